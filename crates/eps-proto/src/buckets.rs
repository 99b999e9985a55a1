//! The bucket map of sparse tables: which server owns each of the
//! [`BUCKETS`] key-hash buckets, from which iteration on. Buckets are what a
//! scale event moves: the new map takes effect at a cutover iteration `T`
//! (pushes of `T` and later, and pulls of version `T` and later, go by it),
//! so the map is kept as a history of `(first iteration, owners)`.
//!
//! On the wire a map is its runs: `(first bucket, owner)` for each range of
//! buckets with one owner.

/// Buckets of every table (a power of two).
pub const BUCKETS: u32 = 4096;

/// A bijective 64-bit mix (the splitmix64 finalizer): nearby keys land far
/// apart.
pub fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The bucket of `key`, in `0..BUCKETS`: the top bits of its [`mix`], so
/// any key space (ids hashed by the user or not, dense or clustered)
/// spreads evenly.
pub fn bucket_of(key: u64) -> u32 {
    (mix(key) >> (64 - BUCKETS.trailing_zeros())) as u32
}

/// A bucket map as runs: `(first bucket, owner)`, by first bucket.
pub type Runs = Vec<(u32, u32)>;

/// The first placement of buckets on `servers` servers: contiguous ranges
/// of about equal size (bucket `b` on server `b * servers / BUCKETS`).
pub fn initial_owners(servers: u32) -> Vec<u32> {
    let s = servers.max(1) as u64;
    (0..BUCKETS as u64).map(|b| (b * s / BUCKETS as u64) as u32).collect()
}

/// `owners` (one per bucket) as runs.
pub fn runs(owners: &[u32]) -> Runs {
    let mut v: Runs = Vec::new();
    for (b, &o) in owners.iter().enumerate() {
        if v.last().is_none_or(|&(_, last)| last != o) {
            v.push((b as u32, o));
        }
    }
    v
}

/// One owner per bucket from `runs`; `None` unless they start at bucket 0
/// and their first buckets rise within range.
pub fn expand(runs: &[(u32, u32)]) -> Option<Vec<u32>> {
    if runs.first().is_none_or(|&(b, _)| b != 0) {
        return None;
    }
    let mut owners = Vec::with_capacity(BUCKETS as usize);
    for (i, &(b, o)) in runs.iter().enumerate() {
        let end = runs.get(i + 1).map_or(BUCKETS, |&(n, _)| n);
        if end <= b || end > BUCKETS {
            return None;
        }
        owners.extend(std::iter::repeat_n(o, (end - b) as usize));
    }
    Some(owners)
}

/// A new placement of the buckets on `servers` (sorted ranks): each gets
/// `BUCKETS / n` or one more, and as few buckets as that allows change
/// owner. A server over its share gives up its highest buckets; buckets of
/// servers not in `servers` go too; the ones given up go, lowest first, to
/// the servers under their share, by rank. The servers holding the most keep
/// the larger shares.
pub fn rebalance(owners: &[u32], servers: &[u32]) -> Vec<u32> {
    let mut owners = owners.to_vec();
    if servers.is_empty() {
        return owners;
    }
    let n = servers.len();
    let count = |owners: &[u32], s: u32| owners.iter().filter(|&&o| o == s).count();
    let mut by_size: Vec<(usize, u32)> = servers.iter().map(|&s| (count(&owners, s), s)).collect();
    by_size.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let (base, extra) = (BUCKETS as usize / n, BUCKETS as usize % n);
    let quota = |s: u32| base + usize::from(by_size.iter().position(|&(_, r)| r == s).is_some_and(|i| i < extra));
    let mut freed: Vec<usize> = (0..owners.len()).filter(|&b| !servers.contains(&owners[b])).collect();
    for &s in servers {
        let mine: Vec<usize> = (0..owners.len()).filter(|&b| owners[b] == s).collect();
        let q = quota(s);
        if mine.len() > q {
            freed.extend_from_slice(&mine[q..]);
        }
    }
    freed.sort_unstable();
    let mut freed = freed.into_iter();
    for &s in servers {
        let need = quota(s).saturating_sub(count(&owners, s));
        for b in freed.by_ref().take(need) {
            owners[b] = s;
        }
    }
    owners
}

/// The distinct `(from, to)` pairs of buckets that change owner from `old`
/// to `new`, sorted.
pub fn transfers(old: &[u32], new: &[u32]) -> Vec<(u32, u32)> {
    let mut v: Vec<(u32, u32)> = old.iter().zip(new).filter(|(a, b)| a != b).map(|(&a, &b)| (a, b)).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The owners at iteration `t` in a history of `(first iteration, owners)`
/// sorted by first iteration (the first entry if `t` precedes them all).
pub fn owners_at<O>(history: &[(u64, O)], t: u64) -> Option<&O> {
    history.iter().rev().find(|(at, _)| *at <= t).or(history.first()).map(|(_, o)| o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_round_trip_and_bad_runs_are_refused() {
        let o = initial_owners(3);
        assert_eq!(runs(&o), vec![(0, 0), (1366, 1), (2731, 2)]);
        assert_eq!(expand(&runs(&o)).as_deref(), Some(&o[..]));
        assert_eq!(expand(&[]), None);
        assert_eq!(expand(&[(1, 0)]), None);
        assert_eq!(expand(&[(0, 0), (0, 1)]), None);
        assert_eq!(expand(&[(0, 0), (BUCKETS + 1, 1)]), None);
    }

    #[test]
    fn rebalancing_moves_only_the_shares_and_balances() {
        let two = initial_owners(2);
        let three = rebalance(&two, &[0, 1, 2]);
        let count = |o: &[u32], s| o.iter().filter(|&&x| x == s).count();
        assert_eq!((count(&three, 0), count(&three, 1), count(&three, 2)), (1366, 1365, 1365));
        // Server 0 and 1 each keep their lowest buckets; only what server 2 gets moved.
        let moved = two.iter().zip(&three).filter(|(a, b)| a != b).count();
        assert_eq!(moved, 1365);
        assert!(two.iter().zip(&three).all(|(a, b)| a == b || *b == 2));
        assert_eq!(transfers(&two, &three), vec![(0, 2), (1, 2)]);
        // Back to two: server 2's buckets go, the others keep theirs.
        let back = rebalance(&three, &[0, 1]);
        assert_eq!((count(&back, 0), count(&back, 1), count(&back, 2)), (2048, 2048, 0));
        assert!(three.iter().zip(&back).all(|(a, b)| a == b || *a == 2));
        assert_eq!(rebalance(&back, &[0, 1]), back);
    }

    #[test]
    fn the_owners_of_an_iteration_come_from_the_entry_before_it() {
        let h = vec![(0u64, 'a'), (10, 'b'), (20, 'c')];
        assert_eq!(owners_at(&h, 0), Some(&'a'));
        assert_eq!(owners_at(&h, 9), Some(&'a'));
        assert_eq!(owners_at(&h, 10), Some(&'b'));
        assert_eq!(owners_at(&h, 25), Some(&'c'));
    }
}
