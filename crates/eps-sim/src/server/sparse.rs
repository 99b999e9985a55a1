//! A server's part of the job's sparse table, as `eps-server`'s
//! `sparse.rs` and `buckets.rs` run it, with a 64-bit digest standing in
//! for each row. Whether a request goes on, waits or is refused, what a
//! bucket map moves, and when the leaving rows may go are `eps-core`'s
//! decisions (`eps_core::buckets`); pushes and pulls go through the part's
//! `ShardSync`, as a dense shard's do.

use std::collections::BTreeMap;

use eps_core::buckets::{self, BucketsIn, Leaving, SparseGate, SparseGuard, SparseReq};
use eps_proto::control::{ControlMsg, ShardEndpoint};
use eps_proto::spec::Consistency;
use eps_proto::sync::{PushOutcome, ShardSync};

use super::SimServer;
use crate::World;
use crate::net::{Msg, Node, h2};
use crate::sparse::row_init;

/// Rows of a request: key and digest (a gradient's, or a row's).
type Rows = Vec<(u64, u64)>;

/// A request held until a bucket vote or move ends.
#[derive(Clone, Debug)]
enum Req {
    Push { t: u64, rows: Rows },
    Pull { v: u64, keys: Vec<u64> },
}

/// The server's part of the table.
#[derive(Debug)]
pub(crate) struct SimTable {
    sync: ShardSync,
    /// The rows held: a digest per key.
    rows: BTreeMap<u64, u64>,
    /// The bucket maps known, by first iteration.
    owners: Vec<(u64, Vec<u32>)>,
    /// Requests held, in arrival order: (worker, request).
    deferred: Vec<(u32, Req)>,
    incoming: Option<BucketsIn>,
    /// Buckets leaving, until their rows are taken out.
    leaving: Option<Leaving>,
    /// By worker rank: the push in its landing region (iteration, key and
    /// gradient digest), and the keys of its pull waiting for a version.
    pushes: Vec<Option<(u64, Rows)>>,
    pulls: Vec<Option<Vec<u64>>>,
}

impl SimTable {
    /// An empty part at version 0 of a job that started on `servers` servers.
    pub(crate) fn new(mode: Consistency, ranks: u32, servers: u32) -> Self {
        Self {
            sync: ShardSync::new(mode, ranks),
            rows: BTreeMap::new(),
            owners: vec![(0, eps_proto::buckets::initial_owners(servers))],
            deferred: Vec::new(),
            incoming: None,
            leaving: None,
            pushes: vec![None; ranks as usize],
            pulls: vec![None; ranks as usize],
        }
    }

    /// Its version and where its rows stand, for a stall report.
    pub(crate) fn describe(&self) -> String {
        format!(
            "[table v{} rows {} held {} in {:?} leaving {:?} pushes {:?}]",
            self.sync.version(),
            self.rows.len(),
            self.deferred.len(),
            self.incoming.as_ref().map(|i| (i.at, i.sources().to_vec())),
            self.leaving.as_ref().map(|l| (l.at, l.targets.clone())),
            self.pushes.iter().enumerate().filter_map(|(r, p)| p.as_ref().map(|p| (r, p.0))).collect::<Vec<_>>()
        )
    }

    /// The rows held, for the end check.
    pub(crate) fn rows(&self) -> &BTreeMap<u64, u64> {
        &self.rows
    }

    pub(crate) fn sync(&self) -> &ShardSync {
        &self.sync
    }
}

/// The endpoint a server reports for its part (`TablesReady`).
pub(crate) fn table_endpoint(rank: u32, ranks: u32) -> ShardEndpoint {
    ShardEndpoint { shard: 0, owner: rank, landing: vec![(0, 0); ranks as usize], published_addr: 0, published_rkey: 0 }
}

impl SimServer {
    /// Worker `r`'s push of iteration `t` (key and gradient digest per row)
    /// landed.
    pub(super) fn on_sparse_push(&mut self, w: &mut World, r: u32, t: u64, rows: Vec<(u64, u64)>) {
        self.on_sparse(w, r, Req::Push { t, rows });
    }

    /// Worker `r` asks for version `v` of the rows of `keys`.
    pub(super) fn on_sparse_pull(&mut self, w: &mut World, r: u32, v: u64, keys: Vec<u64>) {
        self.on_sparse(w, r, Req::Pull { v, keys });
    }

