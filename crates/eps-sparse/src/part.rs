//! A table's part on one server: the rows of the buckets it owns and the
//! consistency state of its pushes and pulls ([`ShardSync`], the same state
//! machine as a dense shard's), free of I/O. The server hands it the
//! requests that landed, checked ([`crate::wire::parse`]); it says when an
//! iteration is complete, applies it, and fills pull answers.

use eps_proto::Consistency;
use eps_proto::sync::ShardSync;

use crate::bucket::bucket_of;
use crate::decl::Declared;
use crate::index::KeyIndex;
#[cfg(doc)]
use crate::table::sum_duplicates;
use crate::{RowTable, SparseError};

/// A table's rows on one server, and their versions.
#[derive(Debug)]
pub struct TablePart {
    table: Declared,
    rows: RowTable,
    /// Pushes in, iterations complete, pulls waiting: as a dense shard.
    pub sync: ShardSync,
    mode: Consistency,
    workers: u32,
    stats: PartStats,
    merged: Merger,
}

/// What a part did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PartStats {
    /// Keys answered to pulls.
    pub pulled_keys: u64,
    /// Distinct keys stepped.
    pub stepped_keys: u64,
    /// Rows evicted.
    pub evicted: u64,
    /// Rows not created because the table was full.
    pub refused: u64,
}

impl TablePart {
    /// An empty part of `table` at version 0, for `workers` worker ranks.
    pub fn new(table: Declared, mode: Consistency, workers: u32) -> Result<Self, SparseError> {
        Ok(Self {
            rows: RowTable::new(table.spec)?,
            table,
            sync: ShardSync::new(mode, workers),
            mode,
            workers,
            stats: PartStats::default(),
            merged: Merger::default(),
        })
    }

    /// A part holding `rows` at version `at` (BSP: pushes and pulls go on
    /// from `at`; see [`TablePart::restart_at`]): a backup's copy of another
    /// server's rows, served in its place.
    pub fn from_rows(table: Declared, mode: Consistency, workers: u32, rows: RowTable, at: u64) -> Result<Self, SparseError> {
        let mut part = Self::new(table, mode, workers)?;
        if rows.stride() != part.rows.stride() {
            return Err(SparseError::Rows("a copy of rows of another shape than the table's".into()));
        }
        part.rows = rows;
        part.restart_at(at);
        Ok(part)
    }

    /// The table.
    pub fn table(&self) -> &Declared {
        &self.table
    }

    /// The rows held.
    pub fn rows(&self) -> &RowTable {
        &self.rows
    }

    /// Forgets which buckets changed (a checkpoint took them; see
    /// [`RowTable::changed_buckets`]).
    pub fn clear_changed(&mut self) {
        self.rows.clear_changed();
    }

    /// What it did so far.
    pub fn stats(&self) -> PartStats {
        PartStats { evicted: self.rows.evicted(), refused: self.rows.refused(), ..self.stats }
    }

    /// The rows held here from now on are those of the buckets it receives
    /// at iteration `at`, when it held none before: BSP pushes and pulls
    /// start at version `at`; SSP/ASP every worker's next push is of `at`.
    pub fn restart_at(&mut self, at: u64) {
        self.sync = eps_core::buckets::restarted(self.mode, self.workers, at);
    }

    /// Whether every push of the iterations before `at` was applied here
    /// (BSP: the version is `at`; SSP/ASP: every one of `workers` pushed
    /// `at - 1`), and nothing after: `Some(true)` if so, `Some(false)` if
    /// not yet, `None` if an iteration of `at` or later was applied already.
    pub fn reached(&self, at: u64, workers: &[u32]) -> Option<bool> {
        eps_core::buckets::reached(&self.sync, self.mode, at, workers)
    }

    /// Takes out the rows of the buckets `dest` sends away (see
    /// [`RowTable::take_rows`]).
    pub fn take_rows(&mut self, dest: impl Fn(u32) -> Option<usize>, outs: &mut [Vec<u8>]) -> Vec<u64> {
        self.rows.take_rows(|k| dest(bucket_of(k)), outs)
    }

    /// As [`TablePart::take_rows`], the rows held on a backup fed forwards
    /// until released (see [`RowTable::take_rows_held`]).
    pub fn take_rows_held(&mut self, dest: impl Fn(u32) -> Option<usize>, outs: &mut [Vec<u8>], tags: &[u32]) -> Vec<u64> {
        self.rows.take_rows_held(|k| dest(bucket_of(k)), outs, tags)
    }

    /// The rows held out under `tag` go from the backup with the next forward.
    pub fn release_held(&mut self, tag: u32) {
        self.rows.release_held(tag);
    }

    /// Takes in rows another server took out (see [`RowTable::put_rows`]).
    pub fn put_rows(&mut self, records: &[u8], rows: u64) -> Result<(), SparseError> {
        self.rows.put_rows(records, rows)
    }

    /// How many of the keys of `rows` records in `records` are held here.
    pub fn held_of(&self, records: &[u8], rows: u64) -> u64 {
        self.rows.held_of(records, rows)
    }

