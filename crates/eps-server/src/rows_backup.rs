//! Backups of table rows (`job.replicas = 2`): every server that owns
//! buckets keeps a copy of its rows on the next one (the control plane
//! says which: `Order::BackupRows`), in step with every update.
//!
//! After each update of a table the owner writes what changed since the
//! last forward (the rows created, touched, stepped or taken in, with their
//! optimizer state and bookkeeping, and the keys evicted or taken out; every
//! row for a new backup) into a registered blob, and WRITEs its descriptor
//! into the backup's inbox with a `Forward` immediate. A blob that fits the
//! landing region the backup keeps for it (its address came with the last
//! acknowledgement) is WRITTEN there just before; a larger one (a new
//! backup's every row) the backup READs. The backup takes the blob in over
//! its copy and acknowledges the version. Until
//! then the owner holds the table's requests and answers nothing of the new
//! version: a version a worker pulled is always on the backup too. (A
//! pull's own bookkeeping, a row created or touched, travels with the next
//! update's forward.) With `EPS_VERIFY_BACKUPS` set, each forward carries a
//! digest of every row the owner holds, and the backup checks its copy
//! against it, bit for bit.

use eps_fabric::{Access, Fabric, MemoryRegion, RemoteAddr, SendOp, SendWr, Sge};
use eps_proto::control::{ControlMsg, RowsBackup};
use eps_proto::imm::{Imm, ImmKind};
use eps_proto::layout::sparse_id;
use eps_sparse::RowTable;

use crate::{Peer, Server, ServerError, WR_OTHER};

/// Work-request ids of READs of forwarded rows: these bits, the owner's
/// rank (bits 16..) and the table.
pub(crate) const WR_MIRROR: u64 = WR_OTHER | (1 << 44);

/// Owners a server can keep rows of: each server rank has a descriptor
/// slot per table.
const INBOX_SLOTS: usize = eps_proto::spec::MAX_SERVERS as usize;
/// Bytes of a descriptor: version, blob address (0: in the landing region),
/// length, key, then where the acknowledgement's reply goes (address, key).
const DESCRIPTOR: usize = 48;
/// Bytes of a reply: the landing region's address, key and length.
const REPLY: usize = 16;
/// Where a forward's blob starts in the owner's memory (after the descriptor
/// and the reply).
const BLOB_AT: usize = DESCRIPTOR + REPLY;
/// Bytes of the landing region a backup keeps per owner and table.
const LANDING: usize = 4 << 20;
/// READs of one forward in flight at once.
const READ_WINDOW: u32 = 4;

/// A server's part in table backups: as an owner, its forwards; as a backup,
/// its copies of other servers' rows.
pub(crate) struct RowsBackups<P: Fabric> {
    /// By table: where owners write descriptors (none without replicas).
    inbox: Vec<P::Mr>,
    link: Option<Link>,
    out: Vec<Out<P>>,
    copies: Vec<Copy<P>>,
    /// Landing regions of copies dropped, by owner: an old owner that has
    /// not heard yet that its backup moved (or that was cut off and has not
    /// stopped yet) may still WRITE into one. Kept while a connection from
    /// it lives (nothing else can WRITE there).
    retired: Vec<(u32, P::Mr)>,
    /// Each forward carries a digest the backup checks.
    verify: bool,
    sent: Totals,
    taken: Totals,
    /// Sources whose rows were taken in here, reported once they are on
    /// this server's backup.
    taken_from: Vec<u32>,
}

/// Where this server's rows are kept.
struct Link {
    rank: u32,
    ci: usize,
    inbox: Vec<RemoteAddr>,
}

/// One table's forwards.
struct Out<P: Fabric> {
    staging: Vec<u8>,
    /// The descriptor, then the blob.
    blob: Option<P::Mr>,
    /// The version forwarded and not acknowledged, and the connection it went on.
    in_flight: Option<(u64, usize)>,
    /// When it was posted.
    posted: std::time::Instant,
    /// Every row goes with the next forward (a new backup).
    full_due: bool,
    /// Rows were taken in (a bucket move): what changed goes to the backup
    /// before anything else is served.
    changed_due: bool,
    /// The forward in flight carries every row; one such was acknowledged
    /// by the current backup.
    full_in_flight: bool,
    whole: bool,
    /// The backup's landing region for this table's forwards, and its bytes.
    landing: Option<(RemoteAddr, usize)>,
    /// The contributors of the update whose forward is in flight: credited,
    /// and the pulls it made ready answered, once it is acknowledged.
    after: Option<Vec<u32>>,
}

