//! Sparse tables from a worker: rows pulled and gradients pushed by key (see
//! `eps-sparse` and the server's `sparse.rs`).
//!
//! A pull deduplicates the batch's keys, sends each server owning some of
//! them its key list, and the servers WRITE the rows straight into this
//! worker's registered row buffer, each server's rows where its request
//! said; they are then spread to every position of the batch. A push sums
//! each key's gradient rows in batch order and sends every server its keys
//! and rows (an empty push where it owns none: BSP counts every worker's
//! push). Both are for the worker's current iteration: a pull gets the rows
//! as of it (every earlier iteration applied), a push is the iteration's
//! gradient. A table not pushed in an iteration is pushed empty when the
//! worker waits for the iteration's parameters.

use eps_fabric::{Access, Fabric, FabricError, HostRegion, MemoryRegion, QueuePair, RemoteAddr, SendOp, SendWr, Sge};
use eps_proto::control::JobMap;
use eps_proto::imm::{Imm, ImmKind};
use eps_proto::layout::{sparse_id, stand_in_id};
use eps_sparse::batch::{dedup, split_by_owner};
use eps_sparse::bucket::bucket_of;
use eps_sparse::decl::Declared;
use eps_sparse::wire::{self, HEADER, Header, Op};

use crate::{Worker, WorkerError};

/// Work-request ids of sparse requests: this bit, and the table's index
/// (and [`WR_SPARSE_PULL`] for a pull's).
pub(crate) const WR_SPARSE: u64 = 1 << 60;
/// Marks a sparse pull's work request (not signaled: only a failure shows).
pub(crate) const WR_SPARSE_PULL: u64 = 1 << 16;

/// Which staging buffer a request is WRITTEN from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Staged {
    Push,
    Pull,
    /// Pulls sent again to a stand-in (see `takeover.rs`).
    Again,
}

/// Offset of the pull region in a server's landing region for a worker.
pub(crate) fn pull_offset(d: &Declared) -> usize {
    wire::region_bytes(Op::Push, d).next_multiple_of(8)
}

/// One table, as this worker uses it.
pub(crate) struct Table<P: Fabric> {
    pub(crate) decl: Declared,
    /// The servers WRITE pulled rows here (in the table's dtype).
    rows: P::Mr,
    /// Pulled rows as f32, copied out of `rows` (and widened, for tables whose
    /// rows travel as bf16 or f16).
    wide: Vec<f32>,
    /// Pulled bf16 or f16 rows, copied out of `rows` before they are widened.
    raw: Vec<u8>,
    /// Requests are written here and WRITTEN from.
    push_out: P::Mr,
    pub(crate) pull_out: P::Mr,
    /// By server rank: its push region may be written (the server applied
    /// the last push).
    pub(crate) credit: Vec<bool>,
    /// Push WRITEs not completed, by the server rank of their connection
    /// (a lost server's connection is dropped with its WRITEs: they never
    /// complete, and are not awaited).
    pub(crate) sending: Vec<u32>,
    /// The iteration last pushed.
    pub(crate) pushed_at: Option<u64>,
    /// The servers whose pull answers are not in yet.
    pub(crate) owed: Vec<u32>,
    /// The last push and pull: each server's part of the staging buffer
    /// (server, offset, bytes), and the pull's version (what a stand-in is
    /// sent again: see `takeover.rs`).
    pub(crate) push_posts: Vec<(u32, usize, usize)>,
    pub(crate) pull_posts: Vec<(u32, usize, usize)>,
    pub(crate) pull_seq: Option<u64>,
    /// With replicas: the pulls answered before the last one, of its version
    /// and the one before, each server's part copied.
    pub(crate) log: Vec<LoggedPull>,
}

/// A pull answered: its version, and each server's part of it (the bytes
/// WRITTEN there).
pub(crate) type LoggedPull = (u64, Vec<(u32, Vec<u8>)>);

