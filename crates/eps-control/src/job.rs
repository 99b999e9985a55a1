//! The state of one job as the control plane keeps it, free of I/O: membership,
//! the shard map under its epoch, shard endpoints, scale events and the migrations
//! they plan, and the orders each server is given. Every state change is a
//! [`ControlMsg`] record, so replaying the store's records rebuilds the same state
//! (orders included, with the same sequence numbers).

use eps_proto::JobSpec;
use eps_proto::control::{ControlMsg, ErrorCode, MigrationKeys, Order, Refusal, Role, ShardEndpoint};
use eps_proto::declare::TensorDecl;
use eps_proto::layout::Layout;
use eps_proto::shardmap::ShardMap;
use eps_proto::spec::Consistency;

mod buckets;
mod moves;
mod replicas;
mod routing;
mod servers;
mod split;
mod stand_in;
mod status;
pub use status::{Figures, SERVER_STATES, ServerRow, WorkerRow};
mod workers;

#[cfg(test)]
mod tests;

pub use split::Span;

/// Phase of one shard migration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The owner stops forwarding to the shard's backup (which then goes; a
    /// new one is built after the move).
    Unreplicating,
    /// The target registers memory.
    Preparing,
    /// The source sends the snapshot and forwards updates.
    Copying,
    /// Pushes from iteration `at` on go to the target; the source still serves
    /// versions up to `at`.
    CuttingOver {
        /// The cutover iteration.
        at: u64,
    },
    /// The source released the shard.
    Done,
    /// Stopped: a server at one end was lost.
    Cancelled,
}

/// One shard migration.
#[derive(Clone, Debug)]
pub struct Migration {
    /// Global shard id.
    pub shard: u32,
    /// Source server.
    pub from: u32,
    /// Target server.
    pub to: u32,
    /// Phase.
    pub phase: Phase,
    /// Bytes sent (known once done).
    pub bytes: u64,
    /// Duration from order to release (known once done).
    pub millis: u64,
    target: Option<(ShardEndpoint, MigrationKeys)>,
    /// SSP/ASP: the epoch of the cutover, and whether the source was told to
    /// release (once every worker routes with that epoch).
    cut_epoch: u64,
    release_ordered: bool,
    /// Done, and the source told it may free the shard's landing slots.
    landing_freed: bool,
}

impl Migration {
    /// Neither done nor cancelled.
    pub fn in_flight(&self) -> bool {
        !matches!(self.phase, Phase::Done | Phase::Cancelled)
    }
}

#[derive(Clone, Debug, Default)]
struct ServerInfo {
    addr: String,
    ready: bool,
    finished: bool,
    /// Scaled away: leaves once it holds nothing and no worker routes to it.
    leaving: bool,
    retired: bool,
    /// Epoch in which its last shard moved away.
    drained_at: u64,
}

/// Finished migrations `eps status` shows.
const RECENT_MOVES: usize = 8;
/// Ids of resendable changes remembered to tell a re-send from a new request
/// ([`ControlMsg::Once`]): more than a job's peers send between a dropped
/// connection and their re-send.
const RECENT_CHANGES: usize = 1024;

