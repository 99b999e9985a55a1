//! Registering with the control plane: a rank, the spec, and the shard map to
//! start with, before any fabric is chosen.

use std::time::Instant;

use eps_control_client::ControlClient;
use eps_proto::JobSpec;
use eps_proto::control::{ControlMsg, JobMap, Role};
use eps_proto::declare::TensorDecl;
use eps_proto::layout::Layout;

use crate::{WorkerConfig, WorkerError};

/// A worker that has registered with the control plane and holds the shard map
/// it starts with: the caller picks the fabric from the spec (see [`Worker::join_on`]).
pub struct Registration {
    pub(crate) rank: u32,
    pub(crate) spec: JobSpec,
    pub(crate) layout: Layout,
    pub(crate) map: JobMap,
    pub(crate) ctl: ControlClient,
    /// The model's initial values, if given ([`Registration::with_initial`]).
    pub(crate) initial: Option<Vec<u8>>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration").field("rank", &self.rank).field("job", &self.spec.job.name).finish()
    }
}

impl Registration {
    /// The rank the control plane gave this worker.
    pub fn rank(&self) -> u32 {
        self.rank
    }
    /// The job's spec.
    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }
}

/// Registers with the control plane as a worker and waits for the shard map (and,
/// for a worker started to join a running job, for the change that admits it).
/// The job's spec must name its tensors: see [`register_declaring`] otherwise.
pub fn register(cfg: &WorkerConfig) -> Result<Registration, WorkerError> {
    register_declaring(cfg, None)
}

/// As [`register`], declaring the model's tensors first when `tensors` is
/// given: the first declaration fixes the layout of a job whose spec says
/// `model.declare = true`; any later one (or one for a job whose spec names
/// its tensors) must be the same, or the control plane refuses it, naming
/// the first difference ([`WorkerError::Control`]).
pub fn register_declaring(cfg: &WorkerConfig, tensors: Option<&[TensorDecl]>) -> Result<Registration, WorkerError> {
    let mut ctl = ControlClient::connect(cfg.control.clone(), &cfg.secret, cfg.timeout)?;
    // Declared (or the spec checked) before registering: a refused worker
    // takes no rank.
    let req = match tensors {
        Some(tensors) => ControlMsg::Declare { tensors: tensors.to_vec() },
        None => ControlMsg::GetSpec { rank: u32::MAX },
    };
    let ControlMsg::Registered { spec_toml, .. } = ctl.call(&req)? else {
        return Err(WorkerError::Unexpected);
    };
    if JobSpec::from_toml(&spec_toml)?.awaits_declaration() {
        return Err(WorkerError::Unsupported("the job's workers declare its tensors, and this one declared none"));
    }
    let (rank, spec_text) = ctl.register(Role::Worker)?;
    let spec = JobSpec::from_toml(&spec_text)?;
    let layout = spec.layout()?;
    let ControlMsg::Map(mut map) = ctl.call(&ControlMsg::GetMap { worker: rank, adopted: 0, min_epoch: 0, iteration: 0 })? else {
        return Err(WorkerError::Unexpected);
    };
    // A worker started for a join that is still being voted on waits for the
    // commit, which names the iteration it starts at.
    let deadline = Instant::now() + cfg.timeout;
    while map.proposal != 0 && !map.membership.last().is_some_and(|(_, set)| set.contains(&rank)) {
        if Instant::now() >= deadline {
            return Err(WorkerError::Timeout("the membership change that admits this worker"));
        }
        let req = ControlMsg::GetMap { worker: rank, adopted: 0, min_epoch: map.epoch + 1, iteration: 0 };
        if let ControlMsg::Map(m) = ctl.call(&req)? {
            map = m;
        }
    }
    if map.routes.len() < layout.shards.len() {
        return Err(WorkerError::Unexpected);
    }
    Ok(Registration { rank, spec, layout, map, ctl, initial: None })
}
