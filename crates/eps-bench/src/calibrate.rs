//! `eps sched calibrate`'s measurements: the constants of the scheduler's
//! cluster model, measured on this machine with real EPS processes (push/pull
//! rounds, a sum, migrations, and a live job rescaled through a cycle of
//! allocations).

use eps_agg::DType;
use eps_sched::policy::View;
use eps_sched::{Alloc, ClusterModel, Policy};

use crate::agg::{self, AggBench};
use crate::migrate::{self, MigrateBench};
use crate::pushpull::{self, PushPullBench};
use eps_cluster::error::chain as crate_error;

/// What a calibration measured, and the model made of it.
#[derive(Clone, Debug)]
pub struct Calibration {
    /// The cluster model.
    pub model: ClusterModel,
    /// The model size of the large rounds (bytes).
    pub size: u64,
    /// Push/pull of `size`: ms per iteration (p50).
    pub big_ms: f64,
    /// Push/pull of 4 KiB: ms per iteration (p50).
    pub tiny_ms: f64,
    /// Sum of two f32 contributions: GB/s.
    pub sum_gbytes_per_s: f64,
    /// Migration: GB/s.
    pub migration_gbytes_per_s: f64,
    /// The live job's fit.
    pub fit: LiveFit,
}

/// Measures the model (`quick`: smaller sizes and fewer rounds), saying
/// each step.
pub fn measure(quick: bool) -> Result<Calibration, String> {
    let (size, iters) = if quick { (4u64 << 20, 5) } else { (64u64 << 20, 20) };
    let step = |what: &str| eps_proto::say!("eps sched calibrate: {what}");
    step(&format!("push/pull of a {} MiB model, one worker, one server", size >> 20));
    let big = pushpull::run(&PushPullBench { size, workers: 1, servers: 1, iters, shard_bytes: 4 << 20, shm: false })
        .map_err(|e| crate_error(&e))?;
    step("push/pull of a 4 KiB model (the fixed cost of an iteration)");
    let tiny =
        pushpull::run(&PushPullBench { size: 4096, workers: 1, servers: 1, iters: iters * 5, shard_bytes: 4096, shm: false })
            .map_err(|e| crate_error(&e))?;
    step(&format!("sum of two {} MiB f32 contributions on one thread", size >> 20));
    let sum = agg::run(&AggBench { dtype: DType::F32, workers: 2, size, threads: 1, reps: 5 }).map_err(|e| crate_error(&e))?;
    step(&format!("migrations of a {} MiB shard between server processes", size >> 20));
    let mig = migrate::run(&MigrateBench {
        shard_bytes: size,
        steady_steps: 5,
        migrations: 2,
        gap_steps: 5,
        after_steps: 5,
        pulls_per_step: 1,
    })
    .map_err(|e| crate_error(&e))?;
    let overhead_s = tiny.iter_ms_p50 / 1e3;
    let agg_elements_per_s = 2.0 * (size / 4) as f64 / sum.sum_s;
    let agg_s = (size / 4) as f64 / agg_elements_per_s;
    // One worker and one server: iteration = transfer + aggregation + overhead.
    let transfer_s = (big.iter_ms_p50 / 1e3 - agg_s - overhead_s).max(1e-6);
    let bw = size as f64 / transfer_s;
    let mut model = ClusterModel {
        server_bytes_per_s: bw,
        worker_bytes_per_s: bw,
        agg_elements_per_s,
        iteration_overhead_s: overhead_s,
        worker_overhead_s: 0.0,
        migration_bytes_per_s: mig.migration_gbytes_per_s * 1e9,
        ..ClusterModel::default()
    };
    step("a live job rescaled every 1.5 s (1 to 4 workers, 1 or 2 servers, up and down): its start, its pauses, its iterations");
    let fit = live_job(if quick { 8.0 } else { 24.0 }, &model)?;
    model.iteration_overhead_s += fit.extra_s;
    model.worker_overhead_s = fit.per_worker_s;
    model.rescale_pause_s = fit.rescale_pause_s;
    model.start_pause_s = fit.start_pause_s;
    Ok(Calibration {
        model,
        size,
        big_ms: big.iter_ms_p50,
        tiny_ms: tiny.iter_ms_p50,
        sum_gbytes_per_s: sum.gbytes_per_s,
        migration_gbytes_per_s: mig.migration_gbytes_per_s,
        fit,
    })
}

/// Rescales its one job through a fixed cycle of allocations, one step every
/// `every_s` seconds.
struct Cycle {
    steps: Vec<Alloc>,
    every_s: f64,
    first: Option<f64>,
}

