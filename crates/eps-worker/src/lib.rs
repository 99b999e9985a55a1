//! # eps-worker
//!
//! The worker side of EPS as a library (the C ABI wraps it). A worker joins a job
//! through the control plane, registers its parameter and gradient buffers once, and
//! then per iteration: reads parameters, writes gradients, and calls
//! [`Worker::push_pull`], which pushes every shard's gradient straight from the
//! registered gradient buffer (WRITE_WITH_IMM into the server's landing slot) and has
//! every server write the next parameters straight into the registered parameter
//! buffer. All shards are in flight at once (per-shard pipelining); queues are sized
//! at start.
//!
//! ```no_run
//! use std::time::Duration;
//! use eps_worker::{Worker, WorkerConfig};
//!
//! let cfg = WorkerConfig {
//!     control: "127.0.0.1:7100".parse().unwrap(),
//!     secret: eps_fabric::Secret::new(std::env::var("EPS_JOB_SECRET").unwrap()).unwrap(),
//!     timeout: Duration::from_secs(60),
//! };
//! let mut w = Worker::join(&cfg)?; // registers, connects, pulls version 0
//! let weights = w.tensor("w")?; // element range of a tensor in the flat buffers
//! for _ in 0..w.spec().job.steps {
//!     // f32 jobs: compute straight from/into the registered buffers.
//!     let mut params = vec![0f32; w.layout().total as usize];
//!     w.read_params(&mut params)?;
//!     let grads = w.grads_f32_mut().expect("an f32 job");
//!     for (g, p) in grads[weights.clone()].iter_mut().zip(&params[weights.clone()]) {
//!         *g = 2.0 * p; // the gradient of sum(p^2)
//!     }
//!     w.push_pull()?; // push every shard, wait for the next parameters
//! }
//! w.finish()?;
//! # Ok::<(), eps_worker::WorkerError>(())
//! ```
//!
//! # Memory peers reach
//! This crate holds no `unsafe`. The gradient buffer and the request buffers are
//! registered for the worker alone (no LOCAL_WRITE, no REMOTE_WRITE), so
//! eps-fabric gives views of them; the parameter buffer and a table's row
//! buffer are written by servers, so Rust code reads them through copies
//! ([`Worker::read_params`], [`Worker::params_copy`], the rows of
//! [`Worker::sparse_pull_rows`]). A foreign-function edge that hands the
//! parameter buffer to a framework in place takes its address
//! ([`Worker::params_ptr`]); every method that starts transfers waits for them to
//! finish before returning, so the framework reads it between transfers.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use eps_agg::DType;
use eps_control_client::ControlClient;
use eps_core::route::{self, PullAgain};
use eps_fabric::prelude::*;
use eps_proto::control::{ControlMsg, JobMap, Role, ShardEndpoint};
use eps_proto::hello::{HELLO_LEN, Hello};
use eps_proto::imm::{Imm, ImmKind};
use eps_proto::layout::Layout;
use eps_proto::membership::Membership;
use eps_proto::{Consistency, JobSpec};

mod error;
mod loss;
mod metrics;
mod pull;
mod reap;
mod register;
mod round;
mod routing;
mod seed;
mod sparse;
mod takeover;
mod watch;
pub use error::WorkerError;
pub use register::{Registration, register, register_declaring};
pub use seed::check_initial;
pub use sparse::PulledRows;
use watch::MapWatch;

/// How a worker joins.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Control-plane address.
    pub control: eps_control_client::ControlAddrs,
    /// Job secret.
    pub secret: Secret,
    /// How long to wait for the control plane and the servers.
    pub timeout: Duration,
}

/// Transfer statistics.
#[derive(Clone, Copy, Debug, Default)]
pub struct WorkerStats {
    /// Gradient bytes pushed.
    pub pushed_bytes: u64,
    /// Parameter bytes pulled.
    pub pulled_bytes: u64,
    /// Time spent inside push/pull calls.
    pub comm: Duration,
}

const WR_PUSH: u64 = 1 << 62;
const WR_PULLREQ: u64 = 2 << 62;
const WR_HELLO: u64 = 3 << 62;
/// RDMA READs of ASP pulls (stamps and buffers); the low bits are unused.
const WR_READ: u64 = 1 << 61;

