//! The `eps` command line, run as a user would: help, bad input, and a real
//! two-process fabric benchmark whose JSON line is checked.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn eps(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_eps")).args(args).output().expect("run eps")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn help_explains_commands_and_flags() {
    let o = eps(&["--help"]);
    assert!(o.status.success());
    assert!(text(&o).contains("bench"), "{}", text(&o));
    let o = eps(&["bench", "fabric", "--help"]);
    assert!(o.status.success());
    let t = text(&o);
    for flag in ["--op", "--size", "--iters", "--depth", "--transport", "--json", "round trip"] {
        assert!(t.contains(flag), "help lacks {flag}: {t}");
    }
    assert!(!t.contains("fabric-peer"), "the internal peer command stays hidden");
    let o = eps(&["scale", "--help"]);
    assert!(o.status.success() && text(&o).contains("--workers") && text(&o).contains("job.max_workers"), "{}", text(&o));
}

#[test]
fn bad_input_is_a_clear_error() {
    let o = eps(&["bench", "fabric", "--size", "4XB"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("invalid size"), "{}", text(&o));
    let o = eps(&["bench", "fabric", "--size", "0"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("at least 1 byte"), "{}", text(&o));
    // Counts past their bounds are refused, never wrapped or cut down.
    for (args, want) in [
        (&["bench", "pushpull", "--iters", "18446744073709551615"][..], "not in 1..=1000000000"),
        (&["bench", "agg", "--threads", "5000"][..], "not in 0..=1024"),
        (&["train", "--steps", "18446744073709551615"][..], "job.steps"),
        (
            &["scale", "--control", "127.0.0.1:1", "--servers", "2", "--workers", "100"][..],
            "--workers 100: a job has between 1 and 64",
        ),
    ] {
        let o = eps(args);
        assert!(!o.status.success() && text(&o).contains(want) && !text(&o).contains("panicked"), "{args:?}: {}", text(&o));
    }
    let o = eps(&["bench", "fabric", "--depth", "0"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--depth"), "{}", text(&o));
    let o = eps(&["bench", "fabric", "--transport", "rdma"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--transport soft"), "{}", text(&o));
    let o = eps(&["bench", "fabric", "--transport", "carrier-pigeon"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("auto, soft, shm or rdma"), "{}", text(&o));
    // The roles: an explicit rdma transport without a device (or, as here,
    // without the feature) fails before any process starts, naming the way out;
    // a bad EPS_TRANSPORT or spec value is named.
    let o = eps(&["train", "--transport", "rdma", "--steps", "1"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--transport rdma") && text(&o).contains("--transport soft"), "{}", text(&o));
    assert!(!text(&o).contains("panicked"));
    let o = Command::new(env!("CARGO_BIN_EXE_eps"))
        .args(["train", "--steps", "1"])
        .env("EPS_TRANSPORT", "carrier-pigeon")
        .output()
        .expect("run eps");
    assert!(!o.status.success());
    assert!(text(&o).contains("EPS_TRANSPORT") && text(&o).contains("auto, soft, shm or rdma"), "{}", text(&o));
    let o = eps(&["server", "--control", "127.0.0.1:1", "--transport", "tcp"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("possible values: auto, soft, shm, rdma"), "{}", text(&o));
    // The aggregator: cuda without a GPU (here: without the feature) fails before
    // any process starts, naming the way out; so does the GPU benchmark.
    let o = eps(&["train", "--aggregator", "cuda", "--steps", "1"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--aggregator cpu") && text(&o).contains("--features cuda"), "{}", text(&o));
    let o = eps(&["bench", "gpu"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--features cuda"), "{}", text(&o));
    assert!(!text(&o).contains("panicked"));
    // This test binary's eps is built without the rdma feature: it says how to get it.
    let o = eps(&["rdma", "devices"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--features rdma"), "{}", text(&o));
    assert!(!text(&o).contains("panicked"));
    // The peer refuses to run without the job secret.
    let o = eps(&["bench", "fabric-peer", "--op", "write", "--size", "64", "--depth", "1"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("EPS_JOB_SECRET"), "{}", text(&o));
    assert!(!text(&o).contains("panicked"));
}

fn json_field(line: &str, key: &str) -> f64 {
    let pat = format!("\"{key}\":");
    let at = line.find(&pat).unwrap_or_else(|| panic!("{key} missing in {line}")) + pat.len();
    let rest = &line[at..];
    let end = rest.find([',', '}']).unwrap();
    rest[..end].trim_matches('"').parse().unwrap_or_else(|_| panic!("{key} not a number in {line}"))
}

#[test]
fn fabric_bench_runs_between_two_processes() {
    for (op, size, depth) in [("write", "64KiB", "4"), ("read", "4KiB", "1"), ("send", "1KiB", "2")] {
        let o = eps(&["bench", "fabric", "--op", op, "--size", size, "--iters", "300", "--depth", depth, "--json"]);
        assert!(o.status.success(), "{}", text(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        let last = out.lines().last().expect("a JSON line");
        assert!(last.starts_with('{') && last.contains(&format!("\"op\":\"{op}\"")), "{last}");
        assert_eq!(json_field(last, "iters"), 300.0);
        assert_eq!(json_field(last, "depth"), depth.parse::<f64>().unwrap());
        assert!(json_field(last, "bw_gbytes_per_s") > 0.0);
        let (p50, p99, max) = (json_field(last, "lat_us_p50"), json_field(last, "lat_us_p99"), json_field(last, "lat_us_max"));
        assert!(0.0 < p50 && p50 <= p99 && p99 <= max, "{last}");
    }
}

#[test]
fn agg_and_pushpull_benches_report_their_fields() {
    let o = eps(&["bench", "agg", "--dtype", "bf16", "--workers", "3", "--size", "1MiB", "--reps", "2", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().last().unwrap();
    for k in ["gbytes_per_s", "mem_gbytes_per_s", "ratio"] {
        assert!(json_field(last, k) > 0.0, "{k}: {last}");
    }
    let o = eps(&["bench", "pushpull", "--size", "1MiB", "--iters", "3", "--shard-bytes", "64KiB", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().last().unwrap();
    for k in ["iter_ms_p50", "gbytes_per_s", "fabric_write_gbytes_per_s"] {
        assert!(json_field(last, k) > 0.0, "{k}: {last}");
    }
    assert!(!last.contains("pingpong"), "no latency references at 1 MiB: {last}");
    // Below 1 MiB a round is latency: p99 and the TCP ping-pong references too.
    let o = eps(&["bench", "pushpull", "--size", "64KiB", "--iters", "20", "--shard-bytes", "64KiB", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().last().unwrap();
    for k in ["iter_ms_p99", "pingpong_poll_us_p50", "pingpong_block_us_p50", "round_over_pingpong_poll"] {
        assert!(json_field(last, k) > 0.0, "{k}: {last}");
    }
    assert!(json_field(last, "iter_ms_p99") >= json_field(last, "iter_ms_p50"), "{last}");
    assert!(text(&o).contains("ping-pong on loopback"), "{}", text(&o));
    let o = eps(&["bench", "agg", "--dtype", "f64"]);
    assert!(!o.status.success() && text(&o).contains("f64"));
    // One table in the process: a new row's and a held row's cost, against a
    // copy of the row's bytes.
    let o = eps(&["bench", "sparse", "--table", "--dim", "8", "--keys", "2000", "--iters", "3", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().last().unwrap();
    for k in ["new_row_ns", "held_row_ns", "memcpy_row_ns"] {
        assert!(json_field(last, k) > 0.0, "{k}: {last}");
    }
    assert_eq!(json_field(last, "row_bytes"), 64.0, "dim 8, adagrad: values and accumulators: {last}");
    let o = eps(&["bench", "sparse", "--table", "--optimizer", "lamb"]);
    assert!(!o.status.success() && text(&o).contains("lamb"), "{}", text(&o));
}

#[test]
fn the_replicas_bench_reports_both_and_their_ratio() {
    // A small model: the bench runs four jobs.
    let spec = std::env::temp_dir().join(format!("eps-cli-replicas-{}.toml", std::process::id()));
    let small = "[job]\nworkers = 2\nservers = 2\nsteps = 30\nbatch = 32\nshard_bytes = 65536\n\
                 [model]\npreset = \"synthetic\"\nbuckets = 16384\n";
    std::fs::write(&spec, small).unwrap();
    let o =
        eps(&["bench", "replicas", "--spec", spec.to_str().unwrap(), "--runs", "1", "--steps", "30", "--servers", "2", "--json"]);
    std::fs::remove_file(&spec).ok();
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().last().unwrap();
    for k in ["samples_per_s_replicas_1", "samples_per_s_replicas_2", "ratio", "cpu_s_per_1000_samples_replicas_2", "cpu_ratio"] {
        assert!(json_field(last, k) > 0.0, "{k}: {last}");
    }
    let o = eps(&["bench", "replicas", "--servers", "1"]);
    assert!(!o.status.success() && text(&o).contains("--servers must be 2"), "{}", text(&o));
}

#[test]
fn a_worker_whose_servers_never_come_fails_with_a_message() {
    use std::io::{BufRead, BufReader};
    let dir = std::env::temp_dir().join(format!("eps-cli-noserver-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let spec = dir.join("job.toml");
    std::fs::write(&spec, "[job]\nworkers = 1\nservers = 1\n[model]\npreset = \"synthetic\"\nbuckets = 1024\n").unwrap();
    let mut control = Command::new(env!("CARGO_BIN_EXE_eps"))
        .args([
            "control",
            "--listen",
            "127.0.0.1:0",
            "--spec",
            spec.to_str().unwrap(),
            "--state-dir",
            dir.join("state").to_str().unwrap(),
        ])
        .env("EPS_JOB_SECRET", "cli-test")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(control.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().strip_prefix("EPS_CONTROL_READY addr=").expect("ready line").to_string();
    let o = Command::new(env!("CARGO_BIN_EXE_eps"))
        .args(["worker", "--control", &addr, "--timeout", "1"])
        .env("EPS_JOB_SECRET", "cli-test")
        .output()
        .unwrap();
    let st = Command::new(env!("CARGO_BIN_EXE_eps"))
        .args(["status", "--control", &addr])
        .env("EPS_JOB_SECRET", "cli-test")
        .output()
        .unwrap();
    let scale = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_eps"))
            .args(["scale", "--control", &addr])
            .args(args)
            .env("EPS_JOB_SECRET", "cli-test")
            .output()
            .unwrap()
    };
    let nothing = scale(&[]);
    let early = scale(&["--servers", "2"]);
    let too_many = scale(&["--workers", "2"]);
    let _ = control.kill();
    let _ = control.wait();
    // `eps scale` says what is missing, and what the control plane refuses.
    assert!(!nothing.status.success() && text(&nothing).contains("--servers N and/or --workers N"), "{}", text(&nothing));
    assert!(!early.status.success() && text(&early).contains("still starting"), "{}", text(&early));
    // (A count no change could allow is refused first: it never will be.)
    assert!(!too_many.status.success() && text(&too_many).contains("job.max_workers"), "{}", text(&too_many));
    assert!(!o.status.success());
    assert!(text(&o).contains("did not answer in time"), "{}", text(&o));
    assert!(st.status.success(), "{}", text(&st));
    assert!(text(&st).contains("workers: 1/1 registered") && text(&st).contains("servers: 0/1 registered"), "{}", text(&st));
    // Without the secret, no role starts.
    let o = Command::new(env!("CARGO_BIN_EXE_eps"))
        .args(["worker", "--control", &addr])
        .env_remove("EPS_JOB_SECRET")
        .output()
        .unwrap();
    assert!(!o.status.success() && text(&o).contains("EPS_JOB_SECRET"), "{}", text(&o));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn migrate_bench_pulls_through_migrations_and_plots_them() {
    let png = std::env::temp_dir().join(format!("eps-migrate-{}.png", std::process::id()));
    let png_s = png.to_str().unwrap();
    let o = eps(&[
        "bench",
        "migrate",
        "--shard-bytes",
        "1MiB",
        "--migrations",
        "3",
        "--steady-steps",
        "10",
        "--gap-steps",
        "6",
        "--after-steps",
        "6",
        "--plot",
        png_s,
        "--json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().last().unwrap();
    assert_eq!(json_field(last, "pulls_failed"), 0.0, "{last}");
    assert_eq!(json_field(last, "migrations"), 3.0, "{last}");
    // 10 + 3 x (6 + 40) + 6 steps (each migration is given 40 for itself),
    // 4 timed pulls after each.
    assert_eq!(json_field(last, "pulls"), 616.0, "{last}");
    assert!(json_field(last, "steady_pulls") >= 30.0, "{last}");
    // The snapshot (1 MiB of f32 parameters + the version tail), and a forward
    // when the cutover is the iteration after the snapshot's.
    assert!(json_field(last, "migration_bytes") > 1048576.0, "{last}");
    for k in ["pull_lat_us_p99_steady", "migration_ms", "migration_gbytes_per_s", "fabric_write_gbytes_per_s"] {
        assert!(json_field(last, k) > 0.0, "{k}: {last}");
    }
    let bytes = std::fs::read(&png).expect("the plot was written");
    let _ = std::fs::remove_file(&png);
    assert!(bytes.len() > 10_000 && bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG of a plot");
    let o = eps(&["bench", "migrate", "--shard-bytes", "1000"]);
    assert!(!o.status.success() && text(&o).contains("multiple of 4KiB"), "{}", text(&o));
}

/// `eps up`: its help, and bad input refused before anything starts; a job
/// secret from the environment is used as it is (no secret file is printed),
/// and Ctrl-C (SIGINT) stops the job it started.
#[test]
fn eps_up_explains_refuses_bad_input_and_stops_on_interrupt() {
    let o = eps(&["up", "--help"]);
    let t = text(&o);
    assert!(o.status.success());
    for s in [
        "EPS_CONTROL=HOST:PORT",
        "EPS_JOB_SECRET_FILE",
        "--workers",
        "--max-workers",
        "--optimizer",
        "none",
        "--join-timeout",
        "--init",
    ] {
        assert!(t.contains(s), "help lacks {s}: {t}");
    }
    let o = eps(&["up", "--workers", "0"]);
    assert!(!o.status.success() && text(&o).contains("job.workers"), "{}", text(&o));
    let o = eps(&["up", "--optimizer", "lamb"]);
    assert!(!o.status.success() && text(&o).contains("optimizer.kind"), "{}", text(&o));
    let o = eps(&["up", "--spec", "/nonexistent/job.toml"]);
    assert!(!o.status.success() && text(&o).contains("/nonexistent/job.toml"), "{}", text(&o));
    let o = eps(&["up", "--listen", "not-an-address"]);
    assert!(!o.status.success() && !text(&o).contains("panicked"), "{}", text(&o));
    assert!(!t.contains("cosine"), "the default job has no learning-rate decay: {t}");
    let o = eps(&["up", "--join-timeout", "0"]);
    assert!(!o.status.success() && text(&o).contains("not a number of seconds above 0"), "{}", text(&o));

    use std::io::{BufRead, BufReader};
    let mut up = Command::new(env!("CARGO_BIN_EXE_eps"))
        .args(["up", "--workers", "1", "--servers", "1", "--transport", "soft", "--aggregator", "cpu"])
        .env("EPS_JOB_SECRET", "cli-test-secret")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start eps up");
    let mut out = BufReader::new(up.stdout.take().expect("piped"));
    let mut first = String::new();
    out.read_line(&mut first).expect("a first line");
    assert!(first.starts_with("EPS_CONTROL=127.0.0.1:"), "{first:?}");
    // With the secret from the environment, `eps status` reads it there too.
    let addr = first.trim().trim_start_matches("EPS_CONTROL=").to_string();
    let st = Command::new(env!("CARGO_BIN_EXE_eps"))
        .args(["status", "--control", &addr])
        .env("EPS_JOB_SECRET", "cli-test-secret")
        .output()
        .expect("eps status");
    assert!(st.status.success() && text(&st).contains("awaiting the first worker's declaration"), "{}", text(&st));
    let k = Command::new("kill").args(["-INT", &up.id().to_string()]).status().expect("kill -INT");
    assert!(k.success());
    let status = up.wait().expect("wait eps up");
    assert!(!status.success(), "interrupted: a failure status");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).expect("read the rest");
    assert!(!rest.contains("EPS_JOB_SECRET_FILE"), "no secret file with EPS_JOB_SECRET set: {rest:?}");
}

/// `eps up --join-timeout`: the banner states the wait; past it, with no
/// worker come, `eps up` names the missing ranks, stops the job and fails.
#[test]
fn eps_up_stops_with_a_clear_error_when_its_workers_never_join() {
    let started = Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_eps"))
        .args(["up", "--workers", "2", "--servers", "1", "--transport", "soft", "--aggregator", "cpu", "--join-timeout", "2"])
        .env("EPS_JOB_SECRET", "cli-join-secret")
        .output()
        .expect("run eps up");
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("waiting for 2 workers (for up to 2 s, --join-timeout)"), "{t}");
    assert!(t.contains("2 of the job's 2 workers had not joined (ranks [0, 1])"), "{t}");
    assert!(t.contains("did not all join within --join-timeout 2 s"), "{t}");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
}

/// `eps sim --compare` on the shipped exploration trace: `eps` gives feedback
/// in at most half the time of a static cluster, and completes the jobs that
/// run to completion in at most 0.9 of the time; bad traces are named.
#[test]
fn eps_sim_compares_policies_on_the_shipped_trace() {
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/traces/exploration.csv");
    let o = eps(&["sim", "--trace", trace, "--compare", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let row =
        |p: &str| out.lines().find(|l| l.contains(&format!("\"policy\":\"{p}\""))).unwrap_or_else(|| panic!("{out}")).to_string();
    let (st, ep) = (row("static"), row("eps"));
    assert!(out.contains("\"policy\":\"optimus\""), "{out}");
    assert!(json_field(&ep, "avg_feedback_latency_s") <= 0.5 * json_field(&st, "avg_feedback_latency_s"), "{out}");
    assert!(json_field(&ep, "avg_jct_s") <= 0.9 * json_field(&st, "avg_jct_s"), "{out}");
    assert!(json_field(&ep, "max_queue_wait_s") <= json_field(&st, "max_queue_wait_s"), "{out}");
    // Bad input: a missing file, a bad line (named), an unknown policy.
    let dir = std::env::temp_dir().join(format!("eps-sim-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let png = dir.join("sim.png");
    let o = eps(&["sim", "--trace", trace, "--compare", "--plot", png.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(std::fs::metadata(&png).unwrap().len() > 10_000, "a PNG was drawn");
    let o = eps(&["sim", "--trace", "/nonexistent.csv"]);
    assert!(!o.status.success() && text(&o).contains("/nonexistent.csv"), "{}", text(&o));
    let bad = dir.join("bad.csv");
    std::fs::write(&bad, format!("{}\na,1,100,1,32,10,50,0,1,2,1,1\n", eps_sched::trace::header())).unwrap();
    let o = eps(&["sim", "--trace", bad.to_str().unwrap()]);
    assert!(!o.status.success() && text(&o).contains("line 2, column `feedback_samples`"), "{}", text(&o));
    let o = eps(&["sim", "--trace", trace, "--policy", "lottery"]);
    assert!(!o.status.success() && text(&o).contains("static"), "{}", text(&o));
    // Nodes: the same slots in three nodes, the same decisions (the model has no
    // locality); bad nodes are named; --slots and --nodes exclude each other.
    let o = eps(&["sim", "--trace", trace, "--nodes", "a:16,b:16,c:16", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let on_nodes = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(json_field(&on_nodes, "avg_jct_s"), json_field(&ep, "avg_jct_s"), "{on_nodes}");
    let o = eps(&["sim", "--trace", trace, "--nodes", "a:16,a:8"]);
    assert!(!o.status.success() && text(&o).contains("already used"), "{}", text(&o));
    let o = eps(&["sim", "--trace", trace, "--nodes", "a:16", "--slots", "16"]);
    assert!(!o.status.success() && text(&o).contains("cannot be used with"), "{}", text(&o));
    // Speed noise: the same run for a seed.
    let noisy = |seed: &str| {
        String::from_utf8_lossy(&eps(&["sim", "--trace", trace, "--noise", "0.5", "--seed", seed]).stdout).to_string()
    };
    assert_eq!(noisy("4"), noisy("4"));
    assert_ne!(noisy("4"), noisy("5"));
    let o = eps(&["sim", "generate", "--kind", "steady", "--jobs", "5"]);
    let five = eps_sched::trace::parse(&String::from_utf8_lossy(&o.stdout)).unwrap();
    assert!(o.status.success() && five.len() == 5);
    let o = eps(&["sim", "generate", "--kind", "steady", "--jobs", "5", "--load", "10"]);
    let dense = eps_sched::trace::parse(&String::from_utf8_lossy(&o.stdout)).unwrap();
    assert!((dense[4].submit_s - five[4].submit_s / 10.0).abs() < 0.01, "--load divides the submit times");
    let o = eps(&["sim", "generate", "--kind", "steady", "--load", "0"]);
    assert!(!o.status.success() && text(&o).contains("--load"), "{}", text(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `eps sched calibrate --quick` measures the cluster model with real
/// processes and writes a file `eps sim --cluster` reads.
#[test]
fn calibrate_writes_a_model_the_simulator_reads() {
    let dir = std::env::temp_dir().join(format!("eps-calibrate-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("cluster.toml");
    let o = eps(&["sched", "calibrate", "--quick", "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let t = std::fs::read_to_string(&out).unwrap();
    let m = eps_sched::ClusterModel::from_toml(&t).unwrap();
    assert!(m.server_bytes_per_s > 1e6 && m.agg_elements_per_s > 1e6 && m.migration_bytes_per_s > 1e5, "{t}");
    assert!(m.iteration_overhead_s > 0.0 && m.iteration_overhead_s < 1.0, "{t}");
    // A live job rescaled through servers and workers, up and down, every
    // 1.5 s (shards migrate back to servers that held them before): it must
    // train through every rescale (a failed process fails the command).
    assert!(m.rescale_pause_s >= 0.0 && m.rescale_pause_s < 1.0 && m.start_pause_s < 5.0, "{t}");
    let rescales: u32 = t.split("(of ").nth(1).and_then(|r| r.split(' ').next()?.parse().ok()).unwrap_or(0);
    assert!(rescales >= 3, "{t}");
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/traces/steady.csv");
    let o = eps(&["sim", "--trace", trace, "--cluster", out.to_str().unwrap(), "--json"]);
    assert!(o.status.success() && text(&o).contains("\"policy\":\"eps\""), "{}", text(&o));
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "server_bytes_per_s = 0.0\n").unwrap();
    let o = eps(&["sim", "--trace", trace, "--cluster", bad.to_str().unwrap()]);
    assert!(!o.status.success() && text(&o).contains("server_bytes_per_s"), "{}", text(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `eps sim grid` on the built-in Philly-derived workloads: one line per
/// cell, no baseline beating `eps` where the cluster is contended; `eps sim`
/// reads the Pollux/Philly workload format with the built-in or a given model
/// table, and says what is wrong with one it cannot use.
#[test]
fn eps_sim_grid_and_the_public_trace_format() {
    let o = eps(&["sim", "grid", "--loads", "4", "--slots", "32,64", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let cells: Vec<&str> = out.lines().filter(|l| l.starts_with('{')).collect();
    assert_eq!(cells.len(), 6, "3 workloads x 1 load x 2 sizes: {out}");
    for c in &cells {
        assert!(c.contains("\"pollux_avg_jct_s\"") && c.contains("\"optimus_avg_feedback_latency_s\""), "{c}");
        assert!(c.contains("\"contended\":false") || c.contains("\"eps_beaten_by\":[]"), "{c}");
    }
    let o = eps(&["sim", "grid", "--loads", "0"]);
    assert!(!o.status.success() && text(&o).contains("--loads"), "{}", text(&o));
    let o = eps(&["sim", "grid", "--generated", "lottery:3", "--slots", "48"]);
    assert!(!o.status.success() && text(&o).contains("KIND:SEED"), "{}", text(&o));

    let dir = std::env::temp_dir().join(format!("eps-pollux-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("workload.csv");
    let rows: String =
        (0..40).map(|i| format!("job-{i},{},{},{},{}\n", i * 60, ["cifar10", "ncf", "bert"][i % 3], 1 << (i % 4), 256)).collect();
    std::fs::write(&trace, format!("name,time,application,num_replicas,batch_size\n{rows}")).unwrap();
    let t = trace.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut a = vec!["sim", "--trace", t, "--slots", "16", "--json"];
        a.extend_from_slice(extra);
        eps(&a)
    };
    let o = run(&[]);
    assert!(o.status.success() && text(&o).contains("\"jobs\":40"), "{}", text(&o));
    let sparse = json_field(&String::from_utf8_lossy(&o.stdout), "avg_feedback_latency_s");
    let o = run(&["--load", "8"]);
    let dense = json_field(&String::from_utf8_lossy(&o.stdout), "avg_feedback_latency_s");
    assert!(o.status.success() && dense > sparse, "arrivals 8x as dense wait longer: {dense} vs {sparse}");
    // A model table of its own: ncf made 100x longer makes the jobs later.
    let models = dir.join("models.toml");
    let table = eps_sched::pollux::BUILT_IN.replace("samples = 20000000", "samples = 2000000000");
    std::fs::write(&models, table).unwrap();
    let o = run(&["--models", models.to_str().unwrap()]);
    let longer = json_field(&String::from_utf8_lossy(&o.stdout), "avg_jct_s");
    let o2 = run(&[]);
    assert!(o.status.success() && longer > json_field(&String::from_utf8_lossy(&o2.stdout), "avg_jct_s"), "{}", text(&o));
    std::fs::write(&models, "[ncf]\nparam_bytes = 1\n").unwrap();
    let o = run(&["--models", models.to_str().unwrap()]);
    assert!(!o.status.success() && text(&o).contains("models.toml"), "{}", text(&o));
    std::fs::write(&trace, "name,time,application,num_replicas,batch_size\nx,5,gpt9,2,64\n").unwrap();
    let o = run(&[]);
    assert!(!o.status.success() && text(&o).contains("gpt9") && text(&o).contains("line 2"), "{}", text(&o));
    let csv = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/traces/steady.csv");
    let o = eps(&["sim", "--trace", csv, "--models", models.to_str().unwrap()]);
    assert!(!o.status.success() && text(&o).contains("applies to a trace in the Pollux format"), "{}", text(&o));
    let _ = std::fs::remove_dir_all(&dir);
}
