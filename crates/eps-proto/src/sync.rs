//! The consistency state machine of one shard on its server, free of I/O.
//!
//! Inputs are the immediates that arrive (pushes, pull requests) and the server's
//! own progress (an update applied and published, a pull's write completed); outputs
//! say what to do next (aggregate, apply, serve a pull). The server driver is a thin
//! loop around it.
//!
//! - BSP: the update of iteration `t` is the rank-ordered sum of every worker's
//!   contribution for `t`; it makes version `t + 1`. A worker pushes `t` only when it
//!   holds version `t`, and asks for version `t + 1` next.
//! - SSP / ASP: each contribution is applied as it arrives. Each worker's clock
//!   counts its contributions; a pull asks that the slowest clock be at least some
//!   value (SSP: the worker's iteration minus the staleness bound; ASP: zero).
//!
//! Published parameters have two buffers (versions alternate between them); a
//! version is published only when no pull is still being written from the buffer it
//! overwrites, so a pull never reads a half-applied update.

use std::borrow::Cow;

use crate::membership::Membership;
use crate::spec::Consistency;

/// What a push leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushOutcome {
    /// Recorded; more contributions are expected before anything is applied.
    Wait,
    /// BSP: every contribution of this iteration is in: aggregate all landing slots
    /// in rank order, then apply and publish (see [`ShardSync::published`]).
    AggregateAll {
        /// The iteration.
        iteration: u64,
    },
    /// SSP/ASP: apply this worker's contribution on its own.
    ApplyOne {
        /// The worker.
        worker: u32,
        /// Its iteration.
        iteration: u64,
    },
}

/// A protocol violation by a worker (the server reports it and keeps serving).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SyncError {
    /// Rank outside the job.
    #[error("worker {worker} is not a member of this job")]
    UnknownWorker {
        /// The rank.
        worker: u32,
    },
    /// A push for an iteration the shard has already moved past.
    #[error("worker {worker} pushed iteration {iteration}, but the shard is at iteration {expected}")]
    StaleIteration {
        /// The rank.
        worker: u32,
        /// What it pushed.
        iteration: u64,
        /// What was expected.
        expected: u64,
    },
    /// A push before the previous one from the same worker was consumed.
    #[error("worker {worker} pushed iteration {iteration} before its previous push was consumed")]
    SlotBusy {
        /// The rank.
        worker: u32,
        /// What it pushed.
        iteration: u64,
    },
    /// A push from a worker that is not a contributor of that iteration.
    #[error("worker {worker} is not a contributor of iteration {iteration}")]
    NotContributor {
        /// The rank.
        worker: u32,
        /// The iteration.
        iteration: u64,
    },
    /// A second pull while one is pending.
    #[error("worker {worker} asked for a pull while its previous pull is pending")]
    PullPending {
        /// The rank.
        worker: u32,
    },
}

/// Per-shard synchronization state.
#[derive(Clone, Debug)]
pub struct ShardSync {
    mode: Consistency,
    workers: u32,
    /// Published version (updates applied and visible).
    version: u64,
    /// Per worker: contributions received (its next iteration).
    clock: Vec<u64>,
    /// Per worker: its landing slot holds a contribution not yet consumed.
    slot_full: Vec<bool>,
    /// Contributions in slots (BSP: for iteration `version`).
    full_count: u32,
    /// Per worker: a pending pull's required minimum (BSP: version; else slowest clock).
    pending: Vec<Option<u64>>,
    /// Pull writes in flight per published buffer.
    inflight: [u32; 2],
    /// An update has been computed but waits for its buffer to be free.
    publish_waiting: bool,
    /// BSP migration target still replaying forwarded updates: pushes may be for a
    /// later iteration than the version (the cutover), and wait for it.
    catching_up: bool,
    /// Iteration of the contributions in slots (BSP).
    held: Option<u64>,
    /// Lowest version this shard can serve: a migration target serves its
    /// snapshot's version (published from the snapshot) and the versions after.
    floor: u64,
}

impl ShardSync {
    /// A shard at version 0 for `workers` workers.
    pub fn new(mode: Consistency, workers: u32) -> Self {
        let w = workers as usize;
        Self {
            mode,
            workers,
            version: 0,
            clock: vec![0; w],
            slot_full: vec![false; w],
            full_count: 0,
            pending: vec![None; w],
            inflight: [0; 2],
            publish_waiting: false,
            catching_up: false,
            held: None,
            floor: 0,
        }
    }

