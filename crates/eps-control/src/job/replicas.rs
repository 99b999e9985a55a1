//! Replicas (`job.replicas = 2`): each shard's backup on another server, its
//! promotion when the owner is lost, new backups after a loss, and backups
//! around scale events.
//!
//! A shard that moves keeps its backup: the source forwards each update to
//! the backup, then to the target; the target forwards its own updates to the
//! same backup from the start (`Replicate` right after `MigrateIn`). So the
//! backup holds every version served by either owner, and a loss at any point
//! of the move loses nothing: the source lost before the target holds
//! everything, or the target lost after the cutover, and the backup is
//! promoted; the target lost before the cutover, and the source keeps the
//! shard.
//!
//! When the backup is on the move's target or on a server that leaves, the
//! owner first stops forwarding to it (`Unreplicate`, answered `Unreplicated`
//! once no forward or snapshot is in flight), the backup is dropped, and a new
//! one is built from the owner's snapshot (`AddBackup`) once the move is done;
//! backups of shards that stay, on a server that leaves, go the same way. In
//! that window the shard has no backup: a loss then takes it with it (the job
//! rolls back to its last checkpoint, or stops naming it).

use eps_proto::control::{ControlMsg, MigrationKeys, Order, Refusal, ShardEndpoint};
use eps_proto::shardmap::Move;

use super::{Job, Phase};

impl Job {
    /// A server holds a backup of a shard: its primary forwards to it once both
    /// are ready.
    pub(super) fn backup_ready(&mut self, e: &ShardEndpoint, keys: &MigrationKeys) -> Result<ControlMsg, Refusal> {
        let sid = e.shard as usize;
        if self.replicas < 2 || sid >= self.backups.len() || self.servers.get(e.owner as usize).is_none() {
            return Err(Refusal::stale(format!(
                "server {} reported a backup of shard {} the job does not keep",
                e.owner, e.shard
            )));
        }
        if self.moving(e.shard) {
            // A new backup ordered before the shard began to move: its drop was
            // ordered then (see `start_moves`); one follows the move.
            return Ok(ControlMsg::Ok);
        }
        self.backups[sid] = Some((e.owner, e.clone(), *keys));
        if self.endpoints[sid].is_some() {
            self.order_replicate(sid);
        }
        Ok(ControlMsg::Ok)
    }

    /// Orders shard `sid`'s owner to forward to its backup.
    pub(super) fn order_replicate(&mut self, sid: usize) {
        let (Some((to, _, keys)), Some(owner)) = (&self.backups[sid], &self.endpoints[sid]) else { return };
        let (to, keys, owner) = (*to, *keys, owner.owner);
        let to_addr = self.servers[to as usize].addr.clone();
        if !to_addr.is_empty() && to != owner {
            let snapshot = self.rebuilding[sid].take().is_some();
            self.unsynced[sid] |= snapshot;
            self.order(owner, Order::Replicate { shard: sid as u32, to, to_addr, keys, snapshot });
        }
    }

    /// Whether shard `id` is moving (a migration of it is in flight).
    pub(super) fn moving(&self, id: u32) -> bool {
        self.migrations.iter().any(|m| m.shard == id && m.in_flight())
    }

    /// Whether server `rank` keeps a backup of any shard, or is ordered to.
    pub(super) fn keeps_backups(&self, rank: u32) -> bool {
        self.backups.iter().flatten().any(|(b, _, _)| *b == rank) || self.rebuilding.contains(&Some(rank))
    }

    /// A move of shard `sid` from `owner` to `to` starts. Returns whether it
    /// waits for the owner's `Unreplicated` (its backup goes; see the
    /// module's doc).
    pub(super) fn unreplicate_for_move(&mut self, sid: usize, owner: u32, to: u32) -> bool {
        if let Some(c) = self.rebuilding.get_mut(sid).and_then(Option::take) {
            // A new backup ordered and not reported yet: dropped before any
            // later order to its server (which may be the move's target).
            self.order(c, Order::DropBackup { shard: sid as u32 });
        }
        let Some((c, _, _)) = self.backups.get(sid).and_then(Option::as_ref) else { return false };
        let kept = *c != to && self.servers.get(*c as usize).is_some_and(|s| !s.leaving);
        if !kept {
            self.order(owner, Order::Unreplicate { shard: sid as u32 });
        }
        !kept
    }