/// A copy of another server's rows of one table.
struct Copy<P: Fabric> {
    from: u32,
    table: u16,
    rows: RowTable,
    version: u64,
    read: Option<Read<P>>,
    /// The last forward's memory, kept for the next.
    spare: Option<P::Mr>,
    /// Where forwards that fit are WRITTEN, and the reply of each
    /// acknowledgement (where that is) is sent from.
    landing: P::Mr,
    reply: P::Mr,
    /// It started from a forward of every row (one that did not is an old
    /// owner's last forward, landed after this server stopped being its
    /// backup: it is acknowledged and not kept).
    whole: bool,
}

/// The READs of one forward.
struct Read<P: Fabric> {
    ci: usize,
    mr: P::Mr,
    remote: RemoteAddr,
    /// Where the acknowledgement's reply goes.
    reply: RemoteAddr,
    len: usize,
    asked: usize,
    in_flight: u32,
}

#[derive(Clone, Copy, Debug, Default)]
struct Totals {
    forwards: u64,
    rows: u64,
    bytes: u64,
    verified: u64,
    /// Of the forwards taken in, those READ (too large for the landing region).
    read: u64,
    /// Seconds from forwards posted to their acknowledgements.
    waited_s: f64,
}

impl<P: Fabric> RowsBackups<P> {
    /// Whether the rows of server `from` were taken in and are not reported
    /// yet.
    pub(crate) fn taking(&self, from: u32) -> bool {
        self.taken_from.contains(&from)
    }

    /// For `tables` tables; inboxes registered if the job keeps replicas.
    pub(crate) fn new(pd: &P, tables: usize, replicas: u32) -> Result<Self, ServerError> {
        let mut inbox = Vec::new();
        if replicas > 1 {
            for _ in 0..tables {
                inbox.push(pd.alloc_mr(INBOX_SLOTS * DESCRIPTOR, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?);
            }
        }
        let out = (0..tables).map(|_| Out {
            staging: Vec::new(),
            blob: None,
            in_flight: None,
            posted: std::time::Instant::now(),
            full_due: false,
            changed_due: false,
            full_in_flight: false,
            whole: false,
            landing: None,
            after: None,
        });
        Ok(Self {
            inbox,
            link: None,
            out: out.collect(),
            copies: Vec::new(),
            retired: Vec::new(),
            verify: std::env::var_os("EPS_VERIFY_BACKUPS").is_some(),
            sent: Totals::default(),
            taken: Totals::default(),
            taken_from: Vec::new(),
        })
    }

    /// Table `t`'s inbox (address, key), or zeros.
    pub(crate) fn inbox(&self, t: usize) -> (u64, u32) {
        self.inbox.get(t).map_or((0, 0), |m| (m.addr(), m.rkey()))
    }

    /// Whether table `t`'s requests wait for its backup's acknowledgement.
    pub(crate) fn busy(&self, t: usize) -> bool {
        self.out.get(t).is_some_and(|o| o.in_flight.is_some())
    }

    /// Takes out the copies of server `from`'s rows, one per table of
    /// `tables` and each at its version, if every one is whole (see
    /// `stand_in.rs`).
    pub(crate) fn take_copies(&mut self, from: u32, tables: usize) -> Option<Vec<(RowTable, u64)>> {
        let of = |copies: &[Copy<P>], t: usize| copies.iter().position(|c| c.from == from && c.table as usize == t && c.whole);
        if (0..tables).any(|t| of(&self.copies, t).is_none()) {
            return None;
        }
        let mut out = Vec::with_capacity(tables);
        for t in 0..tables {
            let c = self.copies.remove(of(&self.copies, t)?);
            self.retired.push((from, c.landing));
            out.push((c.rows, c.version));
        }
        Some(out)
    }

    /// What the backups did, for the server's last words.
    pub(crate) fn report(&self, rank: u32, stepped: u64, row_bytes: u64) -> Vec<String> {
        let mut lines = Vec::new();
        let s = self.sent;
        if s.forwards > 0 {
            lines.push(format!(
                "eps server {rank}: forwarded {} updates of its table rows to its backup: {} rows, {} bytes \
                 (the merged gradients were {} bytes); acknowledged {:.0} us after they went, on average",
                s.forwards,
                s.rows,
                s.bytes,
                stepped * row_bytes,
                s.waited_s * 1e6 / s.forwards as f64
            ));
        }
        for c in &self.copies {
            lines.push(format!(
                "eps server {rank}: holds a copy of server {}'s table {} at version {}: {} rows",
                c.from,
                c.table,
                c.version,
                c.rows.len()
            ));
        }
        let t = self.taken;
        if t.forwards > 0 {
            lines.push(format!(
                "eps server {rank}: took in {} forwards of table rows ({} rows, {} bytes, {} of them READ); {} checked bit for bit",
                t.forwards, t.rows, t.bytes, t.read, t.verified
            ));
        }
        lines
    }
}

impl<P: Fabric> Server<P> {
    /// `Order::BackupRows`: this server's rows are kept on `to` from now on
    /// (every row first), or on no server.
    pub(crate) fn on_backup_rows(&mut self, to: Option<RowsBackup>) -> Result<(), ServerError> {
        let b = &mut self.sparse.backups;
        b.link = None;
        for o in &mut b.out {
            o.full_due = false;
            o.whole = false;
            o.landing = None;
        }
        let Some(to) = to else {
            eps_proto::say!("eps server {}: its table rows have no backup from now on", self.rank);
            return Ok(());
        };
        if self.rank as usize >= INBOX_SLOTS || to.inbox.len() != self.sparse.tables.len() {
            eps_proto::say!(
                "eps server {}: its table rows cannot be kept on server {} (ranks from {INBOX_SLOTS} on have no inbox, \
                 or the tables differ); they have no backup",
                self.rank,
                to.rank
            );
            return Ok(());
        }
        let ci = match self.target_conn(to.rank, &to.addr) {
            Ok(ci) => ci,
            Err(e) => {
                eps_proto::say!("eps server {}: cannot reach server {} for its row backups ({e})", self.rank, to.rank);
                return Ok(());
            }
        };
        let slot = (self.rank as usize * DESCRIPTOR) as u64;
        let inbox = to.inbox.iter().map(|&(addr, rkey)| RemoteAddr { addr: addr + slot, rkey }).collect();
        let b = &mut self.sparse.backups;
        b.link = Some(Link { rank: to.rank, ci, inbox });
        for o in &mut b.out {
            o.full_due = true;
        }
        eps_proto::say!("eps server {}: its table rows are kept in step on server {}", self.rank, to.rank);
        for t in 0..self.sparse.tables.len() as u16 {
            if !self.sparse.backups.busy(t as usize) {
                self.forward_rows(t, None)?;
            }
        }
        Ok(())
    }

