//! # eps-sched
//!
//! The multi-job elastic scheduler of EPS, as in the paper it follows: in
//! feedback-driven exploration users kill most jobs after their first
//! results, so a new job should get slots at once, taken from running jobs,
//! and slots freed by killed or finished jobs should go back to the running
//! ones. The core is free of I/O:
//!
//! - [`model`]: the cluster model (a job's throughput for its workers and
//!   servers, what a rescale costs);
//! - [`trace`]: job traces (CSV), and [`pollux`]: public traces in the
//!   Pollux/Philly format with a model table;
//! - [`policy`]: the policies behind one trait: `static` (FIFO at the sizes
//!   asked, today's PS clusters), `optimus` (marginal-gain allocation),
//!   `pollux` (goodput-style speedup allocation) and `eps` (the job nearest
//!   its feedback first, slots dealt by milestone, rescale only when it pays);
//! - [`placement`]: nodes with capacities, and where each job's processes
//!   run on them;
//! - [`sim`]: the discrete-event simulator that runs a trace under a policy;
//! - [`grid`]: the policies compared over workloads, loads and cluster sizes;
//! - [`synth`]: synthetic traces.

#![forbid(unsafe_code)]

pub mod grid;
pub mod model;
pub mod placement;
pub mod policy;
pub mod pollux;
pub mod sim;
pub mod synth;
pub mod trace;

pub use model::{Alloc, ClusterModel};
pub use policy::{Policy, Timing, by_name, by_name_timed};
pub use sim::{JobRecord, SimError, Summary};
pub use trace::{JobSpec, TraceError};
