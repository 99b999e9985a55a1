//! Live shard migration between servers: the driver around
//! `eps_proto::migrate::Source` on the source, and the replay of forwarded updates
//! on the target.
//!
//! Source A: on `MigrateOut` it dials the target B (once per target), WRITEs the
//! shard's f32 master parameters and optimizer state (with their version `v0` in
//! the region's tail) straight into B's registered region, then, once that WRITE
//! completed, announces the cutover iteration `T` to the control plane (which
//! publishes it in a new epoch): `T = version + 1` when that iteration is complete
//! here and forwarding is cheaper than pushing it again, else `T = version` (the
//! held pushes go back to their workers). It forwards the averaged gradient of
//! every update it applies up to version `T`, one at a time (B acknowledges
//! each). Pushes of iterations `>= T` are answered "moved". A releases the shard
//! once B acknowledged version `T`.
//!
//! Target B: on `MigrateIn` it registers the shard's memory and reports it; the
//! snapshot sets its version; each forward is applied with the optimizer code the
//! source used (so B tracks A bitwise) and acknowledged; pushes of iteration `T`
//! are held until the forwards reach version `T`.

use std::time::Instant;

use eps_core::{Arrival, MoveIn, Notice};
use eps_fabric::prelude::*;
use eps_proto::control::{ControlMsg, MigrationKeys, Order};
use eps_proto::hello::{HELLO_LEN, Hello, PEER_BIT};
use eps_proto::imm::{Imm, ImmKind, widen_seq};
use eps_proto::migrate::{Forwarded, SourceAction};
use eps_proto::sync::ShardSync;

use crate::{Held, Origin, Peer, Pending, Server, ServerError, WR_MIGRATE, WR_OTHER};

pub(crate) const WR_FORWARD: u64 = 1 << 40;

/// The source side of one shard's migration.
#[derive(Debug)]
pub(crate) struct Outgoing {
    /// What is in flight, the cutover, the relay (`eps-core`).
    pub(crate) core: eps_core::MoveOut,
    /// Connection to the target.
    pub(crate) ci: usize,
    keys: MigrationKeys,
    started: Instant,
    /// When the snapshot WRITE was posted, and how long until it completed.
    snapshot_posted: Instant,
    snapshot_secs: f64,
    snapshot_bytes: u64,
    pub(crate) bytes: u64,
}

impl Outgoing {
    /// A WRITE from the shard's master/state or gradient buffer is in flight: the
    /// next update must wait.
    pub(crate) fn busy(&self) -> bool {
        self.core.busy()
    }

    /// The snapshot WRITE completed.
    pub(crate) fn snapshot_done(&mut self) {
        self.core.snapshot_written();
        self.snapshot_secs = self.snapshot_posted.elapsed().as_secs_f64();
    }

    /// Where forwards land on the target.
    pub(crate) fn grad_remote(&self) -> RemoteAddr {
        RemoteAddr { addr: self.keys.grad_addr, rkey: self.keys.grad_rkey }
    }
}

impl<P: Fabric> Server<P> {
    pub(crate) fn on_order(&mut self, o: Order) -> Result<(), ServerError> {
        match o {
            Order::MigrateIn { shard, from, start, len } => self.migrate_in(shard, from, start, len),
            Order::Split { shard, mid, lo, hi } => self.on_split_order(shard, mid, lo, hi),
            Order::Release { shard } => self.on_release_order(shard),
            Order::MigrateOut { shard, to, to_addr, keys } => self.migrate_out(shard, to, &to_addr, keys),
            Order::Retire => {
                self.retired = true;
                Ok(())
            }
            Order::Propose { id } => self.on_propose(id),
            Order::Members { at, workers, expired } => self.on_members(at, workers, expired),
            Order::Checkpoint { version, dir } => self.on_checkpoint_order(version, &dir),
            Order::Replicate { shard, to, to_addr, keys, snapshot } => self.on_replicate(shard, to, &to_addr, keys, snapshot),
            Order::AddBackup { shard, from, start, len } => self.on_add_backup(shard, from, start, len),
            Order::Promote { shard } => self.on_promote(shard),
            Order::Unreplicate { shard } => self.on_unreplicate(shard),
            Order::DropBackup { shard } => self.on_drop_backup(shard),
            Order::NoBackup { shard } => self.on_no_backup(shard),
            Order::Buckets { at, runs } => self.on_buckets(at, &runs),
            Order::BackupRows { to } => self.on_backup_rows(to),
            Order::StandIn { from, give, take } => self.on_stand_in(from, give, take),
            Order::FetchRows { from, to, via, from_addr, addr, rkey, len } => {
                self.on_fetch_rows((from, to), via, &from_addr, (addr, rkey, len))
            }
            Order::FreeRows { to } => self.on_free_rows(to),
            Order::FreeLanding { shard } => {
                // The oldest move away: orders come in order, and a later
                // move of the shard away from here comes after this one.
                if let Some(k) = self.retained.iter().position(|(s, _)| *s == Some(shard)) {
                    self.retained.remove(k);
                }
                Ok(())
            }
        }
    }

