//! The job spec: a TOML file describing model, cluster shape, consistency and
//! optimizer. Unknown or malformed fields are rejected with their name.

use eps_agg::DType;
use serde::Deserialize;

mod init;
mod optim;
mod slurm;
mod tables;

pub use optim::{OptimizerSection, ScheduleSection};
pub use slurm::SlurmSection;
pub use tables::{MAX_KEYS, MAX_TABLE_DIM, MAX_TABLES, TABLE_OPTIMIZERS, TableDecl};

/// Consistency model of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Consistency {
    /// Bulk synchronous: every iteration waits for every worker (deterministic).
    Bsp,
    /// Stale synchronous: a worker may run ahead of the slowest by `staleness`.
    Ssp,
    /// Asynchronous: no waiting; updates apply as they arrive.
    Asp,
}

impl Consistency {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Consistency::Bsp => "bsp",
            Consistency::Ssp => "ssp",
            Consistency::Asp => "asp",
        }
    }
    /// Parses a name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "bsp" => Some(Self::Bsp),
            "ssp" => Some(Self::Ssp),
            "asp" => Some(Self::Asp),
            _ => None,
        }
    }
    /// Wire code.
    pub fn code(self) -> u8 {
        self as u8
    }
    /// From a wire code.
    pub fn from_code(c: u8) -> Option<Self> {
        [Self::Bsp, Self::Ssp, Self::Asp].get(c as usize).copied()
    }
}

/// A named tensor of the model.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorSpec {
    /// Name, unique in the model.
    pub name: String,
    /// Number of elements.
    pub elements: u64,
}

/// The whole job spec as read from TOML.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Cluster shape and run length.
    pub job: JobSection,
    /// The model's tensors.
    #[serde(default)]
    pub model: ModelSection,
    /// Optimizer and hyper-parameters.
    #[serde(default)]
    pub optimizer: OptimizerSection,
    /// Learning-rate schedule.
    #[serde(default)]
    pub lr_schedule: ScheduleSection,
    /// The data-plane transport and RDMA device (command-line flags and the
    /// environment override these).
    #[serde(default)]
    pub fabric: FabricSection,
    /// What each role's Slurm job step asks for (`--launcher slurm`).
    #[serde(default)]
    pub slurm: SlurmSection,
    /// Where the job starts from a checkpoint (written by `eps control --resume`
    /// and `eps train --resume`, not by hand).
    #[serde(default)]
    pub resume: Option<ResumeSection>,
    /// `[task]`: what a built-in task's workers compute (written by the `eps`
    /// command when it expands a `model.preset`). Carried with the spec to
    /// every process and read by those workers alone: the control plane and
    /// the servers never look inside it.
    #[serde(default)]
    pub task: Option<toml::Table>,
}

/// `[resume]`: the job continues from a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ResumeSection {
    /// The checkpoint's directory (with its manifest).
    pub from: String,
    /// The iteration the checkpoint was taken at: servers start at that version,
    /// workers at that iteration.
    pub iteration: u64,
    /// Contributor sets before it (`FIRST:R,R,...;...`), so that samples are
    /// dealt out from where the checkpoint left them.
    pub membership: String,
}

/// `[fabric]`: which transport the servers and workers use, and on which RDMA
/// device. Every field is optional.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FabricSection {
    /// `auto` (rdma when a usable device exists, else soft; `eps train` on one
    /// machine: shm), `soft`, `shm` or `rdma`.
    pub transport: Option<String>,
    /// RDMA device name (e.g. `mlx5_0`, `rxe0`).
    pub rdma_device: Option<String>,
    /// Port of the RDMA device, from 1.
    pub rdma_port: Option<u8>,
    /// GID index on that port.
    pub gid_index: Option<u32>,
    /// RDMA device by node name (Slurm's `SLURMD_NODENAME`, else the host
    /// name), for clusters whose nodes name their devices differently; the
    /// node's entry is taken before `rdma_device`.
    #[serde(default)]
    pub rdma_devices: std::collections::BTreeMap<String, String>,
}

impl FabricSection {
    /// The RDMA device for the node named `node`: its entry in
    /// `rdma_devices`, else `rdma_device`.
    pub fn device_for(&self, node: Option<&str>) -> Option<String> {
        node.and_then(|n| self.rdma_devices.get(n)).or(self.rdma_device.as_ref()).cloned()
    }
}

/// The aggregators `job.aggregator` and `--aggregator` name.
pub const AGGREGATORS: [&str; 3] = ["auto", "cpu", "cuda"];

