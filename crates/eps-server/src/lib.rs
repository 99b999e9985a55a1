//! # eps-server
//!
//! The parameter-server role: a thin driver around the per-shard consistency state
//! machine of `eps-proto`. It registers with the control plane, keeps its shards in
//! registered memory (two published versions, one landing slot per worker), sums
//! contributions in rank order and applies the optimizer through an
//! [`eps_agg::Aggregator`], and answers pulls by writing parameters straight from
//! its registered memory into the worker's.
//!
//! # Safety
//! This crate reads landing slots and writes published buffers in place. Which
//! bytes a peer may be writing or reading at any moment is decided by the protocol
//! (see `ShardSync`); the two `unsafe` views into registered memory rely on it and
//! say so at each use.

mod memory;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use eps_agg::{Aggregator, LrSchedule, Optimizer};
use eps_control::{ControlClient, ControlError};
use eps_fabric::prelude::*;
use eps_proto::control::{ControlMsg, Role, ServerEndpoint};
use eps_proto::hello::{HELLO_LEN, Hello};
use eps_proto::imm::{Imm, ImmKind, widen_seq};
use eps_proto::membership::Membership;
use eps_proto::sync::{PushOutcome, ShardSync};
use eps_proto::{JobSpec, SpecError};

pub use memory::{MAX_WORKERS, MemoryError, ShardMemory, UpdateArgs};

/// How a server runs.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Control-plane address.
    pub control: SocketAddr,
    /// Job secret.
    pub secret: Secret,
    /// IP to listen on for workers (the port is chosen by the OS).
    pub listen_ip: IpAddr,
    /// The aggregator (CPU or GPU).
    pub aggregator: Arc<dyn Aggregator>,
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
    /// Local shards.
    pub shards: usize,
    /// Parameter elements held.
    pub elements: u64,
    /// Updates applied (per shard, summed).
    pub updates: u64,
    /// Pull answers written.
    pub pulls: u64,
    /// Protocol violations by workers (each closed that worker's connection).
    pub violations: u64,
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
    /// More workers than one server can sum.
    #[error("{0} workers: a server sums at most 64 contributions")]
    TooManyWorkers(u32),
}

/// 0, 1, 2, ...: contributor lists are slices of this.
const ALL_RANKS: [u32; MAX_WORKERS] = {
    let mut a = [0u32; MAX_WORKERS];
    let mut i = 0;
    while i < MAX_WORKERS {
        a[i] = i as u32;
        i += 1;
    }
    a
};

const WR_PULL: u64 = 1 << 62;
const WR_CREDIT: u64 = 2 << 62;
const WR_HELLO: u64 = 1;

struct Conn {
    qp: SoftQp,
    hello: Option<Hello>,
    alive: bool,
}

struct Server {
    workers: u32,
    opt: Optimizer,
    sched: LrSchedule,
    agg: Arc<dyn Aggregator>,
    mem: ShardMemory,
    sync: Vec<ShardSync>,
    conns: Vec<Conn>,
    /// Worker rank -> connection index.
    by_rank: Vec<Option<usize>>,
    /// QP number -> connection index.
    by_qp: HashMap<u32, usize>,
    hellos: SoftMr,
    /// Per shard: updates (iteration, contributor) waiting for a free buffer, in
    /// arrival order (at most one per worker).
    waiting: Vec<std::collections::VecDeque<(u64, Option<u32>)>>,
    summary: ServerSummary,
    ready: Vec<(u32, u64)>,
    threads: usize,
    /// Contributor sets by iteration (static membership for now: every worker).
    membership: Membership,
}

