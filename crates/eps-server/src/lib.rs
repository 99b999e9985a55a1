//! # eps-server
//!
//! The parameter-server role: a thin driver around the per-shard consistency and
//! migration state machines of `eps-proto`. It registers with the control plane,
//! keeps its shards in registered memory (two published versions, one landing slot
//! per worker), sums contributions in rank order and applies the optimizer through
//! an [`eps_agg::Aggregator`], and answers pulls by writing parameters straight from
//! its registered memory into the worker's. Shards arrive and leave while the job
//! runs (see `migrate.rs`): the control plane's orders say which.
//!
//! # Memory peers reach
//! This crate holds no `unsafe`: it reaches registered memory through
//! eps-fabric's safe calls. Regions only this server writes (the published
//! copies, the master values and optimizer state, reply and forward buffers)
//! are registered without LOCAL_WRITE or REMOTE_WRITE, and the fabric gives
//! views of them; what peers write (landing slots, forwarded gradients, a
//! snapshot's inbox, sparse requests, moved buckets) is copied out before it is
//! checked or used. Which bytes a peer may write at a moment is decided by the
//! protocol (see `ShardSync`): a peer that breaks it changes only the values it
//! sent, never what this server checked.

#![forbid(unsafe_code)]

mod buckets;
mod checkpoint;
mod cut;
mod members;
mod memory;
mod metrics;
mod migrate;
mod relay;
mod replica;
mod rows_backup;
mod rows_checkpoint;
mod seed;
mod serve;
mod sparse;
mod split;
mod stand_in;
mod stand_in_give;
mod stand_in_take;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, channel};
use std::time::Duration;

use eps_agg::{Aggregator, LrSchedule, Optimizer};
use eps_control_client::client::ANSWER_WITHIN;
use eps_control_client::{ControlClient, ControlError};
use eps_core::{Answers, Members, Pending};
use eps_fabric::prelude::*;
use eps_proto::control::{ControlMsg, Order, Role, ShardEndpoint};
use eps_proto::hello::Hello;
use eps_proto::sync::ShardSync;
use eps_proto::{Consistency, JobSpec, SpecError};

pub use eps_metrics::rss_bytes;
pub use memory::{DirectRegions, HostRegions, MAX_WORKERS, MemoryError, Origin, ShardMemory, UpdateArgs};

/// How a server runs.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Control-plane address.
    pub control: eps_control_client::ControlAddrs,
    /// Job secret.
    pub secret: Secret,
    /// IP to listen on for workers (the port is chosen by the OS).
    pub listen_ip: IpAddr,
    /// The aggregator (CPU or GPU), for shards in host memory.
    pub aggregator: Arc<dyn Aggregator>,
    /// Where shards' master copies and optimizer state live between updates (a
    /// GPU), if not in host memory; updates then run there.
    pub device: Option<Arc<dyn eps_agg::ShardDevice>>,
    /// How long to wait for every worker to connect.
    pub accept_timeout: Duration,
    /// Threads an update of a large shard is split over (1 or 2).
    pub update_threads: usize,
}

/// What a server did.
#[derive(Clone, Debug, Default)]
pub struct ServerSummary {
    /// Server rank.
    pub rank: u32,
    /// Shards held at the end (migrations move shards in and out).
    pub shards: usize,
    /// Parameter elements held at the end.
    pub elements: u64,
    /// Updates applied (per shard, summed).
    pub updates: u64,
    /// Pull answers written.
    pub pulls: u64,
    /// Protocol violations by workers (each closed that worker's connection).
    pub violations: u64,
    /// Shards migrated away (released here).
    pub migrated_out: u64,
    /// Shards received by migration.
    pub migrated_in: u64,
    /// Pushes answered "moved" (routed with an old epoch).
    pub moved: u64,
    /// Shards split here.
    pub splits: u64,
    /// Rows of sparse tables held at the end.
    pub sparse_rows: u64,
    /// Rows taken in from, and given to, other servers when buckets moved.
    pub sparse_rows_in: u64,
    /// See `sparse_rows_in`.
    pub sparse_rows_out: u64,
    /// Their bytes with optimizer state.
    pub sparse_row_state_bytes: u64,
    /// Keys answered to sparse pulls, and distinct keys stepped.
    pub sparse_pulled_keys: u64,
    /// See `sparse_pulled_keys`.
    pub sparse_stepped_keys: u64,
    /// Rows evicted.
    pub sparse_evicted: u64,
    /// Rows a full table did not create.
    pub sparse_refused: u64,
    /// What the tables hold on the heap (rows, state, index, bookkeeping).
    pub sparse_heap_bytes: u64,
    /// The process's resident bytes once the tables' regions were set up,
    /// before any row (0 without tables).
    pub sparse_rss_start_bytes: u64,
    /// And once the job ended, with every row still held.
    pub sparse_rss_end_bytes: u64,
}

