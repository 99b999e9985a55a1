//! # eps-cluster
//!
//! What the `eps` commands run, apart from their arguments and output: the
//! processes of a job and the state they share.
//!
//! - [`cluster`]: a local cluster as child processes of this one (or as Slurm
//!   job steps): a control plane, servers and workers, supervised, stopped
//!   together; [`scale`]: the scale plans run against it.
//! - [`train`]: a training run on a local cluster (resumed from a checkpoint
//!   if asked), its children's reports gathered into one; [`checkpoint`]:
//!   what a run resumes from, and a checkpoint taken on request.
//! - [`live`]: the multi-job scheduler's live mode: real jobs started,
//!   rescaled and killed by a policy, from a trace or from `eps submit`;
//!   [`launcher`]: how it starts a job (a cluster per job).
//! - [`slurm`]: the allocation, its nodes, and processes as job steps.
//! - [`soak`]: a job with backups trained under a stream of faults, and its
//!   fault-free reference.
//! - [`ha`]: the control plane's store (the embedded file, or etcd with
//!   standby control planes) and its election.
//! - [`jobspec`]: the job spec a command builds (the built-in tasks' presets
//!   expanded into explicit tensors and tables).
//! - [`report`]: the lines children send `eps train`.
//! - [`advertise`], [`secret`], [`error`], [`progress`]: where a process
//!   says it listens, the job secret, errors as the command line prints them,
//!   and the progress of long work.

pub mod advertise;
pub mod checkpoint;
pub mod cluster;
pub mod error;
pub mod ha;
pub mod jobspec;
pub mod launcher;
pub mod live;
pub mod progress;
pub mod report;
pub mod scale;
pub mod secret;
pub mod slurm;
pub mod soak;
pub mod train;

pub use cluster::{Launch, LocalCluster};
pub use error::TrainError;
