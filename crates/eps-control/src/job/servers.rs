//! The job's servers: ready with their shards and tables, scaled in and
//! out (moves planned onto new ones and off leaving ones), released from a
//! move, retired once drained.

use eps_proto::control::{ControlMsg, ErrorCode, Order, Refusal, ShardEndpoint};
use eps_proto::shardmap::Move;
use eps_proto::spec::Consistency;

use super::{Job, Migration, Phase};

impl Job {
    pub(super) fn server_ready(&mut self, rank: u32, addr: &str, shards: &[ShardEndpoint]) -> Result<ControlMsg, Refusal> {
        let Some(info) = self.servers.get_mut(rank as usize) else {
            return Err(Refusal::stale(format!("server rank {rank} has not registered")));
        };
        for e in shards {
            let owner = self.map.index_of(e.shard).map(|i| self.map.shards[i].owner);
            if owner != Some(rank) || e.owner != rank || self.endpoints[e.shard as usize].is_some() {
                return Err(Refusal::stale(format!("server {rank} reported shard {} it does not own", e.shard)));
            }
        }
        info.addr = addr.to_string();
        info.ready = true;
        for e in shards {
            self.endpoints[e.shard as usize] = Some(e.clone());
        }
        // Backups reported before their primary was ready.
        for sid in 0..self.backups.len() {
            if self.endpoints[sid].as_ref().is_some_and(|e| e.owner == rank) {
                self.order_replicate(sid);
            }
        }
        if rank >= self.initial_servers && !self.map.servers.contains(&rank) {
            // A server added by a scale event: move shards onto it until balanced,
            // once no other migration is in flight (a plan made while shards are
            // moving would see their old owners and could move one twice).
            self.to_balance.push(rank);
            self.balance_next()?;
        }
        self.place_row_backups();
        Ok(ControlMsg::Ok)
    }

    /// Server `rank` reports its parts of the sparse tables (before it is
    /// ready): one endpoint per table, in the spec's order.
    pub(super) fn tables_ready(&mut self, rank: u32, tables: &[ShardEndpoint]) -> Result<ControlMsg, Refusal> {
        let Some(info) = self.servers.get(rank as usize) else {
            return Err(Refusal::stale(format!("server rank {rank} has not registered")));
        };
        if info.ready || self.tables.iter().any(|e| e.owner == rank) {
            return Err(Refusal::stale(format!("server {rank} reported its sparse tables twice, or after it was ready")));
        }
        let ranks = self.adopted.len();
        let fits = |(i, e): (usize, &ShardEndpoint)| e.shard == i as u32 && e.owner == rank && e.landing.len() == ranks;
        if tables.len() != self.table_count || !tables.iter().enumerate().all(fits) {
            return Err(Refusal::invalid(format!(
                "server {rank} reported {} sparse table parts; the job has {} tables",
                tables.len(),
                self.table_count
            )));
        }
        self.tables.extend_from_slice(tables);
        Ok(ControlMsg::Ok)
    }

    /// Whether server `rank` is serving (registered, not retired or finished).
    pub fn server_serving(&self, rank: u32) -> bool {
        self.servers.get(rank as usize).is_some_and(|s| s.ready && !s.retired && !s.finished)
    }

    /// Whether server `rank` was told to retire (scaled away holding nothing,
    /// or the job is over) and has not said it finished (nor was it lost).
    pub fn server_retiring(&self, rank: u32) -> bool {
        let r = self.servers.get(rank as usize);
        r.is_some_and(|s| s.retired && !s.finished) && !self.lost.contains(&rank)
    }

    /// Server `rank` is gone: its order poll dropped for good or its lease
    /// lapsed (a server polls until it has said it finished). The record to
    /// apply and persist, if any: a retiring server is counted finished (so
    /// that a job whose server died as it ended still ends); with replicas, a
    /// serving one is lost and its shards' backups take over.
    pub fn server_gone(&self, rank: u32) -> Option<ControlMsg> {
        let retiring = self.server_retiring(rank) && !eps_proto::mutants::active("dead-retiring-server-awaited");
        let lost = retiring || (self.replicated() && self.server_serving(rank) && !self.done());
        lost.then_some(ControlMsg::ServerLost { rank })
    }

    pub(crate) fn start_moves(&mut self, moves: &[Move]) {
        for mv in moves {
            let Some(i) = self.map.shard_of(mv.start) else { continue };
            let shard = self.map.shards[i].id;
            let waits = self.unreplicate_for_move(shard as usize, mv.from, mv.to);
            self.migrations.push(Migration {
                shard,
                from: mv.from,
                to: mv.to,
                phase: if waits { Phase::Unreplicating } else { Phase::Preparing },
                bytes: 0,
                millis: 0,
                target: None,
                cut_epoch: 0,
                landing_freed: false,
                release_ordered: false,
            });
            if !waits {
                self.order_migrate_in(self.migrations.len() - 1);
            }
        }
    }

