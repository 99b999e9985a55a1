//! The buckets of sparse tables over a job's life: which server owns each,
//! from which iteration on, and their moves after a scale event.
//!
//! A move is decided like a membership change (see `workers.rs`): every
//! worker and server votes the first iteration it has not begun or
//! aggregated and holds there, and the new map is committed at the largest
//! vote, `T`. No worker has then pushed `T` by the old map, so none of a
//! sparse push's many buckets is ever answered "moved". Every server is
//! ordered `Buckets { at: T }`; a source takes the rows of the buckets it
//! gives away out once every push before `T` is applied (any consistency)
//! and reports where they wait (`RowsOut`); the control plane orders the
//! target to READ them (`FetchRows`), and the target, which held the
//! requests that need them meanwhile, reports them taken (`RowsTaken`),
//! after which the source frees them (`FreeRows`).
//!
//! Moves are planned one at a time, once no shard migration, split or vote
//! is in flight and every server has joined: after a scale-up, the added
//! servers get their share; after a scale-down, leaving servers give theirs
//! away (and retire only once their rows are taken and no worker routes by
//! a map that still names them).

use std::fmt::Write as _;

use eps_proto::buckets::{self, BUCKETS};
use eps_proto::control::{ControlMsg, Order, Refusal, RowsBackup};

use super::Job;

/// A bucket move committed and not finished.
#[derive(Clone, Debug)]
pub(crate) struct BucketMove {
    /// The cutover iteration.
    pub(crate) at: u64,
    /// `(source, target)` pairs whose rows are not taken yet.
    pub(crate) pending: Vec<(u32, u32)>,
    /// Of those, the pairs whose target was told to READ the rows: neither
    /// end retires until the READ is done, even when the job ends (the
    /// target's READ would fail on a source that exited).
    pub(crate) reading: Vec<(u32, u32)>,
    /// Where the rows of those pairs wait: the server holding them, and the
    /// blob (address, key, bytes); told again to a lost target's stand-in.
    pub(crate) out: Vec<((u32, u32), u32, Blob)>,
}

/// Rows taken out for a move: address, key and bytes.
pub(crate) type Blob = (u64, u32, u64);

/// The bucket maps by first iteration, each kept as runs (the history grows
/// with every move, and a loss makes one), the newest one also whole.
#[derive(Debug)]
pub(super) struct BucketHistory {
    runs: Vec<(u64, buckets::Runs)>,
    last: Vec<u32>,
}

impl BucketHistory {
    pub(super) fn new(owners: Vec<u32>) -> Self {
        Self { runs: vec![(0, buckets::runs(&owners))], last: owners }
    }

    /// The newest map: its first iteration and each bucket's owner.
    pub(super) fn last(&self) -> Option<(u64, &Vec<u32>)> {
        self.runs.last().map(|(at, _)| (*at, &self.last))
    }

    pub(super) fn push(&mut self, at: u64, owners: Vec<u32>) {
        self.runs.push((at, buckets::runs(&owners)));
        self.last = owners;
    }

    /// Whether any map names server `rank`.
    pub(super) fn ever_named(&self, rank: u32) -> bool {
        self.runs.iter().any(|(_, r)| r.iter().any(|&(_, o)| o == rank))
    }
}

impl Job {
    /// The bucket maps by first iteration, as the job map carries them.
    pub(super) fn bucket_runs(&self) -> Vec<(u64, buckets::Runs)> {
        if self.table_count == 0 {
            return Vec::new();
        }
        self.buckets.runs.clone()
    }

    /// Whether server `rank` owns buckets or is at one end of a bucket move.
    pub(super) fn holds_buckets(&self, rank: u32) -> bool {
        let owns = self.buckets.last().is_some_and(|(_, o)| o.contains(&rank));
        let moving = self.bucket_move.as_ref().is_some_and(|m| m.pending.iter().any(|&(a, b)| a == rank || b == rank));
        self.table_count > 0 && (owns || moving)
    }

    /// Whether a bucket move is voted on or under way.
    pub(super) fn buckets_busy(&self) -> bool {
        self.bucket_move.is_some() || self.w.proposal.as_ref().is_some_and(|p| p.buckets.is_some())
    }

    /// Proposes the next bucket move, if one is due and nothing else moves.
    pub(super) fn maybe_move_buckets(&mut self) {
        if self.table_count == 0 || self.buckets_busy() || self.w.proposal.is_some() || self.awaiting {
            return;
        }
        let joining = self.servers.len() as u32 != self.server_slots || self.servers.iter().any(|s| !s.ready && !s.retired);
        let moving = self.migrations_in_flight() > 0 || self.splitting.is_some() || !self.to_balance.is_empty();
        if joining || moving || !self.initial_ready() || self.w.all_finished() {
            return;
        }
        let has_tables = |r: u32| self.tables.iter().filter(|e| e.owner == r).count() == self.table_count;
        let eligible: Vec<u32> = self.live_servers().into_iter().filter(|&r| has_tables(r) && !self.lost.contains(&r)).collect();
        let Some((_, now)) = self.buckets.last() else { return };
        if now.iter().any(|r| self.lost.contains(r)) {
            // A lost server's buckets go to its stand-in, which holds their
            // rows, once it serves them (see `stand_in.rs`); lost rows stay
            // lost, and nothing else moves.
            let want: Option<Vec<u32>> =
                now.iter().map(|&r| if self.lost.contains(&r) { self.heir_of(r) } else { Some(r) }).collect();
            if let Some(want) = want {
                let members = self.w.members.latest().to_vec();
                self.propose(members, Vec::new(), Some(want));
            }
            return;
        }
        let want = buckets::rebalance(now, &eligible);
        if want != *now {
            let members = self.w.members.latest().to_vec();
            self.propose(members, Vec::new(), Some(want));
        }
    }