    fn migrate_in(&mut self, id: u32, from: u32, start: u64, len: u64) -> Result<(), ServerError> {
        if id >= eps_proto::layout::MAX_SHARDS || len == 0 {
            return Err(ServerError::Migration(format!("ordered to receive shard {id} of {len} elements")));
        }
        if self.shards.get(id as usize).is_some_and(Option::is_some) {
            return Err(ServerError::Migration(format!("ordered to receive shard {id}, which is already here")));
        }
        if self.shards.len() <= id as usize {
            self.shards.resize_with(id as usize + 1, || None);
            self.spans.resize(id as usize + 1, (0, 0));
        }
        self.spans[id as usize] = (start, len);
        // (SSP/ASP: its cuts start from the clocks it arrives with.)
        self.saver.cuts.remove(&id);
        self.mem.add(id, start, len, Origin::Incoming)?;
        let sync = ShardSync::incoming(self.mode, self.ranks, 0);
        self.shards[id as usize] = Some(Held {
            core: eps_core::ShardCore::new(sync),
            out: None,
            incoming: Some(MoveIn::new(from)),
            split: None,
            replica: crate::replica::Replica::none(),
            new_backup: None,
            seed: None,
        });
        let (endpoint, keys) = self.writable_by_peer(id)?;
        let bytes = self.mem.get(id).map_or(0, |b| b.bytes);
        eps_proto::say!("eps server {}: receiving shard {id} ({bytes} bytes) from server {from}", self.rank);
        if let Err(why) = self.report(&ControlMsg::ShardReady { endpoint, keys })? {
            // The move was cancelled while its order waited here (its source
            // was lost, say): the empty copy goes.
            eps_proto::say!("eps server {}: the move of shard {id} here was cancelled ({why})", self.rank);
            return self.on_drop_backup(id);
        }
        self.summary.migrated_in += 1;
        self.metrics.migrated_in.inc();
        Ok(())
    }

    /// Shard `id`'s endpoint for workers, and where a peer server writes its
    /// master values and state and its forwarded gradients.
    pub(crate) fn writable_by_peer(&self, id: u32) -> Result<(eps_proto::control::ShardEndpoint, MigrationKeys), ServerError> {
        let b = self.mem.get(id).ok_or_else(|| ServerError::Migration("shard memory vanished".into()))?;
        let grad = b.grad.as_ref().ok_or_else(|| ServerError::Migration("no gradient buffer".into()))?;
        // A snapshot lands in the inbox; a shard without one (a backup from the
        // start, kept in step by forwards alone) takes none: no key writes it.
        let (state_addr, state_rkey) = b.inbox.as_ref().map_or((0, 0), |i| (i.addr(), i.rkey()));
        let keys = MigrationKeys { state_addr, state_rkey, grad_addr: grad.addr(), grad_rkey: grad.rkey() };
        let endpoint = self.endpoint(id).ok_or_else(|| ServerError::Migration("shard memory vanished".into()))?;
        Ok((endpoint, keys))
    }

    /// The connection shard `id` forwards to server `to` on (dialed on first
    /// use), with a buffer to forward from; none if `to` cannot be reached
    /// (`then` says what follows; the control plane declares `to` lost).
    pub(crate) fn forward_conn(&mut self, id: u32, to: u32, addr: &str, then: &str) -> Result<Option<usize>, ServerError> {
        let ci = match self.target_conn(to, addr) {
            Ok(ci) => ci,
            Err(e) => {
                eps_proto::say!("eps server {}: cannot reach server {to} for shard {id} ({e}); {then}", self.rank);
                return Ok(None);
            }
        };
        if self.mem.get(id).is_some_and(|b| b.grad.is_none()) {
            self.mem.add_forward_buffer(id)?;
        }
        Ok(Some(ci))
    }

