//! Wire formats of the `soft` provider: fixed-width little-endian frames.
//!
//! Sans-IO: encoders write into caller buffers, decoders take bytes and return typed
//! frames or a [`FrameError`]. Every decoder here reads bytes from the network and is
//! fuzzed (`fuzz/`) and property-tested.

use crate::error::WcStatus;

/// Bytes of a request header.
pub const REQ_LEN: usize = 32;
/// Bytes of a response header.
pub const RESP_LEN: usize = 16;
const REQ_MAGIC: u8 = 0xE5;
const RESP_MAGIC: u8 = 0xE6;

/// Protocol version spoken in the handshake.
pub const VERSION: u16 = 1;
const HS_MAGIC: u32 = u32::from_le_bytes(*b"EPSH");

/// Opcode of a request on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum WireOp {
    /// SEND: payload follows, lands in a posted RECV.
    Send = 1,
    /// WRITE: payload follows, lands at (rkey, addr).
    Write = 2,
    /// WRITE_WITH_IMM: as WRITE, then consumes a RECV with `imm`.
    WriteImm = 3,
    /// READ: no payload; the response carries `len` bytes from (rkey, addr).
    Read = 4,
}

impl WireOp {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Send,
            2 => Self::Write,
            3 => Self::WriteImm,
            4 => Self::Read,
            _ => return None,
        })
    }

    /// Whether `len` payload bytes follow the header on the wire.
    pub fn carries_payload(self) -> bool {
        !matches!(self, Self::Read)
    }
}

/// A request header (initiator to target).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Operation.
    pub op: WireOp,
    /// Per-QP sequence number (pairs requests with responses).
    pub seq: u32,
    /// Payload length (SEND/WRITE) or requested length (READ).
    pub len: u32,
    /// Remote key (WRITE/WRITE_IMM/READ).
    pub rkey: u32,
    /// Remote virtual address (WRITE/WRITE_IMM/READ).
    pub addr: u64,
    /// Immediate (WRITE_IMM).
    pub imm: u32,
}

/// A response header (target to initiator).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Response {
    /// Echo of the request's opcode.
    pub op: WireOp,
    /// Outcome.
    pub status: WcStatus,
    /// Echo of the request's sequence number.
    pub seq: u32,
    /// For a successful READ: bytes of data that follow.
    pub len: u32,
}

/// Why bytes could not be decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Wrong magic number.
    #[error("bad magic")]
    BadMagic,
    /// Unknown opcode.
    #[error("unknown opcode {0}")]
    BadOpcode(u8),
    /// Unknown status byte.
    #[error("unknown status {0}")]
    BadStatus(u8),
    /// A reserved field was not zero.
    #[error("reserved field not zero")]
    Reserved,
    /// Too few bytes.
    #[error("frame truncated")]
    Truncated,
    /// Fields disagree (e.g. a READ response with data but an error status).
    #[error("inconsistent frame")]
    Inconsistent,
}

const _: () = assert!(REQ_LEN == 1 + 1 + 2 + 4 + 4 + 4 + 8 + 4 + 4);
const _: () = assert!(RESP_LEN == 1 + 1 + 1 + 1 + 4 + 4 + 4);

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

impl Request {
    /// Encodes into exactly [`REQ_LEN`] bytes.
    pub fn encode(&self) -> [u8; REQ_LEN] {
        let mut b = [0u8; REQ_LEN];
        b[0] = REQ_MAGIC;
        b[1] = self.op as u8;
        b[4..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.rkey.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..28].copy_from_slice(&self.imm.to_le_bytes());
        b
    }

    /// Decodes a header; the length limit is checked by the target, not here.
    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        if b.len() < REQ_LEN {
            return Err(FrameError::Truncated);
        }
        if b[0] != REQ_MAGIC {
            return Err(FrameError::BadMagic);
        }
        let op = WireOp::from_u8(b[1]).ok_or(FrameError::BadOpcode(b[1]))?;
        if b[2] != 0 || b[3] != 0 || u32_at(b, 28) != 0 {
            return Err(FrameError::Reserved);
        }
        Ok(Self { op, seq: u32_at(b, 4), len: u32_at(b, 8), rkey: u32_at(b, 12), addr: u64_at(b, 16), imm: u32_at(b, 24) })
    }
}

