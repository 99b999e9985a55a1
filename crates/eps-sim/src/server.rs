//! A server as the simulation runs it, with a 64-bit digest per alignment
//! unit standing in for each shard's parameters. Its decisions are
//! `eps-core`'s, the ones `eps-server` carries out: pushes, pulls, parked
//! updates, update plans, BSP completion, votes and commits, a migration's
//! source (`MoveOut`, `Relay`) and target (`MoveIn`), splits (`Split`) and
//! replicas (`Replica`). What is left here is the carrying out: digests for
//! bytes, messages for WRITEs, and the checks.

mod moves;
mod replica;
mod sparse;

pub(crate) use sparse::{SimTable, table_endpoint};

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use eps_core::{Answers, Arrival, Members, MoveIn, MoveOut, Next, Pending, PullStep, PushGate, RelayStep, ShardCore, push_gate};
use eps_proto::control::{ControlMsg, MigrationKeys, Order, Role, ShardEndpoint};
use eps_proto::migrate::SourceAction;
use eps_proto::spec::Consistency;
use eps_proto::sync::ShardSync;

use crate::net::{Msg, Node, h2};
use crate::{World, units};
use replica::Rep;

/// One held shard.
#[derive(Debug)]
struct Shard {
    /// First element and elements.
    span: (u64, u64),
    /// Its consistency state and parked updates: `eps-server`'s own.
    core: ShardCore,
    /// Value of each version held (a digest per unit).
    vals: BTreeMap<u64, Vec<u64>>,
    /// Per worker rank: (iteration, gradient digest per unit) in its landing slot.
    landing: Vec<Option<(u64, Vec<u64>)>>,
    /// The digests of forwards parked or applying, by the version each produces.
    forwards: BTreeMap<u64, Vec<u64>>,
    /// SSP/ASP: relayed contributions parked or applying, in arrival order
    /// (worker, iteration, digest).
    relayed: VecDeque<(u32, u64, Vec<u64>)>,
    out: Option<MoveOut>,
    /// Migration target: (source, snapshot landed).
    incoming: Option<MoveIn<()>>,
    /// A split ordered.
    split: Option<eps_core::Split>,
    /// Its part in replication (`job.replicas = 2`).
    replica: Rep,
}

impl Shard {
    fn new(span: (u64, u64), sync: ShardSync, ranks: u32) -> Self {
        Self::with_core(span, ShardCore::new(sync), ranks)
    }

    fn with_core(span: (u64, u64), core: ShardCore, ranks: u32) -> Self {
        Self {
            span,
            core,
            vals: BTreeMap::new(),
            landing: vec![None; ranks as usize],
            forwards: BTreeMap::new(),
            relayed: VecDeque::new(),
            out: None,
            incoming: None,
            split: None,
            replica: Rep::none(),
        }
    }

    fn units(&self) -> std::ops::Range<usize> {
        units(self.span.0, self.span.1)
    }
}

/// One server.
#[derive(Debug)]
pub(crate) struct SimServer {
    pub(crate) rank: u32,
    shards: BTreeMap<u32, Shard>,
    members: Members,
    pub(crate) retired: bool,
    /// Workers whose connection closed.
    dead: BTreeSet<u32>,
    /// Servers whose connection failed (they crashed).
    gone: BTreeSet<u32>,
    /// Pushes answered "moved", pull WRITEs in flight.
    answers: Answers,
    /// Copies of a shard released here whose landing slots are kept.
    released: BTreeMap<u32, u32>,
    ranks: u32,
    mode: Consistency,
    /// Its part of the job's sparse table, if it has one.
    pub(crate) table: Option<SimTable>,
}

pub(crate) fn endpoint(shard: u32, owner: u32) -> ShardEndpoint {
    ShardEndpoint { shard, owner, landing: Vec::new(), published_addr: 0, published_rkey: 0 }
}

