//! Faults injected into `eps train` runs (real processes on 127.0.0.1): a
//! control plane killed mid-run is restarted from its store and the job ends
//! with the uninterrupted run's parameters; a server killed mid-run rolls the
//! job back to its newest checkpoint, and it still ends with them; without
//! checkpoints the run stops at once, naming the shards lost; a worker killed
//! at any point (mid-push, mid-pull, during a migration) is removed when its
//! lease runs out and the others finish the job. Stopped processes (SIGSTOP)
//! keep their connections open: a stopped server with replicas is lost when
//! its lease lapses and fenced off when woken; a stopped worker is removed and,
//! woken, says so and leaves.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

mod common;

use common::run::{Run, kill, kill_together};

use common::cli::{SMALL_JOB, eps, json_field as json, spec_file};

fn tmp(name: &str) -> PathBuf {
    common::cli::tmp("faults", name)
}

/// The parameters' checksum an uninterrupted `eps train` with `args` ends with.
fn uninterrupted(args: &[&str]) -> String {
    let o: Output = eps().args(["train", "--json"]).args(args).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    json(&String::from_utf8_lossy(&o.stdout), "params_checksum")
}

#[test]
fn a_control_plane_killed_mid_run_is_restarted_and_the_job_ends_bitwise() {
    let spec = spec_file("faults", "control");
    let s = spec.to_str().unwrap();
    let expected = uninterrupted(&["--spec", s]);
    let mut run = Run::start(&["--spec", s]);
    run.wait_step(40);
    kill(run.role_pid("control"));
    let (ok, out, err) = run.finish();
    assert!(ok, "{err}");
    assert!(err.contains("restarting it from its store"), "{err}");
    assert_eq!(json(&out, "params_checksum"), expected);
    std::fs::remove_file(&spec).ok();
}

#[test]
fn a_server_killed_mid_run_rolls_back_to_the_newest_checkpoint_bitwise() {
    let spec = spec_file("faults", "server");
    let s = spec.to_str().unwrap();
    let expected = uninterrupted(&["--spec", s]);
    let dir = tmp("server-dir");
    let mut run = Run::start(&["--spec", s, "--checkpoint-every", "20", "--checkpoint-dir", dir.to_str().unwrap()]);
    run.wait_step(70);
    kill(run.role_pid("server"));
    let (ok, out, err) = run.finish();
    assert!(ok, "{err}");
    assert!(err.contains("its shards are lost") && err.contains("rolling back from iteration"), "{err}");
    assert_eq!(json(&out, "rollbacks"), "1");
    let lost: u64 = json(&out, "iterations_lost").parse().unwrap();
    assert!(lost < 100, "{lost} iterations lost with a checkpoint every 20");
    assert!(err.contains("on 1 server ("), "the job goes on on the server left: {err}");
    assert_eq!(json(&out, "params_checksum"), expected);
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_file(&spec).ok();
}

#[test]
fn a_server_killed_without_checkpoints_stops_the_run_naming_its_shards() {
    let spec = spec_file("faults", "lost");
    let mut run = Run::start(&["--spec", spec.to_str().unwrap()]);
    run.wait_step(20);
    let killed = Instant::now();
    kill(run.role_pid("server"));
    let (ok, _, err) = run.finish();
    assert!(!ok);
    assert!(killed.elapsed() < Duration::from_secs(30), "took {:?} to stop", killed.elapsed());
    assert!(err.contains("its shards are lost") && err.contains("[shards "), "{err}");
    assert!(err.contains("no checkpoints to roll back to"), "{err}");
    std::fs::remove_file(&spec).ok();
}

/// Three workers, leases of a second.
fn three_workers(name: &str) -> PathBuf {
    let p = tmp(name).with_extension("toml");
    std::fs::write(
        &p,
        // Long enough that a kill after step 51 (and up to 90 ms) lands
        // while it trains: its rounds take well under a millisecond.
        SMALL_JOB.replace("workers = 2", "workers = 3\nworker_lease_ms = 1000").replace("steps = 300", "steps = 1500"),
    )
    .unwrap();
    p
}

/// The run went on without one worker: finished, with its removal in the
/// contributor sets.
fn check_went_on(ok: bool, out: &str, err: &str) {
    assert!(ok, "{err}");
    assert!(err.contains("the job goes on without it"), "{err}");
    let m = eps::train::worker::parse_membership(&json(out, "membership")).unwrap();
    assert_eq!(m.epochs().len(), 2, "one removal: {:?}", m.epochs());
    assert_eq!(m.latest().len(), 2, "{:?}", m.epochs());
    let loss: f64 = json(out, "final_loss").parse().unwrap();
    assert!(loss.is_finite() && loss < 1.0, "loss {loss}");
}

