//! Orders: what the control plane asks of a server, and their encoding.

use super::codec::{R, W};
use super::{DecodeError, MigrationKeys};

/// What the control plane asks of a server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Order {
    /// Allocate and register memory for `shard` (it will come from `from`), then
    /// report `ShardReady`.
    MigrateIn {
        /// Global shard id.
        shard: u32,
        /// Source server.
        from: u32,
        /// First element of the shard.
        start: u64,
        /// Its elements.
        len: u64,
    },
    /// Migrate `shard` to server `to` at `to_addr`, into `keys`.
    MigrateOut {
        /// Global shard id.
        shard: u32,
        /// Target server.
        to: u32,
        /// Its fabric address.
        to_addr: String,
        /// Where the target receives the shard.
        keys: MigrationKeys,
    },
    /// Leave: the job is over, or this server was scaled away and holds nothing.
    Retire,
    /// A membership change is proposed: vote the first iteration none of your
    /// shards has aggregated yet, and aggregate nothing from there on until the
    /// change is committed.
    Propose {
        /// Proposal id.
        id: u64,
    },
    /// A membership change is committed (or, to a server that joins later, one
    /// committed earlier): from iteration `at` on, `workers` contribute. Workers in
    /// `expired` lost their lease: their contributions of iterations before `at`
    /// that never arrived are dropped, and their connections are closed.
    Members {
        /// First iteration of the new contributor set.
        at: u64,
        /// The contributor set, sorted.
        workers: Vec<u32>,
        /// Workers removed because their lease expired.
        expired: Vec<u32>,
    },
    /// SSP/ASP migration source: every worker routes `shard` to its new owner now
    /// and none has a push to this server in flight; forward what is queued, then
    /// release it and report `Released`.
    Release {
        /// Global shard id.
        shard: u32,
    },
    /// Split `shard` (BSP) at the first iteration it has not aggregated: elements
    /// before `mid` become shard `lo`, the rest shard `hi`, both held here from
    /// that iteration on; report `Split`.
    Split {
        /// Global shard id.
        shard: u32,
        /// First element of the upper part.
        mid: u64,
        /// Id of the lower part.
        lo: u32,
        /// Id of the upper part.
        hi: u32,
    },
    /// Forward every update of `shard` to its backup on server `to` (at
    /// `to_addr`, into `keys`), and serve a version to pulls only once the
    /// backup acknowledged it (`job.replicas = 2`); with `snapshot`, first
    /// write the shard's master values and state into the backup (a new one,
    /// after a loss).
    Replicate {
        /// Global shard id.
        shard: u32,
        /// The backup's server.
        to: u32,
        /// Its fabric address.
        to_addr: String,
        /// Where the backup receives the snapshot and forwarded gradients.
        keys: MigrationKeys,
        /// The backup starts from a snapshot.
        snapshot: bool,
    },
    /// Keep a new backup of `shard` (`len` elements from `start`), owned by
    /// server `from`, which sends a snapshot; report `BackupReady`.
    AddBackup {
        /// Global shard id.
        shard: u32,
        /// Its owner.
        from: u32,
        /// First element.
        start: u64,
        /// Elements.
        len: u64,
    },
    /// The shard's primary was lost: this backup owns `shard` from now on.
    Promote {
        /// Global shard id.
        shard: u32,
    },
    /// Stop forwarding `shard`'s updates to its backup (it is about to move,
    /// or its backup's server leaves): once no forward or snapshot is in
    /// flight, report `Unreplicated`.
    Unreplicate {
        /// Global shard id.
        shard: u32,
    },
    /// Free this server's backup of `shard` (its owner no longer forwards).
    DropBackup {
        /// Global shard id.
        shard: u32,
    },
    /// `shard` has no backup, and none can be made now (its backup's server
    /// was lost and no other is left): serve it alone. The owner of a shard
    /// of a job with replicas applies no update until it is told where its
    /// backup is (`Replicate`) or this.
    NoBackup {
        /// Global shard id.
        shard: u32,
    },
    /// Every worker routes by a map in which `shard` left this server (by its
    /// oldest move away still remembered here): the landing slots kept for
    /// pushes routed by an older map can go.
    FreeLanding {
        /// Global shard id.
        shard: u32,
    },
    /// Sparse tables: from iteration `at` on, the buckets are owned as
    /// `runs` say. A server giving buckets away takes their rows out at
    /// version `at` and reports `RowsOut`; one receiving holds requests of
    /// `at` and later until every source's rows are in.
    Buckets {
        /// The cutover iteration.
        at: u64,
        /// The new bucket map.
        runs: crate::buckets::Runs,
    },
    /// READ the rows server `from` gives server `to` (this one, or the lost
    /// server it stands in for), from server `via` (at `from_addr`: `from`
    /// itself, or the stand-in that serves its rows if it was lost): `len`
    /// bytes at `addr` under `rkey`; then report `RowsTaken`.
    FetchRows {
        /// The source's rank.
        from: u32,
        /// The target's rank.
        to: u32,
        /// The rank of the server that holds the rows.
        via: u32,
        /// Its fabric address.
        from_addr: String,
        /// Where the rows are.
        addr: u64,
        /// Their remote key.
        rkey: u32,
        /// Their bytes.
        len: u64,
    },
    /// The rows for server `to` were taken: their memory may go.
    FreeRows {
        /// The target's rank.
        to: u32,
    },
    /// Forward every table's changes after each update, starting with all
    /// its rows, to server `to`'s copy of this server's rows (`None`: to no
    /// server from now on).
    BackupRows {
        /// The backup, if any.
        to: Option<RowsBackup>,
    },
    /// Server `from`, whose table rows this server keeps in step, was lost:
    /// serve its buckets from the copy, as it would have (report
    /// `StandInReady`), give the rows of the buckets it was giving to
    /// `give` away in its place (report `RowsOut` for each), and take in
    /// its place the rows `take` were giving it (`FetchRows` follows).
    StandIn {
        /// The lost server's rank.
        from: u32,
        /// The targets of a bucket move from it that have not taken its rows.
        give: Vec<u32>,
        /// The sources of a bucket move to it whose rows it had not taken.
        take: Vec<u32>,
    },
    /// Save every shard held here when it publishes `version` (BSP), into
    /// directory `dir`; report each as `Saved` (or missed: its version is past).
    Checkpoint {
        /// The version to save.
        version: u64,
        /// The checkpoint's directory.
        dir: String,
    },
}

