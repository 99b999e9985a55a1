//! `eps bench migrate`: a worker pulls one shard of SHARD bytes over and over while
//! the shard migrates between server processes on 127.0.0.1 (snapshot, forwarded
//! updates, cutover, release): the job grows from one server to two (the shard
//! moves onto the new one), shrinks back (it moves home), and so on.
//!
//! The worker trains (one `push_pull` per step, so versions advance and each
//! migration can cut over) and between steps pulls the shard `pulls_per_step`
//! times with [`Worker::pull_shard`], timing each pull. A thread of this process
//! triggers the scale events and follows each migration's phases through the
//! control plane's status every 2 ms. Pull latencies are split into steady (before
//! the first migration) and during (from a migration's first phase to its
//! release); the fabric's 4 MiB WRITE bandwidth is measured in the same run, before
//! and after.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use eps_control_client::ControlClient;
use eps_fabric::Secret;
use eps_proto::control::ControlMsg;
use eps_worker::{Worker, WorkerError};

use eps_cluster::scale::Spawn;

use crate::fabric::{self, FabricBench, Op};
use eps_cluster::cluster::soft_args;
use eps_cluster::report::{self, Report};
use eps_cluster::{LocalCluster, TrainError};

/// Parameters of one run.
#[derive(Clone, Debug)]
pub struct MigrateBench {
    /// Bytes of the migrating shard (f32 parameters, SGD).
    pub shard_bytes: u64,
    /// Training steps before the first scale event.
    pub steady_steps: u64,
    /// Migrations of the shard: odd ones onto a new server (scale to 2), even ones
    /// back (scale to 1).
    pub migrations: u32,
    /// Steps from the end of one migration to the next scale event.
    pub gap_steps: u64,
    /// Steps after the last one.
    pub after_steps: u64,
    /// Timed pulls of the shard between two training steps.
    pub pulls_per_step: u32,
}

impl Default for MigrateBench {
    fn default() -> Self {
        Self { shard_bytes: 64 << 20, steady_steps: 40, migrations: 6, gap_steps: 8, after_steps: 20, pulls_per_step: 4 }
    }
}

/// One migration's phases as the control plane reported them (UNIX microseconds of
/// the first status poll that showed each).
#[derive(Clone, Copy, Debug, Default)]
pub struct Phases {
    /// The scale request was accepted (a new server process starts, or the plan
    /// is made).
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
}

impl Phases {
    fn ms(a: u64, b: u64) -> f64 {
        b.saturating_sub(a) as f64 / 1e3
    }

    /// From the first phase to the release.
    pub fn total_ms(&self) -> f64 {
        Self::ms(self.preparing_us, self.done_us)
    }

    /// The target registering memory.
    pub fn preparing_ms(&self) -> f64 {
        Self::ms(self.preparing_us, self.copying_us)
    }

    /// The snapshot transfer (and the source's cutover announcement).
    pub fn copying_ms(&self) -> f64 {
        Self::ms(self.copying_us, self.cutover_us)
    }

    /// Forwarding until the cutover iteration, and the release.
    pub fn cutover_ms(&self) -> f64 {
        Self::ms(self.cutover_us, self.done_us)
    }

    fn covers(&self, at: u64) -> bool {
        at >= self.preparing_us && at <= self.done_us
    }
}

