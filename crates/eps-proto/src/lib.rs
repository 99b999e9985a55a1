//! # eps-proto
//!
//! The protocol core of EPS, free of I/O and clocks: job specs ([`spec`]), the flat
//! parameter space and its shards ([`layout`]), the immediates that name every
//! data-plane message ([`imm`]), the control-plane messages ([`control`]), and the
//! per-shard consistency state machine ([`sync`]). Drivers in the role crates feed
//! it bytes and events and act on what it returns.

#![forbid(unsafe_code)]

pub mod buckets;
pub mod checkpoint;
pub mod control;
pub mod declare;
pub mod hello;
pub mod imm;
pub mod init;
pub mod layout;
pub mod membership;
pub mod migrate;
pub mod shardmap;
pub mod spec;
pub mod sync;

pub use spec::{Consistency, JobSpec, SpecError};

/// `eprintln!` in one write (it expands in the caller: this crate does no
/// I/O). `eprintln!` writes a line piece by piece, so the lines of processes
/// sharing one stderr (a local cluster's roles) interleave mid-line; one
/// write of a line under `PIPE_BUF` bytes reaches a pipe whole.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        let mut line = ::std::format!($($arg)*);
        line.push('\n');
        let _ = ::std::io::Write::write_all(&mut ::std::io::stderr().lock(), line.as_bytes());
    }};
}
