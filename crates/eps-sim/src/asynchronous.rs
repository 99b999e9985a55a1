//! SSP and ASP jobs. A server applies each worker's contribution on its own
//! as it comes, so a unit's value is its initial value plus the digests
//! applied (wrapping sums: the order does not matter, each one does). The
//! world follows every (unit, version) with how many contributions of each
//! worker it holds, and checks:
//! - each update adds exactly the digest its worker pushed for that
//!   iteration, the worker's next one in order (nothing lost, nothing applied
//!   twice, nothing out of order);
//! - an SSP pull answer holds every worker's contributions up to the
//!   staleness bound the worker asked for;
//! - at the end, every worker's every contribution is in the last version.

use super::*;

impl World {
    /// Worker `r` pushes `digest` (per unit, from unit `first`) for iteration `t`.
    pub(crate) fn pushed_digest(&mut self, r: u32, first: usize, t: u64, digest: &[u64]) {
        for (u, &d) in (first..).zip(digest) {
            if let Some(old) = self.pushed.insert((r, u, t), d)
                && old != d
            {
                return self.fail(format!("worker {r} pushed iteration {t} of unit {u} twice, as {old:x} and {d:x}"));
            }
        }
    }

    /// A server applied worker `r`'s contribution of iteration `t`, `digest`,
    /// to version `v` of the units from `first`, making `value` (version `v + 1`).
    pub(crate) fn applied_one(&mut self, r: u32, first: usize, v: u64, t: u64, digest: &[u64], value: &[u64]) {
        let workers = self.workers0 as usize;
        for (i, u) in (first..first + value.len()).enumerate() {
            let clock = match (self.clocks.get(&(u, v)), v) {
                (Some(c), _) => c.clone(),
                (None, 0) => vec![0; workers],
                (None, _) => return self.fail(format!("an update of unit {u} at version {v}, which nobody published")),
            };
            if clock.get(r as usize) != Some(&t) {
                return self.fail(format!(
                    "worker {r}'s contribution of iteration {t} applied to unit {u} at version {v}, which holds {clock:?} of each worker's"
                ));
            }
            if self.pushed.get(&(r, u, t)) != Some(&digest[i]) {
                return self
                    .fail(format!("unit {u}: worker {r}'s contribution of iteration {t} applied is not the one it pushed"));
            }
            let Some(&old) = self.published.get(&(u, v)) else {
                return self.fail(format!("an update of unit {u} at version {v}, which nobody published"));
            };
            if value[i] != old.wrapping_add(digest[i]) {
                return self.fail(format!("unit {u}: version {} is not version {v} plus worker {r}'s contribution", v + 1));
            }
            let mut next = clock;
            next[r as usize] += 1;
            match self.clocks.get(&(u, v + 1)) {
                Some(c) if *c != next => {
                    return self.fail(format!("unit {u}: version {} holds {next:?} here, {c:?} elsewhere", v + 1));
                }
                _ => {
                    self.clocks.insert((u, v + 1), next);
                }
            }
        }
    }

    /// SSP: worker `r` asked for every worker's contributions before
    /// iteration `need` and got version `v` of the units `us`.
    pub(crate) fn check_stale(&mut self, r: u32, us: std::ops::Range<usize>, v: u64, need: u64) {
        for u in us {
            let slowest = match self.clocks.get(&(u, v)) {
                Some(c) => c.iter().copied().min().unwrap_or(0),
                None if v == 0 => 0,
                None => return self.fail(format!("worker {r} pulled unit {u} at version {v}, which nobody made")),
            };
            if slowest < need {
                return self.fail(format!(
                    "worker {r} pulled unit {u} at version {v}, holding {:?} of each worker's contributions: the staleness bound asks for {need}",
                    self.clocks.get(&(u, v))
                ));
            }
        }
    }

    /// The end of an SSP/ASP run: every worker trained to the last step and
    /// every contribution is in each unit's last version.
    pub(crate) fn check_end_async(&mut self) {
        let stuck = self.workers.values().flatten().any(|w| w.state != WState::Done);
        if stuck {
            let what = format!("no progress: the network fell silent\n{}", self.dump());
            return self.fail(what);
        }
        self.check_sparse_end_async();
        let last = self.steps * u64::from(self.workers0);
        let want = vec![self.steps; self.workers0 as usize];
        for u in 0..self.units {
            match self.clocks.get(&(u, last)) {
                Some(c) if *c == want => {}
                got => {
                    return self
                        .fail(format!("unit {u}'s version {last} holds {got:?} of each worker's contributions, not {want:?}"));
                }
            }
        }
    }
}