/// The transports `fabric.transport` and `--transport` name.
pub const TRANSPORTS: [&str; 4] = ["auto", "soft", "shm", "rdma"];

/// `[job]`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSection {
    /// Name for logs.
    #[serde(default = "default_name")]
    pub name: String,
    /// Worker processes.
    #[serde(default = "one")]
    pub workers: u32,
    /// Server processes.
    #[serde(default = "one")]
    pub servers: u32,
    /// Training iterations.
    #[serde(default = "default_steps")]
    pub steps: u64,
    /// `bsp`, `ssp` or `asp`.
    #[serde(default = "default_consistency")]
    pub consistency: Consistency,
    /// SSP staleness bound (iterations a worker may run ahead of the slowest).
    #[serde(default = "default_staleness")]
    pub staleness: u32,
    /// Element type on the wire: `f32`, `bf16`, `f16`.
    #[serde(default = "default_dtype")]
    pub dtype: String,
    /// Job secret; when absent the `EPS_JOB_SECRET` environment variable is used.
    #[serde(default)]
    pub secret: Option<String>,
    /// Seed of the synthetic data and initial parameters.
    #[serde(default = "one64")]
    pub seed: u64,
    /// Target shard size in bytes of the wire dtype (rounded to 4 KiB multiples).
    #[serde(default = "default_shard_bytes")]
    pub shard_bytes: u64,
    /// Samples per worker per iteration (used by the built-in training task).
    #[serde(default = "default_batch")]
    pub batch: u32,
    /// Worker ranks the job may ever admit (BSP: workers that join a running job
    /// take new ranks; servers keep a landing slot per rank). Default: `workers`.
    #[serde(default)]
    pub max_workers: Option<u32>,
    /// A worker that has not reached the control plane for this long is removed
    /// from the job at the next iteration boundary.
    #[serde(default = "default_lease_ms")]
    pub worker_lease_ms: u64,
    /// A worker rank admitted by `eps scale` must be taken by a registering
    /// worker within this long, or it is removed as an expired lease is. (The
    /// job's first workers have no deadline here: the job waits for them as
    /// long as its launcher says, e.g. `eps up --join-timeout`.)
    #[serde(default = "default_join_deadline_ms")]
    pub join_deadline_ms: u64,
    /// With replicas: a server whose order poll has not reached the control
    /// plane for this long (stopped, hung, cut off) is lost; its shards'
    /// backups take over, and it is fenced off if it comes back.
    #[serde(default = "default_server_lease_ms")]
    pub server_lease_ms: u64,
    /// Where servers sum and step: `auto` (a GPU when one is usable, else the
    /// CPU), `cpu` or `cuda` (command-line flags and the environment override it).
    #[serde(default)]
    pub aggregator: Option<String>,
    /// Servers write a checkpoint every this many iterations (0: never; in SSP/ASP a cut, see `checkpoint`).
    #[serde(default)]
    pub checkpoint_every: u64,
    /// Where checkpoints are written (one directory per checkpoint inside).
    #[serde(default)]
    pub checkpoint_dir: Option<String>,
    /// Complete checkpoints kept; older ones are removed.
    #[serde(default = "default_keep")]
    pub checkpoint_keep: u32,
    /// Copies of every shard (BSP): 2 keeps a backup on the next server,
    /// updated before each version is served, promoted if the owner dies.
    #[serde(default = "one")]
    pub replicas: u32,
}

fn default_keep() -> u32 {
    3
}

fn default_lease_ms() -> u64 {
    10_000
}

fn default_join_deadline_ms() -> u64 {
    300_000
}

fn default_server_lease_ms() -> u64 {
    5_000
}

impl JobSection {
    /// Worker ranks the job may admit over its life.
    pub fn rank_limit(&self) -> u32 {
        self.max_workers.unwrap_or(self.workers)
    }
}

/// `[model]`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// The tensors, in the order they are laid out.
    #[serde(default)]
    pub tensors: Vec<TensorSpec>,
    /// The tensors are declared by the first worker to join (a framework knows
    /// them only at run time); the control plane then fixes them in the spec.
    #[serde(default)]
    pub declare: bool,
    /// Where the first parameters come from: `worker` (rank 0's values at
    /// join) or `servers` (the seeded initialiser); see
    /// [`JobSpec::seeded_by_worker`] for the default.
    #[serde(default)]
    pub init: Option<String>,
    /// Sparse embedding tables (`[[model.tables]]`), beside the dense tensors.
    #[serde(default)]
    pub tables: Vec<TableDecl>,
}