/// What one run measured. Medians over the migrations where several.
#[derive(Clone, Debug, Default)]
pub struct MigrateReport {
    /// Timed pulls.
    pub pulls: u64,
    /// Pulls that failed (must be 0).
    pub pulls_failed: u64,
    /// The first failure, if any.
    pub failure: Option<String>,
    /// Pulls that started before the first scale event.
    pub steady_pulls: u64,
    /// Their p50 latency (us).
    pub pull_lat_us_p50_steady: f64,
    /// Their p99 latency (us).
    pub pull_lat_us_p99_steady: f64,
    /// Pulls that started while a migration was in flight.
    pub during_pulls: u64,
    /// Their p99 latency (us).
    pub pull_lat_us_p99_during: f64,
    /// Their max latency (us).
    pub pull_lat_us_max_during: f64,
    /// Median duration from a migration's first phase to its release.
    pub migration_ms: f64,
    /// Median phase durations.
    pub preparing_ms: f64,
    /// See [`Phases::copying_ms`].
    pub copying_ms: f64,
    /// See [`Phases::cutover_ms`].
    pub cutover_ms: f64,
    /// Median of bytes the source sent / duration.
    pub migration_gbytes_per_s: f64,
    /// Median of snapshot bytes / copying phase (the state transfer alone).
    pub snapshot_gbytes_per_s: f64,
    /// Bytes of the snapshot (f32 parameters; SGD has no optimizer state).
    pub snapshot_bytes: u64,
    /// `eps bench fabric --op write --size 4MiB --depth 8`, mean of before and after.
    pub fabric_write_gbytes_per_s: f64,
    /// Every timed pull: (start, UNIX us; latency, us).
    pub samples: Vec<(u64, u64)>,
    /// Every migration, in order.
    pub migrations: Vec<Phases>,
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
    /// A scale event or a migration went wrong.
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
/// after each; prints a `Progress` report per step and at the end a `Pulls`
/// report (each pull's start and latency, the failure if one failed).
pub fn run_worker<P: eps_fabric::Fabric>(mut w: Worker<P>, pulls: u32) -> Result<(), WorkerError> {
    let steps = w.spec().job.steps;
    let mut samples = Vec::new();
    let mut failure: Option<String> = None;
    'steps: for step in 0..steps {
        w.push_pull()?;
        for _ in 0..pulls {
            let (at, t) = (unix_us(), Instant::now());
            if let Err(e) = w.pull_shard(0) {
                failure = Some(eps_cluster::error::chain(&e));
                break 'steps;
            }
            let lat = t.elapsed().as_micros() as u64;
            samples.push((at, lat));
        }
        Report::Progress(report::Progress { step: step + 1, ..report::Progress::default() }).print();
    }
    Report::Pulls(report::Pulls { samples, failed: failure.clone() }).print();
    match failure {
        None => w.finish().map(|_| ()),
        // Exit non-zero so the cluster stops; the driver still reads the line.
        Some(_) => Err(WorkerError::Timeout("a pull during the benchmark (see the Pulls report)")),
    }
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i] as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the benchmark.
pub fn run(cfg: &MigrateBench) -> Result<MigrateReport, MigrateError> {
    if cfg.shard_bytes < 4096 || cfg.shard_bytes % 4096 != 0 || cfg.shard_bytes > 4 << 30 {
        return Err(MigrateError::Config("--shard-bytes must be a multiple of 4KiB between 4KiB and 4GiB".into()));
    }
    if cfg.pulls_per_step == 0 || cfg.steady_steps < 5 || cfg.after_steps < 5 || cfg.gap_steps < 4 || cfg.migrations == 0 {
        return Err(MigrateError::Config(
            "need at least 1 pull per step, 1 migration, 5 steady steps, 4 steps between migrations and 5 after".into(),
        ));
    }
    // Two shards of SHARD bytes: when the second server joins, moving shard 0
    // whole balances the bytes (no split), and it moves home when it leaves.
    let elements = cfg.shard_bytes / 4 * 2;
    // Each migration's own steps (a new server starting, the move) come on
    // top of the gaps: room for them, whatever the step rate.
    let steps = cfg.steady_steps + u64::from(cfg.migrations) * (cfg.gap_steps + MIGRATION_STEPS) + cfg.after_steps;
    let text = format!(
        "[job]\nname = \"migrate\"\nworkers = 1\nservers = 1\nsteps = {steps}\nshard_bytes = {}\n\
         [model]\ntensors = [{{ name = \"params\", elements = {elements} }}]\n[optimizer]\nkind = \"sgd\"\nlr = 0.0001\n",
        cfg.shard_bytes,
    );
    let spec = eps_proto::JobSpec::from_toml(&text).map_err(TrainError::from)?;
    let fabric_before = fabric::run(&FabricBench { op: Op::Write, size: 4 << 20, iters: 300, depth: 8 })?;
    let pulls = cfg.pulls_per_step.to_string();
    let cluster = LocalCluster::start(&spec, &text, &["--bench-migrate", &pulls], &soft_args())?;
    let control: SocketAddr =
        cluster.control_addr().parse().map_err(|_| MigrateError::Migration("bad control-plane address".into()))?;
    let secret = Secret::new(cluster.secret()).map_err(|_| MigrateError::Migration("bad job secret".into()))?;
    let step = Arc::new(AtomicU64::new(0));
    let (tx, more_servers) = std::sync::mpsc::channel();
    let followed = Arc::new(Mutex::new((Vec::new(), Some("no scale event happened".to_string()))));
    {
        let (step, followed, cfg) = (step.clone(), followed.clone(), cfg.clone());
        std::thread::spawn(move || {
            let mut out = Vec::new();
            let r = follow(control, &secret, &cfg, &step, &tx, &mut out);
            *followed.lock().unwrap_or_else(|p| p.into_inner()) = (out, r.err());
        });
    }
    let mut line = None;
    let bar = eps_cluster::progress::Progress::new(spec.job.steps, "eps bench migrate");
    let ran = cluster.supervise(Some(&more_servers), |l| match Report::parse(l) {
        Some(Report::Progress(p)) => {
            step.store(p.step, Ordering::Release);
            bar.tick(p.step, "steps, shards migrating at the scale events");
        }
        Some(Report::Pulls(p)) => line = Some(p),
        _ => {}
    });
    drop(bar);
    let line = match (ran, line) {
        (Ok(_), Some(l)) => l,
        // A failed pull stops the worker (and so the cluster): report it.
        (Err(_), Some(l)) if l.failed.is_some() => l,
        (Err(e), _) => return Err(e.into()),
        (Ok(_), None) => return Err(MigrateError::NoReport),
    };
    let fabric_after = fabric::run(&FabricBench { op: Op::Write, size: 4 << 20, iters: 300, depth: 8 })?;
    let failed = u64::from(line.failed.is_some());
    let (migrations, why) = followed.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if let Some(why) = why.filter(|_| failed == 0) {
        return Err(MigrateError::Migration(why));
    }
    let samples = line.samples;
    // Steady: before the first scale event (and so before its server process started).
    let first = migrations.first().map_or(u64::MAX, |m| m.requested_us);
    let mut steady: Vec<u64> = samples.iter().filter(|s| s.0 < first).map(|s| s.1).collect();
    let mut during: Vec<u64> = samples.iter().filter(|s| migrations.iter().any(|m| m.covers(s.0))).map(|s| s.1).collect();
    steady.sort_unstable();
    during.sort_unstable();
    let of = |f: fn(&Phases) -> f64| median(migrations.iter().map(f).collect());
    let snapshot_bytes = cfg.shard_bytes;
    Ok(MigrateReport {
        pulls: samples.len() as u64 + failed,
        pulls_failed: failed,
        failure: line.failed,
        steady_pulls: steady.len() as u64,
        pull_lat_us_p50_steady: percentile(&steady, 0.50),
        pull_lat_us_p99_steady: percentile(&steady, 0.99),
        during_pulls: during.len() as u64,
        pull_lat_us_p99_during: percentile(&during, 0.99),
        pull_lat_us_max_during: during.last().copied().unwrap_or(0) as f64,
        migration_ms: of(Phases::total_ms),
        preparing_ms: of(Phases::preparing_ms),
        copying_ms: of(Phases::copying_ms),
        cutover_ms: of(Phases::cutover_ms),
        migration_gbytes_per_s: median(
            migrations.iter().map(|m| m.bytes as f64 / (m.total_ms() / 1e3).max(1e-9) / 1e9).collect(),
        ),
        snapshot_gbytes_per_s: median(
            migrations.iter().map(|m| snapshot_bytes as f64 / (m.copying_ms() / 1e3).max(1e-9) / 1e9).collect(),
        ),
        snapshot_bytes,
        fabric_write_gbytes_per_s: 0.5 * (fabric_before.bw_gbytes_per_s + fabric_after.bw_gbytes_per_s),
        samples,
        migrations,
    })
}