    /// Forwards what changed in table `table` to its backup, if it has one;
    /// `after` (an update's contributors) is finished once it is
    /// acknowledged. Returns whether a forward went (else finish now).
    pub(crate) fn forward_rows(&mut self, table: u16, after: Option<Vec<u32>>) -> Result<bool, ServerError> {
        let t = table as usize;
        let link = self.sparse.backups.link.as_ref().filter(|l| self.conns[l.ci].alive);
        let Some((ci, remote)) = link.map(|l| (l.ci, l.inbox[t])) else {
            // (No backup: nothing is due to one.)
            if let Some(o) = self.sparse.backups.out.get_mut(t) {
                o.changed_due = false;
            }
            return Ok(false);
        };
        let verify = self.sparse.backups.verify;
        let o = &mut self.sparse.backups.out[t];
        let full = std::mem::take(&mut o.full_due);
        o.changed_due = false;
        let part = &mut self.sparse.tables[t].part;
        let version = part.sync.version();
        let stats = part.write_forward(full, verify, &mut o.staging);
        let (len, need) = (o.staging.len(), BLOB_AT + o.staging.len());
        if o.blob.as_ref().is_none_or(|m| m.len() < need) {
            o.blob = Some(self.pd.alloc_mr(need.next_power_of_two(), Access::REMOTE_READ | Access::REMOTE_WRITE)?);
        }
        let Some(blob) = o.blob.as_mut() else { return Ok(false) };
        // (One WRITE: no larger than the fabric's largest message.)
        let most = (self.opts.max_msg_bytes as usize).max(4096);
        let inline = o.landing.filter(|&(_, n)| len <= n.min(most)).map(|(at, _)| at);
        let mut d = [0u8; DESCRIPTOR];
        d[..8].copy_from_slice(&version.to_le_bytes());
        let at = if inline.is_some() { 0 } else { blob.addr() + BLOB_AT as u64 };
        d[8..16].copy_from_slice(&at.to_le_bytes());
        d[16..24].copy_from_slice(&(len as u64).to_le_bytes());
        d[24..28].copy_from_slice(&blob.rkey().to_le_bytes());
        d[32..40].copy_from_slice(&(blob.addr() + DESCRIPTOR as u64).to_le_bytes());
        d[40..44].copy_from_slice(&blob.rkey().to_le_bytes());
        blob.write_at(0, &d);
        blob.write_at(BLOB_AT, &o.staging);
        let conn = &self.conns[ci];
        if let Some(landing) = inline {
            // Before the notice on the same connection: in place when it lands.
            let sg = [Sge::new(blob, BLOB_AT as u64, len as u32)];
            let wr = SendWr { wr_id: WR_OTHER, op: SendOp::Write(landing), sg: &sg, signaled: false };
            conn.post_or_flush(&wr, &mut self.flushed)?;
        }
        let imm = Imm { kind: ImmKind::Forward, shard: sparse_id(table), seq: version as u16 }.encode();
        let sg = [Sge::new(blob, 0, DESCRIPTOR as u32)];
        let wr = SendWr { wr_id: WR_OTHER, op: SendOp::WriteImm(remote, imm), sg: &sg, signaled: false };
        conn.post_or_flush(&wr, &mut self.flushed)?;
        o.in_flight = Some((version, ci));
        o.full_in_flight = full;
        o.posted = std::time::Instant::now();
        o.after = after;
        let s = &mut self.sparse.backups.sent;
        s.forwards += 1;
        s.rows += stats.rows;
        s.bytes += stats.bytes;
        Ok(true)
    }

