//! The client against a scripted control plane: a request whose connection
//! dropped before the answer is sent again, and only the control plane's
//! `AlreadyApplied` makes a refused re-send a success.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use eps_fabric::Secret;
use eps_proto::control::{ControlMsg, ErrorCode};

use crate::conn::{auth_challenge, auth_proof_holds, read_msg, write_msg};
use crate::{ControlClient, ControlError};

/// A control plane that serves one connection per entry of `answers`: it
/// authenticates, reads one request, then answers it (`Some`) or drops the
/// connection without an answer (`None`).
fn scripted(secret: &Secret, answers: Vec<Option<ControlMsg>>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let secret = secret.clone();
    std::thread::spawn(move || {
        for a in answers {
            let (mut s, _) = l.accept().expect("accept");
            let mut nonce_c = [0u8; 16];
            s.read_exact(&mut nonce_c).expect("nonce");
            let (nonce_s, challenge) = auth_challenge(&secret, &nonce_c).expect("challenge");
            s.write_all(&challenge).expect("challenge");
            let mut proof = [0u8; 32];
            s.read_exact(&mut proof).expect("proof");
            assert!(auth_proof_holds(&secret, &nonce_c, &nonce_s, &proof));
            s.write_all(&[1]).expect("ok");
            read_msg(&mut s).expect("a request");
            if let Some(a) = a {
                write_msg(&mut s, &a).expect("answer");
            }
        }
    });
    addr
}

fn resent(answer: ControlMsg) -> Result<ControlMsg, ControlError> {
    let secret = Secret::new(b"client-resend-test".to_vec()).expect("secret");
    let addr = scripted(&secret, vec![None, Some(answer)]);
    let mut c = ControlClient::connect(addr, &secret, Duration::from_secs(5)).expect("connect");
    c.call(&ControlMsg::Cutover { shard: 3, at: 12 })
}

#[test]
fn a_resent_change_refused_for_another_reason_stays_refused() {
    let r = resent(ControlMsg::Error { code: ErrorCode::Stale, message: "shard 3 is not being copied".into() });
    match r {
        Err(e @ ControlError::Rejected(_)) => assert_eq!(e.code(), Some(ErrorCode::Stale)),
        other => panic!("a stale refusal of a re-send must stay a refusal: {other:?}"),
    }
}

#[test]
fn a_resent_change_the_control_plane_applied_before_is_done() {
    let r = resent(ControlMsg::Error { code: ErrorCode::AlreadyApplied, message: "the same request was applied before".into() });
    assert_eq!(r.expect("applied"), ControlMsg::Ok);
}

#[test]
fn already_applied_without_a_resend_is_a_refusal() {
    let secret = Secret::new(b"client-resend-test".to_vec()).expect("secret");
    let refusal = ControlMsg::Error { code: ErrorCode::AlreadyApplied, message: "applied before".into() };
    let addr = scripted(&secret, vec![Some(refusal)]);
    let mut c = ControlClient::connect(addr, &secret, Duration::from_secs(5)).expect("connect");
    let r = c.call(&ControlMsg::Cutover { shard: 3, at: 12 });
    assert_eq!(r.err().and_then(|e| e.code()), Some(ErrorCode::AlreadyApplied));
}
