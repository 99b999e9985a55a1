//! # eps-fabric
//!
//! The transport of EPS: one API with RDMA verbs semantics ([`api`]), so server and
//! worker code is the same over InfiniBand, RoCE, soft-RoCE and plain TCP, and the
//! `soft` provider ([`soft`]) that implements it in userspace over TCP with io_uring.
//!
//! ```no_run
//! use eps_fabric::prelude::*;
//! let dev = SoftDevice::open()?;
//! let pd = dev.alloc_pd();
//! let mr = pd.alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! let cq = pd.create_cq(256)?;
//! let opts = QpOptions::new(Secret::new("job secret")?);
//! let qp = pd.connect("127.0.0.1:7000".parse().unwrap(), &cq, &cq, &opts)?;
//! # let _ = (mr, qp);
//! # Ok::<(), eps_fabric::FabricError>(())
//! ```
//!
//! # Safety
//! Unsafe code lives here because this crate is the gate to the kernel's socket and
//! io_uring interfaces. The public API is safe: registered memory is owned by its
//! region and kept alive by every operation in flight that names it, so dropping a
//! region, a QP or the device while operations are outstanding is sound.

pub mod api;
pub mod auth;
pub mod error;
pub mod mem;
pub mod mixed;
pub mod shm;
pub mod soft;
pub mod span;
pub mod spin;
pub mod stats;
pub mod wire;

pub use api::*;
pub use error::{FabricError, Result, WcStatus};
pub use mem::RegionBuf;
pub use span::Span;
pub use spin::Spin;

/// Everything a user of the fabric needs in scope.
pub mod prelude {
    pub use crate::api::*;
    pub use crate::error::{FabricError, WcStatus};
    pub use crate::mem::RegionBuf;
    pub use crate::soft::{SoftCq, SoftDevice, SoftListener, SoftMr, SoftPd, SoftQp};
}
