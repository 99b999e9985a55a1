//! Checkpoints of sparse tables on a server (the format is
//! `eps_proto::checkpoint`'s). When a BSP table publishes a checkpoint's
//! version `v`, the rows of the buckets this server applied iteration
//! `v - 1` to are copied out between two updates (before any leave with a
//! bucket move) and handed to the checkpoint writer thread.
//!
//! Into the job's own checkpoint directory the saves are incremental: a
//! bucket is written again only if its rows changed since this server last
//! copied them (`eps_sparse::RowTable::changed_buckets`) and that copy is
//! known written whole; otherwise the report names the earlier file. Into
//! any other directory every bucket is written. A resumed job's servers
//! take the rows of the buckets they own at the start, whatever servers
//! saved them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use eps_control_client::ControlClient;
use eps_control_client::checkpoint::{read_checked, write_atomic};
use eps_fabric::Fabric;
use eps_proto::buckets::{BUCKETS, bucket_of, owners_at};
use eps_proto::checkpoint::{Manifest, RowsEntry, RowsHeader, dir_name, parse_runs, rows_name, runs_text};
use eps_proto::control::ControlMsg;
use eps_sparse::moves::ROW_META;
use eps_sparse::saves::{Saved, Saves};

use crate::{Server, ServerError};

/// What the writer thread hands back to the event loop.
#[derive(Default)]
pub(crate) struct Handed {
    /// By (table, version): the SHA-256 of a rows file this server wrote
    /// whole into the job's own directory.
    written: HashMap<(u32, u64), String>,
    /// By table: the records' buffer of the last save written, for the next
    /// (its pages touched: copying into it does not wait for page faults).
    spare: HashMap<u32, Vec<u8>>,
}

/// [`Handed`], shared.
pub(crate) type Written = Arc<Mutex<Handed>>;

/// One table's rows on their way to disk, or a miss to report.
pub(crate) struct RowsPiece {
    pub(crate) version: u64,
    pub(crate) table: u32,
    /// The server whose buckets they are, its rank in the file's name: this
    /// one, or the lost one it stands in for.
    pub(crate) owner: u32,
    /// The job's checkpoint directory.
    pub(crate) dir: PathBuf,
    /// Whether the file is remembered in [`Written`] (the job's own directory).
    pub(crate) remember: bool,
    /// Values and state per row.
    pub(crate) stride: u32,
    pub(crate) saved: Saved,
    /// Not saved: why (empty: the table had passed the version).
    pub(crate) missed: Option<String>,
}

/// What a server's table saves remember.
#[derive(Default)]
pub(crate) struct RowsSaves {
    /// By table.
    saves: Vec<Saves>,
    pub(crate) written: Written,
    /// SSP/ASP, by table: the last cut saved or passed, and the pushes
    /// (worker, iteration) of the cut's iteration or later held back until
    /// the table is saved.
    cuts: HashMap<u16, u64>,
    held: HashMap<u16, Vec<(u32, u64)>>,
}

