//! Serving a lost server's table rows (`job.replicas = 2`): on
//! `Order::StandIn`, the server that kept the lost server's rows in step
//! (see `rows_backup.rs`) makes each table's copy a part of its own, at the
//! copy's version, with landing and reply regions for every worker, and
//! reports them (`StandInReady`). Workers then send it what the lost server
//! had not answered, with the stand-in's immediates
//! (`eps_proto::layout::stand_in_id`), and it answers as the lost server
//! would have.
//!
//! The copy holds version `V`: the last one acknowledged, so no worker
//! pulled a later one, and no worker pushed beyond iteration `V` (each
//! waits for the credit of its last push first). What a worker sends again:
//! - its push of an iteration the copy holds (the lost server applied it
//!   and was lost before it credited it): credited again, not applied;
//! - its push of iteration `V`: taken as any push;
//! - the last pull the lost server answered, with no reply address
//!   (`wire::NO_REPLY`): at version `V` the copy lacks that pull's
//!   bookkeeping (rows created, rows touched), which would have travelled
//!   with the next forward; it is taken (the rows are gathered, not sent).
//!   Of an earlier version, it is in the copy already and is dropped;
//! - a pull not answered: answered once the version reaches it.
//!
//! Each row's bookkeeping counts touches and remembers the last version,
//! so pulls taken in another order leave the same rows: the results stay
//! bit for bit those of a run without the loss.

use eps_core::buckets::BucketsIn;
use eps_fabric::Fabric;
use eps_proto::control::{ControlMsg, ShardEndpoint};
use eps_proto::imm::{Imm, ImmKind};
use eps_sparse::part::TablePart;
use eps_sparse::wire::{self, Op};

use crate::sparse::{Side, Table};
use crate::{Server, ServerError};

/// A lost server's table parts, served here.
pub(crate) struct StandIn<P: Fabric> {
    /// The lost server's rank.
    pub(crate) from: u32,
    /// By table: its part, from the copy of its rows.
    pub(crate) tables: Vec<Table<P>>,
    /// Rows gathered for pulls taken again (not sent).
    scratch: Vec<f32>,
    /// Pulls taken again whose bookkeeping the copy lacked.
    pub(crate) taken_again: u64,
    /// The cutover at which the buckets become this server's own (a bucket
    /// map that no longer names the lost server).
    pub(crate) leaves_at: Option<u64>,
    /// Rows taken into this server's own parts at that cutover.
    pub(crate) merged: Option<u64>,
    /// What it gives away in the lost server's place (see `stand_in_give.rs`).
    pub(crate) give: Option<crate::stand_in_give::Give<P>>,
    /// What it takes in the lost server's place (see `stand_in_take.rs`).
    pub(crate) incoming: Option<BucketsIn>,
}

impl<P: Fabric> Server<P> {
    /// `Order::StandIn`: serves lost server `from`'s buckets from the copies
    /// of its rows, if every table's is whole; reports where workers WRITE
    /// their requests for them (nowhere, if not: its rows are lost); gives
    /// the rows it was giving `give` in its place, and takes the rows `take`
    /// were giving it.
    pub(crate) fn on_stand_in(&mut self, from: u32, give: Vec<u32>, take: Vec<u32>) -> Result<(), ServerError> {
        let n = self.sparse.tables.len();
        // (One whose rows became this server's own is done: its regions are
        // kept until the next one is done too, as a late request may still
        // land there; none lands two losses late, each ended at a cutover
        // every worker voted for.)
        let busy = self.sparse.stand_in.as_ref().is_some_and(|s| s.merged.is_none());
        let copies = if busy { None } else { self.sparse.backups.take_copies(from, n) };
        self.drop_retired_landings();
        let mut endpoints = Vec::new();
        match copies {
            Some(copies) => {
                let mut tables = Vec::with_capacity(n);
                for (t, (rows, version)) in copies.into_iter().enumerate() {
                    let decl = self.sparse.tables[t].part.table().clone();
                    let held = rows.len();
                    let part = TablePart::from_rows(decl, self.mode, self.ranks, rows, version)
                        .map_err(|e| ServerError::Sparse(e.to_string()))?;
                    let table = Table::new(&self.pd, part, self.ranks)?;
                    endpoints.push(ShardEndpoint {
                        shard: t as u32,
                        owner: from,
                        landing: table.landings(),
                        published_addr: 0,
                        published_rkey: 0,
                    });
                    eps_proto::say_event!(
                        "stand_in",
                        { server = self.rank, lost = from, table = t, version = version, rows = held },
                        "eps server {}: serves lost server {from}'s rows of table {t} from its copy: {held} rows at version {version}",
                        self.rank
                    );
                    tables.push(table);
                }
                let give = crate::stand_in_give::Give::new(&self.sparse.owners, from, give, n);
                let incoming = eps_core::buckets::still_incoming(&self.sparse.owners, from, &take);
                if let Some(i) = &incoming {
                    eps_proto::say!(
                        "eps server {}: takes the rows servers {:?} give lost server {from} at iteration {} in its place",
                        self.rank,
                        i.sources(),
                        i.at
                    );
                }
                let (scratch, taken_again, leaves_at, merged) = (Vec::new(), 0, None, None);
                let s = StandIn { from, tables, scratch, taken_again, leaves_at, merged, give, incoming };
                if let Some(old) = self.sparse.stand_in.replace(s).and_then(|done| self.sparse.stood_in.replace(done)) {
                    let line = self.stood_in_line(&old);
                    self.sparse.stood_in_before.push((old.from, line));
                }
            }
            None => {
                eps_proto::say!("eps server {}: holds no whole copy of lost server {from}'s table rows: they are lost", self.rank)
            }
        }
        if let Err(why) = self.report(&ControlMsg::StandInReady { rank: self.rank, from, tables: endpoints })? {
            return Err(ServerError::Sparse(format!("the control plane refused a stand-in for server {from}: {why}")));
        }
        self.stand_in_give()?;
        self.merge_stand_in()
    }