/// Errors of the server role.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// Talking to the control plane failed.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The spec handed out by the control plane is unusable.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The fabric failed.
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// Memory could not be registered.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The control plane answered something unexpected.
    #[error("unexpected answer from the control plane")]
    Unexpected,
    /// The aggregator rejected its buffers.
    #[error(transparent)]
    Agg(#[from] eps_agg::AggError),
    /// A migration could not proceed.
    #[error("migration: {0}")]
    Migration(String),
    /// A membership change cannot be applied.
    #[error("membership: {0}")]
    Membership(String),
    /// An update cannot run as asked (a bug, or a peer that broke the protocol).
    #[error("shard {shard}: {source}")]
    Update {
        /// The shard.
        shard: u32,
        /// Why.
        source: eps_core::CoreError,
    },
    /// A work request could not be posted.
    #[error("posting {op:?} to {peer}: {source}")]
    Post {
        /// Who the connection is to.
        peer: String,
        /// The operation.
        op: SendOp,
        /// Why.
        source: FabricError,
    },
    /// A checkpoint cannot be restored.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// More workers than one server can sum.
    #[error("{0} workers: a server sums at most 64 contributions")]
    TooManyWorkers(u32),
    /// A sparse table refused an update or a pull.
    #[error("sparse table: {0}")]
    Sparse(String),
}

/// Work-request ids: kind in the top two bits.
const WR_PULL: u64 = 1 << 62;
const WR_MIGRATE: u64 = 2 << 62;
pub(crate) const WR_OTHER: u64 = 3 << 62;
const WR_HELLO: u64 = 1;

/// A pull answer's work-request id: shard (13 bits), worker (6), version (43).
fn pull_wr(shard: u32, worker: u32, version: u64) -> u64 {
    WR_PULL | (u64::from(shard) << 49) | (u64::from(worker) << 43) | (version & ((1 << 43) - 1))
}

fn pull_wr_parts(wr: u64) -> (u32, u32, u64) {
    (((wr >> 49) & 0x1FFF) as u32, ((wr >> 43) & 0x3F) as u32, wr & ((1 << 43) - 1))
}

/// Who is at the other end of a connection.
#[derive(Clone, Copy, Debug)]
enum Peer {
    /// Nothing received yet.
    Unknown,
    /// A worker.
    Worker(Hello),
    /// Another server migrating shards here or forwarding to backups here
    /// (acknowledgements go to its region).
    Server(Hello),
    /// A server this one dialed to migrate shards to or forward to backups on.
    Target(u32),
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Unknown => f.write_str("a peer that has not said hello"),
            Peer::Worker(h) => write!(f, "worker {}", h.rank),
            Peer::Server(h) => write!(f, "server {} (forwarding here)", h.rank & !eps_proto::hello::PEER_BIT),
            Peer::Target(r) => write!(f, "server {r} (forwarded to)"),
        }
    }
}

struct Conn<P: Fabric> {
    /// `None` once closed.
    qp: Option<P::Qp>,
    /// The queue pair's number (kept once closed: flushed requests name it).
    qp_num: u32,
    peer: Peer,
    alive: bool,
    hello: P::Mr,
}

