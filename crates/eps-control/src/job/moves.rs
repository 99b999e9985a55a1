//! A move its source gave up on before the cutover: the link between source
//! and target alone was cut (both still poll, so neither is lost).

use eps_proto::control::{ControlMsg, Order, Refusal};

use super::{Job, Phase};

impl Job {
    /// Server `rank` stopped moving `shard` (its connection to the target
    /// failed before the cutover): the move is cancelled, the target drops its
    /// copy, and what still has to happen is planned again: a shard left on a
    /// leaving server moves elsewhere, an added server's balancing goes on,
    /// and the shard gets its backup back.
    pub(super) fn move_stopped(&mut self, shard: u32, rank: u32) -> Result<ControlMsg, Refusal> {
        let i = self
            .migrations
            .iter()
            .rposition(|m| m.shard == shard && m.from == rank && m.in_flight())
            .ok_or_else(|| Refusal::stale(format!("server {rank} is not moving shard {shard}")))?;
        let (to, phase) = (self.migrations[i].to, self.migrations[i].phase);
        match phase {
            // (Its backup is kept: the move had not begun.)
            Phase::Unreplicating => {}
            Phase::Preparing | Phase::Copying => {
                if self.server_serving(to) {
                    self.order(to, Order::DropBackup { shard });
                }
            }
            _ => return Err(Refusal::stale(format!("the move of shard {shard} is past its cutover: it cannot stop"))),
        }
        self.migrations[i].phase = Phase::Cancelled;
        self.move_leftovers();
        self.rebuild_backups();
        self.balance_next()?;
        Ok(ControlMsg::Ok)
    }
}
