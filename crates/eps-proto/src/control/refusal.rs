//! Refusals as values: every `ControlMsg::Error` carries an [`ErrorCode`]
//! with a stable number, so that clients decide by the code and never by the
//! wording of the message (which is for people). Number 0 is never sent; an
//! unknown number does not decode (as an unknown message tag does not).

/// Why the control plane (or a standby) refused a request. The numbers are
/// part of the wire format: never renumbered, never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorCode {
    /// A value of the request is unusable (malformed, out of range, a bad
    /// declaration or spec).
    Invalid = 1,
    /// A count passes its documented upper bound.
    Limit = 2,
    /// The worker's declared tensors differ from the job's.
    Mismatch = 3,
    /// The job is still starting: its initial servers are not all ready.
    /// Temporary: the same request may succeed later.
    Starting = 4,
    /// Another scale event is under way. Temporary.
    ChangeInProgress = 5,
    /// A worker membership change is being voted on. Temporary.
    VoteInProgress = 6,
    /// A standby answered: the leader is elsewhere (or being elected); the
    /// request was not applied.
    NotLeader = 7,
    /// The job has all the ranks it may have of that role.
    Full = 8,
    /// The request does not fit the job's state (it moved on: a move
    /// cancelled, a shard gone, a report out of order).
    Stale = 9,
    /// The very same request was applied before: a re-send after a lost
    /// answer. Its sender may take it as done.
    AlreadyApplied = 10,
    /// The server was declared lost; its shards' backups serve them now.
    Lost = 11,
    /// The operation is not possible for this job (its consistency, its
    /// last worker).
    Unsupported = 12,
    /// An operator's checkpoint failed.
    Checkpoint = 13,
    /// The message is not one the control plane answers.
    Unexpected = 14,
}

impl ErrorCode {
    /// Every code, in wire order.
    pub const ALL: [ErrorCode; 14] = [
        Self::Invalid,
        Self::Limit,
        Self::Mismatch,
        Self::Starting,
        Self::ChangeInProgress,
        Self::VoteInProgress,
        Self::NotLeader,
        Self::Full,
        Self::Stale,
        Self::AlreadyApplied,
        Self::Lost,
        Self::Unsupported,
        Self::Checkpoint,
        Self::Unexpected,
    ];

    /// The number on the wire.
    pub fn wire(self) -> u16 {
        self as u16
    }

    /// The code of a wire number, if it is one.
    pub fn from_wire(n: u32) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| u32::from(c.wire()) == n)
    }

    /// Whether the same request may be granted later without any change by
    /// its sender (the job starting, another change under way).
    pub fn is_temporary(self) -> bool {
        matches!(self, Self::Starting | Self::ChangeInProgress | Self::VoteInProgress)
    }
}

/// A refusal: its code, and a message for people.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    /// What kind of refusal (decide by this).
    pub code: ErrorCode,
    /// Why, in words (show this).
    pub message: String,
}

impl Refusal {
    /// A refusal of kind `code`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }

    /// A value of the request is unusable.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Invalid, message)
    }

    /// The request does not fit the job's state.
    pub fn stale(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Stale, message)
    }

    /// The wire message that carries it.
    pub fn into_msg(self) -> super::ControlMsg {
        super::ControlMsg::Error { code: self.code, message: self.message }
    }
}

impl super::ControlMsg {
    /// Whether this request changes the job once and may reach the control
    /// plane twice: its sender asks again after a connection dropped before
    /// the answer. The client sends it as a [`ControlMsg::Once`] with an id;
    /// the control plane remembers the latest ids applied and refuses the
    /// same id again with [`ErrorCode::AlreadyApplied`], which the sender
    /// takes as done (every other refusal stays a refusal).
    pub fn is_resendable_change(&self) -> bool {
        use super::ControlMsg as M;
        matches!(
            self,
            M::ShardReady { .. }
                | M::BackupReady { .. }
                | M::BackupSynced { .. }
                | M::Unreplicated { .. }
                | M::MoveStopped { .. }
                | M::TablesReady { .. }
                | M::RowsOut { .. }
                | M::RowsTaken { .. }
                | M::StandInReady { .. }
                | M::RowsBackedUp { .. }
                | M::Cutover { .. }
                | M::Split { .. }
                | M::Released { .. }
                | M::Vote { .. }
                | M::Leave { .. }
                | M::Finished { .. }
                | M::ServerReady { .. }
        )
    }

    /// The change a [`super::ControlMsg::Once`] carries, or the message itself.
    pub fn change(&self) -> &super::ControlMsg {
        match self {
            super::ControlMsg::Once { change, .. } => change,
            m => m,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_numbers_are_stable_and_unknown_ones_are_other() {
        for (i, c) in ErrorCode::ALL.iter().enumerate() {
            assert_eq!(usize::from(c.wire()), i + 1, "{c:?}");
            assert_eq!(ErrorCode::from_wire(c.wire().into()), Some(*c));
        }
        // The numbering is the wire format: these must never change.
        assert_eq!(ErrorCode::Mismatch.wire(), 3);
        assert_eq!(ErrorCode::NotLeader.wire(), 7);
        assert_eq!(ErrorCode::AlreadyApplied.wire(), 10);
        assert_eq!(ErrorCode::from_wire(0), None);
        assert_eq!(ErrorCode::from_wire(999), None);
        let temporary: Vec<_> = ErrorCode::ALL.iter().filter(|c| c.is_temporary()).collect();
        assert_eq!(temporary, [&ErrorCode::Starting, &ErrorCode::ChangeInProgress, &ErrorCode::VoteInProgress]);
    }
}
