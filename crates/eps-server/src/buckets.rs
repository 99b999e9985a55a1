//! Buckets of sparse tables moving between servers (the control plane's
//! side is `eps-control`'s `job/buckets.rs`).
//!
//! On `Order::Buckets { at: T }`, the server keeps the new map and:
//! - as a source, takes each table's rows of the buckets it gives away out
//!   the moment the table holds every push before `T` (BSP: version `T`;
//!   SSP/ASP: every worker's clock at `T`; no worker pushes `T` by the old
//!   map), one blob per target in registered memory, and reports it
//!   (`RowsOut`); it frees the blob on `FreeRows`;
//! - as a target, holds pushes of `T` and later, and pulls of keys whose
//!   rows are on their way, until each source's rows are in: on
//!   `FetchRows` it dials the source and READs the blob, takes the rows in
//!   with their optimizer state and bookkeeping, reports `RowsTaken` (with
//!   replicas, once its backup has them: see `rows_backup.rs`), and
//!   once the last source's are in, serves what it held. A server that
//!   owned no bucket before starts its parts at `T`.

use std::time::Instant;

use eps_core::buckets::{BucketsIn, Leaving};
use eps_fabric::{Access, Fabric, MemoryRegion, RemoteAddr, SendOp, SendWr, Sge};
use eps_proto::control::ControlMsg;
use eps_sparse::moves;

use crate::{Server, ServerError, WR_OTHER};

/// Work-request ids of row READs: these bits, and the source's rank.
pub(crate) const WR_ROWS: u64 = WR_OTHER | (1 << 43);

/// What moves, on a server.
pub(crate) struct Moving<P: Fabric> {
    /// Receiving: what is on its way.
    incoming: Option<BucketsIn>,
    /// Giving away at `at`: the targets, each bucket's target (an index
    /// into them), which tables were taken out, and each target's blob.
    outgoing: Option<Outgoing>,
    /// Blobs waiting to be READ, by target.
    pub(crate) blobs: Vec<(u32, P::Mr)>,
    /// READs of rows, by source.
    fetching: Vec<Fetch<P>>,
}

/// The READs of one source's rows: in pieces of at most the fabric's
/// largest message, a few in flight at a time.
struct Fetch<P: Fabric> {
    from: u32,
    /// Their target: this server, or the lost one it stands in for.
    to: u32,
    /// The server READ: `from`, or its stand-in.
    via: u32,
    ci: usize,
    remote: RemoteAddr,
    mr: P::Mr,
    /// Bytes asked for so far, and READs not completed.
    asked: usize,
    in_flight: u32,
    started: Instant,
}

/// READs of one source's rows in flight at once.
const FETCH_WINDOW: u32 = 4;

/// The low bits of a row READ's work-request id: the server READ, and
/// whether the rows are for a lost server this one stands in for.
fn fetch_bits(via: u32, stand_in: bool) -> u64 {
    u64::from(via) | u64::from(stand_in) << 32
}

struct Outgoing {
    leaving: Leaving,
    taken: Vec<bool>,
    blobs: Vec<Vec<u8>>,
    rows: Vec<u64>,
}

impl<P: Fabric> Default for Moving<P> {
    fn default() -> Self {
        Self { incoming: None, outgoing: None, blobs: Vec::new(), fetching: Vec::new() }
    }
}

impl<P: Fabric> Moving<P> {
    /// What is on its way here, if anything.
    pub(crate) fn gate(&self) -> Option<&BucketsIn> {
        self.incoming.as_ref()
    }

    /// The rows of source `from` are in (taken from a lost server's
    /// stand-in here): whether they were the last awaited.
    pub(crate) fn take_in(&mut self, from: u32) -> bool {
        let last = self.incoming.as_mut().is_some_and(|inc| inc.taken(from));
        if last {
            self.incoming = None;
        }
        last
    }

    /// Whether buckets are moving here or away.
    pub(crate) fn busy(&self) -> bool {
        self.incoming.is_some() || self.outgoing.is_some() || !self.fetching.is_empty()
    }

    /// Whether table `table` still holds rows it gives away (the buckets it
    /// owned before the newest map, whose rows are not taken out yet).
    pub(crate) fn giving(&self, table: usize) -> bool {
        self.outgoing.as_ref().is_some_and(|o| !o.taken[table])
    }
}

