//! The client every role uses to talk to the control plane.

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use eps_fabric::Secret;
use eps_proto::control::{ControlMsg, ErrorCode, Refusal, Role};

use crate::ControlError;
use crate::conn::{auth_client, read_msg, write_msg};

/// The addresses of a job's control planes: one, or the leader and its
/// standbys in any order (`HOST:PORT[,HOST:PORT...]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControlAddrs(Vec<SocketAddr>);

impl ControlAddrs {
    /// The addresses, in the order given.
    pub fn all(&self) -> &[SocketAddr] {
        &self.0
    }
    /// The first address.
    pub fn first(&self) -> SocketAddr {
        self.0[0]
    }
}

impl From<SocketAddr> for ControlAddrs {
    fn from(a: SocketAddr) -> Self {
        Self(vec![a])
    }
}

impl From<&ControlAddrs> for ControlAddrs {
    fn from(a: &ControlAddrs) -> Self {
        a.clone()
    }
}

impl std::str::FromStr for ControlAddrs {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let v: Vec<SocketAddr> = s
            .split(',')
            .map(|a| a.trim().parse().map_err(|e| format!("{a:?} is not a control plane's IP:PORT ({e})")))
            .collect::<Result<_, _>>()?;
        if v.is_empty() {
            return Err("no control plane address".into());
        }
        Ok(Self(v))
    }
}

impl std::fmt::Display for ControlAddrs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let all: Vec<String> = self.0.iter().map(SocketAddr::to_string).collect();
        f.write_str(&all.join(","))
    }
}

/// An authenticated connection to the control plane. A connection the control
/// plane drops (it died; a restart replays its store, or a standby takes
/// over) is made again, to any of its addresses, for up to the connect wait,
/// and the request sent again. A standby's answer that it does not lead
/// sends the request on to the next address.
#[derive(Debug)]
pub struct ControlClient {
    s: TcpStream,
    addrs: ControlAddrs,
    /// The address `s` is connected to.
    at: usize,
    secret: Secret,
    wait: Duration,
    /// For clients whose requests are answered within a bound (long polls):
    /// no answer within it means a dead connection (a cut link), made again.
    silence: Option<Duration>,
    /// This client's random id, and its count of changes sent: the id of
    /// each resendable change ([`ControlMsg::Once`]).
    once: (u64, u64),
    /// Set by the owner once it no longer needs the control plane (its work
    /// is done, the job may end): a lost connection then ends the call at
    /// once, without a word, instead of being made again.
    done: Option<Arc<AtomicBool>>,
}

/// How long a client of long polls waits for an answer before it takes the
/// connection for dead ([`ControlClient::answer_within`]): ten long polls.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// How long a lost connection is made again before it is reported.
const QUIET: Duration = Duration::from_secs(1);

/// Whether an error means the control plane went away (not a slow answer).
fn lost(e: &ControlError) -> bool {
    use std::io::ErrorKind as K;
    matches!(e, ControlError::Io(io) if matches!(io.kind(),
        K::UnexpectedEof | K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe | K::NotConnected))
}

impl ControlClient {
    /// Connects (retrying for up to `wait` while the control plane starts) and
    /// authenticates with the job secret.
    pub fn connect(addrs: impl Into<ControlAddrs>, secret: &Secret, wait: Duration) -> Result<Self, ControlError> {
        let addrs = addrs.into();
        let (s, at) = Self::dial(&addrs, 0, secret, wait)?;
        let nonce = eps_fabric::auth::nonce().map_err(ControlError::Io)?;
        let id = u64::from_le_bytes(nonce[..8].try_into().expect("8 of 16 bytes"));
        Ok(Self { s, addrs, at, secret: secret.clone(), wait, silence: None, once: (id, 0), done: None })
    }

    /// Once `done` is set, a lost connection ends a call with its error at
    /// once and quietly (the job ending is no news to a client that finished).
    pub fn quiet_once(mut self, done: Arc<AtomicBool>) -> Self {
        self.done = Some(done);
        self
    }

    fn finished(&self) -> bool {
        self.done.as_ref().is_some_and(|d| d.load(Ordering::Acquire))
    }

    /// Takes a connection that answers nothing for `d` as dead: it is made
    /// again and the request sent again (for the connect wait in all). For
    /// requests answered within `d` by design (long polls, votes), so that a
    /// link cut and restored is noticed in seconds, not after TCP's backoff.
    pub fn answer_within(mut self, d: Duration) -> Result<Self, ControlError> {
        self.silence = Some(d);
        self.s.set_read_timeout(Some(d)).map_err(ControlError::Io)?;
        Ok(self)
    }

    /// The address of the control plane this client is connected to.
    pub fn peer(&self) -> SocketAddr {
        self.addrs.all()[self.at]
    }

