//! Messages between roles and the control plane, and their framing:
//! `u32 length (LE) | u8 tag | fields`, integers little-endian, strings as
//! `u32 length | UTF-8 bytes`. Decoding never panics on any input.

/// Largest frame accepted (bytes after the length field).
pub const MAX_FRAME: usize = 16 << 20;

/// Which role a process plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A parameter server.
    Server,
    /// A worker.
    Worker,
}

/// Where a server's data-plane memory is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerEndpoint {
    /// Server rank.
    pub rank: u32,
    /// Fabric listener address (`ip:port`).
    pub fabric_addr: String,
    /// Per worker rank: its landing region (gradient slots of every shard of this
    /// server) as (virtual address, rkey). Each worker writes only its own region.
    pub landing: Vec<(u64, u32)>,
    /// Published-parameters region: virtual address and rkey (READ in ASP).
    pub published_addr: u64,
    /// Published region rkey.
    pub published_rkey: u32,
}

/// A control-plane message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControlMsg {
    /// Role -> control: join the job.
    Register {
        /// The role.
        role: Role,
        /// Servers: the fabric address they listen on. Workers: empty.
        fabric_addr: String,
    },
    /// Control -> role: your rank and the job spec (TOML).
    Registered {
        /// Rank within the role.
        rank: u32,
        /// The job spec as TOML.
        spec_toml: String,
    },
    /// Server -> control: memory registered, listening.
    ServerReady(ServerEndpoint),
    /// Worker -> control: wait until every server is ready, then send the plan.
    GetPlan,
    /// Control -> worker: every server's endpoint, by rank.
    Plan {
        /// Endpoints in rank order.
        servers: Vec<ServerEndpoint>,
    },
    /// Role -> control: finished its work.
    Finished {
        /// The role.
        role: Role,
        /// Its rank.
        rank: u32,
    },
    /// Anyone -> control: report job state.
    Status,
    /// Control -> anyone: job state, human-readable.
    StatusReport {
        /// The text.
        text: String,
    },
    /// Control -> role: acknowledged.
    Ok,
    /// Control -> role: the request failed.
    Error {
        /// Why.
        message: String,
    },
}

/// Why bytes are not a message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Too few bytes.
    #[error("truncated control message")]
    Truncated,
    /// Unknown tag or enum value.
    #[error("unknown control message tag {0}")]
    Tag(u8),
    /// A string is not UTF-8.
    #[error("control message string is not UTF-8")]
    Utf8,
    /// Longer than [`MAX_FRAME`].
    #[error("control frame of {0} bytes exceeds the limit")]
    TooLong(usize),
    /// Bytes left over.
    #[error("trailing bytes in control message")]
    Trailing,
}

struct W(Vec<u8>);
impl W {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn endpoint(&mut self, e: &ServerEndpoint) {
        self.u32(e.rank);
        self.str(&e.fabric_addr);
        self.u32(e.landing.len() as u32);
        for (a, k) in &e.landing {
            self.u64(*a);
            self.u32(*k);
        }
        self.u64(e.published_addr);
        self.u32(e.published_rkey);
    }
}

struct R<'a>(&'a [u8]);
impl R<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError::Truncated);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| DecodeError::Truncated)?))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| DecodeError::Truncated)?))
    }
    fn str(&mut self) -> Result<String, DecodeError> {
        let n = self.u32()? as usize;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError::Utf8)
    }
    fn role(&mut self) -> Result<Role, DecodeError> {
        match self.u8()? {
            0 => Ok(Role::Server),
            1 => Ok(Role::Worker),
            t => Err(DecodeError::Tag(t)),
        }
    }
    fn endpoint(&mut self) -> Result<ServerEndpoint, DecodeError> {
        let rank = self.u32()?;
        let fabric_addr = self.str()?;
        let n = self.u32()? as usize;
        if n > self.0.len() / 12 {
            return Err(DecodeError::Truncated);
        }
        let mut landing = Vec::with_capacity(n);
        for _ in 0..n {
            landing.push((self.u64()?, self.u32()?));
        }
        Ok(ServerEndpoint { rank, fabric_addr, landing, published_addr: self.u64()?, published_rkey: self.u32()? })
    }
}

fn role_code(r: Role) -> u8 {
    match r {
        Role::Server => 0,
        Role::Worker => 1,
    }
}