    /// A shard that starts at `version`, published already (a part of a split):
    /// it serves that version and the ones after, and aggregates iteration
    /// `version` next.
    pub fn at_version(mode: Consistency, workers: u32, version: u64) -> Self {
        let mut s = Self::new(mode, workers);
        s.version = version;
        s.floor = version;
        s
    }

    /// A shard arriving by migration at version `version` (a snapshot): BSP pushes
    /// of a later iteration (the cutover) are held until forwarded updates
    /// ([`ShardSync::forwarded`]) bring the version up to it.
    pub fn incoming(mode: Consistency, workers: u32, version: u64) -> Self {
        let mut s = Self::new(mode, workers);
        s.version = version;
        s.floor = version.max(1);
        s.catching_up = true;
        s
    }

    /// A backup that starts with its owner at `version` (the job's first
    /// iteration; the same initial or restored values): forwards bring it up,
    /// as they do a migration target, and it serves `version` too once
    /// promoted (a worker may still need it for its first pull).
    pub fn backup(mode: Consistency, workers: u32, version: u64) -> Self {
        let mut s = Self::incoming(mode, workers, version);
        s.floor = version;
        s
    }

    /// The snapshot of a migration target landed: the shard is at `version`,
    /// published from the snapshot (contributions already held stay). Pull
    /// requests waiting here for an earlier version are dropped and their workers
    /// returned: they routed with an old map and must ask the owner that serves
    /// that version. Then see [`ShardSync::ready_pulls`].
    pub fn snapshot_landed(&mut self, version: u64) -> Vec<u32> {
        self.version = version;
        self.floor = version;
        let mut moved = Vec::new();
        for (w, p) in self.pending.iter_mut().enumerate() {
            if p.is_some_and(|need| need < self.floor) {
                *p = None;
                moved.push(w as u32);
            }
        }
        self.debug_check();
        moved
    }

    /// SSP/ASP: the snapshot of a migration target landed, with the source's
    /// version and per-worker clocks (contributions received from each worker).
    /// The target serves from here on; the contributions the source takes after
    /// the snapshot come as forwards ([`ShardSync::forwarded_from`]).
    pub fn snapshot_landed_async(&mut self, version: u64, clocks: &[u64]) {
        assert_eq!(clocks.len(), self.clock.len(), "a snapshot carries a clock for every worker rank of the job");
        self.version = version;
        self.floor = 0;
        self.catching_up = false;
        for (c, &x) in self.clock.iter_mut().zip(clocks) {
            *c = x;
        }
    }

    /// An SSP/ASP shard resumed from a checkpoint cut at iteration `t`: it
    /// holds every worker's contributions before `t`, and no other.
    pub fn resumed_at(mut self, t: u64) -> Self {
        self.clock.iter_mut().for_each(|c| *c = t);
        if self.mode != Consistency::Bsp {
            // Pulls ask for clocks, not versions: any is served.
            self.floor = 0;
        }
        self
    }

    /// Per-worker clocks (contributions received from each worker).
    pub fn clocks(&self) -> &[u64] {
        &self.clock
    }

    /// SSP/ASP migration target: a contribution of `worker` that the source took
    /// was applied here (forwarded). Returns the new version.
    pub fn forwarded_from(&mut self, worker: u32) -> u64 {
        assert!((worker as usize) < self.clock.len(), "a contribution forwarded from worker {worker}, past the job's ranks");
        self.clock[worker as usize] += 1;
        self.version += 1;
        self.publish_waiting = false;
        self.debug_check();
        self.version
    }

    /// SSP/ASP migration source after its cutover: `worker`'s contribution left
    /// its slot (forwarded, not applied here); the slot is free again.
    pub fn consumed(&mut self, worker: u32) {
        if let Some(s) = self.slot_full.get_mut(worker as usize)
            && *s
        {
            *s = false;
            self.full_count -= 1;
        }
    }

    /// Drops every pull request waiting here and returns their workers (a source
    /// that stops serving at its cutover).
    pub fn refuse_all(&mut self) -> Vec<u32> {
        let out = (0..self.pending.len() as u32).filter(|&w| self.pending[w as usize].is_some()).collect();
        self.pending.iter_mut().for_each(|p| *p = None);
        out
    }

