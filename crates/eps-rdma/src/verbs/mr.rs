//! Registered memory: host memory (`ibv_reg_mr`, through the registration cache)
//! and device memory exported as a dmabuf (`ibv_reg_dmabuf_mr`: GPUDirect RDMA,
//! the NIC reads and writes GPU memory without a host copy).

use std::io;
use std::sync::Arc;

use eps_fabric::Result;
use eps_fabric::prelude::*;
use rdma_sys as sys;

use super::{PdInner, RdmaPd};

/// Memory the CPU cannot address, exported as a dmabuf by its owner (a GPU
/// allocation): the NIC reaches it directly; the CPU's copies go through the owner.
pub trait DeviceMemory: Send + Sync + std::fmt::Debug {
    /// The dmabuf file descriptor (owned by this object, open while it lives).
    fn dmabuf_fd(&self) -> std::os::fd::RawFd;
    /// Offset of the memory within the dmabuf.
    fn dmabuf_offset(&self) -> u64;
    /// Length in bytes (at least 1).
    fn len(&self) -> usize;
    /// Never true: device memory holds at least one byte.
    fn is_empty(&self) -> bool {
        false
    }
    /// The address work requests and peers name it by (the device pointer).
    fn iova(&self) -> u64;
    /// Copies `out.len()` bytes at `offset` to the host.
    fn read(&self, offset: usize, out: &mut [u8]);
    /// Copies `data` to `offset`.
    fn write(&self, offset: usize, data: &[u8]);
}

#[derive(Debug)]
enum Backing {
    /// Host memory; taken out only in `drop` (it goes back to the pool when no
    /// span of it is left). Shared with the region's spans.
    Host(std::mem::ManuallyDrop<Arc<RegionBuf>>),
    /// Device memory, kept alive as long as its registration and its spans.
    Device(Arc<dyn DeviceMemory>),
}

/// A registered memory region: host memory, or device memory registered through
/// its dmabuf ([`RdmaPd::register_dmabuf`]).
#[derive(Debug)]
pub struct RdmaMr {
    pub(super) mr: *mut sys::ibv_mr,
    backing: Backing,
    access: Access,
    pub(super) pd: Arc<PdInner>,
}

// SAFETY: the region's bytes are reached through `read_at`/`write_at` (copies),
// the unsafe host views, and the NIC; the ibv_mr handle is immutable after
// registration.
unsafe impl Send for RdmaMr {}
// SAFETY: as above.
unsafe impl Sync for RdmaMr {}

/// A new region, counted in the process's registered memory until dropped.
fn counted(mr: RdmaMr) -> RdmaMr {
    eps_fabric::stats::registered(mr.len() as i64);
    mr
}

impl Drop for RdmaMr {
    fn drop(&mut self) {
        eps_fabric::stats::registered(-(self.len() as i64));
        match &mut self.backing {
            Backing::Host(buf) => {
                // SAFETY: `buf` is taken once, here, and not used after.
                let buf = unsafe { std::mem::ManuallyDrop::take(buf) };
                // A buffer a span still holds is not reused: it goes with the
                // last span, deregistered now.
                match Arc::try_unwrap(buf) {
                    Ok(buf) => {
                        if let Err((mr, buf)) = self.pd.cache.put(self.pd.pd, self.mr, buf, self.access) {
                            // SAFETY: registered once, deregistered once, before its buffer goes.
                            unsafe { sys::ibv_dereg_mr(mr) };
                            drop(buf);
                        }
                    }
                    // SAFETY: as above; the spans keep the memory mapped.
                    Err(_held) => unsafe {
                        sys::ibv_dereg_mr(self.mr);
                    },
                }
            }
            // The device memory is dropped after this, with the struct.
            // SAFETY: registered once, deregistered once, before its memory goes.
            Backing::Device(_) => unsafe {
                sys::ibv_dereg_mr(self.mr);
            },
        }
    }
}

impl RdmaMr {
    /// True for host memory (the regions `alloc_mr` and `register` make).
    pub fn is_host(&self) -> bool {
        matches!(self.backing, Backing::Host(_))
    }
}

impl MemoryRegion for RdmaMr {
    fn lkey(&self) -> u32 {
        // SAFETY: `mr` is registered for the life of self.
        unsafe { (*self.mr).lkey }
    }
    fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }
    fn addr(&self) -> u64 {
        match &self.backing {
            Backing::Host(b) => b.as_ptr() as u64,
            Backing::Device(d) => d.iova(),
        }
    }
    fn len(&self) -> usize {
        match &self.backing {
            Backing::Host(b) => b.len(),
            Backing::Device(d) => d.len(),
        }
    }
    fn access(&self) -> Access {
        self.access
    }
    fn read_at(&self, offset: usize, out: &mut [u8]) {
        match &self.backing {
            Backing::Host(b) => out.copy_from_slice(&b.as_slice()[offset..offset + out.len()]),
            Backing::Device(d) => {
                assert!(offset.checked_add(out.len()).is_some_and(|e| e <= d.len()), "read_at out of bounds");
                d.read(offset, out)
            }
        }
    }
    fn write_at(&mut self, offset: usize, data: &[u8]) {
        match &mut self.backing {
            Backing::Host(b) => {
                assert!(offset.checked_add(data.len()).is_some_and(|e| e <= b.len()), "write_at out of bounds");
                // SAFETY: the range lies in the live mapping (checked above);
                // `&mut self` excludes this region's views, and the spans' holders
                // reach the bytes by address, as DMA does.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), b.as_ptr().add(offset), data.len()) }
            }
            Backing::Device(d) => {
                assert!(offset.checked_add(data.len()).is_some_and(|e| e <= d.len()), "write_at out of bounds");
                d.write(offset, data)
            }
        }
    }
}