    /// The backup on `ci` acknowledged table `table`'s forward of version
    /// `seq` (low bits), its landing region in the reply: the update is
    /// finished, what waited is handled.
    pub(crate) fn rows_acked(&mut self, ci: usize, table: u16, seq: u16) -> Result<(), ServerError> {
        let t = table as usize;
        let current = self.sparse.backups.link.as_ref().is_some_and(|l| l.ci == ci);
        let Some(o) = self.sparse.backups.out.get_mut(t) else { return Ok(()) };
        if o.in_flight.is_none_or(|(v, c)| v as u16 != seq || c != ci) {
            eps_proto::say!("eps server {}: an acknowledgement of table {table}'s rows it did not wait for; ignored", self.rank);
            return Ok(());
        }
        o.in_flight = None;
        let whole = current && o.full_in_flight && !o.whole;
        o.whole |= current && o.full_in_flight;
        self.sparse.backups.sent.waited_s += o.posted.elapsed().as_secs_f64();
        if whole && self.sparse.backups.out.iter().all(|o| o.whole) {
            // Every table's rows are whole on the backup: a loss of this
            // server loses none of them from now on.
            let backup = self.sparse.backups.link.as_ref().map_or(u32::MAX, |l| l.rank);
            if let Err(why) = self.report(&ControlMsg::RowsBackedUp { rank: self.rank, backup })? {
                eps_proto::say!("eps server {}: the control plane did not take its rows' backup: {why}", self.rank);
            }
        }
        let o = &mut self.sparse.backups.out[t];
        if let Some(blob) = o.blob.as_ref().filter(|_| current) {
            let mut r = [0u8; REPLY];
            blob.read_at(DESCRIPTOR, &mut r);
            let addr = u64::from_le_bytes(r[..8].try_into().unwrap_or_default());
            let rkey = u32::from_le_bytes(r[8..12].try_into().unwrap_or_default());
            let n = u32::from_le_bytes(r[12..16].try_into().unwrap_or_default()) as usize;
            o.landing = (addr != 0).then_some((RemoteAddr { addr, rkey }, n));
        }
        self.rows_forward_done(table)
    }

    /// Table `table`'s forward is over (acknowledged, or its backup lost).
    fn rows_forward_done(&mut self, table: u16) -> Result<(), ServerError> {
        let o = &mut self.sparse.backups.out[table as usize];
        let after = o.after.take();
        // A new backup ordered meanwhile gets every row now; rows taken in
        // meanwhile go too.
        if (o.full_due || o.changed_due) && self.forward_rows(table, None)? {
            self.sparse.backups.out[table as usize].after = after;
            return Ok(());
        }
        if let Some(c) = after {
            self.finish_sparse_update(table, &c)?;
        }
        self.report_taken_rows()?;
        self.replay_sparse()
    }