    /// The vote on a bucket move is over: from `hold` (or the iteration after
    /// the last map's) on, `owners` own the buckets.
    pub(super) fn commit_buckets(&mut self, hold: u64, owners: Vec<u32>) {
        let Some((last_at, old)) = self.buckets.last().map(|(a, o)| (a, o.clone())) else { return };
        let at = hold.max(last_at + 1);
        let pending = buckets::transfers(&old, &owners);
        let runs = buckets::runs(&owners);
        for r in self.unretired_servers() {
            self.order(r, Order::Buckets { at, runs: runs.clone() });
        }
        let gave_all: Vec<u32> = old.iter().copied().filter(|r| !owners.contains(r)).collect();
        self.buckets.push(at, owners);
        // (The caller moves the epoch on: servers that gave all their
        // buckets away are drained from it, once they hold no shard either.)
        for r in gave_all {
            if !self.map.shards.iter().any(|x| x.owner == r)
                && let Some(s) = self.servers.get_mut(r as usize)
            {
                s.drained_at = self.map.epoch + 1;
            }
        }
        self.bucket_move = (!pending.is_empty()).then_some(BucketMove { at, pending, reading: Vec::new(), out: Vec::new() });
    }

    /// `RowsOut`: the rows server `from` gives server `to` wait for it on
    /// server `rank` (`from`, or the stand-in serving its rows) at `blob`
    /// (address, key, bytes); `to` (or the stand-in serving its rows, once
    /// it serves them) is told to READ them.
    pub(super) fn rows_out(&mut self, rank: u32, from: u32, to: u32, blob: (u64, u32, u64)) -> Result<ControlMsg, Refusal> {
        let holder = rank == from || self.heir_of(from) == Some(rank);
        let Some(m) = self.bucket_move.as_mut().filter(|m| m.pending.contains(&(from, to)) && holder) else {
            return Err(Refusal::stale(format!(
                "no bucket move from server {from} to server {to} is under way on server {rank}"
            )));
        };
        m.reading.push((from, to));
        m.out.retain(|o| o.0 != (from, to));
        m.out.push(((from, to), rank, blob));
        let (at, len) = (m.at, blob.2);
        self.fetch_rows(from, to);
        let on = if rank == from { String::new() } else { format!(" on server {rank}, its stand-in,") };
        eps_proto::say!("eps control: the rows server {from} gives server {to} at iteration {at} wait{on} ({len} bytes)");
        Ok(ControlMsg::Ok)
    }

    /// Orders the reader of the rows server `from` gives server `to`, if
    /// they are out: `to`, or the stand-in serving its rows if it was lost
    /// (none yet: it is told once it serves them, see `stand_in_ready`).
    pub(super) fn fetch_rows(&mut self, from: u32, to: u32) {
        let Some(&(_, via, (addr, rkey, len))) = self.bucket_move.as_ref().and_then(|m| m.out.iter().find(|o| o.0 == (from, to)))
        else {
            return;
        };
        let reader = if self.lost.contains(&to) { self.heir_of(to).filter(|&h| h != to) } else { Some(to) };
        let Some(reader) = reader else { return };
        let from_addr = self.servers.get(via as usize).map(|s| s.addr.clone()).unwrap_or_default();
        self.order(reader, Order::FetchRows { from, to, via, from_addr, addr, rkey, len });
    }

    /// `RowsTaken`: server `rank` took the rows server `from` gave server
    /// `to` (itself, or the lost server it stands in for).
    pub(super) fn rows_taken(&mut self, rank: u32, from: u32, to: u32) -> Result<ControlMsg, Refusal> {
        let reader = rank == to || (self.lost.contains(&to) && self.heir_of(to) == Some(rank));
        let Some(m) = self.bucket_move.as_mut().filter(|m| m.pending.contains(&(from, to)) && reader) else {
            return Err(Refusal::stale(format!(
                "no bucket move from server {from} to server {to} is under way on server {rank}"
            )));
        };
        m.pending.retain(|&p| p != (from, to));
        m.reading.retain(|&p| p != (from, to));
        m.out.retain(|o| o.0 != (from, to));
        if m.pending.is_empty() {
            self.bucket_move = None;
            self.bucket_moves += 1;
            self.place_row_backups();
        }
        if !self.lost.contains(&from) {
            // (A lost server's rows came from its stand-in's copy.)
            self.order(from, Order::FreeRows { to });
        }
        self.retire_drained();
        // A job that ended meanwhile retires them now.
        self.end_if_over();
        Ok(ControlMsg::Ok)
    }

