//! `eps bench pushpull`: iterations of push + pull of a model of SIZE bytes through
//! real processes (control plane, servers, workers on 127.0.0.1), against the
//! fabric's WRITE bandwidth (on the same transport) measured in the same run;
//! below 1 MiB, where a round is latency rather than bandwidth, also against a
//! 64-byte TCP ping-pong on loopback, polling and blocking ([`crate::pingpong`]).

use std::time::Instant;

use eps_worker::{Worker, WorkerError};

use crate::fabric::{self, FabricBench, Op};
use crate::pingpong::{self, PingPong, Wait};
use eps_cluster::cluster::soft_args;
use eps_cluster::report::{self, Report};
use eps_cluster::{LocalCluster, TrainError};

/// Warm-up iterations before measuring.
const WARMUP: u64 = 3;
/// Below this model size the latency references are measured too.
pub const LATENCY_BELOW: u64 = 1 << 20;
/// Round trips of each ping-pong reference.
const PINGPONG_ROUNDS: usize = 5_000;

/// Parameters of one run.
#[derive(Clone, Debug)]
pub struct PushPullBench {
    /// Model bytes (f32).
    pub size: u64,
    /// Worker processes.
    pub workers: u32,
    /// Server processes.
    pub servers: u32,
    /// Measured iterations.
    pub iters: u64,
    /// Target shard size.
    pub shard_bytes: u64,
    /// On the shm transport (else soft).
    pub shm: bool,
}

/// What one run measured.
#[derive(Clone, Debug)]
pub struct PushPullReport {
    /// Median iteration time (worker 0), milliseconds.
    pub iter_ms_p50: f64,
    /// 99th percentile of the iteration time (worker 0), milliseconds.
    pub iter_ms_p99: f64,
    /// Below [`LATENCY_BELOW`]: a 64-byte TCP ping-pong on loopback with both
    /// ends polling, and with both blocking, in the same run (the mean of one
    /// run before the cluster and one after).
    pub pingpong: Option<(PingPong, PingPong)>,
    /// Gradient bytes pushed plus parameter bytes pulled, per worker per second, at
    /// the median iteration time (1e9 B/s).
    pub gbytes_per_s: f64,
    /// `eps bench fabric --op write --size 4MiB --depth 8` (same transport) in the same run.
    pub fabric_write_gbytes_per_s: f64,
    /// What the metrics cost a worker per round, nanoseconds: the recording
    /// its rounds do (bytes counted per shard pushed and pulled, the round's
    /// latency into its histogram, the iteration counter and gauges), timed
    /// alone on this machine in the same run.
    pub metrics_ns_per_round: f64,
}

