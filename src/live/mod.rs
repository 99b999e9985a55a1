//! `eps sched run` and `eps sched serve`: their flags and reports. The live
//! driver itself (real jobs started, rescaled and killed by a policy) is
//! `eps_cluster::live`, re-exported here under its old paths.

pub mod cli;
pub mod serve;

pub use eps_cluster::live::*;
pub use eps_cluster::live::{job, launcher};

use eps_sched::placement::Node;

/// The scheduler's slots and nodes: with the `slurm` launcher, the
/// allocation's nodes with a slot per CPU (read from Slurm; --slots and
/// --nodes are refused), else as `cluster` says.
pub fn cluster(launcher: &str, cluster: &crate::sim::Cluster, default_slots: u32) -> Result<(u32, Vec<Node>), String> {
    if launcher != "slurm" {
        return cluster.resolve(default_slots);
    }
    if cluster.slots.is_some() || cluster.nodes.is_some() {
        return Err("--launcher slurm takes its nodes and slots from the Slurm allocation: drop --slots/--nodes".into());
    }
    eps_cluster::live::slurm_nodes()
}
