//! The simulator under every policy: every job ends as its trace says, the
//! rules hold (checked by the simulator at every decision), and on
//! feedback-driven exploration `eps` gives feedback much sooner than a static
//! PS cluster without slowing the jobs that run to completion.

use eps_sched::model::ClusterModel;
use eps_sched::policy::{NAMES, by_name};
use eps_sched::{sim, synth};

fn run(policy: &str, jobs: &[eps_sched::JobSpec], slots: u32) -> (sim::Summary, Vec<sim::JobRecord>) {
    let mut p = by_name(policy).unwrap();
    sim::run(jobs, slots, &ClusterModel::default(), p.as_mut()).unwrap()
}

#[test]
fn every_job_ends_as_its_trace_says_under_every_policy() {
    for seed in 1..4 {
        for (kind, jobs) in [("exploration", synth::exploration(seed, 120)), ("steady", synth::steady(seed, 80))] {
            for policy in NAMES {
                let (s, rec) = run(policy, &jobs, 32);
                for (j, r) in jobs.iter().zip(&rec) {
                    let (st, fb, end) = (r.start_s.unwrap(), r.feedback_s.unwrap(), r.end_s.unwrap());
                    assert!(j.submit_s <= st && st < fb && fb <= end, "{kind} {policy} {}: {r:?}", j.name);
                    assert_eq!(r.killed, j.kill_after_feedback);
                }
                assert!(s.utilization > 0.0 && s.utilization <= 1.0 + 1e-9, "{kind} {policy}: {s:?}");
                if policy == "static" {
                    assert_eq!(s.rescales, 0, "a static cluster never rescales");
                }
            }
        }
    }
}

#[test]
fn the_simulation_is_deterministic() {
    let jobs = synth::exploration(7, 60);
    assert_eq!(run("eps", &jobs, 24), run("eps", &jobs, 24));
}

#[test]
fn speed_noise_is_the_same_for_a_seed_and_jobs_still_end_as_their_trace_says() {
    let jobs = synth::exploration(7, 60);
    let m = ClusterModel::default();
    let with = |noise: f64, seed: u64| {
        let mut p = by_name("eps").unwrap();
        sim::run_with(&jobs, 24, &m, p.as_mut(), &sim::Options { noise, seed, ..Default::default() }).unwrap()
    };
    assert_eq!(with(0.0, 5), run("eps", &jobs, 24), "no noise: the model's speeds");
    assert_eq!(with(0.5, 5), with(0.5, 5));
    assert_ne!(with(0.5, 5).0, with(0.5, 6).0);
    let (_, rec) = with(0.5, 5);
    for (j, r) in jobs.iter().zip(&rec) {
        assert!(r.end_s.is_some() && r.killed == j.kill_after_feedback, "{r:?}");
    }
    let f: Vec<f64> = (0..200)
        .map(|i| sim::speed_factor(&sim::Options { noise: 0.5, seed: 1, ..Default::default() }, &format!("j{i}")))
        .collect();
    assert!(f.iter().all(|&x| (1.0 / 1.5 - 1e-12..=1.5 + 1e-12).contains(&x)));
    assert!(f.iter().any(|&x| x < 0.8) && f.iter().any(|&x| x > 1.25), "spread over the range");
}

#[test]
fn eps_gives_feedback_sooner_than_a_static_cluster_without_slowing_completions() {
    for seed in 1..6 {
        let jobs = synth::exploration(seed, 200);
        let (st, _) = run("static", &jobs, 48);
        let (ep, _) = run("eps", &jobs, 48);
        let (op, _) = run("optimus", &jobs, 48);
        println!(
            "seed {seed}: feedback latency static {:.0} s, optimus {:.0} s, eps {:.0} s; JCT static {:.0} s, optimus {:.0} s, eps {:.0} s; max queue wait eps {:.0} s",
            st.avg_feedback_latency_s,
            op.avg_feedback_latency_s,
            ep.avg_feedback_latency_s,
            st.avg_jct_s,
            op.avg_jct_s,
            ep.avg_jct_s,
            ep.max_queue_wait_s
        );
        assert!(ep.avg_feedback_latency_s <= 0.5 * st.avg_feedback_latency_s, "seed {seed}: {ep:?} vs {st:?}");
        assert!(ep.avg_jct_s <= 0.9 * st.avg_jct_s, "seed {seed}: {ep:?} vs {st:?}");
        assert!(ep.max_queue_wait_s <= st.max_queue_wait_s, "seed {seed}: no job starves more than under static");
    }
}

#[test]
fn on_nodes_every_process_has_a_slot_and_the_decisions_are_those_of_one_pool() {
    let jobs = synth::exploration(3, 120);
    let m = ClusterModel::default();
    let nodes = eps_sched::placement::parse_nodes("n1:8,n2:8,n3:8,n4:8").unwrap();
    for policy in NAMES {
        let mut p = by_name(policy).unwrap();
        let on_nodes = sim::Options { nodes: nodes.clone(), ..Default::default() };
        // The simulator places every decision (shrinks first) and fails if a
        // process finds no slot.
        let (s, rec) = sim::run_with(&jobs, 32, &m, p.as_mut(), &on_nodes).unwrap();
        let (flat, flat_rec) = run(policy, &jobs, 32);
        // Without a network in the model nodes cost nothing: the same
        // decisions, the same times.
        assert_eq!((s.avg_jct_s, s.rescales), (flat.avg_jct_s, flat.rescales), "{policy}");
        // With a slow one, jobs spread over nodes train slower, and nothing
        // changes for those on one node.
        let slow = ClusterModel::from_toml("[cluster]\nnode_bandwidth_gbytes_per_s = 0.3\n").unwrap();
        let mut p = by_name(policy).unwrap();
        let (spread, _) = sim::run_with(&jobs, 32, &slow, p.as_mut(), &on_nodes).unwrap();
        assert!(spread.avg_jct_s > 1.05 * flat.avg_jct_s, "{policy}: {} vs {}", spread.avg_jct_s, flat.avg_jct_s);
        let mut p = by_name(policy).unwrap();
        assert_eq!(sim::run_with(&jobs, 32, &slow, p.as_mut(), &sim::Options::default()).unwrap().0, flat, "{policy}");
        assert!(flat_rec.iter().all(|r| r.max_nodes == 1), "one node of all the slots");
        for (j, r) in jobs.iter().zip(&rec) {
            // At most one node per process.
            assert!(r.max_nodes >= 1 && r.max_nodes <= 4.min(j.max_alloc().slots()), "{}: {r:?}", j.name);
        }
        assert!(rec.iter().any(|r| r.max_nodes > 1), "{policy}: some jobs must spill over (32 slots in nodes of 8)");
    }
    let mut p = by_name("eps").unwrap();
    let wrong = sim::Options { nodes, ..Default::default() };
    assert!(sim::run_with(&jobs, 48, &m, p.as_mut(), &wrong).unwrap_err().to_string().contains("32 slots"));
}