    /// Whether a pull of version `need` or later can be served here (see
    /// [`ShardSync::snapshot_landed`]).
    pub fn serves(&self, need: u64) -> bool {
        need >= self.floor
    }

    /// A migration target learns that its source cut over at the snapshot's
    /// version: no forward follows, this shard aggregates from that version on
    /// (an iteration without contributions included).
    pub fn caught_up(&mut self) {
        self.catching_up = false;
    }

    /// A forwarded update (applied by the migration source) has been applied and
    /// published here. Returns the new version; then see [`ShardSync::complete`].
    ///
    /// Contributions held for the iteration the forwarded update applied are
    /// in it already: their slots are freed. (A backup's owner, lost or cut
    /// off, forwarded it after workers routing by the map that promotes the
    /// backup pushed that iteration here again; a migration target never
    /// holds the iteration its source forwards.)
    pub fn forwarded(&mut self) -> u64 {
        if self.held == Some(self.version) {
            self.slot_full.iter_mut().for_each(|s| *s = false);
            self.full_count = 0;
            self.held = None;
        }
        self.version += 1;
        self.publish_waiting = false;
        self.debug_check();
        self.version
    }

    /// BSP: the iteration whose contributions are all in and can be aggregated now
    /// (the version has reached it), if any. An iteration whose every contributor
    /// was removed before pushing (`contributors` empty) is complete at once and
    /// aggregated empty: the parameters carry over to the next version. (Not on a
    /// migration target still replaying its source's updates: the source carries
    /// such an iteration and forwards it.)
    pub fn complete(&self, contributors: &[u32]) -> Option<u64> {
        if self.mode != Consistency::Bsp {
            return None;
        }
        if contributors.is_empty() {
            return (self.held.is_none() && !self.catching_up).then_some(self.version);
        }
        let t = self.held?;
        (t == self.version && self.full_count as usize == contributors.len()).then_some(t)
    }

    /// Lowest version this shard serves: a migration target's snapshot
    /// version, a split part's first version, else 0.
    pub fn floor(&self) -> u64 {
        self.floor
    }

    /// Whether a migration target still replays its source's updates (it
    /// stops when the source cuts over, or when it aggregates an iteration
    /// itself from pushes that all landed here).
    pub fn catching_up(&self) -> bool {
        self.catching_up
    }

    /// Published version.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Buffer (0 or 1) holding version `v`.
    pub fn parity(v: u64) -> usize {
        (v % 2) as usize
    }

    /// Slowest worker's clock.
    pub fn min_clock(&self) -> u64 {
        self.clock.iter().copied().min().unwrap_or(0)
    }

    fn check(&self, worker: u32) -> Result<usize, SyncError> {
        if worker >= self.workers {
            return Err(SyncError::UnknownWorker { worker });
        }
        Ok(worker as usize)
    }

    /// Worker `worker` pushed its contribution for `iteration` into its slot.
    /// `contributors` is that iteration's contributor set (see `Membership`): in BSP
    /// the update is ready once every one of them has pushed.
    pub fn on_push(&mut self, worker: u32, iteration: u64, contributors: &[u32]) -> Result<PushOutcome, SyncError> {
        self.record(worker, iteration, Some(contributors))
    }

    /// Its consistency model.
    pub fn mode(&self) -> Consistency {
        self.mode
    }

    /// BSP, while the contributor set of `iteration` is not settled yet (a
    /// membership change is being voted on): records the push; whether the
    /// iteration is complete is asked later with [`ShardSync::complete`].
    pub fn on_push_unsettled(&mut self, worker: u32, iteration: u64) -> Result<(), SyncError> {
        self.record(worker, iteration, None).map(|_| ())
    }

