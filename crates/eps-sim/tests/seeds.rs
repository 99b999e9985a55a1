//! Hundreds of seeded runs of the simulation (random server and worker scale
//! events, splits, migrations, worker crashes, server crashes with replicas or
//! rolled back to a checkpoint, network interleavings). A failure prints its seed;
//! `EPS_SIM_SEED=N` replays exactly that run, `EPS_SIM_SEEDS=N` runs N seeds.

use eps_sim::run;

fn seeds() -> Vec<u64> {
    if let Some(s) = std::env::var("EPS_SIM_SEED").ok().and_then(|s| s.parse().ok()) {
        return vec![s];
    }
    let n = std::env::var("EPS_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(2000u64);
    (0..n).collect()
}

#[test]
fn every_seed_keeps_the_invariants_and_finishes() {
    let mut totals = eps_sim::Report::default();
    let mut failures = Vec::new();
    for seed in seeds() {
        match run(seed) {
            Ok(r) => totals.add(&r),
            Err(f) => failures.push(f),
        }
    }
    println!(
        "{} events, {} migrations, {} splits, {} server and {} worker scale requests, {} membership changes, {} crashes, {} empty updates, {} runs with replicas, {} server crashes, {} roll-backs to a checkpoint",
        totals.events,
        totals.migrations,
        totals.splits,
        totals.scales.0,
        totals.scales.1,
        totals.membership_changes,
        totals.crashes,
        totals.empty_updates,
        totals.replicated,
        totals.server_crashes,
        totals.rollbacks
    );
    if let Some(f) = failures.first() {
        let seeds: Vec<u64> = failures.iter().take(20).map(|f| f.seed).collect();
        panic!("{} seeds failed (the first {}: {seeds:?})\nfirst:\n{f}", failures.len(), seeds.len());
    }
    // The plan must actually exercise the machinery.
    assert!(totals.migrations > 0 && totals.splits > 0 && totals.membership_changes > 0 && totals.crashes > 0, "{totals:?}");
    assert!(totals.replicated > 0 && totals.server_crashes > 0 && totals.rollbacks > 0, "{totals:?}");
    assert!(
        totals.worker_joins > 0 && totals.worker_leaves > 0 && totals.lease_expiries > 0 && totals.promotions > 0,
        "{totals:?}"
    );
}

#[test]
fn a_seed_replays_exactly() {
    let a = run(7).map_err(|f| f.to_string());
    let b = run(7).map_err(|f| f.to_string());
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
}
