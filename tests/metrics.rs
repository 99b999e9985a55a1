//! Every role of `eps train --metrics` serves Prometheus metrics and a
//! health check: scraped twice while the job trains, the series move.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::cli::{eps, spawn_collected, tmp};

/// GET `path` of `host:port`: (status line, body).
fn get(addr: &str, path: &str) -> (String, String) {
    let mut c = TcpStream::connect(addr).unwrap_or_else(|e| panic!("{addr}: {e}"));
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(c, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut s = String::new();
    c.read_to_string(&mut s).unwrap();
    let (head, body) = s.split_once("\r\n\r\n").unwrap_or_else(|| panic!("{s}"));
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// The value of the series `name{labels}` (labels as written), summed over
/// series whose name and labels start so.
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

#[test]
fn every_role_serves_metrics_that_move_while_the_job_trains() {
    let spec = tmp("metrics", "job").with_extension("toml");
    std::fs::write(
        &spec,
        "[job]\nname = \"m\"\nworkers = 2\nservers = 2\nsteps = 6000\nbatch = 64\nshard_bytes = 65536\n\
         [model]\npreset = \"synthetic\"\nbuckets = 60000\n[optimizer]\nkind = \"adam\"\nlr = 0.01\n",
    )
    .unwrap();
    let (mut child, mut lines) = spawn_collected(
        eps()
            .args(["train", "--metrics", "--spec", spec.to_str().unwrap(), "--progress-every", "100", "--json"])
            .args(["--scale-plan", "400:servers=3"]),
    );
    // Where each role serves (control, 2 servers, 2 workers).
    let mut at: Vec<(String, String)> = Vec::new();
    while at.len() < 5 {
        let l = lines.line("metrics on http://");
        let role = l.split_whitespace().nth(1).unwrap().trim_end_matches(':').to_string();
        let url = l.split("http://").nth(1).unwrap().split('/').next().unwrap().to_string();
        at.push((role, url));
    }
    lines.until("training under way", |l| l.trim_start().starts_with("step ") && l.contains("/6000"));
    let scrape = || -> Vec<String> {
        at.iter()
            .map(|(role, a)| {
                let (status, body) = get(a, "/metrics");
                assert_eq!(status, "HTTP/1.1 200 OK", "{role} {a}");
                body
            })
            .collect()
    };
    let first = scrape();
    dashboard_names_only_existing_metrics(&first);
    std::thread::sleep(Duration::from_millis(1500));
    let second = scrape();
    for (i, (role, a)) in at.iter().enumerate() {
        let (a0, a1) = (&first[i], &second[i]);
        assert!(value(a1, "eps_process_resident_memory_bytes") > 1e6, "{role}: {a1}");
        // Transport figures: memory registered (a worker's buffers, a server's
        // shards), and error completions by kind (none of these in a healthy run).
        if role != "control" {
            assert!(value(a1, "eps_fabric_registered_bytes") > 0.0, "{role}: {a1}");
            assert!(a1.lines().any(|l| l == "eps_fabric_completion_errors_total{kind=\"remote_access\"} 0"), "{role}: {a1}");
        }
        match role.as_str() {
            "worker" => {
                for s in [
                    "eps_worker_pushed_bytes_total{",
                    "eps_worker_pulled_bytes_total{",
                    "eps_worker_pushes_total{",
                    "eps_worker_pulls_total{",
                    "eps_worker_iterations_total{",
                ] {
                    assert!(value(a1, s) > value(a0, s) && value(a0, s) > 0.0, "{role} {s}: {a0}\n---\n{a1}");
                }
                // The latency histogram has counts, in its buckets too.
                let n = value(a1, "eps_worker_push_pull_seconds_count{");
                assert!(n > value(a0, "eps_worker_push_pull_seconds_count{"), "{a1}");
                let inf = a1.lines().find(|l| l.starts_with("eps_worker_push_pull_seconds_bucket{") && l.contains("le=\"+Inf\""));
                assert_eq!(inf.and_then(|l| l.rsplit_once(' ')).map(|(_, v)| v.parse::<f64>().unwrap()), Some(n), "{a1}");
                assert!(value(a1, "eps_worker_push_pull_seconds_sum{") > 0.0);
            }
            "server" => {
                for s in ["eps_server_updates_total{", "eps_server_pulls_total{"] {
                    assert!(value(a1, s) > value(a0, s), "{role} {s}: {a0}\n---\n{a1}");
                }
                assert!(value(a1, "eps_server_shards{") >= 1.0, "{a1}");
                assert!(value(a1, "eps_server_parameter_bytes{") > 0.0, "{a1}");
            }
            "control" => {
                let s = "eps_control_iteration{job=\"m\"}";
                assert!(value(a1, s) > value(a0, s), "{a0}\n---\n{a1}");
                // Two, or three once the scale event came.
                let serving = value(a1, "eps_control_servers{job=\"m\",state=\"serving\"}");
                assert!((2.0..=3.0).contains(&serving), "{a1}");
                assert_eq!(value(a1, "eps_control_workers{job=\"m\"}"), 2.0, "{a1}");
            }
            r => panic!("unexpected role {r} at {a}"),
        }
        let (status, body) = get(a, "/healthz");
        assert_eq!(status, "HTTP/1.1 200 OK", "{role}");
        assert!(body.starts_with(&format!("ok eps {role}")), "{body}");
        assert!(get(a, "/nothing").0.starts_with("HTTP/1.1 404"));
    }
    assert_eq!(at.iter().filter(|(r, _)| r == "worker").count(), 2);
    assert_eq!(at.iter().filter(|(r, _)| r == "server").count(), 2);
    // The third server takes shards: the sources count and time migrations,
    // the control plane counts them done.
    if !lines.text().contains("migrated shard") {
        lines.line("migrated shard");
    }
    let eventually = |addr: &str, what: &dyn Fn(&str) -> bool| {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let body = get(addr, "/metrics").1;
            if what(&body) {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "{addr}: {body}");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let servers: Vec<&str> = at.iter().filter(|(r, _)| r == "server").map(|(_, a)| a.as_str()).collect();
    let control = &at.iter().find(|(r, _)| r == "control").unwrap().1;
    eventually(control, &|b| value(b, "eps_control_migrations_done{job=\"m\"}") >= 1.0);
    // Per server: every migration away counted is timed.
    let sum = |b: &str, name: &str, tag: &str| -> f64 {
        b.lines()
            .filter(|l| l.starts_with(name) && l.contains(tag))
            .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
            .sum()
    };
    let mut out = 0.0;
    for a in &servers {
        let b = get(a, "/metrics").1;
        let n = sum(&b, "eps_server_migrations_total{", "direction=\"out\"");
        assert_eq!(sum(&b, "eps_server_migration_seconds_count{", "phase=\"total\""), n, "{b}");
        out += n;
    }
    assert!(out >= 1.0, "no migration timed on the first servers");
    let status = child.wait().unwrap();
    lines.rest(Duration::from_millis(300));
    assert!(status.success(), "{}", lines.text());
    let _ = std::fs::remove_file(spec);
}

/// An ASP worker reads parameters with pulls of its own (RDMA READs):
/// `eps_worker_pull_seconds` counts them, in its buckets too.
#[test]
fn an_asp_workers_pulls_are_timed() {
    let (mut child, mut lines) = spawn_collected(eps().args([
        "train",
        "--metrics",
        "--consistency",
        "asp",
        "--steps",
        "100000",
        "--workers",
        "1",
        "--servers",
        "1",
    ]));
    let l = lines.line("eps worker: metrics on http://");
    let url = l.split("http://").nth(1).unwrap().split('/').next().unwrap().to_string();
    let count = |b: &str| value(b, "eps_worker_pull_seconds_count{");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let (first, second) = loop {
        let a = get(&url, "/metrics").1;
        std::thread::sleep(Duration::from_millis(500));
        let b = get(&url, "/metrics").1;
        if count(&a) > 0.0 && count(&b) > count(&a) {
            break (a, b);
        }
        assert!(std::time::Instant::now() < deadline, "no timed pulls:\n{b}\n{}", lines.text());
    };
    let inf = second.lines().find(|l| l.starts_with("eps_worker_pull_seconds_bucket{") && l.contains("le=\"+Inf\""));
    assert_eq!(inf.and_then(|l| l.rsplit_once(' ')).map(|(_, v)| v.parse::<f64>().unwrap()), Some(count(&second)));
    assert!(value(&second, "eps_worker_pulls_total{") > value(&first, "eps_worker_pulls_total{"));
    let _ = child.kill();
    let _ = child.wait();
}

/// The Grafana dashboard (examples/grafana/eps.json) parses, and every
/// metric its queries name is one the roles export (`scraped`).
fn dashboard_names_only_existing_metrics(scraped: &[String]) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/grafana/eps.json");
    let d: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).expect("the dashboard parses");
    let exported: std::collections::HashSet<&str> =
        scraped.iter().flat_map(|t| t.lines()).filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next()).collect();
    let mut queries = Vec::new();
    fn walk<'a>(v: &'a serde_json::Value, out: &mut Vec<&'a str>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    match (k.as_str(), x) {
                        ("expr" | "query", serde_json::Value::String(s)) => out.push(s),
                        _ => walk(x, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    walk(&d, &mut queries);
    assert!(queries.len() >= 8, "{queries:?}");
    let mut named = 0;
    for q in &queries {
        for word in q.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| w.starts_with("eps_")) {
            let base = ["_bucket", "_sum", "_count"].iter().find_map(|s| word.strip_suffix(s)).unwrap_or(word);
            assert!(exported.contains(word) || exported.contains(base), "the dashboard names {word}, which no role exports");
            named += 1;
        }
    }
    assert!(named >= 15, "{named}");
}
