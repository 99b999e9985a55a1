//! Checkpoints on disk (the formats are `eps_proto::checkpoint`'s): pieces
//! written whole or not at all (a temporary file, fsync'd, renamed, its
//! directory fsync'd), the control plane's tracking of the pieces servers
//! report until they cover the parameters, the manifest written last, pruning,
//! and finding the newest complete checkpoint to resume from.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use eps_proto::checkpoint::{MANIFEST, Manifest, PieceEntry, PieceHeader, cover, dir_name, parse_dir_name};
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
    let mut bytes = Vec::new();
    File::open(&path).and_then(|mut f| f.read_to_end(&mut bytes)).map_err(|err| io_err(&path, "cannot read", err))?;
    let sha = hex(&Sha256::digest(&bytes));
    if sha != e.sha256 {
        return Err(format!("{}: checksum {sha} is not the manifest's {} (the file is damaged)", path.display(), e.sha256));
    }
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
/// older than the newest complete one. Returns the versions removed.
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
    let mut removed = Vec::new();
    for (v, path, done) in all {
        complete += usize::from(done);
        let drop = if done { complete > keep } else { v < newest };
        if drop && std::fs::remove_dir_all(&path).is_ok() {
            removed.push(v);
        }
    }
    removed
}

#[derive(Debug, Default)]
struct Collecting {
    pieces: Vec<PieceEntry>,
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
    /// failed); once the pieces cover the parameters, writes the manifest and
    /// prunes.
    pub fn saved(&mut self, r: &Report<'_>, job: &Manifest) -> Outcome {
        let Report { version, start, len, file, sha256, missed } = *r;
        let path = Path::new(file);
        let (Some(ckpt), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
            return Outcome::Failed(format!("a server reported a piece without a directory: {file}"));
        };
        let Some(dir) = ckpt.parent() else { return Outcome::Failed(format!("{file} is not in a checkpoint directory")) };
        let key = (dir.to_path_buf(), version);
        if self.done.contains_key(&key) {
            return self.outcome(dir, version);
        }
        let c = self.collecting.entry(key.clone()).or_default();
        if missed {
            // A missed report's `sha256` is the error, when writing failed.
            c.failed.get_or_insert_with(|| {
                if sha256.is_empty() {
                    format!("a server had passed iteration {version} when the checkpoint was ordered")
                } else {
                    format!("a server could not save {name}: {sha256}")
                }
            });
        } else {
            c.pieces.push(PieceEntry { file: name.to_string(), start, len, sha256: sha256.to_string() });
        }
        if let Some(why) = &c.failed {
            return Outcome::Failed(why.clone());
        }
        let spans: Vec<(u64, u64)> = c.pieces.iter().map(|p| (p.start, p.len)).collect();
        let Ok(chosen) = cover(&spans, job.total) else { return Outcome::Pending };
        let manifest = Manifest { version, pieces: chosen.iter().map(|&i| c.pieces[i].clone()).collect(), ..job.clone() };
        let ckpt = dir.join(dir_name(version));
        self.collecting.remove(&key);
        if let Err(e) = write_atomic(&ckpt.join(MANIFEST), &[manifest.to_toml().as_bytes()]) {
            let why = format!("cannot write the manifest: {e}");
            self.collecting.insert(key, Collecting { pieces: Vec::new(), failed: Some(why.clone()) });
            return Outcome::Failed(why);
        }
        prune(dir, self.keep);
        self.done.insert(key, ckpt.clone());
        Outcome::Complete(ckpt)
    }
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
}