    /// The connection to target server `to`, dialed on first use.
    pub(crate) fn target_conn(&mut self, to: u32, addr: &str) -> Result<usize, ServerError> {
        if let Some(&ci) = self.targets.get(&to)
            && self.conns[ci].alive
        {
            return Ok(ci);
        }
        let sa = addr.parse().map_err(|_| ServerError::Migration(format!("server {to} has a bad fabric address {addr:?}")))?;
        let qp = self.pd.connect(sa, &self.cq, &self.cq, &self.opts)?;
        crate::serve::post_receives::<P>(&qp, None, self.opts.max_recv_wr)?;
        let ci = self.add_conn(qp, Peer::Target(to), crate::serve::hello_buffer(&self.pd)?);
        let conn = &mut self.conns[ci];
        let hello = Hello { rank: self.rank | PEER_BIT, pull_rkey: self.acks.rkey(), pull_addr: self.acks.addr() };
        conn.hello.write_at(0, &hello.encode());
        let sg = [Sge::new(&conn.hello, 0, HELLO_LEN as u32)];
        conn.post(&SendWr { wr_id: WR_OTHER, op: SendOp::Send, sg: &sg, signaled: false })?;
        self.targets.insert(to, ci);
        Ok(ci)
    }

    fn migrate_out(&mut self, id: u32, to: u32, addr: &str, keys: MigrationKeys) -> Result<(), ServerError> {
        let Some(h) = self.shards.get(id as usize).and_then(Option::as_ref) else {
            return Err(ServerError::Migration(format!("ordered to migrate shard {id}, which is not here")));
        };
        if h.out.is_some() {
            return Err(ServerError::Migration(format!("shard {id} is already migrating")));
        }
        if self.replica_forwarding(id) || self.awaiting_seed(id) {
            // The update applied is not served before its backup has it: the
            // snapshot waits for the acknowledgement (see `replica_acked`); a
            // shard waiting for its first values moves once they are in.
            self.parked_moves.push(Order::MigrateOut { shard: id, to, to_addr: addr.to_string(), keys });
            return Ok(());
        }
        self.unhold_for_move(id);
        if self.replica_awaited(id)
            && let Some(h) = self.held_mut(id)
        {
            // Its backup was never reported (the control plane makes one
            // after the move): the updates it parked go with it.
            h.replica.stop();
        }
        let Some(h) = self.shards.get(id as usize).and_then(Option::as_ref) else { return Ok(()) };
        let v0 = h.core.sync.version();
        // SSP/ASP: the workers' clocks, less contributions parked here (they are
        // not in the snapshot; they are relayed after it).
        let clocks = h.core.snapshot_clocks();
        let started = Instant::now();
        // Lost (the control plane cancels the move): the shard stays.
        let Some(ci) = self.forward_conn(id, to, addr, "the move goes no further; the shard stays here")? else {
            return Ok(());
        };
        // The snapshot is the host region: current from the device first.
        self.mem.to_host(id)?;
        self.mem.set_snapshot_version(id, v0, &clocks);
        let b = self.mem.get(id).ok_or_else(|| ServerError::Migration("shard memory vanished".into()))?;
        let size = b.state.len() as u64;
        eps_proto::say!(
            "eps server {}: migrating shard {id} ({size} bytes of parameters and state) to server {to} from version {v0}",
            self.rank
        );
        let imm = Imm { kind: ImmKind::Forward, shard: id, seq: v0 as u16 }.encode();
        let remote = RemoteAddr { addr: keys.state_addr, rkey: keys.state_rkey };
        let sg = [Sge::whole(&b.state)];
        let snapshot_posted = Instant::now();
        let wr = SendWr { wr_id: WR_MIGRATE | u64::from(id), op: SendOp::WriteImm(remote, imm), sg: &sg, signaled: true };
        self.conns[ci].post_or_flush(&wr, &mut self.flushed)?;
        let out = Outgoing {
            core: eps_core::MoveOut::new(v0, to),
            ci,
            keys,
            started,
            snapshot_posted,
            snapshot_secs: 0.0,
            snapshot_bytes: size,
            bytes: size,
        };
        if let Some(h) = self.shards[id as usize].as_mut() {
            h.out = Some(out);
        }
        Ok(())
    }

