//! Checkpoints, free of I/O: the file formats and the rules that make one whole.
//!
//! A checkpoint of a BSP job is version `v` of every parameter: after `v`
//! updates, with the optimizer state of that moment (the learning-rate schedule
//! position is `v` itself). Each server writes the shards it publishes `v` of
//! as pieces (`shard-ID-server-RANK.bin`: a [`PieceHeader`], the f32 master
//! values, then the optimizer state, `state_k` values per element, interleaved
//! as servers keep them) into the checkpoint's directory (`ckpt-V`); the
//! control plane writes the [`Manifest`] last, once the pieces cover the whole
//! flat space. A directory without a manifest is a torn checkpoint and is never
//! taken for a good one. Pieces may overlap (a migration's source and target
//! both apply `v`): they hold the same bits, and the manifest lists a cover.
//!
//! In SSP/ASP, where shards apply each worker's contribution on its own, a
//! checkpoint at iteration `t` is a cut: every shard is saved when it holds
//! exactly the contributions of iterations before `t` of every worker (it
//! holds back those of `t` on until it does), with the number of updates it
//! applied ([`PieceHeader::updates`]). Resumed, every worker starts at `t`:
//! no contribution is lost or applied twice.
//!
//! Sparse tables are saved by bucket: at version `v` each server saves the
//! rows of the buckets it applied iteration `v - 1` to, into
//! `table-T-server-RANK.bin` (a [`RowsHeader`], the rows as `eps-sparse`
//! moves them, by ascending key, then the keys deleted). A checkpoint into
//! the job's own directory is incremental (`eps_sparse::saves`): a bucket is
//! read as a chain of files, one that holds its rows whole and then, in
//! version order, ones that hold its changes (rows changed, keys deleted),
//! each possibly of an earlier checkpoint of the same job directory
//! (`../ckpt-U/...`). The manifest's [`RowsEntry`]s give each table's
//! buckets exactly one whole file.

use serde::{Deserialize, Serialize};

/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST: &str = "MANIFEST.toml";

/// Bytes of a piece's header.
pub const PIECE_HEADER: usize = 64;

const PIECE_MAGIC: [u8; 8] = *b"EPSCKPT1";

/// Version of the manifest format.
pub const FORMAT: u32 = 1;

/// The directory of the checkpoint at `version`, inside the job's checkpoint
/// directory (names sort by version).
pub fn dir_name(version: u64) -> String {
    format!("ckpt-{version:012}")
}

/// The version of a checkpoint directory's name, if it is one.
pub fn parse_dir_name(name: &str) -> Option<u64> {
    let v = name.strip_prefix("ckpt-")?;
    (v.len() == 12 && v.bytes().all(|b| b.is_ascii_digit())).then(|| v.parse().ok())?
}

/// The file server `rank` writes shard `shard` into.
pub fn piece_name(shard: u32, rank: u32) -> String {
    format!("shard-{shard}-server-{rank}.bin")
}

/// The file server `rank` writes table `table`'s rows into.
pub fn rows_name(table: u32, rank: u32) -> String {
    format!("table-{table}-server-{rank}.bin")
}

/// Why checkpoint bytes are unusable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// Not a piece, or of another format.
    #[error("not a checkpoint piece (bad magic or header)")]
    Header,
    /// The manifest does not parse.
    #[error("manifest: {0}")]
    Manifest(String),
    /// A table's rows are not listed once per bucket, or a rows file is unusable.
    #[error("table rows: {0}")]
    Rows(String),
    /// The pieces leave part of the parameters out.
    #[error("the pieces do not cover elements {from}..{to}")]
    Gap {
        /// First element missing.
        from: u64,
        /// End of the gap.
        to: u64,
    },
}

/// The header of a piece file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceHeader {
    /// The checkpoint's version.
    pub version: u64,
    /// First element in the flat space.
    pub start: u64,
    /// Elements.
    pub len: u64,
    /// Optimizer state values per element.
    pub state_k: u32,
    /// SSP/ASP: the updates the shard had applied (each one worker's
    /// contribution; the learning-rate schedule's position); 0 in BSP, where
    /// that is `version`.
    pub updates: u64,
}

impl PieceHeader {
    /// The updates the piece's shard had applied.
    pub fn applied(&self) -> u64 {
        if self.updates == 0 { self.version } else { self.updates }
    }

    /// Bytes of the payload after the header: master values, then state.
    pub fn payload_bytes(&self) -> u64 {
        self.len * (1 + u64::from(self.state_k)) * 4
    }

