//! Scheduling policies behind one trait. A policy sees the active jobs (queued
//! and running) and returns the allocation each should have now; the caller
//! (the simulator, or the live driver) applies the differences: starts jobs,
//! rescales running ones through their control plane's scale API.

use std::collections::BinaryHeap;

use crate::model::{Alloc, ClusterModel};
use crate::trace::JobSpec;

/// A job as the policy sees it.
#[derive(Clone, Debug)]
pub struct JobView<'a> {
    /// Its spec.
    pub spec: &'a JobSpec,
    /// Its allocation now (zero while queued).
    pub alloc: Alloc,
    /// Samples trained so far.
    pub done_samples: f64,
    /// When it was last started or rescaled.
    pub last_change_s: Option<f64>,
    /// Its measured throughput over the model's for its allocation (1: the
    /// model as it is; the live driver refines it from the iteration times
    /// the job reports). Every estimate of this job's time is divided by it.
    pub speed: f64,
}

impl JobView<'_> {
    /// Whether it runs (it has slots).
    pub fn running(&self) -> bool {
        self.alloc.slots() > 0
    }

    /// Whether its feedback samples are done (the user looked at it and kept it).
    pub fn past_feedback(&self) -> bool {
        self.done_samples >= self.spec.feedback_samples as f64
    }

    /// Samples left of the training it asked for (whether the user will
    /// kill it at its feedback is the user's secret).
    pub fn remaining(&self) -> f64 {
        (self.spec.samples as f64 - self.done_samples).max(0.0)
    }
}

/// What a policy decides from.
#[derive(Clone, Debug)]
pub struct View<'a> {
    /// Now, seconds.
    pub now_s: f64,
    /// Slots of the cluster.
    pub slots: u32,
    /// Active jobs in submit order.
    pub jobs: Vec<JobView<'a>>,
    /// The cluster model.
    pub model: &'a ClusterModel,
}

/// A scheduling policy.
pub trait Policy {
    /// Its name (`static`, `eps`, `optimus`).
    fn name(&self) -> &'static str;
    /// The allocation of every job of `v.jobs`, in the same order: zero to
    /// keep it queued; a running job keeps at least its minimum; the slots
    /// add up to at most `v.slots`.
    fn allocate(&mut self, v: &View<'_>) -> Vec<Alloc>;
}

/// The scheduler's clocks, the same in the simulator and in live runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// The longest time between two decisions while jobs are active, seconds.
    pub tick_s: f64,
    /// `eps`: the least time between two growths of one job, seconds.
    pub min_interval_s: f64,
}

impl Default for Timing {
    fn default() -> Self {
        Self { tick_s: 30.0, min_interval_s: 10.0 }
    }
}

impl Timing {
    /// Both clocks times `x` (a trace replayed `x` times as fast or slow).
    pub fn scaled(self, x: f64) -> Self {
        Self { tick_s: self.tick_s * x, min_interval_s: self.min_interval_s * x }
    }
}

/// The policies by name, with the default clocks.
pub fn by_name(name: &str) -> Option<Box<dyn Policy>> {
    by_name_timed(name, Timing::default())
}

/// The policies by name, with the clocks of `t`.
pub fn by_name_timed(name: &str, t: Timing) -> Option<Box<dyn Policy>> {
    match name {
        "static" => Some(Box::new(Static)),
        "eps" => Some(Box::new(Eps { min_interval_s: t.min_interval_s })),
        "optimus" => Some(Box::new(Optimus)),
        "pollux" => Some(Box::new(Pollux)),
        _ => None,
    }
}

