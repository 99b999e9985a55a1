//! Backups as `eps-server` keeps them (`job.replicas = 2`): the owner forwards
//! each update's digest to the shard's backup and serves the version only once
//! the backup acknowledged it; a new backup starts from the owner's snapshot; a
//! backup is promoted when its owner is lost; pushes sent again to a promoted
//! backup for an iteration it applied already are ignored.

use eps_core::replica::Alone;
use eps_proto::control::{ControlMsg, MigrationKeys};

use super::{Pending, Shard, SimServer, endpoint};
use crate::World;
use crate::net::{Msg, Node};

/// An update applied whose version waits for the backup's acknowledgement.
#[derive(Clone, Debug)]
pub(crate) struct Deferred {
    pub(crate) version: u64,
    /// The iteration aggregated and its contributors.
    pub(crate) iteration: u64,
    pub(crate) contributors: Vec<u32>,
    pub(crate) digest: Vec<u64>,
}

/// A shard's part in replication: `eps_core::Replica`, as `eps-server`
/// keeps it; the owner reaches its backup by the backup's server rank.
pub(crate) type Rep = eps_core::Replica<u32, Deferred>;

const KEYS: MigrationKeys = MigrationKeys { state_addr: 0, state_rkey: 0, grad_addr: 0, grad_rkey: 0 };

impl SimServer {
    /// Whether `from` is the backup shard `id` forwards to (its
    /// acknowledgements are the replica's, not a move's).
    pub(super) fn forwards_to(&self, id: u32, from: Node) -> bool {
        let to = self.shards.get(&id).and_then(|sh| sh.replica.link());
        to.is_some_and(|&to| Node::Server(to) == from)
    }

    /// A job with replicas: the shards this server starts with apply no
    /// update before it hears of their backups.
    pub(crate) fn await_backups(&mut self) {
        for sh in self.shards.values_mut().filter(|sh| sh.replica.role().is_none()) {
            sh.replica = Rep::awaited();
        }
    }

    /// Whether a forward of shard `id` from `from` comes from a crashed owner
    /// whose backup here was promoted (its connection was dropped then).
    pub(super) fn fenced(&self, w: &World, id: u32, from: Node) -> bool {
        let Node::Server(f) = from else { return false };
        let promoted = self
            .shards
            .get(&id)
            .is_none_or(|sh| (sh.replica.promoted() && !sh.replica.is_backup()) || sh.replica.link().is_some());
        w.crashed(f) && promoted
    }

    /// Tells the control plane about the backups held here (at the start).
    pub(crate) fn report_backups(&mut self, w: &mut World) {
        let ids: Vec<u32> = self.shards.iter().filter(|(_, sh)| sh.replica.is_backup()).map(|(&id, _)| id).collect();
        for id in ids {
            if let Err(e) = w.ctl(&ControlMsg::BackupReady { endpoint: endpoint(id, self.rank), keys: KEYS }) {
                return w.fail(format!("server {}: backup of shard {id} refused: {e}", self.rank));
            }
        }
    }

    /// After an update of a replicated shard: forwards its digest and defers
    /// the version. False when the shard has no backup (finish now).
    pub(super) fn forward_to_backup(&mut self, w: &mut World, id: u32, d: Deferred) -> bool {
        let me = self.me();
        let Some(sh) = self.shards.get_mut(&id) else { return false };
        let Some(&to) = sh.replica.link() else { return false };
        w.send(me, Node::Server(to), Msg::Forward { shard: id, v: d.version, digest: d.digest.clone() });
        if sh.replica.defer(d).is_err() {
            w.fail(format!("server {}: shard {id} forwarded to its backup with a forward in flight", self.rank));
        }
        true
    }

