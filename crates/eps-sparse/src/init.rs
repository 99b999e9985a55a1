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
                // A wyrand stream seeded by the table's seed and the key: two
                // 24-bit uniforms per 64-bit draw.
                let mut state = mix(seed ^ mix(key));
                let unit = |bits: u64| ((bits >> 8) & 0xFF_FFFF) as f32 / (1u32 << 24) as f32;
                for pair in row.chunks_mut(2) {
                    state = state.wrapping_add(0xa076_1d64_78bd_642f);
                    let t = u128::from(state) * u128::from(state ^ 0xe703_7ed1_a0b4_28db);
                    let r = (t >> 64) as u64 ^ t as u64;
                    for (x, bits) in pair.iter_mut().zip([r, r >> 32]) {
                        *x = (2.0 * unit(bits) - 1.0) * scale;
                    }
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
        Init::Zeros.fill(7, 42, &mut a);
        assert_eq!(a, [0.0; 16]);
    }
}
