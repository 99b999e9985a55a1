//! Worker membership on a server: the contributor set of every iteration, the
//! hold while a proposed change is voted on (pushes from the held iteration on
//! are recorded but aggregate nothing until the change is committed), and the
//! workers lost with their leases (their missing contributions are dropped).

use std::borrow::Cow;

use eps_proto::Consistency;
use eps_proto::membership::{Membership, MembershipError};
use eps_proto::sync::ShardSync;

/// A membership order that cannot be applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MembersError {
    /// A contributor past the ranks the job admits.
    #[error("contributor set {workers:?} names a rank beyond the job's limit of {ranks}")]
    RankBeyondLimit {
        /// The set.
        workers: Vec<u32>,
        /// Ranks the job admits.
        ranks: u32,
    },
    /// The change itself is refused.
    #[error("change at iteration {at}: {source}")]
    Change {
        /// Its first iteration.
        at: u64,
        /// Why.
        source: MembershipError,
    },
}

/// Who contributes to what, on one server.
#[derive(Clone, Debug)]
pub struct Members {
    membership: Membership,
    /// A vote is open: iterations from here on aggregate nothing yet.
    hold: Option<u64>,
    /// Workers removed by lease expiry, with the first iteration without them.
    lost: Vec<(u32, u64)>,
}

impl Members {
    /// Workers `0..workers` contribute from the start.
    pub fn new(workers: u32) -> Result<Self, MembershipError> {
        Ok(Self { membership: Membership::new((0..workers).collect())?, hold: None, lost: Vec::new() })
    }

    /// The contributor sets by iteration.
    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    /// The first iteration held by an open vote.
    pub fn hold(&self) -> Option<u64> {
        self.hold
    }

    /// Workers lost with their leases, each with its first iteration without it.
    pub fn lost(&self) -> &[(u32, u64)] {
        &self.lost
    }

    /// Whether pushes of `iteration` must wait for a vote to end.
    pub fn unsettled(&self, iteration: u64) -> bool {
        self.hold.is_some_and(|h| iteration >= h)
    }

    /// Who contributes to `iteration` of a shard in state `sync`, in rank
    /// order (BSP's bits depend on it).
    pub fn contributors<'a>(&'a self, sync: &ShardSync, iteration: u64) -> Cow<'a, [u32]> {
        sync.contributors(&self.membership, &self.lost, iteration)
    }

    /// BSP: the iteration of a shard (or a table's part) in state `sync`
    /// that is complete, if its contributor set is settled and every
    /// contribution it expects is in, with its contributors. Asked after
    /// anything that may shrink the set (a commit that drops workers lost
    /// with their leases), not only on a push: the last push may have come
    /// before.
    pub fn complete<'a>(&'a self, sync: &ShardSync) -> Option<(u64, Cow<'a, [u32]>)> {
        let v = sync.version();
        if self.unsettled(v) {
            return None;
        }
        let c = self.contributors(sync, v);
        sync.complete(&c).map(|iteration| (iteration, c))
    }

    /// How far a shard got, for a vote: BSP its version; SSP/ASP, which count
    /// pushes as they come, the furthest iteration any worker pushed.
    pub fn reach(mode: Consistency, sync: &ShardSync) -> u64 {
        match mode {
            Consistency::Bsp => sync.version(),
            _ => sync.clocks().iter().copied().max().unwrap_or(0),
        }
    }

    /// `Order::Propose`: holds from the first iteration after `top` (the
    /// furthest [`Members::reach`] of what this server holds), which is the
    /// server's vote.
    pub fn propose(&mut self, top: u64) -> u64 {
        let hold = top + 1;
        self.hold = Some(hold);
        hold
    }

    /// Ends a vote that changed nothing here (a bucket map committed).
    pub fn release_hold(&mut self) {
        self.hold = None;
    }

    /// `Order::Members`: from `at` on, `workers` contribute; `expired` lost
    /// their leases. Ends the vote. A job admits ranks `0..ranks`.
    pub fn commit(&mut self, at: u64, workers: Vec<u32>, expired: &[u32], ranks: u32) -> Result<(), MembersError> {
        if workers.iter().any(|&r| r >= ranks) {
            return Err(MembersError::RankBeyondLimit { workers, ranks });
        }
        self.membership.schedule(at, at.saturating_sub(1), workers).map_err(|source| MembersError::Change { at, source })?;
        self.lost.extend(expired.iter().map(|&r| (r, at)));
        self.hold = None;
        Ok(())
    }
}
