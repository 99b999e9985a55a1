//! The server's parts of the job's sparse tables (see `eps-sparse`): per table,
//! the rows of the buckets this server owns ([`TablePart`]) and, per worker
//! rank, a landing region its requests are WRITTEN into (pushes first, then
//! pulls) and a reply region the rows of its pulls are gathered into and
//! WRITTEN from.
//!
//! A worker WRITEs a table's push (keys and gradient rows) with the
//! immediate `Push | sparse_id(table) | iteration`; BSP applies the
//! iteration once every contributor's push is in (their rows merged in rank
//! order), then gives each of them a credit (its push region may be written
//! again). A pull (keys, and where in the worker's registered row buffer
//! the rows go) comes as `PullReq`; it is answered once the table's version
//! reaches the one asked, by one WRITE of the rows in the order asked, with
//! `PullDone`.

use eps_core::buckets::{SparseGate, SparseGuard, SparseReq};
use eps_fabric::{Access, Fabric, HostRegion, MemoryRegion, RemoteAddr, SendOp, SendWr, Sge};
use eps_proto::control::ShardEndpoint;
use eps_proto::hello::Hello;
use eps_proto::imm::{Imm, ImmKind};
use eps_proto::layout::{sparse_id, stand_in_id};
use eps_proto::sync::PushOutcome;
use eps_proto::{Consistency, JobSpec};
use eps_sparse::decl::Declared;
use eps_sparse::part::{PartStats, TablePart};
use eps_sparse::wire::{self, Op};

use crate::{Server, ServerError, WR_OTHER};

/// One table's part here and its regions.
pub(crate) struct Table<P: Fabric> {
    pub(crate) part: TablePart,
    /// By worker rank: its requests land here (push region, then pull region).
    landing: Vec<P::Mr>,
    /// By worker rank: its pulls' rows are gathered here and WRITTEN from.
    reply: Vec<P::Mr>,
    /// By worker rank: bytes of the push and of the pull request that landed.
    pushed: Vec<usize>,
    pulled: Vec<usize>,
    /// By worker rank: its push and its pull request copied out of the
    /// landing region when they landed (memory no peer can write, 8-byte
    /// aligned): checked, then acted on, from the copy alone, so that a
    /// worker rewriting its region after a check changes nothing.
    push_copy: Vec<Vec<u64>>,
    pub(crate) pull_copy: Vec<Vec<u64>>,
    /// Rows travelling as bf16 or f16: by worker rank its pushed rows
    /// widened, and the rows of a pull answer before they are narrowed.
    wide: Vec<Vec<f32>>,
    gathered: Vec<f32>,
}

/// The job's sparse tables on this server.
pub(crate) struct Sparse<P: Fabric> {
    pub(crate) tables: Vec<Table<P>>,
    /// The bucket maps by first iteration: a server rank per bucket.
    pub(crate) owners: Vec<(u64, Vec<u32>)>,
    /// Requests held until a bucket vote or move ends: connection, hello,
    /// table, immediate and length, in arrival order.
    pub(crate) deferred: Vec<(usize, Hello, u16, Imm, u32)>,
    /// Buckets moving (see `buckets.rs`).
    pub(crate) moving: crate::buckets::Moving<P>,
    /// Backups of the rows (see `rows_backup.rs`).
    pub(crate) backups: crate::rows_backup::RowsBackups<P>,
    /// The parts of a lost server this one serves from its copy of their
    /// rows (see `stand_in.rs`).
    pub(crate) stand_in: Option<crate::stand_in::StandIn<P>>,
    /// The last stand-in whose rows became this server's own (kept: see
    /// `stand_in.rs`), and the lost servers of those before it, with their
    /// last words.
    pub(crate) stood_in: Option<crate::stand_in::StandIn<P>>,
    pub(crate) stood_in_before: Vec<(u32, String)>,
    /// This process's resident memory once the regions were set up (all
    /// their pages touched), before any row: what rows add is measured from
    /// here.
    rss_start: u64,
}

