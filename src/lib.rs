//! # eps
//!
//! The public Rust facade of EPS, the elastic parameter server, and the
//! `eps` command line: each command's flags and output, calling into the
//! crates (`eps-cluster` for processes, `eps-bench` for measurements).
//!
//! - [`fabric`]: the verbs-semantics transport (re-export of `eps-fabric`).
//! - [`units`]: parsing of human sizes (`4KiB`, `64MiB`).
//! - [`bench`]: `eps bench ...` (the measurements are `eps-bench`'s).
//! - [`roles`]: the control, server and worker commands.
//! - [`rdma`]: `eps rdma devices` (RDMA devices and the choice among them).
//! - [`train`]: `eps train`, a local cluster on the built-in synthetic task.
//! - [`sim`]: `eps sim`, the multi-job scheduler's simulator.
//! - [`up`]: `eps up`, a control plane and servers for a framework's workers.

pub use eps_cluster::{advertise, checkpoint, error, ha, jobspec, progress, report, secret, slurm};
pub use eps_fabric as fabric;

pub mod aggregator;
pub mod bench;
pub mod calibrate;
pub mod json;
pub mod live;
pub mod rdma;
pub mod roles;
pub mod sim;
pub(crate) mod sim_grid;
pub(crate) mod sim_plot;
pub mod soak;
pub mod train;
pub mod transport;
pub mod units;
pub mod up;
