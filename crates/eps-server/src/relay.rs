//! SSP/ASP shard migration, carried out: the source's redirect window
//! (`eps_core::Relay` decides; see there). Relayed contributions are widened
//! to f32 and scaled, as the update the target applies for each. Pull
//! requests (SSP) that reach the source after its cutover are answered "pull
//! moved" and asked again of the target; ASP readers that still read its
//! published buffers get the version of the cutover, a valid one. A worker
//! reports a new epoch only with no push in flight.

use eps_core::RelayStep;
use eps_fabric::prelude::*;
use eps_proto::control::ControlMsg;
use eps_proto::imm::{Imm, ImmKind};

use crate::migrate::WR_FORWARD;
use crate::{Server, ServerError, WR_MIGRATE};

impl<P: Fabric> Server<P> {
    /// The snapshot of SSP/ASP shard `id` landed: stop applying, hand the
    /// contributions parked meanwhile to the relay, refuse the waiting pulls, and
    /// report the cutover.
    pub(crate) fn async_cutover(&mut self, id: u32) -> Result<(), ServerError> {
        let Some(h) = self.held_mut(id) else { return Ok(()) };
        let (relay, refused) = h.core.cut_over_async();
        let Some(out) = h.out.as_mut() else { return Ok(()) };
        out.snapshot_done();
        out.core.relay_from(relay);
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
        let Some(r) = out.core.relay() else { return Ok(()) };
        let w = match r.step() {
            RelayStep::Send(w) => w,
            RelayStep::Release => return self.release(id),
            RelayStep::Idle => return Ok(()),
        };
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
            out.core.relay_sent();
            out.bytes += bytes;
        }
        Ok(())
    }

    /// The target applied the relayed contribution: its slot is free, its
    /// worker gets the credit.
    pub(crate) fn relay_acked(&mut self, id: u32) -> Result<(), ServerError> {
        let Some(h) = self.held_mut(id) else { return Ok(()) };
        let Some(out) = h.out.as_mut() else { return Ok(()) };
        let Some(w) = out.core.relay_acked() else { return Ok(()) };
        h.core.sync.consumed(w);
        self.send_credit(w, id)?;
        self.pump(id)
    }

    /// `Order::Release`: every worker routes shard `id` to the target now.
    pub(crate) fn on_release_order(&mut self, id: u32) -> Result<(), ServerError> {
        let Some(r) = self.held_mut(id).and_then(|h| h.out.as_mut()).and_then(|o| o.core.relay()) else {
            return Err(ServerError::Migration(format!("ordered to release shard {id}, which is not relaying")));
        };
        r.release_ordered();
        self.pump(id)
    }
}
