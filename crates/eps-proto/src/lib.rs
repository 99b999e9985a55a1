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
pub mod mutants;
pub mod shardmap;
pub mod spec;
pub mod sync;

pub use spec::{Consistency, JobSpec, SpecError};

/// A log line: `eprintln!` in one write, or, where the process installed a
/// log subscriber (`eps --log-format json`), a `tracing` event of level info
/// whose message is the line (`say_plain`, the one place this crate writes
/// anything). `eprintln!` writes a line piece by piece, so the lines of processes
/// sharing one stderr (a local cluster's roles) interleave mid-line; one
/// write of a line under `PIPE_BUF` bytes reaches a pipe whole.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        let line = ::std::format!($($arg)*);
        if $crate::__tracing::dispatcher::has_been_set() {
            $crate::__tracing::info!(target: "eps", "{}", line);
        } else {
            $crate::say_plain(line);
        }
    }};
}

/// As [`say!`], for the events an operator queries logs for (a scale event,
/// a migration, a failover, a peer cut off): with a log subscriber, one
/// event named `event` with its ids as fields, e.g.
/// `say_event!("migration", { shard = id, from = rank, to = to }, "eps server {rank}: ...")`.
/// Without one, the line alone, as [`say!`] writes it.
#[macro_export]
macro_rules! say_event {
    ($kind:literal, { $($k:ident = $v:expr),* $(,)? }, $($arg:tt)*) => {{
        let line = ::std::format!($($arg)*);
        if $crate::__tracing::dispatcher::has_been_set() {
            $crate::__tracing::info!(target: "eps", event = $kind, $($k = $v,)* "{}", line);
        } else {
            $crate::say_plain(line);
        }
    }};
}

#[doc(hidden)]
pub use tracing as __tracing;

/// Writes `line` and a newline to stderr in one write (see [`say!`]).
#[doc(hidden)]
pub fn say_plain(mut line: String) {
    line.push('\n');
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
}