    /// The contributors of `iteration` on this shard: the committed set of `m`,
    /// less workers removed by lease expiry (`lost`: rank and the first iteration
    /// of the commit that removed it) whose contribution to an earlier iteration
    /// never arrived here. (A removed worker's push that did arrive counts: it may
    /// have reached some shards before the worker vanished.)
    pub fn contributors<'a>(&self, m: &'a Membership, lost: &[(u32, u64)], iteration: u64) -> Cow<'a, [u32]> {
        let base = m.contributors(iteration);
        // BSP's bits depend on summing in rank order.
        debug_assert!(base.windows(2).all(|w| w[0] < w[1]), "contributors of {iteration} out of rank order: {base:?}");
        let gone = |r: u32| {
            lost.iter().any(|&(x, at)| x == r && iteration < at)
                && !self.has_pushed(r)
                && !crate::mutants::active("expired-worker-still-awaited")
        };
        if lost.is_empty() || !base.iter().any(|&r| gone(r)) {
            return Cow::Borrowed(base);
        }
        Cow::Owned(base.iter().copied().filter(|&r| !gone(r)).collect())
    }

    /// BSP, a migration source cutting over at its current version: gives back
    /// the contributions held for it (their workers push them again to the new
    /// owner) and the pull requests waiting here (for a version this shard will not
    /// produce). Returns (workers whose push was held, workers whose pull waited).
    pub fn evict(&mut self) -> (Vec<u32>, Vec<u32>) {
        let held: Vec<u32> = (0..self.slot_full.len() as u32).filter(|&w| self.slot_full[w as usize]).collect();
        self.slot_full.iter_mut().for_each(|s| *s = false);
        self.full_count = 0;
        self.held = None;
        let waiting: Vec<u32> = (0..self.pending.len() as u32).filter(|&w| self.pending[w as usize].is_some()).collect();
        if crate::mutants::active("cutover-keeps-waiting-pulls") {
            return (held, Vec::new());
        }
        self.pending.iter_mut().for_each(|p| *p = None);
        (held, waiting)
    }

    /// Drops the pull requests waiting for a version after `v` (a migration
    /// source that will not produce it) and returns their workers.
    pub fn refuse_above(&mut self, v: u64) -> Vec<u32> {
        let mut out = Vec::new();
        for (w, p) in self.pending.iter_mut().enumerate() {
            if p.is_some_and(|need| need > v) {
                *p = None;
                out.push(w as u32);
            }
        }
        out
    }

    /// No contribution in, no pull waiting, no update waiting to publish.
    pub fn idle(&self) -> bool {
        self.full_count == 0 && self.pending.iter().all(Option::is_none) && !self.publish_waiting
    }

    /// Its state in a few words, for a stall report: the version, the
    /// workers whose contributions are in, the pulls waiting.
    pub fn describe(&self) -> String {
        let ins: Vec<u32> = (0..self.slot_full.len() as u32).filter(|&w| self.slot_full[w as usize]).collect();
        let pulls: Vec<String> =
            self.pending.iter().enumerate().filter_map(|(w, p)| p.map(|need| format!("{w}:{need}"))).collect();
        format!(
            "version {}{}, contributions in from {ins:?} (iteration {:?}), pulls waiting [{}]{}",
            self.version,
            if self.catching_up { " (catching up)" } else { "" },
            self.held,
            pulls.join(","),
            if self.publish_waiting { ", an update waits to publish" } else { "" }
        )
    }

    /// Whether `worker`'s landing slot holds a contribution not yet consumed.
    pub fn has_pushed(&self, worker: u32) -> bool {
        self.slot_full.get(worker as usize).copied().unwrap_or(false)
    }

    /// The state's invariants, checked after every change in debug builds:
    /// one clock, slot and pending pull per worker rank; the count of full
    /// slots is theirs; BSP holds contributions of the version or a later
    /// iteration (a target's cutover), never of one already aggregated; a
    /// BSP shard serves no version above its own.
    fn debug_check(&self) {
        let w = self.workers as usize;
        debug_assert!(self.clock.len() == w && self.slot_full.len() == w && self.pending.len() == w, "one entry per rank");
        debug_assert_eq!(self.full_count as usize, self.slot_full.iter().filter(|&&f| f).count(), "full slots counted");
        debug_assert!(self.held.is_none_or(|h| h >= self.version), "held {:?} at version {}", self.held, self.version);
        debug_assert!(self.mode != Consistency::Bsp || self.floor <= self.version.max(1), "floor above the version");
    }

    fn record(&mut self, worker: u32, iteration: u64, contributors: Option<&[u32]>) -> Result<PushOutcome, SyncError> {
        let w = self.check(worker)?;
        if self.slot_full[w] {
            return Err(SyncError::SlotBusy { worker, iteration });
        }
        if self.mode == Consistency::Bsp {
            // In BSP a worker's own clock does not matter (it may have joined late):
            // the iteration is the shard's, and only its contributors take part.
            let fits = if self.catching_up {
                iteration >= self.version && self.held.is_none_or(|h| h == iteration)
            } else {
                iteration == self.version
            };
            if !fits {
                let expected = self.held.unwrap_or(self.version);
                return Err(SyncError::StaleIteration { worker, iteration, expected });
            }
            if contributors.is_some_and(|c| !c.contains(&worker)) {
                return Err(SyncError::NotContributor { worker, iteration });
            }
        } else if iteration != self.clock[w] {
            return Err(SyncError::StaleIteration { worker, iteration, expected: self.clock[w] });
        }
        self.slot_full[w] = true;
        self.full_count += 1;
        self.clock[w] = iteration + 1;
        if self.mode == Consistency::Bsp {
            self.held = Some(iteration);
        }
        self.debug_check();
        Ok(match (self.mode, contributors) {
            (Consistency::Bsp, Some(c)) if self.full_count as usize == c.len() && iteration == self.version => {
                PushOutcome::AggregateAll { iteration }
            }
            (Consistency::Bsp, _) => PushOutcome::Wait,
            _ => PushOutcome::ApplyOne { worker, iteration },
        })
    }

    /// Whether the buffer the next version goes to has no pull in flight.
    pub fn can_publish(&self) -> bool {
        self.inflight[Self::parity(self.version + 1)] == 0
    }

    /// Marks that an update is computed but waits for [`ShardSync::can_publish`].
    pub fn set_publish_waiting(&mut self, waiting: bool) {
        self.publish_waiting = waiting;
    }

    /// Whether an update waits to be published.
    pub fn publish_waiting(&self) -> bool {
        self.publish_waiting
    }

    /// The update has been applied and written to buffer `parity(version + 1)`.
    /// Frees the consumed slots (BSP: all; else `worker`'s) and returns the new
    /// version. Call [`ShardSync::ready_pulls`] next.
    pub fn published(&mut self, consumed: Option<u32>) -> u64 {
        match consumed {
            None => {
                self.slot_full.iter_mut().for_each(|s| *s = false);
                self.full_count = 0;
                self.held = None;
                self.catching_up = false;
            }
            Some(w) => {
                if let Some(s) = self.slot_full.get_mut(w as usize)
                    && *s
                {
                    *s = false;
                    self.full_count -= 1;
                }
            }
        }
        self.version += 1;
        self.publish_waiting = false;
        self.debug_check();
        self.version
    }

    fn satisfied(&self, need: u64) -> bool {
        match self.mode {
            Consistency::Bsp => self.version >= need,
            _ if crate::mutants::active("ssp-pull-ignores-staleness") => true,
            _ => self.min_clock() >= need,
        }
    }

    /// Worker `worker` asks for the shard once `need` is met (BSP: version >= need;
    /// SSP/ASP: slowest clock >= need). Returns the version to send now, or `None` if
    /// the request waits.
    pub fn on_pull(&mut self, worker: u32, need: u64) -> Result<Option<u64>, SyncError> {
        let w = self.check(worker)?;
        if self.pending[w].is_some() {
            return Err(SyncError::PullPending { worker });
        }
        if self.satisfied(need) && !self.publish_waiting {
            return Ok(Some(self.start_pull()));
        }
        self.pending[w] = Some(need);
        Ok(None)
    }

    fn start_pull(&mut self) -> u64 {
        self.inflight[Self::parity(self.version)] += 1;
        self.version
    }

    /// Pending pulls that can be served now, as (worker, version); each is counted in
    /// flight until [`ShardSync::pull_written`].
    pub fn ready_pulls(&mut self, out: &mut Vec<(u32, u64)>) {
        if self.publish_waiting {
            return;
        }
        for w in 0..self.pending.len() {
            if let Some(need) = self.pending[w]
                && self.satisfied(need)
            {
                self.pending[w] = None;
                let v = self.start_pull();
                out.push((w as u32, v));
            }
        }
    }

    /// The write of version `v` to a worker completed (or failed).
    pub fn pull_written(&mut self, v: u64) {
        let p = Self::parity(v);
        self.inflight[p] = self.inflight[p].saturating_sub(1);
    }

    /// Forgets a worker's pending pull (its connection is gone).
    pub fn drop_pending(&mut self, worker: u32) {
        if let Some(p) = self.pending.get_mut(worker as usize) {
            *p = None;
        }
    }
}

#[cfg(test)]
mod tests;
