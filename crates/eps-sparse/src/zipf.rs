//! Zipf-distributed ids, the skew of real embedding lookups: id `k` of
//! `0..n` drawn with probability proportional to `(k + 1)^-s`, in constant
//! time and memory whatever `n` (rejection-inversion sampling, Hörmann and
//! Derflinger 1996), from a seeded generator: the same seed gives the same
//! ids everywhere.

use crate::bucket::mix;

/// A seeded source of zipf-distributed ids.
#[derive(Clone, Debug)]
pub struct Zipf {
    n: f64,
    s: f64,
    h_x1: f64,
    h_n: f64,
    cut: f64,
    state: u64,
}

/// `(e^x - 1) / x`, exact near 0.
fn expm1_over(x: f64) -> f64 {
    if x.abs() > 1e-8 { x.exp_m1() / x } else { 1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + 0.25 * x)) }
}

/// `ln(1 + x) / x`, exact near 0.
fn ln1p_over(x: f64) -> f64 {
    if x.abs() > 1e-8 { x.ln_1p() / x } else { 1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x)) }
}

impl Zipf {
    /// Ids of `0..n` with exponent `s` (> 0), from `seed`; `None` for an
    /// empty range or an exponent that is not positive and finite.
    pub fn new(n: u64, s: f64, seed: u64) -> Option<Self> {
        if n == 0 || !(s.is_finite() && s > 0.0) {
            return None;
        }
        let mut z = Self { n: n as f64, s, h_x1: 0.0, h_n: 0.0, cut: 0.0, state: mix(seed ^ 0x5a17) };
        z.h_x1 = z.big_h(1.5) - 1.0;
        z.h_n = z.big_h(n as f64 + 0.5);
        z.cut = 2.0 - z.big_h_inv(z.big_h(2.5) - z.h(2.0));
        Some(z)
    }

    fn h(&self, x: f64) -> f64 {
        (-self.s * x.ln()).exp()
    }

    /// The integral of `h` from 1 to `x`, shifted: `(x^(1-s) - 1) / (1 - s)`.
    fn big_h(&self, x: f64) -> f64 {
        let l = x.ln();
        expm1_over((1.0 - self.s) * l) * l
    }

    fn big_h_inv(&self, y: f64) -> f64 {
        let t = (y * (1.0 - self.s)).max(-1.0);
        (ln1p_over(t) * y).exp()
    }

    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        (mix(self.state) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next id.
    pub fn next_id(&mut self) -> u64 {
        loop {
            let u = self.h_n + self.uniform() * (self.h_x1 - self.h_n);
            let x = self.big_h_inv(u);
            let k = x.round().clamp(1.0, self.n);
            if k - x <= self.cut || u >= self.big_h(k + 0.5) - self.h(k) {
                return k as u64 - 1;
            }
        }
    }

    /// `out` filled with ids.
    pub fn fill(&mut self, out: &mut [u64]) {
        out.iter_mut().for_each(|k| *k = self.next_id());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frequencies_follow_the_power_law_and_stay_in_range() {
        for (n, s) in [(1000u64, 1.05), (50, 0.8), (10, 1.0), (1 << 40, 1.2)] {
            let mut z = Zipf::new(n, s, 3).unwrap();
            let draws = 200_000;
            let mut counts = [0u32; 8];
            for _ in 0..draws {
                let k = z.next_id();
                assert!(k < n);
                if k < 8 {
                    counts[k as usize] += 1;
                }
            }
            if n <= 1000 {
                let norm: f64 = (1..=n).map(|k| (k as f64).powf(-s)).sum();
                for (k, &c) in counts.iter().enumerate().take(n.min(8) as usize) {
                    let want = draws as f64 * ((k + 1) as f64).powf(-s) / norm;
                    assert!(
                        (c as f64 - want).abs() < 5.0 * want.sqrt() + 5.0,
                        "n {n} s {s} id {k}: {c} drawn, {want:.0} expected"
                    );
                }
            }
            // Rank 2 against rank 1: 2^-s.
            let r = counts[1] as f64 / counts[0] as f64;
            assert!((r - 2f64.powf(-s)).abs() < 0.03, "n {n} s {s}: ratio {r}");
        }
        let (mut a, mut b) = (Zipf::new(100, 1.1, 9).unwrap(), Zipf::new(100, 1.1, 9).unwrap());
        assert!((0..100).all(|_| a.next_id() == b.next_id()), "the same seed, the same ids");
        assert!(Zipf::new(0, 1.0, 1).is_none() && Zipf::new(5, 0.0, 1).is_none() && Zipf::new(5, f64::NAN, 1).is_none());
    }
}
