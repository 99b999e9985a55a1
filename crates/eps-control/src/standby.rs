//! A standby control plane's listener: it holds its address, proves the job
//! secret like the leader, and answers every request that it does not lead
//! (and who does), so clients move on to the next address. Nothing it says
//! changes the job.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use eps_fabric::Secret;
use eps_proto::control::ControlMsg;

use crate::conn::{auth_challenge, auth_proof_holds, read_msg, write_msg};

/// Answers on `listener` (a clone of it) until `stop` is set; `leader` is
/// what it says of the leader (kept up to date by the caller).
pub fn serve(
    listener: &TcpListener,
    secret: Secret,
    job: String,
    leader: Arc<Mutex<String>>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    let l = listener.try_clone()?;
    l.set_nonblocking(true)?;
    std::thread::Builder::new().name("eps-standby".into()).spawn(move || {
        while !stop.load(Ordering::Acquire) {
            match l.accept() {
                Ok((s, _)) => {
                    let (secret, job, leader, stop) = (secret.clone(), job.clone(), leader.clone(), stop.clone());
                    let _ = std::thread::Builder::new()
                        .name("eps-standby-conn".into())
                        .spawn(move || answer(s, &secret, &job, &leader, &stop));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(20)),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    })
}

/// One client: authenticated, then told for each request who leads.
fn answer(mut s: TcpStream, secret: &Secret, job: &str, leader: &Mutex<String>, stop: &AtomicBool) {
    let setup = || -> std::io::Result<()> {
        s.set_nonblocking(false)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
    };
    if setup().is_err() {
        return;
    }
    let mut nonce_c = [0u8; 16];
    if s.read_exact(&mut nonce_c).is_err() {
        return;
    }
    let Ok((nonce_s, challenge)) = auth_challenge(secret, &nonce_c) else { return };
    let mut proof = [0u8; 32];
    if s.write_all(&challenge).is_err() || s.read_exact(&mut proof).is_err() {
        return;
    }
    let ok = auth_proof_holds(secret, &nonce_c, &nonce_s, &proof);
    if s.write_all(&[u8::from(ok)]).is_err() || !ok {
        return;
    }
    while !stop.load(Ordering::Acquire) {
        if read_msg(&mut s).is_err() {
            return;
        }
        let now = leader.lock().map(|l| l.clone()).unwrap_or_default();
        let message = format!(
            "{}: a standby control plane of job {job:?} (pid {}); the leader: {}",
            crate::NOT_LEADER,
            std::process::id(),
            if now.is_empty() { "being elected" } else { &now }
        );
        if write_msg(&mut s, &ControlMsg::Error { code: eps_proto::control::ErrorCode::NotLeader, message }).is_err() {
            return;
        }
    }
}
