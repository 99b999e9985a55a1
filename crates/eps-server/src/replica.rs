//! Replicas (`job.replicas = 2`, BSP): every shard has a backup on the next
//! server, kept in step by the migration's forwarding made permanent. After
//! each update the owner forwards the averaged gradient to the backup, which
//! applies it with the same element-wise code (so it holds the owner's bits),
//! and the owner serves the new version to pulls only once the backup
//! acknowledged it. So when the owner dies, its backup holds at least every
//! version any worker has pulled: the control plane promotes it, workers push
//! their current iteration again there, and nothing is lost. A push of an
//! iteration the promoted backup already applied (the owner applied it, the
//! worker had not pulled it yet) is ignored and its pull answered.

use eps_fabric::prelude::*;
use eps_proto::control::{ControlMsg, MigrationKeys, Order};
use eps_proto::imm::{Imm, ImmKind};

use eps_core::replica::{Alone, Role};

use crate::{Peer, Pending, Server, ServerError, WR_OTHER};

/// Work-request ids of forwards to a backup: shard in the low bits.
pub(crate) const WR_REPLICA: u64 = WR_OTHER | (1 << 41);
/// The notice after a snapshot for a new backup (its completion says the
/// snapshot WRITE before it is done too).
pub(crate) const WR_REPLICA_SNAPSHOT: u64 = WR_OTHER | (1 << 42);

/// An update applied whose version waits for the backup's acknowledgement.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deferred {
    pub(crate) p: Pending,
    pub(crate) version: u64,
    pub(crate) carry: bool,
    pub(crate) one: Option<u32>,
}

/// Where an owner's backup receives forwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Link {
    /// The connection to the backup's server.
    pub(crate) ci: usize,
    /// Where the backup receives forwarded gradients.
    pub(crate) keys: MigrationKeys,
}

/// A shard's part in replication: the state and its transitions are
/// `eps_core::Replica`'s, which the simulation drives too.
pub(crate) type Replica = eps_core::Replica<Link, Deferred>;

impl<P: Fabric> Server<P> {
    /// The control plane orders shard `id`'s forwards to its backup on `to`
    /// (after a snapshot of the shard, for a new backup).
    pub(crate) fn on_replicate(
        &mut self,
        id: u32,
        to: u32,
        addr: &str,
        keys: MigrationKeys,
        snapshot: bool,
    ) -> Result<(), ServerError> {
        let Some(h) = self.held_mut(id) else {
            // A move's target is ordered to forward to the shard's backup
            // right after `MigrateIn`; if the move was cancelled meanwhile (its
            // source lost), the target dropped its empty copy and the order
            // is stale: there is nothing to forward.
            eps_proto::say!(
                "eps server {}: ordered to replicate shard {id}, which is not here (a stale order: a cancelled move's): ignored",
                self.rank
            );
            return Ok(());
        };
        if snapshot && (h.awaits_snapshot() || h.core.sync.catching_up()) {
            // A move's target ordered a new backup once the move's source let
            // go: the snapshot waits for the shard's own state (see
            // `start_new_backup`).
            h.new_backup = Some(Order::Replicate { shard: id, to, to_addr: addr.to_string(), keys, snapshot });
            return Ok(());
        }
        let (waiting, promoted) = h.replica.replace();
        if let Some(d) = waiting {
            // A new backup replaces one that never acknowledged (lost while
            // stopped, not closed): the update it waited for is served, and
            // the snapshot below holds it.
            self.finish_update(id, d)?;
        }
        let Some(h) = self.held_mut(id) else {
            return Err(ServerError::Migration(format!("shard {id} left while its backup was replaced")));
        };
        let version = h.core.sync.version();
        // (Updates parked while the backup was awaited run now, unless a
        // snapshot is written first.)
        let Some(ci) = self.forward_conn(id, to, addr, "the shard goes on without a backup")? else {
            if let Some(h) = self.held_mut(id) {
                h.replica.unreachable(promoted);
            }
            return self.drain(id);
        };
        if snapshot {
            // Between updates (this loop does one thing at a time); none runs
            // until the WRITE is done (`snapshotting`).
            self.mem.to_host(id)?;
            self.mem.set_snapshot_version(id, version, &[]);
            let b = self.mem.get(id).ok_or_else(|| ServerError::Migration("shard memory vanished".into()))?;
            let state = [Sge::whole(&b.state)];
            let to_state = RemoteAddr { addr: keys.state_addr, rkey: keys.state_rkey };
            let wr = SendWr { wr_id: WR_OTHER, op: SendOp::Write(to_state), sg: &state, signaled: false };
            self.conns[ci].post_or_flush(&wr, &mut self.flushed)?;
            let imm = Imm { kind: ImmKind::Forward, shard: id, seq: version as u16 }.encode();
            let to_grad = RemoteAddr { addr: keys.grad_addr, rkey: keys.grad_rkey };
            let op = SendOp::WriteImm(to_grad, imm);
            let wr = SendWr { wr_id: WR_REPLICA_SNAPSHOT | u64::from(id), op, sg: &[], signaled: true };
            self.conns[ci].post_or_flush(&wr, &mut self.flushed)?;
        }
        if let Some(h) = self.held_mut(id) {
            h.replica.forward_to(Link { ci, keys }, snapshot, promoted);
        }
        let how = if snapshot { format!(" (a new backup, from version {version})") } else { String::new() };
        eps_proto::say!("eps server {}: shard {id} is replicated on server {to}{how}", self.rank);
        self.drain(id)
    }