impl<P: Fabric> Sparse<P> {
    /// This server's parts of `spec`'s tables (every server has a part of
    /// each table: the first ones own the buckets at the start, added ones
    /// get theirs when buckets move), with regions for `ranks` worker ranks.
    pub(crate) fn new(pd: &P, spec: &JobSpec, ranks: u32) -> Result<Self, ServerError> {
        let owners = vec![(0, eps_sparse::bucket::initial_owners(spec.job.servers))];
        let (deferred, moving) = (Vec::new(), Default::default());
        let backups = crate::rows_backup::RowsBackups::new(pd, spec.model.tables.len(), spec.job.replicas)?;
        if spec.model.tables.is_empty() {
            let (stand_in, stood_in, stood_in_before) = (None, None, Vec::new());
            return Ok(Self {
                tables: Vec::new(),
                owners,
                deferred,
                moving,
                backups,
                stand_in,
                stood_in,
                stood_in_before,
                rss_start: 0,
            });
        }
        let mut tables = Vec::new();
        for t in eps_sparse::decl::tables(spec) {
            let mut part = TablePart::new(t, spec.job.consistency, ranks).map_err(|e| ServerError::Sparse(e.to_string()))?;
            if spec.job.checkpoint_every > 0 && spec.job.checkpoint_dir.is_some() {
                // Its incremental checkpoints write the keys deleted.
                part.keep_deletions();
            }
            if spec.job.replicas > 1 {
                // Each update's changes go to the backup.
                part.keep_forwards();
            }
            tables.push(Table::new(pd, part, ranks)?);
        }
        let rss_start = eps_metrics::rss_bytes(None).unwrap_or(0);
        let (stand_in, stood_in, stood_in_before) = (None, None, Vec::new());
        Ok(Self { tables, owners, deferred, moving, backups, stand_in, stood_in, stood_in_before, rss_start })
    }

    /// Table `table` of `side`, if held.
    pub(crate) fn table_mut(&mut self, side: Side, table: u16) -> Option<&mut Table<P>> {
        match side {
            Side::Own => self.tables.get_mut(table as usize),
            Side::StandIn => self.stand_in.as_mut()?.tables.get_mut(table as usize),
        }
    }

    fn table(&self, side: Side, table: u16) -> Option<&Table<P>> {
        match side {
            Side::Own => self.tables.get(table as usize),
            Side::StandIn => self.stand_in.as_ref()?.tables.get(table as usize),
        }
    }

    /// Whether this server stands or stood in for lost server `from`.
    pub(crate) fn stood_in_for(&self, from: u32) -> bool {
        self.stand_in.iter().chain(&self.stood_in).any(|s| s.from == from) || self.stood_in_before.iter().any(|s| s.0 == from)
    }

    /// Whether this server holds no table.
    pub(crate) fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    /// Where workers WRITE their requests, per table (see `TablesReady`).
    /// (Their "published" address is where owners write descriptors of
    /// forwarded rows: see `rows_backup.rs`.)
    pub(crate) fn endpoints(&self, rank: u32) -> Vec<ShardEndpoint> {
        let ep = |(i, t): (usize, &Table<P>)| ShardEndpoint {
            shard: i as u32,
            owner: rank,
            landing: t.landings(),
            published_addr: self.backups.inbox(i).0,
            published_rkey: self.backups.inbox(i).1,
        };
        self.tables.iter().enumerate().map(ep).collect()
    }

    /// The process's resident bytes before any row.
    pub(crate) fn rss_start(&self) -> u64 {
        self.rss_start
    }

    /// What the tables hold on the heap (rows, state, index, bookkeeping).
    pub(crate) fn heap_bytes(&self) -> u64 {
        self.tables.iter().map(|t| t.part.rows().heap_bytes() as u64).sum()
    }

    /// Bytes of a merged gradient row (its key and values; the first
    /// table's, which the job's figures are about).
    pub(crate) fn merged_row_bytes(&self) -> u64 {
        self.tables.first().map_or(0, |t| 8 + t.part.table().spec.dim as u64 * 4)
    }

