//! The first message on every QP a server accepts. From a worker: its rank and
//! where its parameter buffer is (pull answers are written straight into it). From
//! another server (a migration source): its rank with [`PEER_BIT`] set, and a small
//! region the target acknowledges forwarded updates into.

/// Set in `rank` when the hello comes from a server migrating shards here.
pub const PEER_BIT: u32 = 1 << 31;

/// Bytes of a hello.
pub const HELLO_LEN: usize = 16;

/// A worker's hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Worker rank, or a server's rank with [`PEER_BIT`] set.
    pub rank: u32,
    /// rkey of the worker's parameter buffer.
    pub pull_rkey: u32,
    /// Address of element 0 of the worker's parameter buffer.
    pub pull_addr: u64,
}

impl Hello {
    /// Encodes.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&self.rank.to_le_bytes());
        b[4..8].copy_from_slice(&self.pull_rkey.to_le_bytes());
        b[8..16].copy_from_slice(&self.pull_addr.to_le_bytes());
        b
    }
    /// Whether a server sent it.
    pub fn is_peer(&self) -> bool {
        self.rank & PEER_BIT != 0
    }

    /// Decodes.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < HELLO_LEN {
            return None;
        }
        Some(Self {
            rank: u32::from_le_bytes(b[0..4].try_into().ok()?),
            pull_rkey: u32::from_le_bytes(b[4..8].try_into().ok()?),
            pull_addr: u64::from_le_bytes(b[8..16].try_into().ok()?),
        })
    }
}