/// A worker of a running job.
pub struct Worker<P: Fabric = SoftPd> {
    rank: u32,
    spec: JobSpec,
    layout: Layout,
    mode: Consistency,
    params: P::Mr,
    grads: P::Mr,
    /// By server rank: the connection, once dialed.
    qps: Vec<Option<P::Qp>>,
    /// QP number -> server rank.
    qp_rank: HashMap<u32, u32>,
    /// The map pushes are routed with.
    map: JobMap,
    watch: Arc<MapWatch>,
    cq: P::Cq,
    opts: QpOptions,
    /// Per global shard: the landing slot may be written.
    credit: Vec<bool>,
    /// The shards of the current round (push_pull or first pull): the map's
    /// shards of the iteration, with a split's parts in place of the shard they
    /// replaced when a "moved" answer revealed it.
    round: Vec<usize>,
    /// Pushes answered "moved" since the current push_pull began: (shard,
    /// iteration, the server that answered).
    moved: Vec<(usize, u64, u32)>,
    /// "Pull moved" answers since the current pull began: (shard, server).
    pulls_moved: Vec<(usize, u32)>,
    /// (shard, server): a "pull moved" the server owes this round (it
    /// answered the shard's push "moved"; the answer to the pull request
    /// follows). Forgiven if the server is lost.
    owed: Vec<(usize, u32)>,
    /// By shard: the server its latest push went to.
    pushed_to: Vec<u32>,
    /// Per shard, in the current round: pull answered with data.
    round_pulled: Vec<bool>,
    /// Per shard, in the current round: pull requests not answered yet.
    outstanding: Vec<u32>,
    /// Pull requests answered "moved" since the current push_pull or pull began.
    pull_moved: usize,
    /// The iteration's round, once a push began it (see `round.rs`).
    open: Option<round::Open>,
    /// Per global shard: push WRITEs posted whose completion has not come.
    sending: Vec<u32>,
    /// ASP: where each shard's published-buffer stamps are read into (16 bytes each).
    stamps: P::Mr,
    /// RDMA READs completed since the current read round began.
    reads_done: usize,
    iteration: u64,
    /// The iteration [`Worker::begin`] last began.
    begun: Option<u64>,
    /// Contributor sets by iteration, as of the last `begin`.
    membership: Membership,
    /// Pull answers received since the current push_pull/pull began.
    pulled: usize,
    /// Servers whose connection failed (a job with replicas goes on without them).
    lost: std::collections::HashSet<u32>,
    /// Hellos sent and acknowledged.
    hellos_sent: usize,
    hellos_acked: usize,
    stats: WorkerStats,
    /// Its series of the process's metrics.
    metrics: metrics::Metrics,
    ctl: ControlClient,
    timeout: Duration,
    /// How long a wait spins before it sleeps (learns the rounds' gaps).
    spin: eps_fabric::Spin,
    hello: P::Mr,
    /// The job's sparse tables.
    sparse: sparse::Tables<P>,
    pd: P,
}

impl<P: Fabric> std::fmt::Debug for Worker<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("rank", &self.rank).field("iteration", &self.iteration).finish()
    }
}

impl Worker<SoftPd> {
    /// Joins the job on the `soft` fabric: registers, waits for the shard map,
    /// registers buffers, connects to every server, and pulls version 0 of the
    /// parameters.
    pub fn join(cfg: &WorkerConfig) -> Result<Self, WorkerError> {
        let reg = register(cfg)?;
        Self::join_on(cfg, reg, SoftDevice::open()?.alloc_pd())
    }
}

impl<P: Fabric> Worker<P> {
    /// Joins the job as registered, with buffers and connections on `pd`'s
    /// provider: registers buffers, connects to every server, and pulls the first
    /// parameters.
    pub fn join_on(cfg: &WorkerConfig, reg: Registration, pd: P) -> Result<Self, WorkerError> {
        Self::join_with(cfg, reg, pd, None)
    }

    /// As [`Worker::join_on`], with parameter and gradient buffers the caller
    /// owns (a framework's memory, made a [`eps_fabric::RegionBuf::borrowed`]
    /// under that call's contract), registered in place: each must be the
    /// layout's size ([`eps_proto::layout::Layout::bytes`]: every tensor's
    /// elements, end to end, in the wire dtype). The parameters pulled at join
    /// overwrite `params`. The memory is the caller's again once the worker
    /// is dropped with nothing in flight ([`Worker::quiesce`] says when).
    pub fn join_borrowed(
        cfg: &WorkerConfig,
        reg: Registration,
        pd: P,
        params: eps_fabric::RegionBuf,
        grads: eps_fabric::RegionBuf,
    ) -> Result<Self, WorkerError> {
        let bytes = reg.layout.bytes() as usize;
        if let Some(len) = [params.len(), grads.len()].into_iter().find(|&l| l != bytes) {
            return Err(WorkerError::Length { what: "buffer bytes", expected: bytes, got: len });
        }
        Self::join_with(cfg, reg, pd, Some((params, grads)))
    }