    /// The header's bytes.
    pub fn encode(&self) -> [u8; PIECE_HEADER] {
        let mut b = [0u8; PIECE_HEADER];
        b[..8].copy_from_slice(&PIECE_MAGIC);
        b[8..16].copy_from_slice(&self.version.to_le_bytes());
        b[16..24].copy_from_slice(&self.start.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..36].copy_from_slice(&self.state_k.to_le_bytes());
        b[40..48].copy_from_slice(&self.updates.to_le_bytes());
        b
    }

    /// Reads a header (reserved bytes must be zero).
    pub fn decode(b: &[u8]) -> Result<Self, CheckpointError> {
        let reserved = |r: std::ops::Range<usize>| b[r].iter().any(|&x| x != 0);
        if b.len() < PIECE_HEADER || b[..8] != PIECE_MAGIC || reserved(36..40) || reserved(48..PIECE_HEADER) {
            return Err(CheckpointError::Header);
        }
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes"));
        let state_k = u32::from_le_bytes(b[32..36].try_into().expect("4 bytes"));
        let h = Self { version: u(8..16), start: u(16..24), len: u(24..32), state_k, updates: u(40..48) };
        if h.len == 0 || h.state_k > 8 || h.start.checked_add(h.len).is_none() {
            return Err(CheckpointError::Header);
        }
        Ok(h)
    }
}

const ROWS_MAGIC: [u8; 8] = *b"EPSROWS1";

/// The header of a rows file ([`PIECE_HEADER`] bytes); `rows` records of
/// `eps_sparse::moves::ROW_META + 4 * stride` bytes follow, then `deleted`
/// keys (u64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowsHeader {
    /// The checkpoint's version (the one the file was written for).
    pub version: u64,
    /// The table's index in the job.
    pub table: u32,
    /// Values and optimizer state per row.
    pub stride: u32,
    /// Rows in the file.
    pub rows: u64,
    /// Keys deleted.
    pub deleted: u64,
}

impl RowsHeader {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; PIECE_HEADER] {
        let mut b = [0u8; PIECE_HEADER];
        b[..8].copy_from_slice(&ROWS_MAGIC);
        b[8..16].copy_from_slice(&self.version.to_le_bytes());
        b[16..20].copy_from_slice(&self.table.to_le_bytes());
        b[20..24].copy_from_slice(&self.stride.to_le_bytes());
        b[24..32].copy_from_slice(&self.rows.to_le_bytes());
        b[32..40].copy_from_slice(&self.deleted.to_le_bytes());
        b
    }

    /// Reads a header (reserved bytes must be zero).
    pub fn decode(b: &[u8]) -> Result<Self, CheckpointError> {
        if b.len() < PIECE_HEADER || b[..8] != ROWS_MAGIC || b[40..PIECE_HEADER].iter().any(|&x| x != 0) {
            return Err(CheckpointError::Header);
        }
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        Ok(Self { version: u64_at(8), table: u32_at(16), stride: u32_at(20), rows: u64_at(24), deleted: u64_at(32) })
    }
}

/// Buckets as runs of consecutive ones, `first-last` or `b`, comma-separated
/// (`buckets` ascending).
pub fn runs_text(buckets: impl IntoIterator<Item = u32>) -> String {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for b in buckets {
        match runs.last_mut() {
            Some((_, last)) if *last + 1 == b => *last = b,
            _ => runs.push((b, b)),
        }
    }
    let run = |&(a, b): &(u32, u32)| if a == b { a.to_string() } else { format!("{a}-{b}") };
    runs.iter().map(run).collect::<Vec<_>>().join(",")
}

/// The buckets of [`runs_text`]'s text, ascending, each below
/// [`crate::buckets::BUCKETS`].
pub fn parse_runs(text: &str) -> Result<Vec<u32>, CheckpointError> {
    let bad = || CheckpointError::Rows(format!("{text:?} is not a list of buckets in ascending runs"));
    let mut out: Vec<u32> = Vec::new();
    for run in text.split(',').filter(|r| !r.is_empty()) {
        let (a, b) = run.split_once('-').unwrap_or((run, run));
        let (a, b): (u32, u32) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
        if a > b || b >= crate::buckets::BUCKETS || out.last().is_some_and(|&l| l >= a) {
            return Err(bad());
        }
        out.extend(a..=b);
    }
    Ok(out)
}

/// A file of a table's rows as the manifest lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RowsEntry {
    /// The table's index.
    pub table: u32,
    /// The file, inside the checkpoint's directory or (`../ckpt-U/NAME`)
    /// an earlier checkpoint's of the same job directory.
    pub file: String,
    /// Hex SHA-256 of the whole file.
    pub sha256: String,
    /// The buckets whose rows are read from it ([`runs_text`]); the file may
    /// hold rows of others, newer ones of which are in other files.
    pub buckets: String,
    /// It holds the changes of these buckets (over earlier files), not
    /// their rows whole.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub changes: bool,
}

