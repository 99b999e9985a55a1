//! `eps bench`: the flags, and the reports of the measurements in
//! `eps-bench` (re-exported here under their old paths). Each reports what it
//! measured and, where the command has a `--json` flag, one JSON object as the
//! last line of stdout.

pub use eps_bench::{agg, fabric, migrate, pushpull, sparse};

pub mod cli;
pub mod gpu;
pub mod plot;
pub mod replicas;
pub mod rows;
pub mod sparse_cli;

pub use crate::json::Json;
