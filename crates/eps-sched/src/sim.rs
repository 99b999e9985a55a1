//! The trace-driven simulator: discrete events (arrivals, feedbacks, ends),
//! deterministic, driving a [`Policy`] over the [`ClusterModel`]. A job trains
//! at the model's throughput for its allocation; a start or a rescale pauses
//! it for the model's cost of that change.

use crate::model::{Alloc, ClusterModel};
use crate::placement::{Node, Placement, one_node};
use crate::policy::{JobView, Policy, View, check};
use crate::trace::JobSpec;

/// What happened to one job.
#[derive(Clone, Debug, PartialEq)]
pub struct JobRecord {
    /// Its name.
    pub name: String,
    /// Submitted, started, feedback reached, ended (seconds).
    pub submit_s: f64,
    /// When it first got slots.
    pub start_s: Option<f64>,
    /// When its feedback samples were done.
    pub feedback_s: Option<f64>,
    /// When it finished or was killed.
    pub end_s: Option<f64>,
    /// Killed at its feedback (else it ran to completion).
    pub killed: bool,
    /// Allocation changes after its start.
    pub rescales: u32,
    /// The most nodes its processes ran on at once.
    pub max_nodes: u32,
}

impl JobRecord {
    /// A job submitted at `submit_s`, not started yet.
    pub fn submitted(name: &str, submit_s: f64) -> Self {
        Self {
            name: name.to_string(),
            submit_s,
            start_s: None,
            feedback_s: None,
            end_s: None,
            killed: false,
            rescales: 0,
            max_nodes: 0,
        }
    }
}

/// The run's figures.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// The policy.
    pub policy: String,
    /// Jobs in the trace.
    pub jobs: usize,
    /// Mean and 95th percentile of submit-to-feedback times.
    pub avg_feedback_latency_s: f64,
    /// 95th percentile of the same.
    pub p95_feedback_latency_s: f64,
    /// Mean submit-to-end time of the jobs run to completion.
    pub avg_jct_s: f64,
    /// First submit to last end.
    pub makespan_s: f64,
    /// Slot-seconds allocated over slot-seconds available in the makespan.
    pub utilization: f64,
    /// Rescales of running jobs in all.
    pub rescales: u64,
    /// Longest submit-to-start time.
    pub max_queue_wait_s: f64,
    /// Slots allocated after each decision: (seconds, slots).
    pub timeline: Vec<(f64, u32)>,
}

/// Per job, while the run goes.
struct Live {
    alloc: Alloc,
    done: f64,
    pause_until: f64,
    last_change: Option<f64>,
}

/// Why a run failed: a policy broke a rule (a bug in it).
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum SimError {
    /// Allocations above the cluster, or a running job below its minimum.
    #[error("policy {policy} at {at_s:.3} s: {what}")]
    Policy {
        /// The policy.
        policy: String,
        /// When.
        at_s: f64,
        /// What it did.
        what: String,
    },
    /// Nothing can ever run: a job waits while every slot is free.
    #[error("policy {policy} leaves job {job} queued on an idle cluster (its minimum may exceed the slots)")]
    Stuck {
        /// The policy.
        policy: String,
        /// The job.
        job: String,
    },
}

/// The longest time between two decisions while jobs are active, seconds.
pub const DECISION_TICK_S: f64 = 30.0;

fn reached(done: f64, target: f64) -> bool {
    target - done <= 1e-9 * target.max(1.0)
}

/// How a simulation runs besides its trace, cluster and policy.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// The longest time between two decisions while jobs are active, seconds.
    pub tick_s: f64,
    /// How far each job's real speed may be from the model's: a factor
    /// between 1/(1+noise) and 1+noise (log-uniform), drawn per job from
    /// `seed`. The policy plans with the model until the job has run for
    /// [`MEASURED_AFTER_S`], then with its measured speed (as live runs do).
    pub noise: f64,
    /// Seed of the speed factors.
    pub seed: u64,
    /// The cluster's nodes, their slots adding up to the run's slots (none:
    /// one node of all the slots).
    pub nodes: Vec<Node>,
}

impl Default for Options {
    fn default() -> Self {
        Self { tick_s: DECISION_TICK_S, noise: 0.0, seed: 0, nodes: Vec::new() }
    }
}

/// Seconds a job must have run before its measured speed is known.
pub const MEASURED_AFTER_S: f64 = 2.0;

