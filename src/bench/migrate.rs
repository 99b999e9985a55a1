//! `eps bench migrate`: a worker pulls one shard of SHARD bytes over and over while
//! the job grows from one server process to two and the shard migrates onto the
//! new one (snapshot, forwarded updates, cutover, release), all on 127.0.0.1.
//!
//! The worker trains (one `push_pull` per step, so versions advance and the
//! migration can cut over) and between steps pulls the shard `pulls_per_step`
//! times with [`Worker::pull_shard`], timing each pull. A thread of this process
//! triggers the scale event and follows the migration's phases through the control
//! plane's status every 2 ms. Pull latencies are split into steady (before the
//! migration appeared) and during (from its first phase to its release); the
//! fabric's 4 MiB WRITE bandwidth is measured in the same run, before and after.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use eps_control::{ControlClient, ControlError};
use eps_fabric::Secret;
use eps_proto::control::ControlMsg;
use eps_worker::{Worker, WorkerConfig, WorkerError};

use crate::bench::fabric::{self, FabricBench, Op};
use crate::train::{LocalCluster, TrainError, field, num};

/// Parameters of one run.
#[derive(Clone, Debug)]
pub struct MigrateBench {
    /// Bytes of the migrating shard (f32 parameters, SGD).
    pub shard_bytes: u64,
    /// Training steps before the scale event.
    pub steady_steps: u64,
    /// Steps after it (the migration must end within them).
    pub after_steps: u64,
    /// Timed pulls of the shard between two training steps.
    pub pulls_per_step: u32,
}

impl Default for MigrateBench {
    fn default() -> Self {
        Self { shard_bytes: 64 << 20, steady_steps: 40, after_steps: 40, pulls_per_step: 4 }
    }
}

/// The migration's phases as the control plane reported them (UNIX microseconds of
/// the first status poll that showed each).
#[derive(Clone, Copy, Debug, Default)]
pub struct Phases {
    /// The scale request was accepted.
    pub requested_us: u64,
    /// The target registers the shard's memory.
    pub preparing_us: u64,
    /// The source sends the snapshot.
    pub copying_us: u64,
    /// Cutover announced: forwarding until the cutover iteration.
    pub cutover_us: u64,
    /// The source released the shard.
    pub done_us: u64,
    /// Bytes the source sent (snapshot + forwarded updates), as it reported them.
    pub bytes: u64,
    /// Snapshot bytes (f32 parameters; SGD has no optimizer state).
    pub snapshot_bytes: u64,
}

/// What one run measured.
#[derive(Clone, Debug, Default)]
pub struct MigrateReport {
    /// Timed pulls.
    pub pulls: u64,
    /// Pulls that failed (must be 0).
    pub pulls_failed: u64,
    /// The first failure, if any.
    pub failure: Option<String>,
    /// Pulls before the migration, and their p50 / p99 latency (us).
    pub steady_pulls: u64,
    pub pull_lat_us_p50_steady: f64,
    pub pull_lat_us_p99_steady: f64,
    /// Pulls that started while the migration was in flight, their p99 and max (us).
    pub during_pulls: u64,
    pub pull_lat_us_p99_during: f64,
    pub pull_lat_us_max_during: f64,
    /// From the migration's first phase to its release.
    pub migration_ms: f64,
    /// Phase durations.
    pub preparing_ms: f64,
    pub copying_ms: f64,
    pub cutover_ms: f64,
    /// Bytes the source sent / `migration_ms`.
    pub migration_gbytes_per_s: f64,
    /// Snapshot bytes / `copying_ms` (the state transfer alone).
    pub snapshot_gbytes_per_s: f64,
    /// `eps bench fabric --op write --size 4MiB --depth 8`, mean of before and after.
    pub fabric_write_gbytes_per_s: f64,
    /// Every timed pull: (start, UNIX us; latency, us).
    pub samples: Vec<(u64, u64)>,
    /// The phases.
    pub phases: Phases,
}

