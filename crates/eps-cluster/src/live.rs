//! The scheduler's live mode: real EPS jobs on this machine, started,
//! rescaled and killed by a policy of `eps-sched` (the same core the
//! simulator drives). `eps sched run` replays a trace; `eps sched serve`
//! takes jobs from `eps submit` ([`serve`]).
//!
//! Each job is the built-in synthetic task sized as the trace says
//! ([`launcher::job_launch`]); its workers sleep out the trace's compute time
//! per sample (an accelerator's), report the job's samples every step, and
//! stop once the job has trained all its samples. The driver decides at every
//! arrival, feedback and end, and at least every tick; it refines each job's
//! throughput from the progress the job reports.

pub mod job;
pub use crate::launcher;
pub mod serve;

use std::sync::Arc;
use std::time::{Duration, Instant};

use eps_sched::placement::{Node, Placement, one_node};
use eps_sched::policy::{JobView, View, check};
use eps_sched::sim::{JobRecord, Summary, summarize};
use eps_sched::{Alloc, ClusterModel, JobSpec, Policy, Timing};

use job::Running;
use launcher::{JobLaunch, Launcher, job_launch};

/// The Slurm allocation this runs in as the scheduler's nodes, a slot per
/// CPU, and their total.
pub fn slurm_nodes() -> Result<(u32, Vec<Node>), String> {
    let a = crate::slurm::Allocation::current("gpu")?;
    let nodes: Vec<Node> = a.nodes.iter().map(|n| Node { name: n.name.clone(), slots: n.cpus }).collect();
    let described: Vec<String> = a
        .nodes
        .iter()
        .map(|n| if n.gpus > 0 { format!("{}:{} ({} GPUs)", n.name, n.cpus, n.gpus) } else { format!("{}:{}", n.name, n.cpus) })
        .collect();
    eps_proto::say!("eps sched: Slurm job {}: nodes {} (a slot per CPU)", a.job, described.join(","));
    Ok((nodes.iter().map(|n| n.slots).sum(), nodes))
}

impl LiveRun {
    /// The jobs' records.
    pub fn summary_records(&self) -> Vec<JobRecord> {
        self.jobs.iter().map(|j| j.record.clone()).collect()
    }
}

/// How a live run goes.
#[derive(Clone)]
pub struct Config {
    /// Slots (one worker or server process each).
    pub slots: u32,
    /// The nodes the slots are on (none: one node, `local`, of all of them).
    pub nodes: Vec<Node>,
    /// The cluster model the policy plans with.
    pub model: ClusterModel,
    /// The scheduler's clocks.
    pub timing: Timing,
    /// What starts the jobs' processes.
    pub launcher: Arc<dyn Launcher>,
    /// One line per event on stderr.
    pub verbose: bool,
}

/// What happened to one job of a live run.
#[derive(Clone, Debug)]
pub struct LiveJob {
    /// Its times, as the simulator records them.
    pub record: JobRecord,
    /// The spec it started with.
    pub launch: Option<JobLaunch>,
    /// The final parameters' checksum, for a job run to completion.
    pub checksum: Option<String>,
    /// Its contributor sets by iteration (`FIRST:R,R;...`).
    pub membership: Option<String>,
    /// Its servers changed while it ran.
    pub servers_changed: bool,
    /// Why it failed, if it did (a process failed, a rescale failed).
    pub error: Option<String>,
    /// Allocations decided for it: (seconds, allocation).
    pub allocs: Vec<(f64, Alloc)>,
    /// Its progress: (seconds, samples trained) after every step.
    pub points: Vec<(f64, u64)>,
}

/// A live run's outcome.
#[derive(Debug)]
pub struct LiveRun {
    /// The run's figures, as the simulator's.
    pub summary: Summary,
    /// Per job, in trace order.
    pub jobs: Vec<LiveJob>,
    /// Seconds each rescale took to settle (scale call to a settled job).
    pub rescale_s: Vec<f64>,
    /// Seconds each rescale cost training (the longest iteration gap around
    /// it, less a usual iteration).
    pub pause_s: Vec<f64>,
    /// Seconds from each job's start to its first iteration's end.
    pub start_s: Vec<f64>,
}

enum State {
    /// Queued (no slots).
    Waiting,
    Running(Box<Running>),
    /// Ended; its threads, if it ran, are joined at the end of the run.
    Ended(Option<Box<Running>>),
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config").field("slots", &self.slots).field("launcher", &self.launcher.name()).finish()
    }
}

