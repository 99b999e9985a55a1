//! The job's state as `eps status` shows it.

use std::fmt::Write as _;

use super::{Job, Migration, Phase};

/// The states a server is counted in by [`Figures::servers`].
pub const SERVER_STATES: [&str; 5] = ["serving", "joining", "leaving", "retired", "lost"];

/// The job's figures, for the metrics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Figures {
    /// The shard map's epoch.
    pub epoch: u64,
    /// The furthest and the slowest training worker's iteration.
    pub iteration: u64,
    /// See `iteration`.
    pub slowest: u64,
    /// Workers contributing now.
    pub workers: u64,
    /// Worker membership changes committed.
    pub membership_changes: u64,
    /// Servers by state, in the order of [`SERVER_STATES`].
    pub servers: [u64; 5],
    /// Shard migrations in flight, and done (moves included).
    pub migrations_in_flight: u64,
    /// See `migrations_in_flight`.
    pub migrations_done: u64,
    /// Shard splits done.
    pub splits: u64,
    /// Parameter bytes placed on servers.
    pub bytes: u64,
    /// A shard is being split now.
    pub splitting: bool,
    /// A change of the workers is voted on, or admitted ranks have not
    /// registered yet.
    pub worker_change: bool,
    /// Sparse bucket moves done, and whether one is under way.
    pub bucket_moves: u64,
    /// See `bucket_moves`.
    pub buckets_moving: bool,
    /// Shards with a synced backup (with two replicas), of `shards`.
    pub protected: u64,
    /// Shards in the map.
    pub shards: u64,
    /// Servers that hold table rows; those whose rows are whole on their
    /// backup (with two replicas); lost servers whose rows a stand-in serves.
    pub row_holders: u64,
    /// See `row_holders`.
    pub row_holders_protected: u64,
    /// See `row_holders`.
    pub rows_standing_in: u64,
}

/// A shard move as `eps status --json` shows it: the latest finished ones
/// with their figures, then those in flight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoveRow {
    /// The shard.
    pub shard: u32,
    /// Source and target servers.
    pub from: u32,
    /// See `from`.
    pub to: u32,
    /// `dropping-backup`, `preparing`, `copying`, `cutover`, `done` or `cancelled`.
    pub phase: &'static str,
    /// The cutover iteration, once announced.
    pub at: Option<u64>,
    /// Done: bytes sent and milliseconds taken.
    pub bytes: u64,
    /// See `bytes`.
    pub millis: u64,
}

/// One worker rank as `eps status` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerRow {
    /// Its rank.
    pub rank: u32,
    /// contributing, admitted, finished, expired or left.
    pub state: &'static str,
    /// The first iteration it has not begun, as last reported.
    pub iteration: u64,
}

/// One server rank as `eps status` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerRow {
    /// Its rank.
    pub rank: u32,
    /// One of [`SERVER_STATES`].
    pub state: &'static str,
    /// Its data-plane address.
    pub addr: String,
    /// Dense shards it owns, and their bytes.
    pub shards: u64,
    /// See `shards`.
    pub bytes: u64,
}

impl Job {
    /// Every worker rank admitted so far.
    pub fn worker_rows(&self) -> Vec<WorkerRow> {
        (0..self.w.admitted())
            .map(|r| WorkerRow {
                rank: r,
                state: self.w.state(r),
                iteration: self.progress.get(r as usize).copied().unwrap_or(0),
            })
            .collect()
    }

    /// Every server rank registered so far.
    pub fn server_rows(&self) -> Vec<ServerRow> {
        let load = self.map.bytes_per_server();
        self.servers
            .iter()
            .enumerate()
            .map(|(r, s)| {
                let rank = r as u32;
                let i = if self.lost.contains(&rank) {
                    4
                } else if s.retired {
                    3
                } else if s.leaving {
                    2
                } else if s.ready {
                    0
                } else {
                    1
                };
                ServerRow {
                    rank,
                    state: SERVER_STATES[i],
                    addr: s.addr.clone(),
                    shards: self.map.shards.iter().filter(|x| x.owner == rank).count() as u64,
                    bytes: load.get(&rank).copied().unwrap_or(0),
                }
            })
            .collect()
    }

    /// The iterations of the workers training now.
    fn training_iterations(&self) -> Vec<u64> {
        (0..self.progress.len() as u32).filter(|&r| self.w.routes(r)).map(|r| self.progress[r as usize]).collect()
    }

    /// Its figures now.
    pub fn figures(&self) -> Figures {
        let training = self.training_iterations();
        let mut servers = [0; 5];
        for row in self.server_rows() {
            servers[SERVER_STATES.iter().position(|s| *s == row.state).expect("a known state")] += 1;
        }
        let done = self.migrations.iter().filter(|m| m.phase == Phase::Done).count() as u64 + self.moves_done;
        let (row_holders, row_holders_protected, rows_standing_in) = self.rows_protection();
        Figures {
            epoch: self.map.epoch,
            iteration: training.iter().copied().max().unwrap_or(0),
            slowest: training.iter().copied().min().unwrap_or(0),
            workers: self.w.members.latest().len() as u64,
            membership_changes: self.w.changes,
            servers,
            migrations_in_flight: self.migrations_in_flight() as u64,
            migrations_done: done,
            splits: self.splits,
            bytes: self.map.bytes_per_server().values().sum(),
            splitting: self.splitting.is_some(),
            worker_change: self.w.changing(),
            bucket_moves: self.bucket_moves,
            buckets_moving: self.bucket_move.is_some(),
            protected: self
                .map
                .shards
                .iter()
                .filter(|s| self.backups[s.id as usize].is_some() && !self.unsynced[s.id as usize])
                .count() as u64,
            shards: self.map.shards.len() as u64,
            row_holders,
            row_holders_protected,
            rows_standing_in,
        }
    }

