//! # eps-rdma
//!
//! The `rdma` fabric provider: libibverbs and librdmacm through rdma-sys, for
//! InfiniBand, RoCE and soft-RoCE (rxe). This is the only crate that names
//! rdma-sys; the `eps` binary uses it with its `rdma` feature.
//!
//! - [`device`]: discovery and the selection of device, port and GID, which never
//!   guesses silently (RoCE v2 GIDs are detected when no index is named).
//! - [`verbs`]: the data path: protection domains, registration with a
//!   registration cache, RC queue pairs connected through rdma_cm after a
//!   job-secret handshake (`handshake.rs`), SEND/RECV, WRITE, WRITE_WITH_IMM,
//!   READ, unsignaled work requests with periodic signaling, inline small sends,
//!   batched completion polling with statuses mapped to the fabric's errors.
//! - Unit tests of every rdma-sys inline helper it calls (`inline_helpers.rs`),
//!   and of rdma-sys's struct layouts against the C headers (`tests/layouts.rs`).
//!
//! Its tests on a device (`tests/rxe.rs`, the rdma cases of the fabric
//! conformance suite) run on soft-RoCE through `ci/softroce.sh`.
//!
//! # Safety
//! Every `unsafe` block calls libibverbs on pointers it returned (or on buffers of
//! the size the call documents) and says so.

mod acct;
pub mod addr;
pub mod device;
mod handshake;
mod inline_helpers;
pub mod verbs;

pub use device::{Device, DeviceChoice, Gid, GidKind, Port, RdmaError, Selection, devices, select};
pub use verbs::{DeviceMemory, RdmaCq, RdmaDevice, RdmaListener, RdmaMr, RdmaPd, RdmaQp, RegCacheConfig, RegCacheStats};