fn default_name() -> String {
    "eps-job".into()
}
fn one() -> u32 {
    1
}
fn one64() -> u64 {
    1
}
fn default_steps() -> u64 {
    100
}
fn default_consistency() -> Consistency {
    Consistency::Bsp
}
fn default_staleness() -> u32 {
    2
}
fn default_dtype() -> String {
    "f32".into()
}
fn default_shard_bytes() -> u64 {
    1 << 20
}
fn default_batch() -> u32 {
    256
}

impl Default for ModelSection {
    fn default() -> Self {
        toml::from_str("").expect("all model fields have defaults")
    }
}

/// What is wrong with a spec.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// The TOML did not parse or a field has the wrong type or name.
    #[error("job spec: {0}")]
    Toml(String),
    /// A field has an unusable value.
    #[error("job spec: field `{field}`: {reason}")]
    Field {
        /// Dotted field name.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// Most servers a job may have (`job.servers`, `eps scale --servers`).
pub const MAX_SERVERS: u32 = 1024;
/// Most workers a job may start with (`job.workers`): a server has a landing
/// slot per worker rank and sums at most this many contributions.
pub const MAX_WORKERS: u32 = 64;
/// Most worker ranks a job whose workers change may admit in all
/// (`job.max_workers`, `eps scale --workers`).
pub const MAX_ELASTIC_WORKERS: u32 = 64;

fn bad(field: &'static str, reason: impl Into<String>) -> SpecError {
    SpecError::Field { field, reason: reason.into() }
}

impl JobSpec {
    /// Parses and validates a spec.
    pub fn from_toml(text: &str) -> Result<Self, SpecError> {
        let spec: JobSpec = toml::from_str(text).map_err(|e| SpecError::Toml(e.to_string().trim().replace('\n', " ")))?;
        spec.validate()?;
        Ok(spec)
    }

    /// A spec with every default (one worker, one server, no tensors yet).
    pub fn defaults() -> Self {
        toml::from_str("[job]").expect("defaults parse")
    }

    /// Checks every value; returns the first problem, naming its field.
    pub fn validate(&self) -> Result<(), SpecError> {
        let j = &self.job;
        if j.workers == 0 || j.workers > MAX_WORKERS {
            return Err(bad(
                "job.workers",
                format!("must be between 1 and {MAX_WORKERS} (a server sums at most {MAX_WORKERS} workers' contributions)"),
            ));
        }
        if let Some(m) = j.max_workers {
            if m < j.workers || m > MAX_ELASTIC_WORKERS {
                return Err(bad("job.max_workers", format!("must be at least job.workers and at most {MAX_ELASTIC_WORKERS}")));
            }
            if m > j.workers && j.consistency != Consistency::Bsp {
                return Err(bad("job.max_workers", "workers can join a running job only under BSP consistency"));
            }
        }
        if j.worker_lease_ms < 500 {
            return Err(bad("job.worker_lease_ms", "must be at least 500 (ms)"));
        }
        if j.join_deadline_ms < 1000 {
            return Err(bad("job.join_deadline_ms", "must be at least 1000 (ms)"));
        }
        if j.server_lease_ms < 1000 {
            return Err(bad("job.server_lease_ms", "must be at least 1000 (ms): servers poll every 500 ms"));
        }
        if j.servers == 0 || j.servers > MAX_SERVERS {
            return Err(bad("job.servers", format!("must be between 1 and {MAX_SERVERS}")));
        }
        if j.steps == 0 {
            return Err(bad("job.steps", "must be at least 1"));
        }
        if let Some(a) = &j.aggregator
            && !AGGREGATORS.contains(&a.as_str())
        {
            return Err(bad("job.aggregator", format!("{a:?}: use auto, cpu or cuda")));
        }
        if let Some(t) = &self.fabric.transport
            && !TRANSPORTS.contains(&t.as_str())
        {
            return Err(bad("fabric.transport", format!("{t:?}: use auto, soft, shm or rdma")));
        }
        if self.fabric.rdma_port == Some(0) {
            return Err(bad("fabric.rdma_port", "ports are numbered from 1"));
        }
        if let Some((n, _)) = self.fabric.rdma_devices.iter().find(|(n, d)| n.is_empty() || d.is_empty()) {
            return Err(bad("fabric.rdma_devices", format!("node {n:?}: node and device names must not be empty")));
        }
        self.slurm.validate()?;
        self.dtype()?;
        if j.shard_bytes < 4096 || j.shard_bytes > 1 << 30 {
            return Err(bad("job.shard_bytes", "must be between 4096 and 1 GiB"));
        }
        if j.batch == 0 {
            return Err(bad("job.batch", "must be at least 1"));
        }
        if j.consistency == Consistency::Ssp && j.staleness == 0 {
            return Err(bad("job.staleness", "SSP needs a staleness bound of at least 1 (use bsp for 0)"));
        }
        if self.model.declare && !self.model.tensors.is_empty() {
            return Err(bad("model.declare", "workers declare the tensors: give no tensors with it"));
        }
        if self.model.tensors.is_empty() && !self.model.declare {
            return Err(bad("model.tensors", "give at least one tensor, or `declare = true` (workers declare them)"));
        }
        let m = &self.model;
        let mut names = std::collections::HashSet::new();
        for t in &self.model.tensors {
            if t.elements == 0 {
                return Err(bad("model.tensors.elements", format!("tensor {:?} has no elements", t.name)));
            }
            if !names.insert(&t.name) {
                return Err(bad("model.tensors.name", format!("tensor {:?} appears twice", t.name)));
            }
        }
        let tensors = self.tensors();
        if !m.declare && crate::layout::total_elements(tensors.iter().map(|t| &t.elements)).is_none() {
            return Err(bad(
                "model.tensors.elements",
                format!("the tensors' elements add up past {} (2^40), the most a job may have", crate::layout::MAX_ELEMENTS),
            ));
        }
        tables::validate(&self.model.tables, tensors.iter().map(|t| t.name.as_str()), self)?;
        if j.checkpoint_every > 0 && j.checkpoint_dir.as_deref().is_none_or(str::is_empty) {
            return Err(bad("job.checkpoint_dir", "give the directory checkpoints are written to"));
        }
        if j.replicas == 0 || j.replicas > 2 {
            return Err(bad("job.replicas", "must be 1 or 2"));
        }
        if j.replicas == 2 && (j.consistency != Consistency::Bsp || j.servers < 2) {
            return Err(bad("job.replicas", "2 replicas need BSP consistency and at least 2 servers"));
        }
        self.validate_init()?;
        if j.checkpoint_keep == 0 {
            return Err(bad("job.checkpoint_keep", "keep at least 1 checkpoint"));
        }
        if let Some(r) = &self.resume {
            if r.iteration == 0 || r.iteration >= j.steps {
                return Err(bad("resume.iteration", format!("{} is not before job.steps ({})", r.iteration, j.steps)));
            }
            if crate::membership::Membership::parse_text(&r.membership).is_none() {
                return Err(bad("resume.membership", "not a contributor schedule (`FIRST:R,R,...;...` from 0)"));
            }
        }
        self.optimizer()?;
        self.schedule()?;
        if !m.declare {
            // The shard count's limit too, before anything is started.
            self.layout()?;
        }
        Ok(())
    }

    /// `text` with its `[resume]` section replaced by `r` (or removed, `None`),
    /// every other field kept.
    pub fn set_resume(text: &str, r: Option<&ResumeSection>) -> Result<String, SpecError> {
        let mut table: toml::Table =
            text.parse().map_err(|e: toml::de::Error| SpecError::Toml(e.to_string().trim().replace('\n', " ")))?;
        table.remove("resume");
        if let Some(r) = r {
            let v = toml::Value::try_from(r).map_err(|e| SpecError::Toml(e.to_string()))?;
            table.insert("resume".into(), v);
        }
        Ok(toml::to_string(&table).expect("a TOML table serializes"))
    }

    /// Whether the tensors are still to be declared by the first worker (see
    /// [`crate::declare`]); such a spec has no layout yet.
    pub fn awaits_declaration(&self) -> bool {
        self.model.declare
    }

    /// The model's tensors.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        self.model.tensors.clone()
    }

    /// The parameter layout for `servers` servers.
    pub fn layout(&self) -> Result<crate::layout::Layout, SpecError> {
        let dtype = self.dtype()?;
        crate::layout::Layout::new(&self.tensors(), dtype, self.job.shard_bytes, self.job.servers)
            .map_err(|e| bad("job.shard_bytes", e.to_string()))
    }

    /// The wire element type.
    pub fn dtype(&self) -> Result<DType, SpecError> {
        DType::parse(&self.job.dtype)
            .ok_or_else(|| bad("job.dtype", format!("unknown dtype {:?} (f32, bf16, f16)", self.job.dtype)))
    }
}

#[cfg(test)]
mod tests;
