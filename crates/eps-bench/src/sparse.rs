//! `eps bench sparse`: pulls and pushes of a sparse table's rows by key
//! through real processes (control plane, servers, workers on 127.0.0.1),
//! zipf-distributed ids over a key space of ROWS, against the fabric's WRITE
//! bandwidth measured in the same run; and what the servers' memory grew by
//! for the rows touched, against those rows' bytes with optimizer state.

use std::collections::HashSet;
use std::time::Instant;

use eps_sparse::zipf::Zipf;
use eps_worker::{Worker, WorkerError};

use crate::fabric::{self, FabricBench, Op};
use eps_cluster::cluster::soft_args;
use eps_cluster::report::{self, Report};
use eps_cluster::{LocalCluster, TrainError};

/// Warm-up iterations before measuring.
const WARMUP: u64 = 2;
/// The table's name in the benchmark's spec.
const TABLE: &str = "emb";

/// Parameters of one run.
#[derive(Clone, Debug)]
pub struct SparseBench {
    /// Size of the key space (ids are drawn from `0..rows`).
    pub rows: u64,
    /// Values per row.
    pub dim: u32,
    /// Ids per batch (with repeats).
    pub keys: u32,
    /// Zipf exponent of the ids.
    pub zipf: f64,
    /// Measured iterations.
    pub iters: u64,
    /// Worker processes.
    pub workers: u32,
    /// Server processes.
    pub servers: u32,
    /// The row-wise optimizer.
    pub optimizer: String,
}

/// What one run measured.
#[derive(Clone, Debug, Default)]
pub struct SparseReport {
    /// Median time of a pull (worker 0), milliseconds.
    pub pull_ms_p50: f64,
    /// Median time of a push until the servers applied it, milliseconds.
    pub push_ms_p50: f64,
    /// Distinct ids of a batch (median).
    pub distinct_p50: f64,
    /// Ids pulled per second (a batch's ids, repeats included, at the median).
    pub pull_keys_per_s: f64,
    /// Rows pulled: distinct rows' bytes per second (1e9 B/s).
    pub pull_gbytes_per_s: f64,
    /// Ids pushed per second.
    pub push_keys_per_s: f64,
    /// Gradient rows pushed: distinct rows' bytes per second.
    pub push_gbytes_per_s: f64,
    /// `eps bench fabric --op write --size 4MiB --depth 8` in the same run.
    pub fabric_write_gbytes_per_s: f64,
    /// Rows the servers hold at the end.
    pub rows_held: u64,
    /// Their bytes with optimizer state.
    pub row_state_bytes: u64,
    /// The servers' resident memory at the end.
    pub server_rss_bytes: u64,
    /// What it grew by from before the first row.
    pub server_rss_growth_bytes: u64,
    /// What the tables say they hold on the heap.
    pub table_heap_bytes: u64,
}

