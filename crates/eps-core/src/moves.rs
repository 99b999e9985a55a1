//! The source side of one shard's migration (the protocol is
//! `eps_proto::migrate`'s): what is in flight to the target, the cutover
//! once announced, and what the source does next.

use eps_proto::migrate::{MigrateError, Source, SourceAction};

use crate::{CoreError, Relay};

/// A shard moving away from this server.
#[derive(Clone, Debug)]
pub struct MoveOut {
    src: Source,
    to: u32,
    /// The snapshot's WRITE is in flight (it reads the shard's buffers).
    snapshot_busy: bool,
    /// A forward (or a relayed contribution) is in flight, until acknowledged.
    forward_busy: bool,
    last_forward: u64,
    /// The cutover iteration (BSP), once announced.
    at: u64,
    announced: bool,
    /// SSP/ASP: the relay after the cutover.
    relay: Option<Relay>,
}

impl MoveOut {
    /// A move to server `to` whose snapshot, at version `v0`, is being written.
    pub fn new(v0: u64, to: u32) -> Self {
        let src = Source::start(v0);
        Self { src, to, snapshot_busy: true, forward_busy: false, last_forward: v0, at: 0, announced: false, relay: None }
    }

    /// The target's rank.
    pub fn to(&self) -> u32 {
        self.to
    }

    /// The migration's source state machine.
    pub fn source(&self) -> &Source {
        &self.src
    }

    /// A WRITE from the shard's buffers is in flight: no update may run.
    pub fn busy(&self) -> bool {
        self.snapshot_busy || self.forward_busy
    }

    /// Whether a snapshot WRITE is in flight.
    pub fn snapshotting(&self) -> bool {
        self.snapshot_busy
    }

    /// The snapshot's WRITE completed.
    pub fn snapshot_written(&mut self) {
        self.snapshot_busy = false;
    }

    /// Whether a pull of version `need` is no longer served here (past the
    /// cutover, or relaying: the target serves it).
    pub fn refuses(&self, need: u64) -> bool {
        !self.src.serves(need) || self.relay.is_some()
    }

    /// BSP: the cutover at `at` is announced (the control plane took it).
    pub fn announce(&mut self, at: u64) -> Result<Option<SourceAction>, MigrateError> {
        let action = self.src.announce(at)?;
        self.at = at;
        self.announced = true;
        Ok(action)
    }

    /// SSP/ASP: the cutover (the snapshot landed): contributions go by `relay`.
    pub fn relay_from(&mut self, relay: Relay) {
        self.snapshot_busy = false;
        self.relay = Some(relay);
        self.announced = true;
    }

    /// Whether the cutover was announced.
    pub fn announced(&self) -> bool {
        self.announced
    }

    /// The cutover iteration (BSP), once announced.
    pub fn at(&self) -> u64 {
        self.at
    }

    /// The relay, after an SSP/ASP cutover.
    pub fn relay(&mut self) -> Option<&mut Relay> {
        self.relay.as_mut()
    }

    /// Whether contributions are relayed (SSP/ASP, after the cutover).
    pub fn relaying(&self) -> bool {
        self.relay.is_some()
    }

    /// An update produced `version`: the version to forward to the target
    /// now, if any (then [`MoveOut::forward_sent`]).
    pub fn applied(&mut self, version: u64) -> Option<u64> {
        match self.src.on_applied(version) {
            Some(SourceAction::Forward { version }) => Some(version),
            _ => None,
        }
    }

    /// The forward of `version` went to the target: the shard is busy until
    /// it is acknowledged (one at a time).
    pub fn forward_sent(&mut self, version: u64) {
        self.forward_busy = true;
        self.last_forward = version;
    }

    /// The last version forwarded.
    pub fn last_forward(&self) -> u64 {
        self.last_forward
    }

    /// The target acknowledged the forward of `version`: whether the shard
    /// is released now. An acknowledgement of another version than the one
    /// in flight is refused.
    pub fn acked(&mut self, version: u64) -> Result<bool, CoreError> {
        if !self.forward_busy || version != self.last_forward {
            return Err(CoreError::WrongAck { got: version, sent: self.forward_busy.then_some(self.last_forward) });
        }
        self.forward_busy = false;
        Ok(self.src.on_forward_acked(version) == Some(SourceAction::Release))
    }

    /// SSP/ASP: a relayed contribution went to the target.
    pub fn relay_sent(&mut self) {
        self.forward_busy = true;
    }

    /// SSP/ASP: the target applied the relayed contribution: whose it was.
    pub fn relay_acked(&mut self) -> Option<u32> {
        self.forward_busy = false;
        self.relay.as_mut().and_then(Relay::acked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_forwards_one_version_at_a_time_up_to_its_cutover_and_then_releases() {
        let mut m = MoveOut::new(4, 2);
        assert!(m.busy(), "the snapshot is being written");
        m.snapshot_written();
        assert_eq!(m.announce(5), Ok(None));
        assert!(!m.refuses(5) && m.refuses(6));
        assert_eq!(m.applied(5), Some(5));
        m.forward_sent(5);
        assert!(m.busy());
        assert_eq!(m.acked(4), Err(CoreError::WrongAck { got: 4, sent: Some(5) }));
        assert_eq!(m.acked(5), Ok(true), "the cutover's version is the target's: released");
        assert_eq!(m.acked(5), Err(CoreError::WrongAck { got: 5, sent: None }), "nothing in flight");
    }
}
