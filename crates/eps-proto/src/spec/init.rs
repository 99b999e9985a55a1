//! Where a job's first parameters come from (`model.init`).
//!
//! - `worker`: rank 0's values at join (a framework's own initialisation, e.g.
//!   LayerNorm weights of 1) are sent to the servers as version 0 before any
//!   worker pulls it: every worker starts from them, as DDP broadcasts rank
//!   0's parameters. The default for a job whose tensors a framework declares.
//! - `servers`: the servers' seeded initialiser (uniform in ±0.01 from
//!   `job.seed`): the same bits whatever the workers hold, for reproducible
//!   runs. The default for jobs whose spec names the tensors.
//!
//! A job resumed from a checkpoint starts from the checkpoint either way, and
//! with optimizer `none` the framework keeps its own parameters: neither is
//! seeded.

use super::{Consistency, JobSpec, SpecError, bad};

impl JobSpec {
    /// Whether rank 0's initial values seed the servers (see the module).
    pub fn seeded_by_worker(&self) -> bool {
        let possible = self.resume.is_none() && self.optimizer.kind != "none";
        match self.model.init.as_deref() {
            Some("worker") => possible,
            Some(_) => false,
            None => possible && self.model.declare && self.job.replicas == 1 && self.job.consistency != Consistency::Asp,
        }
    }

    pub(super) fn validate_init(&self) -> Result<(), SpecError> {
        match self.model.init.as_deref() {
            None | Some("servers") => Ok(()),
            Some("worker") if self.job.replicas > 1 => Err(bad(
                "model.init",
                "\"worker\" needs job.replicas = 1 (a backup starts from the servers' initialiser); use \"servers\"",
            )),
            Some("worker") if self.job.consistency == Consistency::Asp => Err(bad(
                "model.init",
                "\"worker\" needs BSP or SSP (ASP workers read the parameters before any seed could land); use \"servers\"",
            )),
            Some("worker") => Ok(()),
            Some(other) => Err(bad("model.init", format!("{other:?} is not \"worker\" or \"servers\""))),
        }
    }
}
