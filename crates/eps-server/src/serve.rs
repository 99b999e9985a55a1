//! The server's event loop: new connections and orders from their threads,
//! completions from the CQ, and the worker-facing half of the protocol (pushes,
//! pull requests, pull answers, credits, "moved" answers).

use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use eps_control_client::ControlError;
use eps_core::{Next, PullStep, PushGate, push_gate};
use eps_fabric::prelude::*;
use eps_proto::control::{ControlMsg, Order, Role, ShardEndpoint};
use eps_proto::hello::{HELLO_LEN, Hello};
use eps_proto::imm::{Imm, ImmKind, widen_seq};
use eps_proto::layout::published_offset;
use eps_proto::sync::ShardSync;

/// How long a server waits with nothing coming before it says what its
/// shards wait for.
const STALL_REPORT: Duration = Duration::from_secs(10);

use crate::{
    Conn, Peer, Pending, Server, ServerError, UpdateArgs, WR_HELLO, WR_MIGRATE, WR_OTHER, WR_PULL, pull_wr, pull_wr_parts,
};

/// How long a completion may wait for its accepted connection to be handed over.
const EARLY_TTL: Duration = Duration::from_secs(10);

/// A buffer for a connection's hello.
pub(crate) fn hello_buffer<P: Fabric>(pd: &P) -> Result<P::Mr, FabricError> {
    pd.alloc_mr(HELLO_LEN, Access::LOCAL_WRITE)
}

/// Posts a new connection's receives, `depth` in all: the hello's first (into
/// `hello`, when the peer dialed us), then one per immediate.
pub(crate) fn post_receives<P: Fabric>(qp: &P::Qp, hello: Option<&P::Mr>, depth: u32) -> Result<(), FabricError> {
    let mut recvs = depth;
    if let Some(h) = hello {
        qp.post_recv(&RecvWr { wr_id: WR_HELLO, sg: &[Sge::whole(h)] })?;
        recvs -= 1;
    }
    for _ in 0..recvs {
        qp.post_recv(&RecvWr { wr_id: 0, sg: &[] })?;
    }
    Ok(())
}

impl<P: Fabric> Server<P> {
    /// Shard `id`'s state, if held here.
    pub(crate) fn held_mut(&mut self, id: u32) -> Option<&mut crate::Held> {
        self.shards.get_mut(id as usize)?.as_mut()
    }

    /// Tells the control plane `m`; its refusal (the job moved on meanwhile:
    /// a move cancelled, a shard gone) is an answer too, `Err(why)`, and
    /// only a failure to reach it an error.
    pub(crate) fn report(&mut self, m: &ControlMsg) -> Result<Result<(), eps_proto::control::Refusal>, ServerError> {
        match self.ctl.call(m) {
            Ok(_) => Ok(Ok(())),
            Err(eps_control_client::ControlError::Rejected(why)) => Ok(Err(why)),
            Err(e) => Err(e.into()),
        }
    }

    /// Shard `id`'s endpoint for workers, if held here.
    pub(crate) fn endpoint(&self, id: u32) -> Option<ShardEndpoint> {
        let b = self.mem.get(id)?;
        Some(ShardEndpoint {
            shard: id,
            owner: self.rank,
            landing: b.landing.iter().map(|m| (m.addr(), m.rkey())).collect(),
            published_addr: b.published.addr(),
            published_rkey: b.published.rkey(),
        })
    }

