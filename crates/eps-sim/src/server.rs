//! A server as the simulation runs it: the decisions of `eps-server` (push and
//! pull handling, held updates, the migration source and target, membership
//! votes and commits, splits, backups and their promotion) over the same
//! protocol cores, with a 64-bit digest per alignment unit standing in for each
//! shard's parameters.

mod moves;
mod replica;

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use eps_proto::control::{ControlMsg, MigrationKeys, Order, Role, ShardEndpoint};
use eps_proto::membership::Membership;
use eps_proto::migrate::{Source, SourceAction};
use eps_proto::serve::{PushGate, push_gate};
use eps_proto::spec::Consistency;
use eps_proto::sync::{PushOutcome, ShardSync};

use crate::net::{Msg, Node, h2};
use crate::{World, units};
use replica::Rep;

/// An update waiting for its shard to be free.
#[derive(Clone, Debug)]
enum Pending {
    /// Aggregate this iteration's contributions.
    Update(u64),
    /// Replay the source's update producing version `v`.
    Forward { v: u64, digest: Vec<u64> },
}

/// The source side of a migration.
#[derive(Debug)]
struct Out {
    src: Source,
    to: u32,
    snapshot_busy: bool,
    forward_busy: bool,
    last_forward: u64,
}

/// One held shard.
#[derive(Debug)]
struct Shard {
    /// First element and elements.
    span: (u64, u64),
    sync: ShardSync,
    /// Value of each version held (a digest per unit).
    vals: BTreeMap<u64, Vec<u64>>,
    /// Per worker rank: (iteration, gradient digest per unit) in its landing slot.
    landing: Vec<Option<(u64, Vec<u64>)>>,
    waiting: VecDeque<Pending>,
    out: Option<Out>,
    /// Migration target: (source, snapshot landed).
    incoming: Option<(u32, bool)>,
    /// A split ordered: (first element of the upper part, lower id, upper id).
    split: Option<(u64, u32, u32)>,
    /// Its part in replication (`job.replicas = 2`).
    replica: Option<Rep>,
}