impl<P: Fabric> Conn<P> {
    fn qp(&self) -> Result<&P::Qp, FabricError> {
        self.qp.as_ref().ok_or(FabricError::InvalidArgument("the connection is closed"))
    }

    /// Posts a send-queue work request; an error names the peer and the operation.
    fn post(&self, wr: &SendWr<'_, P::Mr>) -> Result<(), ServerError> {
        self.qp()?.post_send(wr).map_err(|source| ServerError::Post { peer: self.peer.to_string(), op: wr.op, source })
    }

    /// Posts on a connection that may have closed since it was chosen (its
    /// peer failed): as a queue pair in the error state does, a request on a
    /// closed connection completes flushed, into `flushed`, which the loop
    /// takes on its next turn. The code after a post goes on as after any
    /// post, and the failure is handled where any failed completion is.
    fn post_or_flush(&self, wr: &SendWr<'_, P::Mr>, flushed: &mut Vec<Completion>) -> Result<(), ServerError> {
        if self.qp.is_some() {
            return self.post(wr);
        }
        let opcode = match wr.op {
            SendOp::Send => WcOpcode::Send,
            SendOp::Write(_) | SendOp::WriteImm(..) => WcOpcode::Write,
            SendOp::Read(_) => WcOpcode::Read,
        };
        flushed.push(Completion {
            wr_id: wr.wr_id,
            status: WcStatus::WrFlush,
            opcode,
            byte_len: 0,
            imm: None,
            qp_num: self.qp_num,
        });
        Ok(())
    }
}

/// A shard held here.
pub(crate) struct Held {
    /// Its consistency state and the updates parked until it is free.
    core: eps_core::ShardCore,
    /// Migrating away: the source side.
    out: Option<migrate::Outgoing>,
    /// Arriving: from which server, and once the snapshot has landed, the
    /// connection it came on (forwards follow there).
    incoming: Option<eps_core::MoveIn<usize>>,
    /// A split ordered and waiting for the shard to have no update parked.
    split: Option<split::SplitOrder>,
    /// Its part in replication (`job.replicas = 2`).
    replica: replica::Replica,
    /// A new backup (`Order::Replicate` with a snapshot) ordered while the
    /// shard still arrives here: started once it caught up.
    new_backup: Option<eps_proto::control::Order>,
    /// Waiting for worker 0's initial values (`model.init = "worker"`): the
    /// pull requests that came meanwhile, answered once they are in.
    seed: Option<Vec<seed::PullAsked>>,
}

impl Held {
    /// Arriving here, and its snapshot has not landed yet.
    fn awaits_snapshot(&self) -> bool {
        self.incoming.as_ref().is_some_and(|m| !m.landed())
    }
}

