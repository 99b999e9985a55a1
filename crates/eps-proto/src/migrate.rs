//! The live migration of one shard from server A (source) to server B (target),
//! free of I/O. Version `v` is the shard after iterations `0..v`.
//!
//! 1. B registers memory for the shard.
//! 2. A sends B a snapshot (parameters and optimizer state) at version `v0`, then
//!    forwards every update it applies afterwards (the averaged gradient of each
//!    version), in order; B applies them with the same code, so it tracks A bitwise.
//! 3. The control plane announces a cutover iteration `T` in a new epoch: pushes of
//!    iterations `< T` go to A, of `>= T` to B. A serves pulls of versions `<= T`,
//!    B of versions `>= v0` it holds (it publishes `v0` from the snapshot), so some
//!    owner can always serve a pull. `T` is `v0` itself when A has nothing of
//!    iteration `v0` to apply yet (its held pushes go back to their workers), else
//!    `v0 + 1`.
//! 4. A releases the shard once B has acknowledged version `T` (a forward that is
//!    sent but not yet delivered still counts as A's to serve): B then serves `T`
//!    and everything after, so no pull needs A any more (a worker whose request
//!    reaches A later is answered "pull moved" and asks B).

use crate::sync::ShardSync;

/// A migration protocol violation (a bug or a misrouted message).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MigrateError {
    /// A forwarded update arrived out of order.
    #[error("forwarded version {got} arrived, expected {expected}")]
    Gap {
        /// What arrived.
        got: u64,
        /// What was expected.
        expected: u64,
    },
    /// The cutover must lie after what A has already applied.
    #[error("cutover at iteration {at} is not after version {version}")]
    LateCutover {
        /// Proposed iteration.
        at: u64,
        /// A's version.
        version: u64,
    },
    /// A push reached the server that does not own its iteration.
    #[error("iteration {iteration} belongs to the other side of the cutover")]
    Misrouted {
        /// The iteration.
        iteration: u64,
    },
}

/// Phases of the source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourcePhase {
    /// Forwarding every applied update; no cutover announced yet.
    Forwarding,
    /// Cutover at `at` announced; still forwarding up to version `at`.
    CuttingOver {
        /// The cutover iteration.
        at: u64,
    },
    /// Shard released: A no longer holds it.
    Released,
}

/// What the source must do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceAction {
    /// Send B the update that produced `version`.
    Forward {
        /// The version it produces.
        version: u64,
    },
    /// Free the shard's memory.
    Release,
}

/// The source side (A) of one shard's migration.
#[derive(Clone, Debug)]
pub struct Source {
    phase: SourcePhase,
    /// A's current version.
    version: u64,
    /// Highest version forwarded.
    forwarded: u64,
    /// Highest forwarded version B has acknowledged.
    acked: u64,
}

impl Source {
    /// Starts a migration at A's current version `v0`; the snapshot of `v0` goes to B.
    pub fn start(v0: u64) -> Self {
        Self { phase: SourcePhase::Forwarding, version: v0, forwarded: v0, acked: v0 }
    }

    /// Phase.
    pub fn phase(&self) -> SourcePhase {
        self.phase
    }

    /// A applied the update producing `version` (= previous + 1).
    pub fn on_applied(&mut self, version: u64) -> Option<SourceAction> {
        debug_assert!(version > self.version, "versions only move forward: {version} after {}", self.version);
        self.version = version;
        match self.phase {
            SourcePhase::Forwarding => {}
            SourcePhase::CuttingOver { at } if version <= at => {}
            _ => return None,
        }
        self.forwarded = version;
        Some(SourceAction::Forward { version })
    }

    /// The control plane announced the cutover iteration `at`. A cutover at the
    /// snapshot's own version (nothing to forward: B holds that version and serves
    /// it too) releases at once.
    pub fn announce(&mut self, at: u64) -> Result<Option<SourceAction>, MigrateError> {
        if at < self.version {
            return Err(MigrateError::LateCutover { at, version: self.version });
        }
        self.phase = SourcePhase::CuttingOver { at };
        Ok(self.try_release())
    }