impl<P: Fabric> Server<P> {
    /// `Order::Buckets`: from iteration `at` on, the buckets are owned as
    /// `runs` say.
    pub(crate) fn on_buckets(&mut self, at: u64, runs: &[(u32, u32)]) -> Result<(), ServerError> {
        let me = self.rank;
        let order =
            eps_core::buckets::take_map(&mut self.sparse.owners, at, runs, me).map_err(|e| ServerError::Sparse(e.to_string()))?;
        self.members.release_hold();
        if !self.sparse.tables.is_empty() {
            if let Some(inc) = order.incoming {
                if order.restart {
                    // Nothing here before: the parts start at the cutover.
                    for t in &mut self.sparse.tables {
                        t.part.restart_at(at);
                    }
                }
                eps_proto::say!("eps server {me}: from iteration {at} on, buckets come here from servers {:?}", inc.sources());
                self.sparse.moving.incoming = Some(inc);
            }
            if let Some(leaving) = order.leaving {
                let n = leaving.targets.len();
                self.sparse.moving.outgoing = Some(Outgoing {
                    leaving,
                    taken: vec![false; self.sparse.tables.len()],
                    blobs: (0..n).map(|_| moves::start()).collect(),
                    rows: vec![0; n],
                });
                for t in 0..self.sparse.tables.len() {
                    self.take_out_rows(t as u16)?;
                }
            }
        }
        // A lost server's buckets this server stood in for become its own.
        self.stand_in_map(at)?;
        // Dense shards held by the vote go on too.
        for id in 0..self.shards.len() as u32 {
            self.try_complete(id)?;
        }
        self.replay_sparse()
    }

    /// Table `table` applied an update: if it now holds every push before
    /// the cutover of its leaving buckets (and none after), their rows are
    /// taken out; once every table's are, they are put where their targets
    /// READ them, and reported.
    pub(crate) fn take_out_rows(&mut self, table: u16) -> Result<(), ServerError> {
        let Some(o) = self.sparse.moving.outgoing.as_mut() else { return Ok(()) };
        let t = table as usize;
        if o.taken[t] {
            return Ok(());
        }
        let at = o.leaving.at;
        match self.sparse.tables[t].part.reached(at, self.members.membership().latest()) {
            Some(true) => {}
            Some(false) => return Ok(()),
            None => return Err(ServerError::Sparse(format!("table {t} passed iteration {at} before its buckets left"))),
        }
        let part = &mut self.sparse.tables[t].part;
        let mut outs = vec![Vec::new(); o.leaving.targets.len()];
        let dest = &o.leaving.dest;
        // (With replicas, the backup keeps them until their target's has them.)
        let counts = part.take_rows_held(|b| dest[b as usize], &mut outs, &o.leaving.targets);
        let stride = part.rows().stride();
        for (i, recs) in outs.iter().enumerate() {
            moves::section(&mut o.blobs[i], t as u32, stride, counts[i], recs);
            o.rows[i] += counts[i];
        }
        o.taken[t] = true;
        if !o.taken.iter().all(|&x| x) {
            return Ok(());
        }
        let Some(o) = self.sparse.moving.outgoing.take() else { return Ok(()) };
        let at = o.leaving.at;
        for (i, &to) in o.leaving.targets.iter().enumerate() {
            let blob = &o.blobs[i];
            let mut mr = self.pd.alloc_mr(blob.len(), Access::REMOTE_READ)?;
            mr.write_at(0, blob);
            let (addr, rkey, len) = (mr.addr(), mr.rkey(), blob.len() as u64);
            self.sparse.moving.blobs.push((to, mr));
            eps_proto::say!("eps server {}: {} rows ({len} bytes) go to server {to} at iteration {at}", self.rank, o.rows[i]);
            self.summary.sparse_rows_out += o.rows[i];
            if let Err(why) = self.report(&ControlMsg::RowsOut { rank: self.rank, from: self.rank, to, addr, rkey, len })? {
                return Err(ServerError::Sparse(format!("the control plane refused the rows for server {to}: {why}")));
            }
        }
        Ok(())
    }

