//! The simulation is sharp: each known past bug put back into the shared
//! protocol cores (`eps_proto::mutants`) makes some seed fail within 500.
//! Runs only in a build with the `mutants` feature (`ci/test.sh` runs it:
//! `cargo test --release -p eps-sim --features mutants --test mutants`).
#![cfg(feature = "mutants")]

#[test]
fn every_mutant_is_caught_within_500_seeds() {
    let mut missed = Vec::new();
    for (name, _) in eps_proto::mutants::ALL {
        let caught = eps_sim::first_caught(name, 0..500).unwrap().map(|f| f.seed);
        println!("{name}: {}", caught.map_or("not caught".to_string(), |s| format!("caught by seed {s}")));
        if caught.is_none() {
            missed.push(*name);
        }
    }
    assert!(missed.is_empty(), "mutants the simulation did not catch in 500 seeds: {missed:?}");
    // With none of them on, the same seeds keep every invariant.
    let failed: Vec<u64> = (0..200u64).filter(|&s| eps_sim::run(s).is_err()).collect();
    assert!(failed.is_empty(), "seeds failing without a mutant: {failed:?}");
}
