//! The 32-bit immediates of the data plane. Every push, pull request, pull answer
//! and credit is a WRITE_WITH_IMM whose immediate says what it is:
//! `kind:3 | shard:13 | seq:16`, where `shard` is the global shard id and `seq` the
//! low 16 bits of an iteration or version (widened by [`widen_seq`]). Shard ids
//! stay the same when a shard moves between servers.

use crate::layout::MAX_SHARDS;

/// What an immediate announces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImmKind {
    /// Server to worker: the pull request for `shard` at version >= `seq` reached a
    /// server that does not serve that version (the worker routes with an old
    /// epoch); fetch the newer map and ask the owner it names. Every pull request a
    /// server will not serve is answered so, exactly once.
    PullMoved = 0,
    /// Worker to server: the gradient of iteration `seq` for `shard` has landed.
    Push = 1,
    /// Worker to server: send me `shard` at version >= `seq`.
    PullReq = 2,
    /// Server to worker: `shard` at version `seq` has landed in your buffer.
    PullDone = 3,
    /// Server to worker: your landing slot for `shard` is free again.
    Credit = 4,
    /// Server to worker: the push of iteration `seq` for `shard` belongs to another
    /// owner in a newer epoch of the shard map; fetch it and push there.
    Moved = 5,
    /// Migration source to target: the snapshot (first) or the averaged gradient
    /// producing version `seq` of `shard` has landed.
    Forward = 6,
    /// Migration target to source: version `seq` of `shard` is applied; the
    /// gradient buffer may be written again.
    ForwardAck = 7,
}

/// A decoded immediate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Imm {
    /// Kind.
    pub kind: ImmKind,
    /// Global shard id.
    pub shard: u32,
    /// Low 16 bits of the iteration or version.
    pub seq: u16,
}

impl Imm {
    /// Encodes; `shard` must be below [`MAX_SHARDS`] or a table's
    /// [`crate::layout::sparse_id`].
    pub fn encode(self) -> u32 {
        debug_assert!(self.shard < MAX_SHARDS + crate::layout::SPARSE_IDS);
        ((self.kind as u32) << 29) | ((self.shard & 0x1FFF) << 16) | self.seq as u32
    }

    /// Decodes; every 3-bit kind is defined (`Option` kept for future kinds).
    pub fn decode(v: u32) -> Option<Self> {
        let kind = match v >> 29 {
            0 => ImmKind::PullMoved,
            1 => ImmKind::Push,
            2 => ImmKind::PullReq,
            3 => ImmKind::PullDone,
            4 => ImmKind::Credit,
            5 => ImmKind::Moved,
            6 => ImmKind::Forward,
            _ => ImmKind::ForwardAck,
        };
        Some(Self { kind, shard: (v >> 16) & 0x1FFF, seq: v as u16 })
    }
}

/// The full value congruent to `low` modulo 2^16 that is nearest to `near`.
pub fn widen_seq(low: u16, near: u64) -> u64 {
    let base = near & !0xFFFF;
    let mut best = base | low as u64;
    for b in [base.checked_sub(0x1_0000), base.checked_add(0x1_0000)].into_iter().flatten() {
        let c = b | low as u64;
        if c.abs_diff(near) < best.abs_diff(near) {
            best = c;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_every_kind() {
        let kinds = [
            ImmKind::PullMoved,
            ImmKind::Push,
            ImmKind::PullReq,
            ImmKind::PullDone,
            ImmKind::Credit,
            ImmKind::Moved,
            ImmKind::Forward,
            ImmKind::ForwardAck,
        ];
        for kind in kinds {
            let last = crate::layout::TABLE_IDS as u16 - 1;
            let sparse = [crate::layout::sparse_id(0), crate::layout::sparse_id(last), crate::layout::stand_in_id(last)];
            for shard in [0, 1, 4095, MAX_SHARDS - 1].into_iter().chain(sparse) {
                for seq in [0, 1, 0x7FFF, 0xFFFF] {
                    let i = Imm { kind, shard, seq };
                    assert_eq!(Imm::decode(i.encode()), Some(i));
                }
            }
        }
        assert_eq!(Imm::decode(0x1234), Some(Imm { kind: ImmKind::PullMoved, shard: 0, seq: 0x1234 }));
        // A table's two ids name it; only the second is a stand-in's.
        use crate::layout::{is_stand_in, sparse_id, sparse_table, stand_in_id};
        assert_eq!((sparse_table(sparse_id(5)), sparse_table(stand_in_id(5))), (Some(5), Some(5)));
        assert!(!is_stand_in(sparse_id(31)) && is_stand_in(stand_in_id(0)));
        assert_eq!(sparse_table(MAX_SHARDS - 1), None);
    }

    #[test]
    fn widening_picks_the_nearest() {
        for near in [0u64, 5, 0xFFFF, 0x1_0000, 0x1_2345, 1 << 40] {
            for delta in [-3i64, 0, 1, 2, 100, 30_000] {
                let want = near as i64 + delta;
                if want < 0 {
                    continue;
                }
                assert_eq!(widen_seq(want as u16, near), want as u64, "near {near} delta {delta}");
            }
        }
    }
}
