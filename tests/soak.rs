//! `eps soak`: a short soak under every kind of fault ends with nothing lost
//! (the same bits as the fault-free run), for a job with a sparse table too,
//! and bad flags are refused.

mod common;

use common::cli::{eps, json_field as json};

/// Runs `eps soak --json` with `args` under every kind of fault; checks that
/// nothing was lost and every fault recovered from; its stdout and stderr.
fn soak_losing_nothing(args: &[&str]) -> (String, String) {
    let o = eps()
        .args(["soak", "--every-s", "1", "--seed", "2", "--json"])
        .args(args)
        .args(["--faults", "server_kill,scale_out,scale_in,server_stall,worker_stall,control_kill,server_cut"])
        .output()
        .unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout).to_string(), String::from_utf8_lossy(&o.stderr).to_string());
    assert_eq!(json(&out, "errors"), "0", "{out}\n{err}");
    assert_eq!(json(&out, "lost_updates"), "0", "{out}\n{err}");
    assert_eq!(json(&out, "params_checksum"), json(&out, "reference_checksum"));
    let faults: u64 = json(&out, "faults_injected").parse().unwrap();
    assert!(faults >= 3, "only {faults} faults in the soak:\n{err}");
    assert_eq!(json(&out, "recoveries"), faults.to_string(), "every fault recovered from:\n{err}");
    (out, err)
}

#[test]
fn a_short_soak_under_every_fault_loses_nothing() {
    let (out, _) = soak_losing_nothing(&["--steps", "600"]);
    // (Resident memory is reported; its limit is checked by the soak's exit
    // status, which a short run on a loaded machine may miss for reasons
    // other than a leak: the figure must be there.)
    let growth: f64 = json(&out, "rss_growth_ratio").parse().expect("an RSS growth figure");
    assert!(growth > 0.5, "{out}");
    assert!(json(&out, "push_pull_p99_us").parse::<f64>().unwrap() > 0.0, "{out}");
}

/// A soak of the ctr job (its embeddings rows of a sparse table, backed up
/// too) under every kind of fault: servers killed, cut off and stalled hand
/// their rows to stand-ins, scale events move buckets; the dense parameters
/// and the table rows end as in the fault-free run, bit for bit.
#[test]
fn a_short_soak_of_a_job_with_tables_loses_no_row() {
    let (out, err) = soak_losing_nothing(&["--model", "ctr", "--steps", "2000"]);
    assert!(!json(&out, "sparse_checksum").is_empty(), "{out}");
    assert_eq!(json(&out, "sparse_checksum"), json(&out, "reference_sparse_checksum"), "{out}\n{err}");
    assert!(err.contains("serves lost server"), "no server lost its rows to a stand-in:\n{err}");
}

#[test]
fn bad_soak_flags_are_refused_with_the_reason() {
    for (args, why) in [
        (&["--faults", "server_kill,meteor"][..], "unknown fault \"meteor\""),
        (&["--servers", "2"][..], "3 at least"),
        (&["--minutes", "0"][..], "positive"),
        (&["--every-s", "0"][..], "positive"),
        (&["--model", "resnet"][..], "possible values: synthetic, ctr"),
    ] {
        let o = eps().arg("soak").args(args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(why), "{args:?}: {err}");
    }
}
