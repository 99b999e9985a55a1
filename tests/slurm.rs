//! EPS through a real Slurm: `ci/slurm-up.sh` starts a small cluster on this
//! machine (two node names when the build allows it), and the jobs run inside
//! allocations of it, every role a job step. Skipped, saying why, only where
//! Slurm cannot start (not root, no packages); the test command starts it.

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::cli::{Lines, eps, json_field, tmp};

/// The cluster's slurm.conf, started if need be; `None` (the test prints
/// that it skipped, and why) where Slurm cannot start here.
fn slurm() -> Option<String> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ci/slurm-up.sh");
    let out = Command::new("bash").arg(&script).output().expect("run ci/slurm-up.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => {}
        Some(3) => {
            eps_etcd::testing::skip("tests/slurm.rs", &format!("Slurm cannot start here: {}", stderr.trim()));
            return None;
        }
        _ => panic!("ci/slurm-up.sh failed ({}): {stderr}", out.status),
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let conf = stdout.lines().find_map(|l| l.strip_prefix("export SLURM_CONF=")).expect("SLURM_CONF");
    Some(conf.to_string())
}

/// A Slurm job of this test process, cancelled when dropped (a test that
/// fails leaves nothing running).
struct Allocation {
    conf: String,
    name: String,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let _ = Command::new("scancel").env("SLURM_CONF", &self.conf).args(["--name", &self.name]).status();
    }
}

/// `salloc` of two nodes running `eps ARGS` (the allocation ends with it),
/// as a job named after `tag` and this process.
fn in_allocation(conf: &str, tag: &str, args: &[&str]) -> (Command, Allocation) {
    let name = format!("eps-test-{}-{tag}", std::process::id());
    let mut c = Command::new("salloc");
    c.env("SLURM_CONF", conf).args(["--nodes=2", "--ntasks=8", "--quiet", "--time=10", "--job-name", &name]);
    c.arg(eps().get_program()).args(args);
    (c, Allocation { conf: conf.to_string(), name })
}

/// A spec of the built-in task, small and quick, with `extra` in [job].
fn spec(tag: &str, workers: u32, steps: u32, extra: &str) -> PathBuf {
    let p = tmp(tag, "job").with_extension("toml");
    let text = format!(
        "[job]\nworkers = {workers}\nservers = 2\nsteps = {steps}\nbatch = 64\nshard_bytes = 65536\n{extra}\n\
         [model]\npreset = \"synthetic\"\nbuckets = 60000\n[optimizer]\nkind = \"adam\"\nlr = 0.01\n"
    );
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn slurm_launcher_with_servers_scaled_ends_with_the_local_launchers_parameters() {
    let Some(conf) = slurm() else { return };
    let p = spec("slurm-scale", 2, 120, "");
    let args = ["train", "--spec", p.to_str().unwrap(), "--scale-plan", "30:servers=3,70:servers=1", "--json"];
    let local = eps().args(args).output().unwrap();
    let local_out = String::from_utf8_lossy(&local.stdout);
    assert!(local.status.success(), "{local_out}\n{}", String::from_utf8_lossy(&local.stderr));
    let (mut s, _job) = in_allocation(&conf, "scale", &args);
    let slurm = s.args(["--launcher", "slurm"]).output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&slurm.stdout), String::from_utf8_lossy(&slurm.stderr));
    assert!(slurm.status.success(), "{out}\n{err}");
    assert_eq!(json_field(&out, "launcher"), "slurm");
    assert_eq!(json_field(&out, "scale_events"), "2");
    assert_eq!(json_field(&out, "params_checksum"), json_field(&local_out, "params_checksum"), "{err}");
    // Every role ran as a step, and said where.
    for role in ["control", "server", "worker"] {
        assert!(err.contains(&format!("eps {role}: Slurm job ")), "{role}: {err}");
    }
    assert_eq!(err.matches("eps server: Slurm job ").count(), 3, "two servers, then a third: {err}");
    let _ = std::fs::remove_file(p);
}

