//! The launcher seam of the scheduler's live mode: what starts a job's
//! processes (control plane, servers, workers) and more of them when the job
//! grows. `local` runs them as child processes of this one; `slurm` as job
//! steps of the allocation this process runs in.

use crate::report::Report;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::Receiver;

use crate::cluster::{ChildArgs, Launch, LocalCluster};
use crate::error::TrainError;
use crate::scale::Spawn;

/// One job to start: its spec and the flags of its worker processes.
#[derive(Clone, Debug)]
pub struct JobLaunch {
    /// The spec (servers and workers at the allocation to start with).
    pub spec: eps_proto::JobSpec,
    /// Its TOML text.
    pub text: String,
    /// Flags of every `eps worker` of the job.
    pub worker_args: Vec<String>,
    /// Its workers and servers per node, as the scheduler placed them (the
    /// `local` launcher runs every node's processes on this machine).
    pub nodes: Vec<(String, eps_sched::Alloc)>,
}

/// Starts jobs.
pub trait Launcher: Send + Sync {
    /// Its name (`local`, `slurm`).
    fn name(&self) -> &'static str;
    /// Starts the control plane, the servers and the workers of `job`.
    fn start(&self, job: &JobLaunch) -> Result<Box<dyn Processes>, String>;
}

/// The running processes of one job.
pub trait Processes: Send {
    /// The job's control-plane address.
    fn control(&self) -> SocketAddr;
    /// The job secret its processes share.
    fn secret(&self) -> String;
    /// Set, stops every process of the job ([`Processes::supervise`] returns).
    fn stop_handle(&self) -> Arc<AtomicBool>;
    /// Runs until every process has exited: starts the servers and workers
    /// asked on `more`, feeds every worker line to `on_line`. An error names
    /// the process that failed (the others are stopped), or says the job was
    /// stopped.
    fn supervise(self: Box<Self>, more: &Receiver<Spawn>, on_line: &mut dyn FnMut(&str)) -> Result<(), Stop>;
}

/// Why [`Processes::supervise`] returned early.
#[derive(Debug)]
pub enum Stop {
    /// Its stop handle was set.
    Stopped,
    /// Ctrl-C.
    Interrupted,
    /// A process failed.
    Failed(String),
}

/// Child processes of this one on 127.0.0.1, on the `soft` transport and the
/// CPU aggregator.
#[derive(Debug, Default)]
pub struct Local;

/// Slurm job steps of the allocation this process runs in (one per
/// process; a job's first ones on the nodes the scheduler placed them on,
/// later ones where Slurm finds free CPUs), on the `soft` transport and the
/// CPU aggregator.
#[derive(Debug, Default)]
pub struct Slurm;

struct LocalJob {
    cluster: LocalCluster,
    control: SocketAddr,
}

impl Launcher for Local {
    fn name(&self) -> &'static str {
        "local"
    }

    fn start(&self, job: &JobLaunch) -> Result<Box<dyn Processes>, String> {
        start_with(job, crate::cluster::soft_args())
    }
}

impl Launcher for Slurm {
    fn name(&self) -> &'static str {
        "slurm"
    }

    fn start(&self, job: &JobLaunch) -> Result<Box<dyn Processes>, String> {
        let steps = crate::slurm::Steps::in_allocation(&job.spec.job.name, &job.spec.slurm)?;
        start_with(job, ChildArgs { slurm: Some(steps), ..crate::cluster::soft_args() })
    }
}

/// Starts `job`'s processes as `children` says.
fn start_with(job: &JobLaunch, children: ChildArgs) -> Result<Box<dyn Processes>, String> {
    // The scheduler's placement of the first processes (growth goes where
    // the launcher finds room).
    let nodes = job.nodes.iter().map(|(n, a)| (n.clone(), a.servers, a.workers)).collect();
    let how = Launch { listen: "127.0.0.1:0".into(), secret: None, workers: true, nodes };
    let args: Vec<&str> = job.worker_args.iter().map(String::as_str).collect();
    let cluster = LocalCluster::launch(&job.spec, &job.text, &args, &children, &how).map_err(|e| crate::error::chain(&e))?;
    let control = cluster
        .control_addr()
        .parse()
        .map_err(|_| format!("the control plane reported an unusable address {:?}", cluster.control_addr()))?;
    Ok(Box::new(LocalJob { cluster, control }))
}

impl Processes for LocalJob {
    fn control(&self) -> SocketAddr {
        self.control
    }

    fn secret(&self) -> String {
        self.cluster.secret().to_string()
    }

    fn stop_handle(&self) -> Arc<AtomicBool> {
        self.cluster.stop_handle()
    }

