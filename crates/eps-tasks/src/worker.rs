//! The training loop each `eps worker` process runs on the built-in task, and the
//! reports it prints for the `eps train` driver (`eps_cluster::report`).

use std::time::Instant;

use eps_worker::{Worker, WorkerError};
use sha2::{Digest, Sha256};

use crate::task::{Sample, Task};
use eps_cluster::report::{self, Report};

/// First sample index of the held-out set (far beyond any training index).
pub const HELD_OUT_FIRST: u64 = 1 << 50;
/// Held-out samples evaluated at the end.
pub const HELD_OUT: u64 = 20_000;

/// Hex SHA-256 (first 16 bytes) of the final parameters in the wire dtype.
pub fn checksum(bytes: &[u8]) -> String {
    Sha256::digest(bytes)[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// Contributor sets by iteration as `FIRST:R,R,...;FIRST:R,...`.
pub fn membership_text(m: &eps_proto::membership::Membership) -> String {
    m.to_text()
}

/// Parses [`membership_text`].
pub fn parse_membership(text: &str) -> Option<eps_proto::membership::Membership> {
    eps_proto::membership::Membership::parse_text(text)
}

/// Why the worker could not train.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainWorkerError {
    /// The data plane failed.
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// A contributor without samples (the membership schedule is inconsistent).
    #[error("no training samples for this worker at iteration {0}")]
    NoSamples(u64),
    /// The job has no built-in task to run.
    #[error(
        "this job declares its own tensors; `eps worker` only runs the built-in synthetic task (use the eps-worker library or libeps for other models)"
    )]
    NoTask,
    /// The job's `[task]` is not one this command knows.
    #[error(transparent)]
    Task(#[from] eps_proto::SpecError),
}

/// How a worker paces its training and reports it.
#[derive(Clone, Copy, Debug)]
pub struct Pace {
    /// Rank 0 prints progress every this many steps.
    pub every: u64,
    /// Stop at the first iteration boundary where the job (all its workers)
    /// has trained this many samples, if before `job.steps`.
    pub until_samples: Option<u64>,
    /// Each step's computation takes at least this many milliseconds per sample
    /// of the worker's batch (the rest of the time slept): an accelerator's
    /// compute time, for the scheduler's live runs.
    pub compute_ms_per_sample: f64,
    /// Every this many milliseconds (0: never), a `Latency` report with the
    /// push_pull latencies of the interval (`eps soak` plots them).
    pub latency_every_ms: u64,
    /// The evaluating rank's `Done` report adds a digest per `shard_bytes` of
    /// parameters (`eps soak` compares them with a fault-free run's).
    pub chunk_digests: bool,
}

impl Pace {
    /// Progress every `every` steps, no other pacing.
    pub fn every(every: u64) -> Self {
        Self { every, until_samples: None, compute_ms_per_sample: 0.0, latency_every_ms: 0, chunk_digests: false }
    }
}

/// Push_pull latencies in microseconds: the whole run's, and those since the
/// last `Latency` report.
struct Latency {
    all: hdrhistogram::Histogram<u64>,
    recent: hdrhistogram::Histogram<u64>,
    every: Option<std::time::Duration>,
    last: Instant,
}

impl Latency {
    fn new(every_ms: u64) -> Self {
        // 1 us to 10 min, 2 significant digits.
        let h = || hdrhistogram::Histogram::new_with_bounds(1, 600_000_000, 2).expect("valid histogram bounds");
        let every = (every_ms > 0).then(|| std::time::Duration::from_millis(every_ms));
        Self { all: h(), recent: h(), every, last: Instant::now() }
    }

    fn record(&mut self, rank: u32, took: std::time::Duration, since_start: f64) {
        let us = (took.as_micros() as u64).clamp(1, 600_000_000);
        self.all.saturating_record(us);
        let Some(every) = self.every else { return };
        self.recent.saturating_record(us);
        if self.last.elapsed() >= every {
            let r = &self.recent;
            Report::Latency(report::Latency {
                rank,
                t_s: since_start,
                n: r.len(),
                p50_us: r.value_at_quantile(0.5),
                p99_us: r.value_at_quantile(0.99),
                max_us: r.max(),
            })
            .print();
            self.recent.reset();
            self.last = Instant::now();
        }
    }
}

/// SHA-256 (first 4 bytes, hex) of each `chunk`-byte piece of `bytes`, joined
/// by commas: which parts of two runs' parameters differ.
pub fn chunk_digests(bytes: &[u8], chunk: usize) -> String {
    let d: Vec<String> =
        bytes.chunks(chunk.max(1)).map(|c| Sha256::digest(c)[..4].iter().map(|b| format!("{b:02x}")).collect()).collect();
    d.join(",")
}

/// A worker's `Done` report: what it trained and moved.
pub fn done<P: eps_fabric::Fabric>(w: &Worker<P>, first_step: u64, left: bool, trained: u64, elapsed: f64) -> report::Done {
    let st = w.stats();
    report::Done {
        rank: w.rank(),
        steps: w.iteration() - first_step,
        first_step,
        left,
        samples: trained,
        elapsed_s: elapsed,
        pushed: st.pushed_bytes,
        pulled: st.pulled_bytes,
        comm_s: st.comm.as_secs_f64(),
        latency_us: None,
        result: None,
    }
}

