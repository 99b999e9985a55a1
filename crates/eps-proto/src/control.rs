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
    /// Sparse tables: lost servers that held rows, and the server that serves
    /// their buckets from its copy of their rows (`None`: none does, and
    /// their rows are lost; itself: it had given every row away, after it
    /// applied every push it was sent). Their `tables` endpoints are the
    /// stand-in's.
    pub heirs: Vec<(u32, Option<u32>)>,
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

pub use codec::DecodeError;
pub use order::{Order, RowsBackup};
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
    /// Server -> control: the rows of table `table`'s buckets `buckets`
    /// ([`crate::checkpoint::runs_text`]) at `version` are in `file` (of this
    /// checkpoint, or of an earlier one of the same job directory where they
    /// did not change since), or (`missed`) they are not saved: `sha256` is
    /// then why, or empty if the table had passed `version`.
    SavedRows {
        /// The checkpoint's version.
        version: u64,
        /// The table's index.
        table: u32,
        /// The file's path.
        file: String,
        /// Hex SHA-256 of the file.
        sha256: String,
        /// The buckets whose rows it holds for this checkpoint.
        buckets: String,
        /// It holds their changes over earlier files, not their rows whole.
        changes: bool,
        /// Nothing was saved.
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
    /// Server -> control: the rows of the buckets server `from` gives to
    /// server `to` (every table's, as of the cutover) wait in server
    /// `rank`'s registered memory (`from` itself, or its stand-in), `len`
    /// bytes at `addr` under `rkey`, for `to` to READ.
    RowsOut {
        /// The reporting server's rank.
        rank: u32,
        /// The source's rank.
        from: u32,
        /// The target's rank.
        to: u32,
        /// Where they are.
        addr: u64,
        /// Its remote key.
        rkey: u32,
        /// Their bytes.
        len: u64,
    },
    /// Server -> control: server `rank` serves the buckets of lost server
    /// `from` from its copy of their rows (`Order::StandIn`): where each
    /// worker WRITEs its requests for them, per table (`owner` is `from`).
    /// No table: it holds no whole copy, and those rows are lost.
    StandInReady {
        /// The stand-in's rank.
        rank: u32,
        /// The lost server's rank.
        from: u32,
        /// One per table, in the spec's order (or none).
        tables: Vec<ShardEndpoint>,
    },
    /// Server -> control: server `backup` holds a whole copy of server
    /// `rank`'s table rows (it acknowledged every table's first forward of
    /// every row), kept in step from now on.
    RowsBackedUp {
        /// The owner's rank.
        rank: u32,
        /// Its backup's rank.
        backup: u32,
    },
    /// Server -> control: server `rank` took in the rows server `from` gave
    /// server `to` (`rank` itself, or the lost server it stands in for).
    RowsTaken {
        /// The reporter's rank.
        rank: u32,
        /// The source's rank.
        from: u32,
        /// The target's rank.
        to: u32,
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

mod codec;
mod order;
mod refusal;

#[cfg(test)]
mod tests;
