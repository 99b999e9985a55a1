//! Checkpoints with real processes: a job killed (SIGKILL of every process)
//! after a checkpoint and resumed, on another number of servers, ends with the
//! uninterrupted run's parameters, bit for bit; so does a job resumed from a
//! checkpoint an operator took with `eps checkpoint` while it trained.

use std::io::{BufRead, BufReader};
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::cli::{eps, json_field, spec_file};

fn tmp(name: &str) -> PathBuf {
    common::cli::tmp("ckpt", name)
}

fn json(out: &Output, key: &str) -> String {
    json_field(&String::from_utf8_lossy(&out.stdout), key)
}

fn train(args: &[&str]) -> Output {
    let o = eps().args(["train", "--json", "--progress-every", "50"]).args(args).output().unwrap();
    assert!(o.status.success(), "eps train {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    o
}

/// The newest complete checkpoint's version in `dir`, if any.
fn newest(dir: &Path) -> Option<u64> {
    let mut best = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(v) = eps_proto::checkpoint::parse_dir_name(&name)
            && e.path().join(eps_proto::checkpoint::MANIFEST).exists()
        {
            best = best.max(Some(v));
        }
    }
    best
}

/// Kills the process group `pid` leads (the run and every process it started).
fn kill_group(pid: u32) {
    let ok = Command::new("kill").args(["-KILL", "--", &format!("-{pid}")]).status().unwrap();
    assert!(ok.success());
}

/// Runs `eps train args` (checkpointing into `dir`) in a process group of
/// its own and SIGKILLs every process of it once `dir` holds a complete
/// checkpoint at iteration 50 or later; returns the newest.
fn kill_after_checkpoint(args: &[&str], dir: &Path) -> u64 {
    kill_after(args, dir, 50)
}

/// [`kill_after_checkpoint`], once the checkpoint is at `min` or later.
fn kill_after(args: &[&str], dir: &Path, min: u64) -> u64 {
    let mut run = eps().arg("train").args(args).stdout(Stdio::null()).stderr(Stdio::null()).process_group(0).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while newest(dir).is_none_or(|v| v < min) {
        assert!(run.try_wait().unwrap().is_none(), "the run ended before its second checkpoint");
        assert!(Instant::now() < deadline, "no checkpoint within 120 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    kill_group(run.id());
    let status = run.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "killed, not finished");
    newest(dir).unwrap()
}

fn resume_after_sigkill_equals_the_uninterrupted_run(dtype: &str) {
    let spec = spec_file("ckpt", dtype);
    let s = spec.to_str().unwrap();
    let whole = train(&["--spec", s, "--dtype", dtype, "--servers", "1"]);
    let expected = json(&whole, "params_checksum");

    let dir = tmp(&format!("{dtype}-dir"));
    let d = dir.to_str().unwrap();
    let at = kill_after_checkpoint(
        &["--spec", s, "--dtype", dtype, "--checkpoint-every", "25", "--checkpoint-dir", d, "--keep", "2"],
        &dir,
    );
    assert!((50..300).contains(&at), "{at}");

    // The same command line with --resume: its --dtype is the checkpoint's.
    let other = if dtype == "f32" { "bf16" } else { "f32" };
    let o = eps().args(["train", "--resume", d, "--dtype", other]).output().unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains(&format!("--dtype {other}: the checkpoint's job has {dtype}")), "{e}");
    // Resumed on three servers (the checkpoint was taken on two).
    let resumed = train(&["--resume", d, "--servers", "3", "--dtype", dtype]);
    let from: u64 = json(&resumed, "resumed_at").parse().unwrap();
    assert!(from >= at, "resumed at {from}, newest checkpoint {at}");
    assert_eq!(json(&resumed, "params_checksum"), expected, "{dtype}: resumed at {from} vs uninterrupted");
    assert_eq!(json(&resumed, "dtype"), dtype);
    // Pruned to the newest two (the killed run may have died before pruning
    // after its last one; the resumed run prunes before it reports each
    // checkpoint complete): no torn or older checkpoint is left.
    let left: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_str().and_then(eps_proto::checkpoint::parse_dir_name).is_some())
        .map(|e| e.path())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(left.iter().all(|d| d.join(eps_proto::checkpoint::MANIFEST).exists()), "{left:?}");
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_file(&spec).ok();
}

#[test]
fn f32_resume_after_sigkill_of_every_process_is_bitwise() {
    resume_after_sigkill_equals_the_uninterrupted_run("f32");
}

#[test]
fn bf16_resume_after_sigkill_of_every_process_is_bitwise() {
    resume_after_sigkill_equals_the_uninterrupted_run("bf16");
}