    /// Worker `w` sent the stand-in again a request the lost server took:
    /// its push of iteration `seq`, applied already (credited again), or
    /// its last pull answered, of version `seq` and `len` bytes (its
    /// bookkeeping taken if the copy lacks it).
    pub(crate) fn stand_in_again(&mut self, w: u32, table: u16, push: bool, seq: u64, len: u32) -> Result<(), ServerError> {
        if push {
            return self.send_credit(w, Side::StandIn.id(table));
        }
        let Some(s) = self.sparse.stand_in.as_mut() else { return Ok(()) };
        let Some(Table { part, pull_copy, .. }) = s.tables.get_mut(table as usize) else { return Ok(()) };
        // (Of an earlier version, its bookkeeping came with the copy.)
        if seq == part.sync.version() {
            let bytes: &[u8] = bytemuck::cast_slice(&pull_copy[w as usize]);
            let q = wire::parse(bytes, len as usize, Op::Pull, part.table())
                .map_err(|e| ServerError::Sparse(format!("a pull checked on arrival: {e}")))?;
            s.scratch.resize(q.keys.len() * part.table().spec.dim, 0.0);
            part.gather(q.keys, &mut s.scratch).map_err(|e| ServerError::Sparse(e.to_string()))?;
            s.taken_again += 1;
        }
        // Acknowledged, with no rows: the worker may send the next one.
        self.notify(w, Imm { kind: ImmKind::PullDone, shard: Side::StandIn.id(table), seq: seq as u16 })
    }

    /// A new bucket map from iteration `at` on: if it no longer names the
    /// lost server, its buckets are this server's from `at` (see
    /// `merge_stand_in`).
    pub(crate) fn stand_in_map(&mut self, at: u64) -> Result<(), ServerError> {
        let named = |s: &StandIn<P>, o: &[u32]| o.contains(&s.from);
        let Some(s) = self.sparse.stand_in.as_mut().filter(|s| s.merged.is_none()) else { return Ok(()) };
        if self.sparse.owners.last().is_some_and(|(_, o)| !named(s, o)) {
            s.leaves_at = Some(at);
        }
        self.merge_stand_in()
    }

    /// Once the lost server's parts hold every push before the cutover of
    /// their buckets (BSP: version `at`), their rows are taken into this
    /// server's own parts, as rows a bucket move brings, and reported taken
    /// (`RowsTaken` from the lost server); the requests held for them go on.
    /// The stand-in's regions are kept (nothing is sent to them any more:
    /// every push and pull before the cutover was answered).
    pub(crate) fn merge_stand_in(&mut self) -> Result<(), ServerError> {
        let Some(s) = self.sparse.stand_in.as_mut().filter(|s| s.merged.is_none()) else { return Ok(()) };
        // (What it gives away in the lost server's place goes first.)
        // (And what it takes in the lost server's place must be in.)
        let ready = s.give.as_ref().is_none_or(|g| g.done) && s.incoming.is_none();
        let Some(at) = s.leaves_at.filter(|_| ready) else { return Ok(()) };
        let latest = self.members.membership().latest();
        let mut reached = true;
        for (t, table) in s.tables.iter().enumerate() {
            match table.part.reached(at, latest) {
                Some(r) => reached &= r,
                None => return Err(ServerError::Sparse(format!("lost server {}'s table {t} passed iteration {at}", s.from))),
            }
        }
        if !reached {
            return Ok(());
        }
        let from = s.from;
        let mut rows = 0;
        for (t, table) in s.tables.iter_mut().enumerate() {
            let mut outs = vec![Vec::new()];
            let n = table.part.take_rows(|_| Some(0), &mut outs)[0];
            self.sparse.tables[t]
                .part
                .put_rows(&outs[0], n)
                .map_err(|e| ServerError::Sparse(format!("from lost server {from}: {e}")))?;
            rows += n;
        }
        s.merged = Some(rows);
        eps_proto::say!("eps server {}: lost server {from}'s {rows} rows are its own from iteration {at} on", self.rank);
        self.summary.sparse_rows_in += rows;
        self.rows_taken_in(from)
    }

    /// The stand-in's last words: whose rows, how many at the end, and how
    /// many pulls it took again.
    pub(crate) fn stand_in_report(&self) -> Vec<String> {
        let before = self.sparse.stood_in_before.iter().map(|s| s.1.clone());
        before.chain(self.sparse.stood_in.iter().chain(&self.sparse.stand_in).map(|s| self.stood_in_line(s))).collect()
    }

    fn stood_in_line(&self, s: &StandIn<P>) -> String {
        let versions: Vec<u64> = s.tables.iter().map(|t| t.part.sync.version()).collect();
        let end = match (s.merged, s.leaves_at) {
            (Some(n), Some(at)) => format!("its {n} rows became this server's own at iteration {at}"),
            _ => format!("{} rows at the end", s.tables.iter().map(|t| t.part.rows().len()).sum::<usize>()),
        };
        format!(
            "eps server {}: stood in for lost server {}: {end}, versions {versions:?}; took {} pulls again",
            self.rank, s.from, s.taken_again
        )
    }
}
