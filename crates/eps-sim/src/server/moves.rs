//! Shards moving, as `eps-server` moves them: a migration's snapshot,
//! forwards and acknowledgements, the source's release, the control plane's
//! orders (moves, membership votes and commits, splits) and a split carried
//! out once its shard is free.

use eps_core::Notice;
use eps_proto::migrate::Forwarded;

use super::*;

impl SimServer {
    /// What arrives from a copy's source, decided as `eps-server` decides
    /// it (`eps_core::MoveIn::arrival`): `v` is a forward's version, `r` a
    /// relayed contribution's worker, `empty` a zero-length forward (the
    /// notice that no forward follows). None when it is ignored or refused
    /// (the refusal is a violation).
    fn arrival(&mut self, w: &mut World, from: Node, id: u32, v: u64, r: u32, empty: bool) -> Option<Arrival> {
        let Node::Server(sender) = from else {
            w.fail(format!("server {}: a copy of shard {id} sent by {from:?}", self.rank));
            return None;
        };
        let sh = self.shards.get(&id);
        let Some((copy, sh)) = sh.and_then(|sh| sh.incoming.as_ref().map(|m| (m, sh))) else {
            let promoted = sh.is_some_and(|sh| sh.replica.promoted() && !sh.replica.is_backup());
            if !eps_core::stray_forward_ignored(sh.is_some(), empty, promoted) {
                w.fail(format!("server {}: forward of shard {id}, which is not arriving here", self.rank));
            }
            return None;
        };
        Some(copy.arrival(&sh.core, &Notice { sender, version: v, empty, worker: r }, self.ranks))
    }

    pub(super) fn on_snapshot(&mut self, w: &mut World, from: Node, id: u32, v: u64, value: Vec<u64>, clocks: &[u64]) {
        let me = self.me();
        match self.arrival(w, from, id, v, 0, value.is_empty()) {
            Some(Arrival::Snapshot) => {}
            None | Some(Arrival::StaleNotice) => return,
            Some(a) => return w.fail(format!("server {}: snapshot of shard {id} taken as {a:?}", self.rank)),
        }
        let Some(sh) = self.shards.get_mut(&id) else { return };
        let Some(copy) = sh.incoming.as_mut() else { return };
        let moved = copy.land(&mut sh.core.sync, v, clocks, ());
        let first = sh.units().start;
        w.publish(self.rank, id, first, v, &value);
        sh.vals.insert(v, value);
        if sh.replica.is_backup()
            && let Err(e) = w.ctl(&ControlMsg::BackupSynced { shard: id, rank: self.rank })
        {
            return w.fail(format!("server {}: the control plane refused the snapshot of backup {id}: {e}", self.rank));
        }
        let Some(sh) = self.shards.get_mut(&id) else { return };
        for r in moved {
            w.send(me, Node::Worker(r), Msg::PullMoved { shard: id });
        }
        // The snapshot's version is published: pulls waiting for it are served.
        let mut ready = Vec::new();
        sh.core.sync.ready_pulls(&mut ready);
        for (r, v) in ready {
            self.send_pull(w, r, id, v);
        }
        self.try_complete(w, id);
    }

    pub(super) fn on_snapshot_done(&mut self, w: &mut World, id: u32) {
        let me = self.me();
        if self.mode != Consistency::Bsp {
            return self.cut_over_async(w, id);
        }
        let Some(sh) = self.shards.get_mut(&id) else { return };
        // The iteration after if its update is ready here, else this very version
        // (the held pushes and waiting pulls go back to their workers).
        let version = sh.core.sync.version();
        let at = sh.core.cutover_at(&self.members, 4);
        let (held, waiting) = sh.core.cut_over(at);
        let us = sh.units();
        for &r in &held {
            sh.landing[r as usize] = None;
            w.unaccept(r, us.clone(), version);
            self.answers.moved(r, id);
            w.send(me, Node::Worker(r), Msg::Moved { shard: id, t: version });
        }
        for &r in &waiting {
            self.answers.forget_moved(r, id);
            w.send(me, Node::Worker(r), Msg::PullMoved { shard: id });
        }
        let Some(out) = sh.out.as_mut() else { return };
        out.snapshot_written();
        if at == version {
            // The zero-length notice of the snapshot's version: no forward follows.
            w.send(me, Node::Server(out.to()), Msg::Forward { shard: id, v: version, digest: Vec::new() });
        }
        let action = match out.announce(at) {
            Ok(a) => a,
            Err(e) => return w.fail(format!("server {}: cutover of shard {id}: {e}", self.rank)),
        };
        if let Err(e) = w.ctl(&ControlMsg::Cutover { shard: id, at }) {
            return w.fail(format!("server {}: the control plane refused the cutover of shard {id} at {at}: {e}", self.rank));
        }
        if action == Some(SourceAction::Release) {
            return self.release(w, id);
        }
        self.drain(w, id);
    }

