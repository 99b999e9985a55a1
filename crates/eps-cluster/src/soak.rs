//! `eps soak`'s run: a local elastic job with backups trains under a
//! stream of faults ([`faults`]) while the resident memory of every process
//! is sampled, then the same steps run again without faults for reference.
//! The command line judges and prints the result.

pub mod faults;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eps_proto::JobSpec;

use crate::LocalCluster;
use crate::cluster::{Processes, soft_args};
use crate::jobspec::{Overrides, build_spec_or};
use crate::report::Report as ChildReport;

/// The job the soak trains (workers, servers and steps are set per run).
pub const SOAK_SPEC: &str = r#"
[job]
name = "soak"
workers = 8
servers = 4
steps = 100
consistency = "bsp"
batch = 64
seed = 7
shard_bytes = 131072
replicas = 2

[model]
preset = "synthetic"
buckets = 131072
dense_dim = 16
classes = 4
sparse_per_sample = 8
vocab = 2000

[optimizer]
kind = "adam"
lr = 0.01
"#;

/// The job `eps soak --model ctr` trains: the built-in ctr job (whose
/// embeddings are rows of a sparse table) with a larger vocabulary, rows
/// evicted by their touches, and backups of its dense shards and its rows.
pub fn soak_ctr_spec() -> String {
    crate::jobspec::CTR_SPEC
        .replace("name = \"ctr\"", "name = \"soak-ctr\"\nreplicas = 2")
        .replace("batch = 512", "batch = 128")
        .replace("seed = 1", "seed = 7")
        .replace("vocab = 1000", "vocab = 20000")
        .replace("max_keys = 8192", "max_keys = 8192\nevict_idle_steps = 60\nevict_min_touches = 2")
}

/// What a soak runs: the job's size and the fault stream.
#[derive(Clone, Debug)]
pub struct SoakConfig {
    /// Worker processes.
    pub workers: u32,
    /// Server processes at the start.
    pub servers: u32,
    /// Mean seconds between two faults.
    pub every_s: f64,
    /// Seed of the fault schedule.
    pub seed: u64,
    /// The job has a sparse table (`--model ctr`).
    pub tables: bool,
}

/// Share of the calibrated fault-free speed the soak assumes (faults stop
/// training for a while: a lost server for its lease, a stall for its length).
const FAULTED_SPEED: f64 = 0.8;
const CALIBRATION_STEPS: u64 = 60;
/// Resident memory is sampled this often.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// Training that makes no progress this long is stopped (an error).
const STALL_LIMIT: Duration = Duration::from_secs(180);

pub const ROLES: [&str; 3] = ["control", "server", "worker"];

/// One sample of resident memory: summed per role.
#[derive(Clone, Debug)]
pub struct Tick {
    pub t: f64,
    pub step: u64,
    pub rss: [u64; 3],
    pub procs: [u32; 3],
}

/// The push_pull latency of one worker over one interval.
#[derive(Clone, Copy, Debug)]
pub struct Lat {
    pub t: f64,
    pub p50_us: f64,
    pub p99_us: f64,
}

/// What the run under faults produced.
#[derive(Debug, Default)]
pub struct Soaked {
    pub ticks: Vec<Tick>,
    pub lat: Vec<Lat>,
    pub faults: faults::Log,
    pub checksum: String,
    pub digests: String,
    /// The table rows' checksum (a job with tables).
    pub rows_checksum: String,
    /// Each worker's whole-run p50 and p99 (us).
    pub worker_lat: Vec<(f64, f64)>,
    pub samples_per_s: f64,
    pub seconds: f64,
    /// Seconds since the start from which no fault came any more.
    pub quiet_from: f64,
}

/// The steps a soak of about `minutes` under faults trains, from a short
/// fault-free calibration run.
pub fn calibrated_steps(c: &SoakConfig, minutes: f64) -> Result<u64, String> {
    let (spec, text) = spec(c, CALIBRATION_STEPS, 2)?;
    eps_proto::say!("eps soak: calibrating: {CALIBRATION_STEPS} steps without faults");
    let r = crate::train::run(&spec, &text, CALIBRATION_STEPS, &[], &soft_args(), |_, _| {}).map_err(|e| e.to_string())?;
    let rate = r.steps as f64 / r.elapsed_s.max(1e-3);
    let s = (rate * minutes * 60.0 * FAULTED_SPEED).round().max(50.0) as u64;
    eps_proto::say!("eps soak: {rate:.1} steps/s without faults; the soak trains {s} steps");
    Ok(s)
}