/// The job state.
#[derive(Debug)]
pub struct Job {
    spec_text: String,
    /// The workers declare the tensors and none has yet (no layout).
    awaiting: bool,
    consistency: Consistency,
    initial_servers: u32,
    /// How many servers may register so far (grows with scale-ups).
    server_slots: u32,
    servers: Vec<ServerInfo>,
    /// Worker state by rank (see `workers.rs`).
    pub(crate) w: workers::Workers,
    /// The epoch each worker routes with (reported, not persisted).
    adopted: Vec<u64>,
    /// The first iteration each worker has not begun (reported, not persisted).
    progress: Vec<u64>,
    map: ShardMap,
    endpoints: Vec<Option<ShardEndpoint>>,
    previous: Vec<Option<(ShardEndpoint, u64)>>,
    /// Migrations in flight, and done ones whose source still keeps the
    /// shard's landing slots (see `prune_migrations`).
    migrations: Vec<Migration>,
    /// Migrations finished and forgotten: done, cancelled, and the last few
    /// done (for `eps status`).
    moves_done: u64,
    moves_cancelled: u64,
    recent_moves: std::collections::VecDeque<Migration>,
    /// The ids of the latest `Once` changes applied (replayed ones
    /// included), to answer a re-send with `AlreadyApplied`.
    recent_changes: std::collections::VecDeque<(u64, u64)>,
    /// By server rank: its orders it has not polled past yet, with their
    /// numbers (not persisted: a replay issues them all again, with the same
    /// numbers).
    orders: Vec<std::collections::VecDeque<(u64, Order)>>,
    /// Orders issued so far (the number of the last one).
    issued: u64,
    /// Added servers ready for their share of shards, planned one at a time.
    to_balance: Vec<u32>,
    /// By shard id: its elements and the iterations it is used in.
    spans: Vec<Span>,
    /// A split ordered and not reported yet.
    splitting: Option<split::Ordered>,
    /// The plan of the server being balanced.
    balancing: Option<split::Balancing>,
    /// Splits done so far.
    splits: u64,
    /// Most live shards (splits stop there).
    shard_cap: usize,
    /// The first iteration: 0, or the checkpoint's a resumed job starts from.
    start: u64,
    /// Optimizer state values per element (what a checkpoint's pieces hold).
    state_k: u32,
    /// Copies of each shard (`job.replicas`).
    replicas: u32,
    /// By shard id: its backup (server, endpoint, forward keys), while it has one.
    backups: Vec<Option<(u32, ShardEndpoint, MigrationKeys)>>,
    /// Servers lost (their backups promoted).
    lost: Vec<u32>,
    /// By shard id: the server ordered to keep a new backup (it starts from a
    /// snapshot), until it reports it.
    rebuilding: Vec<Option<u32>>,
    /// A new backup whose snapshot has not landed: it holds nothing yet and
    /// is not promoted.
    unsynced: Vec<bool>,
    /// Shards lost in a move whose source was lost after the cutover, with
    /// that source's rank.
    lost_moving: Vec<(u32, u32)>,
    /// Sparse tables the spec declares.
    table_count: usize,
    /// Per server and table: the workers' landing regions.
    tables: Vec<ShardEndpoint>,
    /// Every initial server reported its tables (latched: scale-downs
    /// retire some later).
    tables_started: bool,
    /// Sparse tables: the bucket maps by first iteration (see `buckets.rs`).
    buckets: buckets::BucketHistory,
    /// The bucket move committed and not finished.
    bucket_move: Option<buckets::BucketMove>,
    /// Bucket moves finished.
    bucket_moves: u64,
    /// By server rank: the server its table rows are backed up on, as last
    /// ordered (`job.replicas = 2`).
    row_backups: Vec<Option<u32>>,
    /// Sparse tables: lost servers that held rows, and who serves them (see
    /// `stand_in.rs`).
    heirs: Vec<(u32, Option<u32>)>,
    /// Stand-ins ordered and not reported yet: (lost server, stand-in).
    standing_in: Vec<(u32, u32)>,
    /// By server rank: the backup that reported a whole copy of its rows
    /// (`RowsBackedUp`), while it is still the one ordered.
    rows_whole_on: Vec<Option<u32>>,
}

