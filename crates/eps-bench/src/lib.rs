//! # eps-bench
//!
//! The measurements behind `eps bench`. Each has a configuration, a report
//! and an error type, and measures its reference in the same run (a memory
//! copy, a TCP ping-pong, the fabric's WRITE bandwidth), so that figures are
//! read as ratios on machines that differ a lot. The command line parses the
//! flags and prints the reports.
//!
//! - [`fabric`]: one transport's WRITE, READ or SEND against a peer process.
//! - [`agg`]: the CPU aggregator's sums and optimizer against a memory copy.
//! - [`pushpull`]: push/pull rounds of one worker and one server; below
//!   1 MiB against [`pingpong`], a 64-byte TCP ping-pong polling and blocking.
//! - [`sparse`]: sparse pulls and pushes of a large table.
//! - [`rows`]: one table's pull in this process: a new row's cost and a held
//!   row's, against a memory copy of a row.
//! - [`migrate`]: a live migration while workers push and pull.
//! - [`calibrate`]: the scheduler's cluster model, measured.

pub mod agg;
pub mod calibrate;
pub mod ckpt;
pub mod fabric;
pub mod migrate;
pub mod pingpong;
pub mod pushpull;
pub mod rows;
pub mod sparse;
