//! Checkpoints on disk (the formats are `eps_proto::checkpoint`'s): pieces
//! written whole or not at all (a temporary file, fsync'd, renamed, its
//! directory fsync'd), the control plane's tracking of the pieces servers
//! report until they cover the parameters, the manifest written last, pruning,
//! and finding the newest complete checkpoint to resume from.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use eps_proto::checkpoint::{
    MANIFEST, Manifest, PieceEntry, PieceHeader, RowsEntry, cover, dir_name, parse_dir_name, parse_runs, runs_text,
};
use sha2::{Digest, Sha256};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> String {
    format!("{what} {}: {e}", path.display())
}

/// Writes `parts` to `path` whole or not at all: a temporary file beside it,
/// fsync'd, renamed over `path`, the directory fsync'd. Returns the hex SHA-256
/// of the bytes.
pub fn write_atomic(path: &Path, parts: &[&[u8]]) -> Result<String, String> {
    let dir = path.parent().ok_or_else(|| format!("{} has no directory", path.display()))?;
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, "cannot create", e))?;
    let tmp = path.with_extension("tmp");
    let mut h = Sha256::new();
    let result = (|| {
        let mut f = File::create(&tmp)?;
        for p in parts {
            f.write_all(p)?;
            h.update(p);
        }
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(path, "cannot write", e));
    }
    Ok(hex(&h.finalize()))
}

/// Writes one piece: `values` are the master values then the optimizer state.
/// Returns the hex SHA-256 of the file.
pub fn write_piece(path: &Path, header: &PieceHeader, values: &[f32]) -> Result<String, String> {
    write_atomic(path, &[&header.encode(), bytemuck::cast_slice(values)])
}

/// A piece read back and checked against its manifest entry: the header and
/// its master values and state.
pub fn read_piece(dir: &Path, e: &PieceEntry, version: u64, state_k: u32) -> Result<(PieceHeader, Vec<f32>), String> {
    let path = dir.join(&e.file);
    let bytes = read_checked(&path, &e.sha256)?;
    let h = PieceHeader::decode(&bytes).map_err(|err| format!("{}: {err}", path.display()))?;
    let n = eps_proto::checkpoint::PIECE_HEADER;
    if h.version != version || h.start != e.start || h.len != e.len || h.state_k != state_k {
        return Err(format!("{}: its header ({h:?}) disagrees with the manifest", path.display()));
    }
    if (bytes.len() - n) as u64 != h.payload_bytes() {
        return Err(format!("{}: {} payload bytes, {} expected", path.display(), bytes.len() - n, h.payload_bytes()));
    }
    let values = bytes[n..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
    Ok((h, values))
}

/// The bytes of `path`, if their hex SHA-256 is `sha256`.
pub fn read_checked(path: &Path, sha256: &str) -> Result<Vec<u8>, String> {
    let mut bytes = Vec::new();
    File::open(path).and_then(|mut f| f.read_to_end(&mut bytes)).map_err(|err| io_err(path, "cannot read", err))?;
    let sha = hex(&Sha256::digest(&bytes));
    if sha != sha256 {
        return Err(format!("{}: checksum {sha} is not the manifest's {sha256} (the file is damaged)", path.display()));
    }
    Ok(bytes)
}

/// The header of a piece the manifest lists (its file's first bytes).
pub fn read_piece_header(dir: &Path, e: &PieceEntry) -> Result<PieceHeader, String> {
    let path = dir.join(&e.file);
    let mut b = [0u8; eps_proto::checkpoint::PIECE_HEADER];
    File::open(&path).and_then(|mut f| f.read_exact(&mut b)).map_err(|err| io_err(&path, "cannot read", err))?;
    PieceHeader::decode(&b).map_err(|err| format!("{}: {err}", path.display()))
}

/// The checkpoint to resume from in `path`: `path` itself when it holds a
/// manifest, else the newest `ckpt-*` directory inside it whose manifest
/// parses (a torn one, without a manifest, is skipped).
pub fn latest(path: &Path) -> Result<(PathBuf, Manifest), String> {
    let read = |dir: &Path| -> Result<Manifest, String> {
        let m = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&m).map_err(|e| io_err(&m, "cannot read", e))?;
        Manifest::from_toml(&text).map_err(|e| format!("{}: {e}", m.display()))
    };
    if path.join(MANIFEST).exists() {
        return read(path).map(|m| (path.to_path_buf(), m));
    }
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(path)
        .map_err(|e| io_err(path, "cannot read the checkpoint directory", e))?
        .flatten()
        .filter_map(|e| Some((parse_dir_name(e.file_name().to_str()?)?, e.path())))
        .collect();
    found.sort();
    let mut skipped = Vec::new();
    for (_, dir) in found.into_iter().rev() {
        match read(&dir) {
            Ok(m) => return Ok((dir, m)),
            Err(e) => skipped.push(e),
        }
    }
    Err(if skipped.is_empty() {
        format!("{} holds no checkpoint", path.display())
    } else {
        format!("{} holds no complete checkpoint ({})", path.display(), skipped.join("; "))
    })
}