/// The headers of the pieces of checkpoint `at` in `dir`.
fn piece_headers(dir: &Path, at: u64) -> Vec<eps_proto::checkpoint::PieceHeader> {
    let ck = dir.join(eps_proto::checkpoint::dir_name(at));
    let mut out = Vec::new();
    for e in std::fs::read_dir(&ck).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "bin") {
            let b = std::fs::read(e.path()).unwrap();
            out.push(eps_proto::checkpoint::PieceHeader::decode(&b).unwrap());
        }
    }
    assert!(!out.is_empty(), "{}", ck.display());
    out
}

/// SSP and ASP: a checkpoint is a cut. Each of its pieces holds exactly the
/// contributions of the iterations before it of both workers (2 per
/// iteration), and resumed after SIGKILL of every process on another number
/// of servers, the job's later checkpoints are cuts too: no contribution was
/// lost or applied twice on the way (the workers' clocks would not match).
fn a_cut_resumes_with_every_contribution_once(mode: &str) {
    let spec = spec_file("ckpt", mode);
    let s = spec.to_str().unwrap();
    let dir = tmp(&format!("{mode}-dir"));
    let d = dir.to_str().unwrap();
    let args = ["--spec", s, "--consistency", mode, "--steps", "1200", "--checkpoint-every", "25", "--checkpoint-dir", d];
    let at = kill_after_checkpoint(&args, &dir);
    for h in piece_headers(&dir, at) {
        assert_eq!((h.version, h.updates), (at, 2 * at), "{mode}: a piece of the checkpoint at {at}");
    }
    let resumed = train(&["--resume", d, "--servers", "3"]);
    assert_eq!(json(&resumed, "resumed_at"), at.to_string());
    assert_eq!(json(&resumed, "consistency"), mode);
    let last = newest(&dir).unwrap();
    assert!(last > at + 100, "{mode}: checkpoints after the resume: newest {last}");
    for h in piece_headers(&dir, last) {
        assert_eq!((h.version, h.updates), (last, 2 * last), "{mode}: a piece of the checkpoint at {last}, resumed at {at}");
    }
    let err = String::from_utf8_lossy(&resumed.stderr);
    assert!(!err.contains("not in that checkpoint") && !err.contains("closing its connection"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_file(&spec).ok();
}

#[test]
fn ssp_resume_after_sigkill_of_every_process_applies_every_contribution_once() {
    a_cut_resumes_with_every_contribution_once("ssp");
}

#[test]
fn asp_resume_after_sigkill_of_every_process_applies_every_contribution_once() {
    a_cut_resumes_with_every_contribution_once("asp");
}

#[test]
fn an_operators_checkpoint_resumes_to_the_same_parameters() {
    let spec = spec_file("ckpt", "op");
    let s = spec.to_str().unwrap();
    let expected = json(&train(&["--spec", s]), "params_checksum");

    let mut up = eps()
        .args(["up", "--spec", s])
        .env_remove("EPS_JOB_SECRET")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
    let control = lines.next().unwrap().unwrap().strip_prefix("EPS_CONTROL=").unwrap().to_string();
    let secret_file = lines.next().unwrap().unwrap().strip_prefix("EPS_JOB_SECRET_FILE=").unwrap().to_string();
    let workers: Vec<_> = (0..2)
        .map(|_| {
            eps()
                .args(["worker", "--control", &control, "--progress-every", "1000"])
                .env("EPS_JOB_SECRET_FILE", &secret_file)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let dir = tmp("op-dir");
    let d = dir.to_str().unwrap();
    // No secret: refused before anything is asked.
    let o = eps().args(["checkpoint", "--control", &control, "--dir", d]).env_remove("EPS_JOB_SECRET").output().unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("no job secret"));
    let o =
        eps().args(["checkpoint", "--control", &control, "--dir", d]).env("EPS_JOB_SECRET_FILE", &secret_file).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    let at: u64 = out.split_whitespace().nth(3).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{out}"));
    assert!(out.contains(&dir.join(eps_proto::checkpoint::dir_name(at)).display().to_string()), "{out}");
    for mut w in workers {
        assert!(w.wait().unwrap().success());
    }
    let _ = up.wait();

    let resumed = train(&["--resume", d]);
    assert_eq!(json(&resumed, "resumed_at"), at.to_string());
    assert_eq!(json(&resumed, "params_checksum"), expected, "resumed at {at} vs uninterrupted");

    // The same checkpoint resumed by a job of separate processes (`eps control
    // --resume`, then servers and workers that find it), on three servers.
    let state = tmp("op-state");
    let mut control = eps()
        .args(["control", "--resume", d, "--servers", "3", "--listen", "127.0.0.1:0", "--state-dir"])
        .arg(&state)
        .env("EPS_JOB_SECRET", "resume-test")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let first = BufReader::new(control.stdout.take().unwrap()).lines().next().unwrap().unwrap();
    let addr = first.strip_prefix("EPS_CONTROL_READY addr=").unwrap_or_else(|| panic!("{first}")).to_string();
    let role = |r: &str| {
        eps()
            .args([r, "--control", &addr])
            .env("EPS_JOB_SECRET", "resume-test")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let servers: Vec<_> = (0..3).map(|_| role("server")).collect();
    let workers: Vec<_> = (0..2).map(|_| role("worker")).collect();
    let mut done = String::new();
    for w in workers {
        let o = w.wait_with_output().unwrap();
        assert!(o.status.success());
        done += &String::from_utf8_lossy(&o.stdout);
    }
    for s in servers {
        assert!(s.wait_with_output().unwrap().status.success());
    }
    assert!(control.wait().unwrap().success());
    let reports: Vec<eps::report::Done> = done
        .lines()
        .filter_map(|l| match eps::report::Report::parse(l) {
            Some(eps::report::Report::Done(d)) => Some(*d),
            _ => None,
        })
        .collect();
    let sum = reports.iter().find_map(|d| d.result.as_ref()).unwrap_or_else(|| panic!("{done}")).params_checksum.clone();
    assert_eq!(sum, expected, "eps control --resume at {at}");
    assert!(!reports.is_empty() && reports.iter().all(|d| d.first_step == at), "{done}");
    std::fs::remove_dir_all(&state).ok();
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_file(&spec).ok();
}

#[test]
fn bad_resumes_say_why() {
    let dir = tmp("bad");
    let o = eps().args(["train", "--resume", dir.to_str().unwrap()]).output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("cannot read the checkpoint directory"), "{err}");
    // A directory with only a torn checkpoint (no manifest) holds nothing to resume.
    std::fs::create_dir_all(dir.join(eps_proto::checkpoint::dir_name(40))).unwrap();
    let o = eps().args(["train", "--resume", dir.to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("no complete checkpoint"), "{err}");
    // The control plane of a job of separate processes says the same.
    let o = eps().args(["control", "--resume", dir.to_str().unwrap()]).env("EPS_JOB_SECRET", "s").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("no complete checkpoint"), "{err}");
    let o = eps().args(["control", "--servers", "2"]).output().unwrap();
    assert!(!o.status.success(), "--servers needs --resume");
    // --checkpoint-every needs a directory.
    let o = eps().args(["train", "--checkpoint-every", "5"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--checkpoint-dir"), "{err}");
    // At least one checkpoint is kept.
    let o = eps().args(["train", "--checkpoint-every", "5", "--checkpoint-dir", "/tmp/x", "--keep", "0"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("keep at least 1"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Checkpoints taken while shards split and migrate (pieces of a migration's
/// source and target, which both apply the versions forwarded, and of a split's
/// parent and parts) resume to the same bits.
#[test]
fn checkpoints_taken_during_scale_events_resume_bitwise() {
    let spec = spec_file("ckpt", "scale");
    let s = spec.to_str().unwrap();
    // Four workers: a migration forwards the update of its cutover iteration,
    // so source and target both save that version.
    let short = ["--spec", s, "--steps", "60", "--workers", "4"];
    let expected = json(&train(&short), "params_checksum");
    let dir = tmp("scale-dir");
    // Checkpoints with more pieces written than the manifest lists were taken
    // while a shard had two owners. (Only complete ones have a manifest: the
    // job may end before its last cuts are written or all reported.)
    let pieces = |v: u64| {
        let one = dir.join(eps_proto::checkpoint::dir_name(v));
        let files = std::fs::read_dir(&one).ok()?.flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".bin")).count();
        let listed = std::fs::read_to_string(one.join(eps_proto::checkpoint::MANIFEST)).ok()?.matches("[[pieces]]").count();
        Some((files, listed))
    };
    // Whether a checkpoint falls inside a move depends on timing: a run where
    // none did (a loaded machine) is run again, at most three times.
    let mut overlapping = Vec::new();
    for _ in 0..3 {
        std::fs::remove_dir_all(&dir).ok();
        let d = dir.to_str().unwrap();
        let args = [&short[..], &["--checkpoint-every", "1", "--checkpoint-dir", d, "--keep", "100"]].concat();
        let scaled = train(&[&args[..], &["--scale-plan", "8:servers=3,20:servers=1,32:servers=3,44:servers=1"]].concat());
        assert_eq!(json(&scaled, "params_checksum"), expected, "scale events change nothing");
        assert!(json(&scaled, "migrations").parse::<u64>().unwrap() >= 3);
        assert!(pieces(45).is_some(), "a checkpoint well before the end is complete");
        overlapping = (1..60).filter(|&v| pieces(v).is_some_and(|(files, listed)| files > listed)).collect();
        if !overlapping.is_empty() {
            break;
        }
    }
    assert!(!overlapping.is_empty(), "no checkpoint was taken while a shard had two owners, in three runs");
    for v in overlapping.iter().take(2).copied().chain([5, 20, 45]) {
        let one = dir.join(eps_proto::checkpoint::dir_name(v));
        let resumed = train(&["--resume", one.to_str().unwrap(), "--servers", "2"]);
        assert_eq!(json(&resumed, "resumed_at"), v.to_string());
        assert_eq!(json(&resumed, "params_checksum"), expected, "resumed at {v} (overlapping: {overlapping:?})");
    }
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_file(&spec).ok();
}

/// A click-through job's sparse table, with rows evicted and its buckets
/// moving between servers, is checkpointed incrementally (the newest
/// checkpoint reads rows of earlier ones, and changes over them); killed
/// (SIGKILL of every process) and resumed on another number of servers, it
/// ends with the uninterrupted run's dense parameters and table rows, bit
/// for bit.
#[test]
fn a_ctr_table_resumes_after_sigkill_bitwise_from_incremental_checkpoints() {
    let spec = tmp("ctr-spec").with_extension("toml");
    let text = eps_cluster::jobspec::CTR_SPEC
        .replace("steps = 1500", "steps = 1200")
        .replace("batch = 512", "batch = 128")
        .replace("vocab = 1000", "vocab = 20000")
        .replace("max_keys = 8192", "max_keys = 8192\nevict_idle_steps = 60\nevict_min_touches = 2");
    std::fs::write(&spec, text).unwrap();
    let s = spec.to_str().unwrap();
    let ctr = |args: &[&str]| train(&[&["--model", "ctr", "--spec", s], args].concat());
    let whole = ctr(&["--servers", "2"]);
    let dir = tmp("ctr-dir");
    let d = dir.to_str().unwrap();
    let args =
        ["--model", "ctr", "--spec", s, "--servers", "2", "--checkpoint-every", "40", "--checkpoint-dir", d, "--keep", "2"];
    let at = kill_after(&[&args[..], &["--scale-plan", "100:servers=3,180:servers=1"]].concat(), &dir, 240);
    let manifest = dir.join(eps_proto::checkpoint::dir_name(at)).join(eps_proto::checkpoint::MANIFEST);
    let m = eps_proto::checkpoint::Manifest::from_toml(&std::fs::read_to_string(manifest).unwrap()).unwrap();
    assert!(m.rows.iter().any(|e| e.changes), "changes over earlier files: {:?}", m.rows);
    assert!(m.rows.iter().any(|e| e.earlier().is_some()), "files of earlier checkpoints: {:?}", m.rows);
    let resumed = eps().args(["train", "--json", "--model", "ctr", "--resume", d, "--servers", "3"]).output().unwrap();
    assert!(resumed.status.success(), "{}", String::from_utf8_lossy(&resumed.stderr));
    assert_eq!(json(&resumed, "resumed_at"), at.to_string());
    for k in ["params_checksum", "sparse_checksum"] {
        assert_eq!(json(&resumed, k), json(&whole, k), "{k}: resumed at {at} on 3 servers vs uninterrupted on 2");
    }
    // A rows file damaged on disk is named, not read (the resumed run went
    // on checkpointing: its newest checkpoint).
    let ckpt = dir.join(eps_proto::checkpoint::dir_name(newest(&dir).unwrap()));
    let m =
        eps_proto::checkpoint::Manifest::from_toml(&std::fs::read_to_string(ckpt.join(eps_proto::checkpoint::MANIFEST)).unwrap())
            .unwrap();
    let damaged = ckpt.join(&m.rows.iter().find(|e| e.earlier().is_none()).expect("a file of the newest checkpoint").file);
    let mut bytes = std::fs::read(&damaged).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 1;
    std::fs::write(&damaged, bytes).unwrap();
    let o = eps().args(["train", "--resume", ckpt.to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("the file is damaged"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_file(&spec).ok();
}