    /// A zero-length WRITE_WITH_IMM to a peer server on connection `ci`.
    fn notice(&mut self, ci: usize, remote: RemoteAddr, imm: Imm) -> Result<(), ServerError> {
        let wr = SendWr { wr_id: WR_OTHER, op: SendOp::WriteImm(remote, imm.encode()), sg: &[], signaled: false };
        self.conns[ci].post_or_flush(&wr, &mut self.flushed)?;
        Ok(())
    }

    /// Shard `id`'s move stops, its target gone: before the cutover the
    /// shard stays here and is served as before; after it, the target owned
    /// it and the control plane counts it lost.
    pub(crate) fn abandon_move(&mut self, id: u32, why: &str) -> Result<(), ServerError> {
        let rank = self.rank;
        let Some(h) = self.held_mut(id) else { return Ok(()) };
        let Some(out) = h.out.as_ref() else { return Ok(()) };
        let to = out.core.to();
        if out.core.announced() {
            // The target owned it; what is left here is not served any more.
            eps_proto::say!(
                "eps server {rank}: the move of shard {id} to server {to} failed after its cutover ({why}); dropped here"
            );
            self.shards[id as usize] = None;
            if let Some(b) = self.mem.remove(id) {
                self.retained.push((None, b.landing));
            }
            return Ok(());
        }
        h.out = None;
        h.core.sync.set_publish_waiting(h.core.parked_len() > 0);
        eps_proto::say!("eps server {rank}: the move of shard {id} to server {to} stopped ({why}); the shard stays here");
        self.release_forward_buffer(id);
        self.drain(id)
    }

    /// As [`Server::abandon_move`], for a move whose connection failed: the
    /// control plane is told, so that it cancels the move (the target may be
    /// alive, cut off from here alone) and plans what still has to happen.
    fn move_conn_failed(&mut self, id: u32, why: &str) -> Result<(), ServerError> {
        let before_cutover = self
            .shards
            .get(id as usize)
            .and_then(Option::as_ref)
            .and_then(|h| h.out.as_ref())
            .is_some_and(|o| !o.core.announced());
        self.abandon_move(id, why)?;
        if !before_cutover {
            return Ok(());
        }
        // (Refused when cancelled already: its target was lost.)
        if let Err(why) = self.report(&ControlMsg::MoveStopped { shard: id, rank: self.rank })? {
            eps_proto::say!("eps server {}: the control plane did not cancel the move of shard {id} ({why})", self.rank);
        }
        Ok(())
    }

    /// The connection `ci` failed (`why`): moves to its server stop.
    pub(crate) fn moves_conn_lost(&mut self, ci: usize, why: &str) -> Result<(), ServerError> {
        let ids: Vec<u32> = (0..self.shards.len() as u32)
            .filter(|&id| self.shards[id as usize].as_ref().and_then(|h| h.out.as_ref()).is_some_and(|o| o.ci == ci))
            .collect();
        for id in ids {
            self.move_conn_failed(id, &format!("its connection failed: {why}"))?;
        }
        Ok(())
    }

