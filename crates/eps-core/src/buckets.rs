//! The buckets of sparse tables on one server: what a new bucket map means
//! for it, and whether a sparse request goes on, waits or is refused.
//!
//! A bucket map ordered at iteration `T` (see `eps-control`'s
//! `job/buckets.rs`) makes this server a source of the buckets it gives
//! away ([`Leaving`]: their rows leave once every push before `T` is
//! applied) and a target of those it receives ([`BucketsIn`]: pushes of `T`
//! and later, and pulls of keys whose rows are on their way, wait until
//! every source's rows are in).

use eps_proto::Consistency;
use eps_proto::buckets::{self, BUCKETS, bucket_of, owners_at};
use eps_proto::sync::ShardSync;

/// Buckets coming to this server.
#[derive(Clone, Debug)]
pub struct BucketsIn {
    /// The cutover iteration: pushes of it and later wait for the rows.
    pub at: u64,
    /// The sources whose rows are not in yet.
    from: Vec<u32>,
    /// By bucket: whether it is one of those coming (pulls of its keys wait).
    buckets: Vec<bool>,
}

impl BucketsIn {
    /// Whether a request must wait for the rows: a push of the cutover
    /// iteration or later, or a pull of a key whose rows are on their way.
    pub fn holds(&self, push: bool, seq: u64, keys: &[u64]) -> bool {
        if push { seq >= self.at } else { keys.iter().any(|&k| self.buckets[bucket_of(k) as usize]) }
    }

    /// The sources whose rows are not in yet.
    pub fn sources(&self) -> &[u32] {
        &self.from
    }

    /// The rows of source `from` are in: whether they were the last.
    pub fn taken(&mut self, from: u32) -> bool {
        self.from.retain(|&f| f != from);
        self.from.is_empty()
    }
}

/// Buckets leaving this server at `at`: the targets, and each bucket's
/// target (an index into them; `None` for a bucket that stays or was never
/// here).
#[derive(Clone, Debug)]
pub struct Leaving {
    pub at: u64,
    pub targets: Vec<u32>,
    pub dest: Vec<Option<usize>>,
}

/// What a new bucket map means for this server.
#[derive(Debug)]
pub struct BucketOrder {
    /// Buckets it receives.
    pub incoming: Option<BucketsIn>,
    /// Buckets it gives away.
    pub leaving: Option<Leaving>,
    /// It owned no bucket before and receives some: its parts start at the
    /// cutover ([`restarted`]).
    pub restart: bool,
}

/// A bucket map that cannot be taken.
#[derive(Debug, thiserror::Error)]
pub enum BucketError {
    #[error("bucket map at iteration {at}: its runs do not cover the buckets")]
    Runs { at: u64 },
    #[error("bucket map at iteration {at}: no map before it")]
    NoneBefore { at: u64 },
    #[error("bucket map at iteration {at}: it does not come after the map of iteration {last}")]
    NotAfter { at: u64, last: u64 },
}

/// Server `me` is ordered the bucket map `runs` from iteration `at` on: it
/// is added to `history` (the maps by first iteration), and what moves to
/// and from `me` is returned.
pub fn take_map(history: &mut Vec<(u64, Vec<u32>)>, at: u64, runs: &[(u32, u32)], me: u32) -> Result<BucketOrder, BucketError> {
    let new = buckets::expand(runs).ok_or(BucketError::Runs { at })?;
    let Some((last, old)) = history.last() else { return Err(BucketError::NoneBefore { at }) };
    if at <= *last {
        return Err(BucketError::NotAfter { at, last: *last });
    }
    let old = old.clone();
    let moves = buckets::transfers(&old, &new);
    let sources: Vec<u32> = moves.iter().filter(|&&(_, to)| to == me).map(|&(f, _)| f).collect();
    let targets: Vec<u32> = moves.iter().filter(|&&(f, _)| f == me).map(|&(_, t)| t).collect();
    let n = BUCKETS as usize;
    let restart = !sources.is_empty() && !old.contains(&me);
    let incoming = (!sources.is_empty()).then(|| BucketsIn {
        at,
        from: sources,
        buckets: (0..n).map(|b| old[b] != me && new[b] == me).collect(),
    });
    let leaving = (!targets.is_empty()).then(|| Leaving {
        at,
        dest: (0..n).map(|b| (old[b] == me).then(|| targets.iter().position(|&t| t == new[b])).flatten()).collect(),
        targets,
    });
    history.push((at, new));
    Ok(BucketOrder { incoming, leaving, restart })
}