/// A job's speed factor for `o` (1 without noise).
pub fn speed_factor(o: &Options, name: &str) -> f64 {
    if o.noise <= 0.0 {
        return 1.0;
    }
    // splitmix64 over the seed and the name's bytes.
    let mut x = o.seed ^ 0x9e37_79b9_7f4a_7c15;
    for b in name.bytes() {
        x = (x ^ u64::from(b)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x ^= x >> 31;
    }
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    let u = (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
    (u * (1.0 + o.noise).ln()).exp()
}

/// Runs `jobs` (sorted by submit time) on `slots` slots under `policy`,
/// deciding at least every [`DECISION_TICK_S`], every job at the model's speed.
pub fn run(
    jobs: &[JobSpec],
    slots: u32,
    model: &ClusterModel,
    policy: &mut dyn Policy,
) -> Result<(Summary, Vec<JobRecord>), SimError> {
    run_with(jobs, slots, model, policy, &Options::default())
}

/// As [`run`], with `o`'s tick and speed noise.
pub fn run_with(
    jobs: &[JobSpec],
    slots: u32,
    model: &ClusterModel,
    policy: &mut dyn Policy,
    o: &Options,
) -> Result<(Summary, Vec<JobRecord>), SimError> {
    let tick_s = o.tick_s;
    let factor: Vec<f64> = jobs.iter().map(|j| speed_factor(o, &j.name)).collect();
    let name = policy.name().to_string();
    let nodes = if o.nodes.is_empty() { one_node(slots) } else { o.nodes.clone() };
    let mut placement = Placement::new(nodes);
    if placement.slots() != slots {
        return Err(SimError::Policy {
            policy: name,
            at_s: 0.0,
            what: format!("the nodes have {} slots, the run {slots}", placement.slots()),
        });
    }
    let mut rec: Vec<JobRecord> = jobs.iter().map(|j| JobRecord::submitted(&j.name, j.submit_s)).collect();
    let mut live: Vec<Live> =
        jobs.iter().map(|_| Live { alloc: Alloc::default(), done: 0.0, pause_until: 0.0, last_change: None }).collect();
    // Active jobs (submitted, not ended), in submit order.
    let mut active: Vec<usize> = Vec::new();
    let mut next = 0usize;
    let mut now = jobs.first().map_or(0.0, |j| j.submit_s);
    let (mut slot_seconds, mut rescales) = (0.0f64, 0u64);
    let mut timeline: Vec<(f64, u32)> = Vec::new();
    // A job's speed on its allocation as placed (the network between nodes
    // costs a job spread over them, when the model has one).
    let rate = |i: usize, l: &Live, p: &Placement| model.throughput_on_nodes(&jobs[i], l.alloc, p.of(i)) * factor[i];
    loop {
        // Arrivals now.
        while next < jobs.len() && jobs[next].submit_s <= now {
            active.push(next);
            next += 1;
        }
        // Decide.
        let view = View {
            now_s: now,
            slots,
            jobs: active
                .iter()
                .map(|&i| JobView {
                    spec: &jobs[i],
                    alloc: live[i].alloc,
                    done_samples: live[i].done,
                    last_change_s: live[i].last_change,
                    speed: match rec[i].start_s {
                        Some(s) if now - s >= MEASURED_AFTER_S => factor[i],
                        _ => 1.0,
                    },
                })
                .collect(),
            model,
        };
        let want = policy.allocate(&view);
        check(&view.jobs, &want, slots).map_err(|what| SimError::Policy { policy: name.clone(), at_s: now, what })?;
        let changes: Vec<(usize, Alloc)> =
            active.iter().zip(&want).filter(|&(&i, &a)| a != live[i].alloc).map(|(&i, &a)| (i, a)).collect();
        placement.apply(&changes).map_err(|what| SimError::Policy { policy: name.clone(), at_s: now, what })?;
        for &(i, _) in &changes {
            rec[i].max_nodes = rec[i].max_nodes.max(placement.span(i) as u32);
        }
        for (&i, &a) in active.iter().zip(&want) {
            let l = &mut live[i];
            if a == l.alloc {
                continue;
            }
            let pause = if l.alloc.slots() == 0 {
                rec[i].start_s = Some(now);
                model.start_s(&jobs[i])
            } else {
                rec[i].rescales += 1;
                rescales += 1;
                model.rescale_s(&jobs[i], l.alloc, a)
            };
            l.pause_until = l.pause_until.max(now) + pause;
            l.alloc = a;
            l.last_change = Some(now);
        }
        let used: u32 = active.iter().map(|&i| live[i].alloc.slots()).sum();
        if timeline.last().is_none_or(|&(_, u)| u != used) {
            timeline.push((now, used));
        }
        if active.iter().all(|&i| live[i].alloc.slots() == 0) && next >= jobs.len() {
            if let Some(&i) = active.first() {
                return Err(SimError::Stuck { policy: name, job: jobs[i].name.clone() });
            }
            break;
        }
        // The next event: an arrival, or a job reaching its feedback or end.
        let mut t_next = if next < jobs.len() { jobs[next].submit_s } else { f64::INFINITY };
        for &i in &active {
            let l = &live[i];
            let r = rate(i, l, &placement);
            if r <= 0.0 {
                continue;
            }
            let fb = jobs[i].feedback_samples as f64;
            let target = if rec[i].feedback_s.is_none() { fb } else { jobs[i].end_samples() as f64 };
            t_next = t_next.min(l.pause_until.max(now) + (target - l.done).max(0.0) / r);
        }
        // The policy decides again at least every `DECISION_TICK_S` while
        // jobs are active: a rescale held back (its frequency is bounded) is
        // reconsidered even when nothing arrives or ends.
        if !active.is_empty() {
            t_next = t_next.min(now + tick_s);
        }
        if !t_next.is_finite() {
            return Err(SimError::Stuck {
                policy: name,
                job: active.first().map_or_else(String::new, |&i| jobs[i].name.clone()),
            });
        }
        // Advance every running job to it.
        let dt = t_next - now;
        for &i in &active {
            let r = rate(i, &live[i], &placement);
            let l = &mut live[i];
            slot_seconds += f64::from(l.alloc.slots()) * dt;
            let run = (t_next - l.pause_until.max(now)).max(0.0);
            l.done = (l.done + r * run).min(jobs[i].samples as f64);
        }
        now = t_next;
        // Milestones.
        active.retain(|&i| {
            let l = &mut live[i];
            let j = &jobs[i];
            if rec[i].feedback_s.is_none() && reached(l.done, j.feedback_samples as f64) {
                l.done = l.done.max(j.feedback_samples as f64);
                rec[i].feedback_s = Some(now);
            }
            if rec[i].feedback_s.is_some() && reached(l.done, j.end_samples() as f64) {
                rec[i].end_s = Some(now);
                rec[i].killed = j.kill_after_feedback;
                l.alloc = Alloc::default();
                placement.shrink(i, Alloc::default());
                return false;
            }
            true
        });
    }
    let summary = summarize(name, &rec, slots, slot_seconds, rescales, timeline);
    Ok((summary, rec))
}

/// The run's figures from its job records: `slot_seconds` allocated in all,
/// `rescales` of running jobs, `timeline` the slots allocated after each
/// decision. The simulator and the live driver report the same figures.
pub fn summarize(
    policy: String,
    rec: &[JobRecord],
    slots: u32,
    slot_seconds: f64,
    rescales: u64,
    timeline: Vec<(f64, u32)>,
) -> Summary {
    let first = rec.iter().map(|r| r.submit_s).fold(f64::INFINITY, f64::min);
    let first = if first.is_finite() { first } else { 0.0 };
    let makespan = rec.iter().filter_map(|r| r.end_s).fold(first, f64::max) - first;
    let mut fb: Vec<f64> = rec.iter().filter_map(|r| r.feedback_s.map(|f| f - r.submit_s)).collect();
    fb.sort_by(f64::total_cmp);
    let jct: Vec<f64> = rec.iter().filter(|r| !r.killed).filter_map(|r| r.end_s.map(|e| e - r.submit_s)).collect();
    let mean = |v: &[f64]| if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
    let p95 = fb.get(((fb.len() as f64 * 0.95).ceil() as usize).saturating_sub(1)).copied().unwrap_or(0.0);
    Summary {
        policy,
        jobs: rec.len(),
        avg_feedback_latency_s: mean(&fb),
        p95_feedback_latency_s: p95,
        avg_jct_s: mean(&jct),
        makespan_s: makespan,
        utilization: if makespan > 0.0 { slot_seconds / (f64::from(slots) * makespan) } else { 0.0 },
        rescales,
        max_queue_wait_s: rec.iter().filter_map(|r| r.start_s.map(|s| s - r.submit_s)).fold(0.0, f64::max),
        timeline,
    }
}