impl Response {
    /// Encodes into exactly [`RESP_LEN`] bytes.
    pub fn encode(&self) -> [u8; RESP_LEN] {
        let mut b = [0u8; RESP_LEN];
        b[0] = RESP_MAGIC;
        b[1] = self.op as u8;
        b[2] = self.status as u8;
        b[4..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a header.
    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        if b.len() < RESP_LEN {
            return Err(FrameError::Truncated);
        }
        if b[0] != RESP_MAGIC {
            return Err(FrameError::BadMagic);
        }
        let op = WireOp::from_u8(b[1]).ok_or(FrameError::BadOpcode(b[1]))?;
        let status = WcStatus::from_u8(b[2]).ok_or(FrameError::BadStatus(b[2]))?;
        if b[3] != 0 || u32_at(b, 12) != 0 {
            return Err(FrameError::Reserved);
        }
        let len = u32_at(b, 8);
        // Only a successful READ response carries data.
        if len != 0 && !(op == WireOp::Read && status.is_ok()) {
            return Err(FrameError::Inconsistent);
        }
        Ok(Self { op, status, seq: u32_at(b, 4), len })
    }
}

/// Bytes of a [`ClientHello`].
pub const CLIENT_HELLO_LEN: usize = 40;
/// Bytes of a [`ServerHello`].
pub const SERVER_HELLO_LEN: usize = 56;
/// Bytes of a client proof frame.
pub const CLIENT_AUTH_LEN: usize = 36;
/// Bytes of an [`AcceptFrame`].
pub const ACCEPT_LEN: usize = 24;

/// First frame of a connection, from the dialer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientHello {
    /// 0: the dialer's requester channel; 1: the dialer's responder channel.
    pub channel: u8,
    /// 0 on channel 0; on channel 1, the token the listener returned for channel 0.
    pub token: u64,
    /// Dialer's fresh nonce.
    pub nonce: [u8; 16],
    /// Largest message the dialer accepts.
    pub max_msg_bytes: u32,
}

/// The listener's answer: its nonce and its proof.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerHello {
    /// Listener's fresh nonce.
    pub nonce: [u8; 16],
    /// HMAC proof of the secret over both nonces.
    pub proof: [u8; 32],
}

/// The listener's verdict after checking the dialer's proof.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AcceptFrame {
    /// 0 accepted, 1 authentication failed, 2 unknown token.
    pub status: u8,
    /// Token pairing the two channels of one QP.
    pub token: u64,
    /// Listener's QP number.
    pub qp_num: u32,
    /// Largest message the listener accepts.
    pub max_msg_bytes: u32,
}

impl ClientHello {
    /// Encodes.
    pub fn encode(&self) -> [u8; CLIENT_HELLO_LEN] {
        let mut b = [0u8; CLIENT_HELLO_LEN];
        b[0..4].copy_from_slice(&HS_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6] = self.channel;
        b[8..16].copy_from_slice(&self.token.to_le_bytes());
        b[16..32].copy_from_slice(&self.nonce);
        b[32..36].copy_from_slice(&self.max_msg_bytes.to_le_bytes());
        b
    }
    /// Decodes; rejects unknown versions and channels.
    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        if b.len() < CLIENT_HELLO_LEN {
            return Err(FrameError::Truncated);
        }
        if u32_at(b, 0) != HS_MAGIC || u16::from_le_bytes([b[4], b[5]]) != VERSION {
            return Err(FrameError::BadMagic);
        }
        if b[6] > 1 {
            return Err(FrameError::Inconsistent);
        }
        if b[7] != 0 || u32_at(b, 36) != 0 {
            return Err(FrameError::Reserved);
        }
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[16..32]);
        Ok(Self { channel: b[6], token: u64_at(b, 8), nonce, max_msg_bytes: u32_at(b, 32) })
    }
}

impl ServerHello {
    /// Encodes.
    pub fn encode(&self) -> [u8; SERVER_HELLO_LEN] {
        let mut b = [0u8; SERVER_HELLO_LEN];
        b[0..4].copy_from_slice(&HS_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[8..24].copy_from_slice(&self.nonce);
        b[24..56].copy_from_slice(&self.proof);
        b
    }
    /// Decodes.
    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        if b.len() < SERVER_HELLO_LEN {
            return Err(FrameError::Truncated);
        }
        if u32_at(b, 0) != HS_MAGIC || u16::from_le_bytes([b[4], b[5]]) != VERSION {
            return Err(FrameError::BadMagic);
        }
        if b[6] != 0 || b[7] != 0 {
            return Err(FrameError::Reserved);
        }
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[8..24]);
        let mut proof = [0u8; 32];
        proof.copy_from_slice(&b[24..56]);
        Ok(Self { nonce, proof })
    }
}

/// Encodes the dialer's proof.
pub fn encode_client_auth(proof: &[u8; 32]) -> [u8; CLIENT_AUTH_LEN] {
    let mut b = [0u8; CLIENT_AUTH_LEN];
    b[0..4].copy_from_slice(&HS_MAGIC.to_le_bytes());
    b[4..36].copy_from_slice(proof);
    b
}

/// Decodes the dialer's proof.
pub fn decode_client_auth(b: &[u8]) -> Result<[u8; 32], FrameError> {
    if b.len() < CLIENT_AUTH_LEN {
        return Err(FrameError::Truncated);
    }
    if u32_at(b, 0) != HS_MAGIC {
        return Err(FrameError::BadMagic);
    }
    let mut p = [0u8; 32];
    p.copy_from_slice(&b[4..36]);
    Ok(p)
}

