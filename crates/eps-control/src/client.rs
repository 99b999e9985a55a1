//! The client every role uses to talk to the control plane.

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use eps_fabric::Secret;
use eps_proto::control::{ControlMsg, Role};

use crate::ControlError;
use crate::conn::{auth_client, read_msg, write_msg};

/// An authenticated connection to the control plane.
#[derive(Debug)]
pub struct ControlClient {
    s: TcpStream,
}

impl ControlClient {
    /// Connects (retrying for up to `wait` while the control plane starts) and
    /// authenticates with the job secret.
    pub fn connect(addr: SocketAddr, secret: &Secret, wait: Duration) -> Result<Self, ControlError> {
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
        Ok(Self { s })
    }

    /// Sends a request and returns the reply; an `Error` reply becomes `Rejected`.
    pub fn call(&mut self, m: &ControlMsg) -> Result<ControlMsg, ControlError> {
        write_msg(&mut self.s, m)?;
        match read_msg(&mut self.s) {
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