#[test]
fn a_worker_killed_at_random_points_is_removed_and_the_others_finish() {
    let spec = three_workers("worker");
    // Each worker pushes and pulls nearly all the time: a kill at a random
    // moment lands mid-push, mid-pull or between them.
    for (i, step) in [(0usize, 20u64), (1, 37), (2, 51)] {
        let mut run = Run::start(&["--spec", spec.to_str().unwrap()]);
        run.wait_step(step);
        std::thread::sleep(Duration::from_micros(1_000 + 1_733 * step));
        kill(run.role_pids("worker")[i]);
        let (ok, out, err) = run.finish();
        check_went_on(ok, &out, &err);
    }
    std::fs::remove_file(&spec).ok();
}

#[test]
fn a_worker_killed_during_a_migration_is_removed_and_the_others_finish() {
    let spec = three_workers("worker-mig");
    let mut run = Run::start(&["--spec", spec.to_str().unwrap(), "--scale-plan", "30:servers=3"]);
    run.wait_line("scaling servers 2 -> 3");
    kill(run.role_pids("worker")[1]);
    let (ok, out, err) = run.finish();
    check_went_on(ok, &out, &err);
    assert_eq!(json(&out, "scale_events"), "1");
    std::fs::remove_file(&spec).ok();
}

#[test]
fn servers_killed_one_after_another_with_two_replicas_lose_nothing() {
    let spec = spec_file("faults", "replicas");
    let s = spec.to_str().unwrap();
    let args = ["--spec", s, "--servers", "4", "--steps", "900"];
    let expected = uninterrupted(&args);
    let mut run = Run::start(&[&args[..], &["--replicas", "2"]].concat());
    run.wait_step(60);
    kill(*run.role_pids("server").last().unwrap());
    // Its shards' backups take over, and the shards left without a backup get
    // a new one (from a snapshot): a second loss loses nothing either.
    run.wait_line("(a new backup, from version");
    run.wait_step(400);
    kill(run.role_pids("server")[0]);
    let (ok, out, err) = run.finish();
    assert!(ok, "{err}");
    // (Lost as its poll connection dropped, or as its peers reported it.)
    let lost = err.lines().filter(|l| l.starts_with("eps control: server ") && l.contains(" is lost (")).count();
    assert_eq!(lost, 2, "{err}");
    assert!(err.contains("is served here from version"), "{err}");
    assert_eq!(json(&out, "params_checksum"), expected, "{err}");
    std::fs::remove_file(&spec).ok();
}

/// A server whose every data connection is cut (`ss -K`) while it lives on
/// and polls for orders: its peers report it unreachable, the control plane
/// declares it lost, its backups take over, it is fenced off at its next
/// poll, and the run ends with the uninterrupted run's parameters.
#[test]
fn a_live_server_whose_connections_are_cut_is_declared_lost_and_nothing_is_lost() {
    if !eps::soak::faults::can_cut() {
        eps_etcd::testing::skip("tests/faults.rs", "cutting connections needs root and `ss` (iproute2)");
        return;
    }
    let spec = spec_file("faults", "cut");
    let s = spec.to_str().unwrap();
    // TCP connections to cut: the soft transport (on one machine `auto` is shm).
    let args = ["--spec", s, "--servers", "3", "--steps", "400", "--transport", "soft"];
    let expected = uninterrupted(&args);
    let mut run = Run::start(&[&args[..], &["--replicas", "2"]].concat());
    run.wait_step(60);
    let pid = run.server_pid(2);
    let port = listen_port(pid);
    let cut = eps::soak::faults::cut_port(port).unwrap();
    assert!(cut > 0, "no connection to port {port} to cut");
    run.wait_line("cannot reach it); its shards' backups take over");
    let (ok, out, err) = run.finish();
    assert!(ok, "{err}");
    assert!(err.contains("server 2 is lost ("), "{err}");
    assert!(err.contains("server 2 was declared lost and its shards' backups serve them now"), "not fenced off:\n{err}");
    assert_eq!(json(&out, "params_checksum"), expected, "{err}");
    std::fs::remove_file(&spec).ok();
}

/// The fabric port server process `pid` listens on (its only TCP listener).
fn listen_port(pid: u32) -> u16 {
    let o = Command::new("ss").args(["-ltnpH"]).output().unwrap();
    let listing = String::from_utf8_lossy(&o.stdout);
    let line = listing.lines().find(|l| l.contains(&format!("pid={pid},"))).expect("the server's listener");
    line.split_whitespace().nth(3).and_then(|a| a.rsplit(':').next()).unwrap().parse().unwrap()
}