    /// Whether A takes a push of `iteration`.
    pub fn accepts_push(&self, iteration: u64) -> Result<(), MigrateError> {
        match self.phase {
            SourcePhase::Forwarding => Ok(()),
            SourcePhase::CuttingOver { at } if iteration < at => Ok(()),
            SourcePhase::CuttingOver { at } if iteration == at && crate::mutants::active("source-takes-cutover-pushes") => Ok(()),
            _ => Err(MigrateError::Misrouted { iteration }),
        }
    }

    /// Whether A can answer a pull of `version` (once it holds it).
    pub fn serves(&self, version: u64) -> bool {
        match self.phase {
            SourcePhase::Forwarding => true,
            SourcePhase::CuttingOver { at } => version <= at,
            SourcePhase::Released => false,
        }
    }

    /// B acknowledged the forward producing `version` (its WRITE completed).
    pub fn on_forward_acked(&mut self, version: u64) -> Option<SourceAction> {
        self.acked = self.acked.max(version);
        self.try_release()
    }

    fn try_release(&mut self) -> Option<SourceAction> {
        if let SourcePhase::CuttingOver { at } = self.phase
            && self.forwarded >= at
            && self.acked >= at
        {
            self.phase = SourcePhase::Released;
            return Some(SourceAction::Release);
        }
        None
    }
}

/// What a migration target makes of a forward from its source, once the
/// snapshot landed (BSP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forwarded {
    /// The source cut over at the snapshot's version (a zero-length notice
    /// of that version): no forward follows, the target aggregates from here
    /// on.
    CutoverAtSnapshot,
    /// That notice, late: the target already aggregated the cutover
    /// iteration itself, every push of it having landed here (workers route
    /// by the new map) before the notice did. Nothing is left to do.
    LateNotice,
    /// Apply the source's update producing `version` (zero-length: an
    /// update without contributions).
    Apply {
        /// The version it produces.
        version: u64,
    },
    /// Not the version that comes next: the source broke the protocol.
    Unexpected {
        /// The version forwarded.
        version: u64,
        /// The one that comes next.
        expected: u64,
    },
}

/// Classifies a forward of `version` (`empty`: zero-length) arriving at a
/// target whose shard state is `sync`, with `queued` forwards waiting to be
/// applied. The server and the simulation both decide with it.
pub fn target_forward(sync: &ShardSync, queued: u64, version: u64, empty: bool) -> Forwarded {
    let expected = sync.version() + 1 + queued;
    if empty && queued == 0 && version == sync.version() {
        return Forwarded::CutoverAtSnapshot;
    }
    if empty
        && queued == 0
        && !sync.catching_up()
        && (sync.floor()..sync.version()).contains(&version)
        && !crate::mutants::active("late-cutover-notice")
    {
        return Forwarded::LateNotice;
    }
    if version != expected {
        return Forwarded::Unexpected { version, expected };
    }
    Forwarded::Apply { version }
}

/// The cutover iteration a source chooses once its snapshot of `version` landed
/// (BSP; no update ran meanwhile). When iteration `version` is complete here
/// (`complete`: every contribution in), there are two ways: apply it and forward
/// its f32 gradient (`version + 1`: the shard's f32 bytes on the wire, and an
/// update on each side in series), or give its `contributors` pushes back to
/// their workers, who push them again to the target (`version`: each pushes the
/// shard's wire bytes, in parallel, and the target applies the update alone). The
/// second is chosen while the pushes sent again carry at most twice the f32
/// bytes of a forward (one or two f32 workers, up to four of bf16/f16). An
/// incomplete iteration always cuts over at `version`.
pub fn cutover_at(version: u64, complete: bool, contributors: usize, wire_elem_bytes: u64) -> u64 {
    let push_again = contributors as u64 * wire_elem_bytes <= 2 * 4;
    if complete && !push_again { version + 1 } else { version }
}

/// The target side (B) of one shard's migration.
#[derive(Clone, Debug)]
pub struct Target {
    /// Version of the snapshot B started from.
    pub snapshot: u64,
    /// Version B holds.
    pub version: u64,
    /// Cutover iteration, once announced.
    pub at: Option<u64>,
}

impl Target {
    /// B received the snapshot of version `v0`.
    pub fn from_snapshot(v0: u64) -> Self {
        Self { snapshot: v0, version: v0, at: None }
    }