/// Why the benchmark failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrateError {
    /// Bad parameters.
    #[error("invalid benchmark configuration: {0}")]
    Config(String),
    /// The cluster failed.
    #[error(transparent)]
    Cluster(#[from] TrainError),
    /// The fabric reference failed.
    #[error(transparent)]
    Fabric(#[from] fabric::BenchError),
    /// The scale event or the migration went wrong.
    #[error("the migration: {0}")]
    Migration(String),
    /// The worker did not report.
    #[error("the worker did not report its pulls")]
    NoReport,
}

fn unix_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// The worker side: train `spec.job.steps` steps, timing `pulls` pulls of shard 0
/// after each; prints `EPS_PROGRESS step=N` per step and at the end
/// `EPS_PULLS failed=F error=.. samples=T:L,T:L,...`.
pub fn run_worker(cfg: &WorkerConfig, pulls: u32) -> Result<(), WorkerError> {
    let mut w = Worker::join(cfg)?;
    let steps = w.spec().job.steps;
    let mut samples = String::new();
    let mut failure: Option<String> = None;
    'steps: for step in 0..steps {
        w.push_pull()?;
        for _ in 0..pulls {
            let (at, t) = (unix_us(), Instant::now());
            if let Err(e) = w.pull_shard(0) {
                failure = Some(crate::roles::crate_error(&e));
                break 'steps;
            }
            let lat = t.elapsed().as_micros() as u64;
            samples.push_str(&format!("{at}:{lat},"));
        }
        println!("EPS_PROGRESS step={}", step + 1);
    }
    let failed = u64::from(failure.is_some());
    let why = failure.as_deref().unwrap_or("-").replace(' ', "_");
    println!("EPS_PULLS failed={failed} error={why} samples={}", samples.trim_end_matches(','));
    match failure {
        None => w.finish().map(|_| ()),
        // Exit non-zero so the cluster stops; the driver still reads the line.
        Some(_) => Err(WorkerError::Timeout("a pull during the benchmark (see the EPS_PULLS line)")),
    }
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i] as f64
}

