//! One control connection, served without a thread of its own: the job
//! secret's challenge and response, framed requests read as they arrive,
//! answers written as the socket takes them.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use eps_fabric::Secret;
use eps_proto::control::{ControlMsg, MAX_FRAME};

use super::State;
use super::requests::{ConnRole, Step, Wait};
use crate::ControlError;
use crate::conn::{auth_challenge, auth_proof_holds};

/// How long a peer has to prove the job secret.
const AUTH_TIME: Duration = Duration::from_secs(10);
/// Bytes a connection may have read and not yet consumed: one frame of the
/// largest size with its length. Past it the connection is not read (its
/// peer waits: TCP backpressure) until its requests are answered; a peer
/// that sends ahead cannot make the control plane's memory grow.
const RBUF_CAP: usize = 4 + eps_proto::control::MAX_FRAME;
/// Bytes of answers a connection may have waiting to be written: past it, its
/// further requests are neither answered nor read until its peer reads.
const WBUF_CAP: usize = 4 + eps_proto::control::MAX_FRAME;
/// Requests of one connection answered in a turn of the service's loop: the
/// rest wait for the next turn, after the other connections had theirs.
const TURN: usize = 32;

#[derive(Debug)]
enum Auth {
    /// Waiting for the client's nonce (16 bytes).
    Nonce,
    /// Waiting for the client's proof (32 bytes).
    Proof {
        nonce_c: [u8; 16],
        nonce_s: [u8; 16],
    },
    Done,
}

/// A connection and where its conversation stands.
#[derive(Debug)]
pub(super) struct Conn {
    pub(super) s: TcpStream,
    auth: Auth,
    since: Instant,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    woff: usize,
    /// A request whose answer waits for the job to change.
    pub(super) wait: Option<Wait>,
    who: ConnRole,
    /// Closes once what is written has gone out (a failed proof).
    closing: bool,
    /// Closed: dropped at the end of the loop's turn.
    pub(super) dead: bool,
}

impl Conn {
    pub(super) fn new(s: TcpStream) -> Result<Self, ControlError> {
        s.set_nonblocking(true).map_err(ControlError::Io)?;
        s.set_nodelay(true).map_err(ControlError::Io)?;
        Ok(Self {
            s,
            auth: Auth::Nonce,
            since: Instant::now(),
            rbuf: Vec::new(),
            wbuf: Vec::new(),
            woff: 0,
            wait: None,
            who: ConnRole::default(),
            closing: false,
            dead: false,
        })
    }

    /// Whether it has an answer to write.
    pub(super) fn writing(&self) -> bool {
        self.woff < self.wbuf.len()
    }

    /// When it must hear from us or go: the end of its wait, or of the time
    /// to prove the secret.
    /// Whether there is room to read more (see [`RBUF_CAP`]).
    /// Whether it holds a request it can answer now (one left over from its
    /// last turn): the service's loop then does not sleep.
    pub(super) fn pending(&self) -> bool {
        matches!(self.auth, Auth::Done)
            && !self.dead
            && !self.closing
            && self.wait.is_none()
            && self.answering()
            && self.rbuf.len() >= 4
            && self.rbuf.len() >= 4 + u32::from_le_bytes(self.rbuf[..4].try_into().expect("4 bytes")) as usize
    }

    /// Whether its peer proved the job secret.
    pub(super) fn proven(&self) -> bool {
        matches!(self.auth, Auth::Done)
    }

    /// Drops a connection whose peer has not proved the secret (nothing of
    /// the job's is tied to it).
    pub(super) fn drop_unproven(&mut self) {
        debug_assert!(!self.proven());
        self.dead = true;
    }

    pub(super) fn reading(&self) -> bool {
        self.rbuf.len() < RBUF_CAP && self.answering()
    }

    /// Whether its answers not yet written leave room for more.
    fn answering(&self) -> bool {
        self.wbuf.len() - self.woff < WBUF_CAP
    }

    pub(super) fn deadline(&self) -> Option<Instant> {
        match self.auth {
            Auth::Done => self.wait.as_ref().map(Wait::deadline),
            _ => Some(self.since + AUTH_TIME),
        }
    }

    /// Reads what arrived and answers the requests now complete.
    pub(super) fn readable(&mut self, st: &mut State, secret: &Secret, hung_up: bool) {
        if hung_up && !self.reading() {
            // (Not read while full: its hang-up would be seen again and again.)
            return self.close(st);
        }
        let mut buf = [0u8; 16 << 10];
        while self.reading() {
            match self.s.read(&mut buf) {
                Ok(0) => return self.close(st),
                Ok(n) => self.rbuf.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return self.close(st),
            }
        }
        self.advance(st, secret);
    }

