//! Worker membership on a server: the contributor set of every iteration, the
//! vote on a proposed change (aggregate nothing from the voted iteration on until
//! it is committed), and the commit (settles held iterations; drops the missing
//! contributions of workers whose lease expired).

use eps_fabric::Fabric;
use eps_proto::control::{ControlMsg, Role};

use crate::{Pending, Server, ServerError};

impl<P: Fabric> Server<P> {
    /// Whether pushes of `iteration` must wait for a membership vote to end.
    pub(crate) fn unsettled(&self, iteration: u64) -> bool {
        self.hold.is_some_and(|h| iteration >= h)
    }

    /// `Order::Propose`: holds from the first iteration none of our shards has
    /// aggregated, and votes it.
    pub(crate) fn on_propose(&mut self, id: u64) -> Result<(), ServerError> {
        // (SSP/ASP count pushes as they come: there, the furthest iteration
        // any worker pushed.)
        let reach = |s: &eps_proto::sync::ShardSync| match self.mode {
            eps_proto::Consistency::Bsp => s.version(),
            _ => s.clocks().iter().copied().max().unwrap_or(0),
        };
        let dense = self.shards.iter().flatten().map(|h| reach(&h.sync));
        let top = dense.chain(self.sparse.tables.iter().map(|t| reach(&t.part.sync))).max().unwrap_or(0);
        let hold = top + 1;
        self.hold = Some(hold);
        self.ctl.call(&ControlMsg::Vote { role: Role::Server, rank: self.rank, id, hold })?;
        Ok(())
    }

    /// `Order::Members`: from `at` on, `workers` contribute.
    pub(crate) fn on_members(&mut self, at: u64, workers: Vec<u32>, expired: Vec<u32>) -> Result<(), ServerError> {
        if workers.iter().any(|&r| r >= self.ranks) {
            return Err(ServerError::Membership(format!("contributor set {workers:?} names a rank beyond the job's limit")));
        }
        eps_proto::say!("eps server {}: from iteration {at} on, workers {workers:?} contribute", self.rank);
        self.membership
            .schedule(at, at.saturating_sub(1), workers)
            .map_err(|e| ServerError::Membership(format!("change at iteration {at}: {e}")))?;
        for &r in &expired {
            eps_proto::say!(
                "eps server {}: worker {r} lost its lease; its contributions before iteration {at} that have not arrived are dropped",
                self.rank
            );
            self.lost.push((r, at));
            if let Some(ci) = self.by_rank.get(r as usize).copied().flatten() {
                self.drop_conn(ci);
            }
        }
        if expired.contains(&crate::seed::SEEDER) {
            self.seeder_gone()?;
        }
        self.hold = None;
        for id in 0..self.shards.len() as u32 {
            self.try_complete(id)?;
        }
        // And the sparse requests the vote held.
        self.replay_sparse()
    }

    /// Aggregates shard `id`'s current iteration if every contribution it
    /// expects is in (and its contributor set is settled).
    pub(crate) fn try_complete(&mut self, id: u32) -> Result<(), ServerError> {
        let Some(h) = self.shards[id as usize].as_ref() else { return Ok(()) };
        let v = h.sync.version();
        // An update applied and waiting for the backup's acknowledgement has
        // not freed its slots yet: they are not a complete iteration again
        // (the version is served, and this checked again, on the ack).
        if self.unsettled(v) || self.replica_deferred(id) {
            return Ok(());
        }
        let c = h.sync.contributors(&self.membership, &self.lost, v);
        if let Some(t) = h.sync.complete(&c) {
            self.update(id, Pending::Update { iteration: t, one: None })?;
        }
        Ok(())
    }
}
