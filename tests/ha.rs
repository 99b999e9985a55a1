//! Control planes with no single point of failure: a job's state in etcd,
//! three control planes, the leader SIGKILLed while the job trains and
//! while shards migrate; the job ends as it would have without the kills.
//! A leader stopped past its lease is deposed and fenced. Bad input (etcd
//! unreachable, a bad prefix, a second job with the same id) fails at
//! start, clearly. Tests use the etcd of `EPS_TEST_ETCD` (the test command
//! starts one), else start their own, else say that they skipped.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::cli::{Lines, control_ready, eps, json_field, spec_file, tmp};
use eps_etcd::testing::TestEtcd;

fn etcd_or_skip() -> Option<TestEtcd> {
    match TestEtcd::get() {
        Ok(e) => Some(e),
        Err(why) => {
            eps_etcd::testing::skip("tests/ha.rs", &format!("no etcd to test against: {why}"));
            None
        }
    }
}

/// The leader's pid and address, from `eps status --control ADDRS --json`.
fn leader(addrs: &str, secret: &str) -> Option<(u32, String)> {
    let out = eps().args(["status", "--control", addrs, "--json"]).env("EPS_JOB_SECRET", secret).output().ok()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    Some((v["leader"]["pid"].as_u64()? as u32, v["leader"]["addr"].as_str()?.to_string()))
}

fn kill(pid: u32, sig: &str) {
    assert!(std::process::Command::new("kill").args([sig, &pid.to_string()]).status().unwrap().success());
}