    /// The snapshot for shard `id`'s new backup is written: updates go on.
    pub(crate) fn replica_snapshot_done(&mut self, id: u32) -> Result<(), ServerError> {
        if self.held_mut(id).is_some_and(|h| h.replica.snapshot_done()) {
            self.stopped_replicating(id)?;
        }
        self.start_parked_moves(id)?;
        self.drain(id)
    }

    /// The control plane orders shard `id`'s forwards to its backup to stop
    /// (the shard is about to move, or its backup's server leaves).
    pub(crate) fn on_unreplicate(&mut self, id: u32) -> Result<(), ServerError> {
        // A forward or snapshot in flight: it stops when the acknowledgement
        // or the snapshot's completion comes (nothing may land on the backup
        // after it is dropped).
        if self.held_mut(id).is_some_and(|h| !h.replica.unreplicate()) {
            return Ok(());
        }
        self.stopped_replicating(id)?;
        self.drain(id)
    }

    /// Shard `id` forwards to no backup from now on (a promoted backup still
    /// ignores pushes it applied already); the control plane is told.
    fn stopped_replicating(&mut self, id: u32) -> Result<(), ServerError> {
        if self.held_mut(id).is_some() {
            self.release_forward_buffer(id);
            eps_proto::say!("eps server {}: shard {id} no longer forwards to a backup", self.rank);
        }
        // (Refused when the shard moved away meanwhile: its new owner keeps
        // the backup, or the control plane rebuilds one.)
        if let Err(why) = self.report(&ControlMsg::Unreplicated { shard: id, rank: self.rank })? {
            eps_proto::say!("eps server {}: shard {id}'s end of replication was refused ({why}); going on", self.rank);
        }
        Ok(())
    }

    /// The control plane orders this server's copy of shard `id` freed: a
    /// backup whose owner stopped forwarding, a move's target whose source was
    /// lost before the copy was complete, or one whose source was lost after
    /// the cutover (the shard's backup, which holds every version served, is
    /// promoted instead). Its landing slots stay (a push routed by an older
    /// map lands in bounds and is answered "moved").
    pub(crate) fn on_drop_backup(&mut self, id: u32) -> Result<(), ServerError> {
        let Some(mut h) = self.shards.get_mut(id as usize).and_then(Option::take) else { return Ok(()) };
        if let Some(b) = self.mem.remove(id) {
            self.retained.push((None, b.landing));
        }
        if !h.replica.is_backup() {
            // Workers may have pushed here, or wait for a pull: they are sent
            // to the new map (the promoted backup). So are the contributors of
            // an update applied here and not served (its backup may not have
            // it): they push it again, and the backup ignores it if it has.
            let v = h.core.sync.version() as u16;
            if let Some(d) = h.replica.waiting()
                && let Pending::Update { iteration, one } = d.p
            {
                let c: Vec<u32> = match one {
                    Some(w) => vec![w],
                    None => self.members.contributors(&h.core.sync, iteration).into_owned(),
                };
                for w in c {
                    self.send_moved(w, id, iteration as u16)?;
                }
            }
            let (held, waiting) = h.core.sync.evict();
            for w in held {
                self.send_moved(w, id, v)?;
            }
            for w in waiting {
                self.answers.forget_moved(w, id);
                self.send_pull_moved(w, id, v)?;
            }
        }
        eps_proto::say!("eps server {}: dropped its copy of shard {id}", self.rank);
        Ok(())
    }