impl Job {
    /// A job at its start: nobody registered yet. A spec whose workers declare
    /// the tensors (`model.declare`) has no layout until the first declaration.
    pub fn new(spec: &JobSpec, spec_text: &str) -> Result<Self, String> {
        let awaiting = spec.awaits_declaration();
        let layout = if awaiting {
            let dtype = spec.dtype().map_err(|e| e.to_string())?;
            Layout { dtype, tensors: Vec::new(), total: 0, shards: Vec::new(), servers: spec.job.servers }
        } else {
            spec.layout().map_err(|e| e.to_string())?
        };
        let mut job = Self {
            spec_text: spec_text.to_string(),
            awaiting,
            consistency: spec.job.consistency,
            initial_servers: spec.job.servers,
            server_slots: spec.job.servers,
            servers: Vec::new(),
            w: workers::Workers::new(&spec.job)?,
            adopted: vec![0; spec.job.rank_limit() as usize],
            progress: vec![0; spec.job.rank_limit() as usize],
            map: ShardMap::from_layout(&layout),
            endpoints: Vec::new(),
            previous: Vec::new(),
            migrations: Vec::new(),
            moves_done: 0,
            moves_cancelled: 0,
            recent_moves: Default::default(),
            recent_changes: Default::default(),
            orders: Vec::new(),
            issued: 0,
            to_balance: Vec::new(),
            spans: Vec::new(),
            splitting: None,
            balancing: None,
            splits: 0,
            shard_cap: 0,
            start: 0,
            state_k: spec.optimizer().map_err(|e| e.to_string())?.state_per_param() as u32,
            replicas: spec.job.replicas,
            backups: Vec::new(),
            lost: Vec::new(),
            rebuilding: Vec::new(),
            lost_moving: Vec::new(),
            unsynced: Vec::new(),
            table_count: spec.model.tables.len(),
            tables: Vec::new(),
            tables_started: false,
            buckets: buckets::BucketHistory::new(eps_proto::buckets::initial_owners(spec.job.servers)),
            bucket_move: None,
            bucket_moves: 0,
            row_backups: Vec::new(),
            heirs: Vec::new(),
            standing_in: Vec::new(),
            rows_whole_on: Vec::new(),
        };
        job.set_layout(&layout);
        if let Some(r) = &spec.resume {
            // Samples are dealt out from where the checkpoint left them; from its
            // iteration on, the spec's workers (ranks 0..W) contribute.
            let before =
                eps_proto::membership::Membership::parse_text(&r.membership).ok_or("resume.membership does not parse")?;
            job.w.members = before.resumed_at(r.iteration, (0..spec.job.workers).collect());
            job.start = r.iteration;
            job.progress.fill(r.iteration);
        }
        Ok(job)
    }

    /// The shard map and everything sized by it, for `layout` at epoch 0.
    fn set_layout(&mut self, layout: &Layout) {
        let n = layout.shards.len();
        self.map = ShardMap::from_layout(layout);
        self.endpoints = vec![None; n];
        self.previous = vec![None; n];
        self.spans = layout.shards.iter().map(|s| Span { start: s.start, len: s.len, from: 0, until: u64::MAX }).collect();
        self.backups = vec![None; n];
        self.rebuilding = vec![None; n];
        self.unsynced = vec![false; n];
        self.shard_cap = eps_proto::layout::live_shard_cap(n);
    }

    /// Whether every initial server is ready (workers may start).
    pub fn initial_ready(&self) -> bool {
        !self.awaiting && self.endpoints.iter().all(Option::is_some) && (self.tables_started || self.tables_up())
    }

    /// Every initial server reported its tables and is ready.
    fn tables_up(&self) -> bool {
        let initial: Vec<&ShardEndpoint> = self.tables.iter().filter(|e| e.owner < self.initial_servers).collect();
        initial.len() == self.table_count * self.initial_servers as usize
            && initial.iter().all(|e| self.servers.get(e.owner as usize).is_some_and(|s| s.ready))
    }

    /// Whether the job's tensors are known (given by the spec, or declared by
    /// the first worker).
    pub fn layout_fixed(&self) -> bool {
        !self.awaiting
    }

    /// The job spec's text as it stands (with the declared tensors once fixed).
    pub fn spec_text(&self) -> &str {
        &self.spec_text
    }