/// What was still on its way to server `me` from `sources` by the newest
/// map of `history` when `me` was lost: its stand-in takes the rows in its
/// place, holding what `me` would have held meanwhile.
pub fn still_incoming(history: &[(u64, Vec<u32>)], me: u32, sources: &[u32]) -> Option<BucketsIn> {
    let [.., (_, old), (at, new)] = history else { return None };
    let from: Vec<u32> = sources.to_vec();
    let buckets: Vec<bool> = old.iter().zip(new).map(|(&o, &n)| n == me && o != me && from.contains(&o)).collect();
    (!from.is_empty()).then_some(BucketsIn { at: *at, from, buckets })
}

/// A table part's state from iteration `at` on, when it held no bucket
/// before: BSP pushes and pulls start at version `at`; SSP/ASP every
/// worker's next push is of `at`.
pub fn restarted(mode: Consistency, workers: u32, at: u64) -> ShardSync {
    match mode {
        Consistency::Bsp => ShardSync::at_version(mode, workers, at),
        _ => ShardSync::new(mode, workers).resumed_at(at),
    }
}

/// Whether every push of the iterations before `at` was applied to a part
/// (BSP: its version is `at`; SSP/ASP: every one of `workers` pushed
/// `at - 1`), and nothing after: `Some(true)` if so (the leaving buckets'
/// rows may go), `Some(false)` if not yet, `None` if an iteration of `at`
/// or later was applied already.
pub fn reached(sync: &ShardSync, mode: Consistency, at: u64, workers: &[u32]) -> Option<bool> {
    match mode {
        Consistency::Bsp if sync.version() > at => None,
        Consistency::Bsp => Some(sync.version() == at),
        _ => {
            let clocks = sync.clocks();
            Some(workers.iter().all(|&w| clocks.get(w as usize).is_some_and(|&c| c >= at)))
        }
    }
}

/// A sparse request that landed: a push (`seq` its iteration) or a pull
/// (`seq` the version asked), of `keys`.
#[derive(Clone, Copy, Debug)]
pub struct SparseReq<'a> {
    pub push: bool,
    pub seq: u64,
    pub keys: &'a [u64],
}

/// What a sparse request leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SparseGate {
    /// Taken now.
    Go,
    /// Held until a bucket vote or move ends (then offered again).
    Hold,
    /// Refused: this key belongs to another server.
    Foreign(u64),
}

/// Where this server (`me`) stands on its buckets, for [`SparseGuard::gate`].
#[derive(Clone, Copy, Debug)]
pub struct SparseGuard<'a> {
    pub me: u32,
    pub mode: Consistency,
    /// The bucket maps known, by first iteration.
    pub history: &'a [(u64, Vec<u32>)],
    /// The hold of an open vote (a membership or a bucket map).
    pub hold: Option<u64>,
    /// Buckets on their way here.
    pub incoming: Option<&'a BucketsIn>,
    /// The table still holds rows it gives away (the buckets it owned
    /// before the newest map, their rows not taken out yet).
    pub giving: bool,
}

