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

/// Where one shard's data-plane memory is on its owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardEndpoint {
    /// Global shard id.
    pub shard: u32,
    /// Owning server rank.
    pub owner: u32,
    /// Per worker rank: its landing slot for this shard as (virtual address, rkey).
    /// Each worker writes only its own slot.
    pub landing: Vec<(u64, u32)>,
    /// Published region (stamps, then two buffers): virtual address (READ in ASP).
    pub published_addr: u64,
    /// Published region rkey.
    pub published_rkey: u32,
}

/// Where a migration target receives a shard: the snapshot of its f32 master
/// parameters and optimizer state, and each forwarded f32 gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MigrationKeys {
    /// Master-and-state region address.
    pub state_addr: u64,
    /// Its rkey.
    pub state_rkey: u32,
    /// Gradient region address.
    pub grad_addr: u64,
    /// Its rkey.
    pub grad_rkey: u32,
}

/// How a worker reaches one shard at an epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// The owner (pushes of iterations from the cutover on go here).
    pub owner: ShardEndpoint,
    /// While a cutover is recent: the previous owner, and the cutover iteration
    /// (pushes of earlier iterations, and pulls of versions up to it, go there).
    pub previous: Option<(ShardEndpoint, u64)>,
    /// First element of the shard in the flat space.
    pub start: u64,
    /// Its elements.
    pub len: u64,
    /// First iteration whose pushes use this shard (a shard made by a split
    /// exists from the split's iteration on; 0 otherwise).
    pub from: u64,
    /// First iteration whose pushes no longer use it (split at that iteration
    /// into two new shards); `u64::MAX` while it is not split.
    pub until: u64,
}

impl Route {
    /// Whether pushes of `iteration` use this shard (and pulls of that version
    /// may ask it).
    pub fn alive(&self, iteration: u64) -> bool {
        self.from <= iteration && iteration < self.until
    }

    /// Where the push of `iteration` (and the pull that follows it) goes.
    pub fn for_iteration(&self, iteration: u64) -> &ShardEndpoint {
        match &self.previous {
            Some((p, at)) if iteration < *at => p,
            _ => &self.owner,
        }
    }
}

/// The shard map as workers see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobMap {
    /// Grows with every change of ownership.
    pub epoch: u64,
    /// Fabric address of every server that owns or owned a routed shard, by
    /// rank (a server declared lost is left out).
    pub servers: Vec<(u32, String)>,
    /// Per global shard id.
    pub routes: Vec<Route>,
    /// Contributor sets by iteration: `(first iteration, sorted worker ranks)`.
    pub membership: Vec<(u64, Vec<u32>)>,
    /// A membership change waiting for votes (its id; 0 when none): every member
    /// worker votes the first iteration it has not begun and holds there until
    /// the change is committed.
    pub proposal: u64,
    /// Sparse tables: per server and table, the workers' landing regions
    /// (`owner` the server, `shard` the table's index; see `TablesReady`).
    pub tables: Vec<ShardEndpoint>,
    /// Sparse tables: the bucket maps by first iteration (see
    /// [`crate::buckets`]), as runs.
    pub buckets: Vec<(u64, crate::buckets::Runs)>,
}

impl JobMap {
    /// Ids of the shards that iteration `t` pushes to (and whose pulls give
    /// version `t`), in order of their first element: a partition of the space.
    pub fn shards_at(&self, t: u64) -> Vec<usize> {
        let mut ids: Vec<usize> = (0..self.routes.len()).filter(|&i| self.routes[i].alive(t)).collect();
        ids.sort_by_key(|&i| self.routes[i].start);
        ids
    }

    /// The shards of iteration `t` that cover shard `sid`'s elements: `sid`
    /// itself while it is alive at `t`, else the shards a split made of it.
    pub fn covering(&self, sid: usize, t: u64) -> Vec<usize> {
        let Some(r) = self.routes.get(sid) else { return Vec::new() };
        if r.alive(t) {
            return vec![sid];
        }
        let (a, b) = (r.start, r.start + r.len);
        self.shards_at(t)
            .into_iter()
            .filter(|&i| self.routes[i].start < b && a < self.routes[i].start + self.routes[i].len)
            .collect()
    }

    /// Fabric address of server `rank`.
    pub fn server_addr(&self, rank: u32) -> Option<&str> {
        self.servers.iter().find(|(r, _)| *r == rank).map(|(_, a)| a.as_str())
    }
}

pub use order::Order;
pub use refusal::{ErrorCode, Refusal};