    pub(super) fn advance(&mut self, st: &mut State, secret: &Secret) {
        for _ in 0..TURN {
            if self.dead || self.closing || self.wait.is_some() || !self.answering() {
                break;
            }
            let done = match self.auth {
                Auth::Done => self.next_request(st),
                _ => self.authenticate(secret),
            };
            match done {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    if !matches!(
                        e,
                        ControlError::Io(_) | ControlError::Auth(_) | ControlError::NotOurs { .. } | ControlError::Protocol(_)
                    ) {
                        eps_proto::say!("eps control: a connection closes: {e}");
                    }
                    return self.close(st);
                }
            }
        }
        self.flush(st);
    }

    /// One step of the challenge and response (see `conn::auth_client`);
    /// whether it took one.
    fn authenticate(&mut self, secret: &Secret) -> Result<bool, ControlError> {
        match self.auth {
            Auth::Nonce if self.rbuf.len() >= 16 => {
                let nonce_c: [u8; 16] = self.rbuf[..16].try_into().expect("16 bytes");
                self.rbuf.drain(..16);
                let (nonce_s, answer) = auth_challenge(secret, &nonce_c)?;
                self.wbuf.extend_from_slice(&answer);
                self.auth = Auth::Proof { nonce_c, nonce_s };
                Ok(true)
            }
            Auth::Proof { nonce_c, nonce_s } if self.rbuf.len() >= 32 => {
                let proof: [u8; 32] = self.rbuf[..32].try_into().expect("32 bytes");
                self.rbuf.drain(..32);
                let ok = auth_proof_holds(secret, &nonce_c, &nonce_s, &proof);
                self.wbuf.push(ok as u8);
                self.auth = Auth::Done;
                self.closing = !ok;
                Ok(ok)
            }
            _ => Ok(false),
        }
    }

    /// Answers the next whole request in the buffer; whether there was one.
    fn next_request(&mut self, st: &mut State) -> Result<bool, ControlError> {
        if self.rbuf.len() < 4 {
            return Ok(false);
        }
        let n = u32::from_le_bytes(self.rbuf[..4].try_into().expect("4 bytes")) as usize;
        if n > MAX_FRAME {
            return Err(ControlError::Protocol("control frame too long"));
        }
        if self.rbuf.len() < 4 + n {
            return Ok(false);
        }
        let m = ControlMsg::decode(&self.rbuf[4..4 + n]).map_err(|_| ControlError::Protocol("undecodable control message"));
        self.rbuf.drain(..4 + n);
        match st.request(m?, &mut self.who)? {
            Step::Reply(r) => self.reply(&r),
            Step::Wait(w) => self.wait = Some(w),
        }
        Ok(true)
    }

    /// Answers its waiting request if the answer is due; whether it was.
    pub(super) fn retry(&mut self, st: &mut State, secret: &Secret) -> bool {
        let Some(mut w) = self.wait.take() else { return false };
        match st.try_answer(&mut w, &mut self.who) {
            Some(r) => {
                self.reply(&r);
                // (A request that came behind it is answered now.)
                self.advance(st, secret);
                true
            }
            None => {
                self.wait = Some(w);
                false
            }
        }
    }

    fn reply(&mut self, r: &ControlMsg) {
        self.wbuf.extend_from_slice(&r.encode());
    }

    /// The socket takes more: writes, then answers requests that waited for
    /// room for their answers.
    pub(super) fn writable(&mut self, st: &mut State, secret: &Secret) {
        let held = !self.answering();
        self.flush(st);
        if held && self.answering() && !self.rbuf.is_empty() {
            self.advance(st, secret);
        }
    }

    /// Writes what the socket takes.
    pub(super) fn flush(&mut self, st: &mut State) {
        while self.writing() {
            match self.s.write(&self.wbuf[self.woff..]) {
                Ok(0) => return self.close(st),
                Ok(n) => self.woff += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return self.close(st),
            }
        }
        self.wbuf.clear();
        self.woff = 0;
        if std::mem::take(&mut self.who.finishes_job) {
            // Only now may the service exit: earlier would cut this answer off.
            st.done_replied = true;
        }
        if self.closing {
            self.close(st);
        }
    }

    /// Closes it; a server whose order poll it carried has dropped it.
    pub(super) fn close(&mut self, st: &mut State) {
        if self.dead {
            return;
        }
        self.dead = true;
        self.wait = None;
        if self.who.finishes_job {
            st.done_replied = true; // (its peer went: nobody waits for the answer)
        }
        if let Some(r) = self.who.poller {
            st.dropped.insert(r, Instant::now());
        }
    }

    /// Gives up on a peer that did not prove the secret in time.
    pub(super) fn expire(&mut self, st: &mut State, now: Instant) {
        if !matches!(self.auth, Auth::Done) && now >= self.since + AUTH_TIME {
            self.close(st);
        }
    }
}
