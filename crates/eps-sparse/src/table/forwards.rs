//! Forwards to a backup: what changed in a table since the last one (the
//! slots whose rows were created, touched, stepped or taken in, and the keys
//! evicted or taken out), kept apart from the checkpoints' bookkeeping (a
//! checkpoint every k steps, a forward every update); written as one blob
//! the backup takes in over its copy, and a digest of every row that says
//! whether the two copies are the same, bit for bit.

use super::RowTable;
use crate::SparseError;
use crate::moves::ROW_META;

/// What changed since the last forward.
#[derive(Debug, Default)]
pub(crate) struct Forwards {
    /// Slots whose row changed, each once (`seen` says which are listed).
    slots: Vec<u32>,
    seen: Vec<u64>,
    /// Keys no longer held.
    deleted: Vec<u64>,
    /// Rows taken out for a bucket move that the backup keeps until their
    /// target has them (see [`RowTable::take_rows_held`]): by tag, their
    /// keys and the sum of their digests.
    held: Vec<(u32, Vec<u64>, u64)>,
    /// Records of rows taken out and held, as they were when taken out (the
    /// backup's copy may be an update behind), and how many.
    taken: Vec<u8>,
    taken_rows: u64,
}

impl Forwards {
    pub(super) fn row(&mut self, s: usize) {
        if self.seen.len() <= s / 64 {
            self.seen.resize(s / 64 + 1, 0);
        }
        if self.seen[s / 64] >> (s % 64) & 1 == 0 {
            self.seen[s / 64] |= 1 << (s % 64);
            self.slots.push(s as u32);
        }
    }

    pub(super) fn gone(&mut self, key: u64) {
        self.deleted.push(key);
    }

    /// Where records of rows taken out and held go.
    pub(super) fn taken_records(&mut self) -> &mut Vec<u8> {
        &mut self.taken
    }

    /// Row `key` (its record at the end of `taken`) was taken out and is
    /// held under `tag`.
    pub(super) fn held(&mut self, tag: u32, key: u64, digest: u64) {
        self.taken_rows += 1;
        let i = match self.held.iter().position(|h| h.0 == tag) {
            Some(i) => i,
            None => {
                self.held.push((tag, Vec::new(), 0));
                self.held.len() - 1
            }
        };
        self.held[i].1.push(key);
        self.held[i].2 = self.held[i].2.wrapping_add(digest);
    }
}

/// A forward's first bytes: "EPSF".
const MAGIC: u32 = 0x4653_5045;
/// Bytes of a forward's header.
const HEADER: usize = 48;
const FULL: u32 = 1;
const DIGEST: u32 = 2;

/// What a forward carried.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForwardStats {
    /// Rows written.
    pub rows: u64,
    /// Keys deleted.
    pub deleted: u64,
    /// Bytes of the blob.
    pub bytes: u64,
}

/// A forward parsed (see [`parse_forward`]).
#[derive(Debug)]
pub struct Forward<'a> {
    /// The table's version once it is taken in.
    pub version: u64,
    /// Every row the table holds (the copy starts over), not only changes.
    pub full: bool,
    /// [`RowTable::digest`] of the sender's table, if it was computed.
    pub digest: Option<u64>,
    /// Keys no longer held.
    pub deleted: Vec<u64>,
    /// Records of [`crate::moves`], `rows` of them.
    pub records: &'a [u8],
    /// How many records.
    pub rows: u64,
}

impl RowTable {
    /// Keeps what changes from now on for forwards to a backup (see
    /// [`RowTable::write_forward`]).
    pub fn keep_forwards(&mut self) {
        self.forwards.get_or_insert_with(Forwards::default);
    }

