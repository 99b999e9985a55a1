//! A worker's side of a sparse pull or push: a batch's keys deduplicated
//! (each row asked for once), split by the server that owns each key's bucket
//! (in first-seen order, so requests and sums are the same for the same
//! batch), and the rows that come back spread to every position that asked.

use crate::SparseError;
use crate::bucket::{BUCKETS, bucket_of};
use crate::index::KeyIndex;

/// A batch's distinct keys, and for each position of the batch which of
/// them it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dedup {
    /// Distinct keys, in first-seen order.
    pub keys: Vec<u64>,
    /// `keys[of[i]]` is the batch's key `i`.
    pub of: Vec<u32>,
}

/// Deduplicates `batch`.
pub fn dedup(batch: &[u64]) -> Dedup {
    let mut keys = Vec::new();
    let mut of = Vec::with_capacity(batch.len());
    KeyIndex::new().number(batch, |i, n, new| {
        if new {
            keys.push(batch[i]);
        }
        of.push(n);
    });
    Dedup { keys, of }
}

/// The keys one server is asked for, and where each sits among the distinct
/// keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// The server's rank.
    pub server: u32,
    /// Its keys, in first-seen order.
    pub keys: Vec<u64>,
    /// `keys[j]` is distinct key `at[j]`.
    pub at: Vec<u32>,
}

/// Splits distinct `keys` by the server that owns each one's bucket
/// (`owner[bucket]`, one entry per bucket), servers in rank order.
pub fn split_by_owner(keys: &[u64], owner: &[u32]) -> Result<Vec<Request>, SparseError> {
    if owner.len() != BUCKETS as usize {
        return Err(SparseError::Buckets(owner.len()));
    }
    let mut by: std::collections::BTreeMap<u32, Request> = std::collections::BTreeMap::new();
    for (i, &k) in keys.iter().enumerate() {
        let server = owner[bucket_of(k) as usize];
        let r = by.entry(server).or_insert_with(|| Request { server, keys: Vec::new(), at: Vec::new() });
        r.keys.push(k);
        r.at.push(i as u32);
    }
    Ok(by.into_values().collect())
}

/// Spreads the distinct keys' rows (`rows`, `dim` values each) to every
/// position of the batch (`out`, `of.len() * dim` values).
pub fn spread(d: &Dedup, rows: &[f32], dim: usize, out: &mut [f32]) {
    for (o, &u) in out.chunks_exact_mut(dim).zip(&d.of) {
        let u = u as usize;
        o.copy_from_slice(&rows[u * dim..(u + 1) * dim]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_asked_once_per_key_of_its_owner_and_spread_back() {
        let batch = [9u64, 4, 9, 1 << 40, 4, 4];
        let d = dedup(&batch);
        assert_eq!(d.keys, vec![9, 4, 1 << 40]);
        assert_eq!(d.of, vec![0, 1, 0, 2, 1, 1]);
        // Buckets alternate between servers 3 and 5.
        let owner: Vec<u32> = (0..BUCKETS).map(|b| if b % 2 == 0 { 3 } else { 5 }).collect();
        assert_eq!(split_by_owner(&d.keys, &owner[1..]).unwrap_err(), SparseError::Buckets(BUCKETS as usize - 1));
        let reqs = split_by_owner(&d.keys, &owner).unwrap();
        assert!(reqs.windows(2).all(|w| w[0].server < w[1].server));
        let mut seen: Vec<u32> = reqs.iter().flat_map(|r| r.at.clone()).collect();
        seen.sort_unstable();
        assert_eq!(seen, vec![0, 1, 2], "every distinct key asked once");
        for r in &reqs {
            for (k, &i) in r.keys.iter().zip(&r.at) {
                assert_eq!(*k, d.keys[i as usize]);
                assert_eq!(owner[bucket_of(*k) as usize], r.server);
            }
        }
        // Rows of 2 values, the key's index in both: spread to all 6 places.
        let rows = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5];
        let mut out = [0f32; 12];
        spread(&d, &rows, 2, &mut out);
        assert_eq!(out, [0.0, 0.5, 1.0, 1.5, 0.0, 0.5, 2.0, 2.5, 1.0, 1.5, 1.0, 1.5]);
    }
}
