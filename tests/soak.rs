//! `eps soak`: a short soak under every kind of fault ends with nothing lost
//! (the same bits as the fault-free run), and bad flags are refused.

use std::process::Command;

fn eps() -> Command {
    Command::new(std::env::var("EPS_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_eps").to_string()))
}

fn json<'a>(line: &'a str, key: &str) -> &'a str {
    let at = line.find(&format!("\"{key}\":")).unwrap_or_else(|| panic!("no {key} in {line}")) + key.len() + 3;
    let rest = &line[at..];
    rest[..rest.find([',', '}']).unwrap()].trim_matches('"')
}

#[test]
fn a_short_soak_under_every_fault_loses_nothing() {
    let o = eps()
        .args(["soak", "--steps", "600", "--every-s", "1", "--seed", "2", "--json"])
        .args(["--faults", "server_kill,scale_out,scale_in,server_stall,worker_stall,control_kill"])
        .output()
        .unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    let line = out.lines().last().unwrap_or_default();
    assert_eq!(json(line, "errors"), "0", "{out}\n{err}");
    assert_eq!(json(line, "lost_updates"), "0", "{out}\n{err}");
    assert_eq!(json(line, "params_checksum"), json(line, "reference_checksum"));
    let faults: u64 = json(line, "faults_injected").parse().unwrap();
    assert!(faults >= 3, "only {faults} faults in the soak:\n{err}");
    assert_eq!(json(line, "recoveries"), faults.to_string(), "every fault recovered from:\n{err}");
    // (Resident memory is reported; its limit is checked by the soak's exit
    // status, which a short run on a loaded machine may miss for reasons
    // other than a leak: the figure must be there.)
    let growth: f64 = json(line, "rss_growth_ratio").parse().expect("an RSS growth figure");
    assert!(growth > 0.5, "{line}");
    assert!(json(line, "push_pull_p99_us").parse::<f64>().unwrap() > 0.0, "{line}");
}

#[test]
fn bad_soak_flags_are_refused_with_the_reason() {
    for (args, why) in [
        (&["--faults", "server_kill,meteor"][..], "unknown fault \"meteor\""),
        (&["--servers", "2"][..], "3 at least"),
        (&["--minutes", "0"][..], "positive"),
        (&["--every-s", "0"][..], "positive"),
    ] {
        let o = eps().arg("soak").args(args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(why), "{args:?}: {err}");
    }
}
