//! A stand-in giving a lost server's buckets away in its place (see
//! `stand_in.rs`): the lost server was the source of a bucket move whose
//! targets had not all taken its rows (`Order::StandIn { give }`).
//!
//! A source's backup keeps the rows it took out until their target has them
//! on its own backup (`RowTable::take_rows_held`; the source releases them
//! on `FreeRows`), so the copy the stand-in serves from holds every row the
//! lost server was to give. Once the stand-in's part holds every push before
//! the cutover `at` (the copy may be behind it: workers send the lost
//! server's buckets to the stand-in until then), it takes out of its part,
//! by the newest bucket map:
//! - the rows of each bucket going to a target in `give`: put where that
//!   target READs them, and reported (`RowsOut` for the lost server; the
//!   target is told to READ them here); to itself, taken in at once. A
//!   target that took them from the lost server just before it was lost
//!   (its report not in yet) ignores them;
//! - the rows of buckets the lost server no longer owns and no target waits
//!   for (taken already, their release not yet forwarded): dropped.
//!
//! What is left is the lost server's from the cutover on (its buckets move
//! to the stand-in later, as any stand-in's); if the newest map names it no
//! more, nothing is left and the stand-in is done.

use std::time::Instant;

use eps_fabric::{Access, Fabric, MemoryRegion};
use eps_proto::control::ControlMsg;
use eps_sparse::moves;

use crate::{Server, ServerError};

/// The buckets a lost server gave away, given by its stand-in.
pub(crate) struct Give<P: Fabric> {
    /// The cutover of the move.
    at: u64,
    targets: Vec<u32>,
    /// By bucket: kept (`None`), to `targets[i]`, or dropped (`targets.len()`).
    dest: Vec<Option<usize>>,
    /// By table: whether its rows were taken out.
    taken: Vec<bool>,
    /// By target: the rows taken out, and how many.
    blobs: Vec<Vec<u8>>,
    rows: Vec<u64>,
    dropped: u64,
    /// Registered for the targets to READ (kept to the end: the control
    /// plane frees no lost server's rows).
    out: Vec<P::Mr>,
    pub(crate) done: bool,
    /// The move's map still names the lost server (it kept some buckets).
    keeps: bool,
}

impl<P: Fabric> Give<P> {
    /// What lost server `from` gives `targets` (and drops) by the newest
    /// bucket map in `owners`, for `tables` tables.
    pub(crate) fn new(owners: &[(u64, Vec<u32>)], from: u32, targets: Vec<u32>, tables: usize) -> Option<Self> {
        let (at, new) = owners.last()?;
        let old = &owners[owners.len().saturating_sub(2)].1;
        let drop = targets.len();
        let dest = new
            .iter()
            .zip(old)
            .map(|(&n, &o)| match targets.iter().position(|&t| t == n) {
                _ if n == from => None,
                Some(i) if o == from => Some(i),
                _ => Some(drop),
            })
            .collect();
        let n = targets.len();
        Some(Self {
            at: *at,
            targets,
            dest,
            taken: vec![false; tables],
            blobs: (0..n).map(|_| moves::start()).collect(),
            rows: vec![0; n],
            dropped: 0,
            out: Vec::new(),
            done: false,
            keeps: new.contains(&from),
        })
    }
}

impl<P: Fabric> Server<P> {
    /// Takes out of the stand-in's parts, each once it holds every push
    /// before the cutover, what the lost server gave away or no longer
    /// owns; once every table's are out, gives them to their targets.
    pub(crate) fn stand_in_give(&mut self) -> Result<(), ServerError> {
        let latest = self.members.membership().latest().to_vec();
        let Some(s) = self.sparse.stand_in.as_mut().filter(|s| s.merged.is_none()) else { return Ok(()) };
        let from = s.from;
        let Some(g) = s.give.as_mut().filter(|g| !g.done) else { return Ok(()) };
        for (t, table) in s.tables.iter_mut().enumerate() {
            // (A copy past the cutover is taken out at once.)
            if g.taken[t] || table.part.reached(g.at, &latest) == Some(false) {
                continue;
            }
            let mut outs = vec![Vec::new(); g.targets.len() + 1];
            let counts = table.part.take_rows(|b| g.dest[b as usize], &mut outs);
            let stride = table.part.rows().stride();
            for i in 0..g.targets.len() {
                moves::section(&mut g.blobs[i], t as u32, stride, counts[i], &outs[i]);
                g.rows[i] += counts[i];
            }
            g.dropped += counts[g.targets.len()];
            g.taken[t] = true;
        }
        if !g.taken.iter().all(|&x| x) {
            return Ok(());
        }
        g.done = true;
        let (at, targets, blobs, rows, dropped) =
            (g.at, g.targets.clone(), std::mem::take(&mut g.blobs), g.rows.clone(), g.dropped);
        let keeps = g.keeps;
        eps_proto::say!(
            "eps server {}: gives lost server {from}'s rows of the buckets it gave away at iteration {at} in its place: \
             {rows:?} rows to servers {targets:?} ({dropped} dropped: taken already)",
            self.rank
        );
        if !keeps {
            // Nothing of it is left to become this server's own (what it
            // kept moves here later, as any stand-in's: `merge_stand_in`).
            s.leaves_at = Some(at);
            s.merged = Some(0);
        }
        for (i, (to, blob)) in targets.into_iter().zip(blobs).enumerate() {
            if to == self.rank {
                self.take_rows_from(from, &blob, Instant::now())?;
                continue;
            }
            let mut mr = self.pd.alloc_mr(blob.len(), Access::REMOTE_READ)?;
            mr.write_at(0, &blob);
            let (addr, rkey, len) = (mr.addr(), mr.rkey(), blob.len() as u64);
            if let Some(g) = self.sparse.stand_in.as_mut().and_then(|s| s.give.as_mut()) {
                g.out.push(mr);
            }
            self.summary.sparse_rows_out += rows[i];
            if let Err(why) = self.report(&ControlMsg::RowsOut { rank: self.rank, from, to, addr, rkey, len })? {
                eps_proto::say!(
                    "eps server {}: the control plane did not take lost server {from}'s rows for server {to}: {why}",
                    self.rank
                );
            }
        }
        Ok(())
    }
}