/// Where a server's table rows are kept in step (see [`Order::BackupRows`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowsBackup {
    /// The backup's rank.
    pub rank: u32,
    /// Its fabric address.
    pub addr: String,
    /// By table: where a forward's descriptor is written (address, key).
    pub inbox: Vec<(u64, u32)>,
}

impl W {
    pub(super) fn order(&mut self, o: &Order) {
        match o {
            Order::MigrateIn { shard, from, start, len } => {
                self.u8(1);
                self.u32(*shard);
                self.u32(*from);
                self.u64(*start);
                self.u64(*len);
            }
            Order::MigrateOut { shard, to, to_addr, keys } => {
                self.u8(2);
                self.u32(*shard);
                self.u32(*to);
                self.str(to_addr);
                self.keys(keys);
            }
            Order::Retire => self.u8(3),
            Order::Propose { id } => {
                self.u8(4);
                self.u64(*id);
            }
            Order::Members { at, workers, expired } => {
                self.u8(5);
                self.u64(*at);
                self.ranks(workers);
                self.ranks(expired);
            }
            Order::Release { shard } => {
                self.u8(7);
                self.u32(*shard);
            }
            Order::Split { shard, mid, lo, hi } => {
                self.u8(6);
                self.u32(*shard);
                self.u64(*mid);
                self.u32(*lo);
                self.u32(*hi);
            }
            Order::Replicate { shard, to, to_addr, keys, snapshot } => {
                self.u8(9);
                self.u32(*shard);
                self.u32(*to);
                self.str(to_addr);
                self.keys(keys);
                self.u8(u8::from(*snapshot));
            }
            Order::AddBackup { shard, from, start, len } => {
                self.u8(11);
                self.u32(*shard);
                self.u32(*from);
                self.u64(*start);
                self.u64(*len);
            }
            Order::Promote { shard } => {
                self.u8(10);
                self.u32(*shard);
            }
            Order::Unreplicate { shard } => {
                self.u8(12);
                self.u32(*shard);
            }
            Order::DropBackup { shard } => {
                self.u8(13);
                self.u32(*shard);
            }
            Order::FreeLanding { shard } => {
                self.u8(14);
                self.u32(*shard);
            }
            Order::NoBackup { shard } => {
                self.u8(15);
                self.u32(*shard);
            }
            Order::Buckets { at, runs } => {
                self.u8(16);
                self.u64(*at);
                self.runs(runs);
            }
            Order::FetchRows { from, to, via, from_addr, addr, rkey, len } => {
                self.u8(17);
                self.u32(*from);
                self.u32(*to);
                self.u32(*via);
                self.str(from_addr);
                self.u64(*addr);
                self.u32(*rkey);
                self.u64(*len);
            }
            Order::FreeRows { to } => {
                self.u8(18);
                self.u32(*to);
            }
            Order::BackupRows { to } => {
                self.u8(19);
                self.u8(u8::from(to.is_some()));
                if let Some(b) = to {
                    self.u32(b.rank);
                    self.str(&b.addr);
                    self.u32(b.inbox.len() as u32);
                    for (a, k) in &b.inbox {
                        self.u64(*a);
                        self.u32(*k);
                    }
                }
            }
            Order::StandIn { from, give, take } => {
                self.u8(20);
                self.u32(*from);
                self.ranks(give);
                self.ranks(take);
            }
            Order::Checkpoint { version, dir } => {
                self.u8(8);
                self.u64(*version);
                self.str(dir);
            }
        }
    }
}