// SAFETY: the NIC enforces the access flags the region was registered with
// (`access_flags`): without LOCAL_WRITE it never writes the region for a RECV
// or READ, without REMOTE_WRITE it refuses peers' WRITEs; `is_host` is false
// for device memory, whose `as_slice` panics instead of making a view.
unsafe impl HostRegion for RdmaMr {
    fn is_host(&self) -> bool {
        RdmaMr::is_host(self)
    }
    fn as_mut_ptr(&self) -> *mut u8 {
        match &self.backing {
            Backing::Host(b) => b.as_ptr(),
            Backing::Device(_) => std::ptr::null_mut(),
        }
    }
    unsafe fn span_unchecked(&self) -> eps_fabric::Span {
        match &self.backing {
            // SAFETY: the Arc owns the mapping, unmapped with the last clone, and
            // a buffer with spans out never goes back to the pool (Drop).
            Backing::Host(b) => unsafe {
                eps_fabric::Span::new(b.as_ptr() as u64, b.len(), true, Arc::clone(b) as Arc<dyn std::any::Any + Send + Sync>)
            },
            // SAFETY: the device memory is freed with the last clone of its Arc.
            Backing::Device(d) => unsafe {
                eps_fabric::Span::new(d.iova(), d.len(), false, Arc::new(Arc::clone(d)) as Arc<dyn std::any::Any + Send + Sync>)
            },
        }
    }
    /// # Panics
    /// On device memory ([`RdmaMr::is_host`] is false), which has no host view.
    unsafe fn as_slice(&self) -> &[u8] {
        match &self.backing {
            Backing::Host(b) => b.as_slice(),
            Backing::Device(_) => panic!("a device-memory region has no host view"),
        }
    }
    /// # Panics
    /// As `as_slice`.
    unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.backing {
            // SAFETY: the mapping lives as long as `b`; the caller's contract
            // excludes other users of the bytes meanwhile.
            Backing::Host(b) => unsafe { std::slice::from_raw_parts_mut(b.as_ptr(), b.len()) },
            Backing::Device(_) => panic!("a device-memory region has no host view"),
        }
    }
}

/// Verbs access flags for `a`.
pub(super) fn access_flags(a: Access) -> u32 {
    let mut f = 0;
    if a.contains(Access::LOCAL_WRITE) {
        f |= sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    }
    if a.contains(Access::REMOTE_WRITE) {
        // Verbs require local write with remote write.
        f |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0 | sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    }
    if a.contains(Access::REMOTE_READ) {
        f |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
    }
    f
}

/// Registers host memory (always afresh: the caller's buffer).
pub(super) fn register_host(pd: &Arc<PdInner>, mut buf: RegionBuf, access: Access) -> Result<RdmaMr> {
    let flags = access_flags(access);
    // SAFETY: the buffer is ours and lives in the returned region as long as the
    // registration.
    let mr = unsafe { sys::ibv_reg_mr(pd.pd, buf.as_mut_slice().as_mut_ptr().cast(), buf.len(), flags as libc::c_int) };
    if mr.is_null() {
        return Err(FabricError::Alloc { bytes: buf.len() as u64, source: io::Error::last_os_error() });
    }
    Ok(counted(RdmaMr { mr, backing: Backing::Host(std::mem::ManuallyDrop::new(Arc::new(buf))), access, pd: pd.clone() }))
}

/// `len` zeroed bytes of host memory: from the registration cache when it holds a
/// region of that length and access, else freshly mapped and registered.
pub(super) fn alloc_host(pd: &Arc<PdInner>, len: usize, access: Access) -> Result<RdmaMr> {
    match pd.cache.take(pd.pd, len, access, access_flags(access)) {
        Some((mr, buf)) => {
            Ok(counted(RdmaMr { mr, backing: Backing::Host(std::mem::ManuallyDrop::new(Arc::new(buf))), access, pd: pd.clone() }))
        }
        None => register_host(pd, RegionBuf::new(len)?, access),
    }
}

impl RdmaPd {
    /// Registers device memory through its dmabuf (`ibv_reg_dmabuf_mr`), for
    /// GPUDirect RDMA: peers WRITE into and READ from GPU memory, and work requests
    /// gather from it, with no host copy. Needs a NIC and kernel that support
    /// dmabuf registration (and, for GPU memory, a driver that exports dmabufs):
    /// an error says when they do not. The region keeps `mem` alive.
    pub fn register_dmabuf(&self, mem: Box<dyn DeviceMemory>, access: Access) -> Result<RdmaMr> {
        let flags = access_flags(access);
        let len = mem.len();
        if len == 0 {
            return Err(FabricError::InvalidArgument("a memory region cannot be empty"));
        }
        // SAFETY: the fd is open while `mem` lives, and `mem` outlives the
        // registration (it is dropped after `ibv_dereg_mr`, see Drop).
        let mr = unsafe {
            sys::ibv_reg_dmabuf_mr(self.0.pd, mem.dmabuf_offset(), len, mem.iova(), mem.dmabuf_fd(), flags as libc::c_int)
        };
        if mr.is_null() {
            return Err(FabricError::Alloc { bytes: len as u64, source: io::Error::last_os_error() });
        }
        Ok(counted(RdmaMr { mr, backing: Backing::Device(Arc::from(mem)), access, pd: self.0.clone() }))
    }
}