    /// Takes in a checkpoint's changes over the rows held: the rows of
    /// `deleted` go, then `rows` records replace or add rows.
    pub fn put_changes(&mut self, deleted: &[u64], records: &[u8], rows: u64) -> Result<(), SparseError> {
        self.rows.remove_keys(deleted);
        self.rows.put_rows_over(records, rows)
    }

    /// Keeps the keys of the rows deleted, for checkpoints that write changes.
    pub fn keep_deletions(&mut self) {
        self.rows.keep_deletions();
    }

    /// Keeps what changes from now on for forwards to a backup.
    pub fn keep_forwards(&mut self) {
        self.rows.keep_forwards();
    }

    /// Writes into `out` the forward to a backup of what changed since the
    /// last one (every row, if `full`), at the part's version (see
    /// [`RowTable::write_forward`]).
    pub fn write_forward(&mut self, full: bool, digest: bool, out: &mut Vec<u8>) -> crate::table::ForwardStats {
        self.rows.write_forward(self.sync.version(), full, digest, out)
    }

    /// The rows of `keys`, in the order asked, into `out` (`keys.len() *
    /// dim` values); rows not held yet are created.
    pub fn gather(&mut self, keys: &[u64], out: &mut [f32]) -> Result<(), SparseError> {
        self.rows.pull(keys, self.sync.version(), out)?;
        self.stats.pulled_keys += keys.len() as u64;
        Ok(())
    }

    /// Answers a pull of version `v` (as [`ShardSync::on_pull`] or
    /// [`ShardSync::ready_pulls`] gave it): the rows of `keys` into `out`.
    /// The answer is a copy, so the rows may change as soon as it returns.
    pub fn answer(&mut self, v: u64, keys: &[u64], out: &mut [f32]) -> Result<(), SparseError> {
        let r = self.gather(keys, out);
        self.sync.pull_written(v);
        r
    }

    /// BSP: applies one iteration's contributions, given in rank order (each
    /// worker's keys and gradient rows): duplicates summed in that order,
    /// averaged over the contributors, one step per distinct key. Returns
    /// the new version. Nothing changes if it is refused.
    pub fn apply_all(&mut self, contributions: &[(&[u64], &[f32])]) -> Result<u64, SparseError> {
        let scale = 1.0 / contributions.len().max(1) as f32;
        self.step(contributions, scale)?;
        Ok(self.sync.published(None))
    }

    /// SSP/ASP: applies worker `w`'s contribution on its own, scaled by the
    /// worker count (as dense shards do). Returns the new version.
    pub fn apply_one(&mut self, w: u32, keys: &[u64], rows: &[f32]) -> Result<u64, SparseError> {
        self.step(&[(keys, rows)], 1.0 / self.workers.max(1) as f32)?;
        Ok(self.sync.published(Some(w)))
    }

    fn step(&mut self, contributions: &[(&[u64], &[f32])], scale: f32) -> Result<(), SparseError> {
        let (keys, grads) = self.merged.merge(contributions, self.table.spec.dim)?;
        grads.iter_mut().for_each(|g| *g *= scale);
        let now = self.sync.version();
        self.rows.push_distinct(keys, grads, self.table.lr, now);
        self.stats.stepped_keys += keys.len() as u64;
        if let Some(e) = self.table.evict
            && (now + 1) % e.idle_steps == 0
        {
            self.rows.evict(now + 1, e.idle_steps, e.min_touches);
        }
        Ok(())
    }
}

/// Contributions (keys and gradient rows of dimension `dim`, in rank order)
/// merged: each key once, its rows summed in the order given. BSP's sum of
/// a row, bit for bit: each worker sums its batch's duplicates in batch
/// order ([`sum_duplicates`]), then the workers' sums are added in rank order.
pub fn merge(contributions: &[(&[u64], &[f32])], dim: usize) -> Result<(Vec<u64>, Vec<f32>), SparseError> {
    let mut m = Merger::default();
    let (k, g) = m.merge(contributions, dim)?;
    Ok((k.to_vec(), g.to_vec()))
}

/// [`merge`] into buffers kept from one update to the next (an update then
/// touches no fresh memory).
#[derive(Debug, Default)]
pub struct Merger {
    at: KeyIndex,
    keys: Vec<u64>,
    rows: Vec<f32>,
}

impl Merger {
    /// Merges `contributions`; the keys and rows are valid until the next call.
    pub fn merge(&mut self, contributions: &[(&[u64], &[f32])], dim: usize) -> Result<(&[u64], &mut [f32]), SparseError> {
        for (k, r) in contributions {
            if r.len() != k.len() * dim {
                return Err(SparseError::Length { what: "gradient rows", got: r.len(), keys: k.len(), dim, want: k.len() * dim });
            }
        }
        self.at.clear();
        self.keys.clear();
        self.rows.clear();
        let (keys, rows) = (&mut self.keys, &mut self.rows);
        for (k, r) in contributions {
            self.at.number(k, |i, n, new| {
                let row = &r[i * dim..(i + 1) * dim];
                if new {
                    keys.push(k[i]);
                    rows.extend_from_slice(row);
                } else {
                    let n = n as usize * dim;
                    rows[n..n + dim].iter_mut().zip(row).for_each(|(a, b)| *a += *b);
                }
            });
        }
        Ok((&self.keys, &mut self.rows))
    }
}

#[cfg(test)]
mod tests;