/// Runs a server until every worker has disconnected.
pub fn run(cfg: &ServerConfig) -> Result<ServerSummary, ServerError> {
    let mut ctl = ControlClient::connect(cfg.control, &cfg.secret, cfg.accept_timeout)?;
    let (rank, spec_text) = match ctl.call(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() })? {
        ControlMsg::Registered { rank, spec_toml } => (rank, spec_toml),
        _ => return Err(ServerError::Unexpected),
    };
    let spec = JobSpec::from_toml(&spec_text)?;
    let layout = spec.layout()?;
    let (opt, sched) = (spec.optimizer()?, spec.schedule()?);
    let workers = spec.job.workers;
    if workers as usize > MAX_WORKERS {
        return Err(ServerError::TooManyWorkers(workers));
    }
    let dev = SoftDevice::open()?;
    let pd = dev.alloc_pd();
    let seed = spec.job.seed;
    let mut mem = ShardMemory::new(&pd, &layout, rank, workers, &opt, |i| eps_proto::init::param(seed, i))?;
    let n = mem.places.len();
    for i in 0..n {
        mem.publish(i, 0);
        mem.set_stamp(i, 0, 0);
        mem.set_stamp(i, 1, eps_proto::layout::STAMP_WRITING);
    }
    let max_bytes = mem.places.iter().map(|p| p.bytes).max().unwrap_or(0);
    let mut opts = QpOptions::new(cfg.secret.clone());
    // Per worker: at most one pull answer per shard in flight, and at most two
    // credits per shard (one acknowledged but not yet reaped, one new).
    opts.max_send_wr = 4 * n as u32 + 16;
    opts.max_recv_wr = 2 * n as u32 + 8;
    opts.max_sge = 1;
    // The largest message is a shard, or the stamp area an ASP reader fetches at once.
    opts.max_msg_bytes = (max_bytes as u64).max(eps_proto::layout::stamp_area_bytes(n)) as u32;
    let listener = pd.listen(SocketAddr::new(cfg.listen_ip, 0), &opts)?;
    let endpoint = ServerEndpoint {
        rank,
        fabric_addr: listener.local_addr().to_string(),
        landing: mem.landing.iter().map(|m| (m.addr(), m.rkey())).collect(),
        published_addr: mem.published.addr(),
        published_rkey: mem.published.rkey(),
    };
    ctl.call(&ControlMsg::ServerReady(endpoint))?;
    let cq = pd.create_cq(workers * (6 * n as u32 + 32))?;
    let hellos = pd.alloc_mr(HELLO_LEN * workers as usize, Access::LOCAL_WRITE)?;
    let mut conns = Vec::new();
    let mut by_qp = HashMap::new();
    for i in 0..workers as usize {
        let qp = listener.accept(&cq, &cq, cfg.accept_timeout)?;
        qp.post_recv(&RecvWr { wr_id: WR_HELLO, sg: &[Sge::new(&hellos, (i * HELLO_LEN) as u64, HELLO_LEN as u32)] })?;
        for _ in 0..opts.max_recv_wr - 1 {
            qp.post_recv(&RecvWr { wr_id: 0, sg: &[] })?;
        }
        by_qp.insert(qp.qp_num(), i);
        conns.push(Conn { qp, hello: None, alive: true });
    }
    let mut s = Server {
        workers,
        opt,
        sched,
        agg: cfg.aggregator.clone(),
        sync: (0..n).map(|_| ShardSync::new(spec.job.consistency, workers)).collect(),
        mem,
        conns,
        by_rank: vec![None; workers as usize],
        by_qp,
        hellos,
        waiting: (0..n).map(|_| std::collections::VecDeque::with_capacity(workers as usize)).collect(),
        summary: ServerSummary { rank, shards: n, elements: layout.elements_of(rank), ..ServerSummary::default() },
        ready: Vec::with_capacity(workers as usize),
        threads: cfg.update_threads.clamp(1, 2),
        membership: Membership::new((0..workers).collect()).map_err(|_| ServerError::Unexpected)?,
    };
    s.serve(&cq)?;
    drop(listener);
    ctl.call(&ControlMsg::Finished { role: Role::Server, rank })?;
    Ok(s.summary)
}

impl Server {
    fn serve(&mut self, cq: &SoftCq) -> Result<(), ServerError> {
        let mut wc = [Completion::EMPTY; 64];
        let mut last = Instant::now();
        while self.conns.iter().any(|c| c.alive) {
            let k = cq.poll(&mut wc)?;
            for c in &wc[..k] {
                self.on_completion(c)?;
            }
            if k > 0 {
                last = Instant::now();
            } else if last.elapsed() > Duration::from_micros(200) {
                cq.wait(Duration::from_millis(1));
            }
        }
        Ok(())
    }