    /// Rows held and their bytes with optimizer state, and what the parts did.
    pub(crate) fn summary(&self) -> (u64, u64, PartStats) {
        let mut s = PartStats::default();
        for t in &self.tables {
            let p = t.part.stats();
            s.pulled_keys += p.pulled_keys;
            s.stepped_keys += p.stepped_keys;
            s.evicted += p.evicted;
            s.refused += p.refused;
        }
        let rows = self.tables.iter().map(|t| t.part.rows().len() as u64).sum();
        let bytes = self.tables.iter().map(|t| t.part.rows().row_state_bytes() as u64).sum();
        (rows, bytes, s)
    }
}

impl<P: Fabric> Table<P> {
    /// `part`, with a landing and a reply region for each of `ranks` workers.
    pub(crate) fn new(pd: &P, part: TablePart, ranks: u32) -> Result<Self, ServerError> {
        let t = part.table();
        let (push, pull) = (wire::region_bytes(Op::Push, t), wire::region_bytes(Op::Pull, t));
        let reply_bytes = t.max_keys * t.spec.dim * 4;
        let mut landing = Vec::with_capacity(ranks as usize);
        let mut reply = Vec::with_capacity(ranks as usize);
        for _ in 0..ranks {
            landing.push(touched(pd.alloc_mr(push.next_multiple_of(8) + pull, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?));
            // Only this server writes a reply region (WRITEs go out of it).
            reply.push(touched(pd.alloc_mr(reply_bytes, Access::NONE)?));
        }
        let n = ranks as usize;
        let (wide, gathered) = (vec![Vec::new(); n], Vec::new());
        let (push_copy, pull_copy) = (vec![vec![0u64; push.div_ceil(8)]; n], vec![vec![0u64; pull.div_ceil(8)]; n]);
        let (pushed, pulled) = (vec![0; n], vec![0; n]);
        Ok(Self { part, landing, reply, pushed, pulled, push_copy, pull_copy, wide, gathered })
    }

    /// Where workers WRITE their requests (see `TablesReady`).
    pub(crate) fn landings(&self) -> Vec<(u64, u32)> {
        self.landing.iter().map(|m| (m.addr(), m.rkey())).collect()
    }
}

/// Which parts a request is for: this server's own, or those it serves for
/// a lost server (see `stand_in.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Own,
    StandIn,
}

impl Side {
    /// The side an immediate's shard id names.
    pub(crate) fn of(id: u32) -> Self {
        if eps_proto::layout::is_stand_in(id) { Side::StandIn } else { Side::Own }
    }

    /// The immediate's shard id of table `table` on this side.
    pub(crate) fn id(self, table: u16) -> u32 {
        match self {
            Side::Own => sparse_id(table),
            Side::StandIn => stand_in_id(table),
        }
    }
}

/// `mr` with every page written once, so that it is resident from the start
/// (the memory rows add is then measured apart from it).
fn touched<M: MemoryRegion>(mut mr: M) -> M {
    let zeros = vec![0u8; 1 << 20];
    for at in (0..mr.len()).step_by(zeros.len()) {
        let n = zeros.len().min(mr.len() - at);
        mr.write_at(at, &zeros[..n]);
    }
    mr
}

/// Offset of the pull region in a landing region.
fn pull_offset(t: &Declared) -> usize {
    wire::region_bytes(Op::Push, t).next_multiple_of(8)
}

/// Copies the request of `len` bytes at `at` of `landing` into `copy`; `false`
/// (nothing copied) when it does not fit.
fn copy_request<M: MemoryRegion>(landing: &M, at: usize, len: usize, copy: &mut [u64]) -> bool {
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(copy);
    if len > bytes.len() || at.checked_add(len).is_none_or(|end| end > landing.len()) {
        return false;
    }
    landing.read_at(at, &mut bytes[..len]);
    true
}