/// Checks a policy's answer `want` for `jobs` on `slots` slots: one
/// allocation per job, within the slots, every job within its sizes, no
/// running job cut below its minimum. The simulator and the live driver
/// refuse an answer that breaks a rule (a bug in the policy).
pub fn check(jobs: &[JobView<'_>], want: &[Alloc], slots: u32) -> Result<(), String> {
    let total: u32 = want.iter().map(|a| a.slots()).sum();
    if want.len() != jobs.len() || total > slots {
        return Err(format!("{total} slots allocated of {slots} ({} answers for {} jobs)", want.len(), jobs.len()));
    }
    for (j, &a) in jobs.iter().zip(want) {
        let (min, max) = (j.spec.min_alloc(), j.spec.max_alloc());
        if j.running() && (a.workers < min.workers || a.servers < min.servers) {
            return Err(format!("job {} cut below its minimum to {a:?}", j.spec.name));
        }
        if a.workers > max.workers
            || a.servers > max.servers
            || (a.slots() > 0 && (a.workers < min.workers || a.servers < min.servers))
        {
            return Err(format!("job {} given {a:?} outside its sizes", j.spec.name));
        }
    }
    Ok(())
}

/// The policies `--compare` runs.
pub const NAMES: [&str; 4] = ["static", "optimus", "pollux", "eps"];

/// Seconds for `j` to train `samples` on `a` (infinite without throughput).
fn time_s(m: &ClusterModel, j: &JobView<'_>, a: Alloc, samples: f64) -> f64 {
    let tp = m.throughput(j.spec, a) * j.speed;
    if tp > 0.0 { samples / tp } else { f64::INFINITY }
}

/// The allocation a job asks for, cut to fit `slots` (workers first, never
/// below the minimum).
fn asked(j: &JobSpec, slots: u32) -> Alloc {
    let mut a = j.max_alloc();
    while a.slots() > slots && a.workers > j.workers.0 {
        a.workers -= 1;
    }
    while a.slots() > slots && a.servers > j.servers.0 {
        a.servers -= 1;
    }
    a
}

/// `static`: first come, first served, each job at the sizes it asked for
/// from start to end, no job overtaking the head of the queue: what a
/// parameter-server cluster does today.
#[derive(Debug, Default)]
pub struct Static;

impl Policy for Static {
    fn name(&self) -> &'static str {
        "static"
    }

    fn allocate(&mut self, v: &View<'_>) -> Vec<Alloc> {
        let mut out: Vec<Alloc> = v.jobs.iter().map(|j| j.alloc).collect();
        let mut free = v.slots - out.iter().map(|a| a.slots()).sum::<u32>();
        for (i, j) in v.jobs.iter().enumerate().filter(|(_, j)| !j.running()) {
            let a = asked(j.spec, v.slots);
            if a.slots() > free {
                break; // FIFO: nobody overtakes the head
            }
            free -= a.slots();
            out[i] = a;
        }
        out
    }
}

/// One more slot for job `i` (a worker or a server, whichever saves more
/// time), with the seconds it saves on its remaining samples.
fn best_step(m: &ClusterModel, j: &JobView<'_>, a: Alloc) -> Option<(f64, Alloc)> {
    let max = j.spec.max_alloc();
    let now = time_s(m, j, a, j.remaining());
    [
        (a.workers < max.workers).then_some(Alloc { workers: a.workers + 1, ..a }),
        (a.servers < max.servers).then_some(Alloc { servers: a.servers + 1, ..a }),
    ]
    .into_iter()
    .flatten()
    .map(|b| (now - time_s(m, j, b, j.remaining()), b))
    .filter(|(g, _)| *g > 0.0)
    .max_by(|x, y| x.0.total_cmp(&y.0))
}

#[derive(PartialEq)]
struct Gain(f64, usize);
impl Eq for Gain {}
impl PartialOrd for Gain {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Gain {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0).then(o.1.cmp(&self.1))
    }
}

/// Every running job at its minimum, then queued jobs admitted at theirs in
/// submit order while they fit (none overtakes the first that does not), as
/// `optimus` and `pollux` start each decision; with the slots left.
fn minimums_in_order(v: &View<'_>) -> (Vec<Alloc>, u32) {
    let mut out: Vec<Alloc> = v.jobs.iter().map(|j| if j.running() { j.spec.min_alloc() } else { Alloc::default() }).collect();
    let mut free = v.slots.saturating_sub(out.iter().map(|a| a.slots()).sum::<u32>());
    for (i, j) in v.jobs.iter().enumerate().filter(|(_, j)| !j.running()) {
        let need = j.spec.min_alloc().slots();
        if need > free {
            break;
        }
        free -= need;
        out[i] = j.spec.min_alloc();
    }
    (out, free)
}

/// `optimus`: an Optimus-style marginal-gain allocator. At every event it
/// admits queued jobs in submit order while their minimum fits (it never
/// shrinks a running job to admit one), then deals every slot above the
/// minimums out again, one at a time, to the job whose remaining time it cuts
/// most; rescale costs are not weighed.
#[derive(Debug, Default)]
pub struct Optimus;

impl Policy for Optimus {
    fn name(&self) -> &'static str {
        "optimus"
    }

    fn allocate(&mut self, v: &View<'_>) -> Vec<Alloc> {
        let (mut out, free) = minimums_in_order(v);
        deal_by(&mut out, free, |i, a| best_step(v.model, &v.jobs[i], a));
        out
    }
}

/// `pollux`: a Pollux-style goodput allocator, without its batch-size
/// adaptation (EPS's jobs keep their batch). At every event it admits queued
/// jobs in submit order while their minimum fits, then deals every slot above
/// the minimums one at a time to the job whose speedup (its throughput over
/// its throughput at its minimum) the slot raises most: the sum of speedups
/// is what it maximises, whatever each job has left to train. Rescale costs
/// are not weighed.
#[derive(Debug, Default)]
pub struct Pollux;