    /// A worker's declaration: the first fixes the layout of a job that awaits
    /// one; any other must equal the job's tensors.
    fn declare(&mut self, decl: &[TensorDecl]) -> Result<ControlMsg, Refusal> {
        if self.awaiting {
            let text = eps_proto::declare::fix(&self.spec_text, decl)
                .map_err(|e| Refusal::invalid(format!("the declaration is refused: {e}")))?;
            let spec = JobSpec::from_toml(&text).map_err(|e| Refusal::invalid(e.to_string()))?;
            let layout = spec.layout().map_err(|e| Refusal::invalid(e.to_string()))?;
            self.set_layout(&layout);
            self.spec_text = text;
            self.awaiting = false;
        } else {
            eps_proto::declare::validate(decl).map_err(|e| Refusal::invalid(format!("the declaration is refused: {e}")))?;
            let spec = JobSpec::from_toml(&self.spec_text).map_err(|e| Refusal::invalid(e.to_string()))?;
            let dtype = spec.dtype().map_err(|e| Refusal::invalid(e.to_string()))?;
            if let Some(d) = eps_proto::declare::first_difference(&spec.tensors(), dtype, decl) {
                return Err(Refusal::new(ErrorCode::Mismatch, format!("this worker's tensors differ from the job's: {d}")));
            }
        }
        Ok(ControlMsg::Registered { rank: u32::MAX, spec_toml: self.spec_text.clone() })
    }

    /// Whether every worker and every server that joined has finished.
    pub fn done(&self) -> bool {
        let gone = |r: usize| self.servers[r].finished || self.lost.contains(&(r as u32));
        self.w.all_finished() && (0..self.servers.len()).all(gone) && !self.servers.is_empty()
    }

    /// Worker ranks whose lease the control plane watches.
    pub fn leased_workers(&self) -> Vec<u32> {
        self.w.leased()
    }

    /// Worker ranks a scale admitted that have not registered yet (each has
    /// the join deadline to).
    pub fn awaited_workers(&self) -> Vec<u32> {
        self.w.awaited()
    }

    /// Committed worker membership changes so far.
    pub fn membership_changes(&self) -> u64 {
        self.w.changes
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.map.epoch
    }

    /// Number of orders issued so far (the sequence number of the last one).
    pub fn orders_issued(&self) -> u64 {
        self.issued
    }

    /// Orders for server `rank` after sequence number `after`, and the last number.
    pub fn orders_for(&self, rank: u32, after: u64) -> (u64, Vec<Order>) {
        let q = self.orders.get(rank as usize);
        let mine = q.into_iter().flatten().filter(|(n, _)| *n > after).map(|(_, o)| o.clone()).collect();
        (self.issued, mine)
    }

    /// Server `rank` polls after order `after`: it carried out every order up
    /// to that one, and they are dropped (a long job's orders do not pile
    /// up). Returns how many of its orders are kept.
    pub fn orders_polled(&mut self, rank: u32, after: u64) -> usize {
        let Some(q) = self.orders.get_mut(rank as usize) else { return 0 };
        while q.front().is_some_and(|(n, _)| *n <= after) {
            q.pop_front();
        }
        q.len()
    }

    /// What a checkpoint at `version` records of the job: its manifest but for
    /// the pieces.
    pub fn checkpoint_record(&self, version: u64) -> eps_proto::checkpoint::Manifest {
        let spec = JobSpec::set_resume(&self.spec_text, None).unwrap_or_else(|_| self.spec_text.clone());
        eps_proto::checkpoint::Manifest {
            format: eps_proto::checkpoint::FORMAT,
            version,
            epoch: self.map.epoch,
            servers: self.live_servers().len() as u32,
            total: self.spans.iter().map(|s| s.start + s.len).max().unwrap_or(0),
            state_k: self.state_k,
            membership: self.w.members.resumed_at(version, Vec::new()).to_text(),
            spec,
            pieces: Vec::new(),
            tables: self.table_count as u32,
            rows: Vec::new(),
        }
    }

    /// Migrations that are not done.
    pub fn migrations_in_flight(&self) -> usize {
        self.migrations.iter().filter(|m| m.in_flight()).count()
    }

    /// Migrations in flight, and done ones not yet forgotten.
    pub fn migrations(&self) -> &[Migration] {
        &self.migrations
    }