    /// The backup acknowledged version `v`: it is served.
    pub(super) fn replica_acked(&mut self, w: &mut World, id: u32, v: u64) {
        let Some(sh) = self.shards.get_mut(&id) else { return };
        match sh.replica.waiting() {
            Some(d) if d.version == v => {}
            d => return w.fail(format!("server {}: backup acknowledged version {v} of shard {id}, waited {d:?}", self.rank)),
        }
        let (d, stopped) = sh.replica.acked();
        if stopped {
            self.stopped_replicating(w, id);
        }
        if let Some(d) = d {
            self.finish(w, id, Pending::Update { iteration: d.iteration, one: None }, d.version, d.digest);
        }
        self.drain(w, id);
    }

    /// The snapshot for shard `id`'s new backup is written: updates go on.
    pub(super) fn replica_snapshot_done(&mut self, w: &mut World, id: u32) {
        if self.shards.get_mut(&id).is_some_and(|sh| sh.replica.snapshot_done()) {
            self.stopped_replicating(w, id);
        }
        self.drain(w, id);
    }

    /// Server `s` crashed (its connection failed): shards replicated there go
    /// on alone (what waited for its acknowledgement is served).
    pub(super) fn peer_gone(&mut self, w: &mut World, s: u32) {
        self.gone.insert(s);
        let ids: Vec<u32> = self.shards.iter().filter(|(_, sh)| sh.replica.link() == Some(&s)).map(|(&id, _)| id).collect();
        for id in ids {
            let Some(sh) = self.shards.get_mut(&id) else { continue };
            if let Some(d) = sh.replica.link_lost() {
                self.finish(w, id, Pending::Update { iteration: d.iteration, one: None }, d.version, d.digest);
            }
            self.drain(w, id);
        }
        if self.shards.values().any(|sh| {
            sh.out.as_ref().is_some_and(|o| o.to() == s)
                || sh.incoming.as_ref().is_some_and(|i| i.from() == s && sh.replica.role().is_none())
        }) {
            w.fail(format!("server {}: server {s} crashed during a move (not modelled)", self.rank));
        }
    }

    /// The control plane orders shard `id`'s forwards to its backup on `to`
    /// (after a snapshot of the shard, for a new backup).
    pub(super) fn on_replicate(&mut self, w: &mut World, id: u32, to: u32, snapshot: bool) {
        let me = self.me();
        let Some(sh) = self.shards.get_mut(&id) else {
            return w.fail(format!("server {}: ordered to replicate shard {id}, which is not here", self.rank));
        };
        let (waiting, promoted) = sh.replica.replace();
        if let Some(d) = waiting {
            // A new backup replaces one that never acknowledged: the update it
            // waited for is served, and the snapshot below holds it.
            self.finish(w, id, Pending::Update { iteration: d.iteration, one: None }, d.version, d.digest);
        }
        let Some(sh) = self.shards.get_mut(&id) else { return };
        if self.gone.contains(&to) {
            // `forward_conn`: the backup's server cannot be reached; the shard
            // goes on without one (the control plane declares it lost).
            sh.replica.unreachable(promoted);
            return self.drain(w, id);
        }
        if snapshot {
            let v = sh.core.sync.version();
            let Some(value) = sh.vals.get(&v).cloned() else {
                return w.fail(format!("server {}: shard {id} has no value at version {v}", self.rank));
            };
            let at = w.send(me, Node::Server(to), Msg::Snapshot { shard: id, v, value, clocks: Vec::new() });
            w.complete_after(me, Msg::ReplicaSnapshotDone { shard: id }, at);
        }
        sh.replica.forward_to(to, snapshot, promoted);
        self.drain(w, id);
    }

    /// Shard `id` has no backup and none can be made: it is served alone.
    pub(super) fn on_no_backup(&mut self, w: &mut World, id: u32) {
        let Some(sh) = self.shards.get_mut(&id) else { return };
        let d = match sh.replica.no_backup() {
            Ok(Alone::Now(d)) => d,
            Ok(Alone::Already) => return,
            Err(e) => return w.fail(format!("server {}: shard {id}: {e}", self.rank)),
        };
        if let Some(d) = d {
            self.finish(w, id, Pending::Update { iteration: d.iteration, one: None }, d.version, d.digest);
        }
        self.drain(w, id);
    }