    /// The latest 8 finished moves, then those in flight, in order.
    pub fn move_rows(&self) -> Vec<MoveRow> {
        let finished: Vec<&Migration> =
            self.recent_moves.iter().chain(self.migrations.iter().filter(|m| m.phase == Phase::Done)).collect();
        let flying = self.migrations.iter().filter(|m| m.in_flight());
        finished[finished.len().saturating_sub(8)..]
            .iter()
            .copied()
            .chain(flying)
            .map(|m| {
                let (phase, at) = match m.phase {
                    Phase::Unreplicating => ("dropping-backup", None),
                    Phase::Cancelled => ("cancelled", None),
                    Phase::Preparing => ("preparing", None),
                    Phase::Copying => ("copying", None),
                    Phase::CuttingOver { at } => ("cutover", Some(at)),
                    Phase::Done => ("done", None),
                };
                MoveRow { shard: m.shard, from: m.from, to: m.to, phase, at, bytes: m.bytes, millis: m.millis }
            })
            .collect()
    }

    /// Human-readable state for `eps status`.
    pub fn status(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(t, "epoch: {}", self.map.epoch);
        if self.awaiting {
            let _ = writeln!(t, "tensors: awaiting the first worker's declaration");
        }
        let training = self.training_iterations();
        if let (Some(lo), Some(hi)) = (training.iter().min(), training.iter().max()) {
            let _ = writeln!(t, "iteration: {hi} (slowest worker at {lo})");
        }
        self.w.status(&mut t);
        let ready = self.servers.iter().filter(|s| s.ready).count();
        let fs = self.servers.iter().filter(|s| s.finished).count();
        let _ = writeln!(t, "servers: {}/{} registered, {ready} ready, {fs} finished", self.servers.len(), self.server_slots);
        if self.replicated() {
            self.backups_status(&mut t);
        }
        self.buckets_status(&mut t);
        for row in self.server_rows() {
            let r = row.rank;
            // A lost server also counts the shards that were moving off it.
            let shards = row.shards as usize + self.lost_moving.iter().filter(|&&(s, _)| s == r).count();
            let mut ids: Vec<u32> = self.map.shards.iter().filter(|x| x.owner == r).map(|x| x.id).collect();
            ids.sort_unstable();
            let mut list: Vec<String> = ids.iter().take(32).map(u32::to_string).collect();
            if ids.len() > 32 {
                list.push("...".into());
            }
            let _ = writeln!(
                t,
                "  server {r}: {}, {shards} shards, {} bytes, {} [shards {}]",
                row.state,
                row.bytes,
                if row.addr.is_empty() { "-" } else { &row.addr },
                list.join(",")
            );
        }
        let done = self.migrations.iter().filter(|m| m.phase == Phase::Done).count() as u64 + self.moves_done;
        let cancelled = self.migrations.iter().filter(|m| m.phase == Phase::Cancelled).count() as u64 + self.moves_cancelled;
        let _ = write!(t, "migrations: {} in flight, {done} done", self.migrations_in_flight());
        let _ = if cancelled > 0 { writeln!(t, ", {cancelled} cancelled (a server at one end was lost)") } else { writeln!(t) };
        let _ = match &self.splitting {
            Some(o) => writeln!(t, "splits: {} done, shard {} splitting on server {}", self.splits, o.shard, o.owner),
            None => writeln!(t, "splits: {} done", self.splits),
        };
        // The most recent finished ones with their figures, then those in flight.
        let finished: Vec<&Migration> =
            self.recent_moves.iter().chain(self.migrations.iter().filter(|m| m.phase == Phase::Done)).collect();
        for m in &finished[finished.len().saturating_sub(8)..] {
            let _ = writeln!(t, "  shard {}: server {} -> {}: done, {} bytes in {} ms", m.shard, m.from, m.to, m.bytes, m.millis);
        }
        for m in self.migrations.iter().filter(|m| m.in_flight()) {
            let phase = match m.phase {
                Phase::Unreplicating => "dropping its backup".to_string(),
                Phase::Cancelled => "cancelled".to_string(),
                Phase::Preparing => "preparing".to_string(),
                Phase::Copying => "copying".to_string(),
                Phase::CuttingOver { at } => format!("cutover at iteration {at}"),
                Phase::Done => "done".to_string(),
            };
            let _ = writeln!(t, "  shard {}: server {} -> {}: {phase}", m.shard, m.from, m.to);
        }
        t.truncate(t.trim_end().len());
        t
    }
}