    /// Rows from server `from` were taken into this server's parts (a bucket
    /// move, or a lost server's copy it stood in for): they go to its backup
    /// (the tables' requests wait meanwhile), and are reported taken
    /// (`RowsTaken`) once it has them: the source keeps its own until then,
    /// and a loss before that is a loss during the move.
    pub(crate) fn rows_taken_in(&mut self, from: u32) -> Result<(), ServerError> {
        self.sparse.backups.taken_from.push(from);
        self.rows_changed()?;
        self.report_taken_rows()
    }

    /// Rows changed outside an update (rows held out for a bucket move
    /// released): what changed goes to the backup (after the forward in
    /// flight, if any).
    pub(crate) fn rows_changed(&mut self) -> Result<(), ServerError> {
        for t in 0..self.sparse.tables.len() as u16 {
            if self.sparse.backups.busy(t as usize) {
                self.sparse.backups.out[t as usize].changed_due = true;
            } else {
                self.forward_rows(t, None)?;
            }
        }
        Ok(())
    }

    /// Reports the rows taken in, once no table's forward is in flight.
    fn report_taken_rows(&mut self) -> Result<(), ServerError> {
        let b = &self.sparse.backups;
        if b.taken_from.is_empty()
            || (0..self.sparse.tables.len()).any(|t| b.busy(t) || b.out.get(t).is_some_and(|o| o.changed_due))
        {
            return Ok(());
        }
        // Only then does anything need them go on: until a target reports
        // a source's rows, its backup's copy holds them whole or not at all
        // (see `stand_in_take.rs`).
        let mut last = false;
        for from in std::mem::take(&mut self.sparse.backups.taken_from) {
            let (rank, to) = (self.rank, self.rank);
            if let Err(why) = self.report(&ControlMsg::RowsTaken { rank, from, to })? {
                return Err(ServerError::Sparse(format!("the control plane refused the rows of server {from}: {why}")));
            }
            last |= self.sparse.moving.take_in(from);
        }
        if last {
            return self.replay_sparse();
        }
        Ok(())
    }

    /// Connection `ci` failed: if it led to the rows' backup, they go on
    /// without one (what waited for an acknowledgement is served).
    pub(crate) fn rows_backup_conn_lost(&mut self, ci: usize) -> Result<(), ServerError> {
        // A forward being READ on it will not come: the copy stays as of
        // the last one taken in (the owner served nothing later).
        for c in &mut self.sparse.backups.copies {
            if c.read.as_ref().is_some_and(|r| r.ci == ci) {
                c.read = None;
            }
        }
        if let Some(rank) = self.sparse.backups.link.as_ref().filter(|l| l.ci == ci).map(|l| l.rank) {
            eps_proto::say!(
                "eps server {}: the backup of its table rows (server {rank}) is gone; they go on without one",
                self.rank
            );
            self.sparse.backups.link = None;
            for o in &mut self.sparse.backups.out {
                o.full_due = false;
            }
        }
        self.drop_retired_landings();
        // (A forward to a backup replaced since may be in flight on it.)
        for t in 0..self.sparse.backups.out.len() {
            let o = &mut self.sparse.backups.out[t];
            if o.in_flight.is_some_and(|(_, c)| c == ci) {
                o.in_flight = None;
                self.rows_forward_done(t as u16)?;
            }
        }
        Ok(())
    }

    /// Drops the landing regions of dropped copies whose owner no live
    /// connection leads to (see `RowsBackups::retired`).
    pub(crate) fn drop_retired_landings(&mut self) {
        let live: Vec<u32> = self
            .conns
            .iter()
            .filter_map(|c| match (c.peer, c.alive) {
                (Peer::Server(h), true) => Some(h.rank & !eps_proto::hello::PEER_BIT),
                _ => None,
            })
            .collect();
        self.sparse.backups.retired.retain(|(owner, _)| live.contains(owner));
    }

