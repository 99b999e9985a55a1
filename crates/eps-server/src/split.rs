//! Splitting a shard held here into two (BSP), ordered by the control plane
//! while it balances an added server.
//!
//! The split happens at the first moment the shard has no update parked: at
//! version `v`, with iteration `v` not aggregated. Both parts get new ids and
//! memory of their own: their ranges of the f32 master copy and the optimizer
//! state, and version `v` published from them (the parent's bits). Pushes of
//! iteration `v` held for the parent are answered "moved" and the pulls waiting
//! for `v + 1` "pull moved": their workers fetch the new map and push and pull
//! the parts. The parent is freed at once (its landing slots stay registered, so a
//! late push lands in bounds and is answered "moved"); a pull of version `v` that
//! reaches it late is answered "pull moved" and asked again of the parts, which
//! serve `v` too. Then the split is reported (`ControlMsg::Split`), which makes
//! the new map.

use std::time::Instant;

use eps_fabric::Fabric;
use eps_proto::control::ControlMsg;
use eps_proto::sync::ShardSync;

use crate::{Held, Server, ServerError};

/// A split ordered and not done yet.
pub(crate) type SplitOrder = eps_core::Split;

impl<P: Fabric> Server<P> {
    /// The control plane ordered shard `id` split at element `mid` into `lo`, `hi`.
    pub(crate) fn on_split_order(&mut self, id: u32, mid: u64, lo: u32, hi: u32) -> Result<(), ServerError> {
        let bad = |why: &dyn std::fmt::Display| Err(ServerError::Migration(format!("ordered to split shard {id}: {why}")));
        let Some(&span) = self.spans.get(id as usize) else { return bad(&"the job has no such shard") };
        let taken = |p: u32| self.shards.get(p as usize).is_some_and(Option::is_some);
        let Some(h) = self.shards.get(id as usize).and_then(Option::as_ref) else { return bad(&"it is not here") };
        let busy = h.out.is_some() || h.split.is_some();
        let order = match eps_core::Split::order(self.mode, id, span, (mid, lo, hi), taken, busy) {
            Ok(o) => o,
            Err(e) => return bad(&e),
        };
        if let Some(h) = self.held_mut(id) {
            h.split = Some(order);
        }
        self.try_split(id)
    }

    /// Splits shard `id` if a split is ordered and no update is parked.
    pub(crate) fn try_split(&mut self, id: u32) -> Result<(), ServerError> {
        let Some(h) = self.shards.get(id as usize).and_then(Option::as_ref) else { return Ok(()) };
        let Some(o) = h.split else { return Ok(()) };
        if !eps_core::Split::ready(&h.core, h.out.is_some(), h.seed.is_some()) {
            return Ok(());
        }
        let began = Instant::now();
        let v = h.core.sync.version();
        let span = self.spans[id as usize];
        self.mem.split(id, ShardSync::parity(v), v, [(o.lo, o.mid - span.0), (o.hi, span.0 + span.1 - o.mid)])?;
        let Some(mut parent) = self.shards[id as usize].take() else { return Ok(()) };
        let parts = o.carry_out(&mut parent.core, span, self.ranks);
        let needed = o.hi.max(o.lo) as usize + 1;
        if self.shards.len() < needed {
            self.shards.resize_with(needed, || None);
            self.spans.resize(needed, (0, 0));
        }
        let sizes = [parts.lo.1.1, parts.hi.1.1];
        for (p, part_span, core) in [parts.lo, parts.hi] {
            self.spans[p as usize] = part_span;
            self.shards[p as usize] = Some(Held {
                core,
                out: None,
                incoming: None,
                split: None,
                replica: crate::replica::Replica::none(),
                new_backup: None,
                seed: None,
            });
        }
        if let Some(b) = self.mem.remove(id) {
            self.retained.push((None, b.landing));
        }
        for w in parts.held {
            self.send_moved(w, id, v as u16)?;
        }
        for w in parts.waiting {
            self.answers.forget_moved(w, id);
            self.send_pull_moved(w, id, v as u16)?;
        }
        let lo = self.endpoint(o.lo).ok_or_else(|| ServerError::Migration("split part vanished".into()))?;
        let hi = self.endpoint(o.hi).ok_or_else(|| ServerError::Migration("split part vanished".into()))?;
        eps_proto::say_event!(
            "split",
            { server = self.rank, shard = id, iteration = v, lo = o.lo, hi = o.hi },
            "eps server {}: split shard {id} at iteration {v} into shard {} ({} elements) and shard {} ({} elements) in {:.1} ms",
            self.rank,
            o.lo,
            sizes[0],
            o.hi,
            sizes[1],
            began.elapsed().as_secs_f64() * 1e3
        );
        self.summary.splits += 1;
        self.metrics.splits.inc();
        self.ctl.call(&ControlMsg::Split { shard: id, at: v, lo, hi })?;
        // An iteration whose every contributor is gone is complete at once.
        self.try_complete(o.lo)?;
        self.try_complete(o.hi)
    }
}