/// A move whose link alone is cut (source to target; both live and poll):
/// the source stops it and tells the control plane, which cancels it (the
/// target drops its copy). Nobody is lost, and the run ends with the
/// uninterrupted run's parameters.
#[test]
fn a_move_whose_link_alone_is_cut_is_cancelled_and_nothing_is_lost() {
    if !eps::soak::faults::can_cut() {
        eps_etcd::testing::skip("tests/faults.rs", "cutting connections needs root and `ss` (iproute2)");
        return;
    }
    let spec = moving_spec("movecut");
    let s = spec.to_str().unwrap();
    // TCP connections to cut: the soft transport (on one machine `auto` is shm).
    let args = ["--spec", s, "--servers", "3", "--steps", "120", "--transport", "soft"];
    let expected = uninterrupted(&args);
    // A move is cut in only if one was still copying when its target was
    // held (its snapshot WRITE in flight): when every move of a run was
    // faster than the hold, the run is let finish and tried again.
    for attempt in 1..=4 {
        let mut run = Run::start(&[&args[..], &["--scale-plan", "30:servers=4"]].concat());
        // "eps server S: migrating shard N (...) to server T from version V"
        let first = run.wait_line("migrating shard");
        let to = field(&first, ") to server ").expect("a move's target");
        // The target held (stopped): its moves not cut over by now stay in
        // flight (a cutover needs it).
        let target = run.server_pid(to);
        signal("-STOP", target);
        std::thread::sleep(Duration::from_millis(200)); // (lines already written)
        // Moves (source, shard) the control plane still has copying while the
        // target is held, whose source has posted the snapshot (its
        // "migrating" line): they cannot cut over until the target runs again
        // (its fabric acknowledges no WRITE while stopped). (The target's own
        // "snapshot landed" line is no guide: its fabric may take the snapshot
        // in before the stop and its event loop print the line after.)
        let status = run.status();
        let text = run.lines.text();
        let started = |&(from, shard): &(u32, u32)| text.contains(&format!("eps server {from}: migrating shard {shard} ("));
        let held: Vec<(u32, u32)> = status
            .lines()
            .filter(|l| l.ends_with(": copying"))
            .filter_map(|l| Some((field(l, ": server ")?, field(l, "shard ")?)))
            .filter(started)
            .collect();
        let Some(&(from, _)) = held.first() else {
            eprintln!("attempt {attempt}: every started move cut over before its target was held; again");
            signal("-CONT", target);
            let (ok, out, err) = run.finish();
            assert!(ok && json(&out, "params_checksum") == expected, "{err}");
            continue;
        };
        // The source's connections to the target cut, then the target woken.
        let source = run.server_pid(from);
        let port = listen_port(target);
        let o = Command::new("ss").args(["-tnpH", "state", "established", &format!("( dport = :{port} )")]).output().unwrap();
        let listing = String::from_utf8_lossy(&o.stdout);
        let mine: Vec<String> = listing
            .lines()
            .filter(|l| l.contains(&format!("pid={source},")))
            .filter_map(|l| l.split_whitespace().nth(2)?.rsplit(':').next().map(str::to_string))
            .collect();
        assert!(!mine.is_empty(), "no connection from server {from} to server {to}:\n{listing}");
        for lp in &mine {
            let filter = format!("( sport = :{lp} and dport = :{port} )");
            assert!(Command::new("ss").args(["-K", "-tnH", "state", "established", &filter]).status().unwrap().success());
        }
        std::thread::sleep(Duration::from_millis(300));
        signal("-CONT", target);
        let (ok, out, err) = run.finish();
        assert!(ok, "{err}");
        assert!(
            err.contains(&format!("server {from} stopped moving shard ")),
            "no move cancelled (held {held:?}; cut server {from}'s {mine:?} to port {port}):\n{status}\n{listing}\n{err}"
        );
        assert!(!err.contains(" is lost ("), "{err}");
        assert_eq!(json(&out, "params_checksum"), expected, "{err}");
        std::fs::remove_file(&spec).ok();
        return;
    }
    panic!("in 4 runs every move cut over before its target was held");
}

/// A spec file of the small job with shards of 1 MiB: a move takes long
/// enough to be killed or cut in.
fn moving_spec(name: &str) -> std::path::PathBuf {
    let spec = tmp(name).with_extension("toml");
    let text = SMALL_JOB.replace("shard_bytes = 65536", "shard_bytes = 1048576").replace("buckets = 16384", "buckets = 1048576");
    std::fs::write(&spec, text).unwrap();
    spec
}

