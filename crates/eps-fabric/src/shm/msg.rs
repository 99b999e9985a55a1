//! Control messages on a shm QP's socket (32 bytes each, little-endian): the
//! set-up exchange, and the announcements of the requester's regions that the
//! responder copies from and into.

/// Bytes of every control message.
pub(crate) const LEN: usize = 32;

/// This side's send-queue depth; carries its progress thread's and send CQ's eventfds.
pub(crate) const SETUP: u8 = 1;
/// The dialer's segment and its ring sizes; carries the segment's memfd.
pub(crate) const SEGMENT: u8 = 2;
/// The listener mapped the segment: the QP is ready.
pub(crate) const READY: u8 = 3;
/// A region of the requester: carries its memfd, or says where it lies in the
/// requester's address space (for memory registered in place).
pub(crate) const REGION: u8 = 4;
/// A region the requester announced is gone.
pub(crate) const FORGET: u8 = 5;

fn frame(kind: u8, a: u32, b: u32, c: u64, d: u64) -> [u8; LEN] {
    let mut m = [0u8; LEN];
    m[0] = kind;
    m[4..8].copy_from_slice(&a.to_le_bytes());
    m[8..12].copy_from_slice(&b.to_le_bytes());
    m[16..24].copy_from_slice(&c.to_le_bytes());
    m[24..32].copy_from_slice(&d.to_le_bytes());
    m
}

/// A decoded message: its kind and fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Msg {
    pub(crate) kind: u8,
    pub(crate) a: u32,
    pub(crate) b: u32,
    pub(crate) c: u64,
    pub(crate) d: u64,
}

/// Decodes `bytes` (exactly [`LEN`] of them).
pub(crate) fn decode(bytes: &[u8]) -> Option<Msg> {
    if bytes.len() != LEN || bytes[1..4] != [0, 0, 0] || bytes[12..16] != [0; 4] {
        return None;
    }
    let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
    Some(Msg { kind: bytes[0], a: u32_at(4), b: u32_at(8), c: u64_at(16), d: u64_at(24) })
}

pub(crate) fn setup(depth: u32) -> [u8; LEN] {
    frame(SETUP, depth, 0, 0, 0)
}

pub(crate) fn segment(ring: [u32; 2]) -> [u8; LEN] {
    frame(SEGMENT, ring[0], ring[1], 0, 0)
}

pub(crate) fn ready() -> [u8; LEN] {
    frame(READY, 0, 0, 0, 0)
}

/// Region `uid` of `len` bytes: in the memfd sent along (`addr` 0), or at `addr`.
pub(crate) fn region(uid: u64, len: u64, addr: u64) -> [u8; LEN] {
    let mut m = frame(REGION, 0, 0, uid, len);
    // The address rides in the a/b words.
    m[4..12].copy_from_slice(&addr.to_le_bytes());
    m
}

impl Msg {
    /// The address of a REGION message (0: the region came as a memfd).
    pub(crate) fn addr(&self) -> u64 {
        self.a as u64 | (self.b as u64) << 32
    }
}

pub(crate) fn forget(uid: u64) -> [u8; LEN] {
    frame(FORGET, 0, 0, uid, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_refuse_junk() {
        let r = decode(&region(7, 4096, 0x7f00_1234_5000)).unwrap();
        assert_eq!((r.kind, r.c, r.d, r.addr()), (REGION, 7, 4096, 0x7f00_1234_5000));
        assert_eq!(decode(&forget(9)).unwrap().c, 9);
        let s = decode(&segment([64, 128])).unwrap();
        assert_eq!((s.kind, s.a, s.b), (SEGMENT, 64, 128));
        let mut bad = setup(4);
        bad[2] = 1;
        assert!(decode(&bad).is_none());
        assert!(decode(&bad[..31]).is_none());
    }
}
