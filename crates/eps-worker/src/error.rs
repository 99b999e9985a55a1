//! The worker library's errors.

use eps_control_client::ControlError;
use eps_fabric::prelude::*;
use eps_proto::SpecError;

/// Errors of the worker library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// Talking to the control plane failed.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The spec is unusable.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The fabric failed.
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// A transfer completed with an error (the server may have closed the connection
    /// after a protocol violation; its log says why).
    #[error("{what} for shard {shard} failed: {status}")]
    Transfer {
        /// Push or pull.
        what: &'static str,
        /// Global shard id.
        shard: u32,
        /// The completion status.
        status: WcStatus,
    },
    /// A server this worker still routes to closed its connection (its posted
    /// receives were flushed): it exited or failed.
    #[error(
        "server {server} closed its connection while this worker still routes to it (iteration {iteration}, shard map epoch {epoch})"
    )]
    ServerGone {
        /// The server's rank.
        server: u32,
        /// The worker's iteration.
        iteration: u64,
        /// The epoch of the worker's shard map.
        epoch: u64,
    },
    /// With replicas: this worker cannot reach server `server`, and no other
    /// peer said so (the control plane did not declare it lost): this worker
    /// is taken to be the broken end, and leaves the job.
    #[error(
        "cannot reach server {server}, which the rest of the job still reaches (iteration {iteration}): this worker leaves the job"
    )]
    Unreachable {
        /// The server's rank.
        server: u32,
        /// The worker's iteration.
        iteration: u64,
    },
    /// The job removed this worker while it could not reach the control plane.
    #[error(
        "this worker (rank {rank}) was removed from the job from iteration {iteration} on: it did not reach the control plane for longer than job.worker_lease_ms (stopped, hung or cut off); the job goes on without it"
    )]
    Removed {
        /// The worker's rank.
        rank: u32,
        /// The first iteration it no longer contributes to.
        iteration: u64,
    },
    /// No tensor has that name.
    #[error("unknown tensor {0:?}")]
    UnknownTensor(String),
    /// A buffer of the wrong length was passed.
    #[error("{what}: expected {expected} elements, got {got}")]
    Length {
        /// Which buffer.
        what: &'static str,
        /// Expected elements.
        expected: usize,
        /// Given elements.
        got: usize,
    },
    /// The control plane answered something unexpected.
    #[error("unexpected answer from the control plane")]
    Unexpected,
    /// Nothing arrived in time.
    #[error("timed out waiting for {0}")]
    Timeout(&'static str),
    /// The servers did not answer every pull of an iteration in time.
    #[error("timed out waiting for pull answers of iteration {iteration}: {missing}")]
    PullTimeout {
        /// The iteration.
        iteration: u64,
        /// The shards not answered, with their servers.
        missing: String,
    },
    /// The call does not apply to this job.
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    /// Values given to the worker are unusable (what, and why).
    #[error("{0}")]
    BadValues(String),
    /// This worker left the job at this iteration (see [`Worker::begin`]):
    /// it pushes and pulls no more.
    #[error("this worker left the job at iteration {0} (see `Worker::begin`)")]
    Left(u64),
    /// The shard map names a server without an address.
    #[error("the shard map names server {0}, whose address is unknown")]
    NoAddress(u32),
    /// No sparse table has that name.
    #[error("unknown sparse table {0:?}")]
    UnknownTable(String),
    /// A sparse pull or push refused (nothing was sent).
    #[error("sparse table {table}: {why}")]
    Sparse {
        /// The table's name.
        table: String,
        /// Why.
        why: String,
    },
}