    /// A forward from the source of a shard arriving here, decided as
    /// `eps-server` decides it (`eps_proto::migrate::target_forward`). An
    /// empty digest is the zero-length notice that no forward follows.
    pub(super) fn on_forward(&mut self, w: &mut World, from: Node, id: u32, v: u64, digest: Vec<u64>) {
        let f = match self.arrival(w, from, id, v, 0, digest.is_empty()) {
            Some(Arrival::Forward(f)) => f,
            None => return,
            Some(a) => return w.fail(format!("server {}: forward of version {v} of shard {id} taken as {a:?}", self.rank)),
        };
        let Some(sh) = self.shards.get_mut(&id) else { return };
        match f {
            Forwarded::CutoverAtSnapshot => {
                sh.core.sync.caught_up();
                self.try_complete(w, id);
            }
            Forwarded::LateNotice => {}
            Forwarded::Unexpected { version, expected } => {
                w.fail(format!("server {}: forwarded version {version} of shard {id}, expected {expected}", self.rank))
            }
            Forwarded::Apply { .. } if digest.is_empty() => {
                w.fail(format!("server {}: a zero-length forward of version {v} of shard {id}", self.rank))
            }
            Forwarded::Apply { version } => {
                sh.forwards.insert(version, digest);
                self.update(w, id, Pending::Forward { version, carry: false, worker: None })
            }
        }
    }

    pub(super) fn on_ack(&mut self, w: &mut World, id: u32, v: u64) {
        let Some(out) = self.shards.get_mut(&id).and_then(|sh| sh.out.as_mut()) else { return };
        if out.relaying() {
            return self.relay_acked(w, id);
        }
        match out.acked(v) {
            Ok(true) => self.release(w, id),
            Ok(false) => self.drain(w, id),
            Err(e) => w.fail(format!("server {}: shard {id}: {e}", self.rank)),
        }
    }

    pub(super) fn release(&mut self, w: &mut World, id: u32) {
        self.shards.remove(&id);
        *self.released.entry(id).or_insert(0) += 1;
        w.migrations += 1;
        if let Err(e) = w.ctl(&ControlMsg::Released { shard: id, bytes: 0, millis: 0 }) {
            w.fail(format!("server {}: the control plane refused the release of shard {id}: {e}", self.rank));
        }
    }