    /// Writes into `out` (cleared first) the forward of what changed since
    /// the last one (or every row, if `full`), for the table at `version`;
    /// with its [`RowTable::digest`] if `digest`. What changed is forgotten.
    pub fn write_forward(&mut self, version: u64, full: bool, digest: bool, out: &mut Vec<u8>) -> ForwardStats {
        let f = self.forwards.take().unwrap_or_default();
        let rec = ROW_META + self.stride * 4;
        let mut slots: Vec<usize> = if full {
            (0..self.meta.len()).filter(|&s| self.is_live(s)).collect()
        } else {
            // (A slot freed since it was listed holds no row, or another key's.)
            f.slots.iter().map(|&s| s as usize).filter(|&s| self.is_live(s)).collect()
        };
        slots.sort_unstable();
        let deleted: &[u64] = if full { &[] } else { &f.deleted };
        let flags = if full { FULL } else { 0 } | if digest { DIGEST } else { 0 };
        // (The rows held out are still on the backup, not on a new one.)
        let held = if full { 0 } else { f.held.iter().fold(0u64, |a, h| a.wrapping_add(h.2)) };
        let sum = if digest { self.digest().wrapping_add(held) } else { 0 };
        out.clear();
        out.reserve(HEADER + deleted.len() * 8 + slots.len() * rec + f.taken.len());
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&flags.to_le_bytes());
        let rows = slots.len() as u64 + f.taken_rows;
        for v in [version, sum, deleted.len() as u64, rows, self.stride as u64] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for k in deleted {
            out.extend_from_slice(&k.to_le_bytes());
        }
        for &s in &slots {
            self.write_record(s, out);
        }
        out.extend_from_slice(&f.taken);
        let stats = ForwardStats { rows, deleted: deleted.len() as u64, bytes: out.len() as u64 };
        // Listed afresh from here (the lists keep their memory).
        let Forwards { mut slots, mut seen, mut deleted, held, mut taken, .. } = f;
        slots.clear();
        seen.fill(0);
        deleted.clear();
        taken.clear();
        self.forwards = Some(Forwards { slots, seen, deleted, held, taken, taken_rows: 0 });
        stats
    }

    /// The rows held out under `tag` (see [`RowTable::take_rows_held`]) may
    /// go from the backup too: their keys go with the next forward.
    pub fn release_held(&mut self, tag: u32) {
        let Some(f) = &mut self.forwards else { return };
        if let Some(i) = f.held.iter().position(|h| h.0 == tag) {
            let (_, keys, _) = f.held.swap_remove(i);
            // Records of them not forwarded yet go unsent: the backup would
            // take them in after the deletion, and keep rows no longer here.
            if !f.taken.is_empty() {
                let rec = ROW_META + self.stride * 4;
                let gone: std::collections::HashSet<u64> = keys.iter().copied().collect();
                let key = |r: &[u8]| u64::from_le_bytes(r[..8].try_into().unwrap_or_default());
                let kept: Vec<u8> = f.taken.chunks_exact(rec).filter(|r| !gone.contains(&key(r))).flatten().copied().collect();
                f.taken_rows = (kept.len() / rec) as u64;
                f.taken = kept;
            }
            f.deleted.extend(keys);
        }
    }

    /// Takes in forward `f` over the rows held (a backup's copy): the rows
    /// of its deleted keys go, its records replace or add rows.
    pub fn take_forward(&mut self, f: &Forward<'_>) -> Result<(), SparseError> {
        self.remove_keys(&f.deleted);
        self.put_rows_over(f.records, f.rows)
    }

    /// A digest of every row held (key, bookkeeping, values and state, bit
    /// for bit), the same whatever the slots they sit in: two tables with
    /// the same digest hold the same rows.
    pub fn digest(&self) -> u64 {
        (0..self.meta.len()).filter(|&s| self.is_live(s)).fold(0u64, |sum, s| sum.wrapping_add(self.row_digest(s)))
    }

    /// Slot `s`'s row's part of [`RowTable::digest`].
    pub(super) fn row_digest(&self, s: usize) -> u64 {
        let m = self.meta[s];
        let mut h = mix(m.key);
        for v in [m.steps, m.created, m.last, u64::from(m.touches)] {
            h = mix(h ^ v);
        }
        for v in self.row_state(s) {
            h = mix(h ^ u64::from(v.to_bits()));
        }
        h
    }
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Parses a forward of [`RowTable::write_forward`] for a table of `stride`
/// values and state per row.
pub fn parse_forward(blob: &[u8], stride: usize) -> Result<Forward<'_>, SparseError> {
    let bad = |why: String| SparseError::Rows(format!("a forward: {why}"));
    if blob.len() < HEADER {
        return Err(bad(format!("{} bytes, shorter than its header", blob.len())));
    }
    let u32_at = |i: usize| u32::from_le_bytes(blob[i..i + 4].try_into().unwrap_or_default());
    let u64_at = |i: usize| u64::from_le_bytes(blob[i..i + 8].try_into().unwrap_or_default());
    let (magic, flags) = (u32_at(0), u32_at(4));
    let (version, digest, deleted, rows, of) = (u64_at(8), u64_at(16), u64_at(24), u64_at(32), u64_at(40));
    if magic != MAGIC || flags & !(FULL | DIGEST) != 0 {
        return Err(bad(format!("header {magic:#x}/{flags:#x} is not a forward's")));
    }
    if of != stride as u64 {
        return Err(bad(format!("rows of {of} values and state; this table's have {stride}")));
    }
    let rec = (ROW_META + stride * 4) as u64;
    let want = deleted.checked_mul(8).and_then(|d| rows.checked_mul(rec).and_then(|r| r.checked_add(d)));
    if want != Some((blob.len() - HEADER) as u64) {
        return Err(bad(format!("{} bytes for {deleted} deleted keys and {rows} rows", blob.len())));
    }
    let keys_end = HEADER + deleted as usize * 8;
    let deleted = blob[HEADER..keys_end].chunks_exact(8).map(|k| u64::from_le_bytes(k.try_into().unwrap_or_default())).collect();
    Ok(Forward {
        version,
        full: flags & FULL != 0,
        digest: (flags & DIGEST != 0).then_some(digest),
        deleted,
        records: &blob[keys_end..],
        rows,
    })
}

#[cfg(test)]
mod tests;
