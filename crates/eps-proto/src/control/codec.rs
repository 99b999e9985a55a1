//! The control messages' wire format: `u32 length (LE) | u8 tag | fields`,
//! integers little-endian, strings as `u32 length | UTF-8 bytes`. Decoding
//! never panics on any input, and what decodes re-encodes to the same bytes.

use super::*;

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
    /// A refusal's code is not one this build knows.
    #[error("unknown refusal code {0}")]
    Code(u32),
}

pub(super) struct W(pub(super) Vec<u8>);
impl W {
    pub(super) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(super) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
    }
    pub(super) fn endpoint(&mut self, e: &ShardEndpoint) {
        self.u32(e.shard);
        self.u32(e.owner);
        self.u32(e.landing.len() as u32);
        for (a, k) in &e.landing {
            self.u64(*a);
            self.u32(*k);
        }
        self.u64(e.published_addr);
        self.u32(e.published_rkey);
    }
    pub(super) fn endpoints(&mut self, v: &[ShardEndpoint]) {
        self.u32(v.len() as u32);
        for e in v {
            self.endpoint(e);
        }
    }
    pub(super) fn keys(&mut self, k: &MigrationKeys) {
        self.u64(k.state_addr);
        self.u32(k.state_rkey);
        self.u64(k.grad_addr);
        self.u32(k.grad_rkey);
    }
    pub(super) fn map(&mut self, m: &JobMap) {
        self.u64(m.epoch);
        self.u32(m.servers.len() as u32);
        for (r, a) in &m.servers {
            self.u32(*r);
            self.str(a);
        }
        self.u32(m.routes.len() as u32);
        for r in &m.routes {
            self.endpoint(&r.owner);
            match &r.previous {
                None => self.u8(0),
                Some((e, at)) => {
                    self.u8(1);
                    self.endpoint(e);
                    self.u64(*at);
                }
            }
            self.u64(r.start);
            self.u64(r.len);
            self.u64(r.from);
            self.u64(r.until);
        }
        self.u32(m.membership.len() as u32);
        for (from, set) in &m.membership {
            self.u64(*from);
            self.ranks(set);
        }
        self.u64(m.proposal);
        self.endpoints(&m.tables);
        self.u32(m.buckets.len() as u32);
        for (at, runs) in &m.buckets {
            self.u64(*at);
            self.runs(runs);
        }
        self.u32(m.heirs.len() as u32);
        for (from, to) in &m.heirs {
            self.u32(*from);
            // (`u32::MAX`: none.)
            self.u32(to.unwrap_or(u32::MAX));
        }
    }
    pub(super) fn runs(&mut self, runs: &[(u32, u32)]) {
        self.u32(runs.len() as u32);
        for (b, o) in runs {
            self.u32(*b);
            self.u32(*o);
        }
    }
    pub(super) fn ranks(&mut self, v: &[u32]) {
        self.u32(v.len() as u32);
        for r in v {
            self.u32(*r);
        }
    }
}