    pub(crate) fn serve(
        &mut self,
        accepted: &Receiver<(P::Qp, P::Mr)>,
        orders: &Receiver<Result<Order, ControlError>>,
    ) -> Result<(), ServerError> {
        let mut wc = [Completion::EMPTY; 64];
        // Spinning after work: 200 us, or twice the recent gaps between bursts
        // when they are under 5 ms (a large round's).
        let mut spin = eps_fabric::Spin::new(Duration::from_micros(200), Duration::from_millis(5));
        let mut told = false;
        // Completions of accepted connections not handed over yet (their receives
        // are posted before the peer can send, on the acceptor's thread).
        let mut early: Vec<(Completion, Instant)> = Vec::new();
        let mut gauged = Instant::now() - Duration::from_secs(1);
        while !self.retired {
            if gauged.elapsed() > Duration::from_millis(100) {
                gauged = Instant::now();
                self.publish_gauges();
            }
            self.admit(accepted, &mut early)?;
            while let Ok(o) = orders.try_recv() {
                match o? {
                    Order::Retire => self.retired = true,
                    o => self.on_order(o)?,
                }
            }
            let k = self.cq.poll(&mut wc)?;
            for c in &wc[..k] {
                if !self.by_qp.contains_key(&c.qp_num) {
                    self.admit(accepted, &mut early)?;
                }
                // In order per connection: after its early ones.
                if self.by_qp.contains_key(&c.qp_num) && !early.iter().any(|(e, _)| e.qp_num == c.qp_num) {
                    self.on_completion(c)?;
                } else {
                    early.push((*c, Instant::now()));
                }
            }
            for wr_id in std::mem::take(&mut self.orphaned) {
                self.on_send_done(wr_id, false)?;
            }
            for c in std::mem::take(&mut self.flushed) {
                self.on_completion(&c)?;
            }
            if k > 0 {
                spin.worked();
                told = false;
            } else if spin.spinning() {
                // Spinning, it gives way to any thread that can run (the
                // progress threads that bring what it waits for, on a
                // machine with few cores).
                std::thread::yield_now();
            } else {
                self.cq.wait(Duration::from_millis(1));
                if !told && spin.last().elapsed() > STALL_REPORT {
                    told = true;
                    self.report_stall();
                }
            }
        }
        Ok(())
    }

    /// What it holds, for the metrics.
    fn publish_gauges(&self) {
        let held = (0..self.shards.len()).filter(|&i| self.shards[i].is_some());
        let (n, elements) = held.fold((0u64, 0u64), |(n, e), i| (n + 1, e + self.spans[i].1));
        self.metrics.shards.set(n as f64);
        self.metrics.bytes.set((elements * 4) as f64);
    }

    /// Nothing came for a while: says what each shard that waits waits for
    /// (a job stalls only on a bug or a peer that is gone for good).
    fn report_stall(&self) {
        for (id, h) in self.shards.iter().enumerate() {
            let Some(h) = h else { continue };
            if h.core.sync.idle() && h.core.parked_len() == 0 {
                continue;
            }
            let what = h.core.sync.describe();
            eps_proto::say!(
                "eps server {}: nothing came for {STALL_REPORT:?}: shard {id}: {what}; {} updates parked{}{}",
                self.rank,
                h.core.parked_len(),
                if h.out.is_some() { ", moving out" } else { "" },
                match h.replica.role() {
                    Some(r) => format!(", {r:?}"),
                    None => String::new(),
                }
            );
        }
        if let Some(what) = self.sparse_stall() {
            eps_proto::say!("eps server {}: nothing came for {STALL_REPORT:?}: {what}", self.rank);
        }
    }

    /// Takes the connections the acceptor handed over, then the early completions
    /// whose connection is now known, in order; drops those still unknown after
    /// `EARLY_TTL` (a connection that failed before it was handed over).
    fn admit(&mut self, accepted: &Receiver<(P::Qp, P::Mr)>, early: &mut Vec<(Completion, Instant)>) -> Result<(), ServerError> {
        while let Ok((qp, hello)) = accepted.try_recv() {
            self.add_conn(qp, Peer::Unknown, hello);
        }
        if early.is_empty() {
            return Ok(());
        }
        for (c, since) in std::mem::take(early) {
            if self.by_qp.contains_key(&c.qp_num) {
                self.on_completion(&c)?;
            } else if since.elapsed() < EARLY_TTL {
                early.push((c, since));
            }
        }
        Ok(())
    }

    /// Registers a connection whose receives are posted ([`post_receives`]), with
    /// the buffer its hello lands in.
    pub(crate) fn add_conn(&mut self, qp: P::Qp, peer: Peer, hello: P::Mr) -> usize {
        let ci = self.conns.len();
        self.by_qp.insert(qp.qp_num(), ci);
        let qp_num = qp.qp_num();
        self.conns.push(Conn { qp: Some(qp), qp_num, peer, alive: true, hello });
        ci
    }

