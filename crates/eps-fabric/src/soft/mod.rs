//! The `soft` provider: verbs semantics in userspace over TCP, driven by io_uring.
//!
//! Each queue pair is two TCP connections: the *requester* channel, on which this side
//! sends requests and reads responses from the caller's thread (posting transmits,
//! polling the CQ reaps), and the *responder* channel, served by the device's progress
//! thread through io_uring: it checks rkey, bounds and access, lands WRITE payloads
//! straight into the target region, and serves READs straight from it. No payload is
//! staged through an intermediate buffer on either side.
//!
//! # Thread safety
//! Every handle is `Send + Sync`. Posting to one QP from several threads is
//! serialised by the QP's lock; polling a CQ from several threads is allowed.

mod cm;
pub(crate) mod cq;
mod engine;
pub(crate) mod qp;
pub(crate) mod sys;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};

use crate::api::{Access, Fabric, HostRegion, MemoryRegion, ProtectionDomain, QpOptions};
use crate::error::Result;
use crate::mem::RegionBuf;

pub use cm::SoftListener;
pub use cq::SoftCq;
pub(crate) use engine::spin_budget;
pub use qp::SoftQp;

/// Most SGEs a soft work request may carry.
pub const MAX_SGE: usize = 8;

/// An open `soft` device: owns the progress thread and the registration table.
#[derive(Clone, Debug)]
pub struct SoftDevice {
    inner: Arc<DeviceInner>,
}

#[derive(Debug)]
pub(crate) struct DeviceInner {
    pub(crate) mrs: Arc<MrTable>,
    pub(crate) engine: engine::EngineHandle,
    pub(crate) next_qp: AtomicU32,
}

impl SoftDevice {
    /// Opens a device and starts its progress thread.
    pub fn open() -> Result<Self> {
        Self::open_with(Arc::new(MrTable::default()))
    }

    /// Opens a device whose regions live in `mrs` (shared with an shm device).
    pub(crate) fn open_with(mrs: Arc<MrTable>) -> Result<Self> {
        let engine = engine::EngineHandle::start(mrs.clone())?;
        Ok(Self { inner: Arc::new(DeviceInner { mrs, engine, next_qp: AtomicU32::new(1) }) })
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> SoftPd {
        self.pd_numbered(next_pd())
    }

    pub(crate) fn pd_numbered(&self, pd: u32) -> SoftPd {
        SoftPd { dev: self.inner.clone(), pd }
    }
}

/// A new protection-domain number: unique in the process across every device
/// and provider, so memory of a domain of another device is told apart as well.
pub(crate) fn next_pd() -> u32 {
    static NEXT_PD: AtomicU32 = AtomicU32::new(1);
    NEXT_PD.fetch_add(1, Ordering::Relaxed)
}

/// A protection domain of the soft device.
#[derive(Clone, Debug)]
pub struct SoftPd {
    pub(crate) dev: Arc<DeviceInner>,
    pub(crate) pd: u32,
}

impl Fabric for SoftPd {
    const NAME: &'static str = "soft";
}

impl ProtectionDomain for SoftPd {
    type Mr = SoftMr;
    type Cq = SoftCq;
    type Qp = SoftQp;
    type Listener = SoftListener;

    fn register(&self, buf: RegionBuf, access: Access) -> Result<SoftMr> {
        Ok(SoftMr::register_in(&self.dev.mrs, buf, self.pd, access))
    }

    fn create_cq(&self, depth: u32) -> Result<SoftCq> {
        SoftCq::new(depth)
    }

    fn listen(&self, addr: SocketAddr, opts: &QpOptions) -> Result<SoftListener> {
        SoftListener::bind(self.clone(), addr, opts.clone())
    }

    fn connect(&self, addr: SocketAddr, send_cq: &SoftCq, recv_cq: &SoftCq, opts: &QpOptions) -> Result<SoftQp> {
        cm::dial(self, addr, send_cq, recv_cq, opts)
    }
}

/// State of one registration, shared by the handle and by operations in flight.
#[derive(Debug)]
pub(crate) struct MrInner {
    pub(crate) buf: RegionBuf,
    pub(crate) key: u32,
    pub(crate) pd: u32,
    pub(crate) access: Access,
    /// Never reused in this process (keys are, after 256 registrations of a
    /// slot): how the `shm` provider names the region to a peer that maps it.
    pub(crate) uid: u64,
}

impl MrInner {
    pub(crate) fn base(&self) -> u64 {
        self.buf.as_ptr() as u64
    }

    /// Checks that `[addr, addr+len)` lies inside the region; returns the pointer.
    pub(crate) fn range(&self, addr: u64, len: u64) -> Option<*mut u8> {
        let off = addr.checked_sub(self.base())?;
        let end = off.checked_add(len)?;
        if end > self.buf.len() as u64 {
            return None;
        }
        // `off` is within the mapping, so the add stays in bounds.
        Some(self.buf.as_ptr().wrapping_add(off as usize))
    }
}

/// A registered memory region. Dropping it deregisters it: its rkey stops working at
/// once, and the memory is unmapped when the last operation in flight that uses it ends.
#[derive(Debug)]
pub struct SoftMr {
    inner: Arc<MrInner>,
    table: Arc<MrTable>,
}

// SAFETY: the soft and shm providers check every local SGE that an operation
// writes (RECV, the target of a READ) for LOCAL_WRITE when it is posted, and
// every peer's WRITE or SEND target for REMOTE_WRITE in the engine, against the
// region's registered access; the mapping lives as long as `inner`.
unsafe impl HostRegion for SoftMr {
    unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the caller excludes concurrent writers; the mapping lives as long as self.
        unsafe { std::slice::from_raw_parts(self.inner.buf.as_ptr(), self.inner.buf.len()) }
    }

