//! The scheduler's live mode as a user runs it: `eps sched run` replays a small
//! exploration trace with real EPS jobs under `static` and `eps`, and `eps
//! sched serve` takes jobs from `eps submit`. With EPS_BIN (CI sets it to the
//! release build) the timed figures are those of an optimized build; the
//! simulator's fidelity is checked against them only then.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const TRACE: &str = "\
name,submit_s,param_bytes,compute_ms_per_sample,batch,samples,feedback_samples,kill_after_feedback,min_workers,max_workers,min_servers,max_servers
long-a,0,512000,2,32,120000,12000,0,1,4,1,2
long-b,10,4000000,2,32,80000,8000,0,2,2,1,3
sweep-1,20,512000,2,32,60000,6000,1,1,2,1,1
sweep-2,22,512000,2,32,60000,6000,1,1,2,1,1
sweep-3,24,512000,2,32,60000,6000,1,1,2,1,1
keep-1,30,512000,2,32,40000,6000,0,1,1,1,2
";

fn bin() -> String {
    std::env::var("EPS_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_eps").to_string())
}

fn eps(args: &[&str]) -> Output {
    Command::new(bin()).args(args).output().expect("run eps")
}

fn num(line: &str, key: &str) -> f64 {
    let pat = format!("\"{key}\":");
    let at = line.find(&pat).unwrap_or_else(|| panic!("{key} missing in {line}")) + pat.len();
    line[at..].split([',', '}']).next().unwrap().trim().parse().unwrap()
}

#[test]
fn live_runs_of_static_and_eps_end_every_job_as_the_trace_says_and_keep_parameters_exact() {
    let path = std::env::temp_dir().join(format!("eps-live-{}.csv", std::process::id()));
    std::fs::write(&path, TRACE).unwrap();
    let out = eps(&[
        "sched",
        "run",
        "--trace",
        path.to_str().unwrap(),
        "--slots",
        "8",
        "--time-scale",
        "0.2",
        "--policy",
        "static,eps",
        "--verify",
        "--json",
        "--quiet",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    // A job that failed, never ended, or ended with other parameters than a
    // static run makes the command fail, naming it.
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with('{')).collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    let (st, ep) = (lines[0], lines[1]);
    assert!(st.contains("\"policy\":\"static\"") && ep.contains("\"policy\":\"eps\""));
    for l in [st, ep] {
        assert_eq!(num(l, "jobs"), 6.0);
        assert_eq!(num(l, "verify_mismatched"), 0.0, "{l}");
        assert!(num(l, "verified_rescaled") + num(l, "verified_kept") >= 1.0, "{l}");
        assert_eq!(num(l, "fidelity_jobs"), 6.0, "every job ended: {l}");
    }
    assert_eq!(num(st, "rescales"), 0.0);
    assert!(num(ep, "rescales") >= 1.0, "{ep}");
    // The direction the simulator shows: feedback much sooner, no starving.
    let (fs, fe) = (num(st, "avg_feedback_latency_s"), num(ep, "avg_feedback_latency_s"));
    assert!(fe < 0.75 * fs, "eps feedback {fe:.1} s vs static {fs:.1} s");
    assert!(num(ep, "max_queue_wait_s") < num(st, "max_queue_wait_s"));
    let optimized = String::from_utf8_lossy(&eps(&["--version"]).stdout).contains("release");
    for l in [st, ep] {
        let err = num(l, "fidelity_median_rel_err");
        eprintln!("simulator vs live, median per-job error: {:.1}%", err * 100.0);
        if optimized {
            assert!(err <= 0.25, "{l}");
        }
    }
    if !optimized {
        eprintln!("fidelity bound not checked: a debug build of eps (set EPS_BIN to a release build)");
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn live_service_takes_submissions_lists_and_kills_jobs() {
    let dir = std::env::temp_dir().join(format!("eps-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("s.sock");
    let sock_s = sock.to_str().unwrap();
    let mut serve = Command::new(bin())
        .args(["sched", "serve", "--slots", "4", "--socket", sock_s, "--time-scale", "0.1"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The service's log, read as it comes (a full pipe would stall it), shown on failure.
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let mut err = serve.stderr.take().unwrap();
    let l = log.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = std::io::Read::read(&mut err, &mut buf) {
            l.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    let tail = || {
        let g = log.lock().unwrap();
        g.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sock.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let job = |name: &str, samples: u64| {
        let p = dir.join(format!("{name}.toml"));
        std::fs::write(
            &p,
            format!(
                "name = \"{name}\"\nparam_bytes = 256000\ncompute_ms_per_sample = 0.2\nbatch = 32\nsamples = {samples}\n\
                 feedback_samples = 1000\nmin_workers = 1\nmax_workers = 2\nmin_servers = 1\nmax_servers = 1\n"
            ),
        )
        .unwrap();
        p
    };
    let (short, long) = (job("short", 8000), job("long", 10_000_000));
    let ok = |o: Output| {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    assert!(ok(eps(&["submit", short.to_str().unwrap(), "--socket", sock_s])).contains("submitted short"));
    assert!(ok(eps(&["submit", long.to_str().unwrap(), "--socket", sock_s])).contains("submitted long"));
    let again = eps(&["submit", long.to_str().unwrap(), "--socket", sock_s]);
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("submitted already"));
    let state = |name: &str| -> String {
        let t = ok(eps(&["jobs", "--socket", sock_s]));
        t.lines().find(|l| l.starts_with(name)).map(|l| l.split_whitespace().nth(1).unwrap().to_string()).unwrap_or_default()
    };
    let wait_for = |name: &str, want: &str| {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let s = state(name);
            if s == want {
                break;
            }
            let table = || ok(eps(&["jobs", "--socket", sock_s]));
            assert!(
                s != "failed" && Instant::now() < deadline,
                "{name} never {want}: {}\nthe service's log:\n{}",
                table(),
                tail()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    wait_for("long", "running");
    wait_for("short", "finished");
    assert!(ok(eps(&["kill", "long", "--socket", sock_s])).contains("killing long"));
    wait_for("long", "killed");
    let again = eps(&["kill", "long", "--socket", sock_s]);
    assert!(String::from_utf8_lossy(&again.stderr).contains("no queued or running job"));
    // Ctrl-C stops the service, which removes its socket.
    let _ = Command::new("kill").args(["-INT", &serve.id().to_string()]).status();
    let st = serve.wait().unwrap();
    assert!(st.success(), "{st}");
    assert!(!sock.exists());
    let none = eps(&["jobs", "--socket", sock_s]);
    assert!(String::from_utf8_lossy(&none.stderr).contains("no scheduler on"));
    let _ = std::fs::remove_dir_all(&dir);
}