    fn on_completion(&mut self, c: &Completion) -> Result<(), ServerError> {
        let Some(&ci) = self.by_qp.get(&c.qp_num) else { return Ok(()) };
        if c.wr_id & crate::buckets::WR_ROWS == crate::buckets::WR_ROWS {
            self.on_rows_read(c.wr_id, c.status.is_ok())?;
            if c.status.is_ok() {
                return Ok(());
            }
        }
        if c.wr_id & crate::rows_backup::WR_MIRROR == crate::rows_backup::WR_MIRROR {
            self.on_forward_read(c.wr_id, c.status.is_ok())?;
            if c.status.is_ok() {
                return Ok(());
            }
        }
        if !c.status.is_ok() {
            // A flush or transport error: the peer is gone (or was cut off).
            if c.opcode == WcOpcode::Write {
                self.on_send_done(c.wr_id, false)?;
            }
            if self.conns[ci].alive {
                self.report_unreachable(ci);
            }
            self.drop_conn(ci);
            self.moves_conn_lost(ci, &format!("{:?} on request {:#x}", c.status, c.wr_id))?;
            self.rows_backup_conn_lost(ci)?;
            return self.replica_conn_lost(ci, c.status, c.wr_id);
        }
        match c.opcode {
            WcOpcode::Recv if c.wr_id == WR_HELLO => {
                let mut b = [0u8; HELLO_LEN];
                self.conns[ci].hello.read_at(0, &mut b);
                match Hello::decode(&b) {
                    Some(h) if h.is_peer() => {
                        self.conns[ci].peer = Peer::Server(h);
                        self.bind_backups(ci, h.rank & !eps_proto::hello::PEER_BIT);
                    }
                    Some(h) if h.rank < self.ranks && self.by_rank[h.rank as usize].is_none() => {
                        self.by_rank[h.rank as usize] = Some(ci);
                        self.conns[ci].peer = Peer::Worker(h);
                    }
                    _ => self.violation(ci, "bad hello (unknown or duplicate worker rank)"),
                }
            }
            WcOpcode::RecvWithImm => {
                if self.conns[ci].alive {
                    self.conns[ci].qp()?.post_recv(&RecvWr { wr_id: 0, sg: &[] })?;
                }
                let imm = c.imm.unwrap_or(0);
                match self.conns[ci].peer {
                    Peer::Worker(h) => self.on_worker_imm(ci, h, imm, c.byte_len)?,
                    Peer::Server(_) => self.on_source_imm(ci, imm, c.byte_len)?,
                    Peer::Target(_) => self.on_target_imm(ci, imm)?,
                    Peer::Unknown => self.violation(ci, "data before its hello"),
                }
            }
            WcOpcode::Write => self.on_send_done(c.wr_id, true)?,
            _ => {}
        }
        Ok(())
    }

    pub(crate) fn violation(&mut self, ci: usize, what: &str) {
        self.summary.violations += 1;
        self.metrics.violations.inc();
        let who = match self.conns[ci].peer {
            Peer::Worker(h) => format!("worker {}", h.rank),
            Peer::Server(h) => format!("server {}", h.rank & !eps_proto::hello::PEER_BIT),
            Peer::Target(r) => format!("server {r}"),
            Peer::Unknown => "unidentified peer".to_string(),
        };
        eps_proto::say_event!(
            "peer_cut_off",
            { server = self.rank, peer = who.as_str(), why = what },
            "eps server {}: {who}: {what}; closing its connection",
            self.rank
        );
        self.drop_conn(ci);
    }

    /// The connection `ci` to another server failed: with replicas, the
    /// control plane is told (two peers saying so make that server lost; a
    /// cut link leaves it polling for orders).
    fn report_unreachable(&mut self, ci: usize) {
        let rank = match self.conns[ci].peer {
            Peer::Server(h) => h.rank & !eps_proto::hello::PEER_BIT,
            Peer::Target(r) => r,
            Peer::Worker(_) | Peer::Unknown => return,
        };
        if !self.replicated || self.retired {
            return;
        }
        let m = ControlMsg::Unreachable { rank, by: Role::Server, by_rank: self.rank };
        if let Err(e) = self.ctl.call(&m) {
            eps_proto::say!("eps server {}: could not report server {rank} unreachable: {e}", self.rank);
        }
    }

    pub(crate) fn drop_conn(&mut self, ci: usize) {
        if !self.conns[ci].alive {
            return;
        }
        self.conns[ci].alive = false;
        // Closing the queue pair cuts the peer off (its side goes to the error state).
        self.conns[ci].qp = None;
        if let Peer::Worker(h) = self.conns[ci].peer {
            for s in self.shards.iter_mut().flatten() {
                s.core.sync.drop_pending(h.rank);
            }
            // Its pulls in flight may never complete now: release their buffers.
            self.orphaned.extend(self.answers.orphaned(h.rank).into_iter().map(|(id, w, v)| pull_wr(id, w, v)));
        }
    }