    pub(crate) fn order(&mut self, rank: u32, o: Order) {
        self.issued += 1;
        let r = rank as usize;
        if self.lost.contains(&rank) {
            return; // fenced off: it polls no more orders
        }
        if self.orders.len() <= r {
            self.orders.resize_with(r + 1, Default::default);
        }
        if o == Order::Retire {
            // A server that leaves holds nothing: what it has not polled yet
            // no longer matters. (A server that is gone never polls past its
            // last orders: they would stay for the job's life, and a replay
            // would queue its whole history again.)
            self.orders[r].clear();
        }
        self.orders[r].push_back((self.issued, o));
    }

    /// Server `rank` is lost: its orders go (it polls no more).
    pub(crate) fn drop_orders_of(&mut self, rank: u32) {
        if let Some(q) = self.orders.get_mut(rank as usize) {
            *q = std::collections::VecDeque::new();
        }
    }

    /// Servers that registered and have not retired (leaving ones included).
    pub(crate) fn unretired_servers(&self) -> Vec<u32> {
        (0..self.servers.len() as u32).filter(|&r| !self.servers[r as usize].retired).collect()
    }

    pub(crate) fn live_servers(&self) -> Vec<u32> {
        (0..self.servers.len() as u32)
            .filter(|&r| !self.servers[r as usize].leaving && !self.servers[r as usize].retired)
            .collect()
    }

    /// Applies one record (live or replayed) and returns the reply for a live
    /// request. Errors leave the state unchanged. Orders follow from records
    /// only, so a replay issues the same ones under the same sequence numbers.
    pub fn apply(&mut self, m: &ControlMsg) -> Result<ControlMsg, Refusal> {
        let id = match m {
            ControlMsg::Once { id, .. } => Some(*id),
            _ => None,
        };
        if let Some(id) = id
            && self.recent_changes.contains(&id)
        {
            return Err(Refusal::new(ErrorCode::AlreadyApplied, "this change was applied when it was first sent"));
        }
        let r = self.apply_record(m.change())?;
        if let Some(id) = id {
            if self.recent_changes.len() == RECENT_CHANGES {
                self.recent_changes.pop_front();
            }
            self.recent_changes.push_back(id);
        }
        // A record may let a source release or a drained server retire (a
        // worker that finished no longer holds it back).
        self.release_async();
        self.retire_drained();
        self.prune_migrations();
        self.tables_started = self.tables_started || self.tables_up();
        self.maybe_move_buckets();
        Ok(r)
    }

    /// Forgets the migrations nothing refers to any more (cancelled ones, and
    /// done ones whose source was told to free the landing slots), keeping
    /// counts and the last few: a long job's state does not grow with every
    /// scale event.
    fn prune_migrations(&mut self) {
        let finished = |m: &Migration| m.phase == Phase::Cancelled || (m.phase == Phase::Done && m.landing_freed);
        if !self.migrations.iter().any(finished) {
            return;
        }
        for m in std::mem::take(&mut self.migrations) {
            if !finished(&m) {
                self.migrations.push(m);
            } else if m.phase == Phase::Cancelled {
                self.moves_cancelled += 1;
            } else {
                self.moves_done += 1;
                if self.recent_moves.len() == RECENT_MOVES {
                    self.recent_moves.pop_front();
                }
                self.recent_moves.push_back(Migration { target: None, ..m });
            }
        }
        self.migrations.shrink_to(self.migrations.len().max(16));
    }