/// Why the benchmark failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PushPullError {
    /// Bad parameters.
    #[error("invalid benchmark configuration: {0}")]
    Config(&'static str),
    /// The cluster failed.
    #[error(transparent)]
    Cluster(#[from] TrainError),
    /// The fabric reference failed.
    #[error(transparent)]
    Fabric(#[from] fabric::BenchError),
    /// The ping-pong reference failed.
    #[error("the TCP ping-pong reference: {0}")]
    PingPong(#[from] std::io::Error),
    /// Workers did not report.
    #[error("the workers did not report their timings")]
    NoReport,
}

/// The worker side: join, warm up, then time `iters` push_pull calls; prints
/// a `Bench` report (p50, p99, min and max in milliseconds).
pub fn run_worker<P: eps_fabric::Fabric>(mut w: Worker<P>, iters: u64) -> Result<(), WorkerError> {
    for _ in 0..WARMUP {
        w.push_pull()?;
    }
    let mut ms = Vec::with_capacity(iters as usize);
    for _ in 0..iters {
        let t = Instant::now();
        w.push_pull()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(|a, b| a.total_cmp(b));
    Report::Bench(report::Bench {
        rank: w.rank(),
        p50_ms: Some(ms[ms.len() / 2]),
        p99_ms: Some(ms[((ms.len() - 1) as f64 * 0.99).round() as usize]),
        min_ms: Some(ms[0]),
        max_ms: Some(ms[ms.len() - 1]),
        ..report::Bench::default()
    })
    .print();
    w.finish()?;
    Ok(())
}

/// The metrics' recording of one worker round over `shards` shards, timed
/// alone (median of 5 batches of 20,000 rounds), in nanoseconds.
pub fn metrics_cost(shards: usize) -> f64 {
    let r = eps_metrics::Registry::default();
    let l: &[(&str, &str)] = &[("job", "bench"), ("rank", "0")];
    let (pushed, pulled) = (r.counter("pushed_total", "", l), r.counter("pulled_total", "", l));
    let (rounds, iterations) = (r.histogram("round_seconds", "", l), r.counter("iterations_total", "", l));
    let (iteration, epoch) = (r.gauge("iteration", "", l), r.gauge("epoch", "", l));
    const ROUNDS: u64 = 20_000;
    let mut batches: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            for i in 0..ROUNDS {
                for _ in 0..shards {
                    pushed.add(std::hint::black_box(4096));
                    pulled.add(std::hint::black_box(4096));
                }
                rounds.observe(std::time::Duration::from_micros(std::hint::black_box(500 + i % 1000)));
                iterations.inc();
                iteration.set(i as f64);
                epoch.set(1.0);
            }
            t.elapsed().as_nanos() as f64 / ROUNDS as f64
        })
        .collect();
    batches.sort_by(|a, b| a.total_cmp(b));
    batches[2]
}

/// Runs the benchmark.
pub fn run(cfg: &PushPullBench) -> Result<PushPullReport, PushPullError> {
    if cfg.size < 4096 || cfg.size % 4 != 0 || cfg.size > 4 << 30 {
        return Err(PushPullError::Config("--size must be a multiple of 4 between 4KiB and 4GiB"));
    }
    if cfg.shard_bytes < 4096 {
        return Err(PushPullError::Config("--shard-bytes must be at least 4KiB"));
    }
    if cfg.workers == 0 || cfg.servers == 0 || cfg.iters == 0 {
        return Err(PushPullError::Config("--workers, --servers and --iters must be at least 1"));
    }
    let text = format!(
        "[job]\nname = \"pushpull\"\nworkers = {}\nservers = {}\nsteps = {}\nshard_bytes = {}\n\
         [model]\ntensors = [{{ name = \"params\", elements = {} }}]\n[optimizer]\nkind = \"sgd\"\nlr = 0.0001\n",
        cfg.workers,
        cfg.servers,
        cfg.iters + WARMUP,
        cfg.shard_bytes.min(cfg.size.div_ceil(4096) * 4096),
        cfg.size / 4
    );
    let spec = eps_proto::JobSpec::from_toml(&text).map_err(TrainError::from)?;
    let reference = || {
        let f = FabricBench { op: Op::Write, size: 4 << 20, iters: 300, depth: 8 };
        if cfg.shm { fabric::run_shm(&f) } else { fabric::run(&f) }
    };
    let latency = || -> Result<Option<(PingPong, PingPong)>, PushPullError> {
        if cfg.size >= LATENCY_BELOW {
            return Ok(None);
        }
        Ok(Some((pingpong::run(PINGPONG_ROUNDS, Wait::Poll)?, pingpong::run(PINGPONG_ROUNDS, Wait::Block)?)))
    };
    let fabric_before = reference()?;
    let latency_before = latency()?;
    let iters = cfg.iters.to_string();
    let mut children = soft_args();
    if cfg.shm {
        children.both = vec!["--transport".into(), "shm".into()];
    }
    let cluster = LocalCluster::start(&spec, &text, &["--bench-iters", &iters], &children)?;
    let (mut p50, mut p99) = (None, None);
    cluster.supervise(None, |l| {
        if let Some(Report::Bench(b)) = Report::parse(l)
            && b.rank == 0
        {
            (p50, p99) = (b.p50_ms, b.p99_ms);
        }
    })?;
    let fabric_after = reference()?;
    let latency_after = latency()?;
    let iter_ms_p50 = p50.ok_or(PushPullError::NoReport)?;
    let mean = |a: PingPong, b: PingPong| PingPong { p50_us: 0.5 * (a.p50_us + b.p50_us), p99_us: 0.5 * (a.p99_us + b.p99_us) };
    let pingpong = match (latency_before, latency_after) {
        (Some(b), Some(a)) => Some((mean(b.0, a.0), mean(b.1, a.1))),
        _ => None,
    };
    let shards = spec.layout().map_or(1, |l| l.shards.len());
    Ok(PushPullReport {
        metrics_ns_per_round: metrics_cost(shards),
        iter_ms_p50,
        iter_ms_p99: p99.unwrap_or(f64::NAN),
        pingpong,
        gbytes_per_s: 2.0 * cfg.size as f64 / (iter_ms_p50 / 1e3) / 1e9,
        fabric_write_gbytes_per_s: 0.5 * (fabric_before.bw_gbytes_per_s + fabric_after.bw_gbytes_per_s),
    })
}
