//! `--log-format json`: every line a local cluster's processes log is one
//! JSON object (ts, level, role, pid, msg), and scale events and migrations
//! are events with their ids as fields.

mod common;

use common::cli::eps;

#[test]
fn a_cluster_logs_json_lines_with_scale_and_migration_events() {
    let out = eps()
        .args(["--log-format", "json", "train", "--steps", "60", "--scale-plan", "30:servers=3"])
        .args(["--transport", "soft", "--aggregator", "cpu", "--progress-every", "20"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let lines: Vec<serde_json::Value> =
        err.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON object ({e}): {l:?}"))).collect();
    for v in &lines {
        for k in ["ts", "level", "role", "pid", "msg"] {
            assert!(!v[k].is_null(), "no {k}: {v}");
        }
    }
    let roles: std::collections::BTreeSet<&str> = lines.iter().filter_map(|v| v["role"].as_str()).collect();
    // (Workers report on stdout, to `eps train`; they log only when something goes wrong.)
    assert!(["control", "server", "train"].iter().all(|r| roles.contains(r)), "{roles:?}");
    assert!(roles.iter().all(|r| ["control", "server", "train", "worker"].contains(r)), "{roles:?}");
    let events = |kind: &str| lines.iter().filter(|v| v["event"] == kind).collect::<Vec<_>>();
    let scale = events("scale");
    assert_eq!(scale.len(), 1, "{err}");
    assert_eq!((scale[0]["servers_from"].as_u64(), scale[0]["servers_to"].as_u64()), (Some(2), Some(3)));
    let moves = events("migration");
    assert!(!moves.is_empty(), "{err}");
    for m in moves {
        assert_eq!(m["to"].as_u64(), Some(2), "{m}");
        assert!(m["from"].as_u64().is_some_and(|f| f < 2) && m["shard"].is_u64() && m["bytes"].as_u64() > Some(0), "{m}");
        assert_eq!(m["role"], "server");
    }
    // The result lines stay on stdout, as text.
    assert!(String::from_utf8_lossy(&out.stdout).contains("params checksum"));
    // A bad format is refused, naming the choices.
    let bad = eps().args(["--log-format", "xml", "status", "--control", "127.0.0.1:1"]).output().unwrap();
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("give text or json"));
}