    /// With replicas: every server that owns buckets keeps its rows in step
    /// on the next one (in rank order), once all are ready and no bucket
    /// moves; those whose backup changed are ordered so (a new backup starts
    /// from every row), and those that own none now stop forwarding.
    pub(super) fn place_row_backups(&mut self) {
        if self.replicas < 2 || self.table_count == 0 || self.bucket_move.is_some() {
            return;
        }
        let Some((_, owners)) = self.buckets.last() else { return };
        let mut holders = owners.clone();
        holders.sort_unstable();
        holders.dedup();
        holders.retain(|&r| !self.lost.contains(&r));
        let reported = |r: u32| self.tables.iter().filter(|e| e.owner == r).count() == self.table_count;
        if !holders.iter().all(|&r| self.servers.get(r as usize).is_some_and(|s| s.ready) && reported(r)) {
            return;
        }
        let n = holders.len();
        let mut want: Vec<(u32, Option<u32>)> =
            holders.iter().enumerate().map(|(i, &r)| (r, (n > 1).then(|| holders[(i + 1) % n]))).collect();
        // Those that own no bucket now forward to no one.
        for r in 0..self.row_backups.len() as u32 {
            if !holders.contains(&r) && self.server_serving(r) {
                want.push((r, None));
            }
        }
        for (r, to) in want {
            if self.row_backups.len() <= r as usize {
                self.row_backups.resize(r as usize + 1, None);
            }
            if self.row_backups[r as usize] == to {
                continue;
            }
            self.row_backups[r as usize] = to;
            // (A new backup starts from every row: whole once it says so.)
            if let Some(w) = self.rows_whole_on.get_mut(r as usize) {
                *w = None;
            }
            let to = to.map(|b| {
                let mut inbox: Vec<_> =
                    self.tables.iter().filter(|e| e.owner == b).map(|e| (e.shard, e.published_addr, e.published_rkey)).collect();
                inbox.sort_unstable();
                let addr = self.servers[b as usize].addr.clone();
                RowsBackup { rank: b, addr, inbox: inbox.into_iter().map(|(_, a, k)| (a, k)).collect() }
            });
            eps_proto::say!(
                "eps control: server {r} keeps its table rows in step on {}",
                to.as_ref().map_or("no server".to_string(), |b| format!("server {}", b.rank))
            );
            self.order(r, Order::BackupRows { to });
        }
    }

    /// The server that keeps server `rank`'s table rows in step, if any.
    pub fn rows_backup_of(&self, rank: u32) -> Option<u32> {
        self.row_backups.get(rank as usize).copied().flatten()
    }

    /// Whether server `rank` is at one end of a READ of rows (see
    /// [`BucketMove::reading`]).
    pub(super) fn reading_rows(&self, rank: u32) -> bool {
        if eps_proto::mutants::active("job-end-retires-mid-read") {
            return false;
        }
        let lost = |r: u32| self.lost.contains(&r);
        // (A lost target's rows are READ by its stand-in.)
        let reader = |b: u32| if lost(b) { self.heir_of(b).filter(|&h| h != b && !lost(h)) } else { Some(b) };
        self.bucket_move
            .as_ref()
            .is_some_and(|m| m.reading.iter().any(|&(a, b)| !lost(a) && reader(b).is_some_and(|r| a == rank || r == rank)))
    }

    /// The buckets' lines of `eps status`.
    pub(super) fn buckets_status(&self, t: &mut String) {
        let Some((at, owners)) = self.buckets.last().filter(|_| self.table_count > 0) else { return };
        let mut held: Vec<(u32, usize)> = Vec::new();
        for &o in owners {
            match held.iter_mut().find(|(r, _)| *r == o) {
                Some(h) => h.1 += 1,
                None => held.push((o, 1)),
            }
        }
        held.sort_unstable();
        let list: Vec<String> = held.iter().map(|(r, n)| format!("server {r}: {n}")).collect();
        let _ =
            writeln!(t, "sparse buckets ({BUCKETS}) from iteration {at}: {}; {} moves done", list.join(", "), self.bucket_moves);
        if let Some(m) = &self.bucket_move {
            let _ = writeln!(t, "  moving at iteration {}: rows not taken yet {:?} (source, target)", m.at, m.pending);
        }
        if self.replicas > 1 {
            let pairs: Vec<String> = (0..self.row_backups.len() as u32)
                .filter_map(|r| self.rows_backup_of(r).map(|b| format!("{r} -> {b}")))
                .collect();
            let kept = if pairs.is_empty() { "none yet".to_string() } else { pairs.join(", ") };
            let _ = writeln!(t, "  rows kept in step on (server -> backup): {kept}");
            self.stand_in_status(t);
        }
    }
}