    /// The control plane orders a new backup of shard `id` here (after a loss).
    pub(super) fn on_add_backup(&mut self, w: &mut World, id: u32, from: u32, start: u64, len: u64) {
        if self.shards.contains_key(&id) {
            return w.fail(format!("server {}: ordered to keep a backup of shard {id}, which is here", self.rank));
        }
        let mut sh =
            Shard::new((start, len), eps_proto::sync::ShardSync::incoming(super::Consistency::Bsp, self.ranks, 0), self.ranks);
        sh.incoming = Some(eps_core::MoveIn::new(from));
        sh.replica = Rep::backup(from, true);
        self.shards.insert(id, sh);
        if let Err(e) = w.ctl(&ControlMsg::BackupReady { endpoint: endpoint(id, self.rank), keys: KEYS }) {
            w.fail(format!("server {}: backup of shard {id} refused: {e}", self.rank));
        }
    }

    /// Shard `id`'s owner was lost: this backup owns it from now on.
    pub(super) fn on_promote(&mut self, w: &mut World, id: u32) {
        let Some(sh) = self.shards.get_mut(&id) else {
            return w.fail(format!("server {}: promoted for shard {id}, which has no backup here", self.rank));
        };
        // Only a backup whose owner crashed is promoted.
        match sh.replica.promote() {
            Some(primary) if w.crashed(primary) => {}
            r => return w.fail(format!("server {}: promoted for shard {id} (owner {r:?}), its owner did not crash", self.rank)),
        }
        sh.core.sync.caught_up();
        sh.incoming = None;
        w.report.promotions += 1;
        self.try_complete(w, id);
    }

    /// Stop forwarding shard `id` to its backup once nothing is in flight.
    pub(super) fn on_unreplicate(&mut self, w: &mut World, id: u32) {
        if self.shards.get_mut(&id).is_some_and(|sh| !sh.replica.unreplicate()) {
            return;
        }
        self.stopped_replicating(w, id);
        self.drain(w, id);
    }

    fn stopped_replicating(&mut self, w: &mut World, id: u32) {
        if let Err(e) = w.ctl(&ControlMsg::Unreplicated { shard: id, rank: self.rank }) {
            w.fail(format!("server {}: the control plane refused shard {id}'s unreplication: {e}", self.rank));
        }
    }

    /// The control plane orders this server's backup of shard `id` freed.
    pub(super) fn on_drop_backup(&mut self, w: &mut World, id: u32) {
        match self.shards.get(&id).map(|sh| sh.replica.is_backup()) {
            None => {}
            Some(true) => {
                self.shards.remove(&id);
            }
            Some(false) => {
                w.fail(format!("server {}: told to drop its copy of shard {id} (a move's target: not modelled)", self.rank))
            }
        }
    }

    /// What a crash of this server loses of workers' pushes: contributions in
    /// its landing slots, and those of an update whose forward to the backup
    /// was cut (`cut`: what the crash kept from landing). As (worker, units,
    /// iteration).
    pub(crate) fn crash_losses(&self, cut: &[(Node, Node, Msg)]) -> Vec<(u32, std::ops::Range<usize>, u64)> {
        let mut out = Vec::new();
        for (&id, sh) in &self.shards {
            for (r, l) in sh.landing.iter().enumerate() {
                if let Some((t, _)) = l {
                    out.push((r as u32, sh.units(), *t));
                }
            }
            if let Some(d) = sh.replica.waiting() {
                let forward_cut =
                    cut.iter().any(|(_, _, m)| matches!(m, Msg::Forward { shard, v, .. } if *shard == id && *v == d.version));
                if forward_cut {
                    out.extend(d.contributors.iter().map(|&r| (r, sh.units(), d.iteration)));
                }
            }
        }
        out
    }
}