/// The job's tables, and which server owns each bucket.
pub(crate) struct Tables<P: Fabric> {
    pub(crate) tables: Vec<Table<P>>,
    /// The bucket maps by first iteration, as the job map gave them.
    maps: Vec<(u64, BucketMap)>,
    /// A server that held rows and was lost, and no server took them over.
    pub(crate) lost: Option<u32>,
    /// With replicas: lost servers that held rows, waiting for a stand-in.
    pub(crate) pending: Vec<u32>,
    /// Lost servers whose rows a stand-in serves: (lost, stand-in).
    pub(crate) heirs: Vec<(u32, u32)>,
    /// A pull sent again to a stand-in whose acknowledgement is awaited
    /// (its table).
    pub(crate) again: Option<u16>,
    /// While requests are sent again to a stand-in.
    pub(crate) taking_over: bool,
    /// Pulls sent again to a stand-in are WRITTEN from here.
    pub(crate) again_out: Option<P::Mr>,
    pub(crate) replicas: u32,
}

/// One bucket map, and what a push needs of it.
struct BucketMap {
    /// A server rank per bucket.
    owner: Vec<u32>,
    /// The servers that own buckets (each gets a push), sorted.
    servers: Vec<u32>,
    /// By server rank: its place in `servers`.
    index: Vec<u32>,
}

impl BucketMap {
    fn new(owner: Vec<u32>) -> Self {
        let mut servers = owner.clone();
        servers.sort_unstable();
        servers.dedup();
        // (A few servers: not a bucket's worth of room per map kept.)
        servers.shrink_to_fit();
        let mut index = vec![0u32; servers.last().map_or(0, |&r| r as usize + 1)];
        for (i, &r) in servers.iter().enumerate() {
            index[r as usize] = i as u32;
        }
        Self { owner, servers, index }
    }
}

/// The most servers one table's push or pull may go to (its staging
/// buffers have room for their headers).
const MAX_TABLE_SERVERS: usize = 1024;

impl<P: Fabric> Tables<P> {
    /// Registers each table's buffers.
    pub(crate) fn new(pd: &P, spec: &eps_proto::JobSpec) -> Result<Self, FabricError> {
        let servers = spec.job.servers;
        let mut tables = Vec::new();
        for decl in eps_sparse::decl::tables(spec) {
            // Every server's request, each 8-byte aligned.
            let slack = MAX_TABLE_SERVERS * (HEADER + 8);
            let push = wire::region_bytes(Op::Push, &decl) + slack;
            let pull = wire::region_bytes(Op::Pull, &decl) + slack;
            tables.push(Table {
                rows: pd.alloc_mr(decl.max_keys * decl.spec.dim * decl.elem(), Access::LOCAL_WRITE | Access::REMOTE_WRITE)?,
                // Room for the largest pull from the start: the rows handed
                // out stay where they are (valid until the next pull, or longer).
                wide: Vec::with_capacity(decl.max_keys * decl.spec.dim),
                raw: if decl.dtype == eps_agg::DType::F32 {
                    Vec::new()
                } else {
                    Vec::with_capacity(decl.max_keys * decl.spec.dim * decl.elem())
                },
                // Only the worker writes its requests (they go out by WRITE).
                push_out: pd.alloc_mr(push, Access::NONE)?,
                pull_out: pd.alloc_mr(pull, Access::NONE)?,
                credit: vec![true; servers as usize],
                sending: Vec::new(),
                pushed_at: None,
                owed: Vec::new(),
                push_posts: Vec::new(),
                pull_posts: Vec::new(),
                pull_seq: None,
                log: Vec::new(),
                decl,
            });
        }
        Ok(Self {
            tables,
            maps: vec![(0, BucketMap::new(eps_sparse::bucket::initial_owners(servers)))],
            lost: None,
            pending: Vec::new(),
            heirs: Vec::new(),
            again: None,
            taking_over: false,
            again_out: None,
            replicas: spec.job.replicas,
        })
    }

    /// Takes in the bucket maps of `map` this worker does not have yet. One
    /// a later map replaced by the iteration every table last pushed keeps
    /// only its servers: no push or pull of this worker uses it again (the
    /// history grows with every move, and a loss makes one).
    pub(crate) fn follow(&mut self, map: &JobMap) -> Result<(), WorkerError> {
        for (at, runs) in map.buckets.iter().skip(self.maps.len()) {
            let owners = eps_proto::buckets::expand(runs).ok_or(WorkerError::Unexpected)?;
            if self.maps.last().is_some_and(|(last, _)| at <= last) {
                return Err(WorkerError::Unexpected);
            }
            self.maps.push((*at, BucketMap::new(owners)));
        }
        if let Some(from) = self.tables.iter().map(|t| t.pushed_at).min().flatten() {
            for i in 1..self.maps.len() {
                if self.maps[i].0 <= from {
                    self.maps[i - 1].1.owner = Vec::new();
                }
            }
        }
        Ok(())
    }