impl<P: Fabric> Server<P> {
    /// A worker's sparse request for `table` landed (`len` bytes): for this
    /// server's part, or for the lost server's part it stands in for (the
    /// immediate says which).
    pub(crate) fn on_sparse_imm(&mut self, ci: usize, h: Hello, table: u16, m: Imm, len: u32) -> Result<(), ServerError> {
        let w = h.rank as usize;
        let side = Side::of(m.shard);
        let Some(t) = self.sparse.table(side, table) else {
            let whose = if side == Side::StandIn { "a lost server's part of " } else { "" };
            self.violation(ci, &format!("a request for {whose}sparse table {table}, which this server does not hold"));
            return Ok(());
        };
        if side == Side::Own && self.sparse.backups.busy(table as usize) {
            // Nothing of the table's new version before its backup has it.
            self.sparse.deferred.push((ci, h, table, m, len));
            return Ok(());
        }
        let op = match m.kind {
            ImmKind::Push => Op::Push,
            ImmKind::PullReq => Op::Pull,
            _ => {
                self.violation(ci, "sent a server-only message");
                return Ok(());
            }
        };
        let at = if op == Op::Push { 0 } else { pull_offset(t.part.table()) };
        // Copied out first: everything below checks and uses the copy.
        let Some(t) = self.sparse.table_mut(side, table) else { return Ok(()) };
        let copy = if op == Op::Push { &mut t.push_copy[w] } else { &mut t.pull_copy[w] };
        if !copy_request(&t.landing[w], at, len as usize, copy) {
            self.violation(ci, &format!("a sparse request of {len} bytes, more than its region holds"));
            return Ok(());
        }
        let Some(t) = self.sparse.table(side, table) else { return Ok(()) };
        let decl = t.part.table();
        let bytes: &[u8] = bytemuck::cast_slice(if op == Op::Push { &t.push_copy[w] } else { &t.pull_copy[w] });
        let stand_in = self.sparse.stand_in.as_ref().filter(|_| side == Side::StandIn);
        let guard = SparseGuard {
            me: stand_in.map_or(self.rank, |s| s.from),
            mode: self.mode,
            history: &self.sparse.owners,
            hold: self.members.hold(),
            incoming: if side == Side::Own { self.sparse.moving.gate() } else { stand_in.and_then(|s| s.incoming.as_ref()) },
            giving: side == Side::Own && self.sparse.moving.giving(table as usize),
        };
        let version = t.part.sync.version();
        let checked = wire::parse(bytes, len as usize, op, decl).map_err(|e| e.to_string()).and_then(|q| {
            if q.header.seq as u16 != m.seq {
                return Err(format!("a request for {} under the immediate's {}", q.header.seq, m.seq));
            }
            let replay = op == Op::Pull && q.header.reply_addr == wire::NO_REPLY;
            if replay && side == Side::Own {
                return Err("a pull with no reply address".into());
            }
            if side == Side::StandIn && (replay || (op == Op::Push && q.header.seq < version)) {
                // A request the lost server took before it was lost: see `stand_in.rs`.
                return Ok(Gated::Again(q.header.seq));
            }
            match guard.gate(SparseReq { push: op == Op::Push, seq: q.header.seq, keys: q.keys }) {
                SparseGate::Hold => Ok(Gated::Hold),
                SparseGate::Foreign(k) => Err(format!("key {k} of table {:?} belongs to another server", decl.name)),
                SparseGate::Go => Ok(Gated::Go(q.header.seq)),
            }
        });
        let seq = match checked {
            Ok(Gated::Go(seq)) => seq,
            Ok(Gated::Again(seq)) => return self.stand_in_again(h.rank, table, op == Op::Push, seq, len),
            Ok(Gated::Hold) => {
                self.sparse.deferred.push((ci, h, table, m, len));
                return Ok(());
            }
            Err(e) => {
                self.violation(ci, &e);
                return Ok(());
            }
        };
        let Some(t) = self.sparse.table_mut(side, table) else { return Ok(()) };
        match op {
            Op::Push => {
                // (The header's iteration is the whole one; the immediate's
                // low bits were checked against it.)
                let iteration = seq;
                t.pushed[w] = len as usize;
                let contributors = self.members.contributors(&t.part.sync, iteration).into_owned();
                match t.part.sync.on_push(h.rank, iteration, &contributors) {
                    Ok(PushOutcome::AggregateAll { .. }) => self.sparse_update_on(side, table, &contributors)?,
                    Ok(PushOutcome::ApplyOne { worker, .. }) => {
                        // (Held back if the table is not yet saved for a cut before it.)
                        if side == Side::StandIn || !self.hold_rows_for_cut(table, worker, iteration)? {
                            self.sparse_update_on(side, table, &[worker])?;
                        }
                    }
                    Ok(PushOutcome::Wait) => {}
                    Err(e) => self.violation(ci, &e.to_string()),
                }
            }
            Op::Pull => {
                t.pulled[w] = len as usize;
                match t.part.sync.on_pull(h.rank, seq) {
                    Ok(Some(v)) => self.sparse_answer(side, table, h.rank, v)?,
                    Ok(None) => {}
                    Err(e) => self.violation(ci, &e.to_string()),
                }
            }
        }
        Ok(())
    }