/// Why the benchmark failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SparseBenchError {
    /// Bad parameters.
    #[error("invalid benchmark configuration: {0}")]
    Config(String),
    /// The cluster failed.
    #[error(transparent)]
    Cluster(#[from] TrainError),
    /// The fabric reference failed.
    #[error(transparent)]
    Fabric(#[from] fabric::BenchError),
    /// Workers or servers did not report.
    #[error("{0} did not report")]
    NoReport(&'static str),
}

/// The worker side of `--bench-sparse ITERS,KEYS,ROWS,ZIPF`: warm up, then
/// time `iters` pulls and pushes of a batch of zipf ids (and a small dense
/// push_pull each step); prints a `Bench` report (pull_ms, push_ms,
/// distinct: medians).
pub fn run_worker<P: eps_fabric::Fabric>(mut w: Worker<P>, args: &str) -> Result<(), WorkerError> {
    let bad = || WorkerError::Unsupported("--bench-sparse takes ITERS,KEYS,ROWS,ZIPF");
    let v: Vec<&str> = args.split(',').collect();
    let [iters, keys, rows, zipf] = v[..] else { return Err(bad()) };
    let (iters, keys, rows): (u64, usize, u64) =
        (iters.parse().map_err(|_| bad())?, keys.parse().map_err(|_| bad())?, rows.parse().map_err(|_| bad())?);
    let zipf: f64 = zipf.parse().map_err(|_| bad())?;
    let table = w.table(TABLE)?;
    let dim = w.table_dim(table)?;
    let mut ids = Zipf::new(rows, zipf, u64::from(w.rank())).ok_or_else(bad)?;
    let (mut batch, mut out) = (vec![0u64; keys], vec![0f32; keys * dim]);
    let grads = vec![1e-3f32; keys * dim];
    let (mut pull, mut push, mut distinct) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..WARMUP + iters {
        ids.fill(&mut batch);
        let t = Instant::now();
        w.sparse_pull(table, &batch, &mut out)?;
        let pulled = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        w.sparse_push(table, &batch, &grads)?;
        w.sparse_flush(table)?;
        let pushed = t.elapsed().as_secs_f64() * 1e3;
        w.push_pull()?;
        if i >= WARMUP {
            pull.push(pulled);
            push.push(pushed);
            distinct.push(batch.iter().collect::<HashSet<_>>().len() as f64);
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    Report::Bench(report::Bench {
        rank: w.rank(),
        pull_ms: Some(med(&mut pull)),
        push_ms: Some(med(&mut push)),
        distinct: Some(med(&mut distinct)),
        ..report::Bench::default()
    })
    .print();
    w.finish()?;
    Ok(())
}

/// Runs the benchmark.
pub fn run(cfg: &SparseBench) -> Result<SparseReport, SparseBenchError> {
    if cfg.rows == 0 || cfg.keys == 0 || cfg.iters == 0 || cfg.workers == 0 || cfg.servers == 0 {
        return Err(SparseBenchError::Config("--rows, --keys, --iters, --workers and --servers must be at least 1".into()));
    }
    if !(cfg.zipf.is_finite() && cfg.zipf > 0.0) {
        return Err(SparseBenchError::Config(format!("--zipf {}: the exponent must be a positive number", cfg.zipf)));
    }
    let text = format!(
        "[job]\nname = \"sparse\"\nworkers = {}\nservers = {}\nsteps = {}\n\
         [model]\ntensors = [{{ name = \"dense\", elements = 1024 }}]\n\
         [[model.tables]]\nname = \"{TABLE}\"\ndim = {}\noptimizer = \"{}\"\nmax_keys = {}\nlr = 0.01\n",
        cfg.workers,
        cfg.servers,
        cfg.iters + WARMUP,
        cfg.dim,
        cfg.optimizer,
        cfg.keys
    );
    let spec = eps_proto::JobSpec::from_toml(&text).map_err(|e| SparseBenchError::Config(e.to_string()))?;
    let reference = FabricBench { op: Op::Write, size: 4 << 20, iters: 300, depth: 8 };
    let fabric_before = fabric::run(&reference)?;
    let arg = format!("{},{},{},{}", cfg.iters, cfg.keys, cfg.rows, cfg.zipf);
    let cluster = LocalCluster::start(&spec, &text, &["--bench-sparse", &arg], &soft_args())?;
    let (mut worker0, mut servers) = (None, Vec::new());
    cluster.supervise(None, |l| match Report::parse(l) {
        Some(Report::Bench(b)) if b.rank == 0 => worker0 = Some(b),
        Some(Report::ServerSparse(s)) => servers.push(s),
        _ => {}
    })?;
    let fabric_after = fabric::run(&reference)?;
    let w = worker0.ok_or(SparseBenchError::NoReport("worker 0"))?;
    if servers.len() != cfg.servers as usize {
        return Err(SparseBenchError::NoReport("every server"));
    }
    let sum = |k: fn(&report::ServerSparse) -> u64| servers.iter().map(k).sum::<u64>();
    let (pull_ms, push_ms, distinct) = (w.pull_ms.unwrap_or(0.0), w.push_ms.unwrap_or(0.0), w.distinct.unwrap_or(0.0));
    let row_bytes = distinct * f64::from(cfg.dim) * 4.0;
    Ok(SparseReport {
        pull_ms_p50: pull_ms,
        push_ms_p50: push_ms,
        distinct_p50: distinct,
        pull_keys_per_s: f64::from(cfg.keys) / (pull_ms / 1e3),
        pull_gbytes_per_s: row_bytes / (pull_ms / 1e3) / 1e9,
        push_keys_per_s: f64::from(cfg.keys) / (push_ms / 1e3),
        push_gbytes_per_s: row_bytes / (push_ms / 1e3) / 1e9,
        fabric_write_gbytes_per_s: 0.5 * (fabric_before.bw_gbytes_per_s + fabric_after.bw_gbytes_per_s),
        rows_held: sum(|s| s.rows),
        row_state_bytes: sum(|s| s.row_state_bytes),
        server_rss_bytes: sum(|s| s.rss_end_bytes),
        server_rss_growth_bytes: sum(|s| s.rss_end_bytes).saturating_sub(sum(|s| s.rss_start_bytes)),
        table_heap_bytes: sum(|s| s.heap_bytes),
    })
}
