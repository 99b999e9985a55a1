//! Pieces shared by the in-process cluster tests: a job spec, the gradient every
//! worker computes, a control plane and servers on threads, and the single-process
//! reference of the same math for any contributor set per iteration.

#![allow(dead_code)]

pub mod cli;
pub mod run;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use eps_agg::{CpuAggregator, reduce};
use eps_control::ControlService;
use eps_control::store::MemStore;
use eps_fabric::Secret;
use eps_proto::JobSpec;
use eps_proto::membership::Membership;
use eps_worker::{Worker, WorkerConfig};

pub fn secret() -> Secret {
    Secret::new("dataplane-test").unwrap()
}

pub fn worker_config(control: SocketAddr) -> WorkerConfig {
    WorkerConfig { control: control.into(), secret: secret(), timeout: Duration::from_secs(30) }
}

/// The gradient a worker computes: a deterministic function of what it pulled.
pub fn gradient(params: &[f32], rank: u32, t: u64, out: &mut [f32]) {
    for (i, (g, p)) in out.iter_mut().zip(params).enumerate() {
        *g = (p * 3.0 + rank as f32 * 0.7 + t as f32 * 0.1 + (i % 13) as f32 * 0.05).sin() * 0.5;
    }
}

pub fn spec_text(workers: u32, servers: u32, steps: u64, dtype: &str, opt: &str, consistency: &str) -> String {
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

/// Starts the control plane on a detached thread (if a role fails, the control
/// plane waiting for it must not keep the test from reporting the failure).
pub fn start_control(text: &str) -> (JobSpec, SocketAddr) {
    let spec = JobSpec::from_toml(text).unwrap();
    let svc = ControlService::bind("127.0.0.1:0".parse().unwrap(), &spec, text, secret(), Box::new(MemStore::default())).unwrap();
    let control = svc.local_addr();
    std::thread::spawn(move || svc.run());
    (spec, control)
}

/// Runs one server until the job ends; returns its summary.
pub fn run_server(control: SocketAddr) -> eps_server::ServerSummary {
    let cfg = eps_server::ServerConfig {
        control: control.into(),
        secret: secret(),
        listen_ip: "127.0.0.1".parse().unwrap(),
        aggregator: Arc::new(CpuAggregator::new(1)),
        device: None,
        accept_timeout: Duration::from_secs(30),
        update_threads: 2,
    };
    eps_server::run(&cfg).unwrap()
}

/// One training step of a worker: gradient of what it pulled, push, pull.
pub fn step(w: &mut Worker, p: &mut [f32], g: &mut [f32]) {
    w.read_params(p).unwrap();
    gradient(p, w.rank(), w.iteration(), g);
    w.write_grads(g).unwrap();
    w.push_pull().unwrap();
}

/// The same training in one process, with the same dtype roundings: iteration
/// `t` sums the gradients of `m.contributors(t)` in rank order and averages over
/// their number.
pub fn reference(text: &str, m: &Membership) -> Vec<u8> {
    reference_with(text, m, &mut |p, r, t, g| gradient(p, r, t, g))
}

/// A worker's gradient: `grad(params, rank, iteration, out)`.
pub type Gradient<'a> = dyn FnMut(&[f32], u32, u64, &mut [f32]) + 'a;

/// [`reference`] with any gradient.
pub fn reference_with(text: &str, m: &Membership, grad: &mut Gradient<'_>) -> Vec<u8> {
    reference_sets(text, &|t| m.contributors(t).to_vec(), grad)
}

/// The reference with any contributor set per iteration; an iteration without
/// contributors leaves the parameters as they are.
pub fn reference_sets(text: &str, sets: &dyn Fn(u64) -> Vec<u32>, grad: &mut Gradient<'_>) -> Vec<u8> {
    let spec = JobSpec::from_toml(text).unwrap();
    let layout = spec.layout().unwrap();
    let (opt, sched, dtype) = (spec.optimizer().unwrap(), spec.schedule().unwrap(), layout.dtype);
    let n = layout.total as usize;
    let es = dtype.size_bytes();
    let mut master: Vec<f32> = (0..n as u64).map(|i| eps_proto::init::param(spec.job.seed, i)).collect();
    let mut state = vec![0f32; n * opt.state_per_param()];
    let mut wire = vec![0u8; n * es];
    let (mut seen, mut g) = (vec![0f32; n], vec![0f32; n]);
    let mut avg = vec![0f32; n];
    for t in 0..spec.job.steps {
        reduce::narrow(dtype, &master, &mut wire);
        reduce::sum(dtype, &[&wire], &mut seen, 1);
        let contributors = sets(t);
        if contributors.is_empty() {
            continue;
        }
        let grads: Vec<Vec<u8>> = contributors
            .iter()
            .map(|&r| {
                grad(&seen, r, t, &mut g);
                let mut out = vec![0u8; n * es];
                reduce::narrow(dtype, &g, &mut out);
                out
            })
            .collect();
        let w = contributors.len();
        // Per shard, as the servers do (the sum is element-wise, so shard by shard
        // equals all at once; done per shard anyway to mirror the optimizer calls).
        for s in &layout.shards {
            let r = s.start as usize..(s.start + s.len) as usize;
            let ins: Vec<&[u8]> = grads.iter().map(|x| &x[r.start * es..r.end * es]).collect();
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

/// Sends a scale request (`Scale`, `ScaleWorkers`), again while another
/// change is in progress (a temporary refusal), for up to a minute.
pub fn scale(control: SocketAddr, msg: eps_proto::control::ControlMsg) {
    use eps_control::{ControlClient, ControlError};
    let mut c = ControlClient::connect(control, &secret(), Duration::from_secs(10)).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        match c.call(&msg) {
            Ok(_) => return,
            Err(e @ ControlError::Rejected(_)) if e.is_temporary() && std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("{msg:?}: {e}"),
        }
    }
}