    /// Orders migration `i`'s target to receive the shard.
    pub(super) fn order_migrate_in(&mut self, i: usize) {
        let m = &self.migrations[i];
        let (shard, from, to) = (m.shard, m.from, m.to);
        if let Some(x) = self.map.index_of(shard).map(|k| self.map.shards[k]) {
            self.order(to, Order::MigrateIn { shard, from, start: x.start, len: x.len });
            self.replicate_from_target(shard as usize, to);
        }
    }

    pub(super) fn scale(&mut self, want: u32) -> Result<ControlMsg, Refusal> {
        if want == 0 {
            return Err(Refusal::invalid("a job needs at least one server"));
        }
        let max = eps_proto::spec::MAX_SERVERS;
        if want > max {
            return Err(Refusal::new(ErrorCode::Limit, format!("{want} servers: a job has at most {max}")));
        }
        if !self.initial_ready() {
            return Err(Refusal::new(ErrorCode::Starting, crate::STILL_STARTING));
        }
        if self.w.proposal_id() != 0 {
            return Err(Refusal::new(ErrorCode::VoteInProgress, format!("{}; try again in a moment", crate::VOTE_IN_PROGRESS)));
        }
        let busy = self.migrations_in_flight()
            + usize::from(self.splitting.is_some())
            + self.to_balance.len()
            + usize::from(self.buckets_busy());
        let starting = self.servers.iter().filter(|s| !s.ready && !s.retired).count();
        if busy > 0 || starting > 0 {
            return Err(Refusal::new(
                ErrorCode::ChangeInProgress,
                format!(
                    "{} ({busy} migrations, splits or servers to balance, {starting} servers registered and starting); try again when `eps status` shows none",
                    crate::CHANGE_IN_PROGRESS,
                ),
            ));
        }
        // Slots that no server took since an earlier scale are given up: the
        // new count replaces the old (an operator who scaled up and started no
        // server is not stuck with it).
        let registered = self.servers.len() as u32;
        let live = self.live_servers();
        let now = live.len() as u32;
        if want > now {
            self.server_slots = registered + (want - now);
        } else if want < now {
            let gone: Vec<u32> = live[want as usize..].to_vec();
            let moves = self.map.plan_remove_many(&gone).map_err(|e| Refusal::invalid(e.to_string()))?;
            self.server_slots = registered;
            for &g in &gone {
                self.servers[g as usize].leaving = true;
                self.map.servers.retain(|&s| s != g);
                if !self.map.shards.iter().any(|s| s.owner == g) {
                    self.servers[g as usize].drained_at = self.map.epoch;
                }
            }
            self.start_moves(&moves);
            self.unreplicate_leaving(&gone);
            self.retire_drained();
        } else {
            self.server_slots = registered;
        }
        Ok(ControlMsg::Ok)
    }

    /// SSP/ASP: a source cut over keeps taking pushes (and forwarding them) until
    /// every worker routes with the cutover's epoch (a worker reports a new epoch
    /// only with no push in flight); then it is told to release.
    pub(super) fn release_async(&mut self) {
        if self.consistency == Consistency::Bsp {
            return;
        }
        for i in 0..self.migrations.len() {
            let m = &self.migrations[i];
            if !matches!(m.phase, Phase::CuttingOver { .. }) || m.release_ordered {
                continue;
            }
            let cut = m.cut_epoch;
            if !self.all_route_with(cut) {
                continue;
            }
            self.migrations[i].release_ordered = true;
            let (from, shard) = (self.migrations[i].from, self.migrations[i].shard);
            self.order(from, Order::Release { shard });
        }
    }

    /// Orders leaving servers that hold nothing, and that no worker routes to any
    /// more, to retire.
    pub(super) fn retire_drained(&mut self) {
        for r in 0..self.servers.len() {
            let s = &self.servers[r];
            if !s.leaving || s.retired {
                continue;
            }
            let holds = self.map.shards.iter().any(|x| x.owner == r as u32);
            let involved = self.migrations.iter().any(|m| m.in_flight() && (m.from == r as u32 || m.to == r as u32));
            let routed = !self.all_route_with(s.drained_at);
            if !holds && !involved && !routed && !self.keeps_backups(r as u32) && !self.holds_buckets(r as u32) {
                self.servers[r].retired = true;
                self.tables.retain(|e| e.owner != r as u32);
                self.order(r as u32, Order::Retire);
                self.server_retired(r as u32);
            }
        }
    }
}
