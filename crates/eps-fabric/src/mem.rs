//! Page-aligned, owned memory for registration.
//!
//! A [`RegionBuf`] is an anonymous private mapping: page-aligned, zero-filled and
//! owned. Registering it hands ownership to the memory region, which keeps it alive
//! for as long as any operation in flight still refers to it.

use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use crate::error::FabricError;

/// Size of a page on this host (falls back to 4 KiB if `sysconf` says nothing).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 { n as usize } else { 4096 }
}

/// An owned, page-aligned, zero-initialised buffer (an anonymous mapping).
///
/// Its length is rounded up to whole pages for the mapping; [`RegionBuf::len`] is the
/// length that was asked for.
pub struct RegionBuf {
    ptr: NonNull<u8>,
    len: usize,
    map_len: usize,
    /// The sealed memfd behind a shared mapping ([`RegionBuf::shared`]).
    fd: Option<OwnedFd>,
}

// SAFETY: RegionBuf owns its mapping exclusively; the pointer is not shared with
// anything that is not also Send.
unsafe impl Send for RegionBuf {}
// SAFETY: shared references only allow reads through `as_slice`, which the borrow
// checker keeps apart from the `&mut self` writers.
unsafe impl Sync for RegionBuf {}

/// Size of a transparent huge page on x86-64 and most aarch64 kernels.
const HUGE_PAGE: usize = 2 << 20;

impl RegionBuf {
    /// Maps `len` bytes (at least 1) of zeroed, page-aligned memory.
    pub fn new(len: usize) -> Result<Self, FabricError> {
        if len == 0 {
            return Err(FabricError::InvalidArgument("a memory region cannot be empty"));
        }
        let page = page_size();
        let map_len =
            len.checked_add(page - 1).ok_or(FabricError::InvalidArgument("memory region length overflows"))? / page * page;
        // SAFETY: an anonymous private mapping with no address hint touches no
        // existing memory; the result is checked against MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(FabricError::Alloc { bytes: len as u64, source: std::io::Error::last_os_error() });
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(FabricError::InvalidArgument("mmap returned null"))?;
        if map_len >= HUGE_PAGE {
            // Large regions ask for transparent huge pages: first touches (a WRITE
            // landing in a fresh region) fault 2 MiB at a time instead of 4 KiB, and
            // copies into and out of the region miss the TLB less. Only advice: where
            // huge pages are off, the region works the same.
            // SAFETY: advice on the mapping created just above, which nothing else uses.
            let _ = unsafe { libc::madvise(ptr.as_ptr().cast(), map_len, libc::MADV_HUGEPAGE) };
        }
        Ok(Self { ptr, len, map_len, fd: None })
    }

