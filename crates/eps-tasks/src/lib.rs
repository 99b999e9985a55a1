//! # eps-tasks
//!
//! The training tasks built into `eps train` and `eps worker`, so that a job
//! runs with no framework at all:
//!
//! - [`task`]: the synthetic teacher task (a known teacher, so accuracy has a
//!   ceiling);
//! - [`ctr`]: the click-through task of `--model ctr` (a log with a known
//!   teacher, embedding bags and an MLP, AUC);
//! - [`worker`]: the training loop of a worker process, paced for live
//!   scheduler runs, with the checksums and reports `eps train` gathers.

pub mod ctr;
mod ctr_worker;
pub mod task;
pub mod worker;
