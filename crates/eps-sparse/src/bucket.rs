//! Keys to buckets: a key's bucket is the top bits of a 64-bit mix of it, so
//! any key space (ids hashed by the user or not, dense or clustered) spreads
//! evenly. Buckets are what servers own, split and move.

pub use eps_proto::buckets::{BUCKETS, bucket_of, initial_owners, mix};

/// Hashes a u64 key by [`mix`] alone: keys are spread well by it, and it
/// costs a few cycles where the standard library's keyed hash costs tens.
/// (Keys come from workers of the same job; a hostile one could only slow
/// its own tables down.)
#[derive(Clone, Copy, Debug, Default)]
pub struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = mix(self.0 ^ u64::from(*b));
        }
    }
    fn write_u64(&mut self, k: u64) {
        self.0 = mix(self.0 ^ k);
    }
}

/// A map by u64 key, hashed by [`KeyHasher`].
pub type KeyMap<V> = std::collections::HashMap<u64, V, std::hash::BuildHasherDefault<KeyHasher>>;

/// An empty [`KeyMap`] with room for `n` keys.
pub fn key_map<V>(n: usize) -> KeyMap<V> {
    KeyMap::with_capacity_and_hasher(n, Default::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_in_range_stable_and_even_for_consecutive_keys() {
        let mut count = vec![0u32; BUCKETS as usize];
        let n = 1u64 << 20;
        for k in 0..n {
            let b = bucket_of(k);
            assert!(b < BUCKETS);
            count[b as usize] += 1;
        }
        assert_eq!(bucket_of(12345), bucket_of(12345));
        // 256 keys a bucket on average: every bucket within a third of it.
        let mean = (n / BUCKETS as u64) as u32;
        assert!(count.iter().all(|&c| c > mean * 2 / 3 && c < mean * 4 / 3), "{:?}", (count.iter().min(), count.iter().max()));
    }
}