    /// The bucket map of iteration `t`.
    fn map_at(&self, t: u64) -> &BucketMap {
        // (The history starts with the map of iteration 0.)
        let m = eps_proto::buckets::owners_at(&self.maps, t).unwrap_or(&self.maps[0].1);
        debug_assert!(!m.owner.is_empty(), "the bucket map of iteration {t} was dropped as used no more");
        m
    }

    /// Whether server `server` holds rows of the tables this worker may
    /// still send to or hear from: a bucket map in force from the iteration
    /// of its oldest last push on names it (the newest one, or one before a
    /// cutover not reached yet).
    pub(crate) fn holds(&self, server: u32) -> bool {
        let from = self.tables.iter().filter_map(|t| t.pushed_at).min().unwrap_or(0);
        let until = |i: usize| self.maps.get(i + 1).map_or(u64::MAX, |n| n.0);
        !self.tables.is_empty() && self.maps.iter().enumerate().any(|(i, (_, m))| until(i) > from && m.servers.contains(&server))
    }

    /// Whether this worker may still send server `server` requests of the
    /// tables or hear from it: a bucket map in force after a table's last
    /// push names it, or a credit or a pull's answer from it is not in. (A
    /// server that gave its buckets away at a cutover owes nothing once it
    /// credited the last push before it: it credits a push once its backup
    /// has every change, the rows it gave away included.)
    pub(crate) fn awaits(&self, server: u32) -> bool {
        let until = |i: usize| self.maps.get(i + 1).map_or(u64::MAX, |n| n.0);
        let named_from = |t: u64| self.maps.iter().enumerate().any(|(i, (_, m))| until(i) > t && m.servers.contains(&server));
        self.tables.iter().any(|t| {
            let next = t.pushed_at.map_or(0, |p| p + 1);
            named_from(next) || t.owed.contains(&server) || t.credit.get(server as usize) == Some(&false)
        })
    }

    /// How many tables.
    pub(crate) fn len(&self) -> usize {
        self.tables.len()
    }

    /// A pull answer or a credit for table `table` from server `server`.
    pub(crate) fn on_imm(&mut self, server: u32, table: u16, m: Imm) {
        // A stand-in speaks for the lost server.
        let server = match eps_proto::layout::is_stand_in(m.shard) {
            true => {
                let Some(lost) = self.lost_for(server) else { return };
                if m.kind == ImmKind::PullDone && self.again == Some(table) {
                    // It took a pull again (see `takeover.rs`).
                    self.again = None;
                    return;
                }
                lost
            }
            false => server,
        };
        let Some(t) = self.tables.get_mut(table as usize) else { return };
        match m.kind {
            // (An answer from a server not asked is not counted.)
            ImmKind::PullDone => {
                if let Some(i) = t.owed.iter().position(|&s| s == server) {
                    t.owed.swap_remove(i);
                }
            }
            ImmKind::Credit => {
                if let Some(c) = t.credit.get_mut(server as usize) {
                    *c = true;
                }
            }
            _ => {}
        }
    }

    /// A push WRITE of table `table` to server `server` completed.
    pub(crate) fn sent(&mut self, table: usize, server: u32) {
        if let Some(n) = self.tables.get_mut(table).and_then(|t| t.sending.get_mut(server as usize)) {
            *n = n.saturating_sub(1);
        }
    }

    /// The tables whose pull answers are not all in: name and the servers
    /// that owe them (for a stall report).
    pub(crate) fn owed(&self) -> Vec<String> {
        let owing = self.tables.iter().filter(|t| !t.owed.is_empty());
        owing.map(|t| format!("table {:?} from servers {:?}", t.decl.name, t.owed)).collect()
    }

    /// Whether every push was applied: no WRITE in flight, every credit in
    /// (and no pull unanswered).
    pub(crate) fn applied(&self) -> bool {
        self.quiet() && self.tables.iter().all(|t| t.credit.iter().all(|&c| c))
    }

    /// Whether nothing is in flight: no pull a server may still answer into a
    /// row buffer, no push still reading its staging buffer.
    pub(crate) fn quiet(&self) -> bool {
        self.tables.iter().all(|t| t.owed.is_empty() && t.sent_all())
    }
}

