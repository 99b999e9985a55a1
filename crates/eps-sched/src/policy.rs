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
        Self { tick_s: 30.0, min_interval_s: 30.0 }
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
pub const NAMES: [&str; 3] = ["static", "optimus", "eps"];

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

/// One slot less for a job (never below its minimum), with the seconds it
/// costs on its remaining samples.
fn cheapest_cut(m: &ClusterModel, j: &JobView<'_>, a: Alloc) -> Option<(f64, Alloc)> {
    let min = j.spec.min_alloc();
    let now = time_s(m, j, a, j.remaining());
    [
        (a.workers > min.workers).then_some(Alloc { workers: a.workers - 1, ..a }),
        (a.servers > min.servers).then_some(Alloc { servers: a.servers - 1, ..a }),
    ]
    .into_iter()
    .flatten()
    .map(|b| (time_s(m, j, b, j.remaining()) - now, b))
    .min_by(|x, y| x.0.total_cmp(&y.0))
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

/// Gives `free` slots one at a time to the jobs `eligible` says may grow,
/// each to the job whose remaining time it cuts most.
fn grow(m: &ClusterModel, v: &View<'_>, out: &mut [Alloc], mut free: u32, eligible: &dyn Fn(usize) -> bool) -> u32 {
    let mut heap: BinaryHeap<Gain> = BinaryHeap::new();
    for i in (0..out.len()).filter(|&i| out[i].slots() > 0 && eligible(i)) {
        if let Some((g, _)) = best_step(m, &v.jobs[i], out[i]) {
            heap.push(Gain(g, i));
        }
    }
    while free > 0 {
        let Some(Gain(_, i)) = heap.pop() else { break };
        if let Some((_, b)) = best_step(m, &v.jobs[i], out[i]) {
            out[i] = b;
            free -= 1;
            if let Some((g, _)) = best_step(m, &v.jobs[i], out[i]) {
                heap.push(Gain(g, i));
            }
        }
    }
    free
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
        let mut out: Vec<Alloc> =
            v.jobs.iter().map(|j| if j.running() { j.spec.min_alloc() } else { Alloc::default() }).collect();
        let mut free = v.slots - out.iter().map(|a| a.slots()).sum::<u32>();
        for (i, j) in v.jobs.iter().enumerate().filter(|(_, j)| !j.running()) {
            let need = j.spec.min_alloc().slots();
            if need > free {
                break;
            }
            free -= need;
            out[i] = j.spec.min_alloc();
        }
        grow(v.model, v, &mut out, free, &|_| true);
        out
    }
}

/// `eps`: the elastic parameter server's heuristic. A new job starts at once,
/// at least at its minimum, with slots taken from the running jobs whose
/// remaining time the loss lengthens least; freed slots go to the jobs whose
/// remaining time they shorten most. A rescale is made only when the time it
/// saves exceeds what it costs (the pause, the bytes migrated), and a job is
/// grown at most once per `min_interval_s`.
#[derive(Debug)]
pub struct Eps {
    /// Least time between two growths of one job, seconds.
    pub min_interval_s: f64,
}

impl Default for Eps {
    fn default() -> Self {
        Self { min_interval_s: 30.0 }
    }
}

impl Policy for Eps {
    fn name(&self) -> &'static str {
        "eps"
    }

    fn allocate(&mut self, v: &View<'_>) -> Vec<Alloc> {
        let m = v.model;
        let mut out: Vec<Alloc> = v.jobs.iter().map(|j| j.alloc).collect();
        let used: u32 = out.iter().map(|a| a.slots()).sum();
        let mut free = v.slots - used;
        // Admit every queued job whose minimum can be found.
        for i in (0..v.jobs.len()).filter(|&i| !v.jobs[i].running()) {
            let need = v.jobs[i].spec.min_alloc().slots();
            let spare: u32 =
                (0..out.len()).filter(|&k| out[k].slots() > 0).map(|k| out[k].slots() - v.jobs[k].spec.min_alloc().slots()).sum();
            if need > free + spare {
                continue; // not even at everybody's minimum; a later, smaller job may fit
            }
            while free < need {
                // Jobs still before their feedback give first (most of them
                // are killed there; their width matters least), then the
                // kept ones, each time the one whose remaining time grows least.
                let cut = (0..out.len())
                    .filter(|&k| out[k].slots() > 0 && k != i)
                    .filter_map(|k| cheapest_cut(m, &v.jobs[k], out[k]).map(|(c, b)| (v.jobs[k].past_feedback(), c, k, b)))
                    .min_by(|x, y| x.0.cmp(&y.0).then(x.1.total_cmp(&y.1)))
                    .map(|(_, c, k, b)| (c, k, b));
                let Some((_, k, b)) = cut else { break };
                out[k] = b;
                free += 1;
            }
            if free >= need {
                free -= need;
                out[i] = v.jobs[i].spec.min_alloc();
            }
        }
        // Growth, bounded in frequency; a growth must pay for its rescale.
        let now = v.now_s;
        let interval = self.min_interval_s;
        let may_grow = |i: usize| !v.jobs[i].running() || v.jobs[i].last_change_s.is_none_or(|t| now - t >= interval);
        let before = out.clone();
        // Kept jobs (past their feedback) first: they are the ones that run to
        // completion; then the others, which need no more than their minimum
        // to give feedback soon.
        let left = grow(m, v, &mut out, free, &|i| may_grow(i) && v.jobs[i].past_feedback());
        let mut left = grow(m, v, &mut out, left, &may_grow);
        for i in 0..out.len() {
            let j = &v.jobs[i];
            if !j.running() || out[i] == before[i] {
                continue;
            }
            let saved = time_s(m, j, before[i], j.remaining()) - time_s(m, j, out[i], j.remaining());
            if saved <= m.rescale_s(j.spec, before[i], out[i]) {
                left += out[i].slots() - before[i].slots();
                out[i] = before[i];
            }
        }
        let _ = left;
        out
    }
}
