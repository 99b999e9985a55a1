//! An SSP/ASP migration source's relay. Without iteration boundaries there is
//! no cutover iteration: once its snapshot (with every worker's clock) has
//! landed on the target, the source stops applying and the control plane
//! routes the shard to the target from the next epoch on. Until every worker
//! routes with that epoch, the source keeps taking pushes and relays each
//! contribution to the target, one at a time; the worker's credit comes once
//! the target applied it, so its next push of the shard, wherever it goes,
//! comes after. Once every worker routes with the new epoch
//! (`Order::Release`), nothing more comes: the source releases the shard when
//! its queue is empty.

use std::collections::VecDeque;

/// What the relay does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelayStep {
    /// Send worker `w`'s contribution (in its landing slot) to the target.
    Send(u32),
    /// Nothing is left and nothing more comes: release the shard.
    Release,
    /// Wait (a contribution is on its way, or nothing is queued).
    Idle,
}

/// The source's relay after an SSP/ASP cutover.
#[derive(Clone, Debug, Default)]
pub struct Relay {
    /// Workers whose contribution waits in its slot, in arrival order.
    queue: VecDeque<u32>,
    /// The worker whose contribution is on its way (until the target acknowledges).
    sending: Option<u32>,
    /// Every worker routes to the target now: release once the queue is empty.
    release: bool,
}

impl Relay {
    /// A relay starting with the contributions parked at the cutover.
    pub fn new(queue: impl IntoIterator<Item = u32>) -> Self {
        Self { queue: queue.into_iter().collect(), sending: None, release: false }
    }

    /// Worker `w`'s contribution landed here after the cutover.
    pub fn take(&mut self, w: u32) {
        debug_assert!(
            !self.queue.contains(&w) && self.sending != Some(w),
            "worker {w}'s next contribution before its last was relayed"
        );
        self.queue.push_back(w);
    }

    /// What to do now.
    pub fn step(&mut self) -> RelayStep {
        if self.release && eps_proto::mutants::active("relay-releases-early") {
            return RelayStep::Release;
        }
        if self.sending.is_some() {
            return RelayStep::Idle;
        }
        match self.queue.pop_front() {
            Some(w) => {
                self.sending = Some(w);
                RelayStep::Send(w)
            }
            None if self.release => RelayStep::Release,
            None => RelayStep::Idle,
        }
    }

    /// The target applied the contribution on its way: whose it was (its
    /// slot is free and its worker gets the credit).
    pub fn acked(&mut self) -> Option<u32> {
        self.sending.take()
    }

    /// `Order::Release`: every worker routes the shard to the target now.
    pub fn release_ordered(&mut self) {
        self.release = true;
    }

    /// Contributions queued or on their way.
    pub fn pending(&self) -> usize {
        self.queue.len() + usize::from(self.sending.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contributions_go_one_at_a_time_and_the_release_waits_for_the_last() {
        let mut r = Relay::new([2, 0]);
        r.release_ordered();
        assert_eq!(r.step(), RelayStep::Send(2));
        r.take(1);
        assert_eq!(r.step(), RelayStep::Idle, "one on its way");
        assert_eq!(r.acked(), Some(2));
        assert_eq!(r.step(), RelayStep::Send(0));
        assert_eq!(r.acked(), Some(0));
        assert_eq!(r.step(), RelayStep::Send(1));
        assert_eq!(r.pending(), 1);
        assert_eq!(r.acked(), Some(1));
        assert_eq!(r.step(), RelayStep::Release);
    }
}
