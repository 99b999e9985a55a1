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

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use eps_control_client::ControlClient;
use eps_control_client::checkpoint::{read_checked, write_atomic};
use eps_fabric::Fabric;
use eps_proto::buckets::{BUCKETS, bucket_of};
use eps_proto::checkpoint::{Manifest, RowsHeader, dir_name, parse_runs, rows_name, runs_text};
use eps_proto::control::ControlMsg;
use eps_sparse::moves::ROW_META;

use crate::{Server, ServerError};

/// By (table, version): the SHA-256 of a rows file this server wrote whole
/// into the job's own directory (filled by the writer thread).
pub(crate) type Written = Arc<Mutex<HashMap<(u32, u64), String>>>;

/// One table's rows on their way to disk, or a miss to report.
pub(crate) struct RowsPiece {
    pub(crate) version: u64,
    pub(crate) table: u32,
    /// The job's checkpoint directory.
    pub(crate) dir: PathBuf,
    /// Whether the file is remembered in [`Written`] (the job's own directory).
    pub(crate) remember: bool,
    /// Values and state per row, the rows and their records.
    pub(crate) stride: u32,
    pub(crate) rows: u64,
    pub(crate) records: Vec<u8>,
    /// The buckets the records are of (written when not empty).
    pub(crate) buckets: Vec<u32>,
    /// Buckets whose rows are in the file of an earlier version, by version.
    pub(crate) earlier: BTreeMap<u64, Vec<u32>>,
    /// Not saved: why (empty: the table had passed the version).
    pub(crate) missed: Option<String>,
}

/// What a server's table saves remember.
#[derive(Default)]
pub(crate) struct RowsSaves {
    /// By table, by bucket: the version its rows were last copied at for the
    /// job's own directory (0: not since they came here).
    copied: Vec<Vec<u64>>,
    pub(crate) written: Written,
}

/// Writes a rows piece and reports it (and the earlier files it refers to).
pub(crate) fn write_rows(rank: u32, p: RowsPiece, written: &Written, ctl: &mut ControlClient) {
    let path_of = |v: u64| p.dir.join(dir_name(v)).join(rows_name(p.table, rank)).display().to_string();
    let report = |ctl: &mut ControlClient, file: String, sha256: String, buckets: String, missed: bool| {
        let m = ControlMsg::SavedRows { version: p.version, table: p.table, file, sha256, buckets, missed };
        if let Err(e) = ctl.call(&m) {
            eps_proto::say!("eps server {rank}: cannot report saved rows to the control plane: {e}");
        }
    };
    if let Some(why) = p.missed {
        return report(ctl, path_of(p.version), why, String::new(), true);
    }
    if !p.buckets.is_empty() {
        let h = RowsHeader { version: p.version, table: p.table, stride: p.stride, rows: p.rows };
        let file = path_of(p.version);
        match write_atomic(Path::new(&file), &[&h.encode(), &p.records]) {
            Ok(sha) => {
                if p.remember {
                    lock(written).insert((p.table, p.version), sha.clone());
                }
                report(ctl, file, sha, runs_text(p.buckets), false);
            }
            Err(e) => {
                eps_proto::say!("eps server {rank}: checkpoint of table {} at iteration {}: {e}", p.table, p.version);
                return report(ctl, file, e, String::new(), true);
            }
        }
    }
    for (v, buckets) in p.earlier {
        match lock(written).get(&(p.table, v)).cloned() {
            Some(sha) => report(ctl, path_of(v), sha, runs_text(buckets), false),
            None => report(ctl, path_of(v), format!("the rows of iteration {v} were not written"), String::new(), true),
        }
    }
}

fn lock(w: &Written) -> std::sync::MutexGuard<'_, HashMap<(u32, u64), String>> {
    w.lock().unwrap_or_else(|e| e.into_inner())
}

/// The owner of each bucket at iteration `i` in a history of bucket maps.
fn owners_at(history: &[(u64, Vec<u32>)], i: u64) -> &[u32] {
    history.iter().rev().find(|(first, _)| *first <= i).or(history.first()).map_or(&[], |(_, o)| o)
}