/// The rows of a pull, copied out of the worker's registered row buffer (see
/// [`Worker::sparse_pull_rows`]).
#[derive(Debug)]
pub struct PulledRows<'a> {
    /// The distinct keys' rows, `dim` values each.
    pub rows: &'a [f32],
    /// Per key asked, in order: the index of its row in `rows`.
    pub index: Vec<u32>,
    /// Values per row.
    pub dim: usize,
}

impl PulledRows<'_> {
    /// Row `r`.
    pub fn row(&self, r: u32) -> &[f32] {
        let r = r as usize * self.dim;
        &self.rows[r..r + self.dim]
    }
}

/// Where worker `rank`'s requests for table `table` land on server `server`.
fn landing(map: &JobMap, rank: u32, server: u32, table: u16) -> Option<(u64, u32)> {
    let e = map.tables.iter().find(|e| e.owner == server && e.shard == u32::from(table))?;
    e.landing.get(rank as usize).copied()
}

impl<P: Fabric> Worker<P> {
    /// The index of table `name` (what [`Worker::sparse_pull`] and
    /// [`Worker::sparse_push`] take).
    pub fn table(&self, name: &str) -> Result<u16, WorkerError> {
        let t = self.sparse.tables.iter().position(|t| t.decl.name == name);
        t.map(|i| i as u16).ok_or_else(|| WorkerError::UnknownTable(name.to_string()))
    }

    /// The row dimension of table `table`.
    pub fn table_dim(&self, table: u16) -> Result<usize, WorkerError> {
        Ok(self.decl(table)?.spec.dim)
    }

    fn decl(&self, table: u16) -> Result<&Declared, WorkerError> {
        let n = self.sparse.len();
        let t = self.sparse.tables.get(table as usize).map(|t| &t.decl);
        t.ok_or_else(|| WorkerError::UnknownTable(format!("#{table} (the job has {n} tables)")))
    }

    fn sparse_err(&self, table: u16, why: String) -> WorkerError {
        WorkerError::Sparse { table: self.sparse.tables[table as usize].decl.name.clone(), why }
    }

    /// Checks `keys` against the table's key limit and its distinct keys
    /// against `max_keys`.
    fn check_keys(&self, table: u16, keys: &[u64], distinct: usize) -> Result<(), WorkerError> {
        let d = self.decl(table)?;
        if let (Some(limit), Some(k)) = (d.key_limit, keys.iter().find(|k| !d.admits(**k))) {
            return Err(self.sparse_err(table, format!("key {k} is not below the table's key_limit {limit}")));
        }
        if distinct > d.max_keys {
            return Err(
                self.sparse_err(table, format!("{distinct} distinct keys in one call; the table's max_keys is {}", d.max_keys))
            );
        }
        Ok(())
    }

    /// The rows of `keys` as of the current iteration, into `out` (`dim`
    /// values per key, in the order of `keys`; a key may repeat). Rows not
    /// seen before are created by their servers from the table's
    /// initializer. (A copy out of [`Worker::sparse_pull_rows`].)
    pub fn sparse_pull(&mut self, table: u16, keys: &[u64], out: &mut [f32]) -> Result<(), WorkerError> {
        let dim = self.decl(table)?.spec.dim;
        if out.len() != keys.len() * dim {
            return Err(WorkerError::Length { what: "sparse pull output", expected: keys.len() * dim, got: out.len() });
        }
        let p = self.sparse_pull_rows(table, keys)?;
        for (o, &r) in out.chunks_exact_mut(dim).zip(&p.index) {
            o.copy_from_slice(p.row(r));
        }
        Ok(())
    }

