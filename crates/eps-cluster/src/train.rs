//! `eps train`: a whole local cluster as separate processes (control plane, S
//! servers, W workers) on the embedded defaults, training the built-in synthetic
//! task; progress while it runs, a summary and an optional JSON line at the end.

use crate::cluster::{self, LocalCluster};
use crate::error::TrainError;
use crate::jobspec::Overrides;
use crate::report::{self, Report};
use crate::scale;

use eps_proto::JobSpec;

/// The outcome of a run.
#[derive(Clone, Debug, Default)]
pub struct TrainReport {
    /// Steps trained.
    pub steps: u64,
    /// Held-out loss.
    pub final_loss: f64,
    /// Held-out accuracy of the trained model.
    pub final_accuracy: f64,
    /// Held-out accuracy of the teacher (the ceiling).
    pub teacher_accuracy: f64,
    /// Ctr: held-out AUC of the trained model, and of the teacher.
    pub final_auc: Option<f64>,
    /// See `final_auc`.
    pub teacher_auc: Option<f64>,
    /// Ctr: checksum of the sparse table's rows of the first ids of each field.
    pub sparse_checksum: Option<String>,
    /// Checksum of the final parameters.
    pub params_checksum: String,
    /// Training samples per second, all workers.
    pub samples_per_s: f64,
    /// Gradient bytes pushed per second, all workers (1e9 B/s).
    pub push_gbytes_per_s: f64,
    /// Parameter bytes pulled per second, all workers.
    pub pull_gbytes_per_s: f64,
    /// Wall time of the training loop (slowest worker).
    pub elapsed_s: f64,
    /// Scale events applied.
    pub scale_events: u64,
    /// Shard migrations they caused.
    pub migrations: u64,
    /// Shard splits they caused.
    pub splits: u64,
    /// Bucket moves of sparse tables done.
    pub bucket_moves: u64,
    /// Worker membership changes committed (joins, leaves, expiries).
    pub membership_changes: u64,
    /// Contributor sets by iteration (`FIRST:R,R,...;...`, see `worker::membership_text`).
    pub membership: String,
    /// Roll-backs to a checkpoint after a server died.
    pub rollbacks: u64,
    /// Iterations trained again because of them.
    pub iterations_lost: u64,
}

/// Most roll-backs of one run before it gives up.
const ROLLBACKS: u64 = 3;

/// Runs the cluster, applying the scale events of `plan` as training reaches them;
/// `progress` receives one human-readable line per report. A server that dies
/// takes its shards with it: a job that writes checkpoints rolls back to its
/// newest complete one on the servers left (a new one if none is) and goes on;
/// one that does not stops, saying which shards were lost.
pub fn run(
    spec: &JobSpec,
    spec_text: &str,
    every: u64,
    plan: &[scale::ScaleEvent],
    children: &cluster::ChildArgs,
    mut progress: impl FnMut(u64, &str),
) -> Result<TrainReport, TrainError> {
    let (mut spec, mut text) = (spec.clone(), spec_text.to_string());
    let (mut rollbacks, mut lost) = (0, 0);
    loop {
        let reached = std::sync::atomic::AtomicU64::new(spec.resume.as_ref().map_or(0, |r| r.iteration));
        let e = match run_once(&spec, &text, every, plan, children, &reached, &mut progress) {
            Ok(mut rep) => {
                (rep.rollbacks, rep.iterations_lost) = (rollbacks, lost);
                return Ok(rep);
            }
            Err(e @ TrainError::ServerLost { .. }) => e,
            Err(e) => return Err(e),
        };
        let dir = spec.job.checkpoint_dir.clone().filter(|_| spec.job.checkpoint_every > 0);
        let Some(dir) = dir.filter(|_| plan.is_empty() && rollbacks < ROLLBACKS) else {
            let why = if !plan.is_empty() {
                "a run with --scale-plan is not rolled back"
            } else if rollbacks >= ROLLBACKS {
                "it was rolled back too often"
            } else {
                "the job writes no checkpoints to roll back to (--checkpoint-every N --checkpoint-dir DIR)"
            };
            return Err(TrainError::Child(format!("{e}; stopped the cluster: {why}")));
        };
        // Two at least with replicas (a backup lives on another server).
        let servers = (spec.job.servers - 1).max(spec.job.replicas.min(2));
        let o = Overrides {
            servers: Some(servers),
            workers: Some(spec.job.workers),
            steps: Some(spec.job.steps),
            ..Default::default()
        };
        let (s, t) = crate::checkpoint::resume_spec(std::path::Path::new(&dir), &o)
            .map_err(|why| TrainError::Child(format!("{e}; no checkpoint to roll back to: {why}")))?;
        let at = s.resume.as_ref().map_or(0, |r| r.iteration);
        let was = reached.load(std::sync::atomic::Ordering::Acquire);
        eps_proto::say!(
            "eps train: {e}; rolling back from iteration {was} to the checkpoint at iteration {at} on {servers} server{} ({} iterations lost)",
            if servers == 1 { "" } else { "s" },
            was.saturating_sub(at)
        );
        rollbacks += 1;
        lost += was.saturating_sub(at);
        (spec, text) = (s, t);
    }
}

