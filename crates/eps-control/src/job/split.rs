//! Balancing an added server: the plan (`ShardMap::plan_add_splits`) cuts shards
//! until whole moves can balance the bytes; its splits are ordered one at a
//! time, in order, then its moves start. A split is done by the shard's owner at
//! the first iteration it has not aggregated (`Order::Split`, reported with
//! `ControlMsg::Split`); both parts get new ids (the plan's), so a push routed
//! with the old map names the old id and is answered "moved".

use std::collections::VecDeque;

use eps_proto::control::{Order, Refusal, ShardEndpoint};
use eps_proto::layout::MAX_SHARDS;
use eps_proto::shardmap::{Move, Split};

use super::Job;

/// A shard's elements and the iterations whose pushes use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// First element.
    pub start: u64,
    /// Elements.
    pub len: u64,
    /// First iteration (0, or the iteration of the split that made it).
    pub from: u64,
    /// First iteration after it (the iteration of its split; `u64::MAX` if none).
    pub until: u64,
}

/// The plan for the server being balanced: splits still to order, then moves.
#[derive(Clone, Debug)]
pub(crate) struct Balancing {
    splits: VecDeque<Split>,
    moves: Vec<Move>,
}

/// A split that was ordered and not reported yet.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ordered {
    pub(crate) shard: u32,
    pub(crate) owner: u32,
    mid: u64,
    lo: u32,
    hi: u32,
}

impl Job {
    /// Splits done so far.
    pub fn splits(&self) -> u64 {
        self.splits
    }

    /// Shard spans by id (every id ever used).
    pub fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// Balances the next added server waiting for its share, if no migration or
    /// split is in flight: plans once (splits, then moves), orders the plan's
    /// splits one at a time in order, then starts its moves.
    pub(crate) fn balance_next(&mut self) -> Result<(), Refusal> {
        if self.migrations_in_flight() > 0 || self.splitting.is_some() {
            return Ok(());
        }
        let Some(&rank) = self.to_balance.first() else { return Ok(()) };
        if self.balancing.is_none() {
            let mut plan = self.map.clone();
            // Splits need BSP (an iteration boundary to cut at); a shard with
            // a backup moves whole (its backup is rebuilt after the move).
            let (splits, moves) = if self.consistency == eps_proto::Consistency::Bsp && self.replicas < 2 {
                plan.plan_add_splits(rank).map_err(|e| Refusal::stale(e.to_string()))?
            } else {
                (Vec::new(), plan.plan_add_whole(rank).map_err(|e| Refusal::stale(e.to_string()))?)
            };
            // Past the shard cap (or the ids), move whole shards only.
            let within = splits.len() + self.map.shards.len() <= self.shard_cap && plan.next_id <= MAX_SHARDS;
            self.balancing = Some(if within {
                Balancing { splits: splits.into(), moves }
            } else {
                Balancing {
                    splits: VecDeque::new(),
                    moves: self.map.clone().plan_add_whole(rank).map_err(|e| Refusal::stale(e.to_string()))?,
                }
            });
        }
        let Some(b) = self.balancing.as_mut() else { return Ok(()) };
        if let Some(sp) = b.splits.pop_front() {
            let owner = self.map.index_of(sp.shard).map(|i| self.map.shards[i].owner);
            let Some(owner) = owner else {
                return Err(Refusal::stale(format!("the plan splits shard {}, which is not in the map", sp.shard)));
            };
            self.map.next_id = self.map.next_id.max(sp.hi + 1);
            self.splitting = Some(Ordered { shard: sp.shard, owner, mid: sp.mid, lo: sp.lo, hi: sp.hi });
            self.order(owner, Order::Split { shard: sp.shard, mid: sp.mid, lo: sp.lo, hi: sp.hi });
            return Ok(());
        }
        let moves = self.balancing.take().map(|b| b.moves).unwrap_or_default();
        self.to_balance.remove(0);
        self.map.servers.push(rank);
        self.map.servers.sort_unstable();
        self.start_moves(&moves);
        if moves.is_empty() {
            return self.balance_next();
        }
        Ok(())
    }

    /// The owner split `shard` at iteration `at` into `lo` and `hi`.
    pub(crate) fn split_done(
        &mut self,
        shard: u32,
        at: u64,
        lo: &ShardEndpoint,
        hi: &ShardEndpoint,
    ) -> Result<eps_proto::control::ControlMsg, Refusal> {
        let Some(o) = self.splitting.filter(|o| o.shard == shard && o.lo == lo.shard && o.hi == hi.shard) else {
            return Err(Refusal::stale(format!("no split of shard {shard} into {} and {} was ordered", lo.shard, hi.shard)));
        };
        if lo.owner != o.owner || hi.owner != o.owner {
            return Err(Refusal::invalid(format!("the parts of shard {shard} must stay on server {}", o.owner)));
        }
        let parent =
            self.spans.get(shard as usize).copied().ok_or_else(|| Refusal::stale(format!("shard {shard} has no span")))?;
        if at < parent.from || parent.until != u64::MAX {
            return Err(Refusal::invalid(format!("shard {shard} cannot split at iteration {at}")));
        }
        if self.spans.len() != o.lo as usize || o.hi != o.lo + 1 {
            return Err(Refusal::invalid(format!("split ids {} and {} are out of order", o.lo, o.hi)));
        }
        self.map.split_at(shard, o.mid, o.lo, o.hi).map_err(|e| Refusal::invalid(e.to_string()))?;
        self.spans[shard as usize].until = at;
        self.spans.push(Span { start: parent.start, len: o.mid - parent.start, from: at, until: u64::MAX });
        self.spans.push(Span { start: o.mid, len: parent.start + parent.len - o.mid, from: at, until: u64::MAX });
        self.endpoints.push(Some(lo.clone()));
        self.endpoints.push(Some(hi.clone()));
        self.previous.push(None);
        self.previous.push(None);
        for _ in 0..2 {
            self.backups.push(None);
            self.rebuilding.push(None);
            self.unsynced.push(false);
        }
        self.map.epoch += 1;
        self.splitting = None;
        self.splits += 1;
        self.balance_next()?;
        Ok(eps_proto::control::ControlMsg::Ok)
    }
}