    fn join_with(
        cfg: &WorkerConfig,
        reg: Registration,
        pd: P,
        borrowed: Option<(eps_fabric::RegionBuf, eps_fabric::RegionBuf)>,
    ) -> Result<Self, WorkerError> {
        let Registration { rank, spec, layout, map, ctl, initial } = reg;
        // The model's values: the caller's buffer, or the ones given.
        let has_values = borrowed.is_some() || initial.is_some();
        let bytes = layout.bytes() as usize;
        // Queues are sized for as many shards as splits may make.
        let n = eps_proto::layout::live_shard_cap(layout.shards.len());
        let (params, grads) = match borrowed {
            // Servers write the parameters; only the worker writes its gradients.
            Some((p, g)) => (pd.register(p, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?, pd.register(g, Access::NONE)?),
            None => (pd.alloc_mr(bytes, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?, pd.alloc_mr(bytes, Access::NONE)?),
        };
        let mut hello = pd.alloc_mr(HELLO_LEN, Access::LOCAL_WRITE)?;
        hello.write_at(0, &Hello { rank, pull_rkey: params.rkey(), pull_addr: params.addr() }.encode());
        let stamps = pd.alloc_mr(16 * eps_proto::layout::MAX_SHARDS as usize, Access::LOCAL_WRITE)?;
        let max_bytes = layout.shards.iter().map(|s| s.len as usize * layout.dtype.size_bytes()).max().unwrap_or(0);
        let sparse = sparse::Tables::new(&pd, &spec)?;
        // Per table: a push and a pull request out, a pull answer and a credit in.
        let n = n + sparse.len();
        let mut opts = QpOptions::new(cfg.secret.clone());
        opts.max_send_wr = 2 * n as u32 + 8;
        opts.max_recv_wr = 2 * n as u32 + 8;
        opts.max_sge = 1;
        opts.max_msg_bytes = (max_bytes as u64).max(4096).max(eps_sparse::wire::max_message_bytes(&spec)) as u32;
        opts.connect_timeout = cfg.timeout;
        // Room for every shard's answers from servers old and new.
        let cq = pd.create_cq(8 * (2 * n as u32 + 8) + 64)?;
        let membership = Membership::from_epochs(map.membership.clone()).ok_or(WorkerError::Unexpected)?;
        // A worker that joined a running job starts at the iteration it was admitted for.
        let joined = membership.joined_at(rank).ok_or(WorkerError::Unsupported("this rank contributes to no iteration"))?;
        // A job resumed from a checkpoint starts at the checkpoint's iteration.
        let start = joined.max(spec.resume.as_ref().map_or(0, |r| r.iteration));
        let watch = Arc::new(MapWatch::new(&map, membership.clone(), start));
        watch::spawn(cfg, rank, watch.clone(), &map)?;
        let ids = map.routes.len();
        let metrics = metrics::Metrics::new(&spec.job.name, rank);
        let mut w = Self {
            rank,
            mode: spec.job.consistency,
            spec,
            layout,
            params,
            grads,
            qps: Vec::new(),
            qp_rank: HashMap::new(),
            map,
            watch,
            cq,
            opts,
            credit: vec![true; ids],
            round: Vec::new(),
            moved: Vec::new(),
            pulls_moved: Vec::new(),
            owed: Vec::new(),
            pushed_to: vec![u32::MAX; ids],
            round_pulled: vec![false; ids],
            outstanding: vec![0; ids],
            pull_moved: 0,
            open: None,
            sending: vec![0; ids],
            stamps,
            reads_done: 0,
            iteration: start,
            begun: None,
            membership,
            pulled: 0,
            lost: Default::default(),
            hellos_sent: 0,
            hellos_acked: 0,
            stats: WorkerStats::default(),
            metrics,
            ctl,
            timeout: cfg.timeout,
            spin: eps_fabric::Spin::new(Duration::from_micros(200), Duration::from_millis(5)),
            hello,
            sparse,
            pd,
        };
        if let Some(v) = &initial {
            w.params.write_at(0, v);
        }
        for o in w.needed_owners() {
            w.connect(o)?;
        }
        if w.spec.seeded_by_worker() && w.rank == 0 && start == 0 {
            w.seed(has_values)?;
        }
        if w.mode == Consistency::Asp {
            w.read_pull()?;
        } else if start < w.spec.job.steps {
            w.pull(start)?;
        }
        // (A worker admitted after the last step has nothing to pull or train.)
        Ok(w)
    }

    /// This worker's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The job spec.
    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    /// The parameter layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Wire dtype of the buffers.
    pub fn dtype(&self) -> DType {
        self.layout.dtype
    }

    /// How long this worker waits for the control plane, a server or a
    /// transfer before it reports a timeout (its configuration's `timeout`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The iteration the next push belongs to.
    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    /// Begins the current iteration ([`Worker::iteration`]) before its gradient is
    /// computed: waits while a membership change is being voted on (only when the
    /// vote reaches this boundary first), and returns whether this worker
    /// contributes to it. A worker that does not has left the job at this boundary:
    /// it calls [`Worker::finish`]. `push_pull` begins the iteration itself if the
    /// caller did not.
    pub fn begin(&mut self) -> Result<bool, WorkerError> {
        let t = self.iteration;
        if self.begun != Some(t) {
            self.membership = self.watch.begin(t, self.timeout)?;
            self.begun = Some(t);
        }
        Ok(self.membership.contributors(t).contains(&self.rank))
    }

    /// The samples this worker trains on in the current iteration, when the job's
    /// data is dealt out by membership (each contributor takes `batch` samples in
    /// rank order; see `eps_proto::membership`). Call after [`Worker::begin`].
    pub fn samples(&self, batch: u64) -> Option<Range<u64>> {
        self.membership.samples(self.iteration, self.rank, batch)
    }

    /// Contributor sets by iteration, as of the last [`Worker::begin`].
    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    /// Transfer statistics so far.
    pub fn stats(&self) -> WorkerStats {
        self.stats
    }

    /// Element range of a tensor in the flat buffers.
    pub fn tensor(&self, name: &str) -> Result<Range<usize>, WorkerError> {
        let t = self.layout.tensor(name).ok_or_else(|| WorkerError::UnknownTensor(name.to_string()))?;
        Ok(t.offset as usize..(t.offset + t.elements) as usize)
    }

    /// A copy of the parameter buffer's wire-dtype bytes.
    pub fn params_copy(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.params.len()];
        self.params.read_at(0, &mut out);
        out
    }

    /// The address of the parameter buffer (`layout().bytes()` bytes of the
    /// wire dtype), for a foreign-function edge that hands it to a framework in
    /// place. Servers write it while a pull is in flight, so it is read only
    /// between the worker's calls.
    pub fn params_ptr(&self) -> *mut u8 {
        self.params.as_mut_ptr()
    }

    /// The gradient buffer as raw wire-dtype bytes.
    pub fn grads_bytes_mut(&mut self) -> &mut [u8] {
        // Registered for the worker alone (`join_with`): the fabric's view.
        self.grads.view_mut().expect("the gradient buffer is the worker's own")
    }

    /// The gradient buffer as f32, without a copy (f32 jobs only).
    pub fn grads_f32_mut(&mut self) -> Option<&mut [f32]> {
        (self.layout.dtype == DType::F32).then(|| bytemuck::cast_slice_mut(self.grads_bytes_mut()))
    }

    /// Widens the parameters into `out` (any dtype).
    pub fn read_params(&self, out: &mut [f32]) -> Result<(), WorkerError> {
        let n = self.layout.total as usize;
        if out.len() != n {
            return Err(WorkerError::Length { what: "parameters", expected: n, got: out.len() });
        }
        let dtype = self.layout.dtype;
        if dtype == DType::F32 {
            self.params.read_at(0, bytemuck::cast_slice_mut(out));
        } else {
            eps_agg::reduce::sum(dtype, &[&self.params_copy()], out, 1);
        }
        Ok(())
    }

    /// Narrows `grads` into the gradient buffer (any dtype).
    pub fn write_grads(&mut self, grads: &[f32]) -> Result<(), WorkerError> {
        let n = self.layout.total as usize;
        if grads.len() != n {
            return Err(WorkerError::Length { what: "gradients", expected: n, got: grads.len() });
        }
        let dtype = self.layout.dtype;
        eps_agg::reduce::narrow(dtype, grads, self.grads_bytes_mut());
        Ok(())
    }

    /// Every shard of this round has its data and no pull request is in flight.
    /// The shards of this round still without an answer, with the servers asked
    /// (for the error when they never come).
    fn unanswered(&self, t: u64) -> String {
        let missing: Vec<String> = self
            .round
            .iter()
            .filter(|&&s| !self.round_pulled[s] || self.outstanding[s] > 0)
            .map(|&s| {
                let owner = self.map.routes.get(s).map(|r| r.for_iteration(t).owner);
                let at = owner.map_or_else(|| "no route".to_string(), |o| format!("server {o}"));
                format!("shard {s} ({at}, {} requests in flight)", self.outstanding[s])
            })
            .collect();
        if missing.is_empty() { "every shard answered".into() } else { missing.join(", ") }
    }

    fn round_done(&self) -> bool {
        self.round.iter().all(|&s| self.round_pulled[s]) && self.outstanding.iter().all(|&o| o == 0)
    }

    /// Starts a round over the map's shards of iteration `t`.
    fn start_round(&mut self, t: u64) {
        self.pulled = 0;
        self.pull_moved = 0;
        self.pulls_moved.clear();
        self.moved.clear();
        self.owed.clear();
        self.round_pulled.iter_mut().for_each(|p| *p = false);
        self.outstanding.iter_mut().for_each(|o| *o = 0);
        self.round = self.map.shards_at(t);
    }

    /// Puts a split's parts in place of shard `sid` in the round. The shard is
    /// gone: its landing slot will not be written again, so no credit for it is
    /// awaited (its pull, refused, never brings one).
    fn replace_in_round(&mut self, sid: usize, parts: &[usize]) {
        self.credit[sid] = true;
        self.round.retain(|&s| s != sid);
        for &p in parts {
            if !self.round.contains(&p) {
                self.round.push(p);
            }
        }
    }

    /// Asks again the pulls answered "pull moved" (for version `need`): of the
    /// owner in the newest map, or of the parts of a shard split meanwhile;
    /// unless another request for the shard is in flight (a push sent again
    /// brings one) or the shard left the round (its push was answered "moved").
    fn ask_again(&mut self, need: u64) -> Result<(), WorkerError> {
        for (sid, refused) in std::mem::take(&mut self.pulls_moved) {
            if !self.round.contains(&sid) || self.round_pulled[sid] || self.outstanding[sid] > 0 {
                continue;
            }
            self.adopt_newest()?;
            let mut again = route::pull_again(&self.map, self.rank, sid, need, Some(refused));
            if again == PullAgain::NewerMap {
                self.refresh_map()?;
                again = route::pull_again(&self.map, self.rank, sid, need, None);
            }
            let cover = match again {
                PullAgain::Ask(cover) => cover,
                // A worker that leaves at `need` does not use that version: a
                // shard already past it (split or moved meanwhile) need not send it.
                PullAgain::Unused | PullAgain::NewerMap => {
                    self.round_pulled[sid] = true;
                    continue;
                }
            };
            if cover != [sid] {
                self.replace_in_round(sid, &cover);
            }
            for c in cover {
                self.await_route_away(c, need)?;
                let to = self.slot_at(&self.map.routes[c].owner)?;
                self.post_pull_req(c, to, need)?;
                self.outstanding[c] += 1;
            }
        }
        Ok(())
    }

    fn need_after_push(&self, t: u64) -> u64 {
        route::need_after_push(self.mode, self.spec.job.staleness as u64, t)
    }

    /// The server of `ep` and this worker's landing slot there.
    fn slot_at(&self, ep: &ShardEndpoint) -> Result<(u32, RemoteAddr), WorkerError> {
        let &(addr, rkey) = ep.landing.get(self.rank as usize).ok_or(WorkerError::Unexpected)?;
        Ok((ep.owner, RemoteAddr { addr, rkey }))
    }

    /// Asks server `to.0` (through this worker's slot `to.1`) for shard `sid` at
    /// version >= `need`.
    fn post_pull_req(&mut self, sid: usize, to: (u32, RemoteAddr), need: u64) -> Result<(), WorkerError> {
        let req = Imm { kind: ImmKind::PullReq, shard: sid as u32, seq: need as u16 }.encode();
        self.post(to.0, WR_PULLREQ | sid as u64, to.1, req, None)
    }

    /// Pushes shard `sid`'s gradient of iteration `t` and asks for the version after.
    fn push_shard(&mut self, sid: usize, t: u64) -> Result<(), WorkerError> {
        self.await_route_away(sid, t)?;
        let es = self.layout.dtype.size_bytes() as u64;
        let (start, len) = (self.map.routes[sid].start, self.map.routes[sid].len);
        let (owner, slot) = self.slot_at(self.route(sid, t))?;
        let push = Imm { kind: ImmKind::Push, shard: sid as u32, seq: t as u16 }.encode();
        self.post(owner, WR_PUSH | sid as u64, slot, push, Some((start * es, (len * es) as u32)))?;
        if self.mode != Consistency::Asp {
            self.post_pull_req(sid, (owner, slot), self.need_after_push(t))?;
            self.outstanding[sid] += 1;
        }
        self.credit[sid] = false;
        self.sending[sid] += 1;
        self.pushed_to[sid] = owner;
        self.count_pushed(len * es);
        Ok(())
    }

    fn qp(&self, server: u32) -> Result<&P::Qp, WorkerError> {
        self.qps.get(server as usize).and_then(Option::as_ref).ok_or(WorkerError::NoAddress(server))
    }

    /// Posts a WRITE_WITH_IMM to server `server` (payload: `grad` = (byte offset,
    /// length) of the gradient buffer, or none).
    fn post(&mut self, server: u32, wr_id: u64, to: RemoteAddr, imm: u32, grad: Option<(u64, u32)>) -> Result<(), WorkerError> {
        self.post_retrying(|w| {
            let sg_buf;
            let sg: &[Sge<'_, P::Mr>] = match grad {
                Some((off, len)) => {
                    sg_buf = [Sge::new(&w.grads, off, len)];
                    &sg_buf
                }
                None => &[],
            };
            let signaled = grad.is_some();
            Ok(w.qp(server)?.post_send(&SendWr { wr_id, op: SendOp::WriteImm(to, imm), sg, signaled })?)
        })
    }

    /// Runs `post` until the send queue takes the request: a full queue is
    /// backpressure (reap completions and retry).
    pub(crate) fn post_retrying(&mut self, post: impl Fn(&Self) -> Result<(), WorkerError>) -> Result<(), WorkerError> {
        loop {
            match post(self) {
                Err(WorkerError::Fabric(FabricError::QueueFull { .. })) => {
                    if !self.reap()? {
                        std::thread::yield_now();
                    }
                }
                r => return r,
            }
        }
    }

    /// Waits (up to the worker's timeout) until nothing is in flight: no pull
    /// a server may still answer into the parameter buffer, no push still
    /// reading the gradient buffer. After it, and once the worker is dropped,
    /// borrowed buffers ([`Worker::join_borrowed`]) are their owner's again.
    pub fn quiesce(&mut self) -> Result<(), WorkerError> {
        self.wait_until(
            |w| w.outstanding.iter().all(|&o| o == 0) && w.sending.iter().all(|&s| s == 0) && w.sparse.quiet(),
            "the pulls and pushes in flight to end",
        )
    }

    /// Asks to leave the running job (BSP): the change is voted at the next
    /// iteration boundary nobody has begun; this worker trains until
    /// [`Worker::begin`] says it no longer contributes, then finishes.
    pub fn leave(&mut self) -> Result<(), WorkerError> {
        self.ctl.call(&ControlMsg::Leave { rank: self.rank })?;
        Ok(())
    }

    /// Tells the control plane this worker is done and disconnects.
    pub fn finish(mut self) -> Result<WorkerStats, WorkerError> {
        self.finish_in_place()
    }

    /// As [`Worker::finish`], keeping the worker (and so its buffers, which
    /// hold the last parameters pulled) until it is dropped; nothing may be
    /// pushed or pulled after it.
    pub fn finish_in_place(&mut self) -> Result<WorkerStats, WorkerError> {
        // In SSP/ASP the last pushes may still await their credits, and a sparse
        // push its WRITE's completion and its credit (in any mode): drain them so
        // the servers have applied everything before we leave. (A WRITE its
        // requester leaves before it completed may never be executed: the
        // responder drops the requests of a peer that is gone.)
        let deadline = Instant::now() + self.timeout;
        while (self.credit.iter().any(|c| !c) || !self.sparse.applied()) && Instant::now() < deadline {
            if !self.reap()? {
                self.cq.wait(Duration::from_millis(1));
            }
        }
        self.watch.stop.store(true, Ordering::Relaxed);
        self.ctl.call(&ControlMsg::Finished { role: Role::Worker, rank: self.rank })?;
        Ok(self.stats)
    }
}

impl<P: Fabric> Drop for Worker<P> {
    fn drop(&mut self) {
        self.watch.stop.store(true, Ordering::Relaxed);
    }
}
