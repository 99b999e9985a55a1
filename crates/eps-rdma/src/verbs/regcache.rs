//! The registration cache: regions dropped by their owner stay registered (pages
//! pinned, translations in the NIC) in a pool of their protection domain, and a
//! later `alloc_mr` of the same length and access takes one from there instead of
//! mapping, faulting and pinning fresh memory. Servers allocate a shard's regions
//! each time a shard arrives (migration, split) and drop them when it leaves, so an
//! elastic job registers the same sizes over and over.
//!
//! Remote access is revoked while a region is pooled: it is re-registered
//! (`ibv_rereg_mr`, access change only) with local access alone, so a peer still
//! holding its rkey gets a remote access error instead of writing into the pool.
//! A device that cannot change access in place (rxe in Linux 6.1) gets
//! no pooling by default: its regions are deregistered at once, as without the
//! cache; `EPS_RDMA_REG_CACHE_UNREVOKED=1` pools them anyway, remote access left
//! on. A region handed out again keeps its keys (verbs do not promise new ones on
//! a change of access); EPS never uses a released region's keys (a shard's memory
//! is released only once every worker routes elsewhere, and its landing regions
//! are kept until the job ends).
//!
//! The pool holds at most `EPS_RDMA_REG_CACHE_MIB` MiB per protection domain
//! (default 256; 0 turns the cache off).

use std::collections::HashMap;
use std::sync::Mutex;

use eps_fabric::Result;
use eps_fabric::prelude::*;
use rdma_sys as sys;

/// Default size limit of a pool.
const DEFAULT_LIMIT_MIB: usize = 256;

/// What a protection domain's registration cache did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegCacheStats {
    /// `alloc_mr` calls served from the pool.
    pub hits: u64,
    /// `alloc_mr` calls that registered fresh memory.
    pub misses: u64,
    /// Regions in the pool now.
    pub pooled: usize,
    /// Bytes in the pool now.
    pub pooled_bytes: usize,
    /// The pool's limit in bytes (0: off).
    pub limit_bytes: usize,
    /// `Some(false)` once the device refused to revoke remote access in place
    /// (the cache then pools nothing unless told to pool unrevoked regions);
    /// `None` until a region was first dropped.
    pub revocable: Option<bool>,
}

/// A region the pool did not take: the caller deregisters it.
pub(crate) type Unpooled = (*mut sys::ibv_mr, RegionBuf);

/// A region in the pool: still registered, with local access only when `revoked`.
struct Pooled {
    mr: *mut sys::ibv_mr,
    buf: RegionBuf,
    revoked: bool,
}

/// How a pool behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegCacheConfig {
    /// Most bytes pooled (0: no cache).
    pub limit_bytes: usize,
    /// Pool regions even where remote access cannot be revoked in place.
    pub unrevoked: bool,
}

impl Default for RegCacheConfig {
    fn default() -> Self {
        Self { limit_bytes: DEFAULT_LIMIT_MIB << 20, unrevoked: false }
    }
}

impl RegCacheConfig {
    /// The defaults, with `EPS_RDMA_REG_CACHE_MIB` and
    /// `EPS_RDMA_REG_CACHE_UNREVOKED` applied (a malformed value is an error
    /// naming it).
    pub fn from_env() -> Result<Self> {
        let mut c = Self::default();
        if let Some(v) = std::env::var("EPS_RDMA_REG_CACHE_MIB").ok().filter(|v| !v.is_empty()) {
            let mib: usize =
                v.parse().map_err(|_| FabricError::InvalidArgument("EPS_RDMA_REG_CACHE_MIB must be a whole number of MiB"))?;
            c.limit_bytes = mib.saturating_mul(1 << 20);
        }
        match std::env::var("EPS_RDMA_REG_CACHE_UNREVOKED").ok().as_deref() {
            None | Some("" | "0") => {}
            Some("1") => c.unrevoked = true,
            Some(_) => return Err(FabricError::InvalidArgument("EPS_RDMA_REG_CACHE_UNREVOKED must be 0 or 1")),
        }
        Ok(c)
    }
}

struct Pool {
    free: HashMap<(usize, u8), Vec<Pooled>>,
    stats: RegCacheStats,
    unrevoked: bool,
}