    /// The target of a move of shard `sid` forwards its own updates to the
    /// shard's backup from its first one.
    pub(super) fn replicate_from_target(&mut self, sid: usize, to: u32) {
        if let Some((c, _, keys)) = self.backups.get(sid).and_then(Option::as_ref) {
            let (c, keys) = (*c, *keys);
            let to_addr = self.servers[c as usize].addr.clone();
            self.order(to, Order::Replicate { shard: sid as u32, to: c, to_addr, keys, snapshot: false });
        }
    }

    /// Shard `shard`'s owner stopped forwarding to its backup: the backup is
    /// dropped, a move waiting for it starts, and backups are rebuilt where
    /// they are missing.
    pub(super) fn unreplicated(&mut self, shard: u32, rank: u32) -> Result<ControlMsg, Refusal> {
        let sid = shard as usize;
        let owner = self.map.index_of(shard).map(|i| self.map.shards[i].owner);
        if owner != Some(rank) {
            return Err(Refusal::stale(format!("server {rank} stopped replicating shard {shard}, which it does not own")));
        }
        self.unsynced[sid] = false;
        if let Some((b, _, _)) = self.backups[sid].take()
            && self.server_serving(b)
        {
            self.order(b, Order::DropBackup { shard });
        }
        if let Some(i) = self.migration(shard, Phase::Unreplicating) {
            self.migrations[i].phase = Phase::Preparing;
            self.order_migrate_in(i);
        }
        self.rebuild_backups();
        Ok(ControlMsg::Ok)
    }

    /// A server is lost: its shards' backups become their owners (a new
    /// epoch); shards without one are lost with it, and so are the shards
    /// of its moves that the other side cannot finish alone.
    pub(super) fn server_lost(&mut self, rank: u32) -> Result<ControlMsg, Refusal> {
        let was_lost = self.lost.contains(&rank);
        let Some(info) = self.servers.get_mut(rank as usize) else { return Err(Refusal::invalid(format!("no server {rank}"))) };
        if info.finished || was_lost {
            return Err(Refusal::stale(format!("server {rank} is not serving")));
        }
        if info.retired {
            // Told to retire (it holds nothing the job still needs) and gone
            // before it said it finished: it finished.
            info.finished = true;
            return Ok(ControlMsg::Ok);
        }
        info.retired = true;
        info.leaving = true;
        self.lost.push(rank);
        self.drop_orders_of(rank);
        let before: std::collections::HashMap<u32, u32> = self.map.shards.iter().map(|s| (s.id, s.owner)).collect();
        for k in 0..self.map.shards.len() {
            let (id, owner) = (self.map.shards[k].id, self.map.shards[k].owner);
            let sid = id as usize;
            if owner != rank {
                // A backup on the lost server is gone (its primary sees its
                // forwards fail and goes on alone).
                if self.backups[sid].as_ref().is_some_and(|(b, _, _)| *b == rank) {
                    self.backups[sid] = None;
                    self.unsynced[sid] = false;
                }
                if self.rebuilding[sid] == Some(rank) {
                    self.rebuilding[sid] = None;
                }
                continue;
            }
            // A backup still waiting for its snapshot holds nothing: the
            // shard is lost with its owner.
            let synced = !std::mem::take(&mut self.unsynced[sid]);
            if let Some((b, ep, _)) = self.backups[sid].take().filter(|_| synced) {
                self.promote(id, b, ep);
            }
        }
        self.cancel_moves_of(rank);
        // The servers whose backups were promoted.
        let mut heirs: Vec<u32> =
            self.map.shards.iter().filter(|s| before.get(&s.id).is_some_and(|&o| o != s.owner)).map(|s| s.owner).collect();
        heirs.sort_unstable();
        heirs.dedup();
        self.revote_after_loss(rank, &heirs);
        self.rows_lost(rank);
        self.map.servers.retain(|&s| s != rank);
        self.map.epoch += 1;
        self.rebuild_backups();
        self.move_leftovers();
        self.balance_next()?;
        Ok(ControlMsg::Ok)
    }

