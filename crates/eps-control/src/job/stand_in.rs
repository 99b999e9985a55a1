//! Sparse tables after a loss (`job.replicas = 2`): the server that kept a
//! lost server's rows in step (`rows_backup_of`) serves that server's
//! buckets from its copy, as the lost server would have: a stand-in.
//!
//! The bucket maps keep naming the lost server; the job map says who stands
//! in for it (`JobMap::heirs`), and its table endpoints are the stand-in's
//! landing regions for those buckets. Workers send what the lost server had
//! not answered to the stand-in. A lost server without a backup of its rows
//! (none placed, or one that holds no whole copy yet, or one lost too) is
//! named with no heir: its rows are lost, and workers stop saying so. A lost
//! server that had given all its buckets away (a move it was the source of
//! is over) is named its own heir: nothing of it is to be taken over.
//!
//! Once it serves them, the lost server's buckets move to the stand-in
//! (`maybe_move_buckets` proposes the map, voted as any bucket move): at the
//! cutover the stand-in takes the rows of its copy into its own parts and
//! reports them taken. From then on they are its own rows: backed up around
//! the ring again (`place_row_backups`), saved by checkpoints, moved by
//! later scale events. Until then they have no backup, and the stand-in
//! saves them for a BSP checkpoint in the lost server's place.

use std::fmt::Write as _;

use eps_proto::control::{ControlMsg, Order, Refusal, ShardEndpoint};

use super::Job;

impl Job {
    /// Server `rank` was lost: a stand-in is ordered for its rows, if it held
    /// any and they have a backup; the rows it stood in for, if it was a
    /// stand-in, are lost.
    pub(super) fn rows_lost(&mut self, rank: u32) {
        if self.table_count == 0 {
            return;
        }
        // The rows it stood in for are lost with it, unless they became its
        // own already (the bucket map no longer names their lost server, and
        // no move from it to this one is under way).
        let named = |x: u32| self.buckets.last().is_some_and(|(_, o)| o.contains(&x));
        let merging = |x: u32| self.bucket_move.as_ref().is_some_and(|m| m.pending.contains(&(x, rank)));
        let unmerged: Vec<u32> =
            self.heirs.iter().filter(|h| h.1 == Some(rank) && (named(h.0) || merging(h.0))).map(|h| h.0).collect();
        for h in &mut self.heirs {
            if unmerged.contains(&h.0) {
                h.1 = None;
            }
        }
        let (pending, rest): (Vec<_>, Vec<_>) = self.standing_in.iter().partition(|&&(_, to)| to == rank);
        self.standing_in = rest;
        self.heirs.extend(pending.into_iter().map(|(from, _)| (from, None)));
        if !self.holds_buckets(rank) {
            // Every row it held went to its targets, after it applied every
            // push it was sent: workers awaiting its credit of the last
            // push before the cutover await it no more.
            if self.buckets.ever_named(rank) && !self.heirs.iter().any(|h| h.0 == rank) {
                self.heirs.push((rank, Some(rank)));
            }
            return;
        }
        // A source's copy holds the rows it gives until their target's
        // backup has them: its stand-in gives them in its place. A target
        // reports rows taken once its backup has them (and serves nothing
        // past the cutover before): its stand-in takes in its place the
        // rows not reported, from their sources, which keep them until then.
        let (give, take): (Vec<u32>, Vec<u32>) = match self.bucket_move.as_mut() {
            Some(m) => {
                // (A READ from it fails: the target waits for the stand-in's.)
                m.reading.retain(|&(a, _)| a != rank);
                m.out.retain(|o| o.0.0 != rank);
                let give = m.pending.iter().filter(|&&(a, _)| a == rank).map(|&(_, b)| b).collect();
                (give, m.pending.iter().filter(|&&(_, b)| b == rank).map(|&(a, _)| a).collect())
            }
            None => (Vec::new(), Vec::new()),
        };
        match self.rows_backup_of(rank).filter(|&b| self.server_serving(b) && !self.lost.contains(&b)) {
            Some(b) => {
                self.standing_in.push((rank, b));
                self.order(b, Order::StandIn { from: rank, give, take });
            }
            None => self.heirs.push((rank, None)),
        }
    }

