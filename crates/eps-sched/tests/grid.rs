//! `eps` against the literature's baselines on the shipped Philly-derived
//! workloads (bench/traces/philly-w{2,3,4}.csv): at 4x their arrival rate on
//! 32 slots, and over the whole grid of loads and cluster sizes where the
//! cluster is contended, it gives feedback and finishes jobs no later on
//! average than `optimus` and `pollux`, and gives feedback at least 3x
//! sooner than `static`.

use eps_sched::grid;
use eps_sched::policy::NAMES;
use eps_sched::{ClusterModel, Timing, trace};

const WORKLOADS: [(&str, &str); 3] = [
    ("philly-w2", include_str!("../../../bench/traces/philly-w2.csv")),
    ("philly-w3", include_str!("../../../bench/traces/philly-w3.csv")),
    ("philly-w4", include_str!("../../../bench/traces/philly-w4.csv")),
];

fn cell(name: &str, text: &str, load: f64, slots: u32) -> grid::Cell {
    let jobs = trace::parse(text).unwrap();
    grid::cell(name, &jobs, load, slots, &[], &ClusterModel::default(), &NAMES, Timing::default()).unwrap().expect("fits")
}

fn show(c: &grid::Cell) -> String {
    let f: Vec<String> =
        c.runs.iter().map(|s| format!("{} fb {:.0} jct {:.0}", s.policy, s.avg_feedback_latency_s, s.avg_jct_s)).collect();
    format!("{} {}x {} slots: {}", c.workload, c.load, c.slots, f.join(", "))
}

#[test]
fn eps_beats_optimus_and_pollux_on_every_shipped_workload_at_4x_on_32_slots() {
    for (name, text) in WORKLOADS {
        let c = cell(name, text, 4.0, 32);
        println!("{}", show(&c));
        assert!(c.contended(), "{}", show(&c));
        let e = c.run("eps").unwrap();
        for b in ["optimus", "pollux"] {
            let s = c.run(b).unwrap();
            assert!(e.avg_feedback_latency_s <= s.avg_feedback_latency_s, "feedback against {b}: {}", show(&c));
            assert!(e.avg_jct_s <= s.avg_jct_s, "JCT against {b}: {}", show(&c));
        }
        assert!(c.static_over_eps().unwrap() >= 3.0, "{}", show(&c));
    }
}

#[test]
fn over_the_contended_grid_no_baseline_beats_eps() {
    let mut contended = 0;
    for (name, text) in WORKLOADS {
        for load in [2.0, 4.0, 8.0] {
            for slots in [16, 32, 64] {
                let c = cell(name, text, load, slots);
                if !c.contended() {
                    continue;
                }
                contended += 1;
                assert!(c.beaten_by().is_empty(), "{}", show(&c));
                assert!(c.static_over_eps().unwrap() >= 3.0, "{}", show(&c));
            }
        }
    }
    assert!(contended >= 18, "the grid is mostly contended ({contended} cells)");
}
