//! Memory lent past a call: what a device (a GPU's copy engine or kernels, a
//! NIC's DMA) is given to use after the call that hands it over has returned.

use std::any::Any;
use std::sync::Arc;

/// A range of memory, with an owner that keeps it allocated at its address for
/// as long as this value (or a clone) lives. A region's span
/// ([`crate::HostRegion::span`]) outlives the region's registration: the keys
/// stop working when the region is dropped, the memory goes with the last span.
///
/// What is read or written through the address is the holder's business: a
/// device that copies from a span that peers write reads the bytes as a NIC's
/// DMA does (a write racing the copy tears the values, never more).
#[derive(Clone)]
pub struct Span {
    addr: u64,
    len: usize,
    host: bool,
    /// Holds the memory (never read).
    _owner: Arc<dyn Any + Send + Sync>,
}

impl Span {
    /// A span of `len` bytes at `addr`: host memory the CPU addresses
    /// (`host`), or a device's (its address there).
    ///
    /// # Safety
    /// `addr..addr + len` stays allocated at that address (mapped, for host
    /// memory) for as long as `owner` lives, and is not handed to other use
    /// meanwhile.
    pub unsafe fn new(addr: u64, len: usize, host: bool, owner: Arc<dyn Any + Send + Sync>) -> Self {
        Self { addr, len, host, _owner: owner }
    }

    /// `len` zeroed bytes of host memory of the span's own (a test's stand-in
    /// for a region, a device's host-side buffer), reached by
    /// [`Span::copy_in`] and [`Span::copy_out`].
    pub fn alloc_host(len: usize) -> crate::Result<Self> {
        let buf = Arc::new(crate::RegionBuf::new(len)?);
        // SAFETY: the Arc owns the mapping, unmapped with the last clone.
        Ok(unsafe { Self::new(buf.as_ptr() as u64, len, true, buf) })
    }

    /// Copies `out.len()` bytes at `offset` out of host memory. Bytes a device
    /// writes meanwhile may be torn, as with DMA.
    pub fn copy_out(&self, offset: usize, out: &mut [u8]) -> crate::Result<()> {
        self.check(offset, out.len())?;
        // SAFETY: the range lies in host memory the owner keeps mapped (checked
        // above); the bytes are read by address, no reference to them is formed.
        unsafe { std::ptr::copy_nonoverlapping((self.addr as usize as *const u8).add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `data` into host memory at `offset`.
    pub fn copy_in(&self, offset: usize, data: &[u8]) -> crate::Result<()> {
        self.check(offset, data.len())?;
        // SAFETY: as in `copy_out`: written by address, as a device's DMA writes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), (self.addr as usize as *mut u8).add(offset), data.len()) };
        Ok(())
    }

    fn check(&self, offset: usize, len: usize) -> crate::Result<()> {
        if !self.host {
            return Err(crate::FabricError::InvalidArgument("a device's memory is not copied from the host this way"));
        }
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(crate::FabricError::InvalidArgument("a copy past the end of a span"));
        }
        Ok(())
    }

    /// The address of the first byte (a host address, or the device's).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty span.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the memory is the host's (else a device's).
    pub fn is_host(&self) -> bool {
        self.host
    }
}

impl std::fmt::Debug for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Span")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("host", &self.host)
            .finish()
    }
}
