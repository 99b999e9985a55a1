//! Splitting a shard held here into two (BSP), ordered by the control plane
//! while it balances an added server.
//!
//! The split happens at the first moment the shard has no update parked: at
//! version `v`, with iteration `v` not aggregated. Both parts serve version
//! `v` (the parent's bits, cut at the split point). Pushes of iteration `v`
//! held for the parent are answered "moved" and the pulls waiting for `v + 1`
//! "pull moved": their workers fetch the new map and push and pull the parts.

use eps_proto::Consistency;
use eps_proto::sync::ShardSync;

use crate::ShardCore;

/// An order to split a shard, checked ([`Split::order`]) and waiting for the
/// shard to be free ([`Split::ready`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// The first element of the upper part.
    pub mid: u64,
    /// The lower part's shard id.
    pub lo: u32,
    /// The upper part's shard id.
    pub hi: u32,
}

/// Why an order to split a shard is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    /// Splits keep every part's version: SSP/ASP shards have none in common.
    #[error("splits need BSP consistency")]
    NotBsp,
    /// The split point leaves a part empty.
    #[error("the split point is outside it")]
    Outside,
    /// A part's id is the parent's or another shard's held here.
    #[error("a part's id is taken")]
    IdTaken,
    /// The shard migrates away or is being split already.
    #[error("it is migrating or splitting already")]
    Busy,
}

/// A split carried out: what the parts start from and whom the parent
/// sends elsewhere.
#[derive(Debug)]
pub struct Parts {
    /// The version both parts serve (the parent's).
    pub version: u64,
    /// The lower part: its id, span (start, length) and core.
    pub lo: (u32, (u64, u64), ShardCore),
    /// The upper part.
    pub hi: (u32, (u64, u64), ShardCore),
    /// Workers whose held pushes are answered "moved".
    pub held: Vec<u32>,
    /// Workers whose waiting pulls are answered "pull moved".
    pub waiting: Vec<u32>,
}

impl Split {
    /// Checks an order to split shard `id`, which spans `span` (start,
    /// length), at element `mid` into `lo` and `hi`. `taken` says whether an
    /// id names a shard held here; `busy` whether the shard migrates away or
    /// has a split ordered already.
    pub fn order(
        mode: Consistency,
        id: u32,
        span: (u64, u64),
        (mid, lo, hi): (u64, u32, u32),
        taken: impl Fn(u32) -> bool,
        busy: bool,
    ) -> Result<Split, SplitError> {
        let (start, len) = span;
        if mode != Consistency::Bsp {
            return Err(SplitError::NotBsp);
        }
        if mid <= start || mid >= start + len {
            return Err(SplitError::Outside);
        }
        if lo == hi || [lo, hi].iter().any(|&p| p == id || taken(p)) {
            return Err(SplitError::IdTaken);
        }
        if busy {
            return Err(SplitError::Busy);
        }
        Ok(Split { mid, lo, hi })
    }

    /// Whether the split can be carried out now: no update parked or being
    /// published, not migrating away, not waiting for its first values.
    pub fn ready(core: &ShardCore, moving: bool, seeding: bool) -> bool {
        core.parked_len() == 0 && !core.sync.publish_waiting() && !moving && !seeding
    }

    /// Carries the split out on the parent's `core`, which spans `span`, in
    /// a job of `ranks` worker ranks. The parent is done with: its held
    /// pushes and waiting pulls are taken out.
    pub fn carry_out(self, core: &mut ShardCore, span: (u64, u64), ranks: u32) -> Parts {
        let (start, len) = span;
        debug_assert!(core.parked_len() == 0, "a split waits for the parked updates");
        debug_assert!(start < self.mid && self.mid < start + len, "checked when ordered");
        let v = core.sync.version();
        let part = |at: u64, n: u64| (ShardCore::new(ShardSync::at_version(Consistency::Bsp, ranks, v)), (at, n));
        let (lo_core, lo_span) = part(start, self.mid - start);
        let (hi_core, hi_span) = part(self.mid, start + len - self.mid);
        let (held, waiting) = core.sync.evict();
        Parts { version: v, lo: (self.lo, lo_span, lo_core), hi: (self.hi, hi_span, hi_core), held, waiting }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_order_is_checked_and_the_parts_serve_the_parents_version() {
        let bsp = Consistency::Bsp;
        let none = |_| false;
        assert_eq!(Split::order(Consistency::Ssp, 1, (0, 8), (4, 2, 3), none, false), Err(SplitError::NotBsp));
        assert_eq!(Split::order(bsp, 1, (0, 8), (8, 2, 3), none, false), Err(SplitError::Outside));
        assert_eq!(Split::order(bsp, 1, (0, 8), (4, 1, 3), none, false), Err(SplitError::IdTaken));
        assert_eq!(Split::order(bsp, 1, (0, 8), (4, 2, 3), |p| p == 3, false), Err(SplitError::IdTaken));
        assert_eq!(Split::order(bsp, 1, (0, 8), (4, 2, 3), none, true), Err(SplitError::Busy));
        let s = Split::order(bsp, 1, (0, 8), (4, 2, 3), none, false).expect("a valid order");
        let mut core = ShardCore::new(ShardSync::at_version(bsp, 2, 5));
        assert!(Split::ready(&core, false, false));
        assert!(!Split::ready(&core, true, false), "not while it migrates");
        let p = s.carry_out(&mut core, (0, 8), 2);
        assert_eq!((p.version, p.lo.0, p.lo.1, p.hi.0, p.hi.1), (5, 2, (0, 4), 3, (4, 4)));
        assert_eq!((p.lo.2.sync.version(), p.hi.2.sync.version()), (5, 5));
    }
}