    fn as_mut_ptr(&self) -> *mut u8 {
        self.inner.buf.as_ptr()
    }

    unsafe fn span_unchecked(&self) -> crate::Span {
        // SAFETY: `inner` owns the mapping (its `RegionBuf`), unmapped only when
        // the last `Arc` goes, and never handed to another registration.
        unsafe { crate::Span::new(self.inner.base(), self.inner.buf.len(), true, self.inner.clone()) }
    }

    unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` excludes other local users.
        unsafe { std::slice::from_raw_parts_mut(self.inner.buf.as_ptr(), self.inner.buf.len()) }
    }
}

impl SoftMr {
    pub(crate) fn inner(&self) -> &Arc<MrInner> {
        &self.inner
    }

    /// Registers `buf` in `table` (the `shm` provider shares this region type).
    pub(crate) fn register_in(table: &Arc<MrTable>, buf: RegionBuf, pd: u32, access: Access) -> SoftMr {
        crate::stats::registered(buf.len() as i64);
        let inner = table.insert(buf, pd, access);
        SoftMr { inner, table: table.clone() }
    }
}

impl MemoryRegion for SoftMr {
    fn lkey(&self) -> u32 {
        self.inner.key
    }
    fn rkey(&self) -> u32 {
        self.inner.key
    }
    fn addr(&self) -> u64 {
        self.inner.base()
    }
    fn len(&self) -> usize {
        self.inner.buf.len()
    }
    fn access(&self) -> Access {
        self.inner.access
    }
    fn read_at(&self, offset: usize, out: &mut [u8]) {
        assert!(offset.checked_add(out.len()).is_some_and(|e| e <= self.len()), "read_at out of bounds");
        // SAFETY: the range is inside the live mapping (checked above). Writers are the
        // kernel (socket receives) only, as with DMA, so no Rust reference aliases it.
        unsafe { std::ptr::copy_nonoverlapping(self.inner.buf.as_ptr().add(offset), out.as_mut_ptr(), out.len()) }
    }
    fn write_at(&mut self, offset: usize, data: &[u8]) {
        assert!(offset.checked_add(data.len()).is_some_and(|e| e <= self.len()), "write_at out of bounds");
        // SAFETY: as in read_at; `&mut self` excludes concurrent local writers.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.inner.buf.as_ptr().add(offset), data.len()) }
    }
}

impl Drop for SoftMr {
    fn drop(&mut self) {
        crate::stats::registered(-(self.inner.buf.len() as i64));
        self.table.remove(self.inner.key);
    }
}

/// rkey -> region. Keys are `(slot + 1) << 8 | generation`, so a deregistered key is
/// never accepted again by accident when its slot is reused.
#[derive(Debug, Default)]
pub(crate) struct MrTable {
    slots: RwLock<Slots>,
}

#[derive(Debug, Default)]
struct Slots {
    entries: Vec<(u8, Option<Arc<MrInner>>)>,
    free: Vec<u32>,
}

impl MrTable {
    fn insert(&self, buf: RegionBuf, pd: u32, access: Access) -> Arc<MrInner> {
        let mut s = self.slots.write().unwrap_or_else(|p| p.into_inner());
        let idx = match s.free.pop() {
            Some(i) => i,
            None => {
                s.entries.push((0, None));
                (s.entries.len() - 1) as u32
            }
        };
        let slot = &mut s.entries[idx as usize];
        slot.0 = slot.0.wrapping_add(1);
        let key = ((idx + 1) << 8) | slot.0 as u32;
        static NEXT_UID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let uid = NEXT_UID.fetch_add(1, Ordering::Relaxed);
        let inner = Arc::new(MrInner { buf, key, pd, access, uid });
        slot.1 = Some(inner.clone());
        inner
    }

    fn remove(&self, key: u32) {
        let mut s = self.slots.write().unwrap_or_else(|p| p.into_inner());
        let idx = (key >> 8).wrapping_sub(1) as usize;
        if let Some(slot) = s.entries.get_mut(idx)
            && slot.1.as_ref().is_some_and(|m| m.key == key)
        {
            slot.1 = None;
            s.free.push(idx as u32);
        }
    }

    /// The live region with this key, if any.
    pub(crate) fn lookup(&self, key: u32) -> Option<Arc<MrInner>> {
        let s = self.slots.read().unwrap_or_else(|p| p.into_inner());
        let idx = (key >> 8).wrapping_sub(1) as usize;
        let m = s.entries.get(idx)?.1.as_ref()?;
        (m.key == key).then(|| m.clone())
    }
}