impl SparseGuard<'_> {
    /// Whether `req` goes on, waits, or is refused.
    pub fn gate(&self, req: SparseReq<'_>) -> SparseGate {
        // Held while a bucket map is voted on or rows are on their way
        // (their owners are checked once it is known).
        let held_push = req.push && self.hold.is_some_and(|h| req.seq >= h);
        if held_push || self.incoming.is_some_and(|g| g.holds(req.push, req.seq, req.keys)) {
            return SparseGate::Hold;
        }
        let foreign = if req.push || self.mode == Consistency::Bsp {
            // The request's iteration (a BSP pull's version is its
            // iteration) names the map it was routed by.
            let owners = owners_at(self.history, req.seq).map_or(&[][..], |o| &o[..]);
            req.keys.iter().copied().find(|&k| owners.get(bucket_of(k) as usize) != Some(&self.me))
        } else {
            // An SSP/ASP pull names a version, not its iteration: its keys
            // are this server's by the newest map, or by the one before
            // while their rows are still here.
            self.foreign_pull(req.keys)
        };
        match foreign {
            // While a bucket map is voted on, a worker may route by the
            // committed one before this server is told it: held until
            // then (and refused only if the new map does not give the key
            // here either).
            Some(_) if self.hold.is_some() && !eps_proto::mutants::active("sparse-pull-before-bucket-order") => SparseGate::Hold,
            Some(k) => SparseGate::Foreign(k),
            None => SparseGate::Go,
        }
    }

    /// The first of `keys` that is not this server's by the newest bucket
    /// map nor, while `giving`, by the one before.
    fn foreign_pull(&self, keys: &[u64]) -> Option<u64> {
        let n = self.history.len();
        let newest = &self.history.last()?.1;
        let before = self.giving.then(|| n.checked_sub(2).map(|i| &self.history[i].1)).flatten();
        keys.iter().copied().find(|&k| {
            let b = bucket_of(k) as usize;
            newest[b] != self.me && before.is_none_or(|o| o[b] != self.me)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_in(bucket_range: std::ops::Range<u32>) -> u64 {
        (0u64..).find(|&k| bucket_range.contains(&bucket_of(k))).unwrap_or(0)
    }

    #[test]
    fn a_new_map_names_sources_targets_and_the_buckets_that_move() {
        let mut h = vec![(0, buckets::initial_owners(1))];
        let new = buckets::rebalance(&h[0].1, &[0, 1]);
        let o = take_map(&mut h, 5, &buckets::runs(&new), 1).unwrap();
        assert!(o.restart && o.leaving.is_none());
        let inc = o.incoming.unwrap();
        assert_eq!((inc.at, inc.sources()), (5, &[0][..]));
        let moved = key_in(BUCKETS / 2..BUCKETS);
        let stays = key_in(0..BUCKETS / 2);
        assert!(inc.holds(false, 3, &[stays, moved]) && !inc.holds(false, 3, &[stays]));
        assert!(inc.holds(true, 5, &[]) && !inc.holds(true, 4, &[moved]));
        let mut h0 = vec![(0, buckets::initial_owners(1))];
        let o = take_map(&mut h0, 5, &buckets::runs(&new), 0).unwrap();
        let l = o.leaving.unwrap();
        assert_eq!(l.targets, vec![1]);
        assert_eq!(l.dest[bucket_of(moved) as usize], Some(0));
        assert_eq!(l.dest[bucket_of(stays) as usize], None);
        assert!(matches!(take_map(&mut h0, 5, &buckets::runs(&new), 0), Err(BucketError::NotAfter { at: 5, last: 5 })));
        assert!(matches!(take_map(&mut h0, 9, &[(1, 0)], 0), Err(BucketError::Runs { at: 9 })));
    }

    #[test]
    fn a_lost_targets_stand_in_holds_what_is_still_on_its_way_to_it() {
        // Three servers to two: server 2's buckets go to 0 and 1.
        let three = buckets::initial_owners(3);
        let two = buckets::rebalance(&three, &[0, 1]);
        let h = vec![(0, three.clone()), (7, two.clone())];
        let inc = still_incoming(&h, 0, &[2]).unwrap();
        assert_eq!((inc.at, inc.sources()), (7, &[2][..]));
        let b = (0..BUCKETS as usize).find(|&b| three[b] == 2 && two[b] == 0).unwrap() as u32;
        let (coming, kept) = (key_in(b..b + 1), key_in(0..1));
        assert!(inc.holds(false, 3, &[coming]) && !inc.holds(false, 3, &[kept]));
        assert!(inc.holds(true, 7, &[kept]) && !inc.holds(true, 6, &[kept]));
        assert!(still_incoming(&h, 0, &[]).is_none() && still_incoming(&h[..1], 0, &[2]).is_none());
    }

    #[test]
    fn a_request_for_keys_the_known_maps_give_elsewhere_waits_while_a_vote_is_open() {
        let h = vec![(0, buckets::initial_owners(2))];
        let theirs = key_in(BUCKETS / 2..BUCKETS);
        let g = SparseGuard { me: 0, mode: Consistency::Bsp, history: &h, hold: None, incoming: None, giving: false };
        let pull = SparseReq { push: false, seq: 4, keys: &[theirs] };
        assert_eq!(g.gate(pull), SparseGate::Foreign(theirs));
        let held = SparseGuard { hold: Some(6), ..g };
        assert_eq!(held.gate(pull), SparseGate::Hold);
        assert_eq!(held.gate(SparseReq { push: true, seq: 6, keys: &[] }), SparseGate::Hold);
        assert_eq!(held.gate(SparseReq { push: true, seq: 5, keys: &[] }), SparseGate::Go);
    }
}
