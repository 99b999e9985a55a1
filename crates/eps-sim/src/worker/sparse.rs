//! A worker's sparse table, as `eps-worker`'s `sparse.rs` uses it: once the
//! iteration has begun (a bucket vote may hold it), the worker takes in the
//! newest map's bucket maps and pulls its keys' rows of the iteration's
//! version from the servers the iteration's map names; it computes once
//! every answer is in. Its push goes, after every server applied its last
//! one (their credits), to every server that owns buckets in the
//! iteration, with the rows of the keys each owns (maybe none).

use std::collections::{BTreeMap, BTreeSet};

use eps_proto::Consistency;

use super::{SimWorker, WState};
use crate::World;
use crate::net::{Msg, Node};
use crate::sparse::row_token;

/// A worker's side of the table.
#[derive(Debug, Default)]
pub(crate) struct WTable {
    /// The bucket maps taken in, by first iteration.
    maps: Vec<(u64, Vec<u32>)>,
    /// Pull answers due.
    awaiting: u32,
    /// The rows pulled this iteration.
    rows: BTreeMap<u64, u64>,
    /// Servers whose credit for the last push has not come.
    owed: BTreeSet<u32>,
    /// The push waits for credits.
    push_due: bool,
}

impl WTable {
    pub(crate) fn new(servers: u32) -> Self {
        Self { maps: vec![(0, eps_proto::buckets::initial_owners(servers))], ..Self::default() }
    }

    pub(crate) fn describe(&self) -> String {
        format!(
            "table maps at {:?}, awaiting {}, owed {:?}, push due {}",
            self.maps.iter().map(|m| m.0).collect::<Vec<_>>(),
            self.awaiting,
            self.owed,
            self.push_due
        )
    }

    fn map_at(&self, t: u64) -> &[u32] {
        eps_proto::buckets::owners_at(&self.maps, t).map_or(&[][..], |o| &o[..])
    }
}

impl SimWorker {
    /// Takes in the bucket maps of its map it does not have yet.
    fn follow_buckets(&mut self, w: &mut World) -> bool {
        self.adopt_newest();
        let Some(tb) = self.table.as_mut() else { return true };
        for (at, runs) in self.map.buckets.iter().skip(tb.maps.len()) {
            let Some(owners) = eps_proto::buckets::expand(runs) else {
                w.fail(format!("worker {}: a bucket map at {at} that does not cover the buckets", self.rank));
                return false;
            };
            if tb.maps.last().is_some_and(|(last, _)| at <= last) {
                w.fail(format!("worker {}: a bucket map at {at} after one at {:?}", self.rank, tb.maps.last().map(|m| m.0)));
                return false;
            }
            tb.maps.push((*at, owners));
        }
        true
    }

    /// The iteration began: its keys' rows are asked for. False if there
    /// is no table (the worker computes at once).
    pub(super) fn sparse_pull(&mut self, w: &mut World) -> bool {
        if self.table.is_none() || !self.follow_buckets(w) {
            return false;
        }
        let (me, rank, t) = (Node::Worker(self.rank), self.rank, self.t);
        let Some(tb) = self.table.as_mut() else { return false };
        let owners = tb.map_at(t);
        let mut by_server: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        for k in w.sparse_keys(rank, t) {
            by_server.entry(owners[eps_proto::buckets::bucket_of(k) as usize]).or_default().push(k);
        }
        tb.rows.clear();
        tb.awaiting = by_server.len() as u32;
        // The version asked: BSP every earlier iteration applied; SSP the
        // slowest worker within the staleness bound; ASP whatever is there.
        let v = match w.mode {
            Consistency::Bsp => t,
            Consistency::Ssp => t.saturating_sub(w.staleness),
            Consistency::Asp => 0,
        };
        for (s, keys) in by_server {
            w.send(me, Node::Server(s), Msg::SparsePull { w: rank, v, keys });
        }
        tb.awaiting > 0
    }

    /// A pull answer: version `v` of `rows`.
    pub(super) fn on_sparse_rows(&mut self, w: &mut World, v: u64, rows: Vec<(u64, u64)>) {
        let (me, rank, t) = (Node::Worker(self.rank), self.rank, self.t);
        if w.mode == Consistency::Bsp && v != t {
            return w.fail(format!("worker {rank}: a sparse pull in iteration {t} gave version {v}"));
        }
        w.sparse_seen(rank, v, &rows);
        let Some(tb) = self.table.as_mut() else { return };
        tb.rows.extend(rows);
        tb.awaiting = tb.awaiting.saturating_sub(1);
        if tb.awaiting == 0 {
            w.timer(me, 1, 8);
        }
    }

    /// A server applied this worker's last push.
    pub(super) fn on_sparse_credit(&mut self, w: &mut World, from: Node) {
        let Node::Server(s) = from else { return };
        let Some(tb) = self.table.as_mut() else { return };
        tb.owed.remove(&s);
        if tb.push_due && tb.owed.is_empty() {
            tb.push_due = false;
            if w.mode == Consistency::Bsp { self.push_all(w) } else { self.push_all_async(w) }
        } else if w.mode != Consistency::Bsp && self.state == WState::Waiting {
            // (The last round ends once its pushes are applied.)
            self.step_async(w);
        }
    }

    /// Every server applied this worker's last sparse push.
    pub(super) fn sparse_settled(&self) -> bool {
        self.table.as_ref().is_none_or(|t| t.owed.is_empty())
    }

    /// Pushes the iteration's gradient rows; false (nothing sent) while a
    /// server has not applied the last push.
    pub(super) fn sparse_push(&mut self, w: &mut World) -> bool {
        if self.table.is_none() {
            return true;
        }
        if !self.follow_buckets(w) {
            return false;
        }
        let (me, rank, t) = (Node::Worker(self.rank), self.rank, self.t);
        let Some(tb) = self.table.as_mut() else { return true };
        if !tb.owed.is_empty() {
            tb.push_due = true;
            return false;
        }
        let owners = tb.map_at(t).to_vec();
        let mut servers = owners.clone();
        servers.sort_unstable();
        servers.dedup();
        let mut by_server: BTreeMap<u32, Vec<(u64, u64)>> = servers.iter().map(|&s| (s, Vec::new())).collect();
        for k in w.sparse_keys(rank, t) {
            let Some(&row) = tb.rows.get(&k) else {
                w.fail(format!("worker {rank}: iteration {t} pushes key {k}, whose row it did not pull"));
                return false;
            };
            let s = owners[eps_proto::buckets::bucket_of(k) as usize];
            by_server.entry(s).or_default().push((k, row_token(rank, t, k, row)));
        }
        for rows in by_server.values() {
            w.sparse_pushed(rank, t, rows);
        }
        for (s, rows) in by_server {
            tb.owed.insert(s);
            w.send(me, Node::Server(s), Msg::SparsePush { w: rank, t, rows });
        }
        true
    }
}
