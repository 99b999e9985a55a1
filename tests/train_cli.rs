//! `eps train` as a user runs it: real processes (control plane, servers, workers)
//! on 127.0.0.1, on a small version of the built-in task.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const SMALL: &str = r#"
[job]
workers = 2
servers = 1
steps = 25
batch = 64
shard_bytes = 65536
[model]
preset = "synthetic"
buckets = 16384
[optimizer]
kind = "adam"
lr = 0.01
"#;

fn spec_file(name: &str, text: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("eps-train-test-{}-{name}.toml", std::process::id()));
    std::fs::write(&p, text).unwrap();
    p
}

fn eps(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_eps")).args(args).output().expect("run eps")
}

fn json_str(out: &Output, key: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default().to_string();
    let pat = format!("\"{key}\":");
    let at = last.find(&pat).unwrap_or_else(|| panic!("{key} missing: {stdout}\n{}", String::from_utf8_lossy(&out.stderr)))
        + pat.len();
    let rest = &last[at..];
    if let Some(text) = rest.strip_prefix('"') {
        return text[..text.find('"').unwrap()].to_string();
    }
    rest[..rest.find([',', '}']).unwrap()].to_string()
}

fn train(spec: &std::path::Path, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--spec", spec.to_str().unwrap(), "--json", "--progress-every", "5"];
    args.extend_from_slice(extra);
    let o = eps(&args);
    assert!(o.status.success(), "eps train {extra:?} failed: {}", String::from_utf8_lossy(&o.stderr));
    o
}

#[test]
fn bsp_result_is_independent_of_server_count_and_reproducible() {
    let spec = spec_file("det", SMALL);
    let one = train(&spec, &["--servers", "1"]);
    // The same run over loopback TCP (soft) and shared memory (shm, the default
    // on one machine) ends with the same bits.
    let three = train(&spec, &["--servers", "3", "--transport", "soft"]);
    let again = train(&spec, &["--servers", "1"]);
    let c1 = json_str(&one, "params_checksum");
    assert_eq!(c1.len(), 32);
    assert_eq!(c1, json_str(&three, "params_checksum"), "1 server on shm vs 3 on soft");
    assert_eq!(json_str(&three, "transport"), "soft");
    assert_eq!(c1, json_str(&again, "params_checksum"), "rerun");
    for key in ["final_loss", "final_accuracy", "teacher_accuracy", "samples_per_s", "push_gbytes_per_s", "pull_gbytes_per_s"] {
        let v: f64 = json_str(&one, key).parse().unwrap();
        assert!(v > 0.0, "{key} = {v}");
    }
    assert_eq!(json_str(&one, "steps"), "25");
    // Every process on this machine: the default `auto` runs on shm and says so.
    assert_eq!(json_str(&one, "transport"), "shm");
    assert_eq!(json_str(&one, "aggregator"), "cpu");
    assert!(String::from_utf8_lossy(&one.stderr).contains("--transport auto: using shm"));
    // A different worker count is a different training run.
    let three_workers = train(&spec, &["--workers", "3"]);
    assert_ne!(c1, json_str(&three_workers, "params_checksum"));
    // 16-bit wire types are deterministic too.
    let b1 = train(&spec, &["--dtype", "bf16", "--servers", "1"]);
    let b2 = train(&spec, &["--dtype", "bf16", "--servers", "2"]);
    assert_eq!(json_str(&b1, "params_checksum"), json_str(&b2, "params_checksum"));
    std::fs::remove_file(spec).ok();
}

