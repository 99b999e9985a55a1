//! One job of a live run: its processes (through the launcher), a thread that
//! supervises them and reads its workers' lines, and a thread that applies the
//! policy's allocations through the job's control plane (the scale API of
//! `eps scale`), starting the servers and workers a growth needs.

use crate::report::Report;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use eps_control::ControlClient;
use eps_proto::control::ControlMsg;
use eps_sched::Alloc;

use super::launcher::{JobLaunch, Launcher, Stop, progress_samples};
use crate::scale::{ScaleOutcome, Spawn, wait_settled};

/// What the driver learns of a running job, written by the job's threads.
#[derive(Debug, Default)]
pub struct Progress {
    /// The job's samples trained so far (rank 0's last progress line).
    pub samples: u64,
    /// When the allocation last changed (seconds of the run).
    pub since_s: f64,
    /// When rank 0 reported the end of training (seconds of the run).
    pub done_s: Option<f64>,
    /// The final parameters' checksum (rank 0).
    pub checksum: Option<String>,
    /// Contributor sets by iteration (rank 0's `membership=`).
    pub membership: Option<String>,
    /// Every process has exited: `Err` says why early.
    pub ended: Option<Result<(), String>>,
    /// The allocation applied so far.
    pub applied: Alloc,
    /// Every progress point: (seconds, samples).
    pub points: Vec<(f64, u64)>,
    /// Each rescale applied: (seconds at the scale call, seconds when settled).
    pub rescales: Vec<(f64, f64)>,
    /// The servers changed at least once.
    pub servers_changed: bool,
    /// A rescale that failed while the job was running.
    pub scale_error: Option<String>,
}

impl Progress {
    /// Seconds from `start_s` to the first iteration's end.
    pub fn start_delay(&self, start_s: f64) -> Option<f64> {
        self.points.first().map(|&(t, _)| t - start_s)
    }

    /// The time each rescale cost training: the longest gap between two
    /// progress points from its scale call to a second after it settled,
    /// less the job's median gap (what an iteration takes anyway).
    pub fn pauses(&self) -> Vec<f64> {
        let gaps: Vec<(f64, f64)> = self.points.windows(2).map(|w| (w[1].0, w[1].0 - w[0].0)).collect();
        let all: Vec<f64> = gaps.iter().map(|g| g.1).collect();
        let Some(median) = super::median(&all) else { return Vec::new() };
        self.rescales
            .iter()
            .filter_map(|&(from, to)| {
                let worst = gaps.iter().filter(|g| g.0 >= from && g.0 <= to + 1.0).map(|g| g.1).fold(f64::NAN, f64::max);
                worst.is_finite().then(|| (worst - median).max(0.0))
            })
            .collect()
    }

    /// Samples per second over the last 5 s since the allocation last
    /// changed (a span of at least `min_s`), if known.
    pub fn rate(&self, min_s: f64) -> Option<f64> {
        let &(t1, s1) = self.points.last()?;
        let from = self.points.partition_point(|p| p.0 < self.since_s.max(t1 - 5.0));
        let &(t0, s0) = self.points.get(from)?;
        (t1 - t0 >= min_s).then(|| (s1 - s0) as f64 / (t1 - t0))
    }
}

/// A started job.
pub struct Running {
    /// Shared with its threads.
    pub progress: Arc<Mutex<Progress>>,
    stop: Arc<AtomicBool>,
    targets: Option<Sender<Alloc>>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Running {
    /// A job dropped without being joined (the driver failed) is stopped.
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.kill();
        }
    }
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running").field("progress", &self.progress).finish()
    }
}

fn lock(p: &Mutex<Progress>) -> std::sync::MutexGuard<'_, Progress> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