/// A control-plane message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControlMsg {
    /// Role -> control: join the job.
    Register {
        /// The role.
        role: Role,
        /// Unused (empty); kept for the record format.
        fabric_addr: String,
    },
    /// Control -> role: your rank and the job spec (TOML).
    Registered {
        /// Rank within the role.
        rank: u32,
        /// The job spec as TOML.
        spec_toml: String,
    },
    /// Worker -> control, before it registers: the model's tensors as this
    /// worker knows them. The first declaration of a job whose spec says
    /// `declare = true` fixes its layout; every other must be the same (the
    /// error names the first difference), so a refused worker takes no rank.
    /// Answered with `Registered` (rank `u32::MAX`: none) and the spec as fixed.
    Declare {
        /// The tensors, in the order of the flat parameter space.
        tensors: Vec<crate::declare::TensorDecl>,
    },
    /// Server -> control: the spec once its tensors are declared (long poll:
    /// may answer with a spec still awaiting them; ask again). Answered with
    /// `Registered`. A worker that declares nothing asks it (rank `u32::MAX`)
    /// before it registers, so that it takes no rank in a job it cannot join.
    GetSpec {
        /// The asking server's rank.
        rank: u32,
    },
    /// Worker -> control: this worker leaves the running job (BSP): voted
    /// and committed at an iteration boundary as a scale-down removing it.
    Leave {
        /// The leaving worker's rank.
        rank: u32,
    },
    /// Server -> control: listening, with the shards it was given at start.
    ServerReady {
        /// Server rank.
        rank: u32,
        /// Fabric listener address (`ip:port`).
        fabric_addr: String,
        /// Its shards' endpoints.
        shards: Vec<ShardEndpoint>,
    },
    /// Worker -> control: the map once every initial server is ready and the epoch
    /// is at least `min_epoch` (long poll: may answer with an older map after a
    /// while; ask again).
    GetMap {
        /// The asking worker's rank.
        worker: u32,
        /// The epoch its pushes are routed with now (servers it no longer needs
        /// may leave once every worker routes past them).
        adopted: u64,
        /// Smallest epoch wanted.
        min_epoch: u64,
        /// The first iteration the worker has not begun (its progress, for
        /// `eps status`).
        iteration: u64,
    },
    /// Control -> worker: the map.
    Map(JobMap),
    /// Migration target -> control: memory for a shard is registered.
    ShardReady {
        /// Its endpoint for workers.
        endpoint: ShardEndpoint,
        /// Where the source writes to.
        keys: MigrationKeys,
    },
    /// Migration source -> control: the target tracks the shard; pushes of
    /// iterations from `at` on go to the target.
    Cutover {
        /// Global shard id.
        shard: u32,
        /// The cutover iteration.
        at: u64,
    },
    /// Server -> control: `shard` was split at iteration `at` (pushes of that
    /// iteration on go to the two parts, which serve its version and later ones).
    Split {
        /// The shard split.
        shard: u32,
        /// The first iteration of the parts.
        at: u64,
        /// The lower part's endpoint.
        lo: ShardEndpoint,
        /// The upper part's endpoint.
        hi: ShardEndpoint,
    },
    /// Migration source -> control: the shard is released.
    Released {
        /// Global shard id.
        shard: u32,
        /// Bytes sent (snapshot and forwards).
        bytes: u64,
        /// From the order to the release, in milliseconds.
        millis: u64,
    },
    /// Operator -> control: scale the job to `servers` servers.
    Scale {
        /// Wanted number of servers.
        servers: u32,
    },
    /// Operator -> control: scale the job to `workers` workers (joins take new
    /// ranks; leaves drop the highest ranks).
    ScaleWorkers {
        /// Wanted number of workers.
        workers: u32,
    },
    /// Worker or server -> control: its vote on proposal `id`: it holds from
    /// iteration `hold` on until the change is committed.
    Vote {
        /// The voter's role.
        role: Role,
        /// Its rank.
        rank: u32,
        /// Proposal id.
        id: u64,
        /// First iteration it holds at.
        hold: u64,
    },
    /// Control plane (its lease clock) -> its own log: worker `rank` stopped
    /// renewing its lease and is removed at the next boundary.
    Expire {
        /// Worker rank.
        rank: u32,
    },
    /// Server -> control: orders after sequence number `after` (long poll).
    Poll {
        /// Server rank.
        rank: u32,
        /// Last order sequence number seen.
        after: u64,
    },
    /// Control -> server: orders, with the sequence number of the last one.
    Orders {
        /// Sequence number of the last order included (or `after` if none).
        last: u64,
        /// The orders.
        orders: Vec<Order>,
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
    /// Anyone -> control: report job state as one JSON object (answered by a
    /// `StatusReport` whose text is the JSON).
    StatusJson,
    /// Control -> anyone: job state, human-readable.
    StatusReport {
        /// The text.
        text: String,
    },
    /// Operator -> control: take a checkpoint (version 0: the control plane picks
    /// the next iteration no server can have reached; the record it persists
    /// names it) into `dir` (empty: the spec's `checkpoint_dir`). Answered with
    /// `Checkpointed` once complete.
    Checkpoint {
        /// The version, or 0.
        version: u64,
        /// The directory the job's checkpoints go to.
        dir: String,
    },
    /// Server -> control: shard `shard` (`len` elements from `start`) is saved
    /// at `version` in `file` of the checkpoint's directory, or (`missed`) it had
    /// passed that version when the order came.
    Saved {
        /// The checkpoint's version.
        version: u64,
        /// Global shard id.
        shard: u32,
        /// First element.
        start: u64,
        /// Elements.
        len: u64,
        /// The file's path.
        file: String,
        /// Hex SHA-256 of the file.
        sha256: String,
        /// The shard was past `version` already (nothing written).
        missed: bool,
    },
    /// Server -> control: it holds a backup of `endpoint.shard` (replicas = 2).
    BackupReady {
        /// The backup's endpoint for workers (used once it is promoted).
        endpoint: ShardEndpoint,
        /// Where the primary forwards to.
        keys: MigrationKeys,
    },
    /// Server -> control: the snapshot that starts its new backup of `shard`
    /// landed (from now on the backup may be promoted).
    BackupSynced {
        /// Shard id.
        shard: u32,
        /// The backup's server rank.
        rank: u32,
    },
    /// Server -> control: `shard`'s owner stopped forwarding to its backup
    /// (after `Unreplicate`).
    Unreplicated {
        /// Shard id.
        shard: u32,
        /// The owner's server rank.
        rank: u32,
    },
    /// Control plane -> its own log: server `rank` is lost (its connections
    /// dropped and it did not come back): backups of its shards are promoted.
    ServerLost {
        /// Server rank.
        rank: u32,
    },
    /// Worker or server -> control: its data connection to server `rank`
    /// failed, or cannot be made, while that server still polls for orders
    /// (a cut link). Reported by two peers (or by a job's only worker), the
    /// server is declared lost (a job with replicas promotes its backups and
    /// fences it off).
    Unreachable {
        /// The server that cannot be reached.
        rank: u32,
        /// Who reports it.
        by: Role,
        /// The reporter's rank.
        by_rank: u32,
    },
    /// Server -> control: the move of `shard` from server `rank` stopped
    /// before its cutover (its connection to the target failed while both
    /// still poll: a link cut between them alone). The shard stays with its
    /// owner; the control plane cancels the move and the target drops its
    /// copy.
    MoveStopped {
        /// Shard id.
        shard: u32,
        /// The source's server rank.
        rank: u32,
    },
    /// Server -> control, before `ServerReady`: where each worker WRITEs its
    /// requests for the server's part of each sparse table (`shard` is the
    /// table's index; `landing[w]` worker `w`'s region: pushes, then pulls).
    TablesReady {
        /// Server rank.
        rank: u32,
        /// One per table, in the spec's order.
        tables: Vec<ShardEndpoint>,
    },
    /// Server -> control: the rows of the buckets server `rank` gives to
    /// server `to` (every table's, as of the cutover) wait in its registered
    /// memory, `len` bytes at `addr` under `rkey`, for `to` to READ.
    RowsOut {
        /// The source's rank.
        rank: u32,
        /// The target's rank.
        to: u32,
        /// Where they are.
        addr: u64,
        /// Its remote key.
        rkey: u32,
        /// Their bytes.
        len: u64,
    },
    /// Server -> control: server `rank` took in the rows server `from` gave it.
    RowsTaken {
        /// The target's rank.
        rank: u32,
        /// The source's rank.
        from: u32,
    },
    /// Control -> operator: the checkpoint at `version` is complete in `path`.
    Checkpointed {
        /// Its version.
        version: u64,
        /// Its directory.
        path: String,
    },
    /// Control -> role: acknowledged.
    Ok,
    /// Role -> control: a resendable change ([`ControlMsg::is_resendable_change`])
    /// with the id that makes it idempotent: the control plane applies each
    /// id once and answers a re-send of it with [`ErrorCode::AlreadyApplied`].
    Once {
        /// The sender's random id (drawn when it connects) and its count of
        /// changes sent.
        id: (u64, u64),
        /// The change (never itself a `Once`).
        change: Box<ControlMsg>,
    },
    /// Control -> role: the request was refused.
    Error {
        /// What kind of refusal (stable on the wire; decide by this).
        code: ErrorCode,
        /// Why, for people.
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
    /// A refusal's code is not one this build knows.
    #[error("unknown refusal code {0}")]
    Code(u32),
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
    fn endpoint(&mut self, e: &ShardEndpoint) {
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
    fn endpoints(&mut self, v: &[ShardEndpoint]) {
        self.u32(v.len() as u32);
        for e in v {
            self.endpoint(e);
        }
    }
    fn keys(&mut self, k: &MigrationKeys) {
        self.u64(k.state_addr);
        self.u32(k.state_rkey);
        self.u64(k.grad_addr);
        self.u32(k.grad_rkey);
    }
    fn map(&mut self, m: &JobMap) {
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
    }
    fn runs(&mut self, runs: &[(u32, u32)]) {
        self.u32(runs.len() as u32);
        for (b, o) in runs {
            self.u32(*b);
            self.u32(*o);
        }
    }
    fn ranks(&mut self, v: &[u32]) {
        self.u32(v.len() as u32);
        for r in v {
            self.u32(*r);
        }
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
    /// A count of items of at least `min_bytes` each, bounded by the input left.
    fn count(&mut self, min_bytes: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        if n > self.0.len() / min_bytes {
            return Err(DecodeError::Truncated);
        }
        Ok(n)
    }
    fn role(&mut self) -> Result<Role, DecodeError> {
        match self.u8()? {
            0 => Ok(Role::Server),
            1 => Ok(Role::Worker),
            t => Err(DecodeError::Tag(t)),
        }
    }
    fn endpoint(&mut self) -> Result<ShardEndpoint, DecodeError> {
        let (shard, owner) = (self.u32()?, self.u32()?);
        let n = self.count(12)?;
        let mut landing = Vec::with_capacity(n);
        for _ in 0..n {
            landing.push((self.u64()?, self.u32()?));
        }
        Ok(ShardEndpoint { shard, owner, landing, published_addr: self.u64()?, published_rkey: self.u32()? })
    }
    fn endpoints(&mut self) -> Result<Vec<ShardEndpoint>, DecodeError> {
        let n = self.count(24)?;
        (0..n).map(|_| self.endpoint()).collect()
    }
    fn keys(&mut self) -> Result<MigrationKeys, DecodeError> {
        Ok(MigrationKeys { state_addr: self.u64()?, state_rkey: self.u32()?, grad_addr: self.u64()?, grad_rkey: self.u32()? })
    }
    fn map(&mut self) -> Result<JobMap, DecodeError> {
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
        Ok(JobMap { epoch, servers, routes, membership, proposal, tables, buckets })
    }
    fn runs(&mut self) -> Result<crate::buckets::Runs, DecodeError> {
        let n = self.count(8)?;
        (0..n).map(|_| Ok((self.u32()?, self.u32()?))).collect()
    }
    fn decls(&mut self) -> Result<Vec<crate::declare::TensorDecl>, DecodeError> {
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
    fn ranks(&mut self) -> Result<Vec<u32>, DecodeError> {
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
            ControlMsg::RowsOut { rank, to, addr, rkey, len } => {
                w.u8(34);
                w.u32(*rank);
                w.u32(*to);
                w.u64(*addr);
                w.u32(*rkey);
                w.u64(*len);
            }
            ControlMsg::RowsTaken { rank, from } => {
                w.u8(35);
                w.u32(*rank);
                w.u32(*from);
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
                missed: match r.u8()? {
                    0 => false,
                    1 => true,
                    t => return Err(DecodeError::Tag(t)),
                },
            },
            26 => ControlMsg::Checkpointed { version: r.u64()?, path: r.str()? },
            27 => ControlMsg::BackupReady { endpoint: r.endpoint()?, keys: r.keys()? },
            28 => ControlMsg::ServerLost { rank: r.u32()? },
            29 => ControlMsg::BackupSynced { shard: r.u32()?, rank: r.u32()? },
            30 => ControlMsg::Unreplicated { shard: r.u32()?, rank: r.u32()? },
            31 => ControlMsg::Unreachable { rank: r.u32()?, by: r.role()?, by_rank: r.u32()? },
            32 => ControlMsg::MoveStopped { shard: r.u32()?, rank: r.u32()? },
            33 => ControlMsg::TablesReady { rank: r.u32()?, tables: r.endpoints()? },
            34 => ControlMsg::RowsOut { rank: r.u32()?, to: r.u32()?, addr: r.u64()?, rkey: r.u32()?, len: r.u64()? },
            35 => ControlMsg::RowsTaken { rank: r.u32()?, from: r.u32()? },
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

mod order;
mod refusal;

#[cfg(test)]
mod tests;