pub(crate) struct Server<P: Fabric> {
    rank: u32,
    /// Workers at the start (SSP/ASP scale each contribution by it).
    workers: u32,
    /// Worker ranks the job may admit (landing slots per shard).
    ranks: u32,
    mode: Consistency,
    /// Whether shards have backups (`job.replicas = 2`).
    replicated: bool,
    opt: Optimizer,
    sched: LrSchedule,
    agg: Arc<dyn Aggregator>,
    mem: ShardMemory<P>,
    /// By global shard id.
    shards: Vec<Option<Held>>,
    conns: Vec<Conn<P>>,
    /// Worker rank -> connection index.
    by_rank: Vec<Option<usize>>,
    /// QP number -> connection index.
    by_qp: HashMap<u32, usize>,
    /// Requests posted on closed connections, completed flushed (see `Conn::post_or_flush`).
    flushed: Vec<Completion>,
    /// Shards seeded from worker 0's initial values so far, and shards it
    /// gave none for.
    seeded: (u32, u32),
    /// Target server rank -> connection index (dialed for migrations).
    targets: HashMap<u32, usize>,
    pd: P,
    cq: P::Cq,
    opts: QpOptions,
    /// Acknowledgements of forwarded updates land here (zero-length writes).
    acks: P::Mr,
    ctl: ControlClient,
    summary: ServerSummary,
    /// Its series of the process's metrics.
    metrics: metrics::Metrics,
    ready: Vec<(u32, u64)>,
    threads: usize,
    /// Contributor sets by iteration, the hold of an open vote, workers lost
    /// with their leases (see `members.rs`).
    members: Members,
    /// Landing regions of released shards, kept so that a push routed with an old
    /// epoch still lands in bounds and is answered "moved".
    /// The shard moved away, for the slots of a completed move (freed when
    /// every worker routes by a newer map: `Order::FreeLanding`).
    retained: Vec<(Option<u32>, Vec<P::Mr>)>,
    /// Moves ordered while their shard's backup had not acknowledged its last
    /// update: started once it has (see `replica.rs`).
    parked_moves: Vec<eps_proto::control::Order>,
    /// Pushes answered "moved" and pull WRITEs in flight.
    answers: Answers,
    /// Pulls to a worker whose connection was dropped: they will never complete,
    /// so the event loop releases their buffers (see `drop_conn`).
    orphaned: Vec<u64>,
    retired: bool,
    /// By global shard id: (first element, elements).
    spans: Vec<(u64, u64)>,
    /// Element ranges of averaged tensors (a framework's buffers), not trained.
    averaged: Vec<(u64, u64)>,
    /// Checkpoints to save, and the thread writing them.
    saver: checkpoint::Saver,
    /// The parts of the sparse tables held here.
    sparse: sparse::Sparse<P>,
}

/// A server that has registered with the control plane: its rank and the job's
/// spec, from which the caller picks the fabric to run on (see [`run_on`]).
pub struct Registration {
    rank: u32,
    spec: JobSpec,
    ctl: ControlClient,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration").field("rank", &self.rank).field("job", &self.spec.job.name).finish()
    }
}

impl Registration {
    /// The rank the control plane gave this server.
    pub fn rank(&self) -> u32 {
        self.rank
    }
    /// The job's spec.
    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }
}

/// Registers with the control plane as a server. When the job's workers
/// declare its tensors (`model.declare`), waits (without a time limit) until
/// the first one has.
pub fn register(cfg: &ServerConfig) -> Result<Registration, ServerError> {
    let mut ctl = ControlClient::connect(cfg.control.clone(), &cfg.secret, cfg.accept_timeout)?;
    let (rank, spec_text) = ctl.register(Role::Server)?;
    eps_proto::say!("eps server {rank}: registered (pid {})", std::process::id());
    let mut spec = JobSpec::from_toml(&spec_text)?;
    if spec.awaits_declaration() {
        eps_proto::say!("eps server {rank}: waiting for the first worker to declare the model's tensors");
    }
    while spec.awaits_declaration() {
        match ctl.call(&ControlMsg::GetSpec { rank })? {
            ControlMsg::Registered { spec_toml, .. } => spec = JobSpec::from_toml(&spec_toml)?,
            _ => return Err(ServerError::Control(ControlError::Protocol("unexpected answer to a spec request"))),
        }
    }
    Ok(Registration { rank, spec, ctl })
}

/// Runs a server on the `soft` fabric until the control plane retires it (the job
/// is over, or it was scaled away and holds nothing).
pub fn run(cfg: &ServerConfig) -> Result<ServerSummary, ServerError> {
    let reg = register(cfg)?;
    run_on(cfg, reg, SoftDevice::open()?.alloc_pd())
}

/// Runs a registered server with its memory and connections on `pd`'s provider
/// (`cfg.listen_ip` must be an address of that provider's device), until the
/// control plane retires it.
pub fn run_on<P: Fabric>(cfg: &ServerConfig, reg: Registration, pd: P) -> Result<ServerSummary, ServerError> {
    run_direct(cfg, reg, pd, None)
}