    fn on_completion(&mut self, c: &Completion) -> Result<(), ServerError> {
        let Some(&ci) = self.by_qp.get(&c.qp_num) else { return Ok(()) };
        if !c.status.is_ok() {
            // A flush or transport error: the worker is gone (or was cut off).
            if c.opcode == WcOpcode::Write {
                self.on_send_done(c.wr_id);
            }
            self.drop_conn(ci);
            return Ok(());
        }
        match c.opcode {
            WcOpcode::Recv if c.wr_id == WR_HELLO => {
                let mut b = [0u8; HELLO_LEN];
                self.hellos.read_at(ci * HELLO_LEN, &mut b);
                match Hello::decode(&b).filter(|h| h.rank < self.workers && self.by_rank[h.rank as usize].is_none()) {
                    Some(h) => {
                        self.by_rank[h.rank as usize] = Some(ci);
                        self.conns[ci].hello = Some(h);
                    }
                    None => self.violation(ci, "bad hello (unknown or duplicate worker rank)"),
                }
            }
            WcOpcode::RecvWithImm => {
                if self.conns[ci].alive {
                    self.conns[ci].qp.post_recv(&RecvWr { wr_id: 0, sg: &[] })?;
                }
                self.on_imm(ci, c.imm.unwrap_or(0), c.byte_len)?;
            }
            WcOpcode::Write => self.on_send_done(c.wr_id),
            _ => {}
        }
        Ok(())
    }

    fn violation(&mut self, ci: usize, what: &str) {
        self.summary.violations += 1;
        let who = self.conns[ci].hello.map_or("unidentified worker".to_string(), |h| format!("worker {}", h.rank));
        eprintln!("eps server {}: {who}: {what}; closing its connection", self.summary.rank);
        self.drop_conn(ci);
    }

    fn drop_conn(&mut self, ci: usize) {
        if !self.conns[ci].alive {
            return;
        }
        self.conns[ci].alive = false;
        if let Some(h) = self.conns[ci].hello {
            for s in &mut self.sync {
                s.drop_pending(h.rank);
            }
        }
    }

    fn on_imm(&mut self, ci: usize, imm: u32, len: u32) -> Result<(), ServerError> {
        let Some(h) = self.conns[ci].hello else {
            self.violation(ci, "data before its hello");
            return Ok(());
        };
        let Some(m) = Imm::decode(imm).filter(|m| (m.shard as usize) < self.sync.len()) else {
            self.violation(ci, &format!("unknown immediate {imm:#x} (bad kind or shard)"));
            return Ok(());
        };
        let i = m.shard as usize;
        match m.kind {
            ImmKind::Push => {
                if len as usize != self.mem.places[i].bytes {
                    let want = self.mem.places[i].bytes;
                    self.violation(
                        ci,
                        &format!("pushed {len} bytes for shard {} (expected {want})", self.mem.places[i].shard.id),
                    );
                    return Ok(());
                }
                let near = self.sync[i].min_clock().max(self.sync[i].version());
                let iteration = widen_seq(m.seq, near);
                let contributors = self.membership.contributors(iteration);
                match self.sync[i].on_push(h.rank, iteration, contributors) {
                    Ok(PushOutcome::Wait) => {}
                    Ok(PushOutcome::AggregateAll { iteration }) => self.update(i, iteration, None)?,
                    Ok(PushOutcome::ApplyOne { worker, iteration }) => self.update(i, iteration, Some(worker))?,
                    Err(e) => self.violation(ci, &e.to_string()),
                }
            }
            ImmKind::PullReq => {
                let need = widen_seq(m.seq, self.sync[i].version().max(self.sync[i].min_clock()));
                match self.sync[i].on_pull(h.rank, need) {
                    Ok(Some(v)) => self.send_pull(h.rank, i, v)?,
                    Ok(None) => {}
                    Err(e) => self.violation(ci, &e.to_string()),
                }
            }
            ImmKind::PullDone | ImmKind::Credit => self.violation(ci, "sent a server-only message"),
        }
        Ok(())
    }

    /// Applies an update to shard `i` (all contributions, or one worker's) and
    /// publishes it, or parks it until its buffer is free.
    fn update(&mut self, i: usize, iteration: u64, one: Option<u32>) -> Result<(), ServerError> {
        if !self.sync[i].can_publish() || !self.waiting[i].is_empty() {
            self.sync[i].set_publish_waiting(true);
            self.waiting[i].push_back((iteration, one));
            return Ok(());
        }
        self.apply(i, iteration, one)
    }