    /// Shard `id`'s backup on server `b` (endpoint `ep`) owns it from now on.
    fn promote(&mut self, id: u32, b: u32, ep: ShardEndpoint) {
        if let Some(k) = self.map.index_of(id) {
            self.map.shards[k].owner = b;
        }
        self.endpoints[id as usize] = Some(ep);
        self.previous[id as usize] = None;
        self.order(b, Order::Promote { shard: id });
    }

    /// Moves with lost server `rank` at one end stop. A source that keeps its
    /// shard (the target was lost before the cutover) keeps serving it; the
    /// target of a source lost after the cutover may miss forwards: the
    /// shard's backup, which has every version served, is promoted and the
    /// target drops its copy (without a backup, the shard is lost).
    fn cancel_moves_of(&mut self, rank: u32) {
        for i in 0..self.migrations.len() {
            let m = &self.migrations[i];
            if !m.in_flight() || (m.from != rank && m.to != rank) {
                continue;
            }
            let (shard, from, to, phase) = (m.shard, m.from, m.to, m.phase);
            self.migrations[i].phase = Phase::Cancelled;
            match phase {
                // The owner's backup was kept (promoted above if the owner
                // was lost); the target holds nothing yet.
                Phase::Unreplicating => {}
                Phase::Preparing | Phase::Copying if to == rank => {
                    // The source abandons the move when its writes fail, or
                    // when its cutover is refused.
                }
                Phase::Preparing | Phase::Copying => {
                    // The source (and the only copy) is gone; the target's
                    // empty copy goes too.
                    self.order(to, Order::DropBackup { shard });
                }
                Phase::CuttingOver { .. } if from == rank => {
                    let sid = shard as usize;
                    let synced = !self.unsynced[sid];
                    match self.backups[sid].take().filter(|(c, _, _)| synced && *c != to && self.server_serving(*c)) {
                        Some((c, ep, _)) => self.promote(shard, c, ep),
                        None => self.lost_moving.push((rank, shard)),
                    }
                    self.order(to, Order::DropBackup { shard });
                }
                // The target owned it alone (counted with its shards).
                Phase::CuttingOver { .. } | Phase::Done | Phase::Cancelled => {}
            }
            self.previous[shard as usize] = None;
        }
    }

    /// Shards left on servers that leave, with no move under way (one was
    /// cancelled): they move to the least loaded server that stays.
    pub(super) fn move_leftovers(&mut self) {
        let live = self.live_servers();
        if live.is_empty() {
            return;
        }
        let mut load = self.map.bytes_per_server();
        load.retain(|r, _| live.contains(r));
        for &r in &live {
            load.entry(r).or_insert(0);
        }
        let mut moves = Vec::new();
        for s in &self.map.shards {
            let leaving = self.servers.get(s.owner as usize).is_some_and(|x| x.leaving && !x.retired);
            if !leaving || self.moving(s.id) {
                continue;
            }
            let Some((&to, _)) = load.iter().min_by_key(|(r, b)| (**b, **r)) else { return };
            *load.entry(to).or_insert(0) += s.len * self.map.elem_bytes;
            moves.push(Move { start: s.start, len: s.len, from: s.owner, to });
        }
        self.start_moves(&moves);
    }

    /// Orders a new backup, on the next live server after its owner, for every
    /// shard that has none and is not moving (after a loss, a move, or a
    /// scale event that took its backup's server).
    pub(super) fn rebuild_backups(&mut self) {
        let live = self.live_servers();
        if self.replicas < 2 {
            return;
        }
        if live.len() < 2 {
            // No server to keep one: the owners serve alone (one still waiting
            // to hear of its backup would wait forever).
            for k in 0..self.map.shards.len() {
                let (id, owner) = (self.map.shards[k].id, self.map.shards[k].owner);
                let sid = id as usize;
                if self.backups[sid].is_none() && self.rebuilding[sid].is_none() && live.contains(&owner) && !self.moving(id) {
                    self.order(owner, Order::NoBackup { shard: id });
                }
            }
            return;
        }
        for k in 0..self.map.shards.len() {
            let (id, owner, start, len) = {
                let x = &self.map.shards[k];
                (x.id, x.owner, x.start, x.len)
            };
            let sid = id as usize;
            if self.backups[sid].is_some() || self.rebuilding[sid].is_some() || !live.contains(&owner) || self.moving(id) {
                continue;
            }
            // The next live server after the owner, but not one the shard
            // just left while workers may still push it there by an older
            // map (its landing slots are kept until none does): those pushes
            // would land in the new backup. If that leaves none, later
            // (`free_landings` tries again).
            let at = live.iter().position(|&r| r == owner).unwrap_or(0);
            let next = (1..live.len()).map(|k| live[(at + k) % live.len()]).find(|&r| !self.landing_kept(id, r));
            let Some(to) = next else { continue };
            self.rebuilding[sid] = Some(to);
            self.order(to, Order::AddBackup { shard: id, from: owner, start, len });
        }
    }