/// As [`run_on`]; with `direct` (and `cfg.device`), the shards' landing slots and
/// published copies are the device's own memory, which peers reach in place
/// (GPUDirect RDMA) and the device sums from and publishes into.
pub fn run_direct<P: Fabric>(
    cfg: &ServerConfig,
    reg: Registration,
    pd: P,
    direct: Option<Arc<dyn DirectRegions<P>>>,
) -> Result<ServerSummary, ServerError> {
    let Registration { rank, spec, ctl } = reg;
    let layout = spec.layout()?;
    let (opt, sched) = (spec.optimizer()?, spec.schedule()?);
    let workers = spec.job.workers;
    // Every rank the job may admit has a landing slot.
    let ranks = spec.job.rank_limit();
    if ranks as usize > MAX_WORKERS {
        return Err(ServerError::TooManyWorkers(ranks));
    }
    let seed = spec.job.seed;
    let total = layout.shards.len();
    let mut mem = ShardMemory::new(&pd, layout.dtype, ranks, &opt, total, cfg.device.clone());
    if let Some(d) = direct.filter(|_| cfg.device.is_some()) {
        eps_proto::say!("eps server {rank}: landing slots and published copies in {}", d.describe());
        mem = mem.with_direct(d);
    }
    let init = |i: u64| eps_proto::init::param(seed, i);
    let restore = match &spec.resume {
        Some(r) => Some(checkpoint::Restore::open(r, layout.total, opt.state_per_param())?),
        None => None,
    };
    if let Some(r) = &restore {
        eps_proto::say!("eps server {rank}: resuming at iteration {} from {}", r.version(), r.dir().display());
    }
    // A resumed job's shards start at the checkpoint's version (SSP/ASP: the
    // updates they had applied, with every worker's clock at its iteration).
    let first = match &restore {
        Some(r) if spec.job.consistency != Consistency::Bsp => r.updates()?,
        Some(r) => r.version(),
        None => 0,
    };
    let clock = restore.as_ref().map_or(0, checkpoint::Restore::version);
    let parity = ShardSync::parity(first);
    let k = opt.state_per_param();
    let mut shards: Vec<Option<Held>> = (0..total).map(|_| None).collect();
    // With two replicas this server also keeps a backup of the shards of the
    // server before it: the same start, kept in step by the owner's forwards.
    let backups: Vec<&eps_proto::layout::Shard> =
        if spec.job.replicas > 1 { layout.backups_of(rank).collect() } else { Vec::new() };
    let mine = layout.shards_of(rank).map(|s| (s, None)).chain(backups.into_iter().map(|s| (s, Some(s.server))));
    for (s, backup_of) in mine {
        let zero = |_: u64| 0.0;
        let init: &dyn Fn(u64) -> f32 = if restore.is_some() { &zero } else { &init };
        mem.add(s.id, s.start, s.len, if backup_of.is_some() { Origin::Backup(init) } else { Origin::Init(init) })?;
        if let Some(r) = &restore {
            mem.restore(s.id, |m, st| r.fill(s.start, m, st, k)).map_err(ServerError::Checkpoint)?;
        }
        mem.publish(s.id, parity)?;
        mem.set_stamp(s.id, parity, first);
        mem.set_stamp(s.id, 1 - parity, eps_proto::layout::STAMP_WRITING);
        let sync = match backup_of {
            // Forwards bring it up from `first`; it serves nothing until promoted.
            Some(_) => ShardSync::backup(spec.job.consistency, ranks, first),
            None => ShardSync::at_version(spec.job.consistency, ranks, first).resumed_at(clock),
        };
        shards[s.id as usize] = Some(Held {
            core: eps_core::ShardCore::new(sync),
            out: None,
            incoming: backup_of.map(eps_core::MoveIn::new),
            split: None,
            replica: match backup_of {
                Some(primary) => replica::Replica::backup(primary, false),
                None if spec.job.replicas > 1 => replica::Replica::awaited(),
                None => replica::Replica::none(),
            },
            new_backup: None,
            seed: (spec.seeded_by_worker() && backup_of.is_none()).then(Vec::new),
        });
    }
    let es = layout.dtype.size_bytes() as u64;
    let max_len = layout.shards.iter().map(|s| s.len).max().unwrap_or(0);
    let mut sparse = sparse::Sparse::new(&pd, &spec, ranks)?;
    if let Some(r) = restore.as_ref().filter(|_| !sparse.is_empty()) {
        let rows = rows_checkpoint::restore_rows(&mut sparse, r.dir(), r.manifest(), rank)?;
        eps_proto::say!("eps server {rank}: {rows} table rows restored");
    }
    let mut opts = QpOptions::new(cfg.secret.clone());
    // Per peer: at most one pull answer and two credits per shard in flight, for
    // as many shards as splits may make; per table a push, a pull, their answers.
    let cap = eps_proto::layout::live_shard_cap(total) as u32 + 2 * spec.model.tables.len() as u32;
    opts.max_send_wr = 4 * cap + 16;
    opts.max_recv_wr = 2 * cap + 8;
    opts.max_sge = 1;
    // The largest message: a shard snapshot (f32 master and optimizer state),
    // or a sparse request or answer.
    let snapshot = (max_len * es).max(max_len * 4 * (1 + opt.state_per_param() as u64) + 4096);
    opts.max_msg_bytes = snapshot.max(eps_sparse::wire::max_message_bytes(&spec)) as u32;
    opts.connect_timeout = cfg.accept_timeout;
    let listener = pd.listen(SocketAddr::new(cfg.listen_ip, 0), &opts)?;
    let fabric_addr = listener.local_addr().to_string();
    let cq = pd.create_cq((ranks + 8) * (6 * cap + 32))?;
    let acks = pd.alloc_mr(64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let mut s = Server {
        rank,
        workers,
        ranks,
        mode: spec.job.consistency,
        replicated: spec.job.replicas > 1,
        opt,
        sched,
        agg: cfg.aggregator.clone(),
        mem,
        shards,
        conns: Vec::new(),
        by_rank: vec![None; ranks as usize],
        by_qp: HashMap::new(),
        flushed: Vec::new(),
        seeded: (0, 0),
        targets: HashMap::new(),
        pd: pd.clone(),
        cq: cq.clone(),
        opts,
        acks,
        ctl,
        metrics: metrics::Metrics::new(&spec.job.name, rank),
        summary: ServerSummary {
            rank,
            shards: layout.shards_of(rank).count(),
            elements: layout.elements_of(rank),
            ..ServerSummary::default()
        },
        ready: Vec::with_capacity(ranks as usize),
        threads: cfg.update_threads.clamp(1, 2),
        members: Members::new(workers).map_err(|_| ServerError::Unexpected)?,
        retained: Vec::new(),
        parked_moves: Vec::new(),
        answers: Answers::default(),
        orphaned: Vec::new(),
        retired: false,
        spans: layout.shards.iter().map(|s| (s.start, s.len)).collect(),
        averaged: layout.averaged(),
        saver: checkpoint::Saver::start(cfg, rank, &spec)?,
        sparse,
    };
    let owned = |id: u32| s.shards[id as usize].as_ref().is_some_and(|h| !h.replica.is_backup());
    let endpoints: Vec<ShardEndpoint> = s.mem.held().filter(|&id| owned(id)).filter_map(|id| s.endpoint(id)).collect();
    if !s.sparse.is_empty() {
        match s.ctl.call(&ControlMsg::TablesReady { rank, tables: s.sparse.endpoints(rank) })? {
            ControlMsg::Ok => {}
            ControlMsg::Error { message, .. } => return Err(ServerError::Sparse(message)),
            _ => return Err(ServerError::Unexpected),
        }
    }
    s.ctl.call(&ControlMsg::ServerReady { rank, fabric_addr, shards: endpoints })?;
    s.report_backups()?;
    let stop = Arc::new(AtomicBool::new(false));
    let accepted = spawn_acceptor::<P>(listener, cq, pd.clone(), s.opts.max_recv_wr, stop.clone());
    let orders = spawn_order_poller(cfg, rank)?;
    let served = s.serve(&accepted, &orders);
    stop.store(true, Ordering::Relaxed);
    served?;
    s.finish_checkpoints();
    s.ctl.call(&ControlMsg::Finished { role: Role::Server, rank })?;
    s.summary.shards = s.shards.iter().flatten().count();
    s.summary.elements = (0..s.shards.len()).filter(|&i| s.shards[i].is_some()).map(|i| s.spans[i].1).sum();
    let (rows, bytes, st) = s.sparse.summary();
    (s.summary.sparse_rows, s.summary.sparse_row_state_bytes) = (rows, bytes);
    (s.summary.sparse_heap_bytes, s.summary.sparse_rss_start_bytes) = (s.sparse.heap_bytes(), s.sparse.rss_start());
    if !s.sparse.is_empty() {
        s.summary.sparse_rss_end_bytes = rss_bytes(None).unwrap_or(0);
    }
    (s.summary.sparse_pulled_keys, s.summary.sparse_stepped_keys, s.summary.sparse_evicted, s.summary.sparse_refused) =
        (st.pulled_keys, st.stepped_keys, st.evicted, st.refused);
    for line in s.sparse.backups.report(rank, st.stepped_keys, s.sparse.merged_row_bytes()) {
        eps_proto::say!("{line}");
    }
    for line in s.stand_in_report() {
        eps_proto::say!("{line}");
    }
    Ok(s.summary)
}

/// Accepts connections on a thread of its own (workers join, migration sources
/// dial in at any time) and hands them to the event loop, each with its receives
/// posted before the peer could send (`depth` of them, the first for its hello)
/// and its hello buffer. The thread stops within a second of `stop` being set.
fn spawn_acceptor<P: Fabric>(
    listener: P::Listener,
    cq: P::Cq,
    pd: P,
    depth: u32,
    stop: Arc<AtomicBool>,
) -> Receiver<(P::Qp, P::Mr)> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let mut spare = None;
        while !stop.load(Ordering::Relaxed) {
            let hello = match spare.take().map_or_else(|| serve::hello_buffer(&pd), Ok) {
                Ok(h) => h,
                Err(e) => {
                    eps_proto::say!("eps server: cannot allocate a connection's hello buffer ({e}); retrying");
                    std::thread::sleep(Duration::from_secs(1));
                    continue;
                }
            };
            // Errors (a peer that fails authentication or hangs up, or no peer within
            // the second) concern that peer only.
            let mut prepare = |qp: &P::Qp| serve::post_receives::<P>(qp, Some(&hello), depth);
            match listener.accept_prepared(&cq, &cq, Duration::from_secs(1), &mut prepare) {
                Ok(qp) => {
                    if tx.send((qp, hello)).is_err() {
                        return;
                    }
                }
                Err(_) => spare = Some(hello),
            }
        }
    });
    rx
}

/// Long-polls the control plane for this server's orders on a thread of its
/// own. It polls on after `Order::Retire`, until the server is gone (its
/// receiver dropped, or the control plane ended): a server that polls is
/// alive, and one that stops before it said it finished died (see
/// `Job::server_gone`).
fn spawn_order_poller(cfg: &ServerConfig, rank: u32) -> Result<Receiver<Result<Order, ControlError>>, ServerError> {
    // Order polls are answered within a long poll: silence means a dead link.
    let mut ctl = ControlClient::connect(cfg.control.clone(), &cfg.secret, cfg.accept_timeout)?.answer_within(ANSWER_WITHIN)?;
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let mut after = 0;
        loop {
            match ctl.call(&ControlMsg::Poll { rank, after }) {
                Ok(ControlMsg::Orders { last, orders }) => {
                    after = last;
                    for o in orders {
                        if tx.send(Ok(o)).is_err() {
                            return;
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            }
        }
    });
    Ok(rx)
}

#[cfg(test)]
mod tests;
