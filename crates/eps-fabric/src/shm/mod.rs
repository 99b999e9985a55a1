//! The `shm` provider: verbs semantics between processes of one host, moving each
//! payload once, through memory both processes map.
//!
//! Regions are memfds sealed against shrinking ([`RegionBuf::shared`]); memory
//! registered in place (a framework's own buffers) is reached with
//! `process_vm_readv`/`process_vm_writev` instead, which the kernel allows
//! between processes of one user. Each queue pair is a Unix socket (set-up,
//! authentication with the job secret, and the announcements of the requester's
//! regions, with their memfds) and a shared segment of request and response
//! rings ([`ring`]). The requester writes a request into the ring from the
//! caller's thread; the responder's progress thread, acting as the NIC, checks
//! the rkey, bounds and access flags against its own registration table, then
//! copies the bytes between the peer's announced memory and its own region, and
//! answers in the response ring, which the requester reaps when its CQ is polled.
//! A peer's memory is reached only as the requester of an operation hands it
//! over, so the responder's checks stand for every byte that lands in its
//! regions; a deregistered region's rkey stops working at once.
//!
//! Doorbells are flags in the shared segment: nobody makes a system call while
//! the other side spins; a side that goes to sleep raises its flag and is woken
//! through its eventfd, which the peer was handed at set-up.
//!
//! # Thread safety
//! Every handle is `Send + Sync`, as with the soft provider, whose region and
//! completion-queue types this provider shares.

mod cm;
mod copy;
mod engine;
mod msg;
mod qp;
pub(crate) mod ring;
mod sys;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use crate::api::{Access, Fabric, ProtectionDomain, QpOptions};
use crate::error::Result;
use crate::mem::RegionBuf;
use crate::soft::{MrTable, SoftCq, SoftMr};

pub use cm::ShmListener;
pub(crate) use cm::{dial_on, dial_socket};
pub use qp::ShmQp;

/// An open `shm` device: owns the progress thread and the registration table.
#[derive(Clone, Debug)]
pub struct ShmDevice {
    inner: Arc<DeviceInner>,
}

#[derive(Debug)]
pub(crate) struct DeviceInner {
    pub(crate) mrs: Arc<MrTable>,
    pub(crate) engine: engine::EngineHandle,
    pub(crate) next_qp: AtomicU32,
}

impl ShmDevice {
    /// Opens a device and starts its progress thread.
    pub fn open() -> Result<Self> {
        Self::open_with(Arc::new(MrTable::default()))
    }

    /// Opens a device whose regions live in `mrs` (shared with a soft device).
    pub(crate) fn open_with(mrs: Arc<MrTable>) -> Result<Self> {
        sys::raise_fd_limit();
        let engine = engine::EngineHandle::start(mrs.clone())?;
        Ok(Self { inner: Arc::new(DeviceInner { mrs, engine, next_qp: AtomicU32::new(1) }) })
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> ShmPd {
        self.pd_numbered(crate::soft::next_pd())
    }

    pub(crate) fn pd_numbered(&self, pd: u32) -> ShmPd {
        ShmPd { dev: self.inner.clone(), pd }
    }
}

/// A protection domain of the shm device.
#[derive(Clone, Debug)]
pub struct ShmPd {
    pub(crate) dev: Arc<DeviceInner>,
    pub(crate) pd: u32,
}

impl Fabric for ShmPd {
    const NAME: &'static str = "shm";
}

impl ProtectionDomain for ShmPd {
    type Mr = SoftMr;
    type Cq = SoftCq;
    type Qp = ShmQp;
    type Listener = ShmListener;

    fn register(&self, buf: RegionBuf, access: Access) -> Result<SoftMr> {
        Ok(SoftMr::register_in(&self.dev.mrs, buf, self.pd, access))
    }

    /// Allocates `len` zeroed bytes in a sealed memfd, so peers can map them.
    fn alloc_mr(&self, len: usize, access: Access) -> Result<SoftMr> {
        self.register(RegionBuf::shared(len)?, access)
    }

    fn create_cq(&self, depth: u32) -> Result<SoftCq> {
        SoftCq::new(depth)
    }

    fn listen(&self, addr: SocketAddr, opts: &QpOptions) -> Result<ShmListener> {
        ShmListener::bind(self.clone(), addr, opts.clone())
    }

    fn connect(&self, addr: SocketAddr, send_cq: &SoftCq, recv_cq: &SoftCq, opts: &QpOptions) -> Result<ShmQp> {
        cm::dial(self, addr, send_cq, recv_cq, opts)
    }
}