/// Rank 0 (the lowest-ranked contributor of `step`: rank 0 unless it left or
/// died) prints a `Progress` report after every `every` steps: the loss
/// and accuracy over the samples since the last one (`(loss sum, correct,
/// seen)`). Returns whether it did.
pub fn report_progress<P: eps_fabric::Fabric>(
    w: &Worker<P>,
    step: u64,
    every: u64,
    batch: u64,
    (loss_sum, correct, seen): (f64, u64, u64),
    start: Instant,
) -> bool {
    if w.membership().contributors(step).first() != Some(&w.rank()) || (step + 1) % every != 0 {
        return false;
    }
    let st = w.stats();
    Report::Progress(report::Progress {
        step: step + 1,
        samples: w.membership().samples_before(step + 1, batch).unwrap_or(u64::MAX),
        loss: loss_sum / seen.max(1) as f64,
        acc: correct as f64 / seen.max(1) as f64,
        elapsed_s: start.elapsed().as_secs_f64(),
        pushed: st.pushed_bytes,
        pulled: st.pulled_bytes,
        workers: w.membership().contributors(step).len() as u64,
    })
    .print();
    true
}

/// Joins the job and trains; prints `Progress` reports every `pace.every`
/// steps (rank 0; `samples=` is the job's samples trained so far) and
/// `Done` at the end (every rank; rank 0 adds the evaluation).
pub fn run<P: eps_fabric::Fabric>(mut w: Worker<P>, pace: Pace) -> Result<(), TrainWorkerError> {
    let every = pace.every.max(1);
    let spec = w.spec().clone();
    let Some(t) = eps_cluster::jobspec::TaskSection::of(&spec)? else {
        return Err(TrainWorkerError::NoTask);
    };
    if t.kind == "ctr" {
        return crate::ctr_worker::run(w, pace);
    }
    let task = Task::new(&t, spec.job.seed);
    let (rank, batch) = (w.rank(), spec.job.batch as u64);
    let compute = std::time::Duration::from_secs_f64(pace.compute_ms_per_sample.max(0.0) * 1e-3 * batch as f64);
    let n = w.layout().total as usize;
    let f32_job = w.dtype() == eps_agg::DType::F32;
    // Staging only for 16-bit dtypes, where the wire format needs a conversion pass.
    let mut p_stage = vec![0f32; n];
    let mut g_stage = if f32_job { Vec::new() } else { vec![0f32; n] };
    let mut sample = Sample::default();
    let mut z = vec![0f32; task.classes];
    let start = Instant::now();
    let first_step = w.iteration();
    let (mut loss_sum, mut correct, mut seen) = (0f64, 0u64, 0u64);
    let mut trained = 0u64;
    let scale = 1.0 / batch as f32;
    let mut left = false;
    let mut lat = Latency::new(pace.latency_every_ms);
    let job_done = |w: &Worker<P>| {
        let it = w.iteration();
        it >= spec.job.steps
            || pace.until_samples.is_some_and(|n| w.membership().samples_before(it, batch).is_none_or(|s| s >= n))
    };
    while !job_done(&w) {
        // Membership changes take effect here: a worker scaled away leaves at this
        // boundary; samples are dealt out to this iteration's contributors.
        if !w.begin()? {
            left = true;
            break;
        }
        let step = w.iteration();
        let samples = w.samples(batch).ok_or(TrainWorkerError::NoSamples(step))?;
        let step_start = Instant::now();
        trained += batch;
        let mut step_batch = |p: &[f32], g: &mut [f32]| {
            g.fill(0.0);
            for i in samples.clone() {
                task.sample(i, &mut sample);
                let (l, ok) = task.backward(p, &sample, scale, g, &mut z);
                loss_sum += l as f64;
                correct += ok as u64;
                seen += 1;
            }
        };
        if f32_job {
            // The parameters are copied out of the buffer servers write; the
            // gradients are computed in place in the worker's own buffer.
            w.read_params(&mut p_stage)?;
            step_batch(&p_stage, w.grads_f32_mut().expect("f32 job"));
        } else {
            w.read_params(&mut p_stage)?;
            step_batch(&p_stage, &mut g_stage);
            w.write_grads(&g_stage)?;
        }
        if let Some(rest) = compute.checked_sub(step_start.elapsed()) {
            std::thread::sleep(rest);
        }
        let pp = Instant::now();
        w.push_pull()?;
        lat.record(rank, pp.elapsed(), start.elapsed().as_secs_f64());
        // The lowest-ranked contributor reports (rank 0 unless it left or died).
        if report_progress(&w, step, every, batch, (loss_sum, correct, seen), start) {
            (loss_sum, correct, seen) = (0.0, 0, 0);
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let mut d = done(&w, first_step, left, trained, elapsed);
    d.latency_us =
        Some(report::Quantiles { p50: lat.all.value_at_quantile(0.5), p99: lat.all.value_at_quantile(0.99), max: lat.all.max() });
    if left {
        eps_proto::say!("eps worker {rank}: left the job at iteration {} (scaled away)", w.iteration());
    }
    // The lowest-ranked contributor of the last iteration evaluates the result.
    let last = w.iteration().saturating_sub(1);
    if !left && w.membership().contributors(last).first() == Some(&rank) {
        let mut p = vec![0f32; n];
        w.read_params(&mut p)?;
        let (acc, teacher) = task.evaluate(&p, HELD_OUT_FIRST, HELD_OUT);
        // Held-out loss.
        let mut loss = 0f64;
        for i in HELD_OUT_FIRST..HELD_OUT_FIRST + 2_000 {
            task.sample(i, &mut sample);
            loss += task.loss(&p, &sample, &mut z) as f64;
        }
        d.result = Some(report::Evaluation {
            membership: membership_text(w.membership()),
            final_loss: loss / 2_000.0,
            final_accuracy: acc,
            teacher_accuracy: teacher,
            params_checksum: checksum(&w.params_copy()),
            chunk_digests: pace.chunk_digests.then(|| chunk_digests(&w.params_copy(), spec.job.shard_bytes as usize)),
            ..report::Evaluation::default()
        });
    }
    Report::Done(Box::new(d)).print();
    w.finish()?;
    Ok(())
}
