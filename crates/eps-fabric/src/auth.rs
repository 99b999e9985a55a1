//! Challenge-response authentication with the job secret (HMAC-SHA256).
//!
//! Both sides send a fresh nonce; the listener proves the secret over both nonces,
//! then the dialer does, with a different label so one proof cannot be replayed as
//! the other. Proofs are compared in constant time. The secret is never logged.

use hmac::{KeyInit, Mac};

use crate::api::Secret;

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

const SERVER_LABEL: &[u8] = b"eps-fabric/v1 listener proof";
const CLIENT_LABEL: &[u8] = b"eps-fabric/v1 dialer proof";

fn proof(secret: &Secret, label: &[u8], nonce_c: &[u8; 16], nonce_s: &[u8; 16], token: u64, channel: u8) -> [u8; 32] {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut mac = <HmacSha256 as KeyInit>::new_from_slice(secret.expose()).expect("HMAC takes any key length");
    mac.update(label);
    mac.update(nonce_c);
    mac.update(nonce_s);
    mac.update(&token.to_le_bytes());
    mac.update(&[channel]);
    mac.finalize().into_bytes().into()
}

/// A fingerprint of the secret for `label` (HMAC-SHA256 of the label): tells
/// whether two parties hold the same secret without revealing it (the owner
/// of a job's state in a shared store).
pub fn fingerprint(secret: &Secret, label: &[u8]) -> [u8; 32] {
    let mut mac = <HmacSha256 as KeyInit>::new_from_slice(secret.expose()).expect("HMAC takes any key length");
    mac.update(b"eps fingerprint: ");
    mac.update(label);
    mac.finalize().into_bytes().into()
}

/// The listener's proof.
pub fn listener_proof(secret: &Secret, nonce_c: &[u8; 16], nonce_s: &[u8; 16], token: u64, channel: u8) -> [u8; 32] {
    proof(secret, SERVER_LABEL, nonce_c, nonce_s, token, channel)
}

/// The dialer's proof.
pub fn dialer_proof(secret: &Secret, nonce_c: &[u8; 16], nonce_s: &[u8; 16], token: u64, channel: u8) -> [u8; 32] {
    proof(secret, CLIENT_LABEL, nonce_c, nonce_s, token, channel)
}

/// Constant-time equality of two proofs.
pub fn proofs_equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b) {
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// A fresh random nonce from the kernel.
pub fn nonce() -> std::io::Result<[u8; 16]> {
    let mut n = [0u8; 16];
    let mut got = 0;
    while got < n.len() {
        // SAFETY: the pointer and length name the unfilled tail of `n`.
        let r = unsafe { libc::getrandom(n[got..].as_mut_ptr().cast(), n.len() - got, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        got += r as usize;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_secret_label_and_nonces() {
        let s = Secret::new("job-secret").unwrap();
        let t = Secret::new("other").unwrap();
        let (a, b) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(a, b);
        let p = listener_proof(&s, &a, &b, 1, 0);
        assert!(proofs_equal(&p, &listener_proof(&s, &a, &b, 1, 0)));
        assert!(!proofs_equal(&p, &listener_proof(&t, &a, &b, 1, 0)));
        assert!(!proofs_equal(&p, &dialer_proof(&s, &a, &b, 1, 0)));
        assert!(!proofs_equal(&p, &listener_proof(&s, &b, &a, 1, 0)));
        assert!(!proofs_equal(&p, &listener_proof(&s, &a, &b, 2, 0)));
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
    }
}