impl Running {
    /// Starts `launch` at `alloc`; `clock` gives the run's seconds.
    pub fn start(
        launcher: &dyn Launcher,
        launch: &JobLaunch,
        alloc: Alloc,
        clock: Arc<dyn Fn() -> f64 + Send + Sync>,
    ) -> Result<Self, String> {
        let procs = launcher.start(launch)?;
        let (control, secret, stop) = (procs.control(), procs.secret(), procs.stop_handle());
        let progress = Arc::new(Mutex::new(Progress { applied: alloc, ..Progress::default() }));
        let (spawn_tx, spawn_rx) = channel::<Spawn>();
        let (targets, target_rx) = channel::<Alloc>();
        let ranks = launch.spec.job.rank_limit().saturating_sub(alloc.workers);
        let p = progress.clone();
        let c = clock.clone();
        let scaler = std::thread::spawn(move || scale_thread(control, &secret, alloc, ranks, &target_rx, &spawn_tx, &p, &*c));
        let p = progress.clone();
        let supervisor = std::thread::spawn(move || {
            let mut on_line = |l: &str| {
                let now = clock();
                let mut g = lock(&p);
                if let Some(s) = progress_samples(l) {
                    g.samples = s;
                    g.points.push((now, s));
                } else if let Some(Report::Done(d)) = Report::parse(l)
                    && let Some(r) = d.result
                {
                    // The lowest-ranked contributor of the last iteration evaluates the result.
                    g.done_s = Some(now);
                    g.checksum = Some(r.params_checksum);
                    g.membership = Some(r.membership);
                }
            };
            let r = procs.supervise(&spawn_rx, &mut on_line);
            let mut g = lock(&p);
            g.ended = Some(match r {
                Ok(()) => Ok(()),
                // Stopped after training ended: a joiner the job no longer
                // needed, or processes slow to exit.
                Err(_) if g.done_s.is_some() => Ok(()),
                Err(Stop::Stopped) => Err("stopped".into()),
                Err(Stop::Interrupted) => Err("interrupted".into()),
                Err(Stop::Failed(e)) => Err(e),
            });
        });
        Ok(Self { progress, stop, targets: Some(targets), threads: vec![scaler, supervisor] })
    }

    /// Asks for `a` (applied in the background, the latest ask first).
    pub fn rescale(&self, a: Alloc) {
        if let Some(t) = &self.targets {
            let _ = t.send(a);
        }
    }

    /// Stops every process of the job.
    pub fn kill(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Waits for its threads (after the job ended or was killed).
    pub fn join(mut self) {
        self.targets = None;
        for t in std::mem::take(&mut self.threads) {
            let _ = t.join();
        }
    }
}

/// Applies allocations as they come, the latest first: servers (new ones
/// started, shards migrating while training goes on), then workers (voted at
/// an iteration boundary; joiners take new ranks, at most `ranks` more).
#[allow(clippy::too_many_arguments)]
fn scale_thread(
    control: SocketAddr,
    secret: &str,
    mut cur: Alloc,
    mut ranks: u32,
    targets: &Receiver<Alloc>,
    spawn: &Sender<Spawn>,
    p: &Mutex<Progress>,
    clock: &dyn Fn() -> f64,
) {
    let mut ctl: Option<ControlClient> = None;
    let outcome = Mutex::new(ScaleOutcome::default());
    while let Ok(mut t) = targets.recv() {
        while let Ok(n) = targets.try_recv() {
            t = n;
        }
        if t == cur || lock(p).ended.is_some() {
            continue;
        }
        let began = clock();
        let r = (|| -> Result<(), String> {
            if ctl.is_none() {
                let s = eps_fabric::Secret::new(secret).map_err(|_| "bad job secret".to_string())?;
                ctl = Some(ControlClient::connect(control, &s, Duration::from_secs(10)).map_err(|e| e.to_string())?);
            }
            let c = ctl.as_mut().expect("connected");
            if t.servers != cur.servers {
                call(c, &ControlMsg::Scale { servers: t.servers })?;
                if t.servers > cur.servers {
                    let _ = spawn.send(Spawn::Servers(t.servers - cur.servers));
                }
                let done = outcome.lock().unwrap_or_else(|e| e.into_inner()).moves() + 1;
                wait_settled(c, &outcome, (done, 0));
                cur.servers = t.servers;
                let mut g = lock(p);
                (g.applied, g.servers_changed) = (cur, true);
                g.since_s = clock();
            }
            let w = t.workers.min(cur.workers + ranks);
            if w != cur.workers {
                call(c, &ControlMsg::ScaleWorkers { workers: w })?;
                if w > cur.workers {
                    ranks -= w - cur.workers;
                    let _ = spawn.send(Spawn::Workers(w - cur.workers));
                }
                let done = outcome.lock().unwrap_or_else(|e| e.into_inner()).moves();
                wait_settled(c, &outcome, (done, 0));
                cur.workers = w;
                let mut g = lock(p);
                g.applied = cur;
                g.since_s = clock();
            }
            Ok(())
        })();
        let mut g = lock(p);
        match r {
            Ok(()) => g.rescales.push((began, clock())),
            // A job that ended meanwhile has nothing left to rescale.
            Err(_) if g.done_s.is_some() || g.ended.is_some() => return,
            Err(e) => {
                g.scale_error.get_or_insert(format!("at {:.1} s, to {t:?}: {e}", clock()));
                ctl = None;
            }
        }
    }
}

/// One scale call, retried while the job starts or an earlier change is
/// still under way.
fn call(c: &mut ControlClient, msg: &ControlMsg) -> Result<(), String> {
    c.call_when_possible(msg, Instant::now() + Duration::from_secs(60)).map(drop).map_err(|e| e.to_string())
}
