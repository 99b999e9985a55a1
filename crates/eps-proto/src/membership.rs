//! Worker membership over iterations, free of I/O. Workers join and leave at
//! iteration boundaries announced in advance, so the set of contributors of every
//! iteration is known to everyone before it starts: no gradient is lost or counted
//! twice and averaging divides by the right count. Data follows membership: the
//! training samples are dealt out in order, iteration by iteration, to that
//! iteration's contributors in rank order, so no sample is skipped or seen twice
//! whatever the changes.

use std::ops::Range;

/// A membership change that cannot be scheduled.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MembershipError {
    /// Changes must be announced for an iteration that has not started.
    #[error("a change at iteration {at} comes too late: iteration {current} is under way")]
    TooLate {
        /// Requested boundary.
        at: u64,
        /// Current iteration.
        current: u64,
    },
    /// An iteration needs at least one contributor.
    #[error("an iteration needs at least one worker")]
    Empty,
}

/// Contributor sets by iteration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Membership {
    /// `(first iteration, sorted worker ranks)`, by ascending first iteration.
    epochs: Vec<(u64, Vec<u32>)>,
}

impl Membership {
    /// `workers` contribute from iteration 0.
    pub fn new(mut workers: Vec<u32>) -> Result<Self, MembershipError> {
        if workers.is_empty() {
            return Err(MembershipError::Empty);
        }
        workers.sort_unstable();
        workers.dedup();
        Ok(Self { epochs: vec![(0, workers)] })
    }

    /// From iteration `at` on, `workers` contribute. `current` is the iteration now
    /// under way (changes apply at a boundary not yet reached).
    pub fn schedule(&mut self, at: u64, current: u64, mut workers: Vec<u32>) -> Result<(), MembershipError> {
        if at <= current {
            return Err(MembershipError::TooLate { at, current });
        }
        if workers.is_empty() {
            return Err(MembershipError::Empty);
        }
        workers.sort_unstable();
        workers.dedup();
        // A later announcement for the same or an earlier boundary replaces what
        // was planned from there on.
        self.epochs.retain(|(from, _)| *from < at);
        self.epochs.push((at, workers));
        Ok(())
    }

    /// Rebuilds a schedule from [`Membership::epochs`] (as it travels in maps and
    /// orders); `None` when it is not one (empty, unordered, or not from 0).
    pub fn from_epochs(epochs: Vec<(u64, Vec<u32>)>) -> Option<Self> {
        let ok = epochs.first().is_some_and(|(f, _)| *f == 0)
            && epochs.windows(2).all(|w| w[0].0 < w[1].0)
            && epochs.iter().all(|(_, set)| !set.is_empty() && set.windows(2).all(|p| p[0] < p[1]));
        ok.then_some(Self { epochs })
    }

    /// `(first iteration, sorted ranks)` of every change so far, oldest first.
    pub fn epochs(&self) -> &[(u64, Vec<u32>)] {
        &self.epochs
    }

    /// The contributors from the last announced change on.
    pub fn latest(&self) -> &[u32] {
        &self.epochs[self.epochs.len() - 1].1
    }

    /// The first iteration of the last run of epochs in which `worker`
    /// contributes without a break (where a worker that joined starts), if it
    /// contributes in the latest epoch.
    pub fn joined_at(&self, worker: u32) -> Option<u64> {
        let mut at = None;
        for (from, set) in &self.epochs {
            match (set.contains(&worker), at) {
                (true, None) => at = Some(*from),
                (false, _) => at = None,
                _ => {}
            }
        }
        at
    }

    /// The contributors of `iteration`, in rank order.
    pub fn contributors(&self, iteration: u64) -> &[u32] {
        let i = self.epochs.partition_point(|(from, _)| *from <= iteration);
        &self.epochs[i.saturating_sub(1)].1
    }

    /// Samples dealt out before `iteration` (each contributor takes `batch`);
    /// `None` when that passes 2^64 - 1 (a batch and an iteration from outside
    /// must not wrap the sample index).
    pub fn samples_before(&self, iteration: u64, batch: u64) -> Option<u64> {
        let mut total = 0u64;
        for (k, (from, set)) in self.epochs.iter().enumerate() {
            if *from >= iteration {
                break;
            }
            let until = self.epochs.get(k + 1).map_or(iteration, |(next, _)| (*next).min(iteration));
            let dealt = (until - from).checked_mul(set.len() as u64)?.checked_mul(batch)?;
            total = total.checked_add(dealt)?;
        }
        Some(total)
    }

    /// The schedule as `FIRST:R,R,...;FIRST:R,...` (no spaces, so it fits a
    /// `key=value` field, a JSON string and a TOML string).
    pub fn to_text(&self) -> String {
        let sets: Vec<String> = self
            .epochs
            .iter()
            .map(|(at, set)| format!("{at}:{}", set.iter().map(u32::to_string).collect::<Vec<_>>().join(",")))
            .collect();
        sets.join(";")
    }

    /// Parses [`Membership::to_text`]; `None` when it is not a schedule.
    pub fn parse_text(text: &str) -> Option<Self> {
        let mut epochs = Vec::new();
        for part in text.split(';') {
            let (at, set) = part.split_once(':')?;
            let set: Option<Vec<u32>> = set.split(',').map(|r| r.parse().ok()).collect();
            epochs.push((at.parse().ok()?, set?));
        }
        Self::from_epochs(epochs)
    }

