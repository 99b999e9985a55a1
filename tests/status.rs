//! `eps status` shows health at a glance: a job of separate processes
//! (control plane, 2 servers, 2 workers) is healthy while it trains, names
//! its leader, and a worker stopped (SIGSTOP) shows as lagging until it
//! wakes.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::cli::{control_ready, eps, tmp};

/// The processes of the test's job, killed when dropped.
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = Command::new("kill").args(["-CONT", &c.id().to_string()]).status();
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

const SECRET: &str = "status-test-secret";

fn status_json(addr: &str) -> serde_json::Value {
    let out = eps().args(["status", "--control", addr, "--json"]).env("EPS_JOB_SECRET", SECRET).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn status_shows_health_the_leader_and_a_stopped_worker_lagging() {
    let dir = tmp("status", "job");
    std::fs::create_dir_all(&dir).unwrap();
    let spec = dir.join("job.toml");
    std::fs::write(
        &spec,
        "[job]\nname = \"st\"\nworkers = 2\nservers = 2\nsteps = 1000000\nbatch = 32\nshard_bytes = 65536\n\
         worker_lease_ms = 4000\n[model]\npreset = \"synthetic\"\nbuckets = 20000\n",
    )
    .unwrap();
    let mut procs = Procs(Vec::new());
    let mut control = eps()
        .args(["control", "--listen", "127.0.0.1:0", "--spec", spec.to_str().unwrap()])
        .args(["--state-dir", dir.join("state").to_str().unwrap()])
        .env("EPS_JOB_SECRET", SECRET)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = control_ready(&mut control);
    let control_pid = control.id();
    procs.0.push(control);
    for role in ["server", "server", "worker", "worker"] {
        let c = eps()
            .args([role, "--control", &addr, "--transport", "soft"])
            .env("EPS_JOB_SECRET", SECRET)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        procs.0.push(c);
    }
    // Training, for long enough to have a rate.
    let deadline = Instant::now() + Duration::from_secs(60);
    let j = loop {
        let j = status_json(&addr);
        if j["iteration"].as_u64().unwrap_or(0) > 20 && j["iterations_per_s"].as_f64().is_some_and(|r| r > 0.0) {
            break j;
        }
        assert!(Instant::now() < deadline, "not training: {j}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(j["healthy"], true, "{j}");
    assert_eq!(j["job"], "st");
    assert_eq!(j["leader"]["pid"].as_u64(), Some(u64::from(control_pid)), "{j}");
    assert_eq!(j["leader"]["addr"].as_str(), Some(addr.as_str()), "{j}");
    let workers = j["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 2);
    assert!(workers.iter().all(|w| w["state"] == "contributing" && w["health"] == "up"), "{j}");
    let servers = j["servers"].as_array().unwrap();
    assert!(servers.len() == 2 && servers.iter().all(|s| s["state"] == "serving" && s["health"] == "up"), "{j}");
    let text = eps().args(["status", "--control", &addr]).env("EPS_JOB_SECRET", SECRET).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.starts_with("health: ok ("), "{text}");

    // A stopped worker renews no lease: past half of it, it lags.
    let worker = procs.0[3].id().to_string();
    assert!(Command::new("kill").args(["-STOP", &worker]).status().unwrap().success());
    std::thread::sleep(Duration::from_millis(3000));
    let j = status_json(&addr);
    assert_eq!(j["healthy"], false, "{j}");
    let lagging: Vec<&serde_json::Value> = j["workers"].as_array().unwrap().iter().filter(|w| w["health"] == "lagging").collect();
    assert_eq!(lagging.len(), 1, "{j}");
    assert!(lagging[0]["lease_age_ms"].as_u64().unwrap() > 2000, "{j}");
    let problems = j["problems"].as_array().unwrap();
    assert!(problems.iter().any(|p| p.as_str().unwrap().contains("lagging")), "{j}");
    let text = eps().args(["status", "--control", &addr]).env("EPS_JOB_SECRET", SECRET).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.starts_with("health: worker ") && text.contains("lagging"), "{text}");
    assert!(Command::new("kill").args(["-CONT", &worker]).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(20);
    while status_json(&addr)["healthy"] != true {
        assert!(Instant::now() < deadline, "not healthy again");
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(procs);
    let _ = std::fs::remove_dir_all(dir);
}