/// Steps each migration is given in the job's length (a fast step rate makes
/// a server's start alone last a dozen).
const MIGRATION_STEPS: u64 = 40;

/// Runs the scale events: after `steady` steps and then `gap` steps after the
/// previous migration finished, grows
/// the job to two servers (starting the new process through `spawn`) or shrinks it
/// back to one, and follows each migration of shard 0 through the status every
/// 2 ms until it is done, appending its phases to `out`.
fn follow(
    control: SocketAddr,
    secret: &Secret,
    cfg: &MigrateBench,
    step: &AtomicU64,
    spawn: &Sender<Spawn>,
    out: &mut Vec<Phases>,
) -> Result<(), String> {
    let mut ctl = ControlClient::connect(control, secret, Duration::from_secs(30)).map_err(|e| e.to_string())?;
    let mut at = cfg.steady_steps;
    for k in 0..cfg.migrations {
        while step.load(Ordering::Acquire) < at {
            std::thread::sleep(Duration::from_millis(2));
        }
        let servers = if k % 2 == 0 { 2 } else { 1 };
        let done_before = status(&mut ctl)?.1;
        let deadline = Instant::now() + Duration::from_secs(120);
        // Still starting, or the previous shrink's server still retiring.
        ctl.call_when_possible(&ControlMsg::Scale { servers }, deadline)
            .map_err(|e| format!("scaling to {servers} servers: {e}"))?;
        if servers == 2 {
            spawn.send(Spawn::Servers(1)).map_err(|_| "the driver is gone".to_string())?;
        }
        eps_proto::say!(
            "eps bench migrate: step {}: migration {} of {}: scaling to {servers} servers",
            step.load(Ordering::Acquire),
            k + 1,
            cfg.migrations
        );
        let requested_us = unix_us();
        out.push(Phases { requested_us, ..follow_one(&mut ctl, done_before, deadline)? });
        at = step.load(Ordering::Acquire) + cfg.gap_steps;
    }
    Ok(())
}