/// Changes the access flags of `mr` in place (`ibv_rereg_mr`); 0 on success.
///
/// # Safety
/// `mr` is a live registration in `pd`.
unsafe fn change_access(pd: *mut sys::ibv_pd, mr: *mut sys::ibv_mr, flags: u32) -> libc::c_int {
    let what = sys::ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_ACCESS.0 as libc::c_int;
    // SAFETY: the caller's promise; no address or PD changes.
    unsafe { sys::ibv_rereg_mr(mr, what, pd, std::ptr::null_mut(), 0, flags as libc::c_int) }
}

/// One protection domain's pool.
pub(crate) struct RegCache {
    pool: Mutex<Pool>,
}

// SAFETY: the pooled ibv_mr handles are only used under the mutex, and verbs
// objects may be used from any thread.
unsafe impl Send for RegCache {}
// SAFETY: as above.
unsafe impl Sync for RegCache {}

impl std::fmt::Debug for RegCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegCache").field("stats", &self.stats()).finish()
    }
}

impl RegCache {
    /// A pool as `cfg` says.
    pub(crate) fn new(cfg: RegCacheConfig) -> Self {
        let stats = RegCacheStats { limit_bytes: cfg.limit_bytes, ..RegCacheStats::default() };
        Self { pool: Mutex::new(Pool { free: HashMap::new(), stats, unrevoked: cfg.unrevoked }) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The counters.
    pub(crate) fn stats(&self) -> RegCacheStats {
        self.lock().stats
    }

    /// A pooled region of exactly `len` bytes, zeroed, with `flags` (verbs access
    /// flags) restored; `None` on a miss (counted).
    pub(crate) fn take(
        &self,
        pd: *mut sys::ibv_pd,
        len: usize,
        access: Access,
        flags: u32,
    ) -> Option<(*mut sys::ibv_mr, RegionBuf)> {
        let mut p = self.lock();
        let found = p.free.get_mut(&(len, access.bits())).and_then(Vec::pop);
        let Some(Pooled { mr, mut buf, revoked }) = found else {
            p.stats.misses += 1;
            return None;
        };
        p.stats.pooled -= 1;
        p.stats.pooled_bytes -= len;
        let rc = if !revoked {
            0
        } else {
            // SAFETY: `mr` is a live registration of `buf` in `pd`; its access goes
            // back to what it was registered with.
            unsafe { change_access(pd, mr, flags) }
        };
        if rc != 0 {
            // Unusable: drop it and register afresh.
            // SAFETY: registered once, deregistered once.
            unsafe { sys::ibv_dereg_mr(mr) };
            p.stats.misses += 1;
            return None;
        }
        p.stats.hits += 1;
        drop(p);
        buf.as_mut_slice().fill(0);
        Some((mr, buf))
    }

    /// Takes a dropped region into the pool, revoking its remote access; hands it
    /// back when it cannot be pooled (full, off, or the device cannot revoke).
    pub(crate) fn put(
        &self,
        pd: *mut sys::ibv_pd,
        mr: *mut sys::ibv_mr,
        buf: RegionBuf,
        access: Access,
    ) -> std::result::Result<(), Unpooled> {
        // Memory its owner keeps is never pooled: it goes back to its owner.
        if buf.is_borrowed() {
            return Err((mr, buf));
        }
        let mut p = self.lock();
        let len = buf.len();
        if p.stats.pooled_bytes.saturating_add(len) > p.stats.limit_bytes || (p.stats.revocable == Some(false) && !p.unrevoked) {
            return Err((mr, buf));
        }
        let local = sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        let rc = if p.stats.revocable == Some(false) {
            -1
        } else {
            // SAFETY: `mr` is a live registration of `buf` in `pd`; with local access
            // only, no peer can reach the memory through the old rkey.
            unsafe { change_access(pd, mr, local) }
        };
        p.stats.revocable = Some(rc == 0);
        if rc != 0 && !p.unrevoked {
            return Err((mr, buf));
        }
        p.free.entry((len, access.bits())).or_default().push(Pooled { mr, buf, revoked: rc == 0 });
        p.stats.pooled += 1;
        p.stats.pooled_bytes += len;
        Ok(())
    }

    /// Deregisters everything pooled (before the protection domain goes).
    pub(crate) fn clear(&self) {
        let mut p = self.lock();
        for (_, v) in p.free.drain() {
            for Pooled { mr, buf, .. } in v {
                // SAFETY: registered once, deregistered once, before its buffer goes.
                unsafe { sys::ibv_dereg_mr(mr) };
                drop(buf);
            }
        }
        p.stats.pooled = 0;
        p.stats.pooled_bytes = 0;
    }
}