/// Runs the benchmark.
pub fn run(cfg: &MigrateBench) -> Result<MigrateReport, MigrateError> {
    if cfg.shard_bytes < 4096 || cfg.shard_bytes % 4096 != 0 || cfg.shard_bytes > 4 << 30 {
        return Err(MigrateError::Config("--shard-bytes must be a multiple of 4KiB between 4KiB and 4GiB".into()));
    }
    if cfg.pulls_per_step == 0 || cfg.steady_steps < 5 || cfg.after_steps < 10 {
        return Err(MigrateError::Config("need at least 1 pull per step, 5 steady steps and 10 steps after".into()));
    }
    // Shard 0 is the big one; a 4 KiB second shard makes one move balance the
    // bytes when the second server joins.
    let elements = cfg.shard_bytes / 4 + 1024;
    let text = format!(
        "[job]\nname = \"migrate\"\nworkers = 1\nservers = 1\nsteps = {}\nshard_bytes = {}\n\
         [model]\ntensors = [{{ name = \"params\", elements = {elements} }}]\n[optimizer]\nkind = \"sgd\"\nlr = 0.0001\n",
        cfg.steady_steps + cfg.after_steps,
        cfg.shard_bytes,
    );
    let spec = eps_proto::JobSpec::from_toml(&text).map_err(TrainError::from)?;
    let fabric_before = fabric::run(&FabricBench { op: Op::Write, size: 4 << 20, iters: 300, depth: 8 })?;
    let pulls = cfg.pulls_per_step.to_string();
    let cluster = LocalCluster::start(&spec, &text, &["--bench-migrate", &pulls])?;
    let control: SocketAddr =
        cluster.control_addr().parse().map_err(|_| MigrateError::Migration("bad control-plane address".into()))?;
    let secret = Secret::new(cluster.secret()).map_err(|_| MigrateError::Migration("bad job secret".into()))?;
    let step = Arc::new(AtomicU64::new(0));
    let (tx, more_servers) = std::sync::mpsc::channel();
    let phases = Arc::new(Mutex::new(Err("the scale event did not happen".to_string())));
    {
        let (step, phases, steady) = (step.clone(), phases.clone(), cfg.steady_steps);
        std::thread::spawn(move || {
            let r = follow(control, &secret, steady, &step, &tx);
            *phases.lock().unwrap_or_else(|p| p.into_inner()) = r;
        });
    }
    let mut line = None;
    let ran = cluster.supervise(Some(&more_servers), |l| {
        if l.starts_with("EPS_PROGRESS") {
            step.store(num(l, "step") as u64, Ordering::Release);
        } else if l.starts_with("EPS_PULLS") {
            line = Some(l.to_string());
        }
    });
    let line = match (ran, line) {
        (Ok(()), Some(l)) => l,
        // A failed pull stops the worker (and so the cluster): report it.
        (Err(_), Some(l)) if num(&l, "failed") > 0.0 => l,
        (Err(e), _) => return Err(e.into()),
        (Ok(()), None) => return Err(MigrateError::NoReport),
    };
    let fabric_after = fabric::run(&FabricBench { op: Op::Write, size: 4 << 20, iters: 300, depth: 8 })?;
    let failed = num(&line, "failed") as u64;
    let mut ph = match phases.lock().unwrap_or_else(|p| p.into_inner()).clone() {
        Ok(p) => p,
        Err(_) if failed > 0 => Phases { preparing_us: u64::MAX, done_us: u64::MAX, ..Phases::default() },
        Err(e) => return Err(MigrateError::Migration(e)),
    };
    ph.snapshot_bytes = cfg.shard_bytes;
    let samples: Vec<(u64, u64)> = field(&line, "samples")
        .unwrap_or("")
        .split(',')
        .filter_map(|x| x.split_once(':'))
        .filter_map(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
        .collect();
    let mut steady: Vec<u64> = samples.iter().filter(|s| s.0 < ph.preparing_us).map(|s| s.1).collect();
    let mut during: Vec<u64> =
        samples.iter().filter(|s| s.0 >= ph.preparing_us && s.0 <= ph.done_us).map(|s| s.1).collect();
    steady.sort_unstable();
    during.sort_unstable();
    let ms = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e3;
    let migration_ms = ms(ph.preparing_us, ph.done_us);
    let copying_ms = ms(ph.copying_us, ph.cutover_us);
    Ok(MigrateReport {
        pulls: samples.len() as u64 + failed,
        pulls_failed: failed,
        failure: field(&line, "error").filter(|e| *e != "-").map(|e| e.replace('_', " ")),
        steady_pulls: steady.len() as u64,
        pull_lat_us_p50_steady: percentile(&steady, 0.50),
        pull_lat_us_p99_steady: percentile(&steady, 0.99),
        during_pulls: during.len() as u64,
        pull_lat_us_p99_during: percentile(&during, 0.99),
        pull_lat_us_max_during: during.last().copied().unwrap_or(0) as f64,
        migration_ms,
        preparing_ms: ms(ph.preparing_us, ph.copying_us),
        copying_ms,
        cutover_ms: ms(ph.cutover_us, ph.done_us),
        migration_gbytes_per_s: ph.bytes as f64 / (migration_ms / 1e3).max(1e-9) / 1e9,
        snapshot_gbytes_per_s: ph.snapshot_bytes as f64 / (copying_ms / 1e3).max(1e-9) / 1e9,
        fabric_write_gbytes_per_s: 0.5 * (fabric_before.bw_gbytes_per_s + fabric_after.bw_gbytes_per_s),
        samples,
        phases: ph,
    })
}

/// Waits for `steady` steps, scales the job to two servers (starting the new
/// process through `spawn`), then polls the status until shard 0's migration is done.
fn follow(control: SocketAddr, secret: &Secret, steady: u64, step: &AtomicU64, spawn: &Sender<u32>) -> Result<Phases, String> {
    let mut ctl = ControlClient::connect(control, secret, Duration::from_secs(30)).map_err(|e| e.to_string())?;
    while step.load(Ordering::Acquire) < steady {
        std::thread::sleep(Duration::from_millis(2));
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match ctl.call(&ControlMsg::Scale { servers: 2 }) {
            Ok(_) => break,
            Err(ControlError::Rejected(m)) if m.contains("starting") && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(format!("scaling to 2 servers: {e}")),
        }
    }
    let mut ph = Phases { requested_us: unix_us(), ..Phases::default() };
    spawn.send(1).map_err(|_| "the driver is gone".to_string())?;
    eprintln!("eps bench migrate: step {}: scaling 1 -> 2 servers", step.load(Ordering::Acquire));
    while Instant::now() < deadline {
        let Ok(ControlMsg::StatusReport { text }) = ctl.call(&ControlMsg::Status) else {
            return Err("the control plane stopped answering".into());
        };
        let now = unix_us();
        if let Some(l) = text.lines().map(str::trim).find(|l| l.starts_with("shard 0:")) {
            let phase = l.rsplit_once(": ").map_or("", |(_, p)| p);
            let first = |t: &mut u64| {
                if *t == 0 {
                    *t = now;
                }
            };
            first(&mut ph.preparing_us);
            if phase.starts_with("copying") {
                first(&mut ph.copying_us);
            } else if phase.starts_with("cutover") {
                first(&mut ph.copying_us);
                first(&mut ph.cutover_us);
            } else if let Some(rest) = l.split_once(": done, ").map(|(_, r)| r) {
                first(&mut ph.copying_us);
                first(&mut ph.cutover_us);
                ph.done_us = now;
                ph.bytes = rest.split(' ').next().and_then(|b| b.parse().ok()).unwrap_or(0);
                return Ok(ph);
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Err("shard 0 did not finish migrating within 120 s".into())
}
