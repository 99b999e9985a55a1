//! Averaged tensors (named `buffer:...`, a framework's buffers): every pull
//! returns the mean of what the workers pushed for them at the iteration
//! before, bit for bit, while shards migrate between servers and with
//! backups that take the forwarded values. In one process over the soft
//! fabric on 127.0.0.1.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::{run_server, scale, start_control, worker_config};
use eps_proto::control::ControlMsg;
use eps_worker::Worker;

const W: usize = 20000;
const B: usize = 3001;

fn text(replicas: u32) -> String {
    format!(
        "[job]\nworkers = 2\nservers = 2\nsteps = 60\nshard_bytes = 8192\nseed = 3\nreplicas = {replicas}\n\
         [model]\ntensors = [{{ name = \"w\", elements = {W} }}, {{ name = \"buffer:stats\", elements = {B} }}]\n\
         [optimizer]\nkind = \"adam\"\nlr = 0.01\n"
    )
}

/// What worker `rank` pushes for the averaged tensor at iteration `t`.
fn pushed(rank: u32, t: u64, i: usize) -> f32 {
    ((rank * 31 + 7) as f32 * 0.013 + t as f32 * 0.37 + i as f32 * 0.001).sin() * 3.0
}

/// The mean the servers take, in rank order, one contribution at a time.
fn mean(t: u64, i: usize) -> f32 {
    let mut m = pushed(0, t, i);
    m += (pushed(1, t, i) - m) * 0.5;
    m
}

fn averaged_tensors_pull_the_mean_while_shards_move(replicas: u32) {
    let text = text(replicas);
    let (spec, control) = start_control(&text);
    let reached = AtomicU64::new(0);
    let checked = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..spec.job.servers {
            s.spawn(move || run_server(control));
        }
        for _ in 0..spec.job.workers {
            s.spawn(|| {
                let mut w = Worker::join(&worker_config(control)).unwrap();
                let n = w.layout().total as usize;
                let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
                while w.iteration() < w.spec().job.steps {
                    let t = w.iteration();
                    w.read_params(&mut p).unwrap();
                    if t > 0 {
                        for i in 0..B {
                            assert_eq!(p[W + i].to_bits(), mean(t - 1, i).to_bits(), "iteration {t}, element {i}");
                        }
                        checked.fetch_add(1, Ordering::Relaxed);
                    }
                    common::gradient(&p[..W], w.rank(), t, &mut g[..W]);
                    for i in 0..B {
                        g[W + i] = pushed(w.rank(), t, i);
                    }
                    w.write_grads(&g).unwrap();
                    w.push_pull().unwrap();
                    reached.fetch_max(t + 1, Ordering::Relaxed);
                    // Slow enough for the moves to happen while it trains.
                    std::thread::sleep(Duration::from_millis(5));
                }
                w.finish().unwrap();
            });
        }
        // Scaled out while the job trains, then back in: the averaged
        // tensor's shards move both ways.
        for (at, servers) in [(5, 3), (30, 2)] {
            while reached.load(Ordering::Relaxed) < at {
                std::thread::sleep(Duration::from_millis(2));
            }
            scale(control, ControlMsg::Scale { servers });
            if servers == 3 {
                s.spawn(move || run_server(control));
            }
        }
    });
    assert_eq!(checked.load(Ordering::Relaxed), 2 * (spec.job.steps - 1));
}

#[test]
fn averaged_tensors_pull_the_workers_mean_while_shards_migrate() {
    averaged_tensors_pull_the_mean_while_shards_move(1);
}

#[test]
fn averaged_tensors_pull_the_workers_mean_with_backups_and_moves() {
    averaged_tensors_pull_the_mean_while_shards_move(2);
}