    pub(super) fn on_order(&mut self, w: &mut World, o: Order) {
        let rank = self.rank;
        match o {
            Order::MigrateIn { shard, from, start, len } => {
                if self.shards.contains_key(&shard) {
                    return w.fail(format!("server {rank}: ordered to receive shard {shard}, which it holds"));
                }
                let mut sh = Shard::new((start, len), ShardSync::incoming(self.mode, self.ranks, 0), self.ranks);
                sh.incoming = Some(MoveIn::new(from));
                self.shards.insert(shard, sh);
                let keys = MigrationKeys { state_addr: 0, state_rkey: 0, grad_addr: 0, grad_rkey: 0 };
                if let Err(e) = w.ctl(&ControlMsg::ShardReady { endpoint: endpoint(shard, rank), keys }) {
                    w.fail(format!("server {rank}: shard {shard} ready refused: {e}"));
                }
            }
            Order::MigrateOut { shard, to, .. } => {
                let me = self.me();
                let Some(sh) = self.shards.get_mut(&shard) else {
                    return w.fail(format!("server {rank}: ordered to send shard {shard}, which it does not hold"));
                };
                let v0 = sh.core.sync.version();
                let Some(value) = sh.vals.get(&v0).cloned() else {
                    return w.fail(format!("server {rank}: shard {shard} has no value at version {v0}"));
                };
                if sh.replica.is_awaited() {
                    // `migrate_out`: its backup was never reported.
                    sh.replica.stop();
                }
                let clocks = sh.core.snapshot_clocks();
                sh.out = Some(MoveOut::new(v0, to));
                let at = w.send(me, Node::Server(to), Msg::Snapshot { shard, v: v0, value, clocks });
                w.complete_after(me, Msg::SnapshotDone { shard }, at);
            }
            Order::Split { shard, mid, lo, hi } => {
                let Some(sh) = self.shards.get(&shard) else {
                    return w.fail(format!("server {rank}: ordered to split shard {shard}, which it does not hold"));
                };
                let busy = sh.out.is_some() || sh.split.is_some();
                let taken = |p: u32| self.shards.contains_key(&p);
                let order = match eps_core::Split::order(self.mode, shard, sh.span, (mid, lo, hi), taken, busy) {
                    Ok(o) => o,
                    Err(e) => {
                        return w.fail(format!("server {rank}: cannot split shard {shard} at {mid}: {e} ({})", self.describe()));
                    }
                };
                if let Some(sh) = self.shards.get_mut(&shard) {
                    sh.split = Some(order);
                }
                self.try_split(w, shard);
            }
            Order::Release { shard } => self.on_release_order(w, shard),
            // The simulation takes no checkpoints (nothing orders one).
            Order::Checkpoint { version, .. } => w.fail(format!("server {rank}: ordered a checkpoint at {version}")),
            // The simulation runs tables without replicas (nothing orders this).
            Order::BackupRows { .. } => w.fail(format!("server {rank}: ordered to back its table rows up")),
            Order::StandIn { from, .. } => w.fail(format!("server {rank}: ordered to stand in for server {from}'s table rows")),
            Order::Buckets { at, runs } => self.on_buckets(w, at, &runs),
            Order::FetchRows { from, .. } => self.on_fetch_rows(w, from),
            Order::FreeRows { to } => self.on_free_rows(w, to),
            Order::Replicate { shard, to, snapshot, .. } => self.on_replicate(w, shard, to, snapshot),
            Order::AddBackup { shard, from, start, len } => self.on_add_backup(w, shard, from, start, len),
            Order::Promote { shard } => self.on_promote(w, shard),
            Order::Unreplicate { shard } => self.on_unreplicate(w, shard),
            Order::DropBackup { shard } => self.on_drop_backup(w, shard),
            Order::NoBackup { shard } => self.on_no_backup(w, shard),
            Order::FreeLanding { shard } => {
                // The landing slots of the oldest copy that left go. Pushes in
                // flight may be for a newer copy (one released since, or held):
                // with none, none may be in flight.
                let left = self.released.get(&shard).copied().unwrap_or(0);
                if left == 0 {
                    return w.fail(format!("server {rank}: told to free shard {shard}'s landing slots, none kept"));
                }
                self.released.insert(shard, left - 1);
                let pushes = w.pushes_in_flight(rank, shard);
                if left == 1 && !self.shards.contains_key(&shard) && pushes > 0 {
                    w.fail(format!(
                        "server {rank}: told to free shard {shard}'s landing slots with {pushes} pushes of it in flight"
                    ));
                }
            }
            Order::Retire => {
                self.retired = true;
                w.check_retired(rank);
                w.rows_exit(rank);
                // `eps-server`: it says it finished as it exits.
                if let Err(e) = w.ctl(&ControlMsg::Finished { role: Role::Server, rank }) {
                    w.fail(format!("server {rank}: its finish was refused: {e}"));
                }
            }
            Order::Propose { id } => {
                let dense = self.shards.values().map(|sh| Members::reach(self.mode, &sh.core.sync));
                let sparse = self.table.iter().map(|tb| Members::reach(self.mode, tb.sync()));
                let top = dense.chain(sparse).max();
                let hold = self.members.propose(top.unwrap_or(0));
                if let Err(e) = w.ctl(&ControlMsg::Vote { role: Role::Server, rank, id, hold }) {
                    w.fail(format!("server {rank}: vote refused: {e}"));
                }
            }
            Order::Members { at, workers, expired } => {
                if let Err(e) = self.members.commit(at, workers, &expired, self.ranks) {
                    return w.fail(format!("server {rank}: membership: {e}"));
                }
                for r in expired {
                    w.lost.insert((r, at));
                    self.drop_conn(w, r);
                }
                let ids: Vec<u32> = self.shards.keys().copied().collect();
                for id in ids {
                    self.try_complete(w, id);
                }
                self.sparse_complete(w);
                // And the sparse requests the vote held.
                self.replay_sparse(w);
            }
        }
    }

    /// `Server::try_split`: splits shard `id` once a split is ordered and no update
    /// is parked; its held pushes are answered "moved", its waiting pulls "pull
    /// moved", and the parts serve its version.
    pub(super) fn try_split(&mut self, w: &mut World, id: u32) {
        let me = self.me();
        let rank = self.rank;
        let Some(sh) = self.shards.get(&id) else { return };
        let Some(o) = sh.split else { return };
        if !eps_core::Split::ready(&sh.core, sh.out.is_some(), false) {
            return;
        }
        let Some(mut parent) = self.shards.remove(&id) else { return };
        let v = parent.core.sync.version();
        let Some(value) = parent.vals.get(&v).cloned() else {
            return w.fail(format!("server {rank}: shard {id} has no value for its version {v}"));
        };
        let parts = o.carry_out(&mut parent.core, parent.span, self.ranks);
        let cut = ((o.mid - parent.span.0) / crate::UNIT) as usize;
        for ((pid, span, core), vals) in [(parts.lo, &value[..cut]), (parts.hi, &value[cut..])] {
            let mut part = Shard::with_core(span, core, self.ranks);
            part.vals.insert(v, vals.to_vec());
            w.publish(rank, pid, part.units().start, v, vals);
            self.shards.insert(pid, part);
        }
        let (held, waiting) = (parts.held, parts.waiting);
        let (lo, hi) = (o.lo, o.hi);
        for &r in &held {
            w.unaccept(r, parent.units(), v);
            self.answers.moved(r, id);
            w.send(me, Node::Worker(r), Msg::Moved { shard: id, t: v });
        }
        for &r in &waiting {
            self.answers.forget_moved(r, id);
            w.send(me, Node::Worker(r), Msg::PullMoved { shard: id });
        }
        w.splits += 1;
        let (el, eh) = (endpoint(lo, rank), endpoint(hi, rank));
        if let Err(e) = w.ctl(&ControlMsg::Split { shard: id, at: v, lo: el, hi: eh }) {
            return w.fail(format!("server {rank}: the control plane refused the split of shard {id}: {e}"));
        }
        self.try_complete(w, lo);
        self.try_complete(w, hi);
    }
}

