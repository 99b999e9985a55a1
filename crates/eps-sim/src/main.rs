//! `eps-sim`: runs seeded simulations of elastic jobs and says what they
//! covered. `cargo run --release -p eps-sim -- --help`.

use std::process::ExitCode;

const HELP: &str = "\
eps-sim: seeded, deterministic simulations of elastic EPS jobs (servers and
workers scaled, shards split and migrated, workers and servers crashed, the
network reordering within what the transports allow), every invariant checked
after every delivery.

usage: eps-sim [--seeds N] [--first S] [--json]
       eps-sim --seed S
       eps-sim --mutant NAME|all [--seeds N]
       eps-sim --list-mutants

  --seeds N   run seeds FIRST .. FIRST+N (default 2000)
  --first S   the first seed (default 0)
  --seed S    run seed S alone, with the control plane's log lines; on a
              failure print its last events
  --json      end with one JSON line: seeds, violations, and how often each
              kind of event happened over all runs
  --mutant M  put back the known past bug M (or each in turn: all) and run
              seeds until one fails; says after how many seeds it was caught
              (needs a build with --features mutants)
  --list-mutants  name the mutants and the bug each puts back
  -h, --help  this text

A failing seed prints the command that replays it. The exit status is 1 when
any seed broke an invariant.";

struct Args {
    first: u64,
    seeds: u64,
    json: bool,
    one: bool,
    mutant: Option<String>,
    list: bool,
}

fn parse(mut it: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut a = Args { first: 0, seeds: 2000, json: false, one: false, mutant: None, list: false };
    let num = |flag: &str, v: Option<String>| -> Result<u64, String> {
        let v = v.ok_or_else(|| format!("{flag} needs a number"))?;
        v.parse().map_err(|_| format!("{flag} {v:?}: not a number"))
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--seeds" => a.seeds = num("--seeds", it.next())?,
            "--first" => a.first = num("--first", it.next())?,
            "--seed" => {
                a.first = num("--seed", it.next())?;
                a.seeds = 1;
                a.one = true;
            }
            "--json" => a.json = true,
            "--mutant" => a.mutant = Some(it.next().ok_or("--mutant needs a name (see --list-mutants)")?),
            "--list-mutants" => a.list = true,
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    if a.seeds == 0 {
        return Err("--seeds must be at least 1".into());
    }
    Ok(Some(a))
}

fn main() -> ExitCode {
    let a = match parse(std::env::args().skip(1)) {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("eps-sim: {e}");
            return ExitCode::from(2);
        }
    };
    if !a.one {
        // The control plane's log lines (bucket moves waiting, ...) are for a
        // replayed seed; over thousands of runs they drown the summary.
        let _ = tracing::subscriber::set_global_default(tracing::subscriber::NoSubscriber::default());
    }
    if a.list {
        for (name, what) in eps_proto::mutants::ALL {
            println!("{name}: {what}");
        }
        return ExitCode::SUCCESS;
    }
    if let Some(m) = &a.mutant {
        return match mutants::run(m, a.first, a.seeds) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("eps-sim: {e}");
                ExitCode::from(2)
            }
        };
    }
    let mut total = eps_sim::Report::default();
    let mut failures: Vec<eps_sim::Failure> = Vec::new();
    let step = (a.seeds / 10).max(1);
    for (i, seed) in (a.first..a.first.saturating_add(a.seeds)).enumerate() {
        match eps_sim::run(seed) {
            Ok(r) => total.add(&r),
            Err(f) => {
                eprintln!("eps-sim: seed {seed} failed: {} (replay: cargo run --release -p eps-sim -- --seed {seed})", f.what);
                failures.push(f);
            }
        }
        let done = i as u64 + 1;
        if !a.one && done % step == 0 && done < a.seeds {
            eprintln!("eps-sim: {done}/{} seeds, {} violations", a.seeds, failures.len());
        }
    }
    if a.one {
        match failures.first() {
            Some(f) => eprintln!("{f}"),
            None => eprintln!("eps-sim: seed {} kept every invariant ({} events)", a.first, total.events),
        }
    }
    if a.json {
        let fields: [(&str, u64); 20] = [
            ("seeds", a.seeds),
            ("violations", failures.len() as u64),
            ("events", total.events),
            ("bsp_runs", total.modes[0]),
            ("ssp_runs", total.modes[1]),
            ("asp_runs", total.modes[2]),
            ("sparse_runs", total.sparse_runs),
            ("sparse_moves", total.sparse_moves),
            ("migrations", total.migrations),
            ("splits", total.splits),
            ("server_scales", total.scales.0),
            ("worker_scales", total.scales.1),
            ("worker_joins", total.worker_joins),
            ("worker_leaves", total.worker_leaves),
            ("lease_expiries", total.lease_expiries),
            ("membership_changes", total.membership_changes),
            ("server_crashes", total.server_crashes),
            ("promotions", total.promotions),
            ("rollbacks", total.rollbacks),
            ("control_failovers", total.control_failovers),
        ];
        let body: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
        let seeds: Vec<String> = failures.iter().take(20).map(|f| f.seed.to_string()).collect();
        println!("{{{},\"failed_seeds\":[{}]}}", body.join(","), seeds.join(","));
    } else if !a.one {
        println!(
            "eps-sim: {} seeds, {} violations; {} migrations, {} splits, {} worker joins, {} leaves, {} lease expiries, {} server crashes, {} promotions, {} roll-backs, {} control-plane failovers, {} sparse-bucket moves",
            a.seeds,
            failures.len(),
            total.migrations,
            total.splits,
            total.worker_joins,
            total.worker_leaves,
            total.lease_expiries,
            total.server_crashes,
            total.promotions,
            total.rollbacks,
            total.control_failovers,
            total.sparse_moves
        );
    }
    if let Some(f) = failures.first().filter(|_| !a.one) {
        eprintln!("first failure:\n{f}");
    }
    if failures.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) }
}

