//! Measurements behind `eps bench`. Each reports what it measured and, where the
//! command has a `--json` flag, one JSON object as the last line of stdout.

pub mod agg;
pub mod cli;
pub mod fabric;
pub mod gpu;
pub mod migrate;
pub mod plot;
pub mod pushpull;
pub mod replicas;
pub mod sparse;

pub use crate::json::Json;