/// Writes a rows piece and reports it (and the earlier files it reads).
pub(crate) fn write_rows(rank: u32, mut p: RowsPiece, written: &Written, ctl: &mut ControlClient) {
    let path_of = |v: u64| p.dir.join(dir_name(v)).join(rows_name(p.table, p.owner)).display().to_string();
    let report = |ctl: &mut ControlClient, file: String, sha256: String, buckets: &[u32], changes: bool, missed: bool| {
        if buckets.is_empty() && !missed {
            return;
        }
        let (version, table, buckets) = (p.version, p.table, runs_text(buckets.iter().copied()));
        let m = ControlMsg::SavedRows { version, table, file, sha256, buckets, changes, missed };
        if let Err(e) = ctl.call(&m) {
            eps_proto::say!("eps server {rank}: cannot report saved rows to the control plane: {e}");
        }
    };
    if let Some(why) = p.missed {
        return report(ctl, path_of(p.version), why, &[], false, true);
    }
    let s = &p.saved;
    let table = p.table;
    if s.writes() {
        let h =
            RowsHeader { version: p.version, table: p.table, stride: p.stride, rows: s.rows, deleted: s.deleted.len() as u64 };
        let file = path_of(p.version);
        match write_atomic(Path::new(&file), &[&h.encode(), &s.records, bytemuck::cast_slice(&s.deleted)]) {
            Ok(sha) => {
                if p.remember {
                    lock(written).written.insert((p.table, p.version), sha.clone());
                }
                report(ctl, file.clone(), sha.clone(), &s.whole, false, false);
                report(ctl, file, sha, &s.changes, true, false);
            }
            Err(e) => {
                eps_proto::say!("eps server {rank}: checkpoint of table {} at iteration {}: {e}", p.table, p.version);
                return report(ctl, file, e, &[], false, true);
            }
        }
    }
    for (v, (whole, changes)) in &p.saved.earlier {
        match lock(written).written.get(&(p.table, *v)).cloned() {
            Some(sha) => {
                report(ctl, path_of(*v), sha.clone(), whole, false, false);
                report(ctl, path_of(*v), sha, changes, true, false);
            }
            None => report(ctl, path_of(*v), format!("the rows of iteration {v} were not written"), &[], false, true),
        }
    }
    lock(written).spare.insert(table, std::mem::take(&mut p.saved.records));
}

fn lock(w: &Written) -> std::sync::MutexGuard<'_, Handed> {
    w.lock().unwrap_or_else(|e| e.into_inner())
}

impl<P: Fabric> Server<P> {
    /// Saves table `table`'s rows at `version` (BSP: it published it;
    /// SSP/ASP: it holds exactly the pushes of the iterations before it)
    /// into the directories it is due in.
    pub(crate) fn save_rows(&mut self, table: u16, version: u64) {
        let dirs = self.saver.due(version);
        if dirs.is_empty() || version == 0 {
            return;
        }
        let t = table as usize;
        let owners = owners_at(&self.sparse.owners, version - 1).map_or(&[][..], |o| o);
        let mine: Vec<bool> = owners.iter().map(|&o| o == self.rank).collect();
        let tables = self.sparse.tables.len();
        let part = &mut self.sparse.tables[t].part;
        let own = self.saver.own_dir().map(Path::to_path_buf);
        let rows = &mut self.saver.rows;
        rows.saves.resize_with(tables, Saves::default);
        let mut pieces = Vec::new();
        for dir in dirs {
            let remember = own.as_deref() == Some(dir.as_path());
            let mut handed = lock(&rows.written);
            let buffer = handed.spare.remove(&(table as u32)).unwrap_or_default();
            let done = |v| handed.written.contains_key(&(table as u32, v));
            let saved = rows.saves[t].save(buffer, part.rows(), version, &mine, remember, done);
            drop(handed);
            let stride = part.rows().stride() as u32;
            let (table, owner) = (table as u32, self.rank);
            pieces.push(RowsPiece { version, table, owner, dir, remember, stride, saved, missed: None });
        }
        if pieces.iter().any(|p| p.remember) {
            part.clear_changed();
        }
        for p in pieces {
            self.saver.send_rows(p);
        }
    }

    /// BSP: the lost server's part this server stands in for published
    /// `version` of table `table`: if a checkpoint is due at it, the rows of
    /// the lost server's buckets are saved whole, in a file named for it
    /// (nobody else saves those buckets; their chain starts again).
    pub(crate) fn save_stand_in_rows(&mut self, table: u16, version: u64) {
        let dirs = self.saver.due(version);
        let Some(s) = self.sparse.stand_in.as_ref().filter(|s| s.merged.is_none()) else { return };
        if dirs.is_empty() || version == 0 || self.mode != eps_proto::Consistency::Bsp {
            return;
        }
        let owners = owners_at(&self.sparse.owners, version - 1).map_or(&[][..], |o| o);
        let mine: Vec<bool> = owners.iter().map(|&o| o == s.from).collect();
        let Some(part) = s.tables.get(table as usize).map(|t| &t.part) else { return };
        let stride = part.rows().stride() as u32;
        let mut pieces = Vec::new();
        for dir in dirs {
            let saved = Saves::default().save(Vec::new(), part.rows(), version, &mine, false, |_| false);
            let (table, owner) = (table as u32, s.from);
            pieces.push(RowsPiece { version, table, owner, dir, remember: false, stride, saved, missed: None });
        }
        eps_proto::say!(
            "eps server {}: saves lost server {}'s rows of table {table} at iteration {version} in its place",
            self.rank,
            s.from
        );
        for p in pieces {
            self.saver.send_rows(p);
        }
    }