/// The number right after `after` in `line`.
fn field(line: &str, after: &str) -> Option<u32> {
    let rest = &line[line.find(after)? + after.len()..];
    rest[..rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len())].parse().ok()
}

fn signal(sig: &str, pid: u32) {
    assert!(Command::new("kill").args([sig, &pid.to_string()]).status().unwrap().success());
}

/// A server stopped (SIGSTOP), not dead: its connections stay open, so only
/// its lease tells. Once it lapses the backups take over; woken up later, the
/// server is fenced off (it learns it was lost and exits) and nothing it
/// still sends is taken.
#[test]
fn a_stopped_server_with_two_replicas_is_declared_lost_fenced_off_and_loses_nothing() {
    let spec = tmp("stopped").with_extension("toml");
    std::fs::write(&spec, SMALL_JOB.replace("[job]", "[job]\nserver_lease_ms = 2000")).unwrap();
    let s = spec.to_str().unwrap();
    let args = ["--spec", s, "--servers", "3", "--steps", "500"];
    let expected = uninterrupted(&args);
    let mut run = Run::start(&[&args[..], &["--replicas", "2"]].concat());
    run.wait_step(60);
    let stopped = *run.role_pids("server").last().unwrap();
    let since = run.lines.seen.len();
    signal("-STOP", stopped);
    // (The control plane's and the backup's lines come in either order.)
    run.lines.all_of(since, &["has not polled for orders", "is served here from version"]);
    run.wait_step(200);
    signal("-CONT", stopped);
    let (ok, out, err) = run.finish();
    assert!(ok, "{err}");
    assert!(
        err.contains("was declared lost and its shards' backups serve them now"),
        "the woken server was not fenced off:\n{err}"
    );
    assert_eq!(json(&out, "params_checksum"), expected, "{err}");
    std::fs::remove_file(&spec).ok();
}

/// A worker stopped past its lease is removed and the others go on; woken
/// up, it finds itself removed and leaves without disturbing them.
#[test]
fn a_stopped_worker_is_removed_when_its_lease_lapses_and_leaves_when_woken() {
    let spec = tmp("stopped-worker").with_extension("toml");
    std::fs::write(&spec, SMALL_JOB.replace("workers = 2", "workers = 3\nworker_lease_ms = 1000")).unwrap();
    let s = spec.to_str().unwrap();
    let mut run = Run::start(&["--spec", s, "--steps", "1500"]);
    run.wait_step(40);
    let stopped = *run.role_pids("worker").last().unwrap();
    signal("-STOP", stopped);
    run.wait_line("has not renewed its lease");
    run.wait_step(150);
    signal("-CONT", stopped);
    let (ok, out, err) = run.finish();
    assert!(ok, "{err}");
    assert_eq!(json(&out, "steps"), "1500", "{err}");
    // The job's contributor sets show the removal, and the woken worker says so.
    assert_eq!(json(&out, "membership").matches(';').count(), 1, "{out}");
    assert!(err.contains("was removed from the job from iteration"), "{err}");
    std::fs::remove_file(&spec).ok();
}

