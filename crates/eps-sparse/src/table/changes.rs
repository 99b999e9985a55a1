//! What changed in a table since a checkpoint took its rows: a bit per
//! bucket, a bit per row, and (when kept) the keys deleted; copies of rows
//! by bucket and change; and taking in a checkpoint's changes.

use super::{Meta, RowTable};
use crate::SparseError;
use crate::bucket::{BUCKETS, bucket_of};
use crate::moves::ROW_META;

/// Rows asked for ahead of the one copied.
const AHEAD: usize = 4;

impl RowTable {
    /// Keeps the keys of rows evicted or taken out from now on (until
    /// [`RowTable::clear_changed`]), for checkpoints that write changes.
    pub fn keep_deletions(&mut self) {
        self.deleted.get_or_insert_with(Vec::new);
    }

    /// The keys deleted since [`RowTable::clear_changed`], if kept.
    pub fn deleted(&self) -> &[u64] {
        self.deleted.as_deref().unwrap_or(&[])
    }

    /// The buckets a row of which was created, touched, stepped, evicted,
    /// taken in or taken out since the last [`RowTable::clear_changed`]
    /// (what an incremental checkpoint writes again), in order.
    pub fn changed_buckets(&self) -> Vec<u32> {
        (0..BUCKETS).filter(|&b| self.changed[(b / 64) as usize] >> (b % 64) & 1 == 1).collect()
    }

    /// By bucket: the rows held, and those of them created, touched,
    /// stepped or taken in since [`RowTable::clear_changed`].
    pub fn bucket_counts(&self) -> (Vec<u64>, Vec<u64>) {
        let (mut held, mut dirty) = (vec![0u64; BUCKETS as usize], vec![0u64; BUCKETS as usize]);
        for s in self.held_slots() {
            let b = bucket_of(self.meta[s].key) as usize;
            held[b] += 1;
            dirty[b] += u64::from(self.is_dirty(s));
        }
        (held, dirty)
    }

    /// Forgets what changed (a checkpoint took it).
    pub fn clear_changed(&mut self) {
        self.changed.fill(0);
        self.dirty.fill(0);
        if let Some(d) = &mut self.deleted {
            d.clear();
        }
    }

    /// Copies the rows `wanted` names (by bucket, and whether the row
    /// changed since [`RowTable::clear_changed`]) into `out` as records of
    /// [`crate::moves`] (what [`RowTable::take_rows`] writes: values, state
    /// and bookkeeping), in the order they sit in memory; the rows stay.
    /// Returns how many.
    pub fn copy_rows(&self, wanted: impl Fn(u32, bool) -> bool, out: &mut Vec<u8>) -> u64 {
        let held: Vec<usize> = self.held_slots().filter(|&s| wanted(bucket_of(self.meta[s].key), self.is_dirty(s))).collect();
        out.reserve(held.len() * (ROW_META + self.stride * 4));
        for (i, &s) in held.iter().enumerate() {
            // Rows changed are spread over the table: their lines are asked
            // for ahead.
            if let Some(&next) = held.get(i + AHEAD) {
                self.prefetch_row(next, self.stride);
            }
            self.write_record(s, out);
        }
        held.len() as u64
    }

    /// Appends slot `s`'s row to `out` as a record of [`crate::moves`]: its
    /// bookkeeping, then its values and state.
    pub(super) fn write_record(&self, s: usize, out: &mut Vec<u8>) {
        let m = self.meta[s];
        for v in [m.key, m.steps, m.created, m.last] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&m.touches.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(bytemuck::cast_slice(self.row_state(s)));
    }

    /// Takes in `rows` records as [`RowTable::put_rows`] does, except that
    /// a row of a key held replaces it (a checkpoint's changes over the
    /// rows of an earlier one).
    pub fn put_rows_over(&mut self, bytes: &[u8], rows: u64) -> Result<(), SparseError> {
        let rec = ROW_META + self.stride * 4;
        if bytes.len() as u64 != rows.saturating_mul(rec as u64) {
            return Err(SparseError::Rows(format!("{} bytes for {rows} rows of {rec} bytes", bytes.len())));
        }
        let u64_at = |r: &[u8], i: usize| u64::from_le_bytes(r[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        for r in bytes.chunks_exact(rec) {
            let touches = u32::from_le_bytes(r[32..36].try_into().unwrap_or_default());
            let meta = Meta { key: u64_at(r, 0), steps: u64_at(r, 1), touches, created: u64_at(r, 2), last: u64_at(r, 3) };
            let s = match self.index.get(meta.key) {
                Some(s) => {
                    self.meta[s as usize] = meta;
                    s as usize
                }
                None => {
                    let s = self.new_slot(meta);
                    self.index.insert(meta.key, s as u32);
                    s
                }
            };
            let (values, state) = self.row_state_mut(s);
            let dst = values.iter_mut().chain(state.iter_mut());
            for (d, v) in dst.zip(r[ROW_META..].chunks_exact(4)) {
                *d = f32::from_le_bytes(v.try_into().unwrap_or_default());
            }
            self.mark_row(s);
        }
        Ok(())
    }

    /// Deletes the rows of `keys` held (a checkpoint's deletions).
    pub fn remove_keys(&mut self, keys: &[u64]) {
        for &k in keys {
            if let Some(s) = self.index.get(k) {
                self.index.remove(k);
                self.release(s as usize);
                self.mark_gone(k);
            }
        }
    }

    /// The slots that hold a row.
    fn held_slots(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.meta.len()).filter(|&s| self.is_live(s))
    }

    /// Whether slot `s` holds a row.
    pub(super) fn is_live(&self, s: usize) -> bool {
        self.live.get(s / 64).is_some_and(|w| w >> (s % 64) & 1 == 1)
    }

    pub(super) fn set_live(&mut self, s: usize) {
        if self.live.len() <= s / 64 {
            self.live.resize(s / 64 + 1, 0);
        }
        self.live[s / 64] |= 1 << (s % 64);
    }

    /// Slot `s` no longer holds a row: it is free for the next.
    pub(super) fn release(&mut self, s: usize) {
        self.live[s / 64] &= !(1 << (s % 64));
        self.free.push(s as u32);
    }

    fn is_dirty(&self, s: usize) -> bool {
        self.dirty.get(s / 64).is_some_and(|w| w >> (s % 64) & 1 == 1)
    }

    /// Slot `s`'s row changed.
    pub(super) fn mark_row(&mut self, s: usize) {
        let b = bucket_of(self.meta[s].key);
        self.changed[(b / 64) as usize] |= 1 << (b % 64);
        if self.dirty.len() <= s / 64 {
            self.dirty.resize(s / 64 + 1, 0);
        }
        self.dirty[s / 64] |= 1 << (s % 64);
        if let Some(f) = &mut self.forwards {
            f.row(s);
        }
    }

    /// The row of `key` is no longer held.
    pub(super) fn mark_gone(&mut self, key: u64) {
        self.mark_taken(key);
        if let Some(f) = &mut self.forwards {
            f.gone(key);
        }
    }

    /// As [`RowTable::mark_gone`], but not for forwards.
    pub(super) fn mark_taken(&mut self, key: u64) {
        let b = bucket_of(key);
        self.changed[(b / 64) as usize] |= 1 << (b % 64);
        if let Some(d) = &mut self.deleted {
            d.push(key);
        }
    }
}
