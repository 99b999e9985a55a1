//! # eps-core
//!
//! A parameter server's decisions, free of I/O: no sockets, no clocks, no
//! threads, no memory but its own. `eps-server` carries them out on the
//! fabric and in registered memory; the deterministic simulation (`eps-sim`)
//! carries out the very same decisions on digests over its simulated network,
//! so what the simulation checks is what the server does.
//!
//! - [`ShardCore`]: one held shard: its consistency state (`ShardSync`) and
//!   the updates parked until the shard is free. It decides what a push, a
//!   pull request and a completed pull WRITE lead to, which update runs when,
//!   what an update consumes ([`Plan`]), when a BSP iteration is complete,
//!   and where a migration source cuts over.
//! - [`Members`]: who contributes to each iteration, the hold while a
//!   membership change is voted on, and the workers lost with their leases.
//! - [`Answers`]: what a server owes its workers across shards: the pushes
//!   answered "moved" (their pull requests are too) and the pull WRITEs in
//!   flight (their buffers stay in use until they complete, or until their
//!   connection drops).
//!
//! Each call takes what happened (a push of an iteration, a completion, an
//! order) and returns what to do (a decision enum, an update to apply, pulls to
//! answer); the caller does it and reports back. The caller owns the order in
//! which things happen, and the rules about it are stated on the calls.
//!
//! - [`MoveOut`]: a migration's source side: its snapshot and forwards in
//!   flight, its cutover, its acknowledgements and release.
//! - [`Relay`]: an SSP/ASP migration source's relay of the contributions
//!   that still reach it after its cutover.
//!
//! - [`buckets`]: a sparse table's buckets on one server: what a new bucket
//!   map moves to and from it, when the leaving rows may go, and whether a
//!   sparse request goes on, waits for a vote or the rows, or is refused.
//!
//! - [`MoveIn`]: a copy arriving here (a migration's target, a backup):
//!   what a snapshot notice, a forward or a relayed contribution means.
//! - [`replica`]: a shard's part in replication: the owner forwarding to
//!   its backup and serving a version once it is acknowledged, a new
//!   backup's snapshot, promotion, the end of forwarding.
//! - [`route`]: what a worker decides from the shard map: the servers it
//!   still needs, when it may report routing with a map's epoch, where a
//!   refused pull goes again.
//! - [`split`]: an order to split a shard, checked, waiting until the shard
//!   is free, and carried out on its state.

#![forbid(unsafe_code)]

mod answers;
pub mod buckets;
mod members;
mod moves;
mod relay;
pub mod replica;
pub mod route;
mod shard;
pub mod split;

pub use answers::Answers;
pub use members::{Members, MembersError};
pub use moves::{Arrival, MoveIn, MoveOut, Notice, stray_forward_ignored};
pub use relay::{Relay, RelayStep};
pub use replica::Replica;
pub use shard::{CoreError, Next, Pending, Plan, PullStep, PushGate, ShardCore, push_gate};
pub use split::{Split, SplitError};

/// 0, 1, 2, ...: a single contributor's list is a slice of this.
const ALL_RANKS: [u32; eps_proto::spec::MAX_WORKERS as usize] = {
    let mut a = [0u32; eps_proto::spec::MAX_WORKERS as usize];
    let mut i = 0;
    while i < a.len() {
        a[i] = i as u32;
        i += 1;
    }
    a
};