/// One run of the cluster (see [`run`]); `reached` follows rank 0's progress.
fn run_once(
    spec: &JobSpec,
    spec_text: &str,
    every: u64,
    plan: &[scale::ScaleEvent],
    children: &cluster::ChildArgs,
    reached: &std::sync::atomic::AtomicU64,
    progress: &mut impl FnMut(u64, &str),
) -> Result<TrainReport, TrainError> {
    // With a plan, rank 0 reports every step so that events happen on time.
    let report_every = if plan.is_empty() { every } else { 1 };
    let every_s = report_every.to_string();
    let cluster = LocalCluster::start(spec, spec_text, &["--progress-every", &every_s], children)?;
    if children.etcd.is_some() {
        // Every control plane, leader and standbys: `eps status --control`
        // (and any client) finds the leader among them.
        println!("EPS_CONTROL={}", cluster.control_addr());
    }
    tell_how_to_reach(&cluster, spec);
    let step = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (tx, more) = std::sync::mpsc::channel();
    let outcome = if plan.is_empty() {
        None
    } else {
        let addr: eps_control::ControlAddrs =
            cluster.control_addr().parse().map_err(|_| TrainError::Child("bad control-plane address".into()))?;
        let secret = eps_fabric::Secret::new(cluster.secret()).map_err(|_| TrainError::Child("bad job secret".into()))?;
        Some(scale::spawn_plan(
            plan.to_vec(),
            addr,
            secret,
            (spec.job.servers, spec.job.workers),
            !spec.model.tables.is_empty(),
            step.clone(),
            tx,
        ))
    };
    let (steps, batch) = (spec.job.steps, spec.job.batch as f64);
    let mut rep = TrainReport { steps, ..TrainReport::default() };
    let mut totals = Totals::default();
    let started = cluster.supervise_tolerant(Some(&more), spec.job.replicas > 1, |l| match Report::parse(l) {
        Some(Report::Progress(p)) => {
            let secs = p.elapsed_s.max(1e-9);
            step.store(p.step, std::sync::atomic::Ordering::Release);
            reached.store(p.step, std::sync::atomic::Ordering::Release);
            if p.step % every != 0 {
                return;
            }
            // Rates over the current contributor count.
            let w = p.workers.max(1) as f64;
            progress(
                p.step,
                &format!(
                    "step {:>6}/{steps}  loss {:.4}  acc {:.3}  {:>8.0} samples/s  push {:.2} GB/s  pull {:.2} GB/s",
                    p.step,
                    p.loss,
                    p.acc,
                    batch * w * every as f64 / (secs - totals.last_s).max(1e-9),
                    p.pushed as f64 * w / secs / 1e9,
                    p.pulled as f64 * w / secs / 1e9,
                ),
            );
            totals.last_s = secs;
        }
        Some(Report::Done(d)) => absorb_done(&d, &mut rep, &mut totals),
        _ => {}
    })?;
    let (started, died) = started;
    if totals.done + died != started || rep.params_checksum.is_empty() {
        return Err(TrainError::Child(format!("only {} of {started} workers reported their results", totals.done)));
    }
    let secs = rep.elapsed_s.max(1e-9);
    rep.samples_per_s = totals.samples / secs;
    rep.push_gbytes_per_s = totals.pushed / secs / 1e9;
    rep.pull_gbytes_per_s = totals.pulled / secs / 1e9;
    rep.membership_changes = rep.membership.matches(';').count() as u64;
    if let Some(o) = outcome {
        let o = o.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(e) = o.error {
            return Err(TrainError::Child(e));
        }
        if o.events != plan.len() as u64 {
            return Err(TrainError::Child(format!(
                "only {} of {} scale events happened before training ended",
                o.events,
                plan.len()
            )));
        }
        (rep.scale_events, rep.migrations, rep.splits, rep.bucket_moves) = (o.events, o.migrations, o.splits, o.bucket_moves);
    }
    Ok(rep)
}

/// What the workers' `Done` reports add up to.
#[derive(Default)]
struct Totals {
    /// Workers that reported.
    done: u32,
    samples: f64,
    pushed: f64,
    pulled: f64,
    /// Rank 0's elapsed seconds at the previous progress line.
    last_s: f64,
}

/// Folds a worker's `Done` report into the run's.
fn absorb_done(d: &report::Done, rep: &mut TrainReport, totals: &mut Totals) {
    totals.done += 1;
    totals.samples += d.samples as f64;
    totals.pushed += d.pushed as f64;
    totals.pulled += d.pulled as f64;
    rep.elapsed_s = rep.elapsed_s.max(d.elapsed_s);
    // The lowest-ranked contributor of the last iteration reports the result.
    if let Some(r) = &d.result {
        rep.membership = r.membership.clone();
        rep.final_loss = r.final_loss;
        rep.final_accuracy = r.final_accuracy;
        rep.teacher_accuracy = r.teacher_accuracy;
        rep.params_checksum = r.params_checksum.clone();
        rep.final_auc = r.final_auc;
        rep.teacher_auc = r.teacher_auc;
        rep.sparse_checksum = r.sparse_checksum.clone();
    }
}

/// Says how `eps status`, `eps scale` and `eps checkpoint` reach the job: its
/// control plane's address, and where its secret is (a generated one is
/// written to a file of the cluster's directory, readable by this user only).
fn tell_how_to_reach(cluster: &LocalCluster, spec: &JobSpec) {
    let from_env = std::env::var("EPS_JOB_SECRET").ok().is_some_and(|s| !s.is_empty());
    let secret = if from_env {
        "EPS_JOB_SECRET=(as set here)".to_string()
    } else if spec.job.secret.is_some() {
        "the spec's job.secret".to_string()
    } else {
        match crate::secret::write(cluster.dir(), cluster.secret()) {
            Ok(path) => format!("EPS_JOB_SECRET_FILE={}", path.display()),
            Err(e) => format!("no secret file ({e})"),
        }
    };
    eps_proto::say!(
        "eps train: the job's control plane is at {}; `eps status`, `eps scale` and `eps checkpoint` reach it with EPS_CONTROL={} and {secret}",
        cluster.control_addr(),
        cluster.control_addr()
    );
}