    /// Whether the rows server `from` gives this one are still awaited; if
    /// not, they were taken already (from the source, just before it was
    /// lost, while its stand-in was told they were not), and it says so.
    fn awaits_rows(&self, from: u32) -> bool {
        let awaited =
            self.sparse.moving.gate().is_some_and(|inc| inc.sources().contains(&from)) && !self.sparse.backups.taking(from);
        if !awaited {
            eps_proto::say!("eps server {}: the rows server {from} gives it are here already", self.rank);
        }
        awaited
    }

    /// `Order::FetchRows`: READs the rows server `from` gives server `to`
    /// (this one, or the lost one it stands in for) from server `via` (at
    /// `via_addr`).
    pub(crate) fn on_fetch_rows(
        &mut self,
        (from, to): (u32, u32),
        via: u32,
        via_addr: &str,
        blob: (u64, u32, u64),
    ) -> Result<(), ServerError> {
        let (addr, rkey, len) = blob;
        let awaited = if to == self.rank { self.awaits_rows(from) } else { self.stand_in_awaits(from, to) };
        if !awaited {
            return Ok(());
        }
        if via == self.rank {
            // Its own rows, for the lost target it stands in for.
            let Some((_, mr)) = self.sparse.moving.blobs.iter().find(|(t, _)| *t == to) else {
                return Err(ServerError::Sparse(format!("told to take the rows it gives server {to}, which it does not hold")));
            };
            let mut blob = vec![0u8; mr.len()];
            mr.read_at(0, &mut blob);
            return self.stand_in_take_rows(from, &blob, Instant::now());
        }
        // (A fetch from a source lost meanwhile is over: see `on_rows_read`.)
        self.sparse.moving.fetching.retain(|f| f.from != from || f.to != to);
        let ci = match self.target_conn(via, via_addr) {
            Ok(ci) => ci,
            Err(e) => {
                // (As a READ that failed: see `on_rows_read`.)
                eps_proto::say!(
                    "eps server {}: cannot reach server {via} for the rows server {from} gives server {to} ({e}); it \
                     waits for them from a stand-in",
                    self.rank
                );
                return Ok(());
            }
        };
        let mr = self.pd.alloc_mr(len as usize, Access::LOCAL_WRITE)?;
        let remote = RemoteAddr { addr, rkey };
        let f = Fetch { from, to, via, ci, remote, mr, asked: 0, in_flight: 0, started: Instant::now() };
        self.sparse.moving.fetching.push(f);
        let k = self.sparse.moving.fetching.len() - 1;
        for _ in 0..FETCH_WINDOW {
            self.fetch_more(k)?;
        }
        Ok(())
    }

    /// Posts the next piece of fetch `k`'s READs, if any is left.
    fn fetch_more(&mut self, k: usize) -> Result<(), ServerError> {
        let piece = (self.opts.max_msg_bytes as usize).clamp(4096, 1 << 30);
        let f = &mut self.sparse.moving.fetching[k];
        let n = piece.min(f.mr.len() - f.asked);
        if n == 0 {
            return Ok(());
        }
        let at = f.asked;
        let sg = [Sge::new(&f.mr, at as u64, n as u32)];
        let remote = RemoteAddr { addr: f.remote.addr + at as u64, rkey: f.remote.rkey };
        let wr_id = WR_ROWS | fetch_bits(f.via, f.to != self.rank);
        let wr = SendWr { wr_id, op: SendOp::Read(remote), sg: &sg, signaled: true };
        self.conns[f.ci].post_or_flush(&wr, &mut self.flushed)?;
        f.asked += n;
        f.in_flight += 1;
        Ok(())
    }

    /// A row READ completed (`ok`) or failed.
    pub(crate) fn on_rows_read(&mut self, wr_id: u64, ok: bool) -> Result<(), ServerError> {
        let via = (wr_id & 0xFFFF_FFFF) as u32;
        let me = self.rank;
        let Some(k) = self.sparse.moving.fetching.iter().position(|f| WR_ROWS | fetch_bits(f.via, f.to != me) == wr_id) else {
            return Ok(());
        };
        if !ok {
            // Its source is gone or cut off (reported by the caller): if it
            // is lost, its stand-in gives the rows (`FetchRows` again);
            // requests that need them wait meanwhile.
            let f = self.sparse.moving.fetching.remove(k);
            eps_proto::say!(
                "eps server {}: the rows server {} gives server {} could not be READ from server {via}; it waits for \
                 them from a stand-in",
                self.rank,
                f.from,
                f.to
            );
            return Ok(());
        }
        let f = &mut self.sparse.moving.fetching[k];
        f.in_flight -= 1;
        if f.asked < f.mr.len() {
            return self.fetch_more(k);
        }
        if f.in_flight > 0 {
            return Ok(());
        }
        let Fetch { from, to, mr, started, .. } = self.sparse.moving.fetching.remove(k);
        // Copied out before it is parsed (the READ into it completed).
        let mut blob = vec![0u8; mr.len()];
        mr.read_at(0, &mut blob);
        if to != self.rank {
            return self.stand_in_take_rows(from, &blob, started);
        }
        self.take_rows_from(from, &blob, started)
    }