    /// A snapshot or forward WRITE completed.
    pub(crate) fn on_migration_written(&mut self, wr_id: u64, ok: bool) -> Result<(), ServerError> {
        let id = (wr_id & 0xFFFF_FFFF) as u32;
        if !ok {
            return self.move_conn_failed(id, "sending to it failed");
        }
        if wr_id & WR_FORWARD != 0 {
            return Ok(()); // the acknowledgement frees the buffer
        }
        if self.mode != eps_proto::Consistency::Bsp {
            return self.async_cutover(id);
        }
        let Some(h) = self.shards.get_mut(id as usize).and_then(Option::as_mut) else { return Ok(()) };
        if h.out.is_none() {
            // The move stopped meanwhile (its connection failed: the failure
            // may be polled before this snapshot's completion): no cutover.
            return Ok(());
        }
        let version = h.core.sync.version();
        // No update ran while the snapshot was in flight, so every worker is still
        // at most at iteration `version`. If that iteration's update is ready here
        // (every contribution in) and forwarding it costs less than pushing it
        // again (`cutover_at`), the cutover is the iteration after: this server
        // applies it and forwards it. Otherwise the cutover is `version` itself:
        // the target holds that version (it publishes it from the snapshot), the
        // pushes of `version` held here are answered "moved" (their workers push
        // again to the target) and the pulls waiting here "pull moved"; nothing is
        // forwarded and the shard is released at once.
        let at = h.core.cutover_at(&self.members, self.mem.dtype.size_bytes() as u64);
        // Announced before anything changes here: a refusal (the control plane
        // cancelled the move, its target lost) leaves the shard as it was.
        // (Nothing else happens here meanwhile: this loop does one thing at a
        // time.)
        if let Err(why) = self.report(&ControlMsg::Cutover { shard: id, at })? {
            return self.abandon_move(id, &why.message);
        }
        let Some(h) = self.shards.get_mut(id as usize).and_then(Option::as_mut) else { return Ok(()) };
        // Pull requests waiting here for a version after the cutover go to the
        // target; at the snapshot's version, held pushes go back too.
        let (held, waiting) = h.core.cut_over(at);
        let Some(out) = h.out.as_mut() else { return Ok(()) };
        out.snapshot_done();
        let action = out.core.announce(at).map_err(|e| ServerError::Migration(e.to_string()))?;
        if at == version {
            // Tell the target: no forward follows (a zero-length forward of the
            // snapshot's own version).
            let remote = RemoteAddr { addr: out.keys.grad_addr, rkey: out.keys.grad_rkey };
            let ci = out.ci;
            self.notice(ci, remote, Imm { kind: ImmKind::Forward, shard: id, seq: version as u16 })?;
        }
        for w in held {
            self.send_moved(w, id, version as u16)?;
        }
        for w in waiting {
            // Its pull request was here already: answered now, not when it comes.
            self.answers.forget_moved(w, id);
            self.send_pull_moved(w, id, version as u16)?;
        }
        if action == Some(SourceAction::Release) {
            return self.release(id);
        }
        self.drain(id)
    }

    /// After an update of shard `id` produced `version`: the source forwards it (an
    /// update without contributions, `carry`, as a zero-length forward); the target
    /// acknowledges a forward and aggregates held pushes once it caught up.
    pub(crate) fn after_apply(&mut self, id: u32, p: Pending, version: u64, carry: bool) -> Result<(), ServerError> {
        let Some(h) = self.shards.get_mut(id as usize).and_then(Option::as_mut) else { return Ok(()) };
        if let Some(out) = h.out.as_mut()
            && let Some(version) = out.core.applied(version)
            // A target whose connection was lost gets nothing more: the move's end
            // was settled when the connection failed (`moves_conn_lost`).
            && self.conns[out.ci].alive
        {
            let b = self.mem.get(id).ok_or_else(|| ServerError::Migration("shard memory vanished".into()))?;
            let g = b.grad.as_ref().ok_or_else(|| ServerError::Migration("no gradient buffer".into()))?;
            let imm = Imm { kind: ImmKind::Forward, shard: id, seq: version as u16 }.encode();
            let remote = RemoteAddr { addr: out.keys.grad_addr, rkey: out.keys.grad_rkey };
            // One shard's gradient: a promoted backup's buffer has two halves,
            // and the target's holds one.
            let whole = [Sge::new(g, 0, (b.len * 4) as u32)];
            let wr = SendWr {
                wr_id: WR_MIGRATE | WR_FORWARD | u64::from(id),
                op: SendOp::WriteImm(remote, imm),
                sg: if carry { &[] } else { &whole },
                signaled: true,
            };
            self.conns[out.ci].post_or_flush(&wr, &mut self.flushed)?;
            out.core.forward_sent(version);
            out.bytes += if carry { 0 } else { b.len * 4 };
        }
        if let (Pending::Forward { worker, .. }, Some(&ci)) = (p, h.incoming.as_ref().and_then(MoveIn::link)) {
            // (Unless a backup acknowledged it on arrival.)
            if !h.replica.acked_on_arrival(version) {
                // SSP/ASP: the acknowledgement names the contribution's worker.
                self.ack_forward(ci, id, worker.map_or(version, u64::from))?;
            }
            self.try_complete(id)?;
        }
        Ok(())
    }

    /// Acknowledges a forward of shard `id` to its source on connection `ci`.
    pub(crate) fn ack_forward(&mut self, ci: usize, id: u32, seq: u64) -> Result<(), ServerError> {
        if let Peer::Server(src) = self.conns[ci].peer {
            let remote = RemoteAddr { addr: src.pull_addr, rkey: src.pull_rkey };
            self.notice(ci, remote, Imm { kind: ImmKind::ForwardAck, shard: id, seq: seq as u16 })?;
        }
        Ok(())
    }