impl Policy for Cycle {
    fn name(&self) -> &'static str {
        "cycle"
    }

    fn allocate(&mut self, v: &View<'_>) -> Vec<Alloc> {
        let first = *self.first.get_or_insert(v.now_s);
        let k = ((v.now_s - first) / self.every_s) as usize % self.steps.len();
        v.jobs.iter().map(|_| self.steps[k]).collect()
    }
}

/// What the live calibration job measured.
#[derive(Clone, Debug)]
pub struct LiveFit {
    pub start_pause_s: f64,
    pub rescale_pause_s: f64,
    pub rescales: usize,
    /// Median time an iteration with one worker took beyond `model`'s.
    pub extra_s: f64,
    /// Median time each further worker added beyond that.
    pub per_worker_s: f64,
    /// Allocations timed.
    pub segments: usize,
}

/// Runs one live job for about `secs` seconds, rescaled every 1.5 s through
/// servers and workers, up and down. Returns the medians of its start delay
/// (less one iteration) and of its rescales' pauses, and how its iterations
/// compare with `model`'s at each allocation (timed from half a second after
/// the decision to the next).
fn live_job(secs: f64, model: &ClusterModel) -> Result<LiveFit, String> {
    // As the jobs of bench/traces/live.csv at --time-scale 0.2: 512 kB,
    // 12.8 ms of compute per iteration (32 samples, slept), transfers small.
    let batch = 32u32;
    let rate = f64::from(batch) / 14e-3 * 2.0;
    let samples = (rate * secs) as u64;
    let job = eps_sched::JobSpec::test("calibrate", 0.0, 512_000, 0.4, batch, samples, samples, true, (1, 4), (1, 2));
    let a = |workers, servers| Alloc { workers, servers };
    let steps = vec![a(1, 1), a(2, 1), a(4, 2), a(2, 2), a(1, 2), a(4, 1)];
    let mut cycle = Cycle { steps, every_s: 1.5, first: None };
    let cfg = eps_cluster::live::Config {
        slots: 6,
        nodes: Vec::new(),
        model: model.clone(),
        timing: eps_sched::Timing { tick_s: 0.1, min_interval_s: 0.0 },
        launcher: eps_cluster::live::launcher::by_name("local").expect("local"),
        verbose: false,
    };
    let run = eps_cluster::live::run(&mut eps_cluster::live::Trace::new(vec![job.clone()]), &cfg, &mut cycle, 0.0)?;
    let j = run.jobs.first().ok_or("the calibration job did not run")?;
    if let Some(e) = &j.error {
        return Err(format!("the calibration job failed: {e}"));
    }
    // Each allocation's iterations, against the model's.
    let mut residual: Vec<(u32, f64)> = Vec::new();
    let end = j.points.last().map_or(0.0, |p| p.0);
    for (k, &(from, alloc)) in j.allocs.iter().enumerate() {
        let to = j.allocs.get(k + 1).map_or(end, |n| n.0);
        let seg: Vec<&(f64, u64)> = j.points.iter().filter(|p| p.0 >= from + 0.5 && p.0 <= to).collect();
        if let (Some(f), Some(l)) = (seg.first(), seg.last())
            && seg.len() >= 10
            && l.0 > f.0
        {
            let iterations = (l.1 - f.1) as f64 / f64::from(alloc.workers * batch);
            let measured = (l.0 - f.0) / iterations;
            residual.push((alloc.workers, measured - model.iteration_s(&job, alloc)));
        }
    }
    let one: Vec<f64> = residual.iter().filter(|r| r.0 == 1).map(|r| r.1).collect();
    let extra_s = eps_cluster::live::median(&one).ok_or("the calibration job was never timed on one worker")?.max(0.0);
    let more: Vec<f64> = residual.iter().filter(|r| r.0 > 1).map(|r| (r.1 - extra_s) / f64::from(r.0 - 1)).collect();
    let per_worker_s = eps_cluster::live::median(&more).ok_or("the calibration job was never timed on several workers")?.max(0.0);
    let iteration = model.iteration_s(&job, a(1, 1)) + extra_s;
    let start = eps_cluster::live::median(&run.start_s).ok_or("the calibration job never iterated")?;
    let pause = eps_cluster::live::median(&run.pause_s).ok_or("the calibration job was never rescaled")?;
    Ok(LiveFit {
        start_pause_s: (start - iteration).max(0.0),
        rescale_pause_s: pause,
        rescales: run.pause_s.len(),
        extra_s,
        per_worker_s,
        segments: residual.len(),
    })
}