    fn on_worker_imm(&mut self, ci: usize, h: Hello, imm: u32, len: u32) -> Result<(), ServerError> {
        if let Some(m) = Imm::decode(imm)
            && let Some(table) = eps_proto::layout::sparse_table(m.shard)
        {
            return self.on_sparse_imm(ci, h, table, m, len);
        }
        // (No map routes a shard to a server that never held it: ids past the
        // ones this server knows are a violation.)
        let Some(m) = Imm::decode(imm).filter(|m| (m.shard as usize) < self.shards.len()) else {
            self.violation(ci, &format!("unknown immediate {imm:#x} (bad kind or shard)"));
            return Ok(());
        };
        let id = m.shard;
        match m.kind {
            ImmKind::Push => {
                let Some(held) = self.shards[id as usize].as_ref() else {
                    return self.send_moved(h.rank, id, m.seq);
                };
                if held.seed.is_some() {
                    self.violation(ci, &format!("pushed shard {id} before its initial values came (model.init = \"worker\")"));
                    return Ok(());
                }
                let near = held.core.sync.min_clock().max(held.core.sync.version());
                let iteration = widen_seq(m.seq, near);
                let bsp = self.mode == eps_proto::Consistency::Bsp;
                match push_gate(bsp, &held.core.sync, held.out.as_ref().map(|o| o.core.source()), self.promoted(id), iteration) {
                    PushGate::Moved => return self.send_moved(h.rank, id, m.seq),
                    PushGate::AlreadyApplied => return Ok(()),
                    PushGate::Take => {}
                }
                let want = self.mem.get(id).map_or(0, |b| b.bytes);
                if len as usize != want {
                    self.violation(ci, &format!("pushed {len} bytes for shard {id} (expected {want})"));
                    return Ok(());
                }
                // With a device, the contribution starts for it now.
                self.mem.stage(id, h.rank)?;
                let Some(held) = self.shards[id as usize].as_mut() else { return Ok(()) };
                match held.core.take_push(&self.members, h.rank, iteration) {
                    Ok(Some(p)) => self.update(id, p)?,
                    Ok(None) => {}
                    Err(e) => self.violation(ci, &e.to_string()),
                }
            }
            ImmKind::PullReq => return self.pull_asked(ci, h, id, m.seq),
            ImmKind::Forward => return self.on_seed(ci, h, id, len),
            _ => self.violation(ci, "sent a server-only message"),
        }
        Ok(())
    }

    /// Worker `h` asks for shard `id` at the version whose low bits are `seq`.
    pub(crate) fn pull_asked(&mut self, ci: usize, h: Hello, id: u32, seq: u16) -> Result<(), ServerError> {
        // A shard or version no longer (or not yet) served here: the worker
        // routes with another epoch; it fetches the new map and asks the owner.
        if self.answers.pull_follows_moved(h.rank, id) {
            return self.send_pull_moved(h.rank, id, seq);
        }
        if self.keep_pull_for_seed(ci, h, id, seq) {
            return Ok(());
        }
        let Some(held) = self.shards[id as usize].as_mut() else { return self.send_pull_moved(h.rank, id, seq) };
        let need = widen_seq(seq, held.core.sync.version().max(held.core.sync.min_clock()));
        let refused = held.out.as_ref().is_some_and(|o| o.core.refuses(need));
        match held.core.pull(h.rank, need, refused) {
            Ok(PullStep::Moved) => return self.send_pull_moved(h.rank, id, seq),
            Ok(PullStep::Send(v)) => self.send_pull(h.rank, id, v)?,
            Ok(PullStep::Wait) => {}
            Err(e) => self.violation(ci, &e.to_string()),
        }
        Ok(())
    }

    /// The averaged element ranges in shard `id`, relative to its start.
    pub(crate) fn averaged_in(&self, id: u32) -> Vec<(usize, usize)> {
        let Some(&(start, len)) = self.spans.get(id as usize) else { return Vec::new() };
        let cut = |&(lo, hi): &(u64, u64)| {
            let (lo, hi) = (lo.max(start), hi.min(start + len));
            (lo < hi).then(|| ((lo - start) as usize, (hi - start) as usize))
        };
        self.averaged.iter().filter_map(cut).collect()
    }

    /// Whether shard `id` can take its next update now.
    pub(crate) fn free(&self, id: u32) -> bool {
        self.shards[id as usize].as_ref().is_some_and(|h| h.core.free(self.busy(id)))
    }

    /// A snapshot or forward of shard `id` is in flight (to a move's target
    /// or its backup): no update may run.
    fn busy(&self, id: u32) -> bool {
        let out = self.shards[id as usize].as_ref().and_then(|h| h.out.as_ref());
        out.is_some_and(|o| o.busy()) || self.replica_busy(id)
    }