/// The steps of the allocation whose name ends with `suffix`, as `JOB.STEP`.
fn steps_named(conf: &str, suffix: &str) -> Vec<String> {
    let out = Command::new("squeue").env("SLURM_CONF", conf).args(["-s", "-h", "-o", "%i %j"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(_, name)| name.ends_with(suffix))
        .map(|(id, _)| id.to_string())
        .collect()
}

#[test]
fn a_worker_step_cancelled_with_scancel_is_removed_and_the_job_finishes() {
    let Some(conf) = slurm() else { return };
    // A job name of its own: the test finds its steps by name.
    let p = spec("slurm-cancel", 3, 400, "name = \"cancel-test\"\nworker_lease_ms = 2000");
    let args = ["train", "--launcher", "slurm", "--spec", p.to_str().unwrap(), "--progress-every", "10", "--json"];
    let (mut c, _job) = in_allocation(&conf, "cancel", &args);
    let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut lines = Lines::default();
    lines.collect(child.stdout.take().unwrap(), "");
    lines.collect(child.stderr.take().unwrap(), "");
    lines.until("training past step 50", |l| {
        l.trim_start().strip_prefix("step").and_then(|r| r.split('/').next()?.trim().parse::<u32>().ok()).is_some_and(|s| s >= 50)
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let step = loop {
        if let Some(s) = steps_named(&conf, "eps-cancel-test-worker-2").pop() {
            break s;
        }
        assert!(Instant::now() < deadline, "no step of worker 2 in squeue");
        std::thread::sleep(Duration::from_millis(200));
    };
    let st = Command::new("scancel").env("SLURM_CONF", &conf).arg(&step).status().unwrap();
    assert!(st.success(), "scancel {step}");
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline + Duration::from_secs(180), "the job did not finish");
        std::thread::sleep(Duration::from_millis(200));
    };
    lines.rest(Duration::from_millis(500));
    let text = lines.text();
    assert!(status.success(), "{text}");
    let json = text.lines().rfind(|l| l.starts_with('{')).unwrap();
    // Removed at a boundary by its lease: one change, two workers after it
    // (ranks are taken as workers register: step names do not say which).
    assert_eq!(json_field(json, "membership_changes"), "1", "{text}");
    let m = json_field(json, "membership");
    let after = m.strip_prefix("0:0,1,2;").and_then(|r| r.split_once(':')).map(|(_, w)| w.split(',').count());
    assert_eq!(after, Some(2), "{m}");
    assert!(text.contains("worker process 2") && text.contains("the job goes on without it"), "{text}");
    let _ = std::fs::remove_file(p);
}

const TRACE: &str = "\
name,submit_s,param_bytes,compute_ms_per_sample,batch,samples,feedback_samples,kill_after_feedback,min_workers,max_workers,min_servers,max_servers
long-a,0,512000,2,32,60000,6000,0,1,3,1,2
sweep-1,8,512000,2,32,30000,3000,1,1,2,1,1
keep-1,14,512000,2,32,20000,3000,0,1,1,1,2
";

#[test]
fn the_schedulers_live_mode_runs_a_trace_through_slurm() {
    let Some(conf) = slurm() else { return };
    let path = tmp("slurm-sched", "trace").with_extension("csv");
    std::fs::write(&path, TRACE).unwrap();
    let args =
        ["sched", "run", "--launcher", "slurm", "--trace", path.to_str().unwrap(), "--time-scale", "0.2", "--verify", "--json"];
    let (mut c, _job) = in_allocation(&conf, "sched", &args);
    let out = c.output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // The slots are the allocation's CPUs on its two nodes.
    let nodes = stderr.lines().find(|l| l.contains("eps sched: Slurm job")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(nodes.contains("n1:") && nodes.contains("n2:") || nodes.contains("n1:8"), "{nodes}");
    let l = stdout.lines().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("{stdout}"));
    assert_eq!(json_field(l, "jobs"), "3", "{l}");
    assert_eq!(json_field(l, "fidelity_jobs"), "3", "every job ended: {l}");
    assert_eq!(json_field(l, "verify_mismatched"), "0", "{l}");
    assert!(stderr.contains("eps worker: Slurm job "), "the jobs' processes ran as steps: {stderr}");
    // The trace needs more slots than either node has: steps ran on both,
    // where the scheduler placed them.
    for n in ["n1", "n2"] {
        assert!(stderr.contains(&format!("on node {n}:")), "{n}: {stderr}");
    }
    let _ = std::fs::remove_file(path);
}

#[test]
fn an_sbatch_script_from_eps_slurm_script_runs_the_job() {
    let Some(conf) = slurm() else { return };
    let p = spec("slurm-script", 2, 200, "");
    let dir = tmp("slurm-script", "out");
    std::fs::create_dir_all(&dir).unwrap();
    let output = dir.join("job-%j.out");
    let s = eps()
        .args(["slurm", "script", "--spec", p.to_str().unwrap(), "--time", "0:10:00", "--output", output.to_str().unwrap()])
        .args(["--", "--scale-plan", "10:servers=3"])
        .output()
        .unwrap();
    assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stderr));
    let script = dir.join("job.sbatch");
    std::fs::write(&script, &s.stdout).unwrap();
    let st = Command::new("sbatch")
        .env("SLURM_CONF", &conf)
        .args(["--wait", "--quiet", "--chdir", dir.to_str().unwrap(), script.to_str().unwrap()])
        .status()
        .unwrap();
    let outs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "out"))
        .collect();
    let log = outs.iter().map(|p| std::fs::read_to_string(p).unwrap()).collect::<String>();
    assert!(st.success(), "sbatch --wait: {st}\n{log}");
    let json = log.lines().rfind(|l| l.starts_with('{')).unwrap_or_else(|| panic!("{log}"));
    assert_eq!(json_field(json, "launcher"), "slurm");
    assert_eq!(json_field(json, "scale_events"), "1");
    assert_eq!(json_field(json, "steps"), "200");
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_file(p);
}

#[test]
fn the_slurm_launcher_outside_an_allocation_says_how_to_get_one() {
    let out = eps().args(["train", "--launcher", "slurm", "--steps", "5"]).env_remove("SLURM_JOB_ID").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("inside a Slurm allocation") && err.contains("salloc"), "{err}");
    let out = eps().args(["sched", "run", "--launcher", "slurm", "--trace", "x.csv", "--slots", "4"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("drop --slots/--nodes") || err.contains("x.csv"), "{err}");
}