impl Policy for Pollux {
    fn name(&self) -> &'static str {
        "pollux"
    }

    fn allocate(&mut self, v: &View<'_>) -> Vec<Alloc> {
        let m = v.model;
        let (mut out, free) = minimums_in_order(v);
        let step = |i: usize, a: Alloc| -> Option<(f64, Alloc)> {
            let j = &v.jobs[i];
            let (max, base) = (j.spec.max_alloc(), m.throughput(j.spec, j.spec.min_alloc()));
            [
                (a.workers < max.workers).then_some(Alloc { workers: a.workers + 1, ..a }),
                (a.servers < max.servers).then_some(Alloc { servers: a.servers + 1, ..a }),
            ]
            .into_iter()
            .flatten()
            .map(|b| ((m.throughput(j.spec, b) - m.throughput(j.spec, a)) / base, b))
            .filter(|(g, _)| *g > 0.0 && g.is_finite())
            .max_by(|x, y| x.0.total_cmp(&y.0))
        };
        deal_by(&mut out, free, step);
        out
    }
}

/// `eps`: the elastic parameter server's heuristic, shortest milestone first.
///
/// - Every running job keeps its minimum; queued jobs are admitted at theirs,
///   the one nearest its feedback first (shortest first is the order that
///   minimises mean waiting; most jobs of an exploration are killed at their
///   feedback), taking the slots running jobs hold above their minimums.
/// - The other slots are dealt one at a time to the job whose next milestone
///   (its feedback, or once past it its end) the slot brings nearest, relative
///   to how far that milestone is ([`deal`]): near milestones first, so a new
///   job reaches its feedback at once while the long runs use what is left.
/// - A running job grows only when the time the growth saves exceeds what its
///   rescale costs (the pause, the bytes migrated), and at most once per
///   `min_interval_s`; a growth held back leaves its slots to the others.
#[derive(Debug)]
pub struct Eps {
    /// Least time between two growths of one job, seconds.
    pub min_interval_s: f64,
}

impl Default for Eps {
    fn default() -> Self {
        Self { min_interval_s: Timing::default().min_interval_s }
    }
}

impl Policy for Eps {
    fn name(&self) -> &'static str {
        "eps"
    }

    fn allocate(&mut self, v: &View<'_>) -> Vec<Alloc> {
        let m = v.model;
        let n = v.jobs.len();
        let cur: Vec<Alloc> = v.jobs.iter().map(|j| j.alloc).collect();
        let mut base: Vec<Alloc> =
            v.jobs.iter().map(|j| if j.running() { j.spec.min_alloc() } else { Alloc::default() }).collect();
        let mut free = v.slots.saturating_sub(base.iter().map(|a| a.slots()).sum::<u32>());
        let mut queued: Vec<usize> = (0..n).filter(|&i| !v.jobs[i].running()).collect();
        let first = |i: usize| milestone_s(m, &v.jobs[i], v.jobs[i].spec.min_alloc());
        queued.sort_by(|&a, &b| first(a).total_cmp(&first(b)).then(a.cmp(&b)));
        for i in queued {
            let need = v.jobs[i].spec.min_alloc().slots();
            if need <= free {
                free -= need;
                base[i] = v.jobs[i].spec.min_alloc();
            }
        }
        // Deal the rest; a growth that comes too soon or does not pay is held
        // at today's allocation and the rest dealt again without it (a few
        // times: what is still held back after that stays free until the
        // next decision).
        let mut held = vec![false; n];
        let mut soon = vec![false; n];
        let mut out = base.clone();
        for round in 0..=HOLD_ROUNDS {
            out = base.clone();
            for i in (0..n).filter(|&i| held[i]) {
                out[i] = cur[i];
            }
            let used: u32 = out.iter().map(|a| a.slots()).sum();
            deal(m, v, &mut out, v.slots.saturating_sub(used), &|i| !held[i]);
            let more = self.hold(v, &cur, &mut out, &mut held, &mut soon, round == HOLD_ROUNDS);
            if !more {
                break;
            }
        }
        // Slots nobody else takes go to jobs held back only because they
        // changed less than `min_interval_s` ago, where the growth pays:
        // the interval keeps jobs from churning, not slots idle.
        let used: u32 = out.iter().map(|a| a.slots()).sum();
        if used < v.slots && soon.iter().any(|&s| s) {
            let before = out.clone();
            deal(m, v, &mut out, v.slots - used, &|i| soon[i]);
            for i in 0..n {
                if !soon[i] || out[i] == before[i] {
                    continue;
                }
                if !pays(m, &v.jobs[i], cur[i], out[i]) {
                    out[i] = before[i];
                }
            }
        }
        out
    }
}