    /// A forward of table `table`'s rows landed from the server on `ci`:
    /// its blob is READ.
    pub(crate) fn on_rows_forward(&mut self, ci: usize, table: u16, seq: u16) -> Result<(), ServerError> {
        let from = match self.conns[ci].peer {
            Peer::Server(h) => h.rank & !eps_proto::hello::PEER_BIT,
            _ => u32::MAX,
        };
        let (t, slot) = (table as usize, from as usize);
        if slot >= INBOX_SLOTS || t >= self.sparse.backups.inbox.len() || t >= self.sparse.tables.len() {
            self.violation(ci, &format!("forwarded rows of table {table}, which it cannot keep here"));
            return Ok(());
        }
        let mut d = [0u8; DESCRIPTOR];
        self.sparse.backups.inbox[t].read_at(slot * DESCRIPTOR, &mut d);
        let u64_at = |i: usize| u64::from_le_bytes(d[i..i + 8].try_into().unwrap_or_default());
        let u32_at = |i: usize| u32::from_le_bytes(d[i..i + 4].try_into().unwrap_or_default());
        let (version, addr, len, rkey) = (u64_at(0), u64_at(8), u64_at(16) as usize, u32_at(24));
        let reply = RemoteAddr { addr: u64_at(32), rkey: u32_at(40) };
        if version as u16 != seq || len > 1 << 40 {
            self.violation(ci, &format!("a descriptor of table {table}'s rows that does not match its notice"));
            return Ok(());
        }
        if self.sparse.stood_in_for(from) {
            // Declared lost (cut off, it may still run): what it forwards
            // after the copy this server serves its rows from is not kept,
            // nor acknowledged (it must stop; its versions count for nothing).
            return Ok(());
        }
        let k = match self.sparse.backups.copies.iter().position(|c| c.from == from && c.table == table) {
            Some(k) => k,
            None => {
                let rows =
                    RowTable::new(self.sparse.tables[t].part.table().spec).map_err(|e| ServerError::Sparse(e.to_string()))?;
                let landing = self.pd.alloc_mr(LANDING, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
                let reply = self.pd.alloc_mr(REPLY, Access::NONE)?;
                let (read, spare, whole) = (None, None, false);
                self.sparse.backups.copies.push(Copy { from, table, rows, version: 0, read, spare, landing, reply, whole });
                self.sparse.backups.copies.len() - 1
            }
        };
        let c = &mut self.sparse.backups.copies[k];
        if c.read.is_some() || (addr == 0 && len > c.landing.len()) {
            self.violation(
                ci,
                &format!("forwarded table {table}'s rows with a forward unacknowledged, or past its landing region"),
            );
            return Ok(());
        }
        if addr == 0 && !c.whole {
            // WRITTEN into a landing region of a copy dropped since (an old
            // owner that has not heard yet that its backup moved): not
            // taken in, acknowledged with no landing region.
            return self.ack_rows(k, ci, reply, version, false);
        }
        if addr == 0 {
            // WRITTEN here before the notice.
            let mut blob = vec![0u8; len];
            c.landing.read_at(0, &mut blob);
            return self.take_forward_in(k, ci, &blob, reply);
        }
        let mr = match c.spare.take() {
            Some(m) if m.len() >= len.max(1) => m,
            _ => self.pd.alloc_mr(len.max(1).next_power_of_two(), Access::LOCAL_WRITE)?,
        };
        self.sparse.backups.taken.read += 1;
        let c = &mut self.sparse.backups.copies[k];
        c.read = Some(Read { ci, mr, remote: RemoteAddr { addr, rkey }, reply, len, asked: 0, in_flight: 0 });
        for _ in 0..READ_WINDOW {
            self.read_more(k)?;
        }
        Ok(())
    }

    /// Posts the next READ of copy `k`'s forward, if any is left.
    fn read_more(&mut self, k: usize) -> Result<(), ServerError> {
        let piece = (self.opts.max_msg_bytes as usize).clamp(4096, 1 << 30);
        let c = &mut self.sparse.backups.copies[k];
        let Some(r) = c.read.as_mut() else { return Ok(()) };
        let n = piece.min(r.len - r.asked);
        if n == 0 {
            return Ok(());
        }
        let sg = [Sge::new(&r.mr, r.asked as u64, n as u32)];
        let remote = RemoteAddr { addr: r.remote.addr + r.asked as u64, rkey: r.remote.rkey };
        let wr_id = WR_MIRROR | (u64::from(c.from) << 16) | u64::from(c.table);
        let wr = SendWr { wr_id, op: SendOp::Read(remote), sg: &sg, signaled: true };
        self.conns[r.ci].post_or_flush(&wr, &mut self.flushed)?;
        r.asked += n;
        r.in_flight += 1;
        Ok(())
    }

    /// A READ of a forward completed (`ok`) or failed.
    pub(crate) fn on_forward_read(&mut self, wr_id: u64, ok: bool) -> Result<(), ServerError> {
        let (from, table) = (((wr_id >> 16) & 0xFFFF) as u32, (wr_id & 0xFFFF) as u16);
        let Some(k) = self.sparse.backups.copies.iter().position(|c| c.from == from && c.table == table) else {
            return Ok(());
        };
        let c = &mut self.sparse.backups.copies[k];
        if !ok {
            // Its owner is gone: the copy stays as of its last forward.
            c.read = None;
            return Ok(());
        }
        let Some(r) = c.read.as_mut() else { return Ok(()) };
        r.in_flight -= 1;
        if r.asked < r.len {
            return self.read_more(k);
        }
        if r.in_flight > 0 {
            return Ok(());
        }
        let Some(r) = c.read.take() else { return Ok(()) };
        let mut blob = vec![0u8; r.len];
        r.mr.read_at(0, &mut blob);
        c.spare = Some(r.mr);
        self.take_forward_in(k, r.ci, &blob, r.reply)
    }

    /// Takes forward `blob` into copy `k` and acknowledges it on `ci`, with
    /// the landing region for the next in the reply.
    fn take_forward_in(&mut self, k: usize, ci: usize, blob: &[u8], reply: RemoteAddr) -> Result<(), ServerError> {
        let c = &mut self.sparse.backups.copies[k];
        let (from, table) = (c.from, c.table);
        let stride = c.rows.stride();
        let bad = |e: String| ServerError::Sparse(format!("server {from}'s forward of table {table}: {e}"));
        let f = eps_sparse::table::parse_forward(blob, stride).map_err(|e| bad(e.to_string()))?;
        if f.full {
            c.rows = RowTable::new(self.sparse.tables[table as usize].part.table().spec).map_err(|e| bad(e.to_string()))?;
            c.whole = true;
        } else if !c.whole {
            // Not taken in: no landing region for the next (see `whole`).
            return self.ack_rows(k, ci, reply, f.version, false);
        }
        c.rows.take_forward(&f).map_err(|e| bad(e.to_string()))?;
        c.version = f.version;
        let t = &mut self.sparse.backups.taken;
        t.forwards += 1;
        t.rows += f.rows;
        t.bytes += blob.len() as u64;
        if let Some(want) = f.digest {
            let got = c.rows.digest();
            if got != want {
                return Err(bad(format!(
                    "the copy differs from the owner's rows at version {} (digest {got:#x}, not {want:#x})",
                    f.version
                )));
            }
            self.sparse.backups.taken.verified += 1;
        }
        let (version, full) = (f.version, f.full);
        self.ack_rows(k, ci, reply, version, true)?;
        if full {
            // A new owner's rows come here: copies of earlier owners' go.
            let b = &mut self.sparse.backups;
            let (keep, gone): (Vec<_>, Vec<_>) = b.copies.drain(..).partition(|c| c.from == from || c.read.is_some());
            b.copies = keep;
            b.retired.extend(gone.into_iter().map(|c| (c.from, c.landing)));
        }
        Ok(())
    }

    /// Acknowledges version `version` of copy `k` on `ci`, the reply (at
    /// `reply`) naming its landing region if `landing`.
    fn ack_rows(&mut self, k: usize, ci: usize, reply: RemoteAddr, version: u64, landing: bool) -> Result<(), ServerError> {
        let c = &mut self.sparse.backups.copies[k];
        let mut r = [0u8; REPLY];
        if landing {
            r[..8].copy_from_slice(&c.landing.addr().to_le_bytes());
            r[8..12].copy_from_slice(&c.landing.rkey().to_le_bytes());
            r[12..16].copy_from_slice(&(c.landing.len() as u32).to_le_bytes());
        }
        // (The owner sends the next forward only after this one is
        // acknowledged: no reply is in flight from this buffer.)
        c.reply.write_at(0, &r);
        let imm = Imm { kind: ImmKind::ForwardAck, shard: sparse_id(c.table), seq: version as u16 }.encode();
        let sg = [Sge::new(&c.reply, 0, REPLY as u32)];
        let wr = SendWr { wr_id: WR_OTHER, op: SendOp::WriteImm(reply, imm), sg: &sg, signaled: false };
        self.conns[ci].post_or_flush(&wr, &mut self.flushed)
    }
}
