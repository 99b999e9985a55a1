//! One shard's migration (the protocol is `eps_proto::migrate`'s). The
//! source ([`MoveOut`]): what is in flight to the target, the cutover once
//! announced, and what the source does next. The target ([`MoveIn`]): where
//! the copy comes from, whether its snapshot landed, and what an arriving
//! snapshot notice, forward or relayed contribution means.

use eps_proto::Consistency;
use eps_proto::migrate::{Forwarded, MigrateError, Source, SourceAction, target_forward};
use eps_proto::sync::ShardSync;

use crate::{CoreError, Relay, ShardCore};

/// A copy of a shard arriving here: a migration's target, or a backup (whose
/// owner's forwards arrive the same way). `L` is how forwards reach it (a
/// connection, a rank), known once the snapshot landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoveIn<L> {
    from: u32,
    link: Option<L>,
}

/// Something arriving from a copy's source ([`MoveIn::arrival`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Notice {
    /// The server it comes from.
    pub sender: u32,
    /// A forward's version (BSP).
    pub version: u64,
    /// It carries no bytes (a zero-length forward, or the notice that no
    /// forward follows).
    pub empty: bool,
    /// A relayed contribution's worker (SSP/ASP).
    pub worker: u32,
}

/// What something arriving from a copy's source means ([`MoveIn::arrival`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// The snapshot is whole: [`MoveIn::land`].
    Snapshot,
    /// A snapshot notice from another server than this copy's source: a late
    /// one for an earlier copy of the shard (a move cancelled when its source
    /// died, this copy made anew since from another server). Ignored.
    StaleNotice,
    /// SSP/ASP: a contribution the source took after its cutover, to apply.
    Relayed,
    /// A relayed contribution that names no worker of the job, or is empty.
    BadRelay,
    /// BSP: a forward, classified by `eps_proto::migrate::target_forward`.
    Forward(Forwarded),
}

impl<L> MoveIn<L> {
    /// A copy whose snapshot comes from server `from`.
    pub fn new(from: u32) -> Self {
        Self { from, link: None }
    }

    /// A backup the job starts with: no snapshot comes, forwards come from
    /// its owner `from` over `link`.
    pub fn landed_from(from: u32, link: L) -> Self {
        Self { from, link: Some(link) }
    }

    /// Where the copy comes from.
    pub fn from(&self) -> u32 {
        self.from
    }

    /// Whether the snapshot landed (forwards follow).
    pub fn landed(&self) -> bool {
        self.link.is_some()
    }

    /// How forwards reach it, once the snapshot landed.
    pub fn link(&self) -> Option<&L> {
        self.link.as_ref()
    }

    /// A backup's owner moved: forwards come from `from` over `link` now.
    pub fn moved_to(&mut self, from: u32, link: L) {
        self.from = from;
        self.link = Some(link);
    }

    /// What `n`, from a server, means for the arriving shard whose state is
    /// `core`, in a job of `ranks` worker ranks.
    pub fn arrival(&self, core: &ShardCore, n: &Notice, ranks: u32) -> Arrival {
        if self.link.is_none() {
            return if n.sender == self.from { Arrival::Snapshot } else { Arrival::StaleNotice };
        }
        if core.sync.mode() != Consistency::Bsp {
            return if n.worker < ranks && !n.empty { Arrival::Relayed } else { Arrival::BadRelay };
        }
        Arrival::Forward(target_forward(&core.sync, core.forwards_parked(), n.version, n.empty))
    }

    /// The snapshot of version `v0` landed (with the workers' `clocks`, under
    /// SSP/ASP): the shard serves from `v0`, forwards come over `link`.
    /// Returns the workers whose waiting pulls are answered "moved" (they
    /// asked for a version the snapshot passed).
    pub fn land(&mut self, sync: &mut ShardSync, v0: u64, clocks: &[u64], link: L) -> Vec<u32> {
        debug_assert!(self.link.is_none(), "a snapshot lands once");
        self.link = Some(link);
        if sync.mode() == Consistency::Bsp {
            sync.snapshot_landed(v0)
        } else {
            sync.snapshot_landed_async(v0, clocks);
            Vec::new()
        }
    }
}

/// A forward (or notice) of a shard that arrives at no copy here: whether it
/// is ignored rather than a protocol violation. With the shard not `held`
/// here, an `empty` one is a "no forwards follow" notice that crossed this
/// server's own move of the shard onward; with it held and not arriving, it
/// comes from a move's target whose copy was dropped when this server's
/// backup was `promoted` (its pushers push again here).
pub fn stray_forward_ignored(held: bool, empty: bool, promoted: bool) -> bool {
    if held { promoted } else { empty }
}

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
        assert!(!self.forward_busy, "a forward of version {version} while another is in flight");
        debug_assert!(version > self.last_forward, "forward of version {version} after {}", self.last_forward);
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
        assert!(!self.forward_busy, "a relayed contribution while another is in flight");
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
    fn a_target_takes_its_sources_snapshot_then_classifies_its_forwards() {
        let mut core = ShardCore::new(ShardSync::incoming(Consistency::Bsp, 2, 0));
        let mut m: MoveIn<char> = MoveIn::new(3);
        let n = |sender, version, empty| Notice { sender, version, empty, worker: 0 };
        assert_eq!(m.arrival(&core, &n(4, 0, false), 2), Arrival::StaleNotice, "another server's notice");
        assert_eq!(m.arrival(&core, &n(3, 0, false), 2), Arrival::Snapshot);
        assert!(m.land(&mut core.sync, 5, &[], 'c').is_empty());
        assert_eq!(m.link(), Some(&'c'));
        assert_eq!(m.arrival(&core, &n(3, 6, false), 2), Arrival::Forward(Forwarded::Apply { version: 6 }));
        assert_eq!(m.arrival(&core, &n(3, 5, true), 2), Arrival::Forward(Forwarded::CutoverAtSnapshot));
        let unexpected = Arrival::Forward(Forwarded::Unexpected { version: 8, expected: 6 });
        assert_eq!(m.arrival(&core, &n(3, 8, false), 2), unexpected);
    }

    #[test]
    fn an_async_target_applies_relayed_contributions_of_known_workers_only() {
        let mut core = ShardCore::new(ShardSync::incoming(Consistency::Asp, 2, 0));
        let mut m: MoveIn<()> = MoveIn::new(1);
        let _ = m.land(&mut core.sync, 4, &[4, 4], ());
        let n = |worker, empty| Notice { sender: 1, version: 0, empty, worker };
        assert_eq!(m.arrival(&core, &n(1, false), 2), Arrival::Relayed);
        assert_eq!(m.arrival(&core, &n(2, false), 2), Arrival::BadRelay);
        assert_eq!(m.arrival(&core, &n(0, true), 2), Arrival::BadRelay);
        assert!(stray_forward_ignored(false, true, false) && !stray_forward_ignored(false, false, true));
        assert!(stray_forward_ignored(true, false, true) && !stray_forward_ignored(true, true, false));
    }

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