/// Removes complete checkpoints in `dir` but the newest `keep`, and torn ones
/// older than the newest complete one. Of one that a kept checkpoint still
/// reads table rows from (rows unchanged since), those files stay, without
/// its manifest. Returns the versions removed.
pub fn prune(dir: &Path, keep: usize) -> Vec<u64> {
    let Ok(rd) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut all: Vec<(u64, PathBuf, bool)> = rd
        .flatten()
        .filter_map(|e| {
            let v = parse_dir_name(e.file_name().to_str()?)?;
            Some((v, e.path(), e.path().join(MANIFEST).exists()))
        })
        .collect();
    all.sort_by_key(|(v, _, _)| std::cmp::Reverse(*v));
    let Some(newest) = all.iter().find(|(_, _, c)| *c).map(|(v, _, _)| *v) else { return Vec::new() };
    let mut complete = 0;
    let (mut dropped, mut kept) = (Vec::new(), Vec::new());
    for (v, path, done) in all {
        complete += usize::from(done);
        let drop = if done { complete > keep } else { v < newest };
        if drop {
            dropped.push((v, path));
        } else if done {
            kept.push(path);
        }
    }
    // Files of earlier checkpoints the kept ones read, by version.
    let mut needed: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    for path in kept {
        let Ok(m) = std::fs::read_to_string(path.join(MANIFEST)).map(|t| Manifest::from_toml(&t)) else { continue };
        // A manifest that does not parse keeps nothing of others: it cannot be resumed from.
        for e in m.iter().flat_map(|m| &m.rows) {
            if let (Some(v), Some(name)) = (e.earlier(), e.file.rsplit('/').next()) {
                needed.entry(v).or_default().push(name.to_string());
            }
        }
    }
    let mut removed = Vec::new();
    for (v, path) in dropped {
        let gone = match needed.get(&v) {
            None => std::fs::remove_dir_all(&path).is_ok(),
            Some(names) => {
                let files = std::fs::read_dir(&path).into_iter().flatten().flatten();
                let stale = files.filter(|f| f.file_name().to_str().is_none_or(|n| !names.iter().any(|k| k == n)));
                // Every stale file is tried, whether an earlier one went or not.
                stale.map(|f| std::fs::remove_file(f.path()).is_ok()).collect::<Vec<_>>().into_iter().all(|ok| ok)
            }
        };
        if gone {
            removed.push(v);
        }
    }
    removed
}

#[derive(Debug, Default)]
struct Collecting {
    pieces: Vec<PieceEntry>,
    /// Table rows reported: the entry and its buckets.
    rows: Vec<(RowsEntry, Vec<u32>)>,
    /// Why it cannot complete (a server had passed the version, or failed to
    /// write).
    failed: Option<String>,
}

/// The checkpoints a control plane is collecting pieces of, by (job
/// directory, version), and how each ended.
#[derive(Debug, Default)]
pub struct Tracker {
    collecting: BTreeMap<(PathBuf, u64), Collecting>,
    /// Completed: the checkpoint's directory.
    done: BTreeMap<(PathBuf, u64), PathBuf>,
    keep: usize,
}