impl Eps {
    /// Holds back the growths of `out` that come too soon or do not pay:
    /// marks them `held` (and `soon` when only the interval holds them
    /// back); on the `last` round trims them to today's slots instead. True
    /// if any was held back.
    fn hold(&self, v: &View<'_>, cur: &[Alloc], out: &mut [Alloc], held: &mut [bool], soon: &mut [bool], last: bool) -> bool {
        let m = v.model;
        let mut more = false;
        for i in 0..out.len() {
            let j = &v.jobs[i];
            if held[i] || !j.running() || out[i].slots() <= cur[i].slots() {
                continue;
            }
            let early = j.last_change_s.is_some_and(|t| v.now_s - t < self.min_interval_s);
            let worth = pays(m, j, cur[i], out[i]);
            if early || !worth {
                held[i] = true;
                soon[i] = worth;
                more = true;
                if last {
                    out[i] = trimmed(out[i], cur[i]);
                }
            }
        }
        more
    }
}

/// Whether growing `j` from `from` to `to` brings its next milestone nearer
/// by more than the rescale costs.
fn pays(m: &ClusterModel, j: &JobView<'_>, from: Alloc, to: Alloc) -> bool {
    milestone_s(m, j, from) - milestone_s(m, j, to) > m.rescale_s(j.spec, from, to)
}

/// Times [`Eps`] deals again after holding growths back.
const HOLD_ROUNDS: usize = 4;

/// `a` with slots taken off (from whichever of workers and servers is above
/// `to`'s) until it has no more than `to`.
fn trimmed(mut a: Alloc, to: Alloc) -> Alloc {
    while a.slots() > to.slots() {
        if a.workers > to.workers {
            a.workers -= 1;
        } else {
            a.servers -= 1;
        }
    }
    a
}

/// Seconds to `j`'s next milestone on `a`: its feedback, or once past it
/// its end.
fn milestone_s(m: &ClusterModel, j: &JobView<'_>, a: Alloc) -> f64 {
    let left = if j.past_feedback() { j.remaining() } else { j.spec.feedback_samples as f64 - j.done_samples };
    time_s(m, j, a, left.max(0.0))
}

/// Deals `free` slots one at a time to the jobs `eligible` allows, each to
/// the job whose next milestone it brings nearest relative to how far it
/// is: saved seconds over the milestone's distance to the power 1.25,
/// between the relative speedup (1) and shortest first (2). Of 1, 1.1, 1.2,
/// 1.25, 1.3, 1.5 and 2, tried on the shipped Philly-derived workloads and
/// ten generated traces, 1.2 and 1.25 lost to a baseline in the fewest cells.
fn deal(m: &ClusterModel, v: &View<'_>, out: &mut [Alloc], free: u32, eligible: &dyn Fn(usize) -> bool) {
    let step = |i: usize, a: Alloc| -> Option<(f64, Alloc)> {
        if !eligible(i) {
            return None;
        }
        let j = &v.jobs[i];
        let max = j.spec.max_alloc();
        let t = milestone_s(m, j, a);
        if !(t.is_finite() && t > 0.0) {
            return None;
        }
        [
            (a.workers < max.workers).then_some(Alloc { workers: a.workers + 1, ..a }),
            (a.servers < max.servers).then_some(Alloc { servers: a.servers + 1, ..a }),
        ]
        .into_iter()
        .flatten()
        .map(|b| ((t - milestone_s(m, j, b)) / (t * t.sqrt().sqrt()), b))
        .filter(|(g, _)| *g > 0.0)
        .max_by(|x, y| x.0.total_cmp(&y.0))
    };
    deal_by(out, free, step);
}

/// Gives `free` slots one at a time to running jobs (those with slots in
/// `out`), each to the job whose `step` (its gain and its allocation with
/// one slot more, or none) gains most.
fn deal_by(out: &mut [Alloc], mut free: u32, step: impl Fn(usize, Alloc) -> Option<(f64, Alloc)>) {
    let mut heap: BinaryHeap<Gain> = BinaryHeap::new();
    for i in (0..out.len()).filter(|&i| out[i].slots() > 0) {
        if let Some((g, _)) = step(i, out[i]) {
            heap.push(Gain(g, i));
        }
    }
    while free > 0 {
        let Some(Gain(_, i)) = heap.pop() else { break };
        if let Some((_, b)) = step(i, out[i]) {
            out[i] = b;
            free -= 1;
            if let Some((g, _)) = step(i, out[i]) {
                heap.push(Gain(g, i));
            }
        }
    }
}
