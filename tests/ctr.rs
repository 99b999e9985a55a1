//! `eps train --model ctr` as a user runs it: real processes (control plane,
//! servers, workers) on 127.0.0.1 training a click-through model whose
//! embedding bags live in a sparse table and whose MLP is dense.

mod common;

use common::cli::{eps, json_field};

fn train(args: &[&str]) -> std::process::Output {
    let mut all = vec!["train", "--model", "ctr", "--json", "--progress-every", "500"];
    all.extend_from_slice(args);
    eps().args(&all).output().expect("run eps")
}

fn ok(o: &std::process::Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "eps train failed: {}\n{out}", String::from_utf8_lossy(&o.stderr));
    out
}

/// The built-in click-through job reaches the teacher's AUC (within 0.01),
/// and BSP gives the same dense parameters and the same table rows, bit for
/// bit, on one server as on two, and when servers are added and removed
/// while it trains (the buckets and their rows move: three moves).
#[test]
fn ctr_reaches_the_teachers_auc_and_bsp_does_not_depend_on_the_servers() {
    let two = ok(&train(&["--servers", "2"]));
    let (auc, teacher): (f64, f64) =
        (json_field(&two, "final_auc").parse().unwrap(), json_field(&two, "teacher_auc").parse().unwrap());
    assert!(teacher > 0.75 && teacher - auc < 0.01, "held-out AUC {auc} against the teacher's {teacher}");
    let one = ok(&train(&["--servers", "1"]));
    let scaled = ok(&train(&["--servers", "2", "--scale-plan", "300:servers=3,700:servers=1,1100:servers=2"]));
    assert_eq!(json_field(&scaled, "bucket_moves"), "3", "{scaled}");
    for k in ["params_checksum", "sparse_checksum", "final_auc"] {
        assert_eq!(json_field(&one, k), json_field(&two, k), "{k}: one server against two");
        assert_eq!(json_field(&scaled, k), json_field(&two, k), "{k}: scaled against two servers");
    }
}

/// Lazy Adam's per-row step counts move with their rows: a small job with
/// an Adam table ends the same, bit for bit, scaled 2 -> 3 -> 1 servers as
/// on 2.
#[test]
fn adam_rows_keep_their_step_counts_across_bucket_moves() {
    let spec = common::cli::tmp("ctr", "adam").with_extension("toml");
    // Long enough that both bucket moves happen while it trains (its rounds
    // take well under a millisecond).
    std::fs::write(&spec, SMALL_CTR.replace("steps = 40", "steps = 600")).unwrap();
    let path = spec.to_str().unwrap();
    let plain = ok(&train(&["--spec", path]));
    let scaled = ok(&train(&["--spec", path, "--scale-plan", "30:servers=3,70:servers=1"]));
    assert_eq!(json_field(&scaled, "bucket_moves"), "2", "{scaled}");
    for k in ["params_checksum", "sparse_checksum"] {
        assert_eq!(json_field(&scaled, k), json_field(&plain, k), "{k}: scaled against not");
    }
}

/// What the ctr job refuses, it says plainly.
#[test]
fn ctr_refusals_are_clear() {
    let bad_dim = common::cli::tmp("ctr", "dim").with_extension("toml");
    let spec = SMALL_CTR.replace("\"ctr.ids\"\ndim = 8", "\"ctr.ids\"\ndim = 4");
    std::fs::write(&bad_dim, spec).unwrap();
    let cases: [(Vec<&str>, &str); 2] = [
        (vec!["--spec", bad_dim.to_str().unwrap()], "table \"ctr.ids\" has dim 4; model.embed_dim is 8"),
        (vec!["--replicas", "2", "--consistency", "ssp"], "2 replicas need BSP consistency"),
    ];
    for (args, want) in cases {
        let o = train(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{args:?}: {err}");
    }
    let o = eps().args(["train", "--model", "wide"]).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("the built-in models are synthetic and ctr"));
}

/// With `--replicas 2` every server's table rows are kept in step on
/// another: each forward carries a digest of every row its owner holds and
/// the backup checks its copy against it (`EPS_VERIFY_BACKUPS`), also while
/// buckets move and backups are placed anew (a new one starts from every
/// row); the results are the same bits as without backups.
#[test]
fn table_backups_hold_their_owners_rows_bit_for_bit_through_bucket_moves() {
    let plan = ["--servers", "2", "--scale-plan", "300:servers=3,700:servers=2"];
    let plain = ok(&train(&plan));
    let mut all = vec!["train", "--model", "ctr", "--json", "--progress-every", "500", "--replicas", "2"];
    all.extend_from_slice(&plan);
    let o = eps().env("EPS_VERIFY_BACKUPS", "1").args(&all).output().expect("run eps");
    let out = ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(json_field(&out, "bucket_moves"), "2", "{out}");
    for k in ["params_checksum", "sparse_checksum"] {
        assert_eq!(json_field(&out, k), json_field(&plain, k), "{k}: with backups against without");
    }
    // "eps server R: took in N forwards of table rows (...); K checked bit for bit"
    let took: Vec<(u64, u64)> = err
        .lines()
        .filter_map(|l| {
            let n = l.split(" took in ").nth(1)?.split(' ').next()?.parse().ok()?;
            let k = l.split("); ").nth(1)?.split(' ').next()?.parse().ok()?;
            Some((n, k))
        })
        .collect();
    assert!(took.len() >= 2 && took.iter().all(|&(n, k)| n > 100 && n == k), "{took:?}\n{err}");
    // The third server kept rows while it was there, and the ring was placed anew.
    assert!(err.contains("keeps its table rows in step on server 2"), "{err}");
}

/// A small ctr job.
const SMALL_CTR: &str = r#"
[job]
name = "ctr"
workers = 2
servers = 2
steps = 40
batch = 64
[model]
preset = "ctr"
embed_dim = 8
[[model.tables]]
name = "ctr.ids"
dim = 8
[optimizer]
kind = "adam"
"#;