impl RowsEntry {
    /// The version of the file: `of`, the manifest's, or its earlier checkpoint's.
    pub fn version(&self, of: u64) -> u64 {
        self.earlier().unwrap_or(of)
    }

    /// The version of the earlier checkpoint the file is in, if it is not
    /// in the manifest's own directory.
    pub fn earlier(&self) -> Option<u64> {
        let rest = self.file.strip_prefix("../")?;
        parse_dir_name(rest.split_once('/')?.0)
    }

    /// Whether `file` is a plain name, or one in an earlier checkpoint's directory.
    fn well_placed(&self) -> bool {
        let plain = |n: &str| !n.is_empty() && !n.contains('/') && n != "." && n != "..";
        match self.file.strip_prefix("../") {
            None => plain(&self.file),
            Some(rest) => rest.split_once('/').is_some_and(|(d, n)| parse_dir_name(d).is_some() && plain(n)),
        }
    }
}

/// Checks that `rows` (of the checkpoint at `version`) name tables below
/// `tables` and give each bucket of each one exactly one whole file, and
/// changes only in later files, each once.
pub fn rows_cover(rows: &[RowsEntry], tables: u32, version: u64) -> Result<(), CheckpointError> {
    let n = crate::buckets::BUCKETS as usize;
    // By table, by bucket: the whole file's version, and the changes' versions.
    let mut whole = vec![vec![None; n]; tables as usize];
    let mut changes: Vec<Vec<Vec<u64>>> = vec![vec![Vec::new(); n]; tables as usize];
    let bad = |why: String| Err(CheckpointError::Rows(why));
    for e in rows {
        if !e.well_placed() || e.earlier().is_some_and(|v| v >= version) {
            return bad(format!("{:?} is not a file of this or an earlier checkpoint", e.file));
        }
        let t = e.table as usize;
        if t >= whole.len() {
            return bad(format!("table {}, of {tables}", e.table));
        }
        let v = e.version(version);
        for b in parse_runs(&e.buckets)? {
            let (w, c) = (&mut whole[t][b as usize], &mut changes[t][b as usize]);
            if e.changes {
                c.push(v);
            } else if w.replace(v).is_some() {
                return bad(format!("bucket {b} of table {t} has two whole files"));
            }
        }
    }
    for (t, (w, c)) in whole.iter().zip(&changes).enumerate() {
        for b in 0..n {
            let Some(base) = w[b] else { return bad(format!("bucket {b} of table {t} is in no file")) };
            let mut vs = c[b].clone();
            vs.sort_unstable();
            if vs.first().is_some_and(|&f| f <= base) || vs.windows(2).any(|p| p[0] == p[1]) {
                return bad(format!("bucket {b} of table {t}: changes not after its whole file, or twice"));
            }
        }
    }
    Ok(())
}

/// One piece as the manifest lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PieceEntry {
    /// File name inside the checkpoint directory.
    pub file: String,
    /// First element.
    pub start: u64,
    /// Elements.
    pub len: u64,
    /// Hex SHA-256 of the whole file.
    pub sha256: String,
}

/// What a checkpoint holds besides its pieces: enough to resume the job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// The version of every parameter (iterations applied).
    pub version: u64,
    /// The shard map's epoch when it completed (for the record).
    pub epoch: u64,
    /// Servers holding shards when it completed (for the record).
    pub servers: u32,
    /// Elements of the flat space.
    pub total: u64,
    /// Optimizer state values per element.
    pub state_k: u32,
    /// Contributor sets by iteration, up to `version`
    /// ([`crate::membership::Membership::to_text`]).
    pub membership: String,
    /// The job's spec (with declared tensors, if any), without `[resume]`.
    pub spec: String,
    /// A cover of the flat space, by ascending start.
    pub pieces: Vec<PieceEntry>,
    /// Sparse tables of the job.
    #[serde(default)]
    pub tables: u32,
    /// Their rows: files whose buckets cover every table's once.
    #[serde(default)]
    pub rows: Vec<RowsEntry>,
}