/// The median of `v` (the mean of the middle two for an even count).
pub fn median(v: &[f64]) -> Option<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(s[n / 2]),
        _ => Some((s[n / 2 - 1] + s[n / 2]) / 2.0),
    }
}

/// Seconds a finished job's processes have to exit before they are stopped.
const LEFTOVER_GRACE_S: f64 = 10.0;

/// A job the driver holds.
struct Held {
    spec: JobSpec,
    state: State,
    alloc: Alloc,
    last_change: Option<f64>,
    out: LiveJob,
    speed: f64,
    /// Samples trained, as last reported.
    samples: u64,
}

/// Where jobs come from: a trace (all known, each with its submit time) or a
/// service taking submissions ([`Source::poll`] returns the new ones).
pub trait Source {
    /// Jobs submitted up to `now_s` (seconds of the run) and not returned
    /// before; names of jobs to kill now.
    fn poll(&mut self, now_s: f64) -> (Vec<JobSpec>, Vec<String>);
    /// No job will come any more.
    fn exhausted(&self) -> bool;
    /// Told the state of every job after each pass of the driver.
    fn observe(&mut self, _now_s: f64, _jobs: &[JobState<'_>]) {}
}

/// A job's state as a [`Source`] sees it.
#[derive(Debug)]
pub struct JobState<'a> {
    /// Its name.
    pub name: &'a str,
    /// queued, running, killed, finished, failed.
    pub state: &'static str,
    /// Its allocation.
    pub alloc: Alloc,
    /// Samples trained, of the samples asked.
    pub samples: (u64, u64),
    /// Its times.
    pub record: &'a JobRecord,
    /// Its processes per node (`name:Nw+Ms,...`).
    pub nodes: String,
    /// Why it failed, for a failed job.
    pub error: Option<&'a str>,
}

/// A trace replayed: each job submitted at its `submit_s`.
#[derive(Debug)]
pub struct Trace {
    jobs: Vec<JobSpec>,
    next: usize,
}

impl Trace {
    /// `jobs` sorted by submit time.
    pub fn new(mut jobs: Vec<JobSpec>) -> Self {
        jobs.sort_by(|a, b| a.submit_s.total_cmp(&b.submit_s));
        Self { jobs, next: 0 }
    }
}

impl Source for Trace {
    fn poll(&mut self, now_s: f64) -> (Vec<JobSpec>, Vec<String>) {
        let from = self.next;
        while self.next < self.jobs.len() && self.jobs[self.next].submit_s <= now_s {
            self.next += 1;
        }
        (self.jobs[from..self.next].to_vec(), Vec::new())
    }