pub(super) struct R<'a>(pub(super) &'a [u8]);
impl R<'_> {
    pub(super) fn take(&mut self, n: usize) -> Result<&[u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError::Truncated);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    pub(super) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    pub(super) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| DecodeError::Truncated)?))
    }
    pub(super) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| DecodeError::Truncated)?))
    }
    /// A bool, as 0 or 1.
    pub(super) fn flag(&mut self) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            t => Err(DecodeError::Tag(t)),
        }
    }
    pub(super) fn str(&mut self) -> Result<String, DecodeError> {
        let n = self.u32()? as usize;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError::Utf8)
    }
    /// A count of items of at least `min_bytes` each, bounded by the input left.
    pub(super) fn count(&mut self, min_bytes: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        if n > self.0.len() / min_bytes {
            return Err(DecodeError::Truncated);
        }
        Ok(n)
    }
    pub(super) fn role(&mut self) -> Result<Role, DecodeError> {
        match self.u8()? {
            0 => Ok(Role::Server),
            1 => Ok(Role::Worker),
            t => Err(DecodeError::Tag(t)),
        }
    }
    pub(super) fn endpoint(&mut self) -> Result<ShardEndpoint, DecodeError> {
        let (shard, owner) = (self.u32()?, self.u32()?);
        let n = self.count(12)?;
        let mut landing = Vec::with_capacity(n);
        for _ in 0..n {
            landing.push((self.u64()?, self.u32()?));
        }
        Ok(ShardEndpoint { shard, owner, landing, published_addr: self.u64()?, published_rkey: self.u32()? })
    }
    pub(super) fn endpoints(&mut self) -> Result<Vec<ShardEndpoint>, DecodeError> {
        let n = self.count(24)?;
        (0..n).map(|_| self.endpoint()).collect()
    }
    pub(super) fn keys(&mut self) -> Result<MigrationKeys, DecodeError> {
        Ok(MigrationKeys { state_addr: self.u64()?, state_rkey: self.u32()?, grad_addr: self.u64()?, grad_rkey: self.u32()? })
    }
    pub(super) fn map(&mut self) -> Result<JobMap, DecodeError> {
        let epoch = self.u64()?;
        let n = self.count(8)?;
        let mut servers = Vec::with_capacity(n);
        for _ in 0..n {
            servers.push((self.u32()?, self.str()?));
        }
        let n = self.count(57)?;
        let mut routes = Vec::with_capacity(n);
        for _ in 0..n {
            let owner = self.endpoint()?;
            let previous = match self.u8()? {
                0 => None,
                1 => Some((self.endpoint()?, self.u64()?)),
                t => return Err(DecodeError::Tag(t)),
            };
            let (start, len, from, until) = (self.u64()?, self.u64()?, self.u64()?, self.u64()?);
            routes.push(Route { owner, previous, start, len, from, until });
        }
        let n = self.count(12)?;
        let mut membership = Vec::with_capacity(n);
        for _ in 0..n {
            membership.push((self.u64()?, self.ranks()?));
        }
        let proposal = self.u64()?;
        let tables = self.endpoints()?;
        let n = self.count(12)?;
        let mut buckets = Vec::with_capacity(n);
        for _ in 0..n {
            buckets.push((self.u64()?, self.runs()?));
        }
        let n = self.count(8)?;
        let mut heirs = Vec::with_capacity(n);
        for _ in 0..n {
            let (from, to) = (self.u32()?, self.u32()?);
            heirs.push((from, (to != u32::MAX).then_some(to)));
        }
        Ok(JobMap { epoch, servers, routes, membership, proposal, tables, buckets, heirs })
    }
    pub(super) fn runs(&mut self) -> Result<crate::buckets::Runs, DecodeError> {
        let n = self.count(8)?;
        (0..n).map(|_| Ok((self.u32()?, self.u32()?))).collect()
    }
    pub(super) fn decls(&mut self) -> Result<Vec<crate::declare::TensorDecl>, DecodeError> {
        let n = self.count(13)?;
        (0..n)
            .map(|_| {
                let (name, elements) = (self.str()?, self.u64()?);
                let c = self.u8()?;
                let dtype = eps_agg::DType::from_code(c).ok_or(DecodeError::Tag(c))?;
                Ok(crate::declare::TensorDecl { name, elements, dtype })
            })
            .collect()
    }
    pub(super) fn ranks(&mut self) -> Result<Vec<u32>, DecodeError> {
        let n = self.count(4)?;
        (0..n).map(|_| self.u32()).collect()
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
            ControlMsg::ServerReady { rank, fabric_addr, shards } => {
                w.u8(3);
                w.u32(*rank);
                w.str(fabric_addr);
                w.endpoints(shards);
            }
            ControlMsg::GetMap { worker, adopted, min_epoch, iteration } => {
                w.u8(4);
                w.u32(*worker);
                w.u64(*adopted);
                w.u64(*min_epoch);
                w.u64(*iteration);
            }
            ControlMsg::Map(m) => {
                w.u8(5);
                w.map(m);
            }
            ControlMsg::Finished { role, rank } => {
                w.u8(6);
                w.u8(role_code(*role));
                w.u32(*rank);
            }
            ControlMsg::Status => w.u8(7),
            ControlMsg::StatusJson => w.u8(36),
            ControlMsg::StatusReport { text } => {
                w.u8(8);
                w.str(text);
            }
            ControlMsg::Ok => w.u8(9),
            ControlMsg::Once { id, change } => {
                w.u8(37);
                w.u64(id.0);
                w.u64(id.1);
                w.0.extend_from_slice(&change.encode()[4..]);
            }
            ControlMsg::Error { code, message } => {
                w.u8(10);
                w.u32(code.wire().into());
                w.str(message);
            }
            ControlMsg::ShardReady { endpoint, keys } => {
                w.u8(11);
                w.endpoint(endpoint);
                w.keys(keys);
            }
            ControlMsg::Cutover { shard, at } => {
                w.u8(12);
                w.u32(*shard);
                w.u64(*at);
            }
            ControlMsg::Released { shard, bytes, millis } => {
                w.u8(13);
                w.u32(*shard);
                w.u64(*bytes);
                w.u64(*millis);
            }
            ControlMsg::Scale { servers } => {
                w.u8(14);
                w.u32(*servers);
            }
            ControlMsg::Poll { rank, after } => {
                w.u8(15);
                w.u32(*rank);
                w.u64(*after);
            }
            ControlMsg::ScaleWorkers { workers } => {
                w.u8(17);
                w.u32(*workers);
            }
            ControlMsg::Vote { role, rank, id, hold } => {
                w.u8(18);
                w.u8(role_code(*role));
                w.u32(*rank);
                w.u64(*id);
                w.u64(*hold);
            }
            ControlMsg::Expire { rank } => {
                w.u8(19);
                w.u32(*rank);
            }
            ControlMsg::Split { shard, at, lo, hi } => {
                w.u8(20);
                w.u32(*shard);
                w.u64(*at);
                w.endpoint(lo);
                w.endpoint(hi);
            }
            ControlMsg::Declare { tensors } => {
                w.u8(21);
                w.u32(tensors.len() as u32);
                for t in tensors {
                    w.str(&t.name);
                    w.u64(t.elements);
                    w.u8(t.dtype.code());
                }
            }
            ControlMsg::GetSpec { rank } => {
                w.u8(22);
                w.u32(*rank);
            }
            ControlMsg::Leave { rank } => {
                w.u8(23);
                w.u32(*rank);
            }
            ControlMsg::Checkpoint { version, dir } => {
                w.u8(24);
                w.u64(*version);
                w.str(dir);
            }
            ControlMsg::Saved { version, shard, start, len, file, sha256, missed } => {
                w.u8(25);
                w.u64(*version);
                w.u32(*shard);
                w.u64(*start);
                w.u64(*len);
                w.str(file);
                w.str(sha256);
                w.u8(u8::from(*missed));
            }
            ControlMsg::SavedRows { version, table, file, sha256, buckets, changes, missed } => {
                w.u8(38);
                w.u64(*version);
                w.u32(*table);
                w.str(file);
                w.str(sha256);
                w.str(buckets);
                w.u8(u8::from(*changes));
                w.u8(u8::from(*missed));
            }
            ControlMsg::Checkpointed { version, path } => {
                w.u8(26);
                w.u64(*version);
                w.str(path);
            }
            ControlMsg::BackupReady { endpoint, keys } => {
                w.u8(27);
                w.endpoint(endpoint);
                w.keys(keys);
            }
            ControlMsg::ServerLost { rank } => {
                w.u8(28);
                w.u32(*rank);
            }
            ControlMsg::BackupSynced { shard, rank } => {
                w.u8(29);
                w.u32(*shard);
                w.u32(*rank);
            }
            ControlMsg::Unreplicated { shard, rank } => {
                w.u8(30);
                w.u32(*shard);
                w.u32(*rank);
            }
            ControlMsg::TablesReady { rank, tables } => {
                w.u8(33);
                w.u32(*rank);
                w.endpoints(tables);
            }
            ControlMsg::RowsOut { rank, from, to, addr, rkey, len } => {
                w.u8(34);
                w.u32(*rank);
                w.u32(*from);
                w.u32(*to);
                w.u64(*addr);
                w.u32(*rkey);
                w.u64(*len);
            }
            ControlMsg::RowsTaken { rank, from, to } => {
                w.u8(35);
                w.u32(*rank);
                w.u32(*from);
                w.u32(*to);
            }
            ControlMsg::RowsBackedUp { rank, backup } => {
                w.u8(40);
                w.u32(*rank);
                w.u32(*backup);
            }
            ControlMsg::StandInReady { rank, from, tables } => {
                w.u8(39);
                w.u32(*rank);
                w.u32(*from);
                w.endpoints(tables);
            }
            ControlMsg::MoveStopped { shard, rank } => {
                w.u8(32);
                w.u32(*shard);
                w.u32(*rank);
            }
            ControlMsg::Unreachable { rank, by, by_rank } => {
                w.u8(31);
                w.u32(*rank);
                w.u8(role_code(*by));
                w.u32(*by_rank);
            }
            ControlMsg::Orders { last, orders } => {
                w.u8(16);
                w.u64(*last);
                w.u32(orders.len() as u32);
                for o in orders {
                    w.order(o);
                }
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
            3 => ControlMsg::ServerReady { rank: r.u32()?, fabric_addr: r.str()?, shards: r.endpoints()? },
            4 => ControlMsg::GetMap { worker: r.u32()?, adopted: r.u64()?, min_epoch: r.u64()?, iteration: r.u64()? },
            5 => ControlMsg::Map(r.map()?),
            6 => ControlMsg::Finished { role: r.role()?, rank: r.u32()? },
            7 => ControlMsg::Status,
            8 => ControlMsg::StatusReport { text: r.str()? },
            9 => ControlMsg::Ok,
            10 => {
                let n = r.u32()?;
                ControlMsg::Error { code: ErrorCode::from_wire(n).ok_or(DecodeError::Code(n))?, message: r.str()? }
            }
            11 => ControlMsg::ShardReady { endpoint: r.endpoint()?, keys: r.keys()? },
            12 => ControlMsg::Cutover { shard: r.u32()?, at: r.u64()? },
            13 => ControlMsg::Released { shard: r.u32()?, bytes: r.u64()?, millis: r.u64()? },
            14 => ControlMsg::Scale { servers: r.u32()? },
            15 => ControlMsg::Poll { rank: r.u32()?, after: r.u64()? },
            16 => {
                let last = r.u64()?;
                let n = r.count(1)?;
                let orders = (0..n).map(|_| r.order()).collect::<Result<_, _>>()?;
                ControlMsg::Orders { last, orders }
            }
            17 => ControlMsg::ScaleWorkers { workers: r.u32()? },
            18 => ControlMsg::Vote { role: r.role()?, rank: r.u32()?, id: r.u64()?, hold: r.u64()? },
            19 => ControlMsg::Expire { rank: r.u32()? },
            20 => ControlMsg::Split { shard: r.u32()?, at: r.u64()?, lo: r.endpoint()?, hi: r.endpoint()? },
            21 => ControlMsg::Declare { tensors: r.decls()? },
            22 => ControlMsg::GetSpec { rank: r.u32()? },
            23 => ControlMsg::Leave { rank: r.u32()? },
            24 => ControlMsg::Checkpoint { version: r.u64()?, dir: r.str()? },
            25 => ControlMsg::Saved {
                version: r.u64()?,
                shard: r.u32()?,
                start: r.u64()?,
                len: r.u64()?,
                file: r.str()?,
                sha256: r.str()?,
                missed: r.flag()?,
            },
            38 => ControlMsg::SavedRows {
                version: r.u64()?,
                table: r.u32()?,
                file: r.str()?,
                sha256: r.str()?,
                buckets: r.str()?,
                changes: r.flag()?,
                missed: r.flag()?,
            },
            26 => ControlMsg::Checkpointed { version: r.u64()?, path: r.str()? },
            27 => ControlMsg::BackupReady { endpoint: r.endpoint()?, keys: r.keys()? },
            28 => ControlMsg::ServerLost { rank: r.u32()? },
            29 => ControlMsg::BackupSynced { shard: r.u32()?, rank: r.u32()? },
            30 => ControlMsg::Unreplicated { shard: r.u32()?, rank: r.u32()? },
            31 => ControlMsg::Unreachable { rank: r.u32()?, by: r.role()?, by_rank: r.u32()? },
            32 => ControlMsg::MoveStopped { shard: r.u32()?, rank: r.u32()? },
            33 => ControlMsg::TablesReady { rank: r.u32()?, tables: r.endpoints()? },
            34 => ControlMsg::RowsOut {
                rank: r.u32()?,
                from: r.u32()?,
                to: r.u32()?,
                addr: r.u64()?,
                rkey: r.u32()?,
                len: r.u64()?,
            },
            35 => ControlMsg::RowsTaken { rank: r.u32()?, from: r.u32()?, to: r.u32()? },
            40 => ControlMsg::RowsBackedUp { rank: r.u32()?, backup: r.u32()? },
            39 => ControlMsg::StandInReady { rank: r.u32()?, from: r.u32()?, tables: r.endpoints()? },
            36 => ControlMsg::StatusJson,
            37 => {
                let id = (r.u64()?, r.u64()?);
                let change = ControlMsg::decode(std::mem::take(&mut r.0))?;
                if !change.is_resendable_change() {
                    return Err(DecodeError::Tag(37));
                }
                ControlMsg::Once { id, change: Box::new(change) }
            }
            t => return Err(DecodeError::Tag(t)),
        };
        if !r.0.is_empty() {
            return Err(DecodeError::Trailing);
        }
        Ok(m)
    }
}