    /// An immediate from a migration source (we are the target).
    pub(crate) fn on_source_imm(&mut self, ci: usize, imm: u32, len: u32) -> Result<(), ServerError> {
        let Some(m) = Imm::decode(imm).filter(|m| m.kind == ImmKind::Forward) else {
            self.violation(ci, &format!("unexpected immediate {imm:#x} from a migration source"));
            return Ok(());
        };
        if let Some(table) = eps_proto::layout::sparse_table(m.shard) {
            return self.on_rows_forward(ci, table, m.seq);
        }
        let id = m.shard;
        let sender = match self.conns[ci].peer {
            Peer::Server(p) => p.rank & !PEER_BIT,
            _ => u32::MAX,
        };
        let held = self.shards.get(id as usize).and_then(Option::as_ref);
        let arriving = held.and_then(|h| h.incoming.as_ref().map(|copy| (copy, &h.core)));
        let arrival = arriving.map(|(copy, core)| {
            let version = widen_seq(m.seq, core.sync.version() + 1 + core.forwards_parked());
            let n = Notice { sender, version, empty: len == 0, worker: u32::from(m.seq) };
            copy.arrival(core, &n, self.ranks)
        });
        let Some(arrival) = arrival else {
            let promoted = held.is_some_and(|h| h.replica.promoted() && !h.replica.is_backup());
            if !eps_core::stray_forward_ignored(held.is_some(), len == 0, promoted) {
                self.violation(ci, &format!("forwarded shard {id}, which is not arriving here"));
            }
            return Ok(());
        };
        match arrival {
            Arrival::StaleNotice => {
                // The orders can be taken before the completions queued ahead
                // of them; its inbox holds nothing of this copy's.
                eps_proto::say!(
                    "eps server {}: a snapshot notice of shard {id} from server {sender}, which it does not arrive from; ignored",
                    self.rank
                );
                Ok(())
            }
            Arrival::Snapshot => {
                // The snapshot's notice: the WRITE before it on this queue
                // pair is whole, and goes from the inbox into the state. Its
                // version is in the region's tail; it is published at once
                // (the same bits the source published), so this server serves
                // that version too.
                let snapshot_version = self.mem.snapshot_version(id);
                self.mem.take_snapshot(id);
                let (v0, clocks) = snapshot_version.unwrap_or_default();
                let Some(h) = self.held_mut(id) else { return Ok(()) };
                let Some(copy) = h.incoming.as_mut() else { return Ok(()) };
                let moved = copy.land(&mut h.core.sync, v0, &clocks, ci);
                let backup = h.replica.is_backup();
                let parity = ShardSync::parity(v0);
                self.mem.publish(id, parity)?;
                self.mem.set_stamp(id, parity, v0);
                eps_proto::say!("eps server {}: snapshot of shard {id} at version {v0} landed", self.rank);
                if backup {
                    // From now on this backup may be promoted.
                    self.ctl.call(&ControlMsg::BackupSynced { shard: id, rank: self.rank })?;
                }
                for w in moved {
                    self.send_pull_moved(w, id, v0 as u16)?;
                }
                let mut ready = Vec::new();
                if let Some(h) = self.held_mut(id) {
                    h.core.sync.ready_pulls(&mut ready);
                }
                for (w, v) in ready {
                    self.send_pull(w, id, v)?;
                }
                // Pushes of the snapshot's version held here (a cutover at that
                // version) may be complete now.
                self.try_complete(id)
            }
            Arrival::BadRelay => {
                self.violation(ci, &format!("relayed a contribution of worker {} ({len} bytes) for shard {id}", m.seq));
                Ok(())
            }
            // A contribution the source took after its cutover.
            Arrival::Relayed => self.update(id, Pending::Forward { version: 0, carry: false, worker: Some(u32::from(m.seq)) }),
            Arrival::Forward(f) => {
                let Some(h) = self.held_mut(id) else { return Ok(()) };
                if h.replica.is_backup()
                    && let Some(copy) = h.incoming.as_mut().filter(|copy| copy.link() != Some(&ci))
                {
                    // A moved shard's new owner forwards from here on (its
                    // first forward comes after the old owner's last one was
                    // acknowledged): acknowledgements go to it.
                    h.replica.primary_moved(sender);
                    copy.moved_to(sender, ci);
                }
                match f {
                    Forwarded::CutoverAtSnapshot => {
                        // We aggregate from here on.
                        h.core.sync.caught_up();
                        self.start_new_backup(id)?;
                        self.try_complete(id)
                    }
                    Forwarded::LateNotice => Ok(()),
                    Forwarded::Unexpected { version, expected } => {
                        self.violation(ci, &format!("forwarded version {version} of shard {id}, expected {expected}"));
                        Ok(())
                    }
                    Forwarded::Apply { version } => {
                        // A zero-length forward: an update without contributions. A
                        // backup acknowledges it now if it applies it now; else after
                        // applying.
                        self.ack_on_arrival(id, ci, version)?;
                        self.update(id, Pending::Forward { version, carry: len == 0, worker: None })
                    }
                }
            }
        }
    }