impl R<'_> {
    pub(super) fn order(&mut self) -> Result<Order, DecodeError> {
        Ok(match self.u8()? {
            4 => Order::Propose { id: self.u64()? },
            5 => Order::Members { at: self.u64()?, workers: self.ranks()?, expired: self.ranks()? },
            1 => Order::MigrateIn { shard: self.u32()?, from: self.u32()?, start: self.u64()?, len: self.u64()? },
            7 => Order::Release { shard: self.u32()? },
            6 => Order::Split { shard: self.u32()?, mid: self.u64()?, lo: self.u32()?, hi: self.u32()? },
            2 => Order::MigrateOut { shard: self.u32()?, to: self.u32()?, to_addr: self.str()?, keys: self.keys()? },
            3 => Order::Retire,
            8 => Order::Checkpoint { version: self.u64()?, dir: self.str()? },
            9 => Order::Replicate {
                shard: self.u32()?,
                to: self.u32()?,
                to_addr: self.str()?,
                keys: self.keys()?,
                snapshot: match self.u8()? {
                    0 => false,
                    1 => true,
                    t => return Err(DecodeError::Tag(t)),
                },
            },
            11 => Order::AddBackup { shard: self.u32()?, from: self.u32()?, start: self.u64()?, len: self.u64()? },
            10 => Order::Promote { shard: self.u32()? },
            12 => Order::Unreplicate { shard: self.u32()? },
            13 => Order::DropBackup { shard: self.u32()? },
            14 => Order::FreeLanding { shard: self.u32()? },
            15 => Order::NoBackup { shard: self.u32()? },
            16 => Order::Buckets { at: self.u64()?, runs: self.runs()? },
            17 => Order::FetchRows {
                from: self.u32()?,
                to: self.u32()?,
                via: self.u32()?,
                from_addr: self.str()?,
                addr: self.u64()?,
                rkey: self.u32()?,
                len: self.u64()?,
            },
            18 => Order::FreeRows { to: self.u32()? },
            19 => Order::BackupRows {
                to: match self.u8()? {
                    0 => None,
                    1 => {
                        let (rank, addr) = (self.u32()?, self.str()?);
                        let n = self.count(12)?;
                        let inbox = (0..n).map(|_| Ok((self.u64()?, self.u32()?))).collect::<Result<_, DecodeError>>()?;
                        Some(RowsBackup { rank, addr, inbox })
                    }
                    t => return Err(DecodeError::Tag(t)),
                },
            },
            20 => Order::StandIn { from: self.u32()?, give: self.ranks()?, take: self.ranks()? },
            t => return Err(DecodeError::Tag(t)),
        })
    }
}