mod mutants {
    use std::process::ExitCode;

    /// Runs seeds `first..first + seeds` with mutant `name` (or each mutant
    /// in turn: `all`) until one fails; prints after how many seeds each was
    /// caught. Exit status 1 if some mutant went uncaught.
    #[cfg(feature = "mutants")]
    pub fn run(name: &str, first: u64, seeds: u64) -> Result<ExitCode, String> {
        let names: Vec<&str> = match name {
            "all" => eps_proto::mutants::ALL.iter().map(|(n, _)| *n).collect(),
            n => vec![n],
        };
        let mut missed = 0;
        for n in names {
            match eps_sim::first_caught(n, first..first.saturating_add(seeds))? {
                Some(f) => {
                    let what = f.what.lines().next().unwrap_or("");
                    println!("{n}: caught by seed {} ({} seeds run): {what}", f.seed, f.seed - first + 1);
                }
                None => {
                    missed += 1;
                    println!("{n}: NOT caught in {seeds} seeds");
                }
            }
        }
        Ok(if missed == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) })
    }

    /// Without the `mutants` feature there is nothing to put back.
    #[cfg(not(feature = "mutants"))]
    pub fn run(_name: &str, _first: u64, _seeds: u64) -> Result<ExitCode, String> {
        Err("this eps-sim was built without mutants: cargo run --release -p eps-sim --features mutants -- --mutant NAME".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Result<Option<Args>, String> {
        parse(v.iter().map(|s| s.to_string()))
    }

    #[test]
    fn flags_are_read_and_bad_ones_refused() {
        let a = args(&["--seeds", "5", "--first", "10", "--json"]).unwrap().unwrap();
        assert_eq!((a.first, a.seeds, a.json, a.one), (10, 5, true, false));
        let a = args(&["--seed", "7"]).unwrap().unwrap();
        assert_eq!((a.first, a.seeds, a.one), (7, 1, true));
        assert!(args(&["--help"]).unwrap().is_none());
        for (bad, why) in [
            (&["--seeds"][..], "needs a number"),
            (&["--seeds", "x"], "not a number"),
            (&["--seeds", "0"], "at least 1"),
            (&["--fast"], "unknown argument"),
        ] {
            let e = args(bad).err().unwrap();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }
}