    fn apply_record(&mut self, m: &ControlMsg) -> Result<ControlMsg, Refusal> {
        match m {
            ControlMsg::Register { role: Role::Server, .. } => {
                if self.servers.len() as u32 >= self.server_slots {
                    return Err(Refusal::new(
                        ErrorCode::Full,
                        format!(
                            "the job already has its {} servers (raise the count with `eps scale --servers N` first)",
                            self.server_slots
                        ),
                    ));
                }
                self.servers.push(ServerInfo::default());
                let rank = self.servers.len() as u32 - 1;
                // A server that joins later learns the contributor sets so far,
                // and which workers each change removed for an expired lease.
                let start = self.start;
                let earlier: Vec<(u64, Vec<u32>)> =
                    self.w.members.epochs().iter().filter(|(at, _)| *at > start).cloned().collect();
                for (at, workers) in earlier {
                    let expired = self.w.lost.iter().filter(|&&(_, a)| a == at).map(|&(r, _)| r).collect();
                    self.order(rank, Order::Members { at, workers, expired });
                }
                // And the bucket maps after the first.
                for (at, runs) in self.bucket_runs().into_iter().skip(1) {
                    self.order(rank, Order::Buckets { at, runs });
                }
                Ok(ControlMsg::Registered { rank, spec_toml: self.spec_text.clone() })
            }
            ControlMsg::Register { role: Role::Worker, .. } => {
                let rank = self.w.register()?;
                Ok(ControlMsg::Registered { rank, spec_toml: self.spec_text.clone() })
            }
            ControlMsg::Declare { tensors } => self.declare(tensors),
            ControlMsg::ScaleWorkers { workers } => self.scale_workers(*workers),
            ControlMsg::Leave { rank } => self.leave(*rank),
            ControlMsg::Vote { role, rank, id, hold } => self.vote(*role, *rank, *id, *hold),
            ControlMsg::Expire { rank } => self.expire(*rank),
            ControlMsg::ServerReady { rank, fabric_addr, shards } => self.server_ready(*rank, fabric_addr, shards),
            ControlMsg::ShardReady { endpoint, keys } => {
                let Some(i) =
                    self.migration(endpoint.shard, Phase::Preparing).filter(|&i| self.migrations[i].to == endpoint.owner)
                else {
                    return Err(Refusal::stale(format!(
                        "no migration of shard {} to server {} is preparing",
                        endpoint.shard, endpoint.owner
                    )));
                };
                let mg = &mut self.migrations[i];
                mg.target = Some((endpoint.clone(), *keys));
                mg.phase = Phase::Copying;
                let (from, to, shard) = (mg.from, mg.to, mg.shard);
                let to_addr = self.servers[to as usize].addr.clone();
                self.order(from, Order::MigrateOut { shard, to, to_addr, keys: *keys });
                Ok(ControlMsg::Ok)
            }
            ControlMsg::Cutover { shard, at } => {
                let Some(i) = self.migration(*shard, Phase::Copying) else {
                    return Err(Refusal::stale(format!("shard {shard} is not being copied")));
                };
                let mg = &mut self.migrations[i];
                mg.phase = Phase::CuttingOver { at: *at };
                let (ep, _) = mg.target.clone().ok_or_else(|| Refusal::stale("the migration has no target endpoint"))?;
                let s = *shard as usize;
                self.previous[s] = self.endpoints[s].take().map(|old| (old, *at));
                self.endpoints[s] = Some(ep);
                let k = self.map.index_of(*shard).ok_or_else(|| Refusal::stale(format!("shard {shard} is not in the map")))?;
                self.map.shards[k].owner = self.migrations[i].to;
                self.map.epoch += 1;
                self.migrations[i].cut_epoch = self.map.epoch;
                let from = self.migrations[i].from as usize;
                if !self.map.shards.iter().any(|x| x.owner == from as u32) {
                    self.servers[from].drained_at = self.map.epoch;
                }
                self.release_async();
                Ok(ControlMsg::Ok)
            }
            ControlMsg::Released { shard, bytes, millis } => {
                let Some(i) = self.migration(*shard, Phase::CuttingOver { at: 0 }) else {
                    return Err(Refusal::stale(format!("shard {shard} is not cutting over")));
                };
                let mg = &mut self.migrations[i];
                (mg.phase, mg.bytes, mg.millis) = (Phase::Done, *bytes, *millis);
                self.previous[*shard as usize] = None;
                self.retire_drained();
                self.free_landings();
                self.balance_next()?;
                // The moved shard's new backup.
                self.rebuild_backups();
                Ok(ControlMsg::Ok)
            }
            ControlMsg::Split { shard, at, lo, hi } => self.split_done(*shard, *at, lo, hi),
            // As a record: the epoch a worker routes with (releases and
            // retirements follow from it).
            ControlMsg::GetMap { worker, adopted, .. } => {
                self.worker_adopted(*worker, *adopted);
                Ok(ControlMsg::Ok)
            }
            ControlMsg::BackupReady { endpoint, keys } => self.backup_ready(endpoint, keys),
            ControlMsg::BackupSynced { shard, rank } => {
                let sid = *shard as usize;
                let keeps = self.backups.get(sid).and_then(Option::as_ref).is_some_and(|(r, _, _)| r == rank);
                if sid >= self.unsynced.len() {
                    return Err(Refusal::invalid(format!(
                        "server {rank} reported a snapshot of shard {shard}, which does not exist"
                    )));
                }
                // (A backup dropped while its snapshot landed reports it late.)
                if keeps {
                    self.unsynced[sid] = false;
                }
                Ok(ControlMsg::Ok)
            }
            ControlMsg::Unreplicated { shard, rank } => self.unreplicated(*shard, *rank),
            ControlMsg::MoveStopped { shard, rank } => self.move_stopped(*shard, *rank),
            ControlMsg::TablesReady { rank, tables } => self.tables_ready(*rank, tables),
            ControlMsg::RowsOut { rank, from, to, addr, rkey, len } => self.rows_out(*rank, *from, *to, (*addr, *rkey, *len)),
            ControlMsg::RowsTaken { rank, from, to } => self.rows_taken(*rank, *from, *to),
            ControlMsg::StandInReady { rank, from, tables } => self.stand_in_ready(*rank, *from, tables),
            ControlMsg::RowsBackedUp { rank, backup } => self.rows_backed_up(*rank, *backup),
            ControlMsg::ServerLost { rank } => self.server_lost(*rank),
            ControlMsg::Checkpoint { version, dir } => {
                if *version == 0 || dir.is_empty() {
                    return Err(Refusal::invalid("a checkpoint needs a version and a directory"));
                }
                for r in self.unretired_servers() {
                    self.order(r, Order::Checkpoint { version: *version, dir: dir.clone() });
                }
                Ok(ControlMsg::Ok)
            }
            ControlMsg::Scale { servers } => self.scale(*servers),
            ControlMsg::Finished { role, rank } => {
                match role {
                    Role::Server => {
                        let Some(s) = self.servers.get_mut(*rank as usize) else {
                            return Err(Refusal::invalid(format!("server rank {rank} is outside the job")));
                        };
                        s.finished = true;
                    }
                    Role::Worker => self.worker_finished(*rank)?,
                }
                if *role == Role::Worker {
                    self.end_if_over();
                }
                Ok(ControlMsg::Ok)
            }
            _ => Err(Refusal::new(ErrorCode::Unexpected, "not a state change")),
        }
    }

    /// Once every worker finished (or was removed), the job is over: every
    /// server leaves.
    pub(crate) fn end_if_over(&mut self) {
        if !self.w.all_finished() {
            return;
        }
        for r in 0..self.servers.len() {
            // (Not while rows are READ from or into it: `rows_taken` ends it.)
            if !self.servers[r].retired && !self.reading_rows(r as u32) {
                self.servers[r].retired = true;
                self.order(r as u32, Order::Retire);
            }
        }
    }

    /// Index of the latest migration of `shard` in `phase` (any cutover iteration
    /// for `CuttingOver`).
    fn migration(&self, shard: u32, phase: Phase) -> Option<usize> {
        self.migrations.iter().rposition(|m| {
            m.shard == shard
                && match (m.phase, phase) {
                    (Phase::CuttingOver { .. }, Phase::CuttingOver { .. }) => true,
                    (a, b) => a == b,
                }
        })
    }
}