    /// Connects to the first of `addrs`, from `start` on and around, that
    /// accepts and proves the secret; for up to `wait`.
    fn dial(addrs: &ControlAddrs, start: usize, secret: &Secret, wait: Duration) -> Result<(TcpStream, usize), ControlError> {
        let deadline = Instant::now() + wait;
        let all = addrs.all();
        // With standbys, a stopped peer must not hold up trying the next.
        let step = if all.len() > 1 { Duration::from_secs(2) } else { wait.max(Duration::from_secs(1)) };
        let mut i = start % all.len();
        let mut told = false;
        loop {
            let addr = all[i];
            let tried = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
                .map_err(|e| ControlError::Connect { addr, source: e })
                .and_then(|mut s| {
                    s.set_nodelay(true).map_err(ControlError::Io)?;
                    s.set_read_timeout(Some(step)).map_err(ControlError::Io)?;
                    auth_client(&mut s, secret)?;
                    // Every answer, including the plan (which waits for all servers), must come
                    // within `wait`: a job whose members never show up fails instead of hanging.
                    s.set_read_timeout(Some(wait.max(Duration::from_secs(1)))).map_err(ControlError::Io)?;
                    Ok(s)
                });
            match tried {
                Ok(s) => return Ok((s, i)),
                Err(ControlError::Auth(why)) => return Err(ControlError::NotOurs { addr, why }),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(e) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if !told && left > Duration::from_secs(3) {
                        // Silence for the whole wait reads as a hang.
                        told = true;
                        let why = std::error::Error::source(&e).map_or(e.to_string(), |s| format!("{e}: {s}"));
                        eps_proto::say!("eps: {why}; trying again for up to {:.0} s", left.as_secs_f64());
                    }
                    i = (i + 1) % all.len();
                    if i == start % all.len() {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            }
        }
    }

    /// Connects again, to this address first, for up to `wait`.
    fn redial(&mut self, from: usize, wait: Duration) -> Result<(), ControlError> {
        let (s, at) = Self::dial(&self.addrs, from, &self.secret, wait)?;
        if let Some(d) = self.silence {
            s.set_read_timeout(Some(d)).map_err(ControlError::Io)?;
        }
        (self.s, self.at) = (s, at);
        Ok(())
    }

    /// Sends a request and returns the reply; an `Error` reply becomes `Rejected`.
    /// If the control plane drops the connection, waits for it (or a standby)
    /// to come back (up to the connect wait) and asks again.
    pub fn call(&mut self, m: &ControlMsg) -> Result<ControlMsg, ControlError> {
        // A change that may be sent twice goes with an id, so that a re-send
        // is told from a new request.
        let once;
        let m = if m.is_resendable_change() {
            self.once.1 += 1;
            once = ControlMsg::Once { id: self.once, change: Box::new(m.clone()) };
            &once
        } else {
            m
        };
        let mut again = false;
        let mut standby_since: Option<Instant> = None;
        let started = Instant::now();
        loop {
            let r = write_msg(&mut self.s, m).and_then(|()| read_msg(&mut self.s));
            match r {
                Err(e) if self.finished() && (lost(&e) || matches!(&e, ControlError::Io(_))) => return Err(e),
                Err(ControlError::Io(e))
                    if self.silence.is_some()
                        && matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
                        && started.elapsed() < self.wait =>
                {
                    // Silent past the bound: a dead connection (a cut link).
                    eps_proto::say!(
                        "eps: no answer from the control plane at {} in {:?}; connecting again",
                        self.peer(),
                        self.silence.unwrap_or_default()
                    );
                    self.redial(self.at, self.wait.saturating_sub(started.elapsed()))?;
                    again = true;
                }
                Err(e) if lost(&e) => {
                    // Quietly at first: at the end of a job the control plane exits
                    // and nobody needs it any more.
                    if self.redial(self.at, QUIET.min(self.wait)).is_err() {
                        eps_proto::say!("eps: the control plane at {} dropped the connection; reconnecting", self.peer());
                        self.redial(self.at + 1, self.wait)?;
                        eps_proto::say!("eps: reconnected to the control plane at {}", self.peer());
                    }
                    again = true;
                }
                Ok(ControlMsg::Error { code: ErrorCode::NotLeader, message }) => {
                    // A standby: the request was not applied; the leader is elsewhere
                    // (or being elected).
                    let since = *standby_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= self.wait {
                        return Err(ControlError::Rejected(Refusal::new(ErrorCode::NotLeader, message)));
                    }
                    std::thread::sleep(Duration::from_millis(if self.addrs.all().len() == 1 { 100 } else { 20 }));
                    self.redial(self.at + 1, self.wait)?;
                }
                // Only the control plane's word that this very request was
                // applied makes a refused re-send a success.
                Ok(ControlMsg::Error { code: ErrorCode::AlreadyApplied, message }) if again => {
                    eps_proto::say!("eps: a request sent again after a reconnect was applied the first time ({message})");
                    return Ok(ControlMsg::Ok);
                }
                r => return Self::answer(r),
            }
        }
    }

    /// As [`ControlClient::call`], asking again while the refusal is
    /// temporary ([`ControlError::is_temporary`]) until `deadline`.
    pub fn call_when_possible(&mut self, m: &ControlMsg, deadline: Instant) -> Result<ControlMsg, ControlError> {
        loop {
            match self.call(m) {
                Err(e) if e.is_temporary() && Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                r => return r,
            }
        }
    }

    fn answer(r: Result<ControlMsg, ControlError>) -> Result<ControlMsg, ControlError> {
        match r {
            Ok(ControlMsg::Error { code, message }) => Err(ControlError::Rejected(Refusal::new(code, message))),
            Ok(r) => Ok(r),
            Err(ControlError::Io(e)) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                Err(ControlError::Timeout)
            }
            Err(e) => Err(e),
        }
    }

    /// Registers as a server or worker: the rank given and the job spec's text.
    pub fn register(&mut self, role: Role) -> Result<(u32, String), ControlError> {
        match self.call(&ControlMsg::Register { role, fabric_addr: String::new() })? {
            ControlMsg::Registered { rank, spec_toml } => Ok((rank, spec_toml)),
            _ => Err(ControlError::Protocol("unexpected answer to a registration")),
        }
    }
}

#[cfg(test)]
mod tests;