    /// The control plane ordered a checkpoint at `version` into `dir`
    /// (after it was added to the orders): BSP tables past it are reported
    /// missed; SSP/ASP ones are saved at their cut.
    pub(crate) fn rows_order(&mut self, version: u64, dir: &str) -> Result<(), ServerError> {
        for t in 0..self.sparse.tables.len() {
            if self.mode != eps_proto::Consistency::Bsp {
                self.try_rows_cut(t as u16)?;
            } else if self.sparse.tables[t].part.sync.version() >= version {
                self.rows_missed(t as u16, version, PathBuf::from(dir), self.rank);
            }
        }
        // (So is the lost server's part a stand-in serves.)
        let bsp = self.mode == eps_proto::Consistency::Bsp;
        if let Some(s) = self.sparse.stand_in.as_ref().filter(|s| s.merged.is_none() && bsp) {
            let passed = s.tables.iter().enumerate().filter(|(_, t)| t.part.sync.version() >= version);
            for t in passed.map(|(t, _)| t as u16).collect::<Vec<_>>() {
                self.rows_missed(t, version, PathBuf::from(dir), s.from);
            }
        }
        Ok(())
    }

    /// Reports table `table`'s rows of server `owner`'s buckets missed.
    fn rows_missed(&self, table: u16, version: u64, dir: PathBuf, owner: u32) {
        let (saved, missed) = (Saved::default(), Some(String::new()));
        let table = table as u32;
        let p = RowsPiece { version, table, owner, dir, remember: false, stride: 0, saved, missed };
        self.saver.send_rows(p);
    }

    /// SSP/ASP: the next cut of table `table`, if one is due (its last cut
    /// is set on first sight: the resumed iteration, or the clocks it
    /// started at).
    fn next_rows_cut(&mut self, table: u16) -> Option<u64> {
        if self.mode == eps_proto::Consistency::Bsp {
            return None;
        }
        let sync = &self.sparse.tables[table as usize].part.sync;
        let seen = sync.clocks().iter().max().copied().unwrap_or(0).saturating_sub(1);
        let after = *self.saver.rows.cuts.entry(table).or_insert(seen.max(self.saver.start));
        self.saver.next_cut(after)
    }

    /// SSP/ASP: holds `worker`'s push of `iteration` to `table` back if the
    /// table was not saved for a cut at or before it (its push region stays
    /// full until then: the worker pushes this table no further). True if held.
    pub(crate) fn hold_rows_for_cut(&mut self, table: u16, worker: u32, iteration: u64) -> Result<bool, ServerError> {
        let Some(t) = self.next_rows_cut(table) else { return Ok(false) };
        if iteration < t || self.sparse.moving.busy() {
            return Ok(false);
        }
        self.saver.rows.held.entry(table).or_default().push((worker, iteration));
        self.try_rows_cut(table)?;
        Ok(true)
    }