    /// An immediate from a migration target (we are the source): an acknowledgement.
    pub(crate) fn on_target_imm(&mut self, ci: usize, imm: u32) -> Result<(), ServerError> {
        let Some(m) = Imm::decode(imm).filter(|m| m.kind == ImmKind::ForwardAck) else {
            self.violation(ci, &format!("unexpected immediate {imm:#x} from a migration target"));
            return Ok(());
        };
        if let Some(table) = eps_proto::layout::sparse_table(m.shard) {
            return self.rows_acked(ci, table, m.seq);
        }
        let id = m.shard;
        // A moving shard forwards both to its backup and to its new owner:
        // the connection says which one acknowledged.
        if self.held_mut(id).and_then(|h| h.replica.link()).is_some_and(|l| l.ci == ci) {
            return self.replica_acked(id);
        }
        let Some(out) = self.held_mut(id).and_then(|h| h.out.as_mut()) else {
            return Ok(());
        };
        if out.core.relaying() {
            return self.relay_acked(id);
        }
        let version = widen_seq(m.seq, out.core.last_forward());
        match out.core.acked(version) {
            Ok(true) => self.release(id),
            Ok(false) => self.drain(id),
            Err(e) => {
                self.violation(ci, &format!("shard {id}: {e}"));
                Ok(())
            }
        }
    }

    /// Frees a migrated shard (its landing slots stay, see `Server::retained`) and
    /// reports the migration's figures.
    pub(crate) fn release(&mut self, id: u32) -> Result<(), ServerError> {
        let Some(h) = self.shards[id as usize].take() else { return Ok(()) };
        let Some(out) = h.out else { return Ok(()) };
        if let Some(b) = self.mem.remove(id) {
            self.retained.push((Some(id), b.landing));
        }
        let secs = out.started.elapsed().as_secs_f64();
        let to = out.core.to();
        let setup = out.snapshot_posted.duration_since(out.started).as_secs_f64();
        let snap = out.snapshot_secs;
        let snapshot_bytes = out.snapshot_bytes;
        eps_proto::say_event!(
            "migration",
            { shard = id, from = self.rank, to = to, bytes = out.bytes, seconds = secs, setup_s = setup, snapshot_s = snap },
            "eps server {}: migrated shard {id} to server {}: {} bytes in {:.1} ms ({:.2} GB/s): setup {:.1} ms, \
             snapshot {:.1} ms ({:.2} GB/s), {} {:.1} ms",
            self.rank,
            to,
            out.bytes,
            secs * 1e3,
            out.bytes as f64 / secs.max(1e-9) / 1e9,
            setup * 1e3,
            snap * 1e3,
            snapshot_bytes as f64 / snap.max(1e-9) / 1e9,
            match out.core.relaying() {
                true => "relaying contributions until every worker routed to the new owner".to_string(),
                false => format!("forwarding to the cutover at iteration {}", out.core.at()),
            },
            (secs - setup - snap) * 1e3,
        );
        self.summary.migrated_out += 1;
        self.metrics.migrated_out.inc();
        self.metrics.migrated_bytes.add(out.bytes);
        let d = std::time::Duration::from_secs_f64;
        for (h, s) in [(0, secs), (1, setup), (2, snap), (3, (secs - setup - snap).max(0.0))] {
            self.metrics.migration_phases[h].observe(d(s));
        }
        self.ctl.call(&ControlMsg::Released { shard: id, bytes: out.bytes, millis: (secs * 1e3) as u64 })?;
        Ok(())
    }
}