    fn on_sparse(&mut self, w: &mut World, r: u32, req: Req) {
        let rank = self.rank;
        let Some(tb) = self.table.as_mut() else {
            return w.fail(format!("server {rank}: a sparse request from worker {r}, with no table"));
        };
        let keys: Vec<u64> = match &req {
            Req::Push { rows, .. } => rows.iter().map(|&(k, _)| k).collect(),
            Req::Pull { keys, .. } => keys.clone(),
        };
        let (push, seq) = match req {
            Req::Push { t, .. } => (true, t),
            Req::Pull { v, .. } => (false, v),
        };
        let guard = SparseGuard {
            me: rank,
            mode: self.mode,
            history: &tb.owners,
            hold: self.members.hold(),
            incoming: tb.incoming.as_ref(),
            giving: tb.leaving.is_some(),
        };
        match guard.gate(SparseReq { push, seq, keys: &keys }) {
            SparseGate::Hold => return tb.deferred.push((r, req)),
            // `eps-server` closes the worker's connection: the job fails.
            SparseGate::Foreign(k) => {
                return w.fail(format!(
                    "server {rank}: worker {r}'s sparse {} of {seq} has key {k}, which belongs to another server",
                    if push { "push" } else { "pull" }
                ));
            }
            SparseGate::Go => {}
        }
        match req {
            Req::Push { t, rows } => {
                tb.pushes[r as usize] = Some((t, rows.clone()));
                w.sparse_accept(r, t, &keys);
                let contributors = self.members.contributors(&tb.sync, t).into_owned();
                match tb.sync.on_push(r, t, &contributors) {
                    Ok(PushOutcome::AggregateAll { iteration }) if self.mode == Consistency::Bsp => {
                        self.sparse_update(w, iteration, &contributors)
                    }
                    Ok(PushOutcome::ApplyOne { worker, .. }) if self.mode != Consistency::Bsp => self.sparse_apply_one(w, worker),
                    Ok(PushOutcome::Wait) => {}
                    Ok(o) => w.fail(format!("server {rank}: a {:?} sparse push gave {o:?}", self.mode)),
                    Err(e) => w.fail(format!("server {rank}: sparse push of worker {r}, iteration {t}: {e}")),
                }
            }
            Req::Pull { v, keys } => {
                tb.pulls[r as usize] = Some(keys);
                match tb.sync.on_pull(r, v) {
                    Ok(Some(v)) => self.sparse_answer(w, r, v),
                    Ok(None) => {}
                    Err(e) => w.fail(format!("server {rank}: sparse pull of worker {r}, version {v}: {e}")),
                }
            }
        }
    }

    /// `Server::on_members`: the table's iteration completes if a lost
    /// worker's push was all it waited for.
    pub(super) fn sparse_complete(&mut self, w: &mut World) {
        let Some(tb) = self.table.as_ref() else { return };
        if let Some((t, c)) = self.members.complete(&tb.sync) {
            let c = c.into_owned();
            self.sparse_update(w, t, &c);
        }
    }

    /// BSP: every contributor's push of `t` is in: each key's gradients
    /// merged in rank order, one step per key, credits, waiting pulls.
    fn sparse_update(&mut self, w: &mut World, t: u64, contributors: &[u32]) {
        let rank = self.rank;
        let Some(tb) = self.table.as_mut() else { return };
        let mut merged: BTreeMap<u64, u64> = BTreeMap::new();
        for &c in contributors {
            match tb.pushes[c as usize].take() {
                Some((it, rows)) if it == t => {
                    for (k, g) in rows {
                        let d = merged.entry(k).or_insert(0);
                        *d = h2(*d, h2(u64::from(c), g));
                    }
                }
                other => {
                    return w.fail(format!(
                        "server {rank}: the table aggregates iteration {t} of {contributors:?} but worker {c}'s push is {other:?}"
                    ));
                }
            }
        }
        if let Some(r) = tb.pushes.iter().position(Option::is_some) {
            return w.fail(format!("server {rank}: the table aggregated iteration {t}, leaving worker {r}'s push behind"));
        }
        for (k, d) in merged {
            let row = tb.rows.entry(k).or_insert_with(|| row_init(k));
            *row = h2(h2(*row, t), d);
        }
        tb.sync.published(None);
        self.after_sparse_update(w, contributors);
    }

    /// After an update of the table: buckets whose cutover it reached leave,
    /// the contributors' push regions are credited, and the pulls that
    /// waited for the new version are answered.
    fn after_sparse_update(&mut self, w: &mut World, contributors: &[u32]) {
        self.take_out_rows(w);
        let me = self.me();
        for &c in contributors {
            if !self.dead.contains(&c) {
                w.send(me, Node::Worker(c), Msg::SparseCredit);
            }
        }
        let mut ready = Vec::new();
        if let Some(tb) = self.table.as_mut() {
            tb.sync.ready_pulls(&mut ready);
        }
        for (r, v) in ready {
            self.sparse_answer(w, r, v);
        }
    }

    /// SSP/ASP: worker `r`'s push is applied on its own, as it comes: each
    /// row plus its gradient digest (wrapping sums: the order of workers
    /// does not matter, each contribution does).
    fn sparse_apply_one(&mut self, w: &mut World, r: u32) {
        let rank = self.rank;
        let Some(tb) = self.table.as_mut() else { return };
        let Some((t, rows)) = tb.pushes[r as usize].take() else {
            return w.fail(format!("server {rank}: the table applies worker {r}'s push, which is not in its slot"));
        };
        for &(k, d) in &rows {
            let row = tb.rows.entry(k).or_insert_with(|| row_init(k));
            *row = row.wrapping_add(d);
        }
        tb.sync.published(Some(r));
        w.sparse_applied(r, t, &rows);
        self.after_sparse_update(w, &[r]);
    }