/// SSP/ASP migrations: the source's relay after its cutover (`eps_core::Relay`).
impl SimServer {
    /// The snapshot of an SSP/ASP shard landed: the source stops applying,
    /// relays what it parked, refuses the waiting pulls, reports the cutover.
    pub(super) fn cut_over_async(&mut self, w: &mut World, id: u32) {
        let me = self.me();
        let Some(sh) = self.shards.get_mut(&id) else { return };
        let (relay, refused) = sh.core.cut_over_async();
        let Some(out) = sh.out.as_mut() else { return };
        out.relay_from(relay);
        for r in refused {
            self.answers.forget_moved(r, id);
            w.send(me, Node::Worker(r), Msg::PullMoved { shard: id });
        }
        if let Err(e) = w.ctl(&ControlMsg::Cutover { shard: id, at: 0 }) {
            return w.fail(format!("server {}: the control plane refused the cutover of shard {id}: {e}", self.rank));
        }
        self.pump(w, id);
    }

    /// Sends the next queued contribution to the target, or releases the shard.
    pub(super) fn pump(&mut self, w: &mut World, id: u32) {
        let (me, rank) = (self.me(), self.rank);
        let Some(sh) = self.shards.get_mut(&id) else { return };
        let Some(out) = sh.out.as_mut() else { return };
        let Some(relay) = out.relay() else { return };
        match relay.step() {
            RelayStep::Idle => {}
            RelayStep::Release => self.release(w, id),
            RelayStep::Send(r) => {
                let Some((t, digest)) = sh.landing[r as usize].clone() else {
                    return w.fail(format!("server {rank}: relays worker {r}'s contribution to shard {id}, not in its slot"));
                };
                out.relay_sent();
                w.send(me, Node::Server(out.to()), Msg::Relayed { shard: id, w: r, t, digest });
            }
        }
    }

    /// The target applied the relayed contribution: its slot is free and its
    /// worker gets the credit.
    pub(super) fn relay_acked(&mut self, w: &mut World, id: u32) {
        let me = self.me();
        let Some(sh) = self.shards.get_mut(&id) else { return };
        let Some(out) = sh.out.as_mut() else { return };
        let Some(r) = out.relay_acked() else {
            return w.fail(format!("server {}: an acknowledgement of shard {id} with nothing relayed", self.rank));
        };
        sh.core.sync.consumed(r);
        sh.landing[r as usize] = None;
        if !self.dead.contains(&r) {
            w.send(me, Node::Worker(r), Msg::Credit { shard: id });
        }
        self.pump(w, id);
    }

    /// `Order::Release`: every worker routes the shard to its target now.
    pub(super) fn on_release_order(&mut self, w: &mut World, id: u32) {
        let relay = self.shards.get_mut(&id).and_then(|sh| sh.out.as_mut()).and_then(MoveOut::relay);
        let Some(relay) = relay else {
            return w.fail(format!("server {}: ordered to release shard {id}, which is not relaying", self.rank));
        };
        relay.release_ordered();
        self.pump(w, id);
    }

    /// A contribution relayed by the shard's source after its cutover.
    pub(super) fn on_relayed(&mut self, w: &mut World, from: Node, id: u32, r: u32, t: u64, digest: Vec<u64>) {
        match self.arrival(w, from, id, 0, r, digest.is_empty()) {
            Some(Arrival::Relayed) => {}
            None => return,
            Some(a) => return w.fail(format!("server {}: a relayed contribution of shard {id} taken as {a:?}", self.rank)),
        }
        let Some(sh) = self.shards.get_mut(&id) else { return };
        sh.relayed.push_back((r, t, digest));
        self.update(w, id, Pending::Forward { version: 0, carry: false, worker: Some(r) });
    }
}
