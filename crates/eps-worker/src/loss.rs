//! Losing a server of a job with replicas, and being removed from a job:
//! how a worker notices and what it does about it.

use std::sync::atomic::Ordering;

use eps_fabric::prelude::*;
use eps_proto::control::ControlMsg;

use crate::{Worker, WorkerError};

impl<P: Fabric> Worker<P> {
    /// The iteration from which the job no longer counts this worker among
    /// its contributors, if it removed it (asked of the control plane now).
    pub(crate) fn removed_at(&mut self) -> Option<u64> {
        let adopted = self.watch.adopted.load(Ordering::Acquire);
        let req = ControlMsg::GetMap { worker: self.rank, adopted, min_epoch: 0, iteration: self.iteration };
        let Ok(ControlMsg::Map(m)) = self.ctl.call(&req) else { return None };
        m.membership.last().filter(|(_, set)| !set.contains(&self.rank)).map(|(first, _)| *first)
    }

    /// With replicas: a server the newest map leaves out was declared lost
    /// (it may be stopped, not dead, so its connection need not fail): this
    /// round goes to its shards' backups, as when a connection fails.
    pub(crate) fn notice_lost_servers(&mut self) {
        if self.spec.job.replicas < 2 || self.watch.newest.load(Ordering::Acquire) <= self.map.epoch {
            return;
        }
        let gone = {
            let g = self.watch.latest.lock().unwrap_or_else(|p| p.into_inner());
            let Some(m) = g.as_ref() else { return };
            eps_core::route::left_out(&self.map, m)
        };
        for s in gone {
            if !self.lost.contains(&s) && (self.routes_to(s) || self.sparse.holds(s)) {
                self.lose_server(s);
            }
        }
    }

    /// Waits for a map that no longer routes shard `sid` (at iteration `t`) to
    /// a server that failed (the control plane promotes its backups).
    pub(crate) fn await_route_away(&mut self, sid: usize, t: u64) -> Result<(), WorkerError> {
        while self.lost.contains(&self.route(sid, t).owner) || self.lost.contains(&self.map.routes[sid].owner.owner) {
            let server = self.route(sid, t).owner;
            match self.refresh_map() {
                // No map declared it lost: the rest of the job still reaches it.
                Err(WorkerError::Timeout(_)) => return Err(WorkerError::Unreachable { server, iteration: self.iteration }),
                r => r?,
            }
        }
        Ok(())
    }

    /// Tells the control plane that server `server` cannot be reached from
    /// here (a connection failed or could not be made): declared lost once
    /// another peer says so too. (A server that died is found sooner so.)
    pub(crate) fn report_unreachable(&mut self, server: u32) {
        let m = ControlMsg::Unreachable { rank: server, by: eps_proto::control::Role::Worker, by_rank: self.rank };
        if let Err(e) = self.ctl.call(&m) {
            eps_proto::say!("eps worker {}: could not report server {server} unreachable: {e}", self.rank);
        }
    }

    /// Server `server` failed in a job with replicas: the control plane
    /// promotes its shards' backups in a new epoch. This round's pushes to it
    /// whose parameters have not come are pushed again to the new owners, and
    /// their pulls asked again (the backup applied every version anyone pulled).
    pub(crate) fn lose_server(&mut self, server: u32) {
        eps_proto::say_event!(
            "peer_cut_off",
            { worker = self.rank, server = server },
            "eps worker {}: server {server} failed; its shards' backups take over",
            self.rank
        );
        self.lost.insert(server);
        self.sparse.lose(server);
        if let Some(q) = self.qps.get_mut(server as usize) {
            *q = None;
        }
        // A "pull moved" it owed (for a push it answered "moved" before the
        // shard moved on) will not come.
        for &(sid, s) in &self.owed {
            if s == server {
                self.outstanding[sid] = self.outstanding[sid].saturating_sub(1);
            }
        }
        self.owed.retain(|o| o.1 != server);
        let t = self.iteration;
        for sid in self.round.clone() {
            // (Routed there, or pushed there with an older map.)
            let there = self.route(sid, t).owner == server || self.pushed_to[sid] == server;
            if !there || self.round_pulled[sid] || self.outstanding[sid] == 0 {
                continue;
            }
            self.outstanding[sid] = 0;
            self.sending[sid] = 0;
            self.pull_moved += 1;
            self.pulls_moved.push((sid, server));
            self.moved.push((sid, t, server));
            self.credit[sid] = true;
        }
    }
}