    /// The schedule up to `iteration` (changes from it on dropped), then
    /// `workers` from `iteration` on unless they contribute there already: where
    /// a job resumed from a checkpoint at `iteration` goes on.
    pub fn resumed_at(&self, iteration: u64, mut workers: Vec<u32>) -> Self {
        workers.sort_unstable();
        workers.dedup();
        let mut epochs: Vec<(u64, Vec<u32>)> = self.epochs.iter().filter(|(at, _)| *at <= iteration).cloned().collect();
        if workers.is_empty() || self.contributors(iteration) == workers.as_slice() {
            return Self { epochs };
        }
        epochs.retain(|(at, _)| *at < iteration);
        epochs.push((iteration, workers));
        Self { epochs }
    }

    /// The samples `worker` trains on in `iteration`, or `None` if it does not
    /// contribute to it, or if the last sample's index would pass 2^64 - 1.
    pub fn samples(&self, iteration: u64, worker: u32, batch: u64) -> Option<Range<u64>> {
        let pos = self.contributors(iteration).iter().position(|&w| w == worker)? as u64;
        let first = self.samples_before(iteration, batch)?.checked_add(pos.checked_mul(batch)?)?;
        Some(first..first.checked_add(batch)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::mix;

    #[test]
    fn changes_apply_at_their_boundary() {
        let mut m = Membership::new(vec![1, 0]).unwrap();
        m.schedule(5, 2, vec![0, 1, 2]).unwrap();
        m.schedule(9, 3, vec![2]).unwrap();
        assert_eq!(m.contributors(4), &[0, 1]);
        assert_eq!(m.contributors(5), &[0, 1, 2]);
        assert_eq!(m.contributors(100), &[2]);
        assert_eq!(m.schedule(3, 3, vec![0]), Err(MembershipError::TooLate { at: 3, current: 3 }));
        assert_eq!(m.schedule(10, 3, vec![]), Err(MembershipError::Empty));
        assert_eq!(m.samples(0, 1, 10), Some(10..20));
        assert_eq!(m.samples(5, 2, 10), Some(5 * 2 * 10 + 20..5 * 2 * 10 + 30));
        assert_eq!(m.samples(9, 0, 10), None);
        // Past 2^64 samples: no range, never a wrapped one.
        assert_eq!(m.samples(9, 2, u64::MAX / 4), None);
        assert_eq!(m.samples_before(1 << 40, 1 << 30), None);
        assert_eq!(m.samples(0, 1, u64::MAX), None);
    }

    #[test]
    fn epochs_travel_and_joins_are_found() {
        let mut m = Membership::new(vec![0, 1]).unwrap();
        m.schedule(4, 0, vec![0, 1, 2]).unwrap();
        m.schedule(9, 5, vec![0, 2]).unwrap();
        m.schedule(12, 9, vec![0, 1, 2]).unwrap();
        assert_eq!(Membership::from_epochs(m.epochs().to_vec()), Some(m.clone()));
        assert_eq!(m.latest(), &[0, 1, 2]);
        assert_eq!(m.joined_at(0), Some(0));
        assert_eq!(m.joined_at(2), Some(4));
        assert_eq!(m.joined_at(1), Some(12), "left at 9, came back at 12");
        assert_eq!(m.joined_at(7), None);
        assert_eq!(Membership::from_epochs(vec![]), None);
        assert_eq!(Membership::from_epochs(vec![(1, vec![0])]), None);
        assert_eq!(Membership::from_epochs(vec![(0, vec![0]), (0, vec![1])]), None);
        assert_eq!(Membership::from_epochs(vec![(0, vec![1, 0])]), None);
        assert_eq!(Membership::from_epochs(vec![(0, vec![])]), None);
    }

    /// Random join/leave schedules: every sample index up to the end is dealt out
    /// exactly once, and only to that iteration's contributors.
    #[test]
    fn no_sample_is_skipped_or_seen_twice() {
        for seed in 1..=200u64 {
            let mut r = seed;
            let mut rnd = |n: u64| {
                r = mix(r);
                r % n
            };
            let mut m = Membership::new((0..1 + rnd(4) as u32).collect()).unwrap();
            let iterations = 40;
            for current in 0..iterations {
                if rnd(4) == 0 {
                    let set: Vec<u32> = (0..8).filter(|_| rnd(2) == 0).collect();
                    if !set.is_empty() {
                        m.schedule(current + 1 + rnd(3), current, set).unwrap();
                    }
                }
            }
            let batch = 1 + rnd(5);
            let mut seen = Vec::new();
            for it in 0..iterations {
                for w in 0..8u32 {
                    match m.samples(it, w, batch) {
                        Some(range) => {
                            assert!(m.contributors(it).contains(&w));
                            seen.extend(range);
                        }
                        None => assert!(!m.contributors(it).contains(&w)),
                    }
                }
            }
            seen.sort_unstable();
            let expected: Vec<u64> = (0..m.samples_before(iterations, batch).unwrap()).collect();
            assert_eq!(seen, expected, "seed {seed}");
        }
    }
}
