//! Framed, authenticated control connections.

use std::io::{Read, Write};
use std::net::TcpStream;

use eps_fabric::Secret;
use eps_fabric::auth;
use eps_proto::control::{ControlMsg, MAX_FRAME};

use crate::ControlError;

/// Channel number that separates control-plane proofs from fabric ones.
const CONTROL_CHANNEL: u8 = 0xC0;

/// Reads one frame.
pub fn read_msg(s: &mut TcpStream) -> Result<ControlMsg, ControlError> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(ControlError::Io)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(ControlError::Protocol("control frame too long"));
    }
    let mut body = vec![0u8; n];
    s.read_exact(&mut body).map_err(ControlError::Io)?;
    ControlMsg::decode(&body).map_err(|_| ControlError::Protocol("undecodable control message"))
}

/// Writes one frame.
pub fn write_msg(s: &mut TcpStream, m: &ControlMsg) -> Result<(), ControlError> {
    s.write_all(&m.encode()).map_err(ControlError::Io)
}

/// Client side of the mutual challenge-response.
pub fn auth_client(s: &mut TcpStream, secret: &Secret) -> Result<(), ControlError> {
    let nonce_c = auth::nonce().map_err(ControlError::Io)?;
    s.write_all(&nonce_c).map_err(ControlError::Io)?;
    let mut b = [0u8; 48];
    s.read_exact(&mut b).map_err(ControlError::Io)?;
    let nonce_s: [u8; 16] = b[..16].try_into().expect("16 bytes");
    let proof: [u8; 32] = b[16..].try_into().expect("32 bytes");
    if !auth::proofs_equal(&proof, &auth::listener_proof(secret, &nonce_c, &nonce_s, 0, CONTROL_CHANNEL)) {
        return Err(ControlError::Auth("it did not prove the job secret"));
    }
    s.write_all(&auth::dialer_proof(secret, &nonce_c, &nonce_s, 0, CONTROL_CHANNEL)).map_err(ControlError::Io)?;
    let mut ok = [0u8; 1];
    s.read_exact(&mut ok).map_err(|_| ControlError::Auth("the control plane rejected our proof of the job secret"))?;
    if ok[0] != 1 {
        return Err(ControlError::Auth("the control plane rejected our proof of the job secret"));
    }
    Ok(())
}

/// Server side of the mutual challenge-response, first half: the answer to
/// the client's nonce (the server's nonce and its proof, 48 bytes).
pub fn auth_challenge(secret: &Secret, nonce_c: &[u8; 16]) -> Result<([u8; 16], [u8; 48]), ControlError> {
    let nonce_s = auth::nonce().map_err(ControlError::Io)?;
    let mut b = [0u8; 48];
    b[..16].copy_from_slice(&nonce_s);
    b[16..].copy_from_slice(&auth::listener_proof(secret, nonce_c, &nonce_s, 0, CONTROL_CHANNEL));
    Ok((nonce_s, b))
}

/// Server side, second half: whether the client's proof holds.
pub fn auth_proof_holds(secret: &Secret, nonce_c: &[u8; 16], nonce_s: &[u8; 16], proof: &[u8; 32]) -> bool {
    auth::proofs_equal(proof, &auth::dialer_proof(secret, nonce_c, nonce_s, 0, CONTROL_CHANNEL))
}
