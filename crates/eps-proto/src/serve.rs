//! A server's decisions on what workers send it, free of I/O, shared by
//! `eps-server` and the simulation (which must not decide otherwise).

use crate::migrate::Source;
use crate::sync::ShardSync;

/// What a server does with a worker's push of an iteration to a shard it
/// holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushGate {
    /// The shard is migrating away and the push belongs to the target (an
    /// iteration at or past the cutover, or a BSP push ahead of the source's
    /// version, which comes from a worker that pulled the next version from
    /// the target): answer "moved".
    Moved,
    /// A promoted backup's shard pushed again for an iteration it already
    /// applied (its worker pushed it again after the owner was lost): the
    /// worker's pull is answered; nothing is applied twice.
    AlreadyApplied,
    /// Take it (see `ShardSync::on_push`).
    Take,
}

/// Decides on a push of `iteration` to a shard in state `sync`; `source` is
/// the shard's migration source side, if it migrates away; `promoted`
/// whether the shard is a backup's (promoted or to be).
pub fn push_gate(bsp: bool, sync: &ShardSync, source: Option<&Source>, promoted: bool, iteration: u64) -> PushGate {
    let future = bsp && iteration > sync.version();
    if source.is_some_and(|s| future || s.accepts_push(iteration).is_err()) {
        return PushGate::Moved;
    }
    if promoted && iteration < sync.version() && !crate::mutants::active("promoted-backup-reapplies") {
        return PushGate::AlreadyApplied;
    }
    PushGate::Take
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Consistency;

    #[test]
    fn pushes_go_where_the_iteration_is_served_and_are_applied_once() {
        let mut s = ShardSync::new(Consistency::Bsp, 2);
        s.snapshot_landed(4);
        assert_eq!(push_gate(true, &s, None, false, 4), PushGate::Take);
        // A source cutting over at 5 takes 4, not 5; in BSP not 5 before it holds 5.
        let mut src = Source::start(4);
        assert_eq!(push_gate(true, &s, Some(&src), false, 5), PushGate::Moved);
        src.announce(5).unwrap();
        assert_eq!(push_gate(true, &s, Some(&src), false, 4), PushGate::Take);
        assert_eq!(push_gate(false, &s, Some(&src), false, 5), PushGate::Moved);
        // A promoted backup at version 4 ignores a re-push of 3, takes 4.
        assert_eq!(push_gate(true, &s, None, true, 3), PushGate::AlreadyApplied);
        assert_eq!(push_gate(true, &s, None, true, 4), PushGate::Take);
        assert_eq!(push_gate(true, &s, None, false, 3), PushGate::Take, "not a backup: ShardSync refuses it");
    }
}