    /// As [`Server::sparse_update_on`] for this server's own part.
    pub(crate) fn sparse_update(&mut self, table: u16, contributors: &[u32]) -> Result<(), ServerError> {
        self.sparse_update_on(Side::Own, table, contributors)
    }

    /// BSP: every contributor's push of the table's iteration is in: merge
    /// them in rank order, step, credit their push regions, answer the pulls
    /// that waited for the new version. SSP/ASP: the one worker in
    /// `contributors` pushed; its rows are applied on their own. (A
    /// stand-in's part is not saved, moved nor forwarded.)
    pub(crate) fn sparse_update_on(&mut self, side: Side, table: u16, contributors: &[u32]) -> Result<(), ServerError> {
        let Some(Table { part, push_copy, pushed, wide, .. }) = self.sparse.table_mut(side, table) else {
            return Err(ServerError::Sparse(format!("an update of table {table}, which this server does not hold")));
        };
        let dtype = part.table().dtype;
        let mut requests = Vec::with_capacity(contributors.len());
        for &w in contributors {
            // The copy made and checked when the push landed.
            let bytes: &[u8] = bytemuck::cast_slice(&push_copy[w as usize]);
            let q = wire::parse(bytes, pushed[w as usize], Op::Push, part.table())
                .map_err(|e| ServerError::Sparse(format!("a push checked on arrival: {e}")))?;
            requests.push(q);
        }
        // f32 rows are read in place; bf16 and f16 ones widened first.
        if dtype != eps_agg::DType::F32 {
            for (q, &w) in requests.iter().zip(contributors) {
                wire::widen(dtype, q.rows, &mut wide[w as usize]);
            }
        }
        let mut views = Vec::with_capacity(contributors.len());
        for (q, &w) in requests.iter().zip(contributors) {
            let rows: &[f32] = match bytemuck::try_cast_slice(q.rows) {
                Ok(r) if dtype == eps_agg::DType::F32 => r,
                _ => &wide[w as usize],
            };
            views.push((q.keys, rows));
        }
        let applied = match (self.mode, contributors) {
            (Consistency::Bsp, _) => part.apply_all(&views),
            (_, &[w]) => part.apply_one(w, views[0].0, views[0].1),
            _ => return Err(ServerError::Sparse("an SSP/ASP update of more than one worker's push".into())),
        };
        let version = applied.map_err(|e| ServerError::Sparse(e.to_string()))?;
        self.summary.updates += 1;
        self.metrics.updates.inc();
        if side == Side::StandIn {
            // (Nobody else saves the lost server's buckets.)
            self.save_stand_in_rows(table, version);
            self.finish_sparse_update_on(side, table, contributors)?;
            self.stand_in_give()?;
            return self.merge_stand_in();
        }
        // Copied out before any of its buckets leave.
        match self.mode {
            Consistency::Bsp if !self.saver.due(version).is_empty() => self.save_rows(table, version),
            Consistency::Bsp => {}
            _ => self.try_rows_cut(table)?,
        }
        // Buckets whose cutover this update reached leave now, before anything
        // of the next iteration is applied.
        self.take_out_rows(table)?;
        if self.forward_rows(table, Some(contributors.to_vec()))? {
            return Ok(());
        }
        self.finish_sparse_update(table, contributors)
    }