/// A server's report of one piece (`ControlMsg::Saved`).
#[derive(Clone, Copy, Debug)]
pub struct Report<'a> {
    /// The checkpoint's version.
    pub version: u64,
    /// First element.
    pub start: u64,
    /// Elements.
    pub len: u64,
    /// The piece's path.
    pub file: &'a str,
    /// Its hex SHA-256, or (missed) why writing failed.
    pub sha256: &'a str,
    /// Nothing was written.
    pub missed: bool,
}

/// A server's report of table rows (`ControlMsg::SavedRows`).
#[derive(Clone, Copy, Debug)]
pub struct RowsReport<'a> {
    /// The checkpoint's version.
    pub version: u64,
    /// The table.
    pub table: u32,
    /// The rows file's path.
    pub file: &'a str,
    /// Its hex SHA-256, or (missed) why saving failed.
    pub sha256: &'a str,
    /// The buckets it holds for this checkpoint (runs).
    pub buckets: &'a str,
    /// It holds their changes over earlier files, not their rows whole.
    pub changes: bool,
    /// Nothing was saved.
    pub missed: bool,
}

/// Where a report left its checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// More pieces are to come.
    Pending,
    /// Complete: the manifest is written in this directory.
    Complete(PathBuf),
    /// It cannot complete.
    Failed(String),
}

impl Tracker {
    /// A tracker that keeps the newest `keep` checkpoints of each directory.
    pub fn new(keep: u32) -> Self {
        Self { keep: keep.max(1) as usize, ..Self::default() }
    }

    /// How the checkpoint at `version` in `dir` stands.
    pub fn outcome(&self, dir: &Path, version: u64) -> Outcome {
        let key = (dir.to_path_buf(), version);
        if let Some(p) = self.done.get(&key) {
            return Outcome::Complete(p.clone());
        }
        match self.collecting.get(&key).and_then(|c| c.failed.clone()) {
            Some(why) => Outcome::Failed(why),
            None => Outcome::Pending,
        }
    }

    /// Takes a server's report of a piece (`file` is its path; when `missed`,
    /// `sha256` is empty if the server had passed `version`, else why writing
    /// failed); once the pieces cover the parameters (and the rows every
    /// table's buckets), writes the manifest and prunes.
    pub fn saved(&mut self, r: &Report<'_>, job: &Manifest) -> Outcome {
        let Report { version, start, len, file, sha256, missed } = *r;
        let (dir, name) = match self.place(file, version) {
            Ok(p) => p,
            Err(o) => return o,
        };
        let key = (dir.clone(), version);
        let c = self.collecting.entry(key).or_default();
        if missed {
            c.failed.get_or_insert_with(|| missed_why(version, &name, sha256));
        } else {
            c.pieces.push(PieceEntry { file: name, start, len, sha256: sha256.to_string() });
        }
        self.finish(&dir, version, job)
    }

    /// Takes a server's report of a table's rows (as [`Tracker::saved`]);
    /// `file` may be in an earlier checkpoint of the same directory.
    pub fn saved_rows(&mut self, r: &RowsReport<'_>, job: &Manifest) -> Outcome {
        let (dir, name) = match self.place(r.file, r.version) {
            Ok(p) => p,
            Err(o) => return o,
        };
        let c = self.collecting.entry((dir.clone(), r.version)).or_default();
        if r.missed {
            c.failed.get_or_insert_with(|| missed_why(r.version, &name, r.sha256));
        } else {
            match parse_runs(r.buckets) {
                Ok(b) if r.table < job.tables => {
                    let (table, sha256, changes) = (r.table, r.sha256.to_string(), r.changes);
                    let e = RowsEntry { table, file: name, sha256, buckets: String::new(), changes };
                    c.rows.push((e, b));
                }
                Ok(_) => c.failed = Some(format!("a server saved rows of table {}, which the job lacks", r.table)),
                Err(e) => c.failed = Some(format!("a server's report of {name}: {e}")),
            }
        }
        self.finish(&dir, r.version, job)
    }