    /// The rows server `from` gives this one (`blob`, asked for at
    /// `started`) are here: they are taken into the parts, reported once on
    /// the backup, and the requests held for them go on.
    pub(crate) fn take_rows_from(&mut self, from: u32, blob: &[u8], started: Instant) -> Result<(), ServerError> {
        if !self.awaits_rows(from) {
            return Ok(());
        }
        let strides: Vec<usize> = self.sparse.tables.iter().map(|t| t.part.rows().stride()).collect();
        let sections = moves::sections(blob, &strides).map_err(|e| ServerError::Sparse(format!("from server {from}: {e}")))?;
        let mut rows = 0;
        for s in sections {
            self.sparse.tables[s.table as usize]
                .part
                .put_rows(s.records, s.rows)
                .map_err(|e| ServerError::Sparse(format!("from server {from}: {e}")))?;
            rows += s.rows;
        }
        self.summary.sparse_rows_in += rows;
        eps_proto::say!(
            "eps server {}: {rows} rows ({} bytes) came from server {from} in {:.1} ms",
            self.rank,
            blob.len(),
            started.elapsed().as_secs_f64() * 1e3
        );
        // (The requests held for them go on once they are reported: see
        // `rows_taken_in`.)
        self.rows_taken_in(from)
    }

    /// What the sparse tables wait for, if anything (for a stall report).
    pub(crate) fn sparse_stall(&self) -> Option<String> {
        let m = &self.sparse.moving;
        let held = self.sparse.deferred.len();
        let stand_in = self.sparse.stand_in.as_ref().filter(|s| s.merged.is_none());
        if self.sparse.tables.is_empty() || (held == 0 && m.incoming.is_none() && m.outgoing.is_none() && stand_in.is_none()) {
            return None;
        }
        let stand_in = stand_in.map_or(String::new(), |s| {
            let parts: Vec<String> = s.tables.iter().map(|t| t.part.sync.describe()).collect();
            let due = s.incoming.as_ref().map_or(String::new(), |i| format!(", rows due at {} from {:?}", i.at, i.sources()));
            format!("; standing in for server {}: [{}]{due}", s.from, parts.join(", "))
        });
        let tables: Vec<String> = self.sparse.tables.iter().map(|t| t.part.sync.describe()).collect();
        let incoming = m.incoming.as_ref().map_or(String::new(), |i| format!("; rows due at {} from {:?}", i.at, i.sources()));
        let outgoing = m
            .outgoing
            .as_ref()
            .map_or(String::new(), |o| format!("; rows leaving at {} for {:?}", o.leaving.at, o.leaving.targets));
        Some(format!(
            "sparse tables [{}]; {held} requests held (hold {:?}){incoming}{outgoing}{stand_in}",
            tables.join(", "),
            self.members.hold()
        ))
    }

    /// `Order::FreeRows`: the blob for server `to` was taken (and is on its
    /// backup): the blob goes, and the rows go from this server's backup.
    pub(crate) fn on_free_rows(&mut self, to: u32) -> Result<(), ServerError> {
        self.sparse.moving.blobs.retain(|(t, _)| *t != to);
        for t in 0..self.sparse.tables.len() {
            self.sparse.tables[t].part.release_held(to);
        }
        self.rows_changed()
    }

    /// Handles the sparse requests held back, in arrival order (each is held
    /// again if it still must wait).
    pub(crate) fn replay_sparse(&mut self) -> Result<(), ServerError> {
        for (ci, h, table, m, len) in std::mem::take(&mut self.sparse.deferred) {
            self.on_sparse_imm(ci, h, table, m, len)?;
        }
        Ok(())
    }
}
