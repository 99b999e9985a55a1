//! Row initializers that depend on the table's seed, the key and the element
//! alone: the same row wherever and whenever it is created (after an
//! eviction, on another server after a move).

use crate::bucket::mix;

/// How a new row's values start.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// Uniform in `[-scale, scale)`.
    Uniform {
        /// Half the width of the range.
        scale: f32,
    },
}

impl Init {
    /// Fills `row`, the row of `key` in a table seeded `seed`.
    pub fn fill(&self, seed: u64, key: u64, row: &mut [f32]) {
        match *self {
            Init::Zeros => row.fill(0.0),
            Init::Uniform { scale } => {
                // Element `j` is a 32-bit hash of (row seed, j), each apart
                // from the others: a loop the compiler vectorizes.
                let base = mix(seed ^ mix(key));
                let (lo, hi) = (base as u32, (base >> 32) as u32);
                let step = 2.0 / (1u32 << 24) as f32;
                for (j, x) in row.iter_mut().enumerate() {
                    let mut h = (lo ^ (j as u32).wrapping_mul(0x9e37_79b9)).wrapping_add(hi);
                    h ^= h >> 16;
                    h = h.wrapping_mul(0x85eb_ca6b);
                    h ^= h >> 13;
                    h = h.wrapping_mul(0xc2b2_ae35);
                    h ^= h >> 16;
                    *x = ((h >> 8) as f32 * step - 1.0) * scale;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_depends_on_seed_and_key_alone_and_stays_in_range() {
        let init = Init::Uniform { scale: 0.05 };
        let (mut a, mut b, mut c, mut d) = ([0f32; 16], [0f32; 16], [0f32; 16], [0f32; 16]);
        init.fill(7, 42, &mut a);
        init.fill(7, 42, &mut b);
        init.fill(7, 43, &mut c);
        init.fill(8, 42, &mut d);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
        assert!(a.iter().chain(&c).all(|x| (-0.05..0.05).contains(x)), "{a:?}");
        // Not all alike within a row.
        assert!(a.iter().any(|x| *x != a[0]));
        // Spread over the range: the mean of many rows' values is near 0,
        // their mean square near scale^2 / 3 (a uniform's).
        let mut row = [0f32; 64];
        let (mut sum, mut sq, mut n) = (0f64, 0f64, 0f64);
        for key in 0..2000u64 {
            Init::Uniform { scale: 1.0 }.fill(3, key, &mut row);
            for &x in &row {
                (sum, sq, n) = (sum + f64::from(x), sq + f64::from(x * x), n + 1.0);
            }
        }
        assert!((sum / n).abs() < 0.01 && (sq / n - 1.0 / 3.0).abs() < 0.01, "mean {} mean square {}", sum / n, sq / n);
        Init::Zeros.fill(7, 42, &mut a);
        assert_eq!(a, [0.0; 16]);
    }
}