    /// The job directory of a file a server reported for `version`, and its
    /// name as the manifest lists it; or the outcome when it is unusable or
    /// the checkpoint is complete already.
    fn place(&self, file: &str, version: u64) -> Result<(PathBuf, String), Outcome> {
        let path = Path::new(file);
        let (Some(ckpt), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
            return Err(Outcome::Failed(format!("a server reported a piece without a directory: {file}")));
        };
        let (Some(dir), Some(at)) = (ckpt.parent(), ckpt.file_name().and_then(|n| parse_dir_name(n.to_str()?))) else {
            return Err(Outcome::Failed(format!("{file} is not in a checkpoint directory")));
        };
        if self.done.contains_key(&(dir.to_path_buf(), version)) {
            return Err(self.outcome(dir, version));
        }
        match at {
            _ if at == version => Ok((dir.to_path_buf(), name.to_string())),
            _ if at < version => Ok((dir.to_path_buf(), format!("../{}/{name}", dir_name(at)))),
            _ => Err(Outcome::Failed(format!("{file} is of a checkpoint after {version}"))),
        }
    }

    /// Writes the manifest of the checkpoint at `version` in `dir` if its
    /// pieces and rows are all in.
    fn finish(&mut self, dir: &Path, version: u64, job: &Manifest) -> Outcome {
        let key = (dir.to_path_buf(), version);
        let Some(c) = self.collecting.get(&key) else { return self.outcome(dir, version) };
        if let Some(why) = &c.failed {
            return Outcome::Failed(why.clone());
        }
        let spans: Vec<(u64, u64)> = c.pieces.iter().map(|p| (p.start, p.len)).collect();
        let Ok(chosen) = cover(&spans, job.total) else { return Outcome::Pending };
        let Some(rows) = rows_cover_of(&c.rows, job.tables) else { return Outcome::Pending };
        let pieces = chosen.iter().map(|&i| c.pieces[i].clone()).collect();
        let manifest = Manifest { version, pieces, rows, ..job.clone() };
        let ckpt = dir.join(dir_name(version));
        self.collecting.remove(&key);
        if let Err(e) = write_atomic(&ckpt.join(MANIFEST), &[manifest.to_toml().as_bytes()]) {
            let why = format!("cannot write the manifest: {e}");
            self.collecting.insert(key, Collecting { failed: Some(why.clone()), ..Collecting::default() });
            return Outcome::Failed(why);
        }
        prune(dir, self.keep);
        self.done.insert(key, ckpt.clone());
        Outcome::Complete(ckpt)
    }
}

/// Why a missed report fails its checkpoint (`sha256` is the error, when
/// writing failed).
fn missed_why(version: u64, name: &str, sha256: &str) -> String {
    if sha256.is_empty() {
        format!("a server had passed iteration {version} when the checkpoint was ordered")
    } else {
        format!("a server could not save {name}: {sha256}")
    }
}

