//! SSP/ASP shard migration: the source's redirect window.
//!
//! Without iteration boundaries there is no cutover iteration. The source stops
//! applying once its snapshot (master, optimizer state, version and per-worker
//! clocks) has landed on the target and tells the control plane, which routes
//! the shard to the target from the next epoch on. Until every worker routes
//! with that epoch, the source keeps taking pushes and relays each contribution
//! to the target (widened to f32 and scaled, as the update the target applies
//! for it), one at a time; the worker's credit comes once the target applied it,
//! so the worker's next push of the shard, wherever it goes, comes after. Its
//! pull requests (SSP) are answered "pull moved" and asked again of the target;
//! ASP readers that still read its published buffers get the version of the
//! cutover, a valid one. A worker reports a new epoch only with no push in
//! flight, so once all did (`Order::Release`) nothing more comes: the source
//! releases the shard when its queue is empty.

use std::collections::VecDeque;

use eps_fabric::prelude::*;
use eps_proto::control::ControlMsg;
use eps_proto::imm::{Imm, ImmKind};

use crate::migrate::WR_FORWARD;
use crate::{Pending, Server, ServerError, WR_MIGRATE};

/// The source's relay after an SSP/ASP cutover.
#[derive(Debug, Default)]
pub(crate) struct Relay {
    /// Workers whose contribution waits in its slot, in arrival order.
    pub(crate) queue: VecDeque<u32>,
    /// The worker whose contribution is on its way (until the target acknowledges).
    sending: Option<u32>,
    /// Every worker routes to the target now: release once the queue is empty.
    release: bool,
}

impl<P: Fabric> Server<P> {
    /// The snapshot of SSP/ASP shard `id` landed: stop applying, hand the
    /// contributions parked meanwhile to the relay, refuse the waiting pulls, and
    /// report the cutover.
    pub(crate) fn async_cutover(&mut self, id: u32) -> Result<(), ServerError> {
        let Some(h) = self.held_mut(id) else { return Ok(()) };
        let queue: VecDeque<u32> = h
            .core
            .unpark_all()
            .into_iter()
            .filter_map(|p| match p {
                Pending::Update { one: Some(w), .. } => Some(w),
                _ => None,
            })
            .collect();
        let refused = h.core.sync.refuse_all();
        let Some(out) = h.out.as_mut() else { return Ok(()) };
        out.snapshot_done();
        out.relay = Some(Relay { queue, ..Relay::default() });
        out.announced = true;
        for w in refused {
            self.answers.forget_moved(w, id);
            self.send_pull_moved(w, id, 0)?;
        }
        self.ctl.call(&ControlMsg::Cutover { shard: id, at: 0 })?;
        self.pump(id)
    }

    /// Sends the next queued contribution of shard `id` to the target, if none
    /// is on its way; releases the shard when told to and nothing is left.
    pub(crate) fn pump(&mut self, id: u32) -> Result<(), ServerError> {
        let scale = 1.0 / self.workers as f32;
        let Some(out) = self.held_mut(id).and_then(|h| h.out.as_mut()) else { return Ok(()) };
        let Some(r) = out.relay.as_mut() else { return Ok(()) };
        if r.sending.is_some() {
            return Ok(());
        }
        let Some(w) = r.queue.pop_front() else {
            return if r.release { self.release(id) } else { Ok(()) };
        };
        r.sending = Some(w);
        let (ci, remote) = (out.ci, out.grad_remote());
        let averaged = self.averaged_in(id);
        self.mem.fill_forward(id, w, scale, &averaged);
        let b = self.mem.get(id).ok_or_else(|| ServerError::Migration("shard memory vanished".into()))?;
        let g = b.grad.as_ref().ok_or_else(|| ServerError::Migration("no gradient buffer".into()))?;
        let imm = Imm { kind: ImmKind::Forward, shard: id, seq: w as u16 }.encode();
        // One shard's gradient (see `after_apply`).
        let sg = [Sge::new(g, 0, (b.len * 4) as u32)];
        let wr =
            SendWr { wr_id: WR_MIGRATE | WR_FORWARD | u64::from(id), op: SendOp::WriteImm(remote, imm), sg: &sg, signaled: true };
        let bytes = b.len * 4;
        self.conns[ci].post_or_flush(&wr, &mut self.flushed)?;
        if let Some(out) = self.held_mut(id).and_then(|h| h.out.as_mut()) {
            out.forward_busy = true;
            out.bytes += bytes;
        }
        Ok(())
    }

    /// The target applied the relayed contribution: its slot is free, its
    /// worker gets the credit.
    pub(crate) fn relay_acked(&mut self, id: u32) -> Result<(), ServerError> {
        let Some(h) = self.held_mut(id) else { return Ok(()) };
        let Some(out) = h.out.as_mut() else { return Ok(()) };
        out.forward_busy = false;
        let Some(w) = out.relay.as_mut().and_then(|r| r.sending.take()) else { return Ok(()) };
        h.core.sync.consumed(w);
        self.send_credit(w, id)?;
        self.pump(id)
    }

    /// `Order::Release`: every worker routes shard `id` to the target now.
    pub(crate) fn on_release_order(&mut self, id: u32) -> Result<(), ServerError> {
        let Some(r) = self.held_mut(id).and_then(|h| h.out.as_mut()).and_then(|o| o.relay.as_mut()) else {
            return Err(ServerError::Migration(format!("ordered to release shard {id}, which is not relaying")));
        };
        r.release = true;
        self.pump(id)
    }
}