    /// SSP/ASP: saves table `table` if it holds exactly the pushes of the
    /// iterations before its cut (or reports the cut missed if it holds
    /// later ones), then applies what it held back (a later cut may hold
    /// them again).
    pub(crate) fn try_rows_cut(&mut self, table: u16) -> Result<(), ServerError> {
        let Some(t) = self.next_rows_cut(table) else { return Ok(()) };
        let held = self.saver.rows.held.get(&table);
        let clocks = self.sparse.tables[table as usize].part.sync.clocks();
        let applied = |w: usize| clocks[w] - held.map_or(0, |v| v.iter().filter(|(x, _)| *x as usize == w).count() as u64);
        let applied: Vec<u64> = (0..clocks.len()).map(applied).collect();
        let passed = applied.iter().any(|&c| c > t);
        if !passed && applied.iter().any(|&c| c < t) {
            return Ok(()); // a worker has not reached `t` here yet
        }
        if passed {
            eps_proto::say!(
                "eps server {}: table {table} applied pushes of iteration {t} or later already: not in that checkpoint",
                self.rank
            );
            for dir in self.saver.due(t) {
                self.rows_missed(table, t, dir, self.rank);
            }
        } else {
            self.save_rows(table, t);
        }
        self.saver.rows.cuts.insert(table, t);
        for (w, iteration) in self.saver.rows.held.remove(&table).unwrap_or_default() {
            if !self.hold_rows_for_cut(table, w, iteration)? {
                self.sparse_update(table, &[w])?;
            }
        }
        Ok(())
    }
}

/// Fills a resumed job's table parts with the rows of the buckets this
/// server owns at the start, from the checkpoint in `dir`: for each bucket
/// its whole file, then its changes, in version order.
pub(crate) fn restore_rows<P: Fabric>(
    sparse: &mut crate::sparse::Sparse<P>,
    dir: &Path,
    m: &Manifest,
    rank: u32,
) -> Result<u64, ServerError> {
    let bad = |e: String| ServerError::Checkpoint(e);
    if m.tables as usize != sparse.tables.len() {
        return Err(bad(format!("{}: {} sparse tables; the job has {}", dir.display(), m.tables, sparse.tables.len())));
    }
    let owners = sparse.owners.first().map(|(_, o)| o.clone()).unwrap_or_default();
    let mut entries: Vec<&RowsEntry> = m.rows.iter().collect();
    entries.sort_by_key(|e| e.version(m.version));
    for e in entries {
        let mut want = vec![false; BUCKETS as usize];
        for b in parse_runs(&e.buckets).map_err(|err| bad(format!("{}: {err}", dir.display())))? {
            want[b as usize] = owners.get(b as usize) == Some(&rank);
        }
        if !want.contains(&true) {
            continue;
        }
        let part = &mut sparse.tables[e.table as usize].part;
        let path = dir.join(&e.file);
        let bytes = read_checked(&path, &e.sha256).map_err(bad)?;
        let (records, rows, deleted) = rows_file(&bytes, e, part.rows().stride(), |k| want[bucket_of(k) as usize])
            .map_err(|why| bad(format!("{}: {why}", path.display())))?;
        let put = if e.changes { part.put_changes(&deleted, &records, rows) } else { part.put_rows(&records, rows) };
        put.map_err(|err| bad(format!("{}: {err}", path.display())))?;
    }
    for t in &mut sparse.tables {
        t.part.restart_at(m.version);
    }
    Ok(sparse.tables.iter().map(|t| t.part.rows().len() as u64).sum())
}

/// The records and deleted keys of a rows file whose keys `want`, checked
/// against its manifest entry and the table's `stride`.
fn rows_file(bytes: &[u8], e: &RowsEntry, stride: usize, want: impl Fn(u64) -> bool) -> Result<(Vec<u8>, u64, Vec<u64>), String> {
    let h = RowsHeader::decode(bytes).map_err(|err| err.to_string())?;
    let (rec, n) = (ROW_META + stride * 4, eps_proto::checkpoint::PIECE_HEADER);
    let body = h.rows.checked_mul(rec as u64).zip(h.deleted.checked_mul(8)).and_then(|(a, b)| a.checked_add(b));
    if h.table != e.table || h.stride as usize != stride || body != Some((bytes.len() - n) as u64) {
        return Err(format!("its header ({h:?}) does not fit table {} of the job", e.table));
    }
    let split = n + h.rows as usize * rec;
    let key = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().unwrap_or_default());
    let mut records = Vec::new();
    let mut rows = 0;
    for r in bytes[n..split].chunks_exact(rec).filter(|r| want(key(r))) {
        records.extend_from_slice(r);
        rows += 1;
    }
    let deleted = bytes[split..].chunks_exact(8).map(key).filter(|&k| want(k)).collect();
    Ok((records, rows, deleted))
}
