//! Policies compared over a grid: workloads, each at several loads (its
//! arrivals compressed) on several cluster sizes, every policy in each cell.
//! `eps sim grid` prints it; the tests hold `eps` to it.

use crate::Timing;
use crate::model::ClusterModel;
use crate::placement::Node;
use crate::policy::by_name_timed;
use crate::sim::{self, Options, SimError, Summary};
use crate::trace::JobSpec;

/// A cell counts as contended when `static` keeps more than this share of
/// the slots busy: below it every policy starts every job at once.
pub const CONTENDED_UTILIZATION: f64 = 0.4;

/// One cell: a workload at one load on one cluster, every policy's run.
#[derive(Clone, Debug)]
pub struct Cell {
    /// The workload's name.
    pub workload: String,
    /// Arrivals this many times as dense as the trace's.
    pub load: f64,
    /// Slots of the cluster.
    pub slots: u32,
    /// One summary per policy, in the order asked.
    pub runs: Vec<Summary>,
}

impl Cell {
    /// The run of `policy`, if the cell has it.
    pub fn run(&self, policy: &str) -> Option<&Summary> {
        self.runs.iter().find(|s| s.policy == policy)
    }

    /// Whether the cluster is contended (`static`'s utilization above
    /// [`CONTENDED_UTILIZATION`]); true when the cell has no `static` run.
    pub fn contended(&self) -> bool {
        self.run("static").is_none_or(|s| s.utilization > CONTENDED_UTILIZATION)
    }

    /// The policies other than `eps` and `static` that give feedback sooner
    /// or finish jobs sooner on average than `eps` does here.
    pub fn beaten_by(&self) -> Vec<String> {
        let Some(e) = self.run("eps") else { return Vec::new() };
        self.runs
            .iter()
            .filter(|s| s.policy != "eps" && s.policy != "static")
            .filter(|s| s.avg_feedback_latency_s < e.avg_feedback_latency_s || s.avg_jct_s < e.avg_jct_s)
            .map(|s| s.policy.clone())
            .collect()
    }

    /// `static`'s average feedback latency over `eps`'s.
    pub fn static_over_eps(&self) -> Option<f64> {
        let (s, e) = (self.run("static")?, self.run("eps")?);
        (e.avg_feedback_latency_s > 0.0).then(|| s.avg_feedback_latency_s / e.avg_feedback_latency_s)
    }
}

/// `jobs` with their submit times divided by `load` (arrivals `load` times
/// as dense).
pub fn compressed(jobs: &[JobSpec], load: f64) -> Vec<JobSpec> {
    jobs.iter().map(|j| JobSpec { submit_s: j.submit_s / load, ..j.clone() }).collect()
}

/// Runs `policies` on `jobs` at `load` on `slots` slots, on `nodes` (none:
/// one node of all the slots), each with `timing`'s clocks. `None` when some
/// job's minimum exceeds the slots.
#[allow(clippy::too_many_arguments)]
pub fn cell(
    workload: &str,
    jobs: &[JobSpec],
    load: f64,
    slots: u32,
    nodes: &[Node],
    model: &ClusterModel,
    policies: &[&str],
    timing: Timing,
) -> Result<Option<Cell>, SimError> {
    if jobs.iter().any(|j| j.min_alloc().slots() > slots) {
        return Ok(None);
    }
    let jobs = compressed(jobs, load);
    let opts = Options { tick_s: timing.tick_s, nodes: nodes.to_vec(), ..Options::default() };
    let mut runs = Vec::new();
    for &name in policies {
        let mut p = by_name_timed(name, timing).ok_or_else(|| SimError::Policy {
            policy: name.into(),
            at_s: 0.0,
            what: "no such policy".into(),
        })?;
        runs.push(sim::run_with(&jobs, slots, model, p.as_mut(), &opts)?.0);
    }
    Ok(Some(Cell { workload: workload.to_string(), load, slots, runs }))
}
