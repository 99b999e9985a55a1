//! How long a waiting thread spins before it sleeps.
//!
//! A thread that waits for completions (a progress thread, a worker's round, a
//! server's loop) first polls, yielding the CPU between polls, then sleeps in
//! the kernel. Waking a sleeping thread costs tens of microseconds on virtual
//! machines, more than a small transfer; spinning costs a core that yields to
//! anything else that can run. [`Spin`] spins for at least a floor, and as long
//! as twice the recent gaps between bursts of work when those are short
//! enough (up to a cap) for spinning to catch the next one: a 4 MiB round's
//! gaps of a millisecond are spun through, a training step's 100 ms of
//! compute is not.

use std::time::{Duration, Instant};

/// Gaps shorter than this are within one burst of work, not between bursts.
const IN_BURST: Duration = Duration::from_micros(5);

/// The spin-then-sleep clock of one waiting thread.
#[derive(Clone, Debug)]
pub struct Spin {
    floor: Duration,
    cap: Duration,
    /// Moving average of the gaps between bursts, nanoseconds.
    gap_ns: f64,
    last: Instant,
}

impl Spin {
    /// Spins at least `floor` after work and, where the recent gaps between
    /// bursts are at most `cap`, twice those (up to `cap`). A zero floor
    /// never spins.
    pub fn new(floor: Duration, cap: Duration) -> Self {
        Self { floor, cap: cap.max(floor), gap_ns: 0.0, last: Instant::now() }
    }

    /// Work came now.
    pub fn worked(&mut self) {
        let now = Instant::now();
        let gap = now.duration_since(self.last);
        if gap > IN_BURST {
            // A quarter of each new gap: a few bursts set the pace, one odd
            // gap does not.
            self.gap_ns += (gap.as_nanos() as f64 - self.gap_ns) / 4.0;
        }
        self.last = now;
    }

    /// How long to spin after the last work.
    pub fn budget(&self) -> Duration {
        if self.floor.is_zero() {
            return Duration::ZERO;
        }
        let gap = Duration::from_nanos(self.gap_ns as u64);
        if gap > self.cap { self.floor } else { (gap * 2).clamp(self.floor, self.cap) }
    }

    /// Whether the thread should still spin (else sleep).
    pub fn spinning(&self) -> bool {
        self.last.elapsed() <= self.budget()
    }

    /// When the last work came.
    pub fn last(&self) -> Instant {
        self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fed(gaps_us: &[u64]) -> Spin {
        let mut s = Spin::new(Duration::from_micros(200), Duration::from_millis(2));
        for &g in gaps_us {
            s.last = Instant::now() - Duration::from_micros(g);
            s.worked();
        }
        s
    }

    #[test]
    fn the_budget_follows_short_gaps_and_ignores_long_ones() {
        assert_eq!(fed(&[]).budget(), Duration::from_micros(200), "no history: the floor");
        let b = fed(&[600; 12]).budget();
        assert!(b > Duration::from_micros(1000) && b <= Duration::from_micros(1200), "twice a 600 us gap: {b:?}");
        assert_eq!(fed(&[1500; 12]).budget(), Duration::from_millis(2), "capped");
        assert_eq!(fed(&[100_000; 12]).budget(), Duration::from_micros(200), "gaps past the cap: spinning would not catch them");
        assert_eq!(fed(&[30; 12]).budget(), Duration::from_micros(200), "never below the floor");
        // Gaps within a burst do not pull the average down.
        let mut s = fed(&[600; 12]);
        for _ in 0..100 {
            s.last = Instant::now();
            s.worked();
        }
        assert!(s.budget() > Duration::from_micros(1000), "{:?}", s.budget());
        assert_eq!(Spin::new(Duration::ZERO, Duration::from_millis(2)).budget(), Duration::ZERO);
    }
}
