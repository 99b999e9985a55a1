//! SSP/ASP checkpoints: cuts. Shards apply each worker's contribution as it
//! comes, so no version is common to all of them; a checkpoint at iteration
//! `t` saves each shard when it has applied exactly the contributions of
//! iterations before `t` of every worker. Until then it holds back those of
//! `t` and later (the worker's slot stays full, so it pushes this shard no
//! further: the wait is the slowest worker's catching up to `t`, which the
//! staleness bound keeps short), then saves a copy and applies them. Every
//! piece of the checkpoint then holds the same contributions, wherever the
//! shards are cut, and a resumed job starts every worker at `t`: none is lost
//! or applied twice.
//!
//! A shard that moves away before its cut gives the contributions it held back
//! to the move (they are relayed to the target, as updates parked then are).
//! A shard that already applied a contribution of `t` or later (it arrived by
//! a migration meanwhile) reports a miss: that checkpoint fails, and the next
//! one is taken.

use std::path::PathBuf;

use eps_fabric::Fabric;
use eps_proto::Consistency;

use crate::checkpoint::Piece;
use crate::{Pending, Server, ServerError};

impl<P: Fabric> Server<P> {
    /// The next cut of shard `id`, if one is due; the shard's last cut is
    /// set on first sight (the resumed iteration, or the clocks it arrived
    /// with).
    fn next_cut(&mut self, id: u32) -> Option<u64> {
        if self.mode == Consistency::Bsp {
            return None;
        }
        let h = self.shards.get(id as usize).and_then(Option::as_ref)?;
        let seen = h.core.sync.clocks().iter().max().copied().unwrap_or(0).saturating_sub(1);
        let after = *self.saver.cuts.entry(id).or_insert(seen.max(self.saver.start));
        self.saver.next_cut(after)
    }

    /// Shard `id` moves away: the contributions it held back for its cut
    /// wait as any parked update does (the move relays them to the target);
    /// its cut is the target's to take.
    pub(crate) fn unhold_for_move(&mut self, id: u32) {
        let Some(held) = self.saver.held.remove(&id) else { return };
        if let Some(h) = self.shards.get_mut(id as usize).and_then(Option::as_mut) {
            h.core.park_all(held.into_iter().map(|(w, iteration)| Pending::Update { iteration, one: Some(w) }));
        }
    }

    /// SSP/ASP: holds `worker`'s contribution of `iteration` back if shard
    /// `id` has not been saved for a cut at or before it. True if held.
    pub(crate) fn hold_for_cut(&mut self, id: u32, worker: u32, iteration: u64) -> Result<bool, ServerError> {
        let Some(t) = self.next_cut(id) else { return Ok(false) };
        let moving = self.shards[id as usize].as_ref().is_none_or(|h| h.out.is_some() || h.awaits_snapshot());
        if iteration < t || moving {
            return Ok(false);
        }
        self.saver.held.entry(id).or_default().push((worker, iteration));
        self.try_cut(id)?;
        Ok(true)
    }

    /// Saves shard `id` if its cut is whole (or reports it missed if passed),
    /// then applies what it held back.
    pub(crate) fn try_cut(&mut self, id: u32) -> Result<(), ServerError> {
        let Some(t) = self.next_cut(id) else { return Ok(()) };
        let Some(h) = self.shards.get(id as usize).and_then(Option::as_ref) else { return Ok(()) };
        if h.out.is_some() || h.awaits_snapshot() || h.core.parked_len() > 0 {
            return Ok(());
        }
        // Contributions applied, per worker: those received less those held.
        let held = self.saver.held.get(&id);
        let applied: Vec<u64> = h
            .core
            .sync
            .clocks()
            .iter()
            .enumerate()
            .map(|(w, &c)| c - held.map_or(0, |v| v.iter().filter(|(x, _)| *x as usize == w).count() as u64))
            .collect();
        let passed = applied.iter().any(|&c| c > t);
        if !passed && applied.iter().any(|&c| c < t) {
            return Ok(()); // a worker has not reached `t` here yet
        }
        let updates = h.core.sync.version();
        let values = if passed { None } else { self.mem.copy_state(id)? };
        let Some((start, len)) = self.mem.get(id).map(|b| (b.start, b.len)) else { return Ok(()) };
        if passed {
            eps_proto::say!(
                "eps server {}: shard {id} applied contributions of iteration {t} or later already: not in that checkpoint",
                self.rank
            );
        }
        let state_k = self.mem.state_k as u32;
        for dir in self.saver.due(t) {
            let values = values.clone();
            self.saver.send(Piece { version: t, updates, shard: id, start, len, state_k, dir, values });
        }
        self.saver.cuts.insert(id, t);
        self.release_held(id)
    }

    /// Applies the contributions shard `id` held back (a later cut may hold
    /// them again).
    fn release_held(&mut self, id: u32) -> Result<(), ServerError> {
        for (w, iteration) in self.saver.held.remove(&id).unwrap_or_default() {
            self.update(id, Pending::Update { iteration, one: Some(w) })?;
        }
        Ok(())
    }

    /// The control plane orders a checkpoint at iteration `t` into `dir`:
    /// shards cut past it already report a miss; the others are saved at
    /// their cut.
    pub(crate) fn on_cut_order(&mut self, t: u64, dir: &str) -> Result<(), ServerError> {
        self.saver.ordered.push((t, PathBuf::from(dir)));
        self.rows_order(t, dir)?;
        for id in self.mem.held().collect::<Vec<_>>() {
            // (The first sight of a shard sets its last cut.)
            let _ = self.next_cut(id);
            let Some(&last) = self.saver.cuts.get(&id) else { continue };
            if last >= t {
                self.report_missed(id, t, dir);
            } else {
                self.try_cut(id)?;
            }
        }
        Ok(())
    }
}