    /// Applies an update to shard `id`, or parks it until the shard is free.
    pub(crate) fn update(&mut self, id: u32, p: Pending) -> Result<(), ServerError> {
        // SSP/ASP: a contribution past the shard's next checkpoint cut waits.
        if let Pending::Update { iteration, one: Some(w) } = p
            && self.hold_for_cut(id, w, iteration)?
        {
            return Ok(());
        }
        // An SSP/ASP source after its cutover applies nothing: it relays.
        if let (Pending::Update { one: Some(w), .. }, Some(r)) =
            (p, self.held_mut(id).and_then(|h| h.out.as_mut()).and_then(|o| o.core.relay()))
        {
            r.take(w);
            return self.pump(id);
        }
        let busy = self.busy(id);
        match self.held_mut(id).and_then(|h| h.core.offer(p, busy)) {
            Some(p) => self.apply(id, p),
            None => Ok(()),
        }
    }

    /// Applies parked updates while the shard is free.
    pub(crate) fn drain(&mut self, id: u32) -> Result<(), ServerError> {
        self.start_new_backup(id)?;
        loop {
            let busy = self.busy(id);
            let Some(h) = self.shards[id as usize].as_mut() else { return Ok(()) };
            match h.core.next(busy) {
                Next::Busy => return Ok(()),
                Next::Idle => return self.try_split(id),
                Next::Apply(p) => self.apply(id, p)?,
            }
        }
    }

    fn apply(&mut self, id: u32, p: Pending) -> Result<(), ServerError> {
        let Some(h) = self.shards[id as usize].as_ref() else { return Ok(()) };
        let eps_core::Plan { next, contributors, one, carry } =
            h.core.plan(p, &self.members).map_err(|e| ServerError::Update { shard: id, source: e })?;
        let parity = ShardSync::parity(next);
        // The update producing version `next` belongs to iteration `next - 1`.
        let scalars = self.opt.scalars(next - 1, self.sched.at(next - 1));
        // BSP: the iteration's contributors, averaged over their number;
        // SSP/ASP: one worker's contribution, scaled by the worker count.
        let scale = match p {
            Pending::Update { one: None, .. } => 1.0 / contributors.len() as f32,
            Pending::Update { one: Some(_), .. } => 1.0 / self.workers as f32,
            Pending::Forward { .. } => 1.0,
        };
        let u = UpdateArgs { agg: &*self.agg, opt: &self.opt, scalars, scale, threads: self.threads };
        self.mem.set_stamp(id, parity, eps_proto::layout::STAMP_WRITING);
        // For the right values: `free` said no pull uses `parity`; a forward
        // landed (its immediate arrived after the data) and its source writes the
        // gradient buffer again only after our acknowledgement; `ShardSync` asks
        // for an update only once every contribution in it has landed, each
        // contributor waits for our pull answer or credit before pushing the
        // shard again, and no snapshot or forward WRITE from it is in flight
        // (`busy`).
        // (Averaged tensors: what they average to replaces the step.)
        let averaged = self.averaged_in(id);
        if carry {
            self.mem.carry(id, parity);
        } else if let Pending::Forward { .. } = p {
            self.mem.apply_forwarded(id, parity, &u)?;
            self.mem.average_forwarded(id, parity, &averaged)?;
        } else {
            self.mem.update(id, parity, &contributors, &u)?;
            // (SSP/ASP: one contribution, which stands.)
            self.mem.average_ranges(id, parity, &contributors, &averaged)?;
        }
        self.mem.set_stamp(id, parity, next);
        let d = crate::replica::Deferred { p, version: next, carry, one };
        // A replicated shard serves the version once its backup has it.
        if matches!(p, Pending::Update { .. }) && self.forward_to_backup(id, d)? {
            return Ok(());
        }
        self.finish_update(id, d)
    }