    /// The control plane orders a new backup of shard `id` here (after a loss).
    pub(crate) fn on_add_backup(&mut self, id: u32, from: u32, start: u64, len: u64) -> Result<(), ServerError> {
        if id >= eps_proto::layout::MAX_SHARDS || len == 0 || self.shards.get(id as usize).is_some_and(Option::is_some) {
            return Err(ServerError::Migration(format!("ordered to keep a backup of shard {id}, which is here or invalid")));
        }
        if self.shards.len() <= id as usize {
            self.shards.resize_with(id as usize + 1, || None);
            self.spans.resize(id as usize + 1, (0, 0));
        }
        self.spans[id as usize] = (start, len);
        self.mem.add(id, start, len, crate::Origin::BackupFromSnapshot)?;
        self.shards[id as usize] = Some(crate::Held {
            core: eps_core::ShardCore::new(eps_proto::sync::ShardSync::incoming(self.mode, self.ranks, 0)),
            out: None,
            incoming: Some(eps_core::MoveIn::new(from)),
            split: None,
            replica: Replica::backup(from, true),
            new_backup: None,
            seed: None,
        });
        eps_proto::say!("eps server {}: keeping a new backup of shard {id} (owner: server {from})", self.rank);
        self.report_backup(id)
    }

    /// Whether shard `id` waits for its backup's acknowledgement, or takes no
    /// update before a move waiting for that starts.
    pub(crate) fn replica_busy(&self, id: u32) -> bool {
        self.replica_forwarding(id)
            || self.replica_awaited(id)
            || self.parked_moves.iter().any(|o| matches!(o, Order::MigrateOut { shard, .. } if *shard == id))
    }

    /// Whether shard `id` waits to be told where its backup is.
    pub(crate) fn replica_awaited(&self, id: u32) -> bool {
        self.shards.get(id as usize).and_then(Option::as_ref).is_some_and(|h| h.replica.is_awaited())
    }

    /// The control plane says shard `id` has no backup now and none can be
    /// made: it is served alone (what waited for a lost backup is served).
    pub(crate) fn on_no_backup(&mut self, id: u32) -> Result<(), ServerError> {
        let Some(h) = self.held_mut(id) else { return Ok(()) };
        let d = match h.replica.no_backup() {
            Ok(Alone::Now(d)) => d,
            Ok(Alone::Already) => return Ok(()),
            Err(e) => return Err(ServerError::Migration(format!("shard {id}: {e}"))),
        };
        self.release_forward_buffer(id);
        eps_proto::say!("eps server {}: shard {id} has no backup (none can be made now); it is served alone", self.rank);
        if let Some(d) = d {
            self.finish_update(id, d)?;
        }
        self.drain(id)
    }

    /// Whether a forward or snapshot of shard `id` to its backup is in flight.
    pub(crate) fn replica_forwarding(&self, id: u32) -> bool {
        self.shards.get(id as usize).and_then(Option::as_ref).is_some_and(|h| h.replica.forwarding())
    }

    /// Whether an update of shard `id` is applied and waits for the backup's
    /// acknowledgement before it is served.
    pub(crate) fn replica_deferred(&self, id: u32) -> bool {
        self.shards.get(id as usize).and_then(Option::as_ref).is_some_and(|h| h.replica.waiting().is_some())
    }