/// The job's status as `eps status --json` has it, and its migrations done.
fn status(ctl: &mut ControlClient) -> Result<(serde_json::Value, u64), String> {
    let Ok(ControlMsg::StatusReport { text }) = ctl.call(&ControlMsg::StatusJson) else {
        return Err("the control plane stopped answering".into());
    };
    let st: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("the status is not JSON: {e}"))?;
    let done = st.get("migrations_done").and_then(serde_json::Value::as_u64).unwrap_or(0);
    Ok((st, done))
}

/// Polls until the number of migrations done exceeds `done_before`, recording when
/// shard 0's migration in flight first showed each phase.
fn follow_one(ctl: &mut ControlClient, done_before: u64, deadline: Instant) -> Result<Phases, String> {
    let mut ph = Phases::default();
    while Instant::now() < deadline {
        let (st, done) = status(ctl)?;
        let now = unix_us();
        let first = |t: &mut u64| {
            if *t == 0 {
                *t = now;
            }
        };
        let moves = st.get("moves").and_then(serde_json::Value::as_array).cloned().unwrap_or_default();
        let of_shard_0 = |m: &&serde_json::Value| m.get("shard").and_then(serde_json::Value::as_u64) == Some(0);
        let phase = |m: &serde_json::Value| m.get("phase").and_then(serde_json::Value::as_str).unwrap_or("").to_string();
        if done > done_before {
            first(&mut ph.preparing_us);
            first(&mut ph.copying_us);
            first(&mut ph.cutover_us);
            ph.done_us = now;
            // The newest finished move of shard 0 carries the source's byte count.
            let last = moves.iter().filter(of_shard_0).rfind(|m| phase(m) == "done");
            ph.bytes = last.and_then(|m| m.get("bytes")?.as_u64()).unwrap_or(0);
            return Ok(ph);
        }
        if let Some(m) = moves.iter().filter(of_shard_0).find(|m| phase(m) != "done") {
            first(&mut ph.preparing_us);
            match phase(m).as_str() {
                "copying" => first(&mut ph.copying_us),
                "cutover" => {
                    first(&mut ph.copying_us);
                    first(&mut ph.cutover_us);
                }
                _ => {}
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Err("shard 0 did not finish migrating within 120 s".into())
}
