//! The job-secret handshake of the rdma provider, carried in rdma_cm's private
//! data so that no queue pair of the listener reaches a connected state before
//! its peer proved the secret:
//!
//! 1. The dialer connects with `Hello { nonce_c, max_msg }` (the largest message
//!    it accepts); the listener rejects it with
//!    `Challenge { nonce_s }` (and remembers the pair, once).
//! 2. The dialer connects again with `Proof { nonce_s, proof_c }`, its proof over
//!    both nonces; the listener checks it (each challenge answers once) and only
//!    then creates the queue pair and accepts, with `Accepted { proof_s, max_msg }`,
//!    its own proof under the other label and its own limit; or rejects with
//!    `Denied`. Each side then refuses to send the other more than its limit.
//! 3. The dialer checks the listener's proof before it uses the connection.
//!
//! The proofs are eps-fabric's (HMAC-SHA256 over the nonces, labelled per side,
//! compared in constant time). Messages fit rdma_cm's limits (a connect request
//! carries 56 bytes of private data on the TCP port space).

use eps_fabric::Secret;
use eps_fabric::auth::{dialer_proof, listener_proof};

const MAGIC: [u8; 4] = *b"EPSr";
/// The `channel` the proofs are bound to (distinct from the soft provider's).
pub(crate) const CHANNEL: u8 = 7;

/// One handshake message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Msg {
    Hello { nonce_c: [u8; 16], max_msg: u32 },
    Challenge { nonce_s: [u8; 16] },
    Proof { nonce_s: [u8; 16], proof_c: [u8; 32] },
    Accepted { proof_s: [u8; 32], max_msg: u32 },
    Denied,
}

impl Msg {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = MAGIC.to_vec();
        match self {
            Msg::Hello { nonce_c, max_msg } => {
                v.push(1);
                v.extend_from_slice(nonce_c);
                v.extend_from_slice(&max_msg.to_le_bytes());
            }
            Msg::Challenge { nonce_s } => {
                v.push(2);
                v.extend_from_slice(nonce_s);
            }
            Msg::Proof { nonce_s, proof_c } => {
                v.push(3);
                v.extend_from_slice(nonce_s);
                v.extend_from_slice(proof_c);
            }
            Msg::Accepted { proof_s, max_msg } => {
                v.push(4);
                v.extend_from_slice(proof_s);
                v.extend_from_slice(&max_msg.to_le_bytes());
            }
            Msg::Denied => v.push(5),
        }
        v
    }

    /// Decodes the private data of a connection event (the transport may pad it
    /// with zeros); `None` for anything else.
    pub(crate) fn decode(b: &[u8]) -> Option<Msg> {
        if b.len() < 5 || b[..4] != MAGIC {
            return None;
        }
        let body = &b[5..];
        let take16 = |o: usize| -> Option<[u8; 16]> { body.get(o..o + 16)?.try_into().ok() };
        let take32 = |o: usize| -> Option<[u8; 32]> { body.get(o..o + 32)?.try_into().ok() };
        let u32_at = |o: usize| -> Option<u32> { Some(u32::from_le_bytes(body.get(o..o + 4)?.try_into().ok()?)) };
        Some(match b[4] {
            1 => Msg::Hello { nonce_c: take16(0)?, max_msg: u32_at(16)? },
            2 => Msg::Challenge { nonce_s: take16(0)? },
            3 => Msg::Proof { nonce_s: take16(0)?, proof_c: take32(16)? },
            4 => Msg::Accepted { proof_s: take32(0)?, max_msg: u32_at(32)? },
            5 => Msg::Denied,
            _ => return None,
        })
    }
}

/// The dialer's proof.
pub(crate) fn proof_c(secret: &Secret, nonce_c: &[u8; 16], nonce_s: &[u8; 16]) -> [u8; 32] {
    dialer_proof(secret, nonce_c, nonce_s, 0, CHANNEL)
}

/// The listener's proof.
pub(crate) fn proof_s(secret: &Secret, nonce_c: &[u8; 16], nonce_s: &[u8; 16]) -> [u8; 32] {
    listener_proof(secret, nonce_c, nonce_s, 0, CHANNEL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_fit_the_limits_and_reject_garbage() {
        let msgs = [
            Msg::Hello { nonce_c: [1; 16], max_msg: 1 << 20 },
            Msg::Challenge { nonce_s: [2; 16] },
            Msg::Proof { nonce_s: [3; 16], proof_c: [4; 32] },
            Msg::Accepted { proof_s: [5; 32], max_msg: 4096 },
            Msg::Denied,
        ];
        for m in msgs {
            let mut b = m.encode();
            assert!(b.len() <= 56, "{m:?}: {} bytes", b.len());
            assert_eq!(Msg::decode(&b), Some(m.clone()));
            b.resize(56, 0); // padded by the transport
            assert_eq!(Msg::decode(&b), Some(m.clone()));
            for cut in 0..b.len().min(5) {
                assert_eq!(Msg::decode(&b[..cut]), None);
            }
        }
        assert_eq!(Msg::decode(b"EPSr\x09"), None);
        assert_eq!(Msg::decode(b"XXXX\x01aaaaaaaaaaaaaaaa"), None);
    }

    #[test]
    fn proofs_need_the_secret_and_differ_per_side() {
        let (s, t) = (Secret::new("job").unwrap(), Secret::new("other").unwrap());
        let (c, n) = ([1u8; 16], [2u8; 16]);
        assert_eq!(proof_c(&s, &c, &n), proof_c(&s, &c, &n));
        assert_ne!(proof_c(&s, &c, &n), proof_c(&t, &c, &n));
        assert_ne!(proof_c(&s, &c, &n), proof_s(&s, &c, &n));
        assert_ne!(proof_c(&s, &c, &n), proof_c(&s, &c, &[3; 16]));
    }
}