    /// Orders shard `id` the new backup it was given while it still arrived,
    /// once it has caught up.
    pub(crate) fn start_new_backup(&mut self, id: u32) -> Result<(), ServerError> {
        let Some(h) = self.held_mut(id) else { return Ok(()) };
        if h.new_backup.is_none() || h.awaits_snapshot() || h.core.sync.catching_up() {
            return Ok(());
        }
        match h.new_backup.take() {
            Some(o) => self.on_order(o),
            None => Ok(()),
        }
    }

    /// Starts the moves of shard `id` parked until its backup acknowledged.
    pub(crate) fn start_parked_moves(&mut self, id: u32) -> Result<(), ServerError> {
        if self.replica_forwarding(id) || self.awaiting_seed(id) {
            return Ok(());
        }
        let (now, later): (Vec<Order>, Vec<Order>) = std::mem::take(&mut self.parked_moves)
            .into_iter()
            .partition(|o| matches!(o, Order::MigrateOut { shard, .. } if *shard == id));
        self.parked_moves = later;
        for o in now {
            self.on_order(o)?;
        }
        Ok(())
    }

    /// After an update of a replicated shard: forwards the averaged gradient
    /// (none for an iteration without contributions) and defers the version.
    /// Returns false when the shard has no backup (finish the update now).
    pub(crate) fn forward_to_backup(&mut self, id: u32, d: Deferred) -> Result<bool, ServerError> {
        let Some(&Link { ci, keys }) = self.shards.get(id as usize).and_then(Option::as_ref).and_then(|h| h.replica.link())
        else {
            return Ok(false);
        };
        if !self.conns[ci].alive {
            return Ok(false);
        }
        let b = self.mem.get(id).ok_or_else(|| ServerError::Migration("shard memory vanished".into()))?;
        let g = b.grad.as_ref().ok_or_else(|| ServerError::Migration("no forward buffer".into()))?;
        let imm = Imm { kind: ImmKind::Forward, shard: id, seq: d.version as u16 }.encode();
        // Into the backup's half of this version's parity.
        let half = eps_proto::sync::ShardSync::parity(d.version) as u64 * b.len * 4;
        let remote = RemoteAddr { addr: keys.grad_addr + half, rkey: keys.grad_rkey };
        // One shard's gradient (a promoted backup's buffer has two halves).
        let whole = [Sge::new(g, 0, (b.len * 4) as u32)];
        let sg: &[Sge<'_, P::Mr>] = if d.carry { &[] } else { &whole };
        let wr = SendWr { wr_id: WR_REPLICA | u64::from(id), op: SendOp::WriteImm(remote, imm), sg, signaled: true };
        if self.conns[ci].post(&wr).is_err() {
            return Ok(false);
        }
        match self.held_mut(id).map(|h| h.replica.defer(d)) {
            Some(Ok(())) => Ok(true),
            _ => Err(ServerError::Migration(format!("shard {id}: forwarded to its backup with a forward in flight"))),
        }
    }

    /// The backup acknowledged shard `id`'s forward: its version is served.
    pub(crate) fn replica_acked(&mut self, id: u32) -> Result<(), ServerError> {
        let (d, stopped) = self.held_mut(id).map_or((None, false), |h| h.replica.acked());
        if stopped {
            // Before the update is finished: the next one is not forwarded.
            self.stopped_replicating(id)?;
        }
        if let Some(d) = d {
            self.finish_update(id, d)?;
        }
        self.start_parked_moves(id)?;
        self.drain(id)
    }

    /// Frees shard `id`'s gradient buffer unless something still uses it: a
    /// backup or a move forwards from it, or the source of a move (or the
    /// owner, for a backup) forwards into it.
    pub(crate) fn release_forward_buffer(&mut self, id: u32) {
        let used = self
            .shards
            .get(id as usize)
            .and_then(Option::as_ref)
            .is_some_and(|h| h.out.is_some() || h.incoming.is_some() || h.replica.link().is_some() || h.replica.is_backup());
        if !used {
            self.mem.drop_forward_buffer(id);
        }
    }

    /// The connection `ci` failed: shards replicated over it lost their
    /// backup; they go on alone (what waited for an acknowledgement is served).
    pub(crate) fn replica_conn_lost(&mut self, ci: usize, status: WcStatus, wr_id: u64) -> Result<(), ServerError> {
        let ids: Vec<u32> = (0..self.shards.len() as u32)
            .filter(|&id| self.shards[id as usize].as_ref().and_then(|h| h.replica.link()).is_some_and(|l| l.ci == ci))
            .collect();
        for id in ids {
            eps_proto::say!(
                "eps server {}: the backup of shard {id} is gone ({}: {status:?}, request {wr_id:#x}); the shard goes on without one",
                self.rank,
                self.conns[ci].peer
            );
            let d = self.held_mut(id).and_then(|h| h.replica.link_lost());
            self.release_forward_buffer(id);
            if let Some(d) = d {
                self.finish_update(id, d)?;
            }
            self.start_parked_moves(id)?;
            self.drain(id)?;
        }
        Ok(())
    }

    /// A server said hello: the backups whose owner it is take their forwards
    /// from this connection.
    pub(crate) fn bind_backups(&mut self, ci: usize, from: u32) {
        for h in self.shards.iter_mut().flatten() {
            if matches!(h.replica.role(), Some(Role::Backup { primary, snapshot: false, .. }) if *primary == from) {
                h.incoming = Some(eps_core::MoveIn::landed_from(from, ci));
            }
        }
    }

    /// The owner of shard `id` is lost: this backup owns it from now on.
    pub(crate) fn on_promote(&mut self, id: u32) -> Result<(), ServerError> {
        let rank = self.rank;
        let Some(h) = self.held_mut(id) else {
            return Err(ServerError::Migration(format!("promoted for shard {id}, which has no backup here")));
        };
        let at = h.core.sync.version();
        h.core.sync.caught_up();
        h.incoming = None;
        let lost = h.replica.promote();
        eps_proto::say!("eps server {rank}: shard {id} is served here from version {at} on (its owner was lost)");
        // Fenced off: a lost owner that was only stopped, not dead, may wake
        // up; nothing it sends lands here any more.
        let from_lost = |p: &Peer| matches!(p, Peer::Server(h) if Some(h.rank & !eps_proto::hello::PEER_BIT) == lost);
        for ci in 0..self.conns.len() {
            if from_lost(&self.conns[ci].peer) {
                self.drop_conn(ci);
            }
        }
        self.try_complete(id)
    }

    /// Whether shard `id` here is a backup's, promoted or to be: a push of an
    /// iteration it applied already is a worker pushing again after the
    /// owner was lost, and is ignored (`eps_core::push_gate`). (A push
    /// reaches a backup only from a worker routing by the map that promotes
    /// it, which may come before the order does.)
    pub(crate) fn promoted(&self, id: u32) -> bool {
        self.shards.get(id as usize).and_then(Option::as_ref).is_some_and(|h| h.replica.promoted())
    }

    /// A backup acknowledges a forward as it arrives, when it applies it at once
    /// (nothing parked): the owner may then serve the version, since this server
    /// applies it now whatever happens to the owner, and the next forward lands
    /// in the other half of the buffer. Returns whether it did.
    pub(crate) fn ack_on_arrival(&mut self, id: u32, ci: usize, version: u64) -> Result<bool, ServerError> {
        let free = self.free(id);
        if !self.held_mut(id).is_some_and(|h| h.replica.ack_on_arrival(free, version)) {
            return Ok(false);
        }
        self.ack_forward(ci, id, version)?;
        Ok(true)
    }

    /// Tells the control plane about the backups held here.
    pub(crate) fn report_backups(&mut self) -> Result<(), ServerError> {
        let ids: Vec<u32> = (0..self.shards.len() as u32)
            .filter(|&id| self.shards[id as usize].as_ref().is_some_and(|h| h.replica.is_backup()))
            .collect();
        for id in ids {
            self.report_backup(id)?;
        }
        Ok(())
    }

    fn report_backup(&mut self, id: u32) -> Result<(), ServerError> {
        let (endpoint, keys) = self.writable_by_peer(id)?;
        self.ctl.call(&ControlMsg::BackupReady { endpoint, keys })?;
        Ok(())
    }
}
