//! The data plane end to end, in one process: a control plane, S servers and W
//! workers on threads, talking over the soft fabric on 127.0.0.1. BSP runs must be
//! bitwise equal to a single-process reference of the same math, for every dtype and
//! optimizer and several worker/server counts.

mod common;

use common::{reference, run_server, spec_text, start_control, step, worker_config};
use eps_proto::JobSpec;
use eps_proto::membership::Membership;
use eps_worker::Worker;

/// Runs a whole cluster on threads; returns every worker's final parameter bytes.
fn run_cluster(text: &str) -> Vec<Vec<u8>> {
    let (spec, control) = start_control(text);
    std::thread::scope(|s| {
        for _ in 0..spec.job.servers {
            s.spawn(move || run_server(control));
        }
        let workers: Vec<_> = (0..spec.job.workers)
            .map(|_| {
                s.spawn(move || {
                    let mut w = Worker::join(&worker_config(control)).unwrap();
                    let n = w.layout().total as usize;
                    let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
                    for _ in 0..w.spec().job.steps {
                        step(&mut w, &mut p, &mut g);
                    }
                    let out = w.params_copy();
                    w.finish().unwrap();
                    out
                })
            })
            .collect();
        workers.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every worker of `text`'s job from iteration 0 on.
fn static_members(text: &str) -> Membership {
    Membership::new((0..JobSpec::from_toml(text).unwrap().job.workers).collect()).unwrap()
}

fn check(workers: u32, servers: u32, dtype: &str, opt: &str) -> Vec<u8> {
    let text = spec_text(workers, servers, 6, dtype, opt, "bsp");
    let got = run_cluster(&text);
    let want = reference(&text, &static_members(&text));
    for (r, g) in got.iter().enumerate() {
        assert!(g == &want, "worker {r} differs from the reference ({workers} workers, {servers} servers, {dtype}, {opt})");
    }
    want
}

#[test]
fn bsp_equals_reference_across_shapes() {
    let a = check(1, 1, "f32", "adam");
    let b = check(2, 3, "f32", "adam");
    let c = check(3, 2, "f32", "adam");
    assert_ne!(a, b, "different worker counts train differently");
    assert_eq!(b.len(), c.len());
}

#[test]
fn bsp_equals_reference_every_dtype_and_optimizer() {
    for dtype in ["f32", "bf16", "f16"] {
        for opt in ["sgd", "momentum", "nesterov", "adam", "adamw"] {
            check(2, 2, dtype, opt);
        }
    }
}

#[test]
fn bsp_is_independent_of_the_number_of_servers() {
    let one = run_cluster(&spec_text(2, 1, 5, "bf16", "momentum", "bsp"));
    let four = run_cluster(&spec_text(2, 4, 5, "bf16", "momentum", "bsp"));
    assert!(one[0] == four[0] && one[1] == four[1]);
}

#[test]
fn ssp_and_asp_train_and_finish() {
    for mode in ["ssp", "asp"] {
        let text = spec_text(3, 2, 8, "f32", "sgd", mode);
        let got = run_cluster(&text);
        assert_eq!(got.len(), 3);
        let init: Vec<u8> = (0..21001u64).flat_map(|i| eps_proto::init::param(7, i).to_le_bytes()).collect();
        for g in &got {
            assert_eq!(g.len(), init.len());
            assert!(g != &init, "{mode}: parameters moved");
        }
    }
}

#[test]
fn bsp_with_updates_split_over_two_threads_equals_reference() {
    // Shards of 256 Ki elements: each update is split in two halves on two threads.
    let text = spec_text(2, 2, 4, "f32", "adamw", "bsp")
        .replace("shard_bytes = 8192", "shard_bytes = 1048576")
        .replace("elements = 20000", "elements = 600000");
    let got = run_cluster(&text);
    let want = reference(&text, &static_members(&text));
    assert!(got.iter().all(|g| g == &want), "split updates differ from the reference");
}