/// SIGKILLs the leader; returns how long until another control plane
/// answered as the leader (the failover time).
fn kill_leader(addrs: &str, secret: &str) -> (u32, Duration) {
    let (pid, _) = leader(addrs, secret).expect("a leader");
    kill(pid, "-KILL");
    let t = Instant::now();
    loop {
        if let Some((now, _)) = leader(addrs, secret)
            && now != pid
        {
            return (pid, t.elapsed());
        }
        assert!(t.elapsed() < Duration::from_secs(30), "no control plane took over from pid {pid}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

// (No worker change: when a join takes effect depends on timing, and with it
// the result; `train_cli` checks joins against their contributor sets.)
const PLAN: &str = "150:servers=3";
const STEPS: &str = "400";

/// The reference: the same job, one control plane, its embedded store.
fn reference_checksum() -> String {
    let out = eps()
        .args(["train", "--steps", STEPS, "--scale-plan", PLAN, "--json", "--transport", "soft", "--aggregator", "cpu"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    json_field(&String::from_utf8_lossy(&out.stdout), "params_checksum")
}

#[test]
fn the_leader_killed_while_training_and_while_shards_migrate_changes_nothing() {
    let Some(etcd) = etcd_or_skip() else { return };
    let secret = "ha-test-secret";
    let store = format!("etcd://{}/eps-ha-test-{}", etcd.endpoint, std::process::id());
    let mut train = eps()
        .args(["train", "--steps", STEPS, "--scale-plan", PLAN, "--json", "--transport", "soft", "--aggregator", "cpu"])
        .args(["--progress-every", "2", "--store", &store, "--control-planes", "3"])
        .env("EPS_JOB_SECRET", secret)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(train.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    let addrs = first.trim().strip_prefix("EPS_CONTROL=").unwrap_or_else(|| panic!("first line {first:?}")).to_string();
    assert_eq!(addrs.split(',').count(), 3, "{addrs}");
    let mut lines = Lines::default();
    lines.collect(train.stderr.take().unwrap(), "");
    let step = |l: &str| l.split_whitespace().nth(1).and_then(|s| s.split('/').next()?.parse::<u64>().ok());

    // 1. While it trains. Nothing on the data path waits for the control
    // plane: steps go on while no control plane leads.
    let at = step(&lines.until("step 60", |l| l.starts_with("step") && step(l).is_some_and(|s| s >= 60))).unwrap();
    let (pid, failover) = kill_leader(&addrs, secret);
    println!("failover while training: the leader (pid {pid}) SIGKILLed, another leads after {} ms", failover.as_millis());
    lines.rest(Duration::from_millis(1));
    let during = lines.seen.iter().rev().find_map(|l| step(l).filter(|_| l.starts_with("step"))).unwrap();
    println!("steps {at} -> {during} while the job had no leader");
    assert!(during > at, "training stopped while no control plane led (step {at} -> {during})");
    // 2. While shards migrate onto the third server.
    lines.line("eps server 2: receiving shard");
    let (pid2, failover2) = kill_leader(&addrs, secret);
    println!("failover during a migration: the leader (pid {pid2}) SIGKILLed, another leads after {} ms", failover2.as_millis());

    let rest = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut s).unwrap();
        s
    });
    let st = train.wait().unwrap();
    lines.rest(Duration::from_millis(300));
    let out = rest.join().unwrap();
    assert!(st.success(), "eps train failed:\n{}", lines.text());
    let text = lines.text();
    for want in ["restarting it as a standby", "standing by: job", "3 servers"] {
        assert!(text.contains(want) || out.contains(want) || want == "3 servers", "no {want:?}:\n{text}");
    }
    assert_eq!(text.matches("restarting it as a standby").count(), 2, "{text}");
    // The migration was in flight when the second leader died: its successor
    // replayed it (its snapshot or cutover was reported to the new leader).
    let served: Vec<&str> = text.lines().filter(|l| l.contains("eps control: serving job")).collect();
    println!("{}", served.join("\n"));
    assert!(served.iter().any(|l| !l.contains(" 0 migrations in flight")), "no leader took over a migration:\n{text}");
    assert_eq!(json_field(&out, "params_checksum"), reference_checksum(), "{text}");
    // The job's state is removed from etcd once it is over.
    let t: eps_etcd::store::EtcdTarget = store.parse().unwrap();
    let mut c = t.connect().unwrap();
    let base = t.job_prefix("synthetic");
    assert!(c.range(&base, &eps_etcd::prefix_end(&base), 1).unwrap().0.is_empty(), "state left in etcd");
}

/// Runs `eps control --store` for `spec` with `secret`; returns it and its address.
fn control(spec: &std::path::Path, store: &str, secret: &str) -> (Child, String) {
    let mut c = eps()
        .args(["control", "--listen", "127.0.0.1:0", "--spec", spec.to_str().unwrap(), "--store", store])
        .env("EPS_JOB_SECRET", secret)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = control_ready(&mut c);
    (c, addr)
}

/// A leader stopped for longer than its lease loses it: a standby takes
/// over, and the old leader, woken, finds its writes fenced and steps down.
#[test]
fn a_leader_stopped_past_its_lease_is_deposed_and_steps_down() {
    let Some(etcd) = etcd_or_skip() else { return };
    let spec = spec_file("ha", "deposed");
    let store = format!("etcd://{}/eps-ha-deposed-{}", etcd.endpoint, std::process::id());
    let secret = "deposed-secret";
    let (mut a, addr_a) = control(&spec, &store, secret);
    let mut lines = Lines::default();
    lines.collect(a.stderr.take().unwrap(), "a: ");
    lines.line("a: eps control: serving job");
    let (mut b, addr_b) = control(&spec, &store, secret);
    lines.collect(b.stderr.take().unwrap(), "b: ");
    lines.line("b: eps control: standing by");
    let addrs = format!("{addr_a},{addr_b}");
    assert_eq!(leader(&addrs, secret).unwrap().0, a.id());
    // A standby alone answers that it does not lead, and who does.
    let out = eps().args(["status", "--control", &addr_b]).env("EPS_JOB_SECRET", secret).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("not the leader") && err.contains(&addr_a), "{err}");

    kill(a.id(), "-STOP");
    lines.line("b: eps control: serving job");
    assert_eq!(leader(&addrs, secret).unwrap().0, b.id());
    kill(a.id(), "-CONT");
    // Woken, the old leader finds its lease gone and steps down.
    let t = Instant::now();
    let st = loop {
        if let Some(st) = a.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(15), "the deposed leader did not step down:\n{}", lines.text());
        std::thread::sleep(Duration::from_millis(50));
    };
    lines.rest(Duration::from_millis(200));
    assert!(!st.success(), "{}", lines.text());
    assert!(lines.text().contains("a: eps: error: deposed"), "{}", lines.text());
    assert_eq!(leader(&addrs, secret).unwrap().0, b.id());
    let _ = b.kill();
    let _ = b.wait();
    let t: eps_etcd::store::EtcdTarget = store.parse().unwrap();
    t.connect().unwrap().delete_prefix(t.prefix.as_bytes()).unwrap();
}

/// Errors at start, each within seconds: etcd unreachable, a bad prefix, a
/// second job with the same id, standbys without etcd.
#[test]
fn bad_stores_and_a_second_job_with_the_same_id_fail_at_start() {
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let run = |args: &[&str], secret: &str| {
        let t = Instant::now();
        let out = eps().args(["train", "--steps", "10"]).args(args).env("EPS_JOB_SECRET", secret).output().unwrap();
        assert!(t.elapsed() < Duration::from_secs(15), "{args:?} took {:?}", t.elapsed());
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let e = run(&["--store", &format!("etcd://127.0.0.1:{free}"), "--control-planes", "3"], "s");
    assert!(e.contains(&format!("cannot reach etcd at 127.0.0.1:{free}")), "{e}");
    let e = run(&["--store", "etcd://127.0.0.1:2379/a b"], "s");
    assert!(e.contains("the key prefix") && e.contains("only letters"), "{e}");
    let e = run(&["--store", "127.0.0.1:2379"], "s");
    assert!(e.contains("etcd://HOST:PORT"), "{e}");
    let e = run(&["--control-planes", "3"], "s");
    assert!(e.contains("--store"), "{e}");

    let Some(etcd) = etcd_or_skip() else { return };
    let dir = tmp("ha", "same-id");
    std::fs::create_dir_all(&dir).unwrap();
    let spec = dir.join("job.toml");
    std::fs::write(&spec, common::cli::SMALL_JOB.replace("[job]\n", "[job]\nname = \"synthetic\"\n")).unwrap();
    let store = format!("etcd://{}/eps-ha-same-{}", etcd.endpoint, std::process::id());
    let (mut first, _) = control(&spec, &store, "first-run");
    let e = run(&["--spec", spec.to_str().unwrap(), "--store", &store, "--control-planes", "2"], "second-run");
    assert!(e.contains("job \"synthetic\" already exists") && e.contains("another job secret"), "{e}");
    let _ = first.kill();
    let _ = first.wait();
    let t: eps_etcd::store::EtcdTarget = store.parse().unwrap();
    t.connect().unwrap().delete_prefix(t.prefix.as_bytes()).unwrap();
}