impl ControlMsg {
    /// Encodes as a whole frame (length prefix included).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W(vec![0; 4]);
        match self {
            ControlMsg::Register { role, fabric_addr } => {
                w.u8(1);
                w.u8(role_code(*role));
                w.str(fabric_addr);
            }
            ControlMsg::Registered { rank, spec_toml } => {
                w.u8(2);
                w.u32(*rank);
                w.str(spec_toml);
            }
            ControlMsg::ServerReady(e) => {
                w.u8(3);
                w.endpoint(e);
            }
            ControlMsg::GetPlan => w.u8(4),
            ControlMsg::Plan { servers } => {
                w.u8(5);
                w.u32(servers.len() as u32);
                for e in servers {
                    w.endpoint(e);
                }
            }
            ControlMsg::Finished { role, rank } => {
                w.u8(6);
                w.u8(role_code(*role));
                w.u32(*rank);
            }
            ControlMsg::Status => w.u8(7),
            ControlMsg::StatusReport { text } => {
                w.u8(8);
                w.str(text);
            }
            ControlMsg::Ok => w.u8(9),
            ControlMsg::Error { message } => {
                w.u8(10);
                w.str(message);
            }
        }
        let n = (w.0.len() - 4) as u32;
        w.0[..4].copy_from_slice(&n.to_le_bytes());
        w.0
    }

    /// Decodes one frame body (the bytes after the length prefix).
    pub fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        if body.len() > MAX_FRAME {
            return Err(DecodeError::TooLong(body.len()));
        }
        let mut r = R(body);
        let m = match r.u8()? {
            1 => ControlMsg::Register { role: r.role()?, fabric_addr: r.str()? },
            2 => ControlMsg::Registered { rank: r.u32()?, spec_toml: r.str()? },
            3 => ControlMsg::ServerReady(r.endpoint()?),
            4 => ControlMsg::GetPlan,
            5 => {
                let n = r.u32()? as usize;
                // Each endpoint is at least 28 bytes: bound the allocation by the input.
                if n > r.0.len() / 28 {
                    return Err(DecodeError::Truncated);
                }
                let mut servers = Vec::with_capacity(n);
                for _ in 0..n {
                    servers.push(r.endpoint()?);
                }
                ControlMsg::Plan { servers }
            }
            6 => ControlMsg::Finished { role: r.role()?, rank: r.u32()? },
            7 => ControlMsg::Status,
            8 => ControlMsg::StatusReport { text: r.str()? },
            9 => ControlMsg::Ok,
            10 => ControlMsg::Error { message: r.str()? },
            t => return Err(DecodeError::Tag(t)),
        };
        if !r.0.is_empty() {
            return Err(DecodeError::Trailing);
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(rank: u32) -> ServerEndpoint {
        ServerEndpoint {
            rank,
            fabric_addr: "127.0.0.1:9".into(),
            landing: vec![(1, 2), (5, 6)],
            published_addr: 3,
            published_rkey: 4,
        }
    }

    #[test]
    fn roundtrip_and_garbage() {
        let msgs = vec![
            ControlMsg::Register { role: Role::Server, fabric_addr: "127.0.0.1:5".into() },
            ControlMsg::Registered { rank: 3, spec_toml: "[job]".into() },
            ControlMsg::ServerReady(ep(1)),
            ControlMsg::GetPlan,
            ControlMsg::Plan { servers: vec![ep(0), ep(1)] },
            ControlMsg::Finished { role: Role::Worker, rank: 2 },
            ControlMsg::Status,
            ControlMsg::StatusReport { text: "x".into() },
            ControlMsg::Ok,
            ControlMsg::Error { message: "no".into() },
        ];
        for m in msgs {
            let f = m.encode();
            assert_eq!(u32::from_le_bytes(f[..4].try_into().unwrap()) as usize, f.len() - 4);
            assert_eq!(ControlMsg::decode(&f[4..]), Ok(m.clone()));
            // Every truncation fails cleanly.
            for cut in 0..f.len() - 4 {
                assert!(ControlMsg::decode(&f[4..4 + cut]).is_err());
            }
        }
        // Random bytes never panic.
        let mut x = 0x1234_5678_9abc_def0u64;
        for _ in 0..20_000 {
            let n = (x % 64) as usize;
            let mut b = Vec::with_capacity(n);
            for _ in 0..n {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                b.push(x as u8);
            }
            let _ = ControlMsg::decode(&b);
        }
    }
}