    fn apply(&mut self, i: usize, iteration: u64, one: Option<u32>) -> Result<(), ServerError> {
        let scalars = self.opt.scalars(iteration, self.sched.at(iteration));
        let next = self.sync[i].version() + 1;
        let parity = ShardSync::parity(next);
        // BSP: the iteration's contributors in rank order, averaged over their
        // number; SSP/ASP: one worker's contribution, scaled by the worker count.
        let (contributors, scale): (&[u32], f32) = match one {
            None => {
                let c = self.membership.contributors(iteration);
                (c, 1.0 / c.len() as f32)
            }
            Some(w) => (std::slice::from_ref(&ALL_RANKS[w as usize]), 1.0 / self.workers as f32),
        };
        let u = UpdateArgs { agg: &*self.agg, opt: &self.opt, scalars, scale, threads: self.threads };
        self.mem.set_stamp(i, parity, eps_proto::layout::STAMP_WRITING);
        // SAFETY: `ShardSync` only asks for an update once every contribution in it
        // has landed, each contributor waits for our pull answer or credit before
        // pushing this shard again, and `can_publish` said no pull uses `parity`.
        unsafe { self.mem.update(i, parity, contributors, &u)? };
        self.mem.set_stamp(i, parity, next);
        self.sync[i].published(one);
        self.sync[i].set_publish_waiting(!self.waiting[i].is_empty());
        self.summary.updates += 1;
        if let Some(w) = one {
            self.send_credit(w, i)?;
        }
        let mut ready = std::mem::take(&mut self.ready);
        ready.clear();
        self.sync[i].ready_pulls(&mut ready);
        for &(w, v) in &ready {
            self.send_pull(w, i, v)?;
        }
        self.ready = ready;
        Ok(())
    }

    fn on_send_done(&mut self, wr_id: u64) {
        if wr_id & (3 << 62) != WR_PULL {
            return;
        }
        let i = ((wr_id >> 48) & 0x3FFF) as usize;
        let v = wr_id & ((1 << 48) - 1);
        let Some(s) = self.sync.get_mut(i) else { return };
        s.pull_written(v);
        while self.sync[i].can_publish()
            && let Some((iteration, one)) = self.waiting[i].pop_front()
        {
            self.sync[i].set_publish_waiting(!self.waiting[i].is_empty());
            if let Err(e) = self.apply(i, iteration, one) {
                eprintln!("eps server {}: deferred update failed: {e}", self.summary.rank);
            }
        }
    }

    fn send_pull(&mut self, w: u32, i: usize, v: u64) -> Result<(), ServerError> {
        let Some(ci) = self.by_rank[w as usize] else { return Ok(()) };
        let conn = &self.conns[ci];
        let (Some(h), true) = (conn.hello, conn.alive) else {
            self.sync[i].pull_written(v);
            return Ok(());
        };
        let p = self.mem.places[i];
        let es = self.mem.dtype.size_bytes() as u64;
        let sg = [Sge::new(&self.mem.published, self.mem.pub_offset(i, ShardSync::parity(v)) as u64, p.bytes as u32)];
        let remote = RemoteAddr { addr: h.pull_addr + p.shard.start * es, rkey: h.pull_rkey };
        let imm = Imm { kind: ImmKind::PullDone, shard: i as u32, seq: v as u16 }.encode();
        let wr_id = WR_PULL | ((i as u64) << 48) | (v & ((1 << 48) - 1));
        conn.qp.post_send(&SendWr { wr_id, op: SendOp::WriteImm(remote, imm), sg: &sg, signaled: true })?;
        self.summary.pulls += 1;
        Ok(())
    }

    fn send_credit(&mut self, w: u32, i: usize) -> Result<(), ServerError> {
        let Some(ci) = self.by_rank[w as usize] else { return Ok(()) };
        let conn = &self.conns[ci];
        let (Some(h), true) = (conn.hello, conn.alive) else { return Ok(()) };
        let imm = Imm { kind: ImmKind::Credit, shard: i as u32, seq: 0 }.encode();
        let remote = RemoteAddr { addr: h.pull_addr, rkey: h.pull_rkey };
        conn.qp.post_send(&SendWr { wr_id: WR_CREDIT, op: SendOp::WriteImm(remote, imm), sg: &[], signaled: false })?;
        Ok(())
    }
}