impl Manifest {
    /// The manifest's text.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a manifest serializes")
    }

    /// Parses and checks a manifest: its format, and pieces that cover
    /// `[0, total)`.
    pub fn from_toml(text: &str) -> Result<Self, CheckpointError> {
        let m: Manifest = toml::from_str(text).map_err(|e| CheckpointError::Manifest(e.to_string().trim().replace('\n', " ")))?;
        if m.format != FORMAT {
            return Err(CheckpointError::Manifest(format!("format {} (this build reads {FORMAT})", m.format)));
        }
        if m.version == 0 {
            return Err(CheckpointError::Manifest("version 0 is the job's start, not a checkpoint".into()));
        }
        let spans: Vec<(u64, u64)> = m.pieces.iter().map(|p| (p.start, p.len)).collect();
        cover(&spans, m.total)?;
        rows_cover(&m.rows, m.tables, m.version)?;
        Ok(m)
    }

    /// Indices of the pieces that hold elements of `[start, start + len)`.
    pub fn overlapping(&self, start: u64, len: u64) -> Vec<usize> {
        let end = start.saturating_add(len);
        (0..self.pieces.len())
            .filter(|&i| {
                let p = &self.pieces[i];
                p.start < end && start < p.start.saturating_add(p.len)
            })
            .collect()
    }
}