fn spec(a: &SoakConfig, steps: u64, replicas: u32) -> Result<(JobSpec, String), String> {
    let o = Overrides {
        workers: Some(a.workers),
        servers: Some(a.servers),
        steps: Some(steps),
        replicas: Some(replicas),
        ..Default::default()
    };
    let text = if a.tables { soak_ctr_spec() } else { SOAK_SPEC.to_string() };
    build_spec_or(None, &text, &o).map_err(|e| e.to_string())
}

/// The faults a comma-separated list names (`--faults`), less those this
/// machine cannot inject (said so).
pub fn fault_kinds(list: &str) -> Result<Vec<faults::Kind>, String> {
    let mut kinds = Vec::new();
    for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let k = faults::Kind::parse(name).ok_or_else(|| {
            let all: Vec<&str> = faults::Kind::ALL.iter().map(|k| k.name()).collect();
            format!("--faults: unknown fault {name:?} (known: {})", all.join(", "))
        })?;
        kinds.push(k);
    }
    if kinds.is_empty() {
        return Err("--faults names no fault".into());
    }
    if kinds.contains(&faults::Kind::ServerCut) && !faults::can_cut() {
        eps_proto::say!("eps soak: server_cut skipped: cutting connections needs root and `ss` (iproute2)");
        kinds.retain(|k| *k != faults::Kind::ServerCut);
        if kinds.is_empty() {
            return Err("--faults: server_cut alone cannot run here (needs root and `ss`)".into());
        }
    }
    Ok(kinds)
}

/// The run under faults.
pub fn soak(a: &SoakConfig, steps: u64, kinds: Vec<faults::Kind>) -> Result<Soaked, String> {
    let (spec, text) = spec(a, steps, 2)?;
    let cluster = LocalCluster::start(
        &spec,
        &text,
        &["--progress-every", "1", "--latency-every-ms", "1000", "--chunk-digests"],
        &soft_args(),
    )
    .map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let step = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let (tx, more) = std::sync::mpsc::channel();
    let log = Arc::new(Mutex::new(faults::Log::default()));
    let plan = faults::Plan {
        control: cluster.control_addr().parse().map_err(|_| "bad control-plane address")?,
        secret: eps_fabric::Secret::new(cluster.secret()).map_err(|_| "bad job secret")?,
        procs: cluster.processes(),
        spawn: tx,
        step: step.clone(),
        first: steps * 15 / 100,
        last: steps * 85 / 100,
        servers: a.servers,
        kinds,
        every: Duration::from_secs_f64(a.every_s),
        seed: a.seed,
        t0,
        done: done.clone(),
    };
    let injector = faults::spawn(plan, log.clone());
    let sampler = sample(cluster.processes(), step.clone(), done.clone(), cluster.stop_handle(), log.clone(), t0);
    let mut out = Soaked::default();
    let bar = crate::progress::Progress::new(steps, "eps soak");
    let res = cluster.supervise_tolerant(Some(&more), true, |l| {
        let t = t0.elapsed().as_secs_f64();
        match ChildReport::parse(l) {
            Some(ChildReport::Progress(p)) => {
                step.store(p.step, Ordering::Release);
                bar.tick(p.step, "under faults");
            }
            Some(ChildReport::Latency(x)) => out.lat.push(Lat { t, p50_us: x.p50_us as f64, p99_us: x.p99_us as f64 }),
            Some(ChildReport::Done(d)) => {
                // (The ctr task's workers report no latency.)
                if let Some(q) = &d.latency_us {
                    out.worker_lat.push((q.p50 as f64, q.p99 as f64));
                }
                out.samples_per_s += d.samples as f64 / d.elapsed_s.max(1e-9);
                if let Some(r) = d.result {
                    out.checksum = r.params_checksum;
                    out.digests = r.chunk_digests.unwrap_or_default();
                    out.rows_checksum = r.sparse_checksum.unwrap_or_default();
                }
            }
            _ => {}
        }
    });
    out.seconds = t0.elapsed().as_secs_f64();
    done.store(true, Ordering::Release);
    let _ = injector.join();
    out.ticks = sampler.join().unwrap_or_default();
    out.faults = std::mem::take(&mut *log.lock().unwrap_or_else(|p| p.into_inner()));
    // (Training ended before the faults did: the samples after the last
    // fault's recovery.)
    let last = out.faults.faults.last().map_or(0.0, |f| f.at_s + f.recovered_s.unwrap_or(0.0));
    out.quiet_from = out.faults.quiet_from.unwrap_or(last);
    if let Err(crate::TrainError::Interrupted) = res {
        return Err("interrupted (Ctrl-C); stopped the cluster".into());
    } else if let Err(e) = res {
        out.faults.errors.push(format!("the job failed: {e}"));
    } else if out.checksum.is_empty() {
        out.faults.errors.push("no worker reported the final parameters".into());
    }
    Ok(out)
}

