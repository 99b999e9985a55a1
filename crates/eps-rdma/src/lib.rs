//! # eps-rdma
//!
//! The `rdma` fabric provider: libibverbs and librdmacm through rdma-sys, for
//! InfiniBand, RoCE and soft-RoCE (rxe). This is the only crate that names
//! rdma-sys; the `eps` binary uses it with its `rdma` feature.
//!
//! What it does so far: device discovery and the selection of device, port and
//! GID ([`device`]), which never guesses silently; and unit tests of the
//! rdma-sys inline helpers the data path will call (`inline_helpers.rs`). The
//! data path (registration, RC queue pairs over rdma_cm, the work requests,
//! completion polling) is not here yet.
//!
//! # Safety
//! Every `unsafe` block calls libibverbs on pointers it returned (or on buffers of
//! the size the call documents) and says so.

mod acct;
pub mod device;
mod handshake;
mod inline_helpers;
pub mod verbs;

pub use device::{Device, DeviceChoice, Gid, GidKind, Port, RdmaError, Selection, devices, select};
pub use verbs::{RdmaCq, RdmaDevice, RdmaListener, RdmaMr, RdmaPd, RdmaQp, RegCacheStats};
