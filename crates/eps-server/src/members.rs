//! Worker membership on a server, carried out: the vote on a proposed change
//! (`eps_core::Members` holds the iterations from the voted one on until it is
//! committed), and the commit (settles held iterations; drops the missing
//! contributions and the connections of workers whose lease expired).

use eps_core::Members;
use eps_fabric::Fabric;
use eps_proto::control::{ControlMsg, Role};

use crate::sparse::Side;
use crate::{Server, ServerError};

impl<P: Fabric> Server<P> {
    /// `Order::Propose`: holds from the first iteration none of our shards has
    /// aggregated, and votes it.
    pub(crate) fn on_propose(&mut self, id: u64) -> Result<(), ServerError> {
        let dense = self.shards.iter().flatten().map(|h| Members::reach(self.mode, &h.core.sync));
        let stand_in = self.sparse.stand_in.iter().flat_map(|s| &s.tables);
        let sparse = self.sparse.tables.iter().chain(stand_in).map(|t| Members::reach(self.mode, &t.part.sync));
        let hold = self.members.propose(dense.chain(sparse).max().unwrap_or(0));
        self.ctl.call(&ControlMsg::Vote { role: Role::Server, rank: self.rank, id, hold })?;
        Ok(())
    }

    /// `Order::Members`: from `at` on, `workers` contribute.
    pub(crate) fn on_members(&mut self, at: u64, workers: Vec<u32>, expired: Vec<u32>) -> Result<(), ServerError> {
        eps_proto::say!("eps server {}: from iteration {at} on, workers {workers:?} contribute", self.rank);
        self.members.commit(at, workers, &expired, self.ranks).map_err(|e| ServerError::Membership(e.to_string()))?;
        for &r in &expired {
            eps_proto::say!(
                "eps server {}: worker {r} lost its lease; its contributions before iteration {at} that have not arrived are dropped",
                self.rank
            );
            if let Some(ci) = self.by_rank.get(r as usize).copied().flatten() {
                self.drop_conn(ci);
            }
        }
        if expired.contains(&crate::seed::SEEDER) {
            self.seeder_gone()?;
        }
        for id in 0..self.shards.len() as u32 {
            self.try_complete(id)?;
        }
        // A table whose every other push of its iteration is in completes
        // now that a lost worker's is no longer awaited.
        for side in [Side::Own, Side::StandIn] {
            for t in 0..self.sparse.tables.len() as u16 {
                let Some(table) = self.sparse.table_mut(side, t) else { continue };
                if let Some((_, c)) = self.members.complete(&table.part.sync) {
                    let c = c.into_owned();
                    self.sparse_update_on(side, t, &c)?;
                }
            }
        }
        // And the sparse requests the vote held.
        self.replay_sparse()
    }

    /// Aggregates shard `id`'s current iteration if every contribution it
    /// expects is in (and its contributor set is settled).
    pub(crate) fn try_complete(&mut self, id: u32) -> Result<(), ServerError> {
        // An update applied and waiting for the backup's acknowledgement has
        // not freed its slots yet: they are not a complete iteration again
        // (the version is served, and this checked again, on the ack).
        if self.replica_deferred(id) {
            return Ok(());
        }
        let Some(h) = self.shards[id as usize].as_ref() else { return Ok(()) };
        match h.core.completes(&self.members) {
            Some(p) => self.update(id, p),
            None => Ok(()),
        }
    }
}
