//! Which rows one server's checkpoint of a table writes, free of I/O.
//!
//! Into the job's own checkpoint directory saves are incremental, bucket by
//! bucket. A bucket's rows are read back as a chain: one file that holds
//! them whole, then files that hold their changes (the rows changed since
//! the save before, and the keys deleted), in version order. At each save
//! a bucket that did not change adds nothing to its chain; one that changed
//! adds its changes, unless the changes of its chain would then outweigh
//! the bucket (or a file of the chain is not known written whole): then it
//! is written whole and its chain starts again. So a resume reads at most
//! about twice a bucket's rows, and a save writes about what changed.
//! Saves into any other directory write every bucket whole.

use std::collections::BTreeMap;

use crate::RowTable;
use crate::bucket::{BUCKETS, bucket_of};

/// What one server remembers of a table's saves into the job's directory.
#[derive(Clone, Debug)]
pub struct Saves {
    /// By bucket: the versions of its chain here (the whole one first);
    /// empty when its rows were not saved since they came here.
    chain: Vec<Vec<u64>>,
    /// By bucket: rows and deletions in the changes of its chain.
    changes: Vec<u64>,
}

impl Default for Saves {
    fn default() -> Self {
        Self { chain: vec![Vec::new(); BUCKETS as usize], changes: vec![0; BUCKETS as usize] }
    }
}

/// One save: the file's contents and the buckets it and earlier files hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Saved {
    /// Row records ([`crate::moves`]'s format), by ascending key.
    pub records: Vec<u8>,
    /// How many.
    pub rows: u64,
    /// Keys deleted (of the buckets whose changes it holds).
    pub deleted: Vec<u64>,
    /// Buckets it holds whole.
    pub whole: Vec<u32>,
    /// Buckets it holds the changes of.
    pub changes: Vec<u32>,
    /// Earlier files of this server still read, by version: the buckets
    /// each holds whole, and those it holds changes of.
    pub earlier: BTreeMap<u64, (Vec<u32>, Vec<u32>)>,
}

impl Saved {
    /// Whether the save writes a file.
    pub fn writes(&self) -> bool {
        !self.whole.is_empty() || !self.changes.is_empty()
    }
}

/// How a bucket is saved.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Plan {
    Skip,
    Whole,
    Changes,
    Unchanged,
}

impl Saves {
    /// Saves the buckets `mine` of `rows` at `version`: into the job's own
    /// directory (`incremental`, where `written(v)` says whether this
    /// server's file of version `v` was written whole), or whole into
    /// another. The records are copied into `buffer` (emptied first): best
    /// memory touched before (an earlier save's), so that the copy does not
    /// wait for the kernel to fault fresh pages in, most of its time. The
    /// caller clears `rows`' changes after an incremental save.
    pub fn save(
        &mut self,
        buffer: Vec<u8>,
        rows: &RowTable,
        version: u64,
        mine: &[bool],
        incremental: bool,
        written: impl Fn(u64) -> bool,
    ) -> Saved {
        let (held, dirty) = rows.bucket_counts();
        let changed = {
            let mut c = vec![false; BUCKETS as usize];
            rows.changed_buckets().into_iter().for_each(|b| c[b as usize] = true);
            c
        };
        let mut deleted_in = vec![0u64; BUCKETS as usize];
        rows.deleted().iter().for_each(|&k| deleted_in[bucket_of(k) as usize] += 1);
        let mut plan = vec![Plan::Skip; BUCKETS as usize];
        let mut out = Saved { records: buffer, ..Saved::default() };
        out.records.clear();
        for (b, p) in plan.iter_mut().enumerate() {
            let (chain, changes) = (&mut self.chain[b], &mut self.changes[b]);
            if !mine.get(b).copied().unwrap_or(false) {
                if incremental {
                    chain.clear();
                }
                continue;
            }
            if !incremental {
                *p = Plan::Whole;
                continue;
            }
            let whole_chain = !chain.is_empty() && chain.iter().all(|&v| written(v));
            let more = dirty[b] + deleted_in[b];
            *p = match () {
                // An empty bucket costs nothing to write, and keeps no older file read.
                _ if held[b] == 0 => Plan::Whole,
                _ if whole_chain && !changed[b] => Plan::Unchanged,
                _ if whole_chain && *changes + more <= held[b] => Plan::Changes,
                _ => Plan::Whole,
            };
            match *p {
                Plan::Whole => {
                    *chain = vec![version];
                    *changes = 0;
                }
                Plan::Changes => {
                    chain.push(version);
                    *changes += more;
                }
                _ => {}
            }
            let (prior, _) = chain.split_at(chain.len() - usize::from(*p != Plan::Unchanged));
            for (i, &v) in prior.iter().enumerate() {
                let e = out.earlier.entry(v).or_default();
                if i == 0 { &mut e.0 } else { &mut e.1 }.push(b as u32);
            }
        }
        for (b, p) in plan.iter().enumerate() {
            match p {
                Plan::Whole => out.whole.push(b as u32),
                Plan::Changes => out.changes.push(b as u32),
                _ => {}
            }
        }
        let write = |b: u32, dirty: bool| match plan[b as usize] {
            Plan::Whole => true,
            Plan::Changes => dirty,
            _ => false,
        };
        out.rows = rows.copy_rows(write, &mut out.records);
        out.deleted = rows.deleted().iter().copied().filter(|&k| plan[bucket_of(k) as usize] == Plan::Changes).collect();
        out.deleted.sort_unstable();
        out
    }
}

#[cfg(test)]
mod tests;