    /// As [`Server::finish_sparse_update_on`] for this server's own part.
    pub(crate) fn finish_sparse_update(&mut self, table: u16, contributors: &[u32]) -> Result<(), ServerError> {
        self.finish_sparse_update_on(Side::Own, table, contributors)
    }

    /// An update of `table` is applied (and on its backup): its contributors
    /// are credited, the pulls that waited for it answered.
    pub(crate) fn finish_sparse_update_on(&mut self, side: Side, table: u16, contributors: &[u32]) -> Result<(), ServerError> {
        let id = side.id(table);
        for &w in contributors {
            self.send_credit(w, id)?;
        }
        let mut ready = Vec::new();
        if let Some(t) = self.sparse.table_mut(side, table) {
            t.part.sync.ready_pulls(&mut ready);
        }
        for (w, v) in ready {
            self.sparse_answer(side, table, w, v)?;
        }
        Ok(())
    }

    /// Answers worker `w`'s pull of `table` with version `v`: its rows
    /// gathered into its reply region, WRITTEN where the request said.
    fn sparse_answer(&mut self, side: Side, table: u16, w: u32, v: u64) -> Result<(), ServerError> {
        let Some(Table { part, pull_copy, reply, pulled, gathered, .. }) = self.sparse.table_mut(side, table) else {
            return Ok(());
        };
        let (dim, dtype) = (part.table().spec.dim, part.table().dtype);
        // The copy made and checked when the pull landed.
        let bytes: &[u8] = bytemuck::cast_slice(&pull_copy[w as usize]);
        let q = wire::parse(bytes, pulled[w as usize], Op::Pull, part.table())
            .map_err(|e| ServerError::Sparse(format!("a pull checked on arrival: {e}")))?;
        let n = q.keys.len() * dim;
        let remote = RemoteAddr { addr: q.header.reply_addr, rkey: q.header.reply_rkey };
        // The previous answer's WRITE from this region was delivered (the worker
        // asks again only after it), so no answer goes out torn.
        let out = reply[w as usize].view_mut().map_err(|e| ServerError::Sparse(format!("the reply region: {e}")))?;
        let bytes = n * dtype.size_bytes();
        if dtype == eps_agg::DType::F32 {
            let rows: &mut [f32] = bytemuck::cast_slice_mut(&mut out[..bytes]);
            part.answer(v, q.keys, rows).map_err(|e| ServerError::Sparse(e.to_string()))?;
        } else {
            gathered.resize(n, 0.0);
            part.answer(v, q.keys, gathered).map_err(|e| ServerError::Sparse(e.to_string()))?;
            eps_agg::reduce::narrow(dtype, gathered, &mut out[..bytes]);
        }
        let Some((conn, _)) = self.worker_conn(w) else { return Ok(()) };
        let Some(t) = self.sparse.table(side, table) else { return Ok(()) };
        let sg = [Sge::new(&t.reply[w as usize], 0, bytes as u32)];
        let imm = Imm { kind: ImmKind::PullDone, shard: side.id(table), seq: v as u16 }.encode();
        let sg: &[Sge<'_, P::Mr>] = if n == 0 { &[] } else { &sg };
        conn.post(&SendWr { wr_id: WR_OTHER, op: SendOp::WriteImm(remote, imm), sg, signaled: false })?;
        self.summary.pulls += 1;
        self.metrics.pulls.inc();
        Ok(())
    }
}

/// What a request's checks decided.
enum Gated {
    /// Acted on now (its iteration or version).
    Go(u64),
    /// Held until a vote or a move ends.
    Hold,
    /// A stand-in's: one the lost server took (see `stand_in.rs`).
    Again(u64),
}