/// The manifest's rows entries once `rows` give every bucket of each of
/// `tables` tables a whole file (a bucket reported whole twice is read from
/// its first report; changes reported twice count once).
fn rows_cover_of(rows: &[(RowsEntry, Vec<u32>)], tables: u32) -> Option<Vec<RowsEntry>> {
    let n = eps_proto::buckets::BUCKETS as usize;
    let mut from = vec![vec![usize::MAX; n]; tables as usize];
    for (i, (e, buckets)) in rows.iter().enumerate().filter(|(_, (e, _))| !e.changes) {
        for &b in buckets {
            let f = &mut from[e.table as usize][b as usize];
            *f = (*f).min(i);
        }
    }
    if from.iter().flatten().any(|&i| i == usize::MAX) {
        return None;
    }
    let first =
        |i: usize, e: &RowsEntry| rows.iter().position(|(o, _)| o.changes && o.table == e.table && o.file == e.file) == Some(i);
    let entry = |(i, (e, buckets)): (usize, &(RowsEntry, Vec<u32>))| {
        let text = match e.changes {
            true if first(i, e) => runs_text(buckets.iter().copied()),
            true => String::new(),
            false => runs_text((0..n as u32).filter(|&b| from[e.table as usize][b as usize] == i)),
        };
        (!text.is_empty()).then(|| RowsEntry { buckets: text, ..e.clone() })
    };
    Some(rows.iter().enumerate().filter_map(entry).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("eps-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn record(total: u64) -> Manifest {
        let (membership, spec) = ("0:0,1".into(), "[job]\n".into());
        Manifest {
            format: eps_proto::checkpoint::FORMAT,
            version: 0,
            epoch: 1,
            servers: 2,
            total,
            state_k: 1,
            membership,
            spec,
            pieces: Vec::new(),
            tables: 0,
            rows: Vec::new(),
        }
    }

    /// Writes a piece of `len` elements from `start` and reports it.
    fn piece(t: &mut Tracker, dir: &Path, v: u64, shard: u32, start: u64, len: u64) -> Outcome {
        let h = PieceHeader { version: v, start, len, state_k: 1, updates: 0 };
        let values: Vec<f32> = (0..2 * len).map(|i| (start * 2 + i) as f32).collect();
        let file = dir.join(dir_name(v)).join(eps_proto::checkpoint::piece_name(shard, 0));
        let sha = write_piece(&file, &h, &values).unwrap();
        let r = Report { version: v, start, len, file: file.to_str().unwrap(), sha256: &sha, missed: false };
        t.saved(&r, &record(8))
    }

    #[test]
    fn a_checkpoint_completes_when_covered_and_old_ones_are_pruned() {
        let dir = tmp("track");
        let mut t = Tracker::new(2);
        for v in [10, 20, 30] {
            assert_eq!(piece(&mut t, &dir, v, 0, 0, 4), Outcome::Pending);
            let Outcome::Complete(p) = piece(&mut t, &dir, v, 1, 4, 4) else { panic!("complete") };
            assert_eq!(p, dir.join(dir_name(v)));
        }
        // A torn checkpoint (no manifest) newer than every complete one stays;
        // the oldest complete one went.
        piece(&mut t, &dir, 40, 0, 0, 4);
        assert!(!dir.join(dir_name(10)).exists());
        let (p, m) = latest(&dir).unwrap();
        assert_eq!((p, m.version), (dir.join(dir_name(30)), 30));
        let (_, values) = read_piece(&dir.join(dir_name(30)), &m.pieces[1], 30, 1).unwrap();
        assert_eq!(values[0], 8.0);
        // A damaged piece is named, not read.
        let f = dir.join(dir_name(30)).join(&m.pieces[1].file);
        let mut b = std::fs::read(&f).unwrap();
        b[70] ^= 1;
        std::fs::write(&f, b).unwrap();
        assert!(read_piece(&dir.join(dir_name(30)), &m.pieces[1], 30, 1).unwrap_err().contains("damaged"));
        // Once a newer one completes, the torn one older than it goes.
        piece(&mut t, &dir, 50, 0, 0, 4);
        piece(&mut t, &dir, 50, 1, 4, 4);
        assert!(!dir.join(dir_name(40)).exists() && !dir.join(dir_name(20)).exists());
        assert!(dir.join(dir_name(30)).exists());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_missed_piece_fails_its_checkpoint_and_nothing_is_found() {
        let dir = tmp("missed");
        let mut t = Tracker::new(3);
        piece(&mut t, &dir, 10, 0, 0, 4);
        let file = dir.join(dir_name(10)).join("x.bin");
        let r = Report { version: 10, start: 4, len: 4, file: file.to_str().unwrap(), sha256: "", missed: true };
        let o = t.saved(&r, &record(8));
        assert!(matches!(o, Outcome::Failed(ref w) if w.contains("passed iteration 10")), "{o:?}");
        assert!(matches!(t.outcome(&dir, 10), Outcome::Failed(_)));
        assert!(latest(&dir).unwrap_err().contains("no complete checkpoint"));
        assert!(latest(&dir.join("absent")).unwrap_err().contains("cannot read"));
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Writes a rows file of table 0 at `at` and reports it for `v` with `buckets`.
    fn rows(t: &mut Tracker, dir: &Path, v: u64, at: u64, rank: u32, buckets: &str) -> Outcome {
        let file = dir.join(dir_name(at)).join(eps_proto::checkpoint::rows_name(0, rank));
        let h = eps_proto::checkpoint::RowsHeader { version: at, table: 0, stride: 1, rows: 0, deleted: 0 };
        let sha = write_atomic(&file, &[&h.encode()]).unwrap();
        let r = RowsReport {
            version: v,
            table: 0,
            file: file.to_str().unwrap(),
            sha256: &sha,
            buckets,
            changes: false,
            missed: false,
        };
        t.saved_rows(&r, &Manifest { tables: 1, ..record(8) })
    }

    #[test]
    fn table_rows_complete_a_checkpoint_and_files_still_read_survive_pruning() {
        let dir = tmp("rows");
        let mut t = Tracker::new(1);
        let job = Manifest { tables: 1, ..record(8) };
        let dense = |t: &mut Tracker, v| {
            let h = PieceHeader { version: v, start: 0, len: 8, state_k: 1, updates: 0 };
            let file = dir.join(dir_name(v)).join(eps_proto::checkpoint::piece_name(0, 0));
            let sha = write_piece(&file, &h, &[0.0; 16]).unwrap();
            t.saved(&Report { version: v, start: 0, len: 8, file: file.to_str().unwrap(), sha256: &sha, missed: false }, &job)
        };
        // Checkpoint 10: the dense piece and two servers' rows.
        assert_eq!(dense(&mut t, 10), Outcome::Pending, "no rows yet");
        assert_eq!(rows(&mut t, &dir, 10, 10, 0, "0-2047"), Outcome::Pending, "half the buckets");
        assert!(matches!(rows(&mut t, &dir, 10, 10, 1, "2048-4095"), Outcome::Complete(_)));
        // Checkpoint 20: server 1's rows did not change, its file of 10 is read.
        dense(&mut t, 20);
        rows(&mut t, &dir, 20, 20, 0, "0-2047");
        let Outcome::Complete(p) = rows(&mut t, &dir, 20, 10, 1, "2048-4095") else { panic!("complete") };
        let (_, m) = latest(&dir).unwrap();
        assert_eq!(m.version, 20);
        let names: Vec<&str> = m.rows.iter().map(|e| e.file.as_str()).collect();
        assert_eq!(names, ["table-0-server-0.bin", "../ckpt-000000000010/table-0-server-1.bin"]);
        // Keeping one: 10 loses its manifest and dense piece, not the rows 20 reads.
        let old = dir.join(dir_name(10));
        assert!(!old.join(MANIFEST).exists() && !old.join("shard-0-server-0.bin").exists());
        assert!(old.join("table-0-server-1.bin").exists() && !old.join("table-0-server-0.bin").exists());
        assert_eq!(latest(&dir).unwrap().0, p);
        // A report of rows for a table the job lacks, or of a later checkpoint's file, fails it.
        let file = "/x/ckpt-000000000030/t.bin";
        let r = RowsReport { version: 30, table: 3, file, sha256: "0", buckets: "1", changes: false, missed: false };
        assert!(matches!(t.saved_rows(&r, &job), Outcome::Failed(w) if w.contains("table 3")));
        let r = RowsReport { version: 30, table: 0, file: "/x/ckpt-000000000040/t.bin", ..r };
        assert!(matches!(t.saved_rows(&r, &job), Outcome::Failed(w) if w.contains("after 30")));
        // Once 30 writes every row anew, 10 goes entirely.
        dense(&mut t, 30);
        rows(&mut t, &dir, 30, 30, 0, "0-4095");
        assert!(!old.exists());
        std::fs::remove_dir_all(&dir).ok();
    }
}