    fn exhausted(&self) -> bool {
        self.next >= self.jobs.len()
    }
}

/// Runs the jobs `source` gives under `policy` until every job has ended and
/// the source is exhausted. Seconds of the run start at `t0_s` (a trace's
/// first submit time, so that times compare with the simulator's).
pub fn run(source: &mut dyn Source, cfg: &Config, policy: &mut dyn Policy, t0_s: f64) -> Result<LiveRun, String> {
    let started = Instant::now();
    let clock: Arc<dyn Fn() -> f64 + Send + Sync> = Arc::new(move || t0_s + started.elapsed().as_secs_f64());
    let mut held: Vec<Held> = Vec::new();
    let mut placement = Placement::new(if cfg.nodes.is_empty() { one_node(cfg.slots) } else { cfg.nodes.clone() });
    if placement.slots() != cfg.slots {
        return Err(format!("the nodes have {} slots, the run {}", placement.slots(), cfg.slots));
    }
    let (mut slot_seconds, mut rescales, mut timeline) = (0.0f64, 0u64, Vec::<(f64, u32)>::new());
    let mut last_decision = f64::NEG_INFINITY;
    let mut last_now = t0_s;
    let mut seed = 0u64;
    let say = |now: f64, what: String| {
        if cfg.verbose {
            eps_proto::say!("eps sched: {now:8.1} s  {what}");
        }
    };
    loop {
        let now = clock();
        if crate::cluster::interrupted() {
            for h in &held {
                if let State::Running(r) = &h.state {
                    r.kill();
                }
            }
            return Err("interrupted; stopped every job".into());
        }
        let used: u32 = held.iter().map(|h| h.alloc.slots()).sum();
        slot_seconds += f64::from(used) * (now - last_now);
        last_now = now;
        let mut event = false;
        let (arrived, kills) = source.poll(now);
        for spec in arrived {
            say(
                now,
                format!(
                    "submitted {} ({} to {} workers, {} to {} servers)",
                    spec.name, spec.workers.0, spec.workers.1, spec.servers.0, spec.servers.1
                ),
            );
            let record = JobRecord::submitted(&spec.name, spec.submit_s.max(t0_s).min(now));
            let out = LiveJob {
                record,
                launch: None,
                checksum: None,
                membership: None,
                servers_changed: false,
                error: None,
                allocs: Vec::new(),
                points: Vec::new(),
            };
            held.push(Held {
                spec,
                state: State::Waiting,
                alloc: Alloc::default(),
                last_change: None,
                out,
                speed: 1.0,
                samples: 0,
            });
            event = true;
        }
        for h in held.iter_mut().filter(|h| kills.contains(&h.spec.name)) {
            event |= end(h, now, true, &say);
        }
        // What the running jobs report.
        for h in &mut held {
            let State::Running(r) = &h.state else { continue };
            let (samples, done, ended, applied, rate) = {
                let g = r.progress.lock().unwrap_or_else(|e| e.into_inner());
                (g.samples, g.done_s, g.ended.clone(), g.applied, g.rate(2.0))
            };
            h.samples = samples;
            if let Some(rate) = rate.filter(|_| applied == h.alloc) {
                let model = cfg.model.throughput(&h.spec, applied);
                if model > 0.0 {
                    h.speed = (rate / model).clamp(0.1, 10.0);
                }
            }
            if h.out.record.feedback_s.is_none() && samples >= h.spec.feedback_samples {
                h.out.record.feedback_s = Some(now);
                say(now, format!("{} reached its feedback ({samples} samples)", h.spec.name));
                event = true;
                if h.spec.kill_after_feedback {
                    event |= end(h, now, true, &say);
                    continue;
                }
            }
            if let Some(d) = done {
                h.out.record.feedback_s.get_or_insert(d);
                event |= end(h, d, false, &say);
            } else if let Some(Err(e)) = ended {
                h.out.error.get_or_insert(e);
                event |= end(h, now, false, &say);
            }
        }
        // Ended jobs' slots are free; processes a finished job left behind
        // (a joiner it no longer needed) are stopped after a grace period.
        for (i, h) in held.iter().enumerate() {
            if matches!(h.state, State::Ended(_)) && placement.span(i) > 0 {
                placement.shrink(i, Alloc::default());
            }
            if let State::Ended(Some(r)) = &h.state {
                let g = r.progress.lock().unwrap_or_else(|e| e.into_inner());
                if g.ended.is_none() && g.done_s.is_some_and(|d| now - d > LEFTOVER_GRACE_S) {
                    drop(g);
                    r.kill();
                }
            }
        }
        // Decide.
        let active: Vec<usize> = (0..held.len()).filter(|&i| !matches!(held[i].state, State::Ended(_))).collect();
        if event || now - last_decision >= cfg.timing.tick_s {
            last_decision = now;
            let view = View {
                now_s: now,
                slots: cfg.slots,
                jobs: active
                    .iter()
                    .map(|&i| {
                        let h = &held[i];
                        let done = match &h.state {
                            State::Running(r) => r.progress.lock().unwrap_or_else(|e| e.into_inner()).samples as f64,
                            _ => 0.0,
                        };
                        JobView {
                            spec: &h.spec,
                            alloc: h.alloc,
                            done_samples: done,
                            last_change_s: h.last_change,
                            speed: h.speed,
                        }
                    })
                    .collect(),
                model: &cfg.model,
            };
            let want = policy.allocate(&view);
            check(&view.jobs, &want, cfg.slots).map_err(|e| format!("policy {} at {now:.1} s: {e}", policy.name()))?;
            drop(view);
            let changes: Vec<(usize, Alloc)> =
                active.iter().zip(&want).filter(|&(&i, &a)| a != held[i].alloc).map(|(&i, &a)| (i, a)).collect();
            placement.apply(&changes).map_err(|e| format!("placing the decision at {now:.1} s: {e}"))?;
            for (&i, &a) in active.iter().zip(&want) {
                let h = &mut held[i];
                if a == h.alloc {
                    continue;
                }
                h.out.record.max_nodes = h.out.record.max_nodes.max(placement.span(i) as u32);
                let on = placement.describe(i);
                if matches!(h.state, State::Waiting) {
                    seed += 1;
                    let mut launch = job_launch(&h.spec, a, seed)?;
                    launch.nodes = placement.of(i).iter().zip(placement.nodes()).map(|(a, n)| (n.name.clone(), *a)).collect();
                    let r = Running::start(cfg.launcher.as_ref(), &launch, a, clock.clone())
                        .map_err(|e| format!("cannot start job {}: {e}", h.spec.name))?;
                    say(now, format!("started {} on {} workers + {} servers ({on})", h.spec.name, a.workers, a.servers));
                    h.state = State::Running(Box::new(r));
                    h.out.launch = Some(launch);
                    h.out.record.start_s = Some(now);
                } else if let State::Running(r) = &h.state {
                    say(now, format!("rescaling {}: {:?} -> {a:?} ({on})", h.spec.name, h.alloc));
                    r.rescale(a);
                    h.out.record.rescales += 1;
                    rescales += 1;
                }
                h.alloc = a;
                h.last_change = Some(now);
                h.out.allocs.push((now, a));
            }
            let used: u32 = held.iter().map(|h| h.alloc.slots()).sum();
            if timeline.last().is_none_or(|&(_, u)| u != used) {
                timeline.push((now, used));
            }
            if active.iter().all(|&i| held[i].alloc.slots() == 0) && source.exhausted() {
                if let Some(&i) = active.first() {
                    return Err(format!("job {} cannot run on {} slots", held[i].spec.name, cfg.slots));
                }
                break;
            }
        }
        let states: Vec<JobState<'_>> = held.iter().enumerate().map(|(i, h)| state_of(h, placement.describe(i))).collect();
        source.observe(now, &states);
        std::thread::sleep(Duration::from_millis(20));
    }
    let (mut rescale_s, mut pause_s, mut start_s) = (Vec::new(), Vec::new(), Vec::new());
    let mut jobs = Vec::new();
    for mut h in held {
        if let State::Running(r) | State::Ended(Some(r)) = h.state {
            let deadline = Instant::now() + Duration::from_secs_f64(LEFTOVER_GRACE_S);
            while r.progress.lock().unwrap_or_else(|e| e.into_inner()).ended.is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            r.kill();
            {
                let g = r.progress.lock().unwrap_or_else(|e| e.into_inner());
                rescale_s.extend(g.rescales.iter().map(|(a, b)| b - a));
                h.out.points = g.points.clone();
                pause_s.extend(g.pauses());
                start_s.extend(h.out.record.start_s.and_then(|s| g.start_delay(s)));
            }
            r.join();
        }
        jobs.push(h.out);
    }
    let recs: Vec<JobRecord> = jobs.iter().map(|j| j.record.clone()).collect();
    let summary = summarize(policy.name().to_string(), &recs, cfg.slots, slot_seconds, rescales, timeline);
    Ok(LiveRun { summary, jobs, rescale_s, pause_s, start_s })
}

fn state_of(h: &Held, nodes: String) -> JobState<'_> {
    let state = match (&h.state, h.out.record.killed, &h.out.error) {
        (State::Waiting, ..) => "queued",
        (State::Running(_), ..) => "running",
        (State::Ended(_), true, _) => "killed",
        (State::Ended(_), _, Some(_)) => "failed",
        (State::Ended(_), ..) => "finished",
    };
    let error = h.out.error.as_deref().filter(|_| state == "failed");
    JobState {
        name: &h.spec.name,
        state,
        alloc: h.alloc,
        samples: (h.samples, h.spec.samples),
        record: &h.out.record,
        nodes,
        error,
    }
}

/// Ends a job (killed: its processes are stopped), freeing its slots.
fn end(h: &mut Held, at: f64, killed: bool, say: &dyn Fn(f64, String)) -> bool {
    let r = match std::mem::replace(&mut h.state, State::Ended(None)) {
        State::Ended(r) => {
            h.state = State::Ended(r);
            return false;
        }
        State::Waiting => None,
        State::Running(r) => Some(r),
    };
    if let Some(r) = &r {
        if killed {
            r.kill();
        }
        let g = r.progress.lock().unwrap_or_else(|e| e.into_inner());
        h.out.checksum = g.checksum.clone();
        h.out.membership = g.membership.clone();
        h.out.servers_changed = g.servers_changed;
        if let Some(e) = &g.scale_error {
            h.out.error.get_or_insert_with(|| format!("rescale failed {e}"));
        }
    }
    h.state = State::Ended(r);
    h.out.record.end_s = Some(at);
    h.out.record.killed = killed;
    h.alloc = Alloc::default();
    let how = match (killed, &h.out.error) {
        (true, _) => "killed".to_string(),
        (false, Some(e)) => format!("failed: {e}"),
        (false, None) => "finished".to_string(),
    };
    say(at, format!("{} {how}", h.spec.name));
    true
}