impl SimServer {
    /// A server holding `shards` (id, first element, elements) at version `at`
    /// (unit values from `init`), and the backups of `backups` (the same, and
    /// the owner's rank).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        rank: u32,
        mode: Consistency,
        ranks: u32,
        workers: u32,
        at: u64,
        shards: &[(u32, u64, u64)],
        backups: &[(u32, u64, u64, u32)],
        init: impl Fn(usize) -> u64,
    ) -> Self {
        let mut s = Self {
            rank,
            shards: BTreeMap::new(),
            members: Members::new(workers).expect("at least one worker"),
            retired: false,
            released: BTreeMap::new(),
            dead: BTreeSet::new(),
            gone: BTreeSet::new(),
            answers: Answers::default(),
            ranks,
            mode,
            table: None,
        };
        for &(id, start, len) in shards {
            let mut sh = Shard::new((start, len), ShardSync::at_version(mode, ranks, at), ranks);
            sh.vals.insert(at, units(start, len).map(&init).collect());
            s.shards.insert(id, sh);
        }
        for &(id, start, len, primary) in backups {
            // `eps-server`: forwards bring it up from version 0; it serves
            // nothing until promoted.
            let mut sh = Shard::new((start, len), ShardSync::backup(Consistency::Bsp, ranks, at), ranks);
            sh.vals.insert(at, units(start, len).map(&init).collect());
            sh.incoming = Some(MoveIn::landed_from(primary, ()));
            sh.replica = Rep::backup(primary, false);
            s.shards.insert(id, sh);
        }
        s
    }

    /// Whether this server can serve version `need` of `shard` (now or once it
    /// has it): it holds the shard and neither a migration nor a snapshot floor
    /// refuses the version.
    pub(crate) fn serves(&self, shard: u32, need: u64) -> bool {
        self.shards.get(&shard).is_some_and(|sh| sh.core.sync.serves(need) && !Self::refuses(sh, need))
    }

    /// Whether a move or a backup not yet synced refuses version `need` of
    /// a shard whose state would serve it.
    fn refuses(sh: &Shard, need: u64) -> bool {
        sh.out.as_ref().is_some_and(|o| o.refuses(need))
            || (sh.replica.is_backup() && sh.incoming.as_ref().is_some_and(|m| !m.landed()))
    }

    /// Whether this server can serve version `need` of alignment unit `unit`
    /// (through any shard that holds it).
    pub(crate) fn serves_unit(&self, unit: usize, need: u64) -> bool {
        self.shards.iter().any(|(&id, sh)| sh.units().contains(&unit) && self.serves(id, need))
    }

    /// Held shards with their version and migration state, for a stall report.
    pub(crate) fn describe(&self) -> String {
        let mut t = format!(
            "{}hold {:?}, lost {:?}, dead {:?}; ",
            if self.retired { "retired; " } else { "" },
            self.members.hold(),
            self.members.lost(),
            self.dead
        );
        for (id, sh) in &self.shards {
            t += &format!(
                "[shard {id} units {:?} v{} waiting {} out {:?} in {:?} split {:?} replica {:?} slots {:?}] ",
                sh.units(),
                sh.core.sync.version(),
                sh.core.parked_len(),
                sh.out.as_ref().map(|o| (o.source().phase(), o.to(), o.snapshotting(), o.busy())),
                sh.incoming,
                sh.split,
                sh.replica,
                sh.landing.iter().enumerate().filter_map(|(r, l)| l.as_ref().map(|l| (r, l.0))).collect::<Vec<_>>()
            );
        }
        if let Some(tb) = &self.table {
            t += &tb.describe();
        }
        t
    }

    /// Handles one delivery.
    pub(crate) fn handle(&mut self, w: &mut World, from: Node, msg: Msg) {
        if self.retired {
            return;
        }
        match msg {
            Msg::Push { w: r, shard, t, token } => self.on_push(w, r, shard, t, token),
            Msg::PullReq { w: r, shard, need } => self.on_pull_req(w, r, shard, need),
            Msg::Read { w: r, shard } => self.on_read(w, r, shard),
            Msg::ConnLost { w: r } => self.drop_conn(w, r),
            Msg::PullWritten { shard, w: r, v } => self.on_pull_written(w, shard, r, v),
            Msg::Snapshot { shard, v, value, clocks } => self.on_snapshot(w, from, shard, v, value, &clocks),
            Msg::Relayed { shard, w: r, t, digest } => self.on_relayed(w, from, shard, r, t, digest),
            Msg::SnapshotDone { shard } => self.on_snapshot_done(w, shard),
            // `Server::on_promote`: a promoted backup dropped its connections
            // from the lost owner; what it still sent does not land.
            Msg::Forward { shard, .. } if self.fenced(w, shard, from) => {}
            Msg::Forward { shard, v, digest } => self.on_forward(w, from, shard, v, digest),
            Msg::ForwardAck { shard, v } if self.forwards_to(shard, from) => self.replica_acked(w, shard, v),
            Msg::ForwardAck { shard, v } => self.on_ack(w, shard, v),
            Msg::ReplicaSnapshotDone { shard } => self.replica_snapshot_done(w, shard),
            Msg::ServerGone { s } => self.peer_gone(w, s),
            Msg::SparsePush { w: r, t, rows } => self.on_sparse_push(w, r, t, rows),
            Msg::SparsePull { w: r, v, keys } => self.on_sparse_pull(w, r, v, keys),
            Msg::RowsRead { from } => self.on_rows_read(w, from),
            Msg::Orders(os) => {
                for o in os {
                    self.on_order(w, o);
                }
            }
            m => w.fail(format!("server {} got {m:?}", self.rank)),
        }
    }

    fn me(&self) -> Node {
        Node::Server(self.rank)
    }

    /// Its part of the sparse table.
    pub(crate) fn table(&self) -> Option<&SimTable> {
        self.table.as_ref()
    }

    fn on_push(&mut self, w: &mut World, r: u32, id: u32, t: u64, token: Vec<u64>) {
        let me = self.me();
        let Some(sh) = self.shards.get_mut(&id) else {
            self.answers.moved(r, id);
            w.send(me, Node::Worker(r), Msg::Moved { shard: id, t });
            return;
        };
        let promoted = sh.replica.promoted();
        let bsp = self.mode == Consistency::Bsp;
        match push_gate(bsp, &sh.core.sync, sh.out.as_ref().map(MoveOut::source), promoted, t) {
            PushGate::Moved => {
                self.answers.moved(r, id);
                w.send(me, Node::Worker(r), Msg::Moved { shard: id, t });
                return;
            }
            PushGate::AlreadyApplied => return,
            PushGate::Take => {}
        }
        if token.len() != sh.units().len() {
            return w.fail(format!("server {}: push of shard {id} with {} unit digests", self.rank, token.len()));
        }
        let us = sh.units();
        match sh.core.take_push(&self.members, r, t) {
            Ok(due) => {
                sh.landing[r as usize] = Some((t, token));
                w.accept(r, us, t);
                match due {
                    None => {}
                    Some(p @ Pending::Update { one, .. }) if one.is_some() != bsp => self.update(w, id, p),
                    Some(p) => w.fail(format!("server {}: a {:?} push gave {p:?}", self.rank, self.mode)),
                }
            }
            Err(e) => w.fail(format!("server {}: push of worker {r}, shard {id}, iteration {t}: {e}", self.rank)),
        }
    }

    fn on_pull_req(&mut self, w: &mut World, r: u32, id: u32, need: u64) {
        let me = self.me();
        let moved = self.answers.pull_follows_moved(r, id);
        let step = match self.shards.get_mut(&id) {
            Some(sh) if !moved => {
                let refused = Self::refuses(sh, need);
                sh.core.pull(r, need, refused)
            }
            _ => Ok(PullStep::Moved),
        };
        match step {
            Ok(PullStep::Moved) => {
                w.send(me, Node::Worker(r), Msg::PullMoved { shard: id });
            }
            Ok(PullStep::Send(v)) => self.send_pull(w, r, id, v),
            Ok(PullStep::Wait) => {}
            Err(e) => w.fail(format!("server {}: pull of worker {r}, shard {id}, version {need}: {e}", self.rank)),
        }
    }

    /// ASP: a worker's READ of the shard's published copy.
    fn on_read(&mut self, w: &mut World, r: u32, id: u32) {
        let me = self.me();
        let Some(sh) = self.shards.get(&id) else {
            w.send(me, Node::Worker(r), Msg::PullMoved { shard: id });
            return;
        };
        let v = sh.core.sync.version();
        let Some(value) = sh.vals.get(&v).cloned() else {
            return w.fail(format!("server {}: shard {id} publishes version {v}, which it does not hold", self.rank));
        };
        w.send(me, Node::Worker(r), Msg::ReadDone { shard: id, v, value });
    }

    fn send_pull(&mut self, w: &mut World, r: u32, id: u32, v: u64) {
        let me = self.me();
        let Some(sh) = self.shards.get_mut(&id) else { return };
        if self.dead.contains(&r) {
            sh.core.sync.pull_written(v);
            return;
        }
        let Some(value) = sh.vals.get(&v).cloned() else {
            return w.fail(format!("server {} asked to send version {v} of shard {id}, which it does not hold", self.rank));
        };
        let at = w.send(me, Node::Worker(r), Msg::PullDone { shard: id, v, value });
        self.answers.posted(id, r, v);
        w.complete_after(me, Msg::PullWritten { shard: id, w: r, v }, at);
    }

    /// Worker `r`'s connection closed: its pending pulls go, and its pulls in
    /// flight release their buffers now (their completions may never come).
    fn drop_conn(&mut self, w: &mut World, r: u32) {
        self.dead.insert(r);
        for sh in self.shards.values_mut() {
            sh.core.sync.drop_pending(r);
        }
        for (id, r, v) in self.answers.orphaned(r) {
            self.on_pull_written(w, id, r, v);
        }
    }

    fn on_pull_written(&mut self, w: &mut World, id: u32, r: u32, v: u64) {
        if !self.answers.written(id, r, v) {
            return; // released when its connection closed
        }
        let Some(sh) = self.shards.get_mut(&id) else { return };
        sh.core.sync.pull_written(v);
        self.drain(w, id);
    }

    /// A snapshot or forward of the shard is in flight (to a move's target or
    /// to its backup): no update may run.
    fn busy(sh: &Shard) -> bool {
        sh.out.as_ref().is_some_and(MoveOut::busy) || sh.replica.busy()
    }

    fn update(&mut self, w: &mut World, id: u32, p: Pending) {
        let Some(sh) = self.shards.get_mut(&id) else { return };
        // `Server::update`: an SSP/ASP source after its cutover applies
        // nothing: it relays.
        if let (Pending::Update { one: Some(r), .. }, Some(relay)) = (p, sh.out.as_mut().and_then(MoveOut::relay)) {
            relay.take(r);
            return self.pump(w, id);
        }
        let busy = Self::busy(sh);
        if let Some(p) = sh.core.offer(p, busy) {
            self.apply(w, id, p);
        }
    }

    fn drain(&mut self, w: &mut World, id: u32) {
        loop {
            let Some(sh) = self.shards.get_mut(&id) else { return };
            let busy = Self::busy(sh);
            match sh.core.next(busy) {
                Next::Busy => return,
                Next::Idle => return self.try_split(w, id),
                Next::Apply(p) => self.apply(w, id, p),
            }
        }
    }

    fn apply(&mut self, w: &mut World, id: u32, p: Pending) {
        let rank = self.rank;
        let Some(sh) = self.shards.get_mut(&id) else { return };
        let plan = match sh.core.plan(p, &self.members) {
            Ok(plan) => plan,
            Err(e) => return w.fail(format!("server {rank}: shard {id}: {e}")),
        };
        let (version, next) = (plan.next - 1, plan.next);
        let Some(old) = sh.vals.get(&version).cloned() else {
            return w.fail(format!("server {rank}: shard {id} has no value for its version {version}"));
        };
        // SSP/ASP: one worker's contribution (from its slot, or relayed by
        // the shard's source), added.
        let one = match p {
            Pending::Update { iteration, one: Some(r) } => {
                Some((r, false, sh.landing[r as usize].take().filter(|(it, _)| *it == iteration)))
            }
            Pending::Forward { worker: Some(r), .. } => {
                Some((r, true, sh.relayed.pop_front().filter(|(x, _, _)| *x == r).map(|(_, t, tok)| (t, tok))))
            }
            _ => None,
        };
        if let Some((r, relayed, got)) = one {
            let Some((t, tok)) = got else {
                let what = if relayed { "a relayed contribution it did not get" } else { "a contribution not in its slot" };
                return w.fail(format!("server {rank}: shard {id} applies worker {r}'s {what} ({p:?})"));
            };
            let value: Vec<u64> = old.iter().zip(&tok).map(|(&o, &d)| o.wrapping_add(d)).collect();
            w.applied_one(r, sh.units().start, version, t, &tok, &value);
            sh.vals.insert(next, value);
            return self.finish(w, id, p, next, tok);
        }
        let mut applied = None;
        let digest = match p {
            Pending::Update { iteration, .. } => {
                let c = plan.contributors.into_owned();
                w.empty_updates += u64::from(c.is_empty());
                let mut d = vec![0u64; old.len()];
                for &r in &c {
                    match sh.landing[r as usize].take() {
                        Some((it, tok)) if it == iteration => {
                            for (d, tok) in d.iter_mut().zip(tok) {
                                *d = h2(*d, h2(u64::from(r), tok));
                            }
                        }
                        other => {
                            return w.fail(format!(
                                "server {rank}: shard {id} aggregates iteration {iteration} of {c:?} but worker {r}'s slot holds {other:?}"
                            ));
                        }
                    }
                }
                if let Some(r) = sh.landing.iter().position(Option::is_some) {
                    return w.fail(format!(
                        "server {rank}: shard {id} aggregated iteration {iteration} of {c:?}, leaving worker {r}'s contribution {:?} behind",
                        sh.landing[r]
                    ));
                }
                applied = Some((iteration, c));
                d
            }
            Pending::Forward { version: v, .. } => match sh.forwards.remove(&v) {
                Some(d) => d,
                None => return w.fail(format!("server {rank}: forward of version {v} of shard {id} without its digest")),
            },
        };
        let value: Vec<u64> = old.iter().zip(&digest).map(|(&o, &d)| h2(h2(o, version), d)).collect();
        sh.vals.insert(next, value);
        // A replicated shard serves the version once its backup has it.
        if let Some((iteration, c)) = applied
            && self.forward_to_backup(
                w,
                id,
                replica::Deferred { version: next, iteration, contributors: c, digest: digest.clone() },
            )
        {
            return;
        }
        self.finish(w, id, p, next, digest);
    }

    /// The end of an update that produced version `next`: the version is
    /// served (and forwarded, on a migration source), pulls go out, and the
    /// next iteration may complete.
    fn finish(&mut self, w: &mut World, id: u32, p: Pending, next: u64, digest: Vec<u64>) {
        let rank = self.rank;
        let Some(sh) = self.shards.get_mut(&id) else { return };
        if let Pending::Forward { worker: None, .. } = p {
            // `ShardSync::forwarded`: pushes held for the iteration the
            // forward applied are in it already.
            for l in sh.landing.iter_mut().filter(|l| l.as_ref().is_some_and(|(t, _)| *t + 1 == next)) {
                *l = None;
            }
        }
        sh.core.finished(p);
        if let Pending::Update { one: Some(r), .. } = p
            && !self.dead.contains(&r)
        {
            w.send(self.me(), Node::Worker(r), Msg::Credit { shard: id });
        }
        let Some(sh) = self.shards.get_mut(&id) else { return };
        let first = sh.units().start;
        let Some(value) = sh.vals.get(&next).cloned() else {
            return w.fail(format!("server {rank}: shard {id} lost version {next} before serving it"));
        };
        // `Server::finish_update`: a checkpoint due at this version is saved now.
        w.save_if_due(rank, id, first, next, &value);
        w.publish(rank, id, first, next, &value);
        self.after_apply(w, id, p, next, digest);
        let mut ready = Vec::new();
        if let Some(sh) = self.shards.get_mut(&id) {
            sh.core.sync.ready_pulls(&mut ready);
        }
        for (r, v) in ready {
            self.send_pull(w, r, id, v);
        }
        // `Server::apply`: an iteration whose every contributor was removed is
        // complete at once.
        self.try_complete(w, id);
        self.try_split(w, id);
    }

    fn after_apply(&mut self, w: &mut World, id: u32, p: Pending, version: u64, digest: Vec<u64>) {
        let me = self.me();
        let Some(sh) = self.shards.get_mut(&id) else { return };
        if let Some(out) = sh.out.as_mut()
            && let Some(version) = out.applied(version)
        {
            w.send(me, Node::Server(out.to()), Msg::Forward { shard: id, v: version, digest });
            out.forward_sent(version);
        }
        if let (Pending::Forward { .. }, Some(from)) = (p, sh.incoming.as_ref().filter(|m| m.landed()).map(MoveIn::from)) {
            w.send(me, Node::Server(from), Msg::ForwardAck { shard: id, v: version });
            self.try_complete(w, id);
        }
    }

    /// Aggregates the shard's current iteration if every contribution it expects
    /// is in and its contributor set is settled.
    fn try_complete(&mut self, w: &mut World, id: u32) {
        let Some(sh) = self.shards.get(&id) else { return };
        // `Server::try_complete`: not while an update waits for the backup's
        // acknowledgement (its slots are not freed yet).
        if sh.replica.waiting().is_some() {
            return;
        }
        if let Some(p) = sh.core.completes(&self.members) {
            self.update(w, id, p);
        }
    }
}