impl Shard {
    fn new(span: (u64, u64), sync: ShardSync, ranks: u32) -> Self {
        Self {
            span,
            sync,
            vals: BTreeMap::new(),
            landing: vec![None; ranks as usize],
            waiting: VecDeque::new(),
            out: None,
            incoming: None,
            split: None,
            replica: None,
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
    membership: Membership,
    hold: Option<u64>,
    lost: Vec<(u32, u64)>,
    pub(crate) retired: bool,
    /// Workers whose connection closed.
    dead: BTreeSet<u32>,
    /// Servers whose connection failed (they crashed).
    gone: BTreeSet<u32>,
    /// (worker, shard) whose last push was answered "moved".
    moved_pushes: BTreeSet<(u32, u32)>,
    /// Pull WRITEs posted and not completed: (worker, shard, version) -> count.
    pulls_out: BTreeMap<(u32, u32, u64), u32>,
    /// Copies of a shard released here whose landing slots are kept.
    released: BTreeMap<u32, u32>,
    ranks: u32,
}

pub(crate) fn endpoint(shard: u32, owner: u32) -> ShardEndpoint {
    ShardEndpoint { shard, owner, landing: Vec::new(), published_addr: 0, published_rkey: 0 }
}

impl SimServer {
    /// A server holding `shards` (id, first element, elements) at version `at`
    /// (unit values from `init`), and the backups of `backups` (the same, and
    /// the owner's rank).
    pub(crate) fn new(
        rank: u32,
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
            membership: Membership::new((0..workers).collect()).expect("at least one worker"),
            hold: None,
            lost: Vec::new(),
            retired: false,
            released: BTreeMap::new(),
            dead: BTreeSet::new(),
            gone: BTreeSet::new(),
            moved_pushes: BTreeSet::new(),
            pulls_out: BTreeMap::new(),
            ranks,
        };
        for &(id, start, len) in shards {
            let mut sh = Shard::new((start, len), ShardSync::at_version(Consistency::Bsp, ranks, at), ranks);
            sh.vals.insert(at, units(start, len).map(&init).collect());
            s.shards.insert(id, sh);
        }
        for &(id, start, len, primary) in backups {
            // `eps-server`: forwards bring it up from version 0; it serves
            // nothing until promoted.
            let mut sh = Shard::new((start, len), ShardSync::backup(Consistency::Bsp, ranks, at), ranks);
            sh.vals.insert(at, units(start, len).map(&init).collect());
            sh.incoming = Some((primary, true));
            sh.replica = Some(Rep::Backup { primary });
            s.shards.insert(id, sh);
        }
        s
    }

    /// Whether this server can serve version `need` of `shard` (now or once it
    /// has it): it holds the shard and neither a migration nor a snapshot floor
    /// refuses the version.
    pub(crate) fn serves(&self, shard: u32, need: u64) -> bool {
        self.shards.get(&shard).is_some_and(|sh| {
            sh.sync.serves(need)
                && sh.out.as_ref().is_none_or(|o| o.src.serves(need))
                && !(matches!(sh.replica, Some(Rep::Backup { .. }))
                    && sh.incoming == Some((sh.incoming.map_or(0, |i| i.0), false)))
        })
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
            self.hold,
            self.lost,
            self.dead
        );
        for (id, sh) in &self.shards {
            t += &format!(
                "[shard {id} units {:?} v{} waiting {} out {:?} in {:?} split {:?} replica {:?} slots {:?}] ",
                sh.units(),
                sh.sync.version(),
                sh.waiting.len(),
                sh.out.as_ref().map(|o| (o.src.phase(), o.to, o.snapshot_busy, o.forward_busy)),
                sh.incoming,
                sh.split,
                sh.replica,
                sh.landing.iter().enumerate().filter_map(|(r, l)| l.as_ref().map(|l| (r, l.0))).collect::<Vec<_>>()
            );
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
            Msg::ConnLost { w: r } => self.drop_conn(w, r),
            Msg::PullWritten { shard, w: r, v } => self.on_pull_written(w, shard, r, v),
            Msg::Snapshot { shard, v, value } => self.on_snapshot(w, shard, v, value),
            Msg::SnapshotDone { shard } => self.on_snapshot_done(w, shard),
            // `Server::on_promote`: a promoted backup dropped its connections
            // from the lost owner; what it still sent does not land.
            Msg::Forward { shard, .. } if self.fenced(w, shard, from) => {}
            Msg::Forward { shard, v, digest } => self.on_forward(w, shard, v, digest),
            Msg::ForwardAck { shard, v } if self.forwards_to(shard, from) => self.replica_acked(w, shard, v),
            Msg::ForwardAck { shard, v } => self.on_ack(w, shard, v),
            Msg::ReplicaSnapshotDone { shard } => self.replica_snapshot_done(w, shard),
            Msg::ServerGone { s } => self.peer_gone(w, s),
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

    fn on_push(&mut self, w: &mut World, r: u32, id: u32, t: u64, token: Vec<u64>) {
        let me = self.me();
        let Some(sh) = self.shards.get_mut(&id) else {
            self.moved_pushes.insert((r, id));
            w.send(me, Node::Worker(r), Msg::Moved { shard: id, t });
            return;
        };
        let promoted = sh.replica.as_ref().is_some_and(Rep::promoted);
        match push_gate(true, &sh.sync, sh.out.as_ref().map(|o| &o.src), promoted, t) {
            PushGate::Moved => {
                self.moved_pushes.insert((r, id));
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
        if self.hold.is_some_and(|h| t >= h) {
            match sh.sync.on_push_unsettled(r, t) {
                Ok(()) => {
                    sh.landing[r as usize] = Some((t, token));
                    w.accept(r, us, t);
                }
                Err(e) => w.fail(format!("server {}: push of worker {r}, shard {id}, iteration {t}: {e}", self.rank)),
            }
            return;
        }
        let c = sh.sync.contributors(&self.membership, &self.lost, t).into_owned();
        match sh.sync.on_push(r, t, &c) {
            Ok(PushOutcome::Wait) => {
                sh.landing[r as usize] = Some((t, token));
                w.accept(r, us, t);
            }
            Ok(PushOutcome::AggregateAll { iteration }) => {
                sh.landing[r as usize] = Some((t, token));
                w.accept(r, us, t);
                self.update(w, id, Pending::Update(iteration));
            }
            Ok(other) => w.fail(format!("server {}: BSP push gave {other:?}", self.rank)),
            Err(e) => w.fail(format!("server {}: push of worker {r}, shard {id}, iteration {t}: {e}", self.rank)),
        }
    }

    fn on_pull_req(&mut self, w: &mut World, r: u32, id: u32, need: u64) {
        let me = self.me();
        if self.moved_pushes.remove(&(r, id)) || !self.serves(id, need) {
            w.send(me, Node::Worker(r), Msg::PullMoved { shard: id });
            return;
        }
        let Some(sh) = self.shards.get_mut(&id) else { return };
        match sh.sync.on_pull(r, need) {
            Ok(Some(v)) => self.send_pull(w, r, id, v),
            Ok(None) => {}
            Err(e) => w.fail(format!("server {}: pull of worker {r}, shard {id}, version {need}: {e}", self.rank)),
        }
    }

    fn send_pull(&mut self, w: &mut World, r: u32, id: u32, v: u64) {
        let me = self.me();
        let Some(sh) = self.shards.get_mut(&id) else { return };
        if self.dead.contains(&r) {
            sh.sync.pull_written(v);
            return;
        }
        let Some(value) = sh.vals.get(&v).cloned() else {
            return w.fail(format!("server {} asked to send version {v} of shard {id}, which it does not hold", self.rank));
        };
        let at = w.send(me, Node::Worker(r), Msg::PullDone { shard: id, v, value });
        *self.pulls_out.entry((r, id, v)).or_insert(0) += 1;
        w.complete_after(me, Msg::PullWritten { shard: id, w: r, v }, at);
    }

    /// Worker `r`'s connection closed: its pending pulls go, and its pulls in
    /// flight release their buffers now (their completions may never come).
    fn drop_conn(&mut self, w: &mut World, r: u32) {
        self.dead.insert(r);
        for sh in self.shards.values_mut() {
            sh.sync.drop_pending(r);
        }
        let mine: Vec<((u32, u32, u64), u32)> =
            self.pulls_out.iter().filter(|((x, _, _), _)| *x == r).map(|(&k, &n)| (k, n)).collect();
        for ((r, id, v), n) in mine {
            for _ in 0..n {
                self.on_pull_written(w, id, r, v);
            }
        }
    }

    fn on_pull_written(&mut self, w: &mut World, id: u32, r: u32, v: u64) {
        match self.pulls_out.get_mut(&(r, id, v)) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                self.pulls_out.remove(&(r, id, v));
            }
            None => return, // released when its connection closed
        }
        let Some(sh) = self.shards.get_mut(&id) else { return };
        sh.sync.pull_written(v);
        self.drain(w, id);
    }

    fn free(&self, id: u32) -> bool {
        self.shards.get(&id).is_some_and(|sh| sh.sync.can_publish() && sh.waiting.is_empty() && !Self::busy(sh))
    }

    /// A snapshot or forward of the shard is in flight (to a move's target or
    /// to its backup): no update may run.
    fn busy(sh: &Shard) -> bool {
        sh.out.as_ref().is_some_and(|o| o.snapshot_busy || o.forward_busy) || sh.replica.as_ref().is_some_and(Rep::busy)
    }

    fn update(&mut self, w: &mut World, id: u32, p: Pending) {
        if !self.free(id) {
            if let Some(sh) = self.shards.get_mut(&id) {
                sh.sync.set_publish_waiting(true);
                let again =
                    matches!(p, Pending::Update(t) if sh.waiting.iter().any(|q| matches!(q, Pending::Update(u) if *u == t)));
                if !again {
                    sh.waiting.push_back(p);
                }
            }
            return;
        }
        self.apply(w, id, p);
    }

    fn drain(&mut self, w: &mut World, id: u32) {
        loop {
            let Some(sh) = self.shards.get_mut(&id) else { return };
            if !sh.sync.can_publish() || Self::busy(sh) {
                return;
            }
            let Some(p) = sh.waiting.pop_front() else { return self.try_split(w, id) };
            sh.sync.set_publish_waiting(!sh.waiting.is_empty());
            self.apply(w, id, p);
        }
    }

    fn apply(&mut self, w: &mut World, id: u32, p: Pending) {
        let rank = self.rank;
        let Some(sh) = self.shards.get_mut(&id) else { return };
        let version = sh.sync.version();
        let next = version + 1;
        let Some(old) = sh.vals.get(&version).cloned() else {
            return w.fail(format!("server {rank}: shard {id} has no value for its version {version}"));
        };
        let mut applied = None;
        let digest = match p.clone() {
            Pending::Update(iteration) => {
                if iteration != version {
                    return w.fail(format!("server {rank}: shard {id} aggregates iteration {iteration} at version {version}"));
                }
                let c = sh.sync.contributors(&self.membership, &self.lost, iteration).into_owned();
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
            Pending::Forward { v, digest } => {
                if v != next {
                    return w.fail(format!("server {rank}: forward of version {v} of shard {id} applied at version {version}"));
                }
                digest
            }
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
        match p {
            Pending::Update(_) => sh.sync.published(None),
            Pending::Forward { .. } => {
                // `ShardSync::forwarded`: pushes held for the iteration the
                // forward applied are in it already.
                for l in sh.landing.iter_mut().filter(|l| l.as_ref().is_some_and(|(t, _)| *t + 1 == next)) {
                    *l = None;
                }
                sh.sync.forwarded()
            }
        };
        sh.sync.set_publish_waiting(!sh.waiting.is_empty());
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
            sh.sync.ready_pulls(&mut ready);
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
            && let Some(SourceAction::Forward { version }) = out.src.on_applied(version)
        {
            w.send(me, Node::Server(out.to), Msg::Forward { shard: id, v: version, digest });
            out.forward_busy = true;
            out.last_forward = version;
        }
        if let (Pending::Forward { .. }, Some((from, true))) = (p, sh.incoming) {
            w.send(me, Node::Server(from), Msg::ForwardAck { shard: id, v: version });
            self.try_complete(w, id);
        }
    }

    /// Aggregates the shard's current iteration if every contribution it expects
    /// is in and its contributor set is settled.
    fn try_complete(&mut self, w: &mut World, id: u32) {
        let Some(sh) = self.shards.get(&id) else { return };
        let v = sh.sync.version();
        // `Server::try_complete`: not while an update waits for the backup's
        // acknowledgement (its slots are not freed yet).
        if self.hold.is_some_and(|h| v >= h) || matches!(sh.replica, Some(Rep::Primary { waiting: Some(_), .. })) {
            return;
        }
        let c = sh.sync.contributors(&self.membership, &self.lost, v);
        if let Some(t) = sh.sync.complete(&c) {
            self.update(w, id, Pending::Update(t));
        }
    }
}