impl<P: Fabric> Server<P> {
    /// Table `table` published `version` (BSP): saves its rows if a
    /// checkpoint is due.
    pub(crate) fn save_rows_if_due(&mut self, table: u16, version: u64) {
        let dirs = self.saver.due(version);
        if dirs.is_empty() || version == 0 {
            return;
        }
        let t = table as usize;
        let mine: Vec<bool> = owners_at(&self.sparse.owners, version - 1).iter().map(|&o| o == self.rank).collect();
        let mut changed = vec![false; BUCKETS as usize];
        let tables = self.sparse.tables.len();
        let part = &mut self.sparse.tables[t].part;
        for b in part.rows().changed_buckets() {
            changed[b as usize] = true;
        }
        let own = self.saver.own_dir().map(Path::to_path_buf);
        let saves = &mut self.saver.rows;
        saves.copied.resize_with(tables, || vec![0; BUCKETS as usize]);
        let mut pieces = Vec::new();
        for dir in dirs {
            let remember = own.as_deref() == Some(dir.as_path());
            let mut write = vec![false; BUCKETS as usize];
            let mut earlier: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
            let done = lock(&saves.written);
            for b in 0..BUCKETS {
                let (i, copied) = (b as usize, &mut saves.copied[t][b as usize]);
                if !mine.get(i).copied().unwrap_or(false) {
                    *copied = if remember { 0 } else { *copied };
                } else if remember && !changed[i] && *copied > 0 && done.contains_key(&(table as u32, *copied)) {
                    earlier.entry(*copied).or_default().push(b);
                } else {
                    write[i] = true;
                    *copied = if remember { version } else { *copied };
                }
            }
            drop(done);
            let mut records = Vec::new();
            let rows = part.rows().copy_rows(|b| write[b as usize], &mut records);
            let buckets = (0..BUCKETS).filter(|&b| write[b as usize]).collect();
            let stride = part.rows().stride() as u32;
            let (table, missed) = (table as u32, None);
            pieces.push(RowsPiece { version, table, dir, remember, stride, rows, records, buckets, earlier, missed });
        }
        if pieces.iter().any(|p| p.remember) {
            part.clear_changed();
        }
        for p in pieces {
            self.saver.send_rows(p);
        }
    }

    /// The control plane ordered a checkpoint at `version` into `dir`: the
    /// tables past it, or that cannot be saved, are reported missed.
    pub(crate) fn rows_order(&self, version: u64, dir: &str) {
        for (t, table) in self.sparse.tables.iter().enumerate() {
            let why = match self.mode {
                eps_proto::Consistency::Bsp if table.part.sync.version() < version => continue,
                eps_proto::Consistency::Bsp => String::new(),
                _ => "sparse tables are saved in BSP jobs only".to_string(),
            };
            let (dir, remember, stride, rows, records, buckets, earlier) =
                (PathBuf::from(dir), false, 0, 0, Vec::new(), Vec::new(), BTreeMap::new());
            let (table, missed) = (t as u32, Some(why));
            self.saver.send_rows(RowsPiece { version, table, dir, remember, stride, rows, records, buckets, earlier, missed });
        }
    }
}

/// Fills a resumed job's table parts with the rows of the buckets this
/// server owns at the start (`owners`), from the checkpoint in `dir`.
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
    let mut total = 0;
    for e in &m.rows {
        let wanted: Vec<u32> = parse_runs(&e.buckets)
            .map_err(|err| bad(format!("{}: {err}", dir.display())))?
            .into_iter()
            .filter(|&b| owners.get(b as usize) == Some(&rank))
            .collect();
        if wanted.is_empty() {
            continue;
        }
        let mut want = vec![false; BUCKETS as usize];
        wanted.iter().for_each(|&b| want[b as usize] = true);
        let part = &mut sparse.tables[e.table as usize].part;
        let stride = part.rows().stride();
        let path = dir.join(&e.file);
        let bytes = read_checked(&path, &e.sha256).map_err(bad)?;
        let h = RowsHeader::decode(&bytes).map_err(|err| bad(format!("{}: {err}", path.display())))?;
        let rec = ROW_META + stride * 4;
        let n = eps_proto::checkpoint::PIECE_HEADER;
        let fits = h.rows.checked_mul(rec as u64) == Some((bytes.len() - n) as u64);
        if h.table != e.table || h.stride as usize != stride || h.version > m.version || !fits {
            return Err(bad(format!("{}: its header ({h:?}) does not fit table {} of the job", path.display(), e.table)));
        }
        let key = |r: &[u8]| u64::from_le_bytes(r[..8].try_into().unwrap_or_default());
        let mut keep = Vec::new();
        let mut rows = 0;
        for r in bytes[n..].chunks_exact(rec).filter(|r| want[bucket_of(key(r)) as usize]) {
            keep.extend_from_slice(r);
            rows += 1;
        }
        part.put_rows(&keep, rows).map_err(|err| bad(format!("{}: {err}", path.display())))?;
        total += rows;
    }
    for t in &mut sparse.tables {
        t.part.restart_at(m.version);
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owners_of_an_iteration_are_those_of_the_newest_map_before_it() {
        let h = vec![(0, vec![0, 0]), (10, vec![0, 1]), (20, vec![1, 1])];
        assert_eq!(owners_at(&h, 0), [0, 0]);
        assert_eq!(owners_at(&h, 9), [0, 0]);
        assert_eq!(owners_at(&h, 10), [0, 1]);
        assert_eq!(owners_at(&h, 25), [1, 1]);
        assert!(owners_at(&[], 3).is_empty());
    }
}