    /// Answers worker `r`'s pull with version `v` of its rows (rows not
    /// held yet are created).
    fn sparse_answer(&mut self, w: &mut World, r: u32, v: u64) {
        let me = self.me();
        let Some(tb) = self.table.as_mut() else { return };
        let keys = tb.pulls[r as usize].take().unwrap_or_default();
        let rows: Vec<(u64, u64)> = keys.iter().map(|&k| (k, *tb.rows.entry(k).or_insert_with(|| row_init(k)))).collect();
        // (The answer is a copy: the rows may change at once.)
        tb.sync.pull_written(v);
        if !self.dead.contains(&r) {
            w.send(me, Node::Worker(r), Msg::SparseRows { v, rows });
        }
    }

    /// `Order::Buckets`: from iteration `at` on, the buckets are owned as
    /// `runs` say.
    pub(super) fn on_buckets(&mut self, w: &mut World, at: u64, runs: &[(u32, u32)]) {
        let rank = self.rank;
        let Some(tb) = self.table.as_mut() else {
            return w.fail(format!("server {rank}: ordered a bucket map at {at} in a job without tables"));
        };
        let order = match buckets::take_map(&mut tb.owners, at, runs, rank) {
            Ok(o) => o,
            Err(e) => return w.fail(format!("server {rank}: {e}")),
        };
        self.members.release_hold();
        if let Some(inc) = order.incoming {
            if order.restart {
                tb.sync = buckets::restarted(self.mode, self.ranks, at);
            }
            tb.incoming = Some(inc);
        }
        if order.leaving.is_some() {
            tb.leaving = order.leaving;
            self.take_out_rows(w);
        }
        // Dense shards held by the vote go on too.
        let ids: Vec<u32> = self.shards.keys().copied().collect();
        for id in ids {
            self.try_complete(w, id);
        }
        self.replay_sparse(w);
    }

    /// If the table holds every push before the cutover of its leaving
    /// buckets (and none after), their rows are taken out, one blob per
    /// target, and reported.
    fn take_out_rows(&mut self, w: &mut World) {
        let rank = self.rank;
        let Some(tb) = self.table.as_mut() else { return };
        let Some(l) = tb.leaving.as_ref() else { return };
        match buckets::reached(&tb.sync, self.mode, l.at, self.members.membership().latest()) {
            Some(true) => {}
            Some(false) => return,
            None => return w.fail(format!("server {rank}: the table passed iteration {} before its buckets left", l.at)),
        }
        let Some(l) = tb.leaving.take() else { return };
        let mut blobs = vec![Vec::new(); l.targets.len()];
        let keys: Vec<u64> = tb.rows.keys().copied().collect();
        for k in keys {
            if let Some(i) = l.dest[eps_proto::buckets::bucket_of(k) as usize]
                && let Some(row) = tb.rows.remove(&k)
            {
                blobs[i].push((k, row));
            }
        }
        for (to, blob) in l.targets.into_iter().zip(blobs) {
            let len = blob.len() as u64;
            w.rows_out(rank, to, blob);
            if let Err(e) = w.ctl(&ControlMsg::RowsOut { rank, from: rank, to, addr: 0, rkey: 0, len }) {
                return w.fail(format!("server {rank}: the control plane refused the rows for server {to}: {e}"));
            }
        }
    }

    /// `Order::FetchRows`: READs the rows server `from` gives this one.
    pub(super) fn on_fetch_rows(&mut self, w: &mut World, from: u32) {
        let me = self.me();
        w.send(Node::Server(from), me, Msg::RowsRead { from });
    }

    /// The READ of server `from`'s rows completed.
    pub(super) fn on_rows_read(&mut self, w: &mut World, from: u32) {
        let rank = self.rank;
        let Some(rows) = w.rows_read(from, rank) else {
            return w.fail(format!("server {rank}: READ the rows of server {from}, which it had freed"));
        };
        let Some(tb) = self.table.as_mut() else { return };
        for (k, row) in rows {
            if tb.rows.insert(k, row).is_some() {
                return w.fail(format!("server {rank}: row {k} came from server {from} but was held here already"));
            }
        }
        if let Err(e) = w.ctl(&ControlMsg::RowsTaken { rank, from, to: rank }) {
            return w.fail(format!("server {rank}: the control plane refused the rows of server {from}: {e}"));
        }
        let Some(tb) = self.table.as_mut() else { return };
        if tb.incoming.as_mut().is_some_and(|i| i.taken(from)) {
            tb.incoming = None;
            w.sparse_moved();
            self.replay_sparse(w);
        }
    }

    /// `Order::FreeRows`: the blob for server `to` was taken.
    pub(super) fn on_free_rows(&mut self, w: &mut World, to: u32) {
        w.free_rows(self.rank, to);
    }

    /// Offers the requests held back again, in arrival order (each is held
    /// again if it still must wait).
    pub(super) fn replay_sparse(&mut self, w: &mut World) {
        let Some(tb) = self.table.as_mut() else { return };
        for (r, req) in std::mem::take(&mut tb.deferred) {
            self.on_sparse(w, r, req);
        }
    }
}
