//! What workers route by: the map they are given, the epochs they report
//! routing with (which release moves' sources and their landing slots), and
//! how far they got.

use eps_proto::control::{ControlMsg, JobMap, Order, Route, ShardEndpoint};

use super::{Job, Phase};

impl Job {
    /// The map as workers see it.
    pub fn job_map(&self) -> JobMap {
        let routes = self
            .endpoints
            .iter()
            .zip(&self.previous)
            .zip(&self.spans)
            .map(|((e, p), g)| Route {
                owner: e.clone().unwrap_or_else(empty_endpoint),
                previous: p.clone(),
                start: g.start,
                len: g.len,
                from: g.from,
                until: g.until,
            })
            .collect();
        // A lost server is left out: workers still waiting on it take that as
        // the loss (it may be stopped, its connections open). One that still
        // owns shards (their backups were lost too) stays: nobody else has them.
        let owns = |r: u32| self.map.shards.iter().any(|x| x.owner == r);
        let servers = self
            .servers
            .iter()
            .enumerate()
            .filter(|(r, s)| s.ready && (!self.lost.contains(&(*r as u32)) || owns(*r as u32)))
            .map(|(r, s)| (r as u32, s.addr.clone()))
            .collect();
        JobMap {
            epoch: self.map.epoch,
            servers,
            routes,
            membership: self.w.members.epochs().to_vec(),
            proposal: self.w.proposal_id(),
            tables: self.tables.clone(),
            buckets: self.bucket_runs(),
            heirs: self.heirs.clone(),
        }
    }

    /// Worker `worker` reports (in a map request) the epoch it routes with.
    /// A newer one than it reported is a state change (releases, retirements
    /// and freed landing slots follow from it, as orders): it is applied, and
    /// the record to persist for it is returned; an older or equal one
    /// changes nothing.
    pub fn adopt(&mut self, worker: u32, epoch: u64) -> Option<ControlMsg> {
        if self.adopted.get(worker as usize).is_none_or(|&a| epoch <= a) {
            return None;
        }
        let record = ControlMsg::GetMap { worker, adopted: epoch, min_epoch: 0, iteration: 0 };
        // (Replays apply the record itself, which cannot fail.)
        let _ = self.apply(&record);
        (!eps_proto::mutants::active("adopted-epoch-not-persisted")).then_some(record)
    }

    /// A worker reports the epoch it routes with (a replayed record; see
    /// [`Job::adopt`]).
    pub(super) fn worker_adopted(&mut self, worker: u32, epoch: u64) {
        if let Some(a) = self.adopted.get_mut(worker as usize) {
            *a = (*a).max(epoch);
        }
        self.release_async();
        self.retire_drained();
        self.free_landings();
    }

    /// Whether every worker that routes reported routing with `epoch` or a
    /// later one (and so, having nothing in flight then, sends nothing by an
    /// older map).
    pub(super) fn all_route_with(&self, epoch: u64) -> bool {
        (0..self.adopted.len()).all(|w| !self.w.routes(w as u32) || self.adopted[w] >= epoch)
    }

    /// Sources of moves done that no worker routes to for the shard any more
    /// may free its landing slots (kept for pushes routed by older maps).
    pub(super) fn free_landings(&mut self) {
        let mut freed = false;
        for i in 0..self.migrations.len() {
            let m = &self.migrations[i];
            if m.phase != Phase::Done || m.landing_freed {
                continue;
            }
            let cut = m.cut_epoch;
            if !self.all_route_with(cut) {
                continue;
            }
            self.migrations[i].landing_freed = true;
            freed = true;
            let (from, shard) = (self.migrations[i].from, self.migrations[i].shard);
            if self.servers.get(from as usize).is_some_and(|s| !s.retired) {
                self.order(from, Order::FreeLanding { shard });
            }
        }
        if freed {
            // A new backup may go where the shard's landing slots were kept.
            self.rebuild_backups();
        }
    }

    /// A worker reports its progress: the first iteration it has not begun.
    pub fn worker_progress(&mut self, worker: u32, iteration: u64) {
        if let Some(p) = self.progress.get_mut(worker as usize) {
            *p = (*p).max(iteration);
        }
    }

    /// The furthest any worker reported it has got (the first iteration not
    /// begun), or the job's first iteration.
    pub fn furthest_iteration(&self) -> u64 {
        self.progress.iter().copied().max().unwrap_or(0).max(self.start)
    }
}

pub(super) fn empty_endpoint() -> ShardEndpoint {
    ShardEndpoint { shard: u32::MAX, owner: u32::MAX, landing: Vec::new(), published_addr: 0, published_rkey: 0 }
}
