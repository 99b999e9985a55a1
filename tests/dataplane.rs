//! The data plane end to end, in one process: a control plane, S servers and W
//! workers on threads, talking over the soft fabric on 127.0.0.1. BSP runs must be
//! bitwise equal to a single-process reference of the same math, for every dtype and
//! optimizer and several worker/server counts.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use eps_agg::{CpuAggregator, DType, reduce};
use eps_control::ControlService;
use eps_control::store::MemStore;
use eps_fabric::Secret;
use eps_proto::JobSpec;
use eps_worker::{Worker, WorkerConfig};

fn secret() -> Secret {
    Secret::new("dataplane-test").unwrap()
}

/// The gradient a worker computes: a deterministic function of what it pulled.
fn gradient(params: &[f32], rank: u32, t: u64, out: &mut [f32]) {
    for (i, (g, p)) in out.iter_mut().zip(params).enumerate() {
        *g = (p * 3.0 + rank as f32 * 0.7 + t as f32 * 0.1 + (i % 13) as f32 * 0.05).sin() * 0.5;
    }
}

fn spec_text(workers: u32, servers: u32, steps: u64, dtype: &str, opt: &str, consistency: &str) -> String {
    format!(
        r#"
        [job]
        workers = {workers}
        servers = {servers}
        steps = {steps}
        dtype = "{dtype}"
        consistency = "{consistency}"
        shard_bytes = 8192
        seed = 7
        [model]
        tensors = [{{ name = "w", elements = 20000 }}, {{ name = "b", elements = 1001 }}]
        [optimizer]
        kind = "{opt}"
        lr = 0.05
        weight_decay = 0.001
        [lr_schedule]
        warmup_steps = 2
        decay = "cosine"
        "#
    )
}

/// Runs a whole cluster on threads; returns every worker's final parameter bytes.
fn run_cluster(text: &str) -> Vec<Vec<u8>> {
    let spec = JobSpec::from_toml(text).unwrap();
    let svc = ControlService::bind("127.0.0.1:0".parse().unwrap(), &spec, text, secret(), Box::new(MemStore::default())).unwrap();
    let control: SocketAddr = svc.local_addr();
    // Detached: if a role fails, the control plane (waiting for it) must not keep
    // the test from reporting the failure.
    std::thread::spawn(move || svc.run());
    std::thread::scope(|s| {
        for _ in 0..spec.job.servers {
            s.spawn(move || {
                let cfg = eps_server::ServerConfig {
                    control,
                    secret: secret(),
                    listen_ip: "127.0.0.1".parse().unwrap(),
                    aggregator: Arc::new(CpuAggregator::new(1)),
                    accept_timeout: Duration::from_secs(30),
                    update_threads: 2,
                };
                eps_server::run(&cfg).unwrap()
            });
        }
        let workers: Vec<_> = (0..spec.job.workers)
            .map(|_| {
                s.spawn(move || {
                    let cfg = WorkerConfig { control, secret: secret(), timeout: Duration::from_secs(30) };
                    let mut w = Worker::join(&cfg).unwrap();
                    let n = w.layout().total as usize;
                    let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
                    for _ in 0..w.spec().job.steps {
                        w.read_params(&mut p).unwrap();
                        gradient(&p, w.rank(), w.iteration(), &mut g);
                        w.write_grads(&g).unwrap();
                        w.push_pull().unwrap();
                    }
                    let out = w.params_bytes().to_vec();
                    w.finish().unwrap();
                    out
                })
            })
            .collect();
        workers.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The same training in one process, with the same dtype roundings.
fn reference(text: &str) -> Vec<u8> {
    let spec = JobSpec::from_toml(text).unwrap();
    let layout = spec.layout().unwrap();
    let (opt, sched, dtype) = (spec.optimizer().unwrap(), spec.schedule().unwrap(), layout.dtype);
    let n = layout.total as usize;
    let es = dtype.size_bytes();
    let mut master: Vec<f32> = (0..n as u64).map(|i| eps_proto::init::param(spec.job.seed, i)).collect();
    let mut state = vec![0f32; n * opt.state_per_param()];
    let w = spec.job.workers;
    let mut wire = vec![0u8; n * es];
    let (mut seen, mut g) = (vec![0f32; n], vec![0f32; n]);
    let mut grads: Vec<Vec<u8>> = vec![vec![0u8; n * es]; w as usize];
    let mut avg = vec![0f32; n];
    for t in 0..spec.job.steps {
        reduce::narrow(dtype, &master, &mut wire);
        reduce::sum(dtype, &[&wire], &mut seen, 1);
        for r in 0..w {
            gradient(&seen, r, t, &mut g);
            reduce::narrow(dtype, &g, &mut grads[r as usize]);
        }
        let refs: Vec<&[u8]> = grads.iter().map(|x| &x[..]).collect();
        // Per shard, as the servers do (the sum is element-wise, so shard by shard
        // equals all at once; done per shard anyway to mirror the optimizer calls).
        for s in &layout.shards {
            let r = s.start as usize..(s.start + s.len) as usize;
            let ins: Vec<&[u8]> = refs.iter().map(|x| &x[r.start * es..r.end * es]).collect();
            reduce::sum(dtype, &ins, &mut avg[r.clone()], 1);
            if w > 1 {
                avg[r.clone()].iter_mut().for_each(|x| *x *= 1.0 / w as f32);
            }
            let k = opt.state_per_param();
            opt.apply(opt.scalars(t, sched.at(t)), &mut master[r.clone()], &avg[r.clone()], &mut state[r.start * k..r.end * k]);
        }
    }
    reduce::narrow(dtype, &master, &mut wire);
    wire
}

fn check(workers: u32, servers: u32, dtype: &str, opt: &str) -> Vec<u8> {
    let text = spec_text(workers, servers, 6, dtype, opt, "bsp");
    let got = run_cluster(&text);
    let want = reference(&text);
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
    let _ = DType::F32;
}

#[test]
fn bsp_with_updates_split_over_two_threads_equals_reference() {
    // Shards of 256 Ki elements: each update is split in two halves on two threads.
    let text = spec_text(2, 2, 4, "f32", "adamw", "bsp")
        .replace("shard_bytes = 8192", "shard_bytes = 1048576")
        .replace("elements = 20000", "elements = 600000");
    let got = run_cluster(&text);
    let want = reference(&text);
    assert!(got.iter().all(|g| g == &want), "split updates differ from the reference");
}