    /// Server `rank` stands in for lost server `from`: workers WRITE their
    /// requests for `from`'s buckets to `tables` (none: it had no whole copy,
    /// and the rows are lost).
    pub(super) fn stand_in_ready(&mut self, rank: u32, from: u32, tables: &[ShardEndpoint]) -> Result<ControlMsg, Refusal> {
        let Some(i) = self.standing_in.iter().position(|&p| p == (from, rank)) else {
            return Err(Refusal::stale(format!(
                "server {rank} reported standing in for server {from}, which it was not told to"
            )));
        };
        let ranks = self.adopted.len();
        let fits = |(i, e): (usize, &ShardEndpoint)| e.shard == i as u32 && e.owner == from && e.landing.len() == ranks;
        if !tables.is_empty() && (tables.len() != self.table_count || !tables.iter().enumerate().all(fits)) {
            return Err(Refusal::invalid(format!(
                "server {rank} reported {} sparse table parts standing in for server {from}; the job has {} tables",
                tables.len(),
                self.table_count
            )));
        }
        self.standing_in.remove(i);
        if tables.is_empty() {
            self.heirs.push((from, None));
        } else {
            self.tables.retain(|e| e.owner != from);
            self.tables.extend_from_slice(tables);
            self.heirs.push((from, Some(rank)));
            // The rows it awaited that are out already: READ by the stand-in.
            let sources: Vec<u32> =
                self.bucket_move.iter().flat_map(|m| m.pending.iter().filter(|p| p.1 == from).map(|p| p.0)).collect();
            for s in sources {
                self.fetch_rows(s, from);
            }
        }
        self.map.epoch += 1;
        Ok(ControlMsg::Ok)
    }

    /// `RowsBackedUp`: server `backup` holds a whole copy of server
    /// `rank`'s rows (ignored if it is no longer the one ordered).
    pub(super) fn rows_backed_up(&mut self, rank: u32, backup: u32) -> Result<ControlMsg, Refusal> {
        if self.rows_backup_of(rank) == Some(backup) {
            if self.rows_whole_on.len() <= rank as usize {
                self.rows_whole_on.resize(rank as usize + 1, None);
            }
            self.rows_whole_on[rank as usize] = Some(backup);
        }
        Ok(ControlMsg::Ok)
    }

    /// Servers that hold table rows, those of them whose rows are whole on
    /// their backup, and lost servers whose rows a stand-in still serves.
    pub fn rows_protection(&self) -> (u64, u64, u64) {
        let Some((_, owners)) = self.buckets.last().filter(|_| self.table_count > 0) else { return (0, 0, 0) };
        let mut holders: Vec<u32> = owners.clone();
        holders.sort_unstable();
        holders.dedup();
        let standing = holders.iter().filter(|r| self.lost.contains(r)).count() + self.standing_in.len();
        holders.retain(|r| !self.lost.contains(r));
        let whole = |r: u32| {
            self.rows_backup_of(r).is_some() && self.rows_whole_on.get(r as usize).copied().flatten() == self.rows_backup_of(r)
        };
        let protected = holders.iter().filter(|&&r| whole(r)).count();
        (holders.len() as u64, protected as u64, standing as u64)
    }

    /// The server serving lost server `rank`'s rows, if one does.
    pub(super) fn heir_of(&self, rank: u32) -> Option<u32> {
        self.heirs.iter().find(|h| h.0 == rank).and_then(|h| h.1)
    }

    /// The stand-ins' line of `eps status`.
    pub(super) fn stand_in_status(&self, t: &mut String) {
        // (A server that had given its rows away left none behind.)
        let heirs = self.heirs.iter().filter(|(from, to)| *to != Some(*from));
        let mut parts: Vec<String> = heirs
            .map(|(from, to)| match to {
                Some(b) => format!("server {from}'s by server {b}"),
                None => format!("server {from}'s lost"),
            })
            .collect();
        parts.extend(self.standing_in.iter().map(|(from, b)| format!("server {from}'s by server {b} (starting)")));
        if parts.is_empty() {
            return;
        }
        let _ = writeln!(
            t,
            "  rows of lost servers: {}; a stand-in keeps them without a backup until they become its own at a bucket move",
            parts.join(", ")
        );
    }
}
