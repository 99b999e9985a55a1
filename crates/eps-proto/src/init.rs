//! Deterministic initial parameters: a pure function of (seed, element index), so
//! every server initialises its shards, and a single-process reference the whole
//! model, to the same bits.

/// splitmix64.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform value in [-1, 1) from 24 random bits.
pub fn unit(h: u64) -> f32 {
    ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// Initial value of element `index`: uniform in [-0.01, 0.01).
pub fn param(seed: u64, index: u64) -> f32 {
    0.01 * unit(mix(seed ^ mix(index)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn deterministic_and_small() {
        assert_eq!(super::param(1, 5).to_bits(), super::param(1, 5).to_bits());
        assert_ne!(super::param(1, 5), super::param(2, 5));
        assert!((0..10_000).all(|i| super::param(3, i).abs() <= 0.01));
    }
}