    /// B received the forwarded update producing `version`; it must be the next one.
    pub fn on_forward(&mut self, version: u64) -> Result<(), MigrateError> {
        if version != self.version + 1 {
            return Err(MigrateError::Gap { got: version, expected: self.version + 1 });
        }
        self.version = version;
        Ok(())
    }

    /// B applied its own update (iterations `>= at`) producing `version`.
    pub fn on_applied(&mut self, version: u64) {
        self.version = version;
    }

    /// Whether B takes a push of `iteration`: only at or after the cutover, and only
    /// once it holds the version that iteration starts from.
    pub fn accepts_push(&self, iteration: u64) -> Result<bool, MigrateError> {
        match self.at {
            Some(at) if iteration >= at => Ok(self.version >= iteration),
            _ => Err(MigrateError::Misrouted { iteration }),
        }
    }

    /// Whether B can answer a pull of `version` now.
    pub fn serves(&self, version: u64) -> bool {
        version >= self.snapshot && version <= self.version
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A target's view of its source's forwards: the notice of a cutover at
    /// the snapshot, the next version, a wrong one, and the notice arriving
    /// after the target aggregated the cutover iteration itself.
    #[test]
    fn a_target_classifies_forwards_and_a_late_notice_is_no_violation() {
        use crate::Consistency;
        use crate::sync::PushOutcome;
        let mut s = ShardSync::incoming(Consistency::Bsp, 2, 0);
        s.snapshot_landed(5);
        assert_eq!(target_forward(&s, 0, 5, true), Forwarded::CutoverAtSnapshot);
        assert_eq!(target_forward(&s, 0, 6, false), Forwarded::Apply { version: 6 });
        assert_eq!(target_forward(&s, 1, 7, true), Forwarded::Apply { version: 7 }, "an update without contributions");
        assert_eq!(target_forward(&s, 0, 7, false), Forwarded::Unexpected { version: 7, expected: 6 });
        // Every push of iteration 5 lands here before the notice: the target
        // aggregates it itself.
        assert_eq!(s.on_push(0, 5, &[0, 1]), Ok(PushOutcome::Wait));
        assert_eq!(s.on_push(1, 5, &[0, 1]), Ok(PushOutcome::AggregateAll { iteration: 5 }));
        assert_eq!(s.published(None), 6);
        assert!(!s.catching_up());
        assert_eq!(target_forward(&s, 0, 5, true), Forwarded::LateNotice);
        assert_eq!(target_forward(&s, 0, 4, true), Forwarded::Unexpected { version: 4, expected: 7 }, "below the snapshot");
    }

    #[test]
    fn the_cutover_forwards_only_when_pushing_again_costs_more() {
        assert_eq!(cutover_at(7, false, 8, 4), 7, "incomplete: always at the snapshot");
        assert_eq!(cutover_at(7, true, 1, 4), 7);
        assert_eq!(cutover_at(7, true, 2, 4), 7);
        assert_eq!(cutover_at(7, true, 3, 4), 8);
        assert_eq!(cutover_at(7, true, 4, 2), 7, "bf16: four workers push half the bytes");
        assert_eq!(cutover_at(7, true, 5, 2), 8);
        assert_eq!(cutover_at(7, true, 0, 4), 7, "an empty iteration is aggregated by the target");
    }
    use crate::init::mix;

    /// Parameters as a hash chain: version v+1 = H(version v, gradient of v). Equal
    /// chains mean bitwise-equal replay.
    fn step(p: u64, v: u64) -> u64 {
        mix(p ^ mix(v))
    }

    /// Random interleavings of A's updates, forwarding delays, the cutover
    /// announcement and pulls: every requested version is
    /// servable by some owner, B tracks A exactly, and A releases at the end.
    #[test]
    fn random_schedules_keep_every_version_servable() {
        for seed in 1..=300u64 {
            let mut r = seed;
            let mut rnd = |n: u64| {
                r = mix(r);
                r % n
            };
            let v0 = rnd(5);
            let mut a_params = 7u64;
            let mut chain = vec![a_params];
            for v in 0..v0 {
                a_params = step(a_params, v);
                chain.push(a_params);
            }
            let mut src = Source::start(v0);
            let mut dst = Target::from_snapshot(v0);
            let mut b_params = a_params;
            let mut in_flight: std::collections::VecDeque<u64> = Default::default();
            let mut a_version = v0;
            let mut announced = None;
            let mut released = false;
            let mut end = v0 + 10 + rnd(10);
            let mut iteration = v0; // next iteration whose update is produced
            for _ in 0..10_000 {
                // Pulls of every version up to the newest must be servable by someone.
                let newest = a_version.max(dst.version);
                for u in v0..=newest {
                    let by_a = !released && src.serves(u) && u <= a_version;
                    let by_b = dst.serves(u);
                    assert!(by_a || by_b, "seed {seed}: version {u} unservable (A at {a_version}, B at {})", dst.version);
                }
                if iteration == end && in_flight.is_empty() && released {
                    break;
                }
                match rnd(5) {
                    0 | 1 if iteration < end => {
                        // The next iteration's update, applied by its owner.
                        if src.accepts_push(iteration).is_ok() && iteration == a_version {
                            a_params = step(a_params, iteration);
                            chain.push(a_params);
                            a_version += 1;
                            iteration += 1;
                            if let Some(SourceAction::Forward { version }) = src.on_applied(a_version) {
                                in_flight.push_back(version);
                            }
                        } else if dst.accepts_push(iteration) == Ok(true) {
                            b_params = step(b_params, iteration);
                            chain.push(b_params);
                            iteration += 1;
                            dst.on_applied(iteration);
                        }
                    }
                    2 => {
                        if let Some(v) = in_flight.pop_front() {
                            dst.on_forward(v).unwrap();
                            b_params = step(b_params, v - 1);
                            assert_eq!(b_params, chain[v as usize], "seed {seed}: B diverged at {v}");
                            if src.on_forward_acked(v) == Some(SourceAction::Release) {
                                released = true;
                            }
                        }
                    }
                    3 if announced.is_none() => {
                        let at = a_version + rnd(3);
                        announced = Some(at);
                        // Training goes on at least to the cutover.
                        end = end.max(at + 1);
                        dst.at = Some(at);
                        if src.announce(at).unwrap() == Some(SourceAction::Release) {
                            released = true;
                        }
                    }
                    _ => {}
                }
                if !released && src.phase() == SourcePhase::Released {
                    released = true;
                }
            }
            assert!(released, "seed {seed}: A never released the shard");
            assert_eq!(src.phase(), SourcePhase::Released);
            assert!(dst.version >= announced.unwrap(), "seed {seed}: B holds the cutover version");
        }
    }

    /// Cut over at the snapshot's version: nothing to forward, released at once;
    /// at the version after, once B acknowledged it.
    #[test]
    fn a_cutover_releases_once_the_target_holds_its_version() {
        let mut src = Source::start(5);
        assert_eq!(src.announce(5), Ok(Some(SourceAction::Release)));
        assert!(!src.serves(6) && src.accepts_push(5).is_err());
        let mut src = Source::start(5);
        assert_eq!(src.announce(6), Ok(None));
        assert_eq!(src.on_applied(6), Some(SourceAction::Forward { version: 6 }));
        assert_eq!(src.on_forward_acked(6), Some(SourceAction::Release));
    }

    #[test]
    fn violations_are_reported() {
        let mut src = Source::start(5);
        src.on_applied(6);
        assert_eq!(src.announce(4), Err(MigrateError::LateCutover { at: 4, version: 6 }));
        src.announce(8).unwrap();
        assert_eq!(src.accepts_push(8), Err(MigrateError::Misrouted { iteration: 8 }));
        assert!(src.accepts_push(7).is_ok());
        let mut dst = Target::from_snapshot(5);
        assert_eq!(dst.on_forward(7), Err(MigrateError::Gap { got: 7, expected: 6 }));
        assert_eq!(dst.accepts_push(9), Err(MigrateError::Misrouted { iteration: 9 }));
        dst.at = Some(8);
        assert_eq!(dst.accepts_push(8), Ok(false), "B cannot take iteration 8 before holding version 8");
        assert_eq!(dst.accepts_push(3), Err(MigrateError::Misrouted { iteration: 3 }));
    }
}