    /// Pulls the rows of `keys` as of the current iteration, each distinct
    /// key once, straight into this worker's registered row buffer (the
    /// servers WRITE them there), and returns a view of them: no copy on
    /// this side. Valid until the table's next pull.
    pub fn sparse_pull_rows(&mut self, table: u16, keys: &[u64]) -> Result<PulledRows<'_>, WorkerError> {
        let (dim, elem) = (self.decl(table)?.spec.dim, self.decl(table)?.elem());
        let d = dedup(keys);
        self.check_keys(table, keys, d.keys.len())?;
        self.follow_buckets()?;
        self.take_over_rows()?;
        // The version asked: BSP every earlier iteration applied; SSP the
        // slowest worker within the staleness bound; ASP whatever is there.
        let v = match self.mode {
            eps_proto::Consistency::Bsp => self.iteration,
            eps_proto::Consistency::Ssp => self.iteration.saturating_sub(self.spec.job.staleness.into()),
            eps_proto::Consistency::Asp => 0,
        };
        // (Buckets move under BSP only: the map of the iteration is the map
        // of the version.)
        let owners = &self.sparse.map_at(self.iteration).owner;
        let reqs = split_by_owner(&d.keys, owners).map_err(|e| self.sparse_err(table, e.to_string()))?;
        // Row `slot[i]` of the row buffer is distinct key `i`'s.
        let mut slot = vec![0u32; d.keys.len()];
        let (mut at, mut row) = (0usize, 0usize);
        let mut posts = Vec::with_capacity(reqs.len());
        let t = &mut self.sparse.tables[table as usize];
        if self.sparse.replicas > 1 {
            t.log_last_pull(v);
        }
        // No pull of this table is in flight (they are answered before the
        // call returns), so no WRITE reads this buffer half-written.
        let out = t.pull_out.view_mut()?;
        for r in &reqs {
            for (j, &i) in r.at.iter().enumerate() {
                slot[i as usize] = (row + j) as u32;
            }
            let h = Header {
                table,
                op: Op::Pull,
                count: r.keys.len() as u32,
                dim: dim as u32,
                seq: v,
                reply_addr: t.rows.addr() + (row * dim * elem) as u64,
                reply_rkey: t.rows.rkey(),
            };
            let n = wire::write(&mut out[at..], &h, &r.keys, &[]);
            posts.push((r.server, at, n));
            at = (at + n).next_multiple_of(8);
            row += r.keys.len();
        }
        t.owed = reqs.iter().map(|r| r.server).collect();
        t.pull_posts.clone_from(&posts);
        t.pull_seq = Some(v);
        let off = pull_offset(&t.decl) as u64;
        for (server, at, n) in posts {
            // (A lost server's part goes to its stand-in: see `takeover.rs`.)
            let Some((addr, rkey)) = self.sparse_landing(server, table)? else { continue };
            let to = RemoteAddr { addr: addr + off, rkey };
            self.post_sparse(server, table, Staged::Pull, to, ImmKind::PullReq, v, at, n)?;
        }
        self.wait_until(|w| w.sparse.tables[table as usize].owed.is_empty(), "sparse pull answers")?;
        self.count_pulled((row * dim * elem) as u64);
        let index = d.of.iter().map(|&u| slot[u as usize]).collect();
        let t = &mut self.sparse.tables[table as usize];
        // Every pull of this table was answered (above): the rows are copied
        // out of the buffer servers write (f32 ones as they are; bf16 and f16
        // ones widened from the copy).
        let n = row * dim;
        let rows: &[f32] = if t.decl.dtype == eps_agg::DType::F32 {
            t.wide.resize(n, 0.0);
            t.rows.read_at(0, bytemuck::cast_slice_mut(&mut t.wide[..]));
            &t.wide
        } else {
            t.raw.resize(n * elem, 0);
            t.rows.read_at(0, &mut t.raw);
            wire::widen(t.decl.dtype, &t.raw, &mut t.wide)
        };
        Ok(PulledRows { rows, index, dim })
    }

    /// Pushes the current iteration's gradient rows of table `table`: one
    /// row of `dim` values per entry of `keys` (a key may repeat: its rows
    /// are summed in order). Once per table and iteration; a table not
    /// pushed is pushed empty when the worker waits for the iteration's
    /// parameters.
    pub fn sparse_push(&mut self, table: u16, keys: &[u64], grads: &[f32]) -> Result<(), WorkerError> {
        let d = self.decl(table)?;
        let (dim, elem, dtype) = (d.spec.dim, d.elem(), d.dtype);
        if grads.len() != keys.len() * dim {
            return Err(WorkerError::Length { what: "sparse push gradients", expected: keys.len() * dim, got: grads.len() });
        }
        let v = self.iteration;
        if self.sparse.tables[table as usize].pushed_at == Some(v) {
            return Err(self.sparse_err(table, format!("pushed twice in iteration {v}")));
        }
        let d = dedup(keys);
        self.check_keys(table, keys, d.keys.len())?;
        self.sparse_flush(table)?;
        self.follow_buckets()?;
        self.take_over_rows()?;
        // The servers that own buckets in this iteration (each gets a push),
        // and each distinct key's (an index into them) and its place in that
        // server's request.
        let bm = self.sparse.map_at(v);
        let ranks = bm.servers.clone();
        if ranks.len() > MAX_TABLE_SERVERS {
            return Err(self.sparse_err(
                table,
                format!("its buckets are on {} servers; a worker pushes to {MAX_TABLE_SERVERS} at most", ranks.len()),
            ));
        }
        let servers = ranks.len();
        let server: Vec<u32> = d.keys.iter().map(|k| bm.index[bm.owner[bucket_of(*k) as usize] as usize]).collect();
        let mut count = vec![0usize; servers];
        let place: Vec<usize> = server
            .iter()
            .map(|&s| {
                count[s as usize] += 1;
                count[s as usize] - 1
            })
            .collect();
        let mut base = Vec::with_capacity(servers);
        let mut at = 0usize;
        for &n in &count {
            base.push(at);
            at = (at + wire::request_bytes(Op::Push, n, dim, elem)).next_multiple_of(8);
        }
        let t = &mut self.sparse.tables[table as usize];
        // No WRITE from the push buffer is in flight (`sparse_flush` waited for
        // every one), so none goes out half-written.
        let out = t.push_out.view_mut()?;
        for (s, (&b, &n)) in base.iter().zip(&count).enumerate() {
            let h = Header { table, op: Op::Push, count: n as u32, dim: dim as u32, seq: v, reply_addr: 0, reply_rkey: 0 };
            out[b..b + HEADER].copy_from_slice(&h.encode());
            debug_assert!(s < servers);
        }
        for (u, k) in d.keys.iter().enumerate() {
            let o = base[server[u] as usize] + HEADER + 8 * place[u];
            out[o..o + 8].copy_from_slice(&k.to_le_bytes());
        }
        // Each distinct key's row: the first of its rows, then the others
        // added in batch order (the bits BSP defines), in f32: straight into
        // the staging buffer for an f32 table, else apart and then narrowed
        // into it.
        let at = |u: usize| {
            let s = server[u] as usize;
            base[s] + HEADER + 8 * count[s] + place[u] * dim * elem
        };
        let mut wide = if dtype == eps_agg::DType::F32 { Vec::new() } else { vec![0f32; d.keys.len() * dim] };
        let mut seen = vec![false; d.keys.len()];
        for (g, &u) in grads.chunks_exact(dim).zip(&d.of) {
            let u = u as usize;
            let row: &mut [f32] = if wide.is_empty() {
                let o = at(u);
                bytemuck::cast_slice_mut(&mut out[o..o + dim * 4])
            } else {
                &mut wide[u * dim..(u + 1) * dim]
            };
            if seen[u] {
                row.iter_mut().zip(g).for_each(|(a, b)| *a += *b);
            } else {
                row.copy_from_slice(g);
                seen[u] = true;
            }
        }
        for (u, row) in wide.chunks_exact(dim).enumerate() {
            let o = at(u);
            eps_agg::reduce::narrow(dtype, row, &mut out[o..o + dim * elem]);
        }
        let posts: Vec<(u32, usize, usize)> =
            (0..servers).map(|s| (ranks[s], base[s], wire::request_bytes(Op::Push, count[s], dim, elem))).collect();
        t.pushed_at = Some(v);
        t.push_posts.clone_from(&posts);
        for (server, at, n) in posts {
            let t = &mut self.sparse.tables[table as usize];
            if t.credit.len() <= server as usize {
                t.credit.resize(server as usize + 1, true);
            }
            t.credit[server as usize] = false;
            // (A lost server's part goes to its stand-in: see `takeover.rs`.)
            let Some((addr, rkey)) = self.sparse_landing(server, table)? else { continue };
            let conn = self.sparse.heir_of(server).unwrap_or(server);
            self.sparse.tables[table as usize].sending_to(conn);
            self.post_sparse(server, table, Staged::Push, RemoteAddr { addr, rkey }, ImmKind::Push, v, at, n)?;
            self.count_pushed(n as u64);
        }
        Ok(())
    }

    /// Waits until the servers applied this worker's last push of table
    /// `table` (under BSP: until every worker's push of that iteration is in
    /// and applied).
    pub fn sparse_flush(&mut self, table: u16) -> Result<(), WorkerError> {
        self.decl(table)?;
        self.wait_until(
            |w| {
                let t = &w.sparse.tables[table as usize];
                t.sent_all() && t.credit.iter().all(|&c| c)
            },
            "the servers to apply this worker's last sparse push",
        )
    }

    /// Begins the iteration, then takes in the newest map the watcher
    /// fetched, and its bucket maps: a
    /// bucket move is committed before any worker begins its cutover
    /// iteration, and the watcher stores the map before it lets the
    /// iteration begin.
    fn follow_buckets(&mut self) -> Result<(), WorkerError> {
        // (The iteration begins here if the caller has not begun it: a
        // bucket vote may hold it.)
        if !self.begin()? {
            return Err(WorkerError::Left(self.iteration));
        }
        self.adopt_newest()?;
        self.sparse.follow(&self.map)
    }

    /// As [`Worker::sparse_fill`] without waiting: `false` (nothing sent)
    /// while a table to push still waits for the credit of its last push.
    pub(crate) fn sparse_fill_ready(&mut self) -> Result<bool, WorkerError> {
        let v = self.iteration;
        let due = |t: &Table<P>| t.pushed_at != Some(v);
        if !self.sparse.tables.iter().any(due) {
            return Ok(true);
        }
        self.reap()?;
        let waiting = |t: &Table<P>| due(t) && !(t.sent_all() && t.credit.iter().all(|&c| c));
        if self.sparse.tables.iter().any(waiting) {
            return Ok(false);
        }
        self.sparse_fill()?;
        Ok(true)
    }

    /// Pushes every table not pushed in the current iteration, empty.
    pub(crate) fn sparse_fill(&mut self) -> Result<(), WorkerError> {
        let v = self.iteration;
        for i in 0..self.sparse.len() {
            if self.sparse.tables[i].pushed_at != Some(v) {
                self.sparse_push(i as u16, &[], &[])?;
            }
        }
        Ok(())
    }

    /// Where this worker's requests for `table` land on server `server`
    /// (its stand-in's regions, if it was lost and one serves its rows).
    /// `None` for a lost server no stand-in serves yet: what it was to get
    /// is sent to its stand-in once there is one; without replicas, a lost
    /// server stops the tables.
    pub(crate) fn sparse_landing(&mut self, server: u32, table: u16) -> Result<Option<(u64, u32)>, WorkerError> {
        if self.sparse.heir_of(server).is_none() {
            let named = self.map.servers.iter().any(|(r, _)| *r == server);
            if self.lost.contains(&server) || !named || self.qps.get(server as usize).is_none_or(Option::is_none) {
                self.sparse.lose(server);
            }
            if let Some(e) = self.sparse.lost_error() {
                return Err(e);
            }
            if self.sparse.pending.contains(&server) {
                return Ok(None);
            }
        }
        landing(&self.map, self.rank, server, table).map(Some).ok_or(WorkerError::NoAddress(server))
    }

    /// Posts bytes `at..at + n` of a table's staging buffer to server
    /// `server` (its stand-in, if it was lost) with a `kind` immediate of
    /// iteration or version `seq`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn post_sparse(
        &mut self,
        server: u32,
        table: u16,
        from: Staged,
        to: RemoteAddr,
        kind: ImmKind,
        seq: u64,
        at: usize,
        n: usize,
    ) -> Result<(), WorkerError> {
        let (conn, shard) = match self.sparse.heir_of(server) {
            Some(h) => (h, stand_in_id(table)),
            None => (server, sparse_id(table)),
        };
        let imm = Imm { kind, shard, seq: seq as u16 }.encode();
        let push = from == Staged::Push;
        self.post_retrying(|w| {
            let t = &w.sparse.tables[table as usize];
            let mr = match from {
                Staged::Push => &t.push_out,
                Staged::Pull => &t.pull_out,
                Staged::Again => w.sparse.again_out.as_ref().ok_or(WorkerError::Unexpected)?,
            };
            let sg = [Sge::new(mr, at as u64, n as u32)];
            let wr_id = WR_SPARSE | if push { 0 } else { WR_SPARSE_PULL } | u64::from(table);
            Ok(w.qp(conn)?.post_send(&SendWr { wr_id, op: SendOp::WriteImm(to, imm), sg: &sg, signaled: push })?)
        })
    }
}