/// Picks pieces (`(start, len)`) that cover `[0, total)`, fewest first by
/// ascending start: their indices, or the first gap.
pub fn cover(pieces: &[(u64, u64)], total: u64) -> Result<Vec<usize>, CheckpointError> {
    let mut order: Vec<usize> = (0..pieces.len()).filter(|&i| pieces[i].1 > 0).collect();
    order.sort_by_key(|&i| (pieces[i].0, std::cmp::Reverse(pieces[i].1)));
    let mut at = 0u64;
    let mut chosen = Vec::new();
    let mut k = 0;
    while at < total {
        // The piece starting at or before `at` that reaches furthest.
        let mut best: Option<(usize, u64)> = None;
        while k < order.len() && pieces[order[k]].0 <= at {
            let i = order[k];
            let end = pieces[i].0.saturating_add(pieces[i].1);
            if end > at && best.is_none_or(|(_, e)| end > e) {
                best = Some((i, end));
            }
            k += 1;
        }
        let Some((i, end)) = best else {
            let next = order.get(k).map_or(total, |&i| pieces[i].0.min(total));
            return Err(CheckpointError::Gap { from: at, to: next });
        };
        chosen.push(i);
        at = end;
    }
    Ok(chosen)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_garbage_is_refused() {
        let h = PieceHeader { version: 40, start: 1 << 20, len: 4096, state_k: 2, updates: 160 };
        assert_eq!(PieceHeader::decode(&h.encode()), Ok(h));
        assert_eq!(h.payload_bytes(), 4096 * 3 * 4);
        let mut b = h.encode();
        b[50] = 1;
        assert_eq!(PieceHeader::decode(&b), Err(CheckpointError::Header));
        assert_eq!(PieceHeader::decode(&[0u8; 10]), Err(CheckpointError::Header));
        let mut b = h.encode();
        b[0] = b'X';
        assert_eq!(PieceHeader::decode(&b), Err(CheckpointError::Header));
    }

    #[test]
    fn a_cover_skips_duplicates_and_names_gaps() {
        // Two copies of the middle piece (a migration's source and target).
        let p = [(0, 10), (10, 5), (10, 5), (15, 5)];
        assert_eq!(cover(&p, 20), Ok(vec![0, 1, 3]));
        // A split's parts next to their parent's copy: either cover works.
        let p = [(0, 20), (0, 10), (10, 10)];
        assert_eq!(cover(&p, 20), Ok(vec![0]));
        assert_eq!(cover(&[(0, 10), (12, 8)], 20), Err(CheckpointError::Gap { from: 10, to: 12 }));
        assert_eq!(cover(&[(0, 10)], 20), Err(CheckpointError::Gap { from: 10, to: 20 }));
        assert_eq!(cover(&[], 0), Ok(vec![]));
    }

    #[test]
    fn manifests_round_trip_and_must_cover_the_space() {
        let piece = |file: &str, start, len| PieceEntry { file: file.into(), start, len, sha256: "00".into() };
        let m = Manifest {
            format: FORMAT,
            version: 20,
            epoch: 3,
            servers: 2,
            total: 30,
            state_k: 2,
            membership: "0:0,1".into(),
            spec: "[job]\nworkers = 2\n".into(),
            pieces: vec![piece("a", 0, 10), piece("b", 10, 20)],
            tables: 0,
            rows: Vec::new(),
        };
        assert_eq!(Manifest::from_toml(&m.to_toml()), Ok(m.clone()));
        assert_eq!(m.overlapping(5, 10), vec![0, 1]);
        assert_eq!(m.overlapping(10, 1), vec![1]);
        let mut torn = m.clone();
        torn.pieces.pop();
        assert!(matches!(Manifest::from_toml(&torn.to_toml()), Err(CheckpointError::Gap { from: 10, to: 30 })));
        let text = m.to_toml().replace("format = 1", "format = 9");
        assert!(Manifest::from_toml(&text).unwrap_err().to_string().contains("format 9"));
        assert_eq!(parse_dir_name(&dir_name(20)), Some(20));
        assert_eq!(parse_dir_name("ckpt-12"), None);
    }

    #[test]
    fn table_rows_are_listed_once_per_bucket() {
        let h = RowsHeader { version: 30, table: 1, stride: 17, rows: 5000, deleted: 12 };
        assert_eq!(RowsHeader::decode(&h.encode()), Ok(h));
        assert_eq!(
            RowsHeader::decode(&PieceHeader { version: 1, start: 0, len: 1, state_k: 0, updates: 0 }.encode()),
            Err(CheckpointError::Header)
        );
        assert_eq!(runs_text([0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(parse_runs("0-2,5,7-8"), Ok(vec![0, 1, 2, 5, 7, 8]));
        assert_eq!(parse_runs(""), Ok(vec![]));
        for bad in ["3-1", "5,4", "0-4096", "x", "1-2-3", "2,2"] {
            assert!(parse_runs(bad).is_err(), "{bad}");
        }
        let all = format!("0-{}", crate::buckets::BUCKETS - 1);
        let e = |table, file: &str, buckets: &str| RowsEntry {
            table,
            file: file.into(),
            sha256: "00".into(),
            buckets: buckets.into(),
            changes: false,
        };
        let changes = |file: &str, buckets: &str| RowsEntry { changes: true, ..e(0, file, buckets) };
        let two = [e(0, "a.bin", "0-99"), e(0, "../ckpt-000000000010/b.bin", &format!("100-{}", crate::buckets::BUCKETS - 1))];
        assert_eq!(rows_cover(&two, 1, 20), Ok(()));
        assert_eq!((two[0].earlier(), two[1].earlier()), (None, Some(10)));
        let gap = rows_cover(&two[..1], 1, 20).unwrap_err().to_string();
        assert!(gap.contains("bucket 100 of table 0 is in no file"), "{gap}");
        let twice = rows_cover(&[e(0, "a", &all), e(0, "b", "7")], 1, 20).unwrap_err().to_string();
        assert!(twice.contains("bucket 7 of table 0 has two whole files"), "{twice}");
        assert!(rows_cover(&[e(1, "a", &all)], 1, 20).is_err(), "a table the job lacks");
        // Changes come after the whole file, each once.
        let base = e(0, "../ckpt-000000000010/a.bin", &all);
        let c15 = changes("../ckpt-000000000015/b.bin", "3-9");
        assert_eq!(rows_cover(&[base.clone(), c15.clone(), changes("c.bin", "5")], 1, 20), Ok(()));
        assert!(rows_cover(&[base.clone(), c15.clone(), c15.clone()], 1, 20).is_err(), "the same changes twice");
        assert!(rows_cover(&[e(0, "a.bin", &all), c15.clone()], 1, 20).is_err(), "changes before the whole file");
        assert!(
            rows_cover(&[base.clone(), changes("../ckpt-000000000020/x", "1")], 1, 20).is_err(),
            "a file of this checkpoint named as earlier"
        );
        for file in ["../../x.bin", "../ckpt-1/x.bin", "d/x.bin", "..", ""] {
            assert!(rows_cover(&[e(0, file, &all)], 1, 20).is_err(), "{file}");
        }
        // A manifest with rows round-trips; one without is read as before.
        let m = Manifest {
            format: FORMAT,
            version: 20,
            epoch: 1,
            servers: 1,
            total: 4,
            state_k: 0,
            membership: "0:0".into(),
            spec: String::new(),
            pieces: vec![PieceEntry { file: "p".into(), start: 0, len: 4, sha256: "00".into() }],
            tables: 1,
            rows: vec![base, c15, changes("c.bin", "5")],
        };
        assert_eq!(Manifest::from_toml(&m.to_toml()), Ok(m.clone()));
        let plain = Manifest { tables: 0, rows: Vec::new(), ..m.clone() };
        let text = plain.to_toml().replace("tables = 0\n", "").replace("rows = []\n", "");
        assert!(!text.contains("rows"), "{text}");
        assert_eq!(Manifest::from_toml(&text), Ok(plain));
        assert!(m.to_toml().contains("changes = true"));
        let torn = Manifest { rows: two[..1].to_vec(), ..m };
        assert!(Manifest::from_toml(&torn.to_toml()).is_err());
    }
}