    /// Whether server `rank` keeps shard `id`'s landing slots after a move
    /// away (some worker may still push it there by an older map).
    fn landing_kept(&self, id: u32, rank: u32) -> bool {
        self.migrations.iter().any(|m| m.shard == id && m.from == rank && m.phase == Phase::Done && !m.landing_freed)
    }

    /// Scale-in: backups on servers that leave (of shards that stay) go, and
    /// are rebuilt on servers that stay.
    pub(super) fn unreplicate_leaving(&mut self, gone: &[u32]) {
        for k in 0..self.map.shards.len() {
            let (id, owner) = (self.map.shards[k].id, self.map.shards[k].owner);
            let sid = id as usize;
            if gone.contains(&owner) {
                continue; // it moves (see `start_moves`)
            }
            if let Some(c) = self.rebuilding[sid].filter(|c| gone.contains(c)) {
                self.rebuilding[sid] = None;
                self.order(c, Order::DropBackup { shard: id });
            }
            if self.backups[sid].as_ref().is_some_and(|(b, _, _)| gone.contains(b)) {
                self.order(owner, Order::Unreplicate { shard: id });
            }
        }
        self.rebuild_backups();
    }

    /// The status line on backups: how many shards one protects, and why the
    /// others have none now.
    pub(super) fn backups_status(&self, t: &mut String) {
        use std::fmt::Write as _;
        let n = self.map.shards.len();
        let ids = || self.map.shards.iter().map(|s| s.id as usize);
        let synced = ids().filter(|&i| self.backups[i].is_some() && !self.unsynced[i]).count();
        let syncing = ids().filter(|&i| self.backups[i].is_some() && self.unsynced[i]).count();
        let ordered = ids().filter(|&i| self.backups[i].is_none() && self.rebuilding[i].is_some()).count();
        let moving =
            ids().filter(|&i| self.backups[i].is_none() && self.rebuilding[i].is_none() && self.moving(i as u32)).count();
        let _ = writeln!(
            t,
            "backups: {synced} of {n} shards protected, {syncing} receiving their snapshot, {ordered} ordered, {moving} to follow a move, {} none",
            n - synced - syncing - ordered - moving
        );
    }

    /// Whether shards have backups (`job.replicas = 2`).
    pub fn replicated(&self) -> bool {
        self.replicas > 1
    }

    /// The shards that server `rank` owns with no backup that could be
    /// promoted now (none, one still waiting for its snapshot, or one on a
    /// server that is not serving), and the shards of moves from or to it:
    /// what losing it now would lose.
    pub fn unprotected_on(&self, rank: u32) -> Vec<u32> {
        let mut out: Vec<u32> = self
            .map
            .shards
            .iter()
            .filter(|s| s.owner == rank)
            .map(|s| s.id)
            .filter(|&id| {
                let sid = id as usize;
                let backup = self.backups.get(sid).and_then(Option::as_ref);
                self.unsynced.get(sid).is_none_or(|&u| u) || backup.is_none_or(|(b, _, _)| !self.server_serving(*b))
            })
            .collect();
        out.extend(self.migrations.iter().filter(|m| m.in_flight() && (m.from == rank || m.to == rank)).map(|m| m.shard));
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Servers lost so far.
    pub fn lost_servers(&self) -> &[u32] {
        &self.lost
    }
}

#[cfg(test)]
mod tests;