impl AcceptFrame {
    /// Encodes.
    pub fn encode(&self) -> [u8; ACCEPT_LEN] {
        let mut b = [0u8; ACCEPT_LEN];
        b[0..4].copy_from_slice(&HS_MAGIC.to_le_bytes());
        b[4] = self.status;
        b[8..16].copy_from_slice(&self.token.to_le_bytes());
        b[16..20].copy_from_slice(&self.qp_num.to_le_bytes());
        b[20..24].copy_from_slice(&self.max_msg_bytes.to_le_bytes());
        b
    }
    /// Decodes.
    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        if b.len() < ACCEPT_LEN {
            return Err(FrameError::Truncated);
        }
        if u32_at(b, 0) != HS_MAGIC {
            return Err(FrameError::BadMagic);
        }
        if b[4] > 2 {
            return Err(FrameError::Inconsistent);
        }
        if b[5..8] != [0, 0, 0] {
            return Err(FrameError::Reserved);
        }
        Ok(Self { status: b[4], token: u64_at(b, 8), qp_num: u32_at(b, 16), max_msg_bytes: u32_at(b, 20) })
    }
}

/// Runs every decoder on `data`; used by the fuzz target and the property test.
/// Returns how many decoders accepted the bytes. Never panics.
pub fn decode_all(data: &[u8]) -> usize {
    let mut ok = 0;
    ok += Request::decode(data).is_ok() as usize;
    ok += Response::decode(data).is_ok() as usize;
    ok += ClientHello::decode(data).is_ok() as usize;
    ok += ServerHello::decode(data).is_ok() as usize;
    ok += decode_client_auth(data).is_ok() as usize;
    ok += AcceptFrame::decode(data).is_ok() as usize;
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*: a tiny seeded generator so failures replay from their seed.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
    }

    #[test]
    fn request_roundtrip_random() {
        let mut r = Rng(0x9E37_79B9_7F4A_7C15);
        for _ in 0..10_000 {
            let op = WireOp::from_u8((r.next() % 4 + 1) as u8).unwrap();
            let q = Request {
                op,
                seq: r.next() as u32,
                len: r.next() as u32,
                rkey: r.next() as u32,
                addr: r.next(),
                imm: r.next() as u32,
            };
            assert_eq!(Request::decode(&q.encode()), Ok(q));
        }
    }

    #[test]
    fn response_roundtrip_and_consistency() {
        let ok = Response { op: WireOp::Read, status: WcStatus::Success, seq: 9, len: 4096 };
        assert_eq!(Response::decode(&ok.encode()), Ok(ok));
        let bad = Response { op: WireOp::Write, status: WcStatus::Success, seq: 9, len: 1 };
        assert_eq!(Response::decode(&bad.encode()), Err(FrameError::Inconsistent));
        let err = Response { op: WireOp::Read, status: WcStatus::RemoteAccess, seq: 1, len: 0 };
        assert_eq!(Response::decode(&err.encode()), Ok(err));
    }

    #[test]
    fn handshake_roundtrip() {
        let h = ClientHello { channel: 1, token: 77, nonce: [3; 16], max_msg_bytes: 1 << 20 };
        assert_eq!(ClientHello::decode(&h.encode()), Ok(h));
        let s = ServerHello { nonce: [5; 16], proof: [6; 32] };
        assert_eq!(ServerHello::decode(&s.encode()), Ok(s));
        assert_eq!(decode_client_auth(&encode_client_auth(&[8; 32])), Ok([8; 32]));
        let a = AcceptFrame { status: 0, token: 1, qp_num: 2, max_msg_bytes: 3 };
        assert_eq!(AcceptFrame::decode(&a.encode()), Ok(a));
    }

    /// Property: no byte string makes a decoder panic, and a flipped reserved or magic
    /// byte is always rejected.
    #[test]
    fn decoders_never_panic_on_random_bytes() {
        let mut r = Rng(0xD1B5_4A32_D192_ED03);
        let mut buf = [0u8; 64];
        for i in 0..200_000 {
            let n = (r.next() % 65) as usize;
            for b in buf.iter_mut().take(n) {
                *b = r.next() as u8;
            }
            // Half the time start from a valid frame and mutate one byte.
            if i % 2 == 0 && n >= REQ_LEN {
                let q = Request { op: WireOp::Write, seq: 1, len: 2, rkey: 3, addr: 4, imm: 5 };
                buf[..REQ_LEN].copy_from_slice(&q.encode());
                let at = (r.next() % REQ_LEN as u64) as usize;
                let old = buf[at];
                buf[at] ^= (r.next() as u8) | 1;
                let res = Request::decode(&buf[..n]);
                if at == 0 || (2..4).contains(&at) || (28..32).contains(&at) {
                    assert!(res.is_err(), "seed byte {at} old {old} accepted");
                }
            }
            let _ = decode_all(&buf[..n]);
            // Whatever decodes re-encodes to the same bytes (no field is dropped).
            if let Ok(q) = Request::decode(&buf[..n]) {
                assert_eq!(&q.encode()[..], &buf[..REQ_LEN]);
            }
            if let Ok(r) = Response::decode(&buf[..n]) {
                assert_eq!(&r.encode()[..], &buf[..RESP_LEN]);
            }
        }
    }
}