    /// The end of an update that produced `d.version`: the version is served
    /// (and forwarded, on a migration source), credits and pulls go out, and
    /// the next iteration may complete.
    pub(crate) fn finish_update(&mut self, id: u32, d: crate::replica::Deferred) -> Result<(), ServerError> {
        let crate::replica::Deferred { p, version: next, carry, one } = d;
        // A checkpoint due at this version is saved now, once it is served: an
        // update whose backup never had it (its owner lost before the
        // acknowledgement) may be done again otherwise, and must not be saved.
        self.save_if_due(id, next)?;
        let Some(h) = self.shards[id as usize].as_mut() else { return Ok(()) };
        h.core.finished(p);
        self.summary.updates += 1;
        self.metrics.updates.inc();
        if let Some(w) = one {
            self.send_credit(w, id)?;
        }
        self.after_apply(id, p, next, carry)?;
        let mut ready = std::mem::take(&mut self.ready);
        ready.clear();
        if let Some(h) = self.shards[id as usize].as_mut() {
            h.core.sync.ready_pulls(&mut ready);
        }
        for &(w, v) in &ready {
            self.send_pull(w, id, v)?;
        }
        self.ready = ready;
        // The next iteration may be complete already: one whose every contributor
        // was removed (it carries the parameters over).
        if self.mode == eps_proto::Consistency::Bsp {
            self.try_complete(id)?;
        } else {
            self.try_cut(id)?;
        }
        self.try_split(id)
    }

    fn on_send_done(&mut self, wr_id: u64, ok: bool) -> Result<(), ServerError> {
        match wr_id & (3 << 62) {
            WR_PULL => {
                let (id, w, v) = pull_wr_parts(wr_id);
                if !self.answers.written(id, w, v) {
                    return Ok(()); // released when its connection was dropped
                }
                let Some(h) = self.held_mut(id) else { return Ok(()) };
                h.core.sync.pull_written(v);
                self.drain(id)
            }
            WR_MIGRATE => self.on_migration_written(wr_id, ok),
            _ if ok && wr_id & crate::replica::WR_REPLICA_SNAPSHOT == crate::replica::WR_REPLICA_SNAPSHOT => {
                self.replica_snapshot_done((wr_id & 0xFFFF_FFFF) as u32)
            }
            _ => Ok(()),
        }
    }

    pub(crate) fn worker_conn(&self, w: u32) -> Option<(&Conn<P>, Hello)> {
        let conn = &self.conns[self.by_rank.get(w as usize).copied().flatten()?];
        match (conn.peer, conn.alive) {
            (Peer::Worker(h), true) => Some((conn, h)),
            _ => None,
        }
    }

    pub(crate) fn send_pull(&mut self, w: u32, id: u32, v: u64) -> Result<(), ServerError> {
        let Some((conn, h)) = self.worker_conn(w) else {
            if let Some(h) = self.shards[id as usize].as_mut() {
                h.core.sync.pull_written(v);
            }
            return Ok(());
        };
        let Some(b) = self.mem.get(id) else { return Ok(()) };
        let es = self.mem.dtype.size_bytes() as u64;
        let sg = [Sge::new(&b.published, published_offset(b.bytes as u64, ShardSync::parity(v)), b.bytes as u32)];
        let remote = RemoteAddr { addr: h.pull_addr + b.start * es, rkey: h.pull_rkey };
        let imm = Imm { kind: ImmKind::PullDone, shard: id, seq: v as u16 }.encode();
        conn.post(&SendWr { wr_id: pull_wr(id, w, v), op: SendOp::WriteImm(remote, imm), sg: &sg, signaled: true })?;
        self.answers.posted(id, w, v);
        self.summary.pulls += 1;
        self.metrics.pulls.inc();
        Ok(())
    }

    /// A zero-length WRITE_WITH_IMM to worker `w`.
    pub(crate) fn notify(&mut self, w: u32, imm: Imm) -> Result<(), ServerError> {
        let Some((conn, h)) = self.worker_conn(w) else { return Ok(()) };
        let remote = RemoteAddr { addr: h.pull_addr, rkey: h.pull_rkey };
        conn.post(&SendWr { wr_id: WR_OTHER, op: SendOp::WriteImm(remote, imm.encode()), sg: &[], signaled: false })?;
        Ok(())
    }

    pub(crate) fn send_credit(&mut self, w: u32, id: u32) -> Result<(), ServerError> {
        self.notify(w, Imm { kind: ImmKind::Credit, shard: id, seq: 0 })
    }

    pub(crate) fn send_moved(&mut self, w: u32, id: u32, seq: u16) -> Result<(), ServerError> {
        self.summary.moved += 1;
        self.metrics.moved.inc();
        self.answers.moved(w, id);
        self.notify(w, Imm { kind: ImmKind::Moved, shard: id, seq })
    }

    pub(crate) fn send_pull_moved(&mut self, w: u32, id: u32, seq: u16) -> Result<(), ServerError> {
        self.summary.moved += 1;
        self.metrics.moved.inc();
        self.notify(w, Imm { kind: ImmKind::PullMoved, shard: id, seq })
    }
}