/// Two of three servers killed at once: some shard lost its owner and its
/// backup together. Without checkpoints the run stops at once, naming them,
/// instead of waiting on shards nobody holds; with them it rolls back (on two
/// servers, still with replicas) and ends with the uninterrupted parameters.
#[test]
fn a_shard_whose_owner_and_backup_die_together_stops_the_run_naming_it() {
    let spec = spec_file("faults", "both");
    let s = spec.to_str().unwrap();
    let mut run = Run::start(&["--spec", s, "--servers", "3", "--steps", "3000", "--replicas", "2"]);
    run.wait_step(40);
    let servers = run.role_pids("server");
    let started = Instant::now();
    kill_together(&[servers[0], servers[1]]);
    let (ok, _, err) = run.finish();
    assert!(!ok, "{err}");
    assert!(err.contains("its shards are lost") && err.contains("their backups were lost too"), "{err}");
    assert!(err.contains("writes no checkpoints to roll back to"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(20), "noticed only after {:?}:\n{err}", started.elapsed());

    let args = ["--spec", s, "--servers", "3", "--steps", "400"];
    let expected = uninterrupted(&args);
    let dir = tmp("both-dir");
    let d = dir.to_str().unwrap();
    let mut run = Run::start(&[&args[..], &["--replicas", "2", "--checkpoint-every", "20", "--checkpoint-dir", d]].concat());
    run.wait_step(70);
    let servers = run.role_pids("server");
    kill_together(&[servers[1], servers[2]]);
    let (ok, out, err) = run.finish();
    assert!(ok, "{err}");
    assert!(err.contains("their backups were lost too") && err.contains("on 2 servers ("), "{err}");
    assert_eq!(json(&out, "rollbacks"), "1", "{err}");
    assert_eq!(json(&out, "params_checksum"), expected, "{err}");
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_file(&spec).ok();
}

/// Servers added and removed in a job with replicas: shards that move keep
/// their backups (or get new ones), and the run ends with the parameters of
/// a static one.
#[test]
fn scale_events_with_two_replicas_end_bitwise_equal_to_a_static_run() {
    let spec = spec_file("faults", "rep-scale");
    let s = spec.to_str().unwrap();
    let args = ["--spec", s, "--servers", "3", "--steps", "150"];
    let expected = uninterrupted(&args);
    // In: backups on the servers that leave go; out: moves to new servers;
    // in again: some shards move to the server holding their backup.
    let plan = ["--replicas", "2", "--scale-plan", "10:servers=2,50:servers=4,100:servers=2"];
    let o: Output = eps().args(["train", "--json"]).args(args).args(plan).output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{err}");
    assert_eq!(json(&out, "scale_events"), "3");
    assert!(err.contains("no longer forwards to a backup") && err.contains("(a new backup, from version"), "{err}");
    assert_eq!(json(&out, "params_checksum"), expected, "{err}");
    std::fs::remove_file(&spec).ok();
}

/// A server killed while a shard moves to an added server, the move's source,
/// its target or the shard's backup, loses nothing:
/// the backup, kept in step by both owners, holds every version served.
#[test]
fn a_server_killed_during_a_migration_with_two_replicas_loses_nothing() {
    let spec = moving_spec("moving");
    let s = spec.to_str().unwrap();
    let args = ["--spec", s, "--servers", "3", "--steps", "120"];
    let expected = uninterrupted(&args);
    // The last holds the move up (its target stopped for a second) so that
    // the backup dies while the move is surely in flight.
    for victim in ["source", "target", "backup", "backup, the target stopped"] {
        let started = Instant::now();
        let mut run = Run::start(&[&args[..], &["--replicas", "2", "--scale-plan", "30:servers=4"]].concat());
        // "eps server S: migrating shard N (...) to server T from version V"
        // (the first that reads whole: lines of several processes may
        // interleave).
        let (from, shard, to) = loop {
            let l = run.wait_line("migrating shard");
            let num = |after: &str| field(&l, after);
            if let (Some(f), Some(n), Some(t)) = (num("eps server "), num(": migrating shard "), num(") to server ")) {
                break (f, n, t);
            }
        };
        let rank = match victim {
            "source" => from,
            "target" => to,
            _ => {
                // (Lines of several processes may interleave: the first
                // that reads whole.)
                let pat = format!(": shard {shard} is replicated on server ");
                run.seen_line(&pat);
                let text = run.lines.text();
                let c = text.lines().filter_map(|l| l.split_once(pat.as_str())?.1.parse::<u32>().ok()).next();
                c.expect("the shard's backup")
            }
        };
        let held = victim.ends_with("stopped").then(|| run.server_pid(to));
        if let Some(t) = held {
            signal("-STOP", t);
        }
        kill(run.server_pid(rank));
        if let Some(t) = held {
            // (Held for a while, well within its lease: the others see the
            // backup's death meanwhile.)
            std::thread::sleep(Duration::from_secs(1));
            signal("-CONT", t);
        }
        let (ok, out, err) = run.finish();
        assert!(ok, "{victim} (server {rank}) killed while shard {shard} moved {from} -> {to}:\n{err}");
        // The target holds nothing once its move is cancelled: if the job
        // ends before its loss is declared, it is counted finished as it is
        // told to retire (and the job still ends).
        let lost = err.contains(&format!("server {rank} is lost"));
        let gone_at_end = victim == "target" && err.contains(&format!("server {rank} was told to retire and is gone"));
        assert!(lost || gone_at_end, "{victim} killed:\n{err}");
        if victim.starts_with("backup") {
            // Source and target live: no move stops (a server that freed a
            // buffer a move still used cut that move's connection).
            assert!(!err.contains("stopped (its connection failed"), "{victim} killed:\n{err}");
        }
        assert_eq!(json(&out, "params_checksum"), expected, "{victim} killed:\n{err}");
        // (Shown with --no-capture: where a slow run spent its time.)
        eprintln!(
            "{victim} (server {rank}) killed while shard {shard} moved {from} -> {to}: the run took {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }
    std::fs::remove_file(&spec).ok();
}