    /// Maps `len` bytes (at least 1) of zeroed, page-aligned memory backed by a
    /// memfd whose size is sealed, so that a process on the same host that is
    /// handed the descriptor ([`RegionBuf::shared_fd`]) can map the same pages
    /// (the `shm` provider) and can never make them shrink under this one.
    pub fn shared(len: usize) -> Result<Self, FabricError> {
        if len == 0 {
            return Err(FabricError::InvalidArgument("a memory region cannot be empty"));
        }
        let page = page_size();
        let map_len =
            len.checked_add(page - 1).ok_or(FabricError::InvalidArgument("memory region length overflows"))? / page * page;
        let alloc_err = |source| FabricError::Alloc { bytes: len as u64, source };
        // SAFETY: the name is a NUL-terminated literal; the result is checked.
        let raw = unsafe { libc::memfd_create(c"eps-region".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(alloc_err(std::io::Error::last_os_error()));
        }
        // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain calls on the descriptor just created; results are checked.
        let sized = unsafe {
            libc::ftruncate(raw, map_len as libc::off_t) == 0
                && libc::fcntl(raw, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL) == 0
        };
        if !sized {
            return Err(alloc_err(std::io::Error::last_os_error()));
        }
        // SAFETY: a shared mapping of the whole memfd (sealed at `map_len`, so it
        // cannot shrink under the mapping), with no address hint; checked below.
        let ptr =
            unsafe { libc::mmap(std::ptr::null_mut(), map_len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, raw, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(alloc_err(std::io::Error::last_os_error()));
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(FabricError::InvalidArgument("mmap returned null"))?;
        Ok(Self { ptr, len, map_len, fd: Some(fd) })
    }

    /// The sealed memfd behind a [`RegionBuf::shared`] buffer (`None` otherwise).
    pub fn shared_fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// Length of the mapping (whole pages; 0 for borrowed memory).
    pub fn map_len(&self) -> usize {
        self.map_len
    }

    /// Memory its owner keeps, to be registered in place (a framework's own
    /// buffers): never freed by this type (its length is its own, no mapping).
    ///
    /// # Safety
    /// `ptr` points to `len` bytes valid for reads and writes that stay valid,
    /// and are not freed or remapped, until this buffer is dropped: the last
    /// memory region registered from it, operation naming it and [`crate::Span`]
    /// of it are gone (peers write into it: the owner must not rely on its
    /// contents while one may land).
    pub unsafe fn borrowed(ptr: *mut u8, len: usize) -> Result<Self, FabricError> {
        if len == 0 {
            return Err(FabricError::InvalidArgument("a memory region cannot be empty"));
        }
        let ptr = NonNull::new(ptr).ok_or(FabricError::InvalidArgument("a memory region cannot start at NULL"))?;
        Ok(Self { ptr, len, map_len: 0, fd: None })
    }

    /// Whether the memory is its owner's ([`RegionBuf::borrowed`]).
    pub fn is_borrowed(&self) -> bool {
        self.map_len == 0
    }

    /// Maps a buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8]) -> Result<Self, FabricError> {
        let mut b = Self::new(data.len().max(1))?;
        b.as_mut_slice()[..data.len()].copy_from_slice(data);
        Ok(b)
    }

    /// Length in bytes as requested.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: a region holds at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Start address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The bytes, for filling before registration.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` valid bytes owned by self, and `&mut self`
        // guarantees no other reference exists.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, for reading before registration.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as above; shared access only.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for RegionBuf {
    fn drop(&mut self) {
        if self.is_borrowed() {
            return; // its owner frees it
        }
        // SAFETY: the mapping was created by `new` with exactly this address and length
        // and nothing refers to it any more (self is being dropped).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.map_len);
        }
    }
}

impl std::fmt::Debug for RegionBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionBuf").field("addr", &self.ptr).field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    #[test]
    fn aligned_zeroed_and_owned() {
        let mut b = RegionBuf::new(10_000).unwrap();
        assert_eq!(b.as_ptr() as usize % page_size(), 0);
        assert_eq!(b.len(), 10_000);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[9_999] = 7;
        assert_eq!(b.as_slice()[9_999], 7);
        assert!(RegionBuf::new(0).is_err());
        let c = RegionBuf::from_slice(b"abc").unwrap();
        assert_eq!(c.as_slice(), b"abc");
    }

    #[test]
    fn shared_memory_is_sealed_and_maps_the_same_pages_twice() {
        let mut b = RegionBuf::shared(10_000).unwrap();
        assert_eq!(b.as_ptr() as usize % page_size(), 0);
        b.as_mut_slice()[9_999] = 7;
        let fd = b.shared_fd().unwrap().as_raw_fd();
        // SAFETY: fcntl on a descriptor owned by `b`.
        let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
        assert_eq!(seals & libc::F_SEAL_SHRINK, libc::F_SEAL_SHRINK);
        // SAFETY: a second shared mapping of the same memfd, unmapped below.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), b.map_len(), libc::PROT_READ, libc::MAP_SHARED, fd, 0) };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: the mapping is map_len >= 10_000 bytes long.
        assert_eq!(unsafe { *p.cast::<u8>().add(9_999) }, 7);
        // SAFETY: unmapping the mapping made above.
        unsafe { libc::munmap(p, b.map_len()) };
        // SAFETY: ftruncate on the descriptor: the seal must refuse it.
        assert_ne!(unsafe { libc::ftruncate(fd, 0) }, 0, "the size is sealed");
        assert!(RegionBuf::new(1).unwrap().shared_fd().is_none());
    }

    #[test]
    fn borrowed_memory_is_used_in_place_and_left_to_its_owner() {
        let mut owner = vec![1u8; 100];
        // SAFETY: `owner` outlives `b` and nothing else touches it meanwhile.
        let mut b = unsafe { RegionBuf::borrowed(owner.as_mut_ptr(), owner.len()) }.unwrap();
        assert!(b.is_borrowed() && !RegionBuf::new(1).unwrap().is_borrowed());
        assert_eq!(b.as_ptr(), owner.as_mut_ptr());
        b.as_mut_slice()[5] = 9;
        drop(b); // must not unmap or free
        assert_eq!(owner[5], 9);
        // SAFETY: as above (and never dereferenced: it is refused).
        assert!(unsafe { RegionBuf::borrowed(owner.as_mut_ptr(), 0) }.is_err());
        // SAFETY: refused before any use.
        assert!(unsafe { RegionBuf::borrowed(std::ptr::null_mut(), 4) }.is_err());
    }
}
