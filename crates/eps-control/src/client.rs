//! The client every role uses to talk to the control plane.

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use eps_fabric::Secret;
use eps_proto::control::{ControlMsg, Role};

use crate::ControlError;
use crate::conn::{auth_client, read_msg, write_msg};

/// An authenticated connection to the control plane. A connection the control
/// plane drops (it died; a restart replays its store) is made again, for up to
/// the connect wait, and the request sent again.
#[derive(Debug)]
pub struct ControlClient {
    s: TcpStream,
    addr: SocketAddr,
    secret: Secret,
    wait: Duration,
}

/// How long a lost connection is made again before it is reported.
const QUIET: Duration = Duration::from_secs(1);

/// Whether an error means the control plane went away (not a slow answer).
fn lost(e: &ControlError) -> bool {
    use std::io::ErrorKind as K;
    matches!(e, ControlError::Io(io) if matches!(io.kind(),
        K::UnexpectedEof | K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe | K::NotConnected))
}

/// Requests whose refusal, when sent again after a reconnect, means the first
/// send was applied before the control plane died (its store has it).
fn applied_if_refused(m: &ControlMsg) -> bool {
    matches!(
        m,
        ControlMsg::ShardReady { .. }
            | ControlMsg::BackupReady { .. }
            | ControlMsg::BackupSynced { .. }
            | ControlMsg::Unreplicated { .. }
            | ControlMsg::MoveStopped { .. }
            | ControlMsg::TablesReady { .. }
            | ControlMsg::RowsOut { .. }
            | ControlMsg::RowsTaken { .. }
            | ControlMsg::Cutover { .. }
            | ControlMsg::Split { .. }
            | ControlMsg::Released { .. }
            | ControlMsg::Vote { .. }
            | ControlMsg::Leave { .. }
            | ControlMsg::Finished { .. }
            | ControlMsg::ServerReady { .. }
    )
}

impl ControlClient {
    /// Connects (retrying for up to `wait` while the control plane starts) and
    /// authenticates with the job secret.
    pub fn connect(addr: SocketAddr, secret: &Secret, wait: Duration) -> Result<Self, ControlError> {
        Ok(Self { s: Self::dial(addr, secret, wait)?, addr, secret: secret.clone(), wait })
    }

    fn dial(addr: SocketAddr, secret: &Secret, wait: Duration) -> Result<TcpStream, ControlError> {
        let deadline = Instant::now() + wait;
        let mut s = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => return Err(ControlError::Connect { addr, source: e }),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        s.set_nodelay(true).map_err(ControlError::Io)?;
        // Every answer, including the plan (which waits for all servers), must come
        // within `wait`: a job whose members never show up fails instead of hanging.
        s.set_read_timeout(Some(wait.max(Duration::from_secs(1)))).map_err(ControlError::Io)?;
        auth_client(&mut s, secret)?;
        Ok(s)
    }

    /// Sends a request and returns the reply; an `Error` reply becomes `Rejected`.
    /// If the control plane drops the connection, waits for it to come back
    /// (up to the connect wait) and asks again.
    pub fn call(&mut self, m: &ControlMsg) -> Result<ControlMsg, ControlError> {
        let mut again = false;
        loop {
            let r = write_msg(&mut self.s, m).and_then(|()| read_msg(&mut self.s));
            match r {
                Err(e) if lost(&e) => {
                    // Quietly at first: at the end of a job the control plane exits
                    // and nobody needs it any more.
                    self.s = match Self::dial(self.addr, &self.secret, QUIET.min(self.wait)) {
                        Ok(s) => s,
                        Err(_) => {
                            eps_proto::say!("eps: the control plane at {} dropped the connection; reconnecting", self.addr);
                            let s = Self::dial(self.addr, &self.secret, self.wait)?;
                            eps_proto::say!("eps: reconnected to the control plane at {}", self.addr);
                            s
                        }
                    };
                    // Answers may take as long as on the first connection.
                    self.s.set_read_timeout(Some(self.wait.max(Duration::from_secs(1)))).map_err(ControlError::Io)?;
                    again = true;
                }
                Ok(ControlMsg::Error { message }) if again && applied_if_refused(m) => {
                    eps_proto::say!("eps: a request sent again after a reconnect was refused ({message}): the first was applied");
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
            Ok(ControlMsg::Error { message }) => Err(ControlError::Rejected(message)),
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