/// Servers added and removed while training runs: shards migrate between server
/// processes (snapshot, forwarded updates, cutover) and the result is bitwise the
/// result of a static server set.
#[test]
fn bsp_scale_events_end_bitwise_equal_to_a_static_run() {
    let spec = spec_file("scale", &SMALL.replace("steps = 25", "steps = 120"));
    for extra in [&[][..], &["--dtype", "bf16", "--optimizer", "momentum"][..]] {
        let mut args = extra.to_vec();
        args.extend_from_slice(&["--servers", "1"]);
        let fixed = train(&spec, &args);
        let mut args = extra.to_vec();
        args.extend_from_slice(&["--servers", "2", "--scale-plan", "8:servers=3,45:servers=1,85:servers=2"]);
        let scaled = train(&spec, &args);
        assert_eq!(json_str(&scaled, "scale_events"), "3");
        let migrations: u64 = json_str(&scaled, "migrations").parse().unwrap();
        assert!(migrations >= 3, "{migrations} migrations");
        // Balancing the third server splits shards (5 shards, one of them tiny).
        let splits: u64 = json_str(&scaled, "splits").parse().unwrap();
        assert!(splits >= 1, "{splits} splits");
        assert_eq!(json_str(&fixed, "migrations"), "0");
        assert_eq!(
            json_str(&fixed, "params_checksum"),
            json_str(&scaled, "params_checksum"),
            "{extra:?}: scaled run differs; its log:\n{}",
            String::from_utf8_lossy(&scaled.stderr)
        );
        // The device path (master copies and optimizer state in a device's memory,
        // here host memory standing in for a GPU's, the host copy poisoned while
        // stale): the same bits through splits and migrations.
        args.extend_from_slice(&["--aggregator", "host-device"]);
        let device = train(&spec, &args);
        assert_eq!(json_str(&device, "aggregator"), "host-device");
        assert_eq!(
            json_str(&fixed, "params_checksum"),
            json_str(&device, "params_checksum"),
            "{extra:?}: the device path differs; its log:\n{}",
            String::from_utf8_lossy(&device.stderr)
        );
        // The direct path (landing slots and published copies in the device's own
        // memory, summed from and published into in place: GPUDirect's path).
        *args.last_mut().unwrap() = "host-direct";
        let direct = train(&spec, &args);
        assert_eq!(json_str(&direct, "aggregator"), "host-direct");
        assert!(String::from_utf8_lossy(&direct.stderr).contains("published copies in host memory, used in place"));
        assert_eq!(
            json_str(&fixed, "params_checksum"),
            json_str(&direct, "params_checksum"),
            "{extra:?}: the direct path differs; its log:\n{}",
            String::from_utf8_lossy(&direct.stderr)
        );
    }
    // Plans are checked before anything starts.
    let capped = spec_file("capped", &SMALL.replace("[job]", "[job]\nmax_workers = 3"));
    let o = eps(&["train", "--spec", capped.to_str().unwrap(), "--scale-plan", "5:workers=3,9:workers=1,12:workers=2"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("needs 4 worker ranks"), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::remove_file(capped).ok();
    let o = eps(&["train", "--spec", spec.to_str().unwrap(), "--consistency", "ssp", "--scale-plan", "5:workers=3"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("needs a BSP job"));
    // An event at the last step or later would find the job over.
    let o = eps(&["train", "--spec", spec.to_str().unwrap(), "--steps", "40", "--scale-plan", "5:servers=3,40:servers=1"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("the event at step 40 comes when the job's 40 steps are done"), "{err}");
    std::fs::remove_file(spec).ok();
}

/// SSP and ASP jobs add and remove servers while training runs: every shard
/// moves through a redirect window (its source relays the contributions it
/// still takes), and every contribution is applied exactly once across the
/// servers (workers x steps x shards updates in all).
#[test]
fn ssp_and_asp_scale_events_apply_every_contribution_once() {
    let spec = spec_file("async-scale", &SMALL.replace("steps = 25", "steps = 160"));
    for (mode, agg) in [("ssp", "cpu"), ("asp", "cpu"), ("asp", "host-device"), ("ssp", "host-direct")] {
        // With the CPU aggregator, checkpoints too: shards hold contributions
        // back at each cut while they migrate.
        let ck = common::cli::tmp("async-scale", &format!("{mode}-{agg}-ck"));
        let mut args = vec!["--consistency", mode, "--scale-plan", "8:servers=2,30:servers=3,55:servers=1", "--aggregator", agg];
        if agg == "cpu" {
            args.extend(["--checkpoint-every", "6", "--keep", "100", "--checkpoint-dir", ck.to_str().unwrap()]);
        }
        let o = train(&spec, &args);
        let log = String::from_utf8_lossy(&o.stderr);
        if agg == "cpu" {
            // Every checkpoint completed is a cut: each piece holds both
            // workers' contributions of the iterations before it, no other.
            let mut complete = 0;
            for e in std::fs::read_dir(&ck).unwrap().flatten() {
                let Some(t) = eps_proto::checkpoint::parse_dir_name(&e.file_name().to_string_lossy()) else { continue };
                if !e.path().join(eps_proto::checkpoint::MANIFEST).exists() {
                    continue;
                }
                complete += 1;
                for p in
                    std::fs::read_dir(e.path()).unwrap().flatten().filter(|p| p.path().extension().is_some_and(|x| x == "bin"))
                {
                    let h = eps_proto::checkpoint::PieceHeader::decode(&std::fs::read(p.path()).unwrap()).unwrap();
                    assert_eq!((h.version, h.updates), (t, 2 * t), "{mode}: {}", p.path().display());
                }
            }
            assert!(complete >= 10, "{mode}: {complete} checkpoints complete of 26; log:\n{log}");
            std::fs::remove_dir_all(&ck).ok();
        }
        assert_eq!(json_str(&o, "scale_events"), "3", "{mode}");
        let migrations: u64 = json_str(&o, "migrations").parse().unwrap();
        assert!(migrations >= 3, "{mode}: {migrations} migrations");
        assert!(log.contains("relaying contributions"), "{mode}: no redirect window in the log:\n{log}");
        // Each server's summary says "N updates applied" (the servers write to the
        // same stderr, so two summaries may share a line).
        let updates: u64 = log
            .match_indices(" updates applied")
            .map(|(i, _)| log[..i].rsplit(|c: char| !c.is_ascii_digit()).next().unwrap().parse::<u64>().unwrap())
            .sum();
        // 2 workers x 160 steps x 5 shards.
        assert_eq!(updates, 2 * 160 * 5, "{mode}: contributions lost or applied twice; log:\n{log}");
        let loss: f64 = json_str(&o, "final_loss").parse().unwrap();
        assert!(loss.is_finite() && loss < 0.69, "{mode}: loss {loss}");
    }
    std::fs::remove_file(spec).ok();
}

/// Workers join and leave while training runs (and a server is added in
/// between): each worker process trains on the samples its iteration's contributor
/// set deals it, and the result is bitwise the single-process reference computed
/// with the contributor sets the run reports.
#[test]
fn bsp_worker_changes_equal_the_reference_with_the_same_contributor_sets() {
    use eps::train::task::{Sample, Task};
    for (dtype, opt) in [("f32", "adam"), ("bf16", "momentum")] {
        // Room after the last event: a change takes effect some iterations
        // after it is asked, many at a fast step rate.
        let text = SMALL
            .replace("steps = 25", "steps = 120")
            .replace("kind = \"adam\"", &format!("kind = \"{opt}\""))
            .replace("[job]", &format!("[job]\ndtype = \"{dtype}\""));
        let spec = spec_file(&format!("workers-{dtype}"), &text);
        let o = train(&spec, &["--scale-plan", "10:workers=3,22:servers=2,32:workers=2,42:workers=3"]);
        assert_eq!(json_str(&o, "scale_events"), "4");
        assert_eq!(json_str(&o, "membership_changes"), "3");
        let m = eps::train::worker::parse_membership(&json_str(&o, "membership")).expect("membership in the JSON line");
        let sets: Vec<&[u32]> = m.epochs().iter().map(|(_, s)| &s[..]).collect();
        assert_eq!(sets, [&[0, 1][..], &[0, 1, 2], &[0, 1], &[0, 1, 3]], "{:?}", m.epochs());
        // The single-process reference: the task's gradient over the samples each
        // contributor is dealt, in rank order.
        let (js, text) = eps::jobspec::parse(&text).unwrap();
        let task = Task::new(&eps::jobspec::TaskSection::of(&js).unwrap().unwrap(), js.job.seed);
        let batch = js.job.batch as u64;
        let (mut sample, mut z) = (Sample::default(), vec![0f32; task.classes]);
        let want = common::reference_with(&text, &m, &mut |p, r, t, g| {
            g.fill(0.0);
            for i in m.samples(t, r, batch).unwrap() {
                task.sample(i, &mut sample);
                task.backward(p, &sample, 1.0 / batch as f32, g, &mut z);
            }
        });
        assert_eq!(
            json_str(&o, "params_checksum"),
            eps::train::worker::checksum(&want),
            "{dtype} {opt}: differs from the reference for {:?}; log:\n{}",
            m.epochs(),
            String::from_utf8_lossy(&o.stderr)
        );
        std::fs::remove_file(spec).ok();
    }
}

#[test]
fn other_modes_and_optimizers_run() {
    let spec = spec_file("modes", SMALL);
    for extra in [
        &["--consistency", "ssp"][..],
        &["--consistency", "asp"],
        &["--optimizer", "nesterov", "--lr", "0.1"],
        &["--dtype", "f16"],
    ] {
        let o = train(&spec, extra);
        let acc: f64 = json_str(&o, "final_accuracy").parse().unwrap();
        assert!(acc > 0.3, "{extra:?}: accuracy {acc}");
    }
    std::fs::remove_file(spec).ok();
}

#[test]
fn bad_specs_name_the_field_and_exit_nonzero() {
    let cases = [
        ("[job]\nworkers = 0\n[model]\npreset = \"synthetic\"\n", "job.workers"),
        ("[job]\nwrkers = 2\n[model]\npreset = \"synthetic\"\n", "wrkers"),
        ("[job]\n[model]\npreset = \"synthetic\"\n[optimizer]\nkind = \"rmsprop\"\n", "optimizer.kind"),
        ("[job]\n[model]\ntensors = [{ name = \"w\", elements = 10 }]\n", "model.preset"),
    ];
    for (i, (text, field)) in cases.iter().enumerate() {
        let spec = spec_file(&format!("bad{i}"), text);
        let o = eps(&["train", "--spec", spec.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(field), "{text:?}: {err}");
        assert!(!err.contains("panicked"));
        std::fs::remove_file(spec).ok();
    }
    let o = eps(&["train", "--consistency", "eventual"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("consistency"));
    let o = eps(&["train", "--spec", "/nonexistent/job.toml"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("/nonexistent/job.toml"));
}

/// Pids whose parent is `pid`.
fn children_of(pid: u32) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
        // The field after the parenthesised command name: state, then ppid.
        let Some(rest) = stat.rsplit(')').next() else { continue };
        let ppid: u32 = rest.split_whitespace().nth(1).and_then(|x| x.parse().ok()).unwrap_or(0);
        if ppid == pid {
            let cmd = std::fs::read_to_string(format!("/proc/{p}/cmdline")).unwrap_or_default().replace('\0', " ");
            out.push((p, cmd));
        }
    }
    out
}

/// A long `eps train` under way (its secret generated), its processes, and
/// the line that says how to reach it.
fn start_long_run(name: &str) -> (Child, Vec<(u32, String)>, String) {
    let spec = spec_file(name, &SMALL.replace("steps = 25", "steps = 100000"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_eps"))
        .args(["train", "--spec", spec.to_str().unwrap(), "--progress-every", "5"])
        .env_remove("EPS_JOB_SECRET")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let mut lines = BufReader::new(err).lines();
    // Wait for training to be under way.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut reach = String::new();
    loop {
        let l = lines.next().expect("eps train ended early").unwrap();
        if l.contains("reach it with") {
            reach = l;
        } else if l.starts_with("step") {
            break;
        }
        assert!(Instant::now() < deadline);
    }
    std::thread::spawn(move || for _ in lines {});
    let kids = children_of(child.id());
    assert_eq!(kids.len(), 1 + 1 + 2, "control + server + 2 workers: {kids:?}");
    (child, kids, reach)
}

fn wait_gone(pids: &[(u32, String)]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    for (p, cmd) in pids {
        while std::path::Path::new(&format!("/proc/{p}/stat")).exists()
            && !std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default().contains(") Z")
        {
            assert!(Instant::now() < deadline, "process {p} ({cmd}) still running");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn ctrl_c_stops_every_process() {
    let (mut train, kids, reach) = start_long_run("int");
    // The generated secret is in a file it names: `eps status` reaches the job.
    let var = |k: &str| reach.split(&format!("{k}=")).nth(1).and_then(|v| v.split_whitespace().next()).map(str::to_string);
    let (control, file) = (var("EPS_CONTROL").expect(&reach), var("EPS_JOB_SECRET_FILE").expect(&reach));
    let st = Command::new(env!("CARGO_BIN_EXE_eps"))
        .arg("status")
        .env("EPS_CONTROL", &control)
        .env("EPS_JOB_SECRET_FILE", &file)
        .env_remove("EPS_JOB_SECRET")
        .output()
        .unwrap();
    assert!(st.status.success() && String::from_utf8_lossy(&st.stdout).starts_with("health: "), "{st:?}");
    Command::new("kill").args(["-INT", &train.id().to_string()]).status().unwrap();
    let st = train.wait().unwrap();
    assert!(!st.success());
    wait_gone(&kids);
}
