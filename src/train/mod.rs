//! `eps train`: a whole local cluster as separate processes (control plane, S
//! servers, W workers) on the embedded defaults, training the built-in synthetic
//! task; progress while it runs, a summary and an optional JSON line at the end.
//! The run itself is `eps_cluster::train`, the built-in tasks and their
//! workers are `eps-tasks`; here is the command.

pub mod cli;
pub mod sbatch;

pub use eps_tasks::{ctr, task, worker};

pub use eps_cluster::error::{TrainError, field};
pub use eps_cluster::jobspec::{CTR_SPEC, DEFAULT_SPEC, Overrides, build_model_spec, build_spec, build_spec_or, default_spec};
pub use eps_cluster::train::*;
pub use eps_cluster::{Launch, LocalCluster, cluster, scale};