    fn supervise(self: Box<Self>, more: &Receiver<Spawn>, on_line: &mut dyn FnMut(&str)) -> Result<(), Stop> {
        match self.cluster.supervise(Some(more), on_line) {
            Ok(_) => Ok(()),
            Err(TrainError::Stopped) => Err(Stop::Stopped),
            Err(TrainError::Interrupted) => Err(Stop::Interrupted),
            Err(e) => Err(Stop::Failed(crate::error::chain(&e))),
        }
    }
}

/// The launchers by name.
pub fn by_name(name: &str) -> Option<Arc<dyn Launcher>> {
    match name {
        "local" => Some(Arc::new(Local)),
        "slurm" => Some(Arc::new(Slurm)),
        _ => None,
    }
}

/// A trace job as an EPS job of the built-in synthetic task: a model of
/// about `param_bytes` (f32), the trace's batch, `alloc`'s servers and
/// workers, Adam at a constant rate (so the parameters after N steps do not
/// depend on how long the job was planned to run), room for workers to join
/// (`max_workers`: joins take new ranks). Its workers stop once the job has
/// trained `samples`, and compute for `compute_ms_per_sample` per sample.
pub fn job_launch(j: &eps_sched::JobSpec, alloc: eps_sched::Alloc, seed: u64) -> Result<JobLaunch, String> {
    const CLASSES: u64 = 4;
    const DENSE: u64 = 64;
    let elements = (j.param_bytes / 4).max(CLASSES * (DENSE + 2));
    let buckets = (elements - CLASSES * (DENSE + 1)) / CLASSES;
    // A few shards a server, so growing and shrinking move some of them.
    let shard_bytes = (j.param_bytes / (4 * u64::from(j.servers.1.max(1)))).clamp(64 << 10, 4 << 20) / 4096 * 4096;
    let per_iteration = u64::from(j.workers.0.max(1)) * u64::from(j.batch);
    let steps = j.samples.div_ceil(per_iteration) + 1;
    // Every worker change can take new ranks; servers keep a landing slot per rank.
    let ranks = (j.workers.1 * 4).clamp(alloc.workers, 64);
    let name = toml::Value::String(j.name.clone());
    let text = format!(
        "[job]\nname = {name}\nworkers = {w}\nservers = {s}\nmax_workers = {ranks}\nsteps = {steps}\nconsistency = \"bsp\"\n\
         dtype = \"f32\"\nbatch = {batch}\nseed = {seed}\nshard_bytes = {shard_bytes}\n\n\
         [model]\npreset = \"synthetic\"\nbuckets = {buckets}\ndense_dim = {DENSE}\nclasses = {CLASSES}\n\
         sparse_per_sample = 8\nvocab = 2000\n\n[optimizer]\nkind = \"adam\"\nlr = 0.01\n",
        w = alloc.workers,
        s = alloc.servers,
        batch = j.batch,
    );
    let (spec, text) = crate::jobspec::parse(&text).map_err(|e| format!("job {}: {e}", j.name))?;
    let worker_args = vec![
        "--progress-every".into(),
        "1".into(),
        "--until-samples".into(),
        j.samples.to_string(),
        "--compute-ms-per-sample".into(),
        j.compute_ms_per_sample.to_string(),
    ];
    Ok(JobLaunch { spec, text, worker_args, nodes: Vec::new() })
}

/// The job's samples trained so far, if `line` is a `Progress` report.
pub fn progress_samples(line: &str) -> Option<u64> {
    match Report::parse(line)? {
        Report::Progress(p) => Some(p.samples),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_job_becomes_a_valid_spec_of_about_its_size() {
        let j = eps_sched::JobSpec::test("a \"b\"", 0.0, 4 << 20, 0.5, 32, 10_000, 2_000, false, (1, 3), (1, 2));
        let l = job_launch(&j, eps_sched::Alloc { workers: 2, servers: 1 }, 7).unwrap();
        assert_eq!((l.spec.job.workers, l.spec.job.servers, l.spec.job.batch), (2, 1, 32));
        assert_eq!(l.spec.job.name, "a \"b\"");
        let bytes = l.spec.layout().unwrap().bytes() as f64;
        assert!((bytes / f64::from(4u32 << 20) - 1.0).abs() < 0.01, "{bytes}");
        assert!(l.spec.layout().unwrap().shards.len() >= 2);
        assert!(l.worker_args.contains(&"10000".to_string()));
        let p = Report::Progress(crate::report::Progress { step: 3, samples: 192, ..Default::default() });
        assert_eq!(progress_samples(&p.line()), Some(192));
        assert_eq!(progress_samples("step 3 samples=192"), None);
    }
}