/// Samples the resident memory of every process; stops the cluster if
/// training stalls for good.
fn sample(
    procs: Processes,
    step: Arc<AtomicU64>,
    done: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<faults::Log>>,
    t0: Instant,
) -> std::thread::JoinHandle<Vec<Tick>> {
    std::thread::spawn(move || {
        let mut ticks = Vec::new();
        let (mut last_step, mut moved) = (0, Instant::now());
        while !done.load(Ordering::Acquire) {
            let mut tick = Tick { t: t0.elapsed().as_secs_f64(), step: step.load(Ordering::Acquire), rss: [0; 3], procs: [0; 3] };
            for p in procs.list() {
                let role = if p.name.starts_with("server") {
                    1
                } else if p.name.starts_with("worker") {
                    2
                } else {
                    0
                };
                if let Some(kb) = rss_kib(p.pid) {
                    tick.rss[role] += kb * 1024;
                    tick.procs[role] += 1;
                }
            }
            if tick.step != last_step {
                (last_step, moved) = (tick.step, Instant::now());
            } else if moved.elapsed() > STALL_LIMIT {
                log.lock().unwrap_or_else(|p| p.into_inner()).errors.push(format!(
                    "training made no progress for {} s at step {last_step}; stopped the cluster",
                    STALL_LIMIT.as_secs()
                ));
                stop.store(true, Ordering::Release);
                moved = Instant::now();
            }
            ticks.push(tick);
            std::thread::sleep(SAMPLE_EVERY);
        }
        ticks
    })
}

/// A process's resident memory of its own (anonymous and shared memory:
/// `VmRSS` less the file-backed pages), if it still runs. The pages of the
/// binary's code are left out: they are faulted in as code first runs (the
/// first fault of a kind runs code never run before), are bounded by the
/// binary's size and shared, and are most of a small process's `VmRSS`.
fn rss_kib(pid: u32) -> Option<u64> {
    eps_metrics::rss_bytes(Some(pid)).map(|b| b / 1024)
}

/// The fault-free run of the same steps (no backups: they change nothing in
/// the result).
#[derive(Clone, Debug, Default)]
pub struct Reference {
    pub checksum: String,
    pub digests: String,
    /// The table rows' checksum (a job with tables).
    pub rows_checksum: String,
}

/// Runs the fault-free run of the same steps.
pub fn reference(a: &SoakConfig, steps: u64) -> Result<Reference, String> {
    let (spec, text) = spec(a, steps, 1)?;
    let cluster = LocalCluster::start(&spec, &text, &["--progress-every", "1000000", "--chunk-digests"], &soft_args())
        .map_err(|e| e.to_string())?;
    let mut out = Reference::default();
    cluster
        .supervise(None, |l| {
            if let Some(ChildReport::Done(d)) = ChildReport::parse(l)
                && let Some(r) = d.result
            {
                out.checksum = r.params_checksum;
                out.digests = r.chunk_digests.unwrap_or_default();
                out.rows_checksum = r.sparse_checksum.unwrap_or_default();
            }
        })
        .map_err(|e| format!("the reference run: {e}"))?;
    if out.checksum.is_empty() {
        return Err("the reference run reported no final parameters".into());
    }
    Ok(out)
}
