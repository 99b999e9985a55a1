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
//!     let (params, grads) = w.buffers_f32().expect("an f32 job");
//!     for (g, p) in grads[weights.clone()].iter_mut().zip(&params[weights.clone()]) {
//!         *g = 2.0 * p; // the gradient of sum(p^2)
//!     }
//!     w.push_pull()?; // push every shard, wait for the next parameters
//! }
//! w.finish()?;
//! # Ok::<(), eps_worker::WorkerError>(())
//! ```
//!
//! # Safety
//! The buffers are registered memory that servers write into. They are only exposed
//! between operations: every method that starts transfers waits for them to finish
//! before returning, and the views borrow the worker, so no view can coexist with a
//! transfer. That is the invariant the `unsafe` views here rely on.

use std::net::SocketAddr;
use std::ops::Range;
use std::time::{Duration, Instant};

use eps_agg::DType;
use eps_control::{ControlClient, ControlError};
use eps_fabric::prelude::*;
use eps_proto::control::{ControlMsg, Role, ServerEndpoint};
use eps_proto::hello::{HELLO_LEN, Hello};
use eps_proto::imm::{Imm, ImmKind};
use eps_proto::layout::Layout;
use eps_proto::{Consistency, JobSpec, SpecError};

/// How a worker joins.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Control-plane address.
    pub control: SocketAddr,
    /// Job secret.
    pub secret: Secret,
    /// How long to wait for the control plane and the servers.
    pub timeout: Duration,
}

/// Errors of the worker library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// Talking to the control plane failed.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The spec is unusable.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The fabric failed.
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// A transfer completed with an error (the server may have closed the connection
    /// after a protocol violation; its log says why).
    #[error("{what} for shard {shard} failed: {status}")]
    Transfer {
        /// Push or pull.
        what: &'static str,
        /// Global shard id.
        shard: u32,
        /// The completion status.
        status: WcStatus,
    },
    /// No tensor has that name.
    #[error("unknown tensor {0:?}")]
    UnknownTensor(String),
    /// A buffer of the wrong length was passed.
    #[error("{what}: expected {expected} elements, got {got}")]
    Length {
        /// Which buffer.
        what: &'static str,
        /// Expected elements.
        expected: usize,
        /// Given elements.
        got: usize,
    },
    /// The control plane answered something unexpected.
    #[error("unexpected answer from the control plane")]
    Unexpected,
    /// Nothing arrived in time.
    #[error("timed out waiting for {0}")]
    Timeout(&'static str),
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
pub struct Worker {
    rank: u32,
    spec: JobSpec,
    layout: Layout,
    mode: Consistency,
    params: SoftMr,
    grads: SoftMr,
    qps: Vec<SoftQp>,
    servers: Vec<ServerEndpoint>,
    cq: SoftCq,
    /// Per server: global shard id of each local shard.
    local_to_global: Vec<Vec<u32>>,
    /// Per global shard: the landing slot may be written.
    credit: Vec<bool>,
    /// ASP: where each server's published-buffer stamps are read into.
    stamps: SoftMr,
    /// ASP: byte offset of each server's stamps in `stamps`.
    stamp_off: Vec<usize>,
    /// RDMA READs completed since the current read round began.
    reads_done: usize,
    iteration: u64,
    /// Pull answers received since the current push_pull/pull began.
    pulled: usize,
    /// Hello sends acknowledged.
    hellos_acked: usize,
    stats: WorkerStats,
    ctl: ControlClient,
    timeout: Duration,
    _hello: SoftMr,
    _pd: SoftPd,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("rank", &self.rank).field("iteration", &self.iteration).finish()
    }
}

impl Worker {
    /// Joins the job: registers, waits for the plan, registers buffers, connects to
    /// every server, and pulls version 0 of the parameters.
    pub fn join(cfg: &WorkerConfig) -> Result<Self, WorkerError> {
        let mut ctl = ControlClient::connect(cfg.control, &cfg.secret, cfg.timeout)?;
        let (rank, spec_text) = match ctl.call(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() })? {
            ControlMsg::Registered { rank, spec_toml } => (rank, spec_toml),
            _ => return Err(WorkerError::Unexpected),
        };
        let spec = JobSpec::from_toml(&spec_text)?;
        let layout = spec.layout()?;
        let ControlMsg::Plan { servers } = ctl.call(&ControlMsg::GetPlan)? else {
            return Err(WorkerError::Unexpected);
        };
        let dev = SoftDevice::open()?;
        let pd = dev.alloc_pd();
        let bytes = layout.bytes() as usize;
        let params = pd.alloc_mr(bytes, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
        let grads = pd.alloc_mr(bytes, Access::LOCAL_WRITE)?;
        let hello = pd.alloc_mr(HELLO_LEN, Access::LOCAL_WRITE)?;
        let mut stamp_off = Vec::with_capacity(servers.len());
        let mut stamp_bytes = 0usize;
        for r in 0..servers.len() as u32 {
            stamp_off.push(stamp_bytes);
            stamp_bytes += 16 * layout.shards_of(r).count();
        }
        let stamps = pd.alloc_mr(stamp_bytes.max(16), Access::LOCAL_WRITE)?;
        let mut local_to_global = vec![Vec::new(); servers.len()];
        for s in &layout.shards {
            local_to_global[s.server as usize].push(s.id);
        }
        let max_local = local_to_global.iter().map(Vec::len).max().unwrap_or(0) as u32;
        let max_bytes = layout.shards.iter().map(|s| s.len as usize * layout.dtype.size_bytes()).max().unwrap_or(0);
        let mut opts = QpOptions::new(cfg.secret.clone());
        opts.max_send_wr = 2 * max_local + 8;
        opts.max_recv_wr = 2 * max_local + 8;
        opts.max_sge = 1;
        opts.max_msg_bytes = (max_bytes as u64).max(eps_proto::layout::stamp_area_bytes(max_local as usize)) as u32;
        opts.connect_timeout = cfg.timeout;
        let cq = pd.create_cq((servers.len() as u32) * (4 * max_local + 24))?;
        let mut qps = Vec::with_capacity(servers.len());
        let mut h = hello;
        h.write_at(0, &Hello { rank, pull_rkey: params.rkey(), pull_addr: params.addr() }.encode());
        for ep in &servers {
            let addr: SocketAddr = ep.fabric_addr.parse().map_err(|_| WorkerError::Unexpected)?;
            let qp = pd.connect(addr, &cq, &cq, &opts)?;
            for _ in 0..opts.max_recv_wr {
                qp.post_recv(&RecvWr { wr_id: 0, sg: &[] })?;
            }
            qp.post_send(&SendWr { wr_id: WR_HELLO, op: SendOp::Send, sg: &[Sge::whole(&h)], signaled: true })?;
            qps.push(qp);
        }
        let n = layout.shards.len();
        let mut w = Self {
            rank,
            mode: spec.job.consistency,
            spec,
            layout,
            params,
            grads,
            qps,
            servers,
            cq,
            local_to_global,
            credit: vec![true; n],
            stamps,
            stamp_off,
            reads_done: 0,
            iteration: 0,
            pulled: 0,
            hellos_acked: 0,
            stats: WorkerStats::default(),
            ctl,
            timeout: cfg.timeout,
            _hello: h,
            _pd: pd,
        };
        let n = w.qps.len();
        w.wait_until(|w| w.hellos_acked >= n, "hello acknowledgements")?;
        if w.mode == Consistency::Asp {
            w.read_pull()?;
        } else {
            w.pull(0)?;
        }
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

    /// The iteration the next push belongs to.
    pub fn iteration(&self) -> u64 {
        self.iteration
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

    /// The parameter buffer as raw wire-dtype bytes.
    pub fn params_bytes(&self) -> &[u8] {
        // SAFETY: no transfer is in flight between calls (see the crate docs), and
        // the shared borrow of self excludes starting one while the slice lives.
        unsafe { self.params.as_slice() }
    }

    /// The gradient buffer as raw wire-dtype bytes.
    pub fn grads_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above; `&mut self` excludes pushes while the slice lives.
        unsafe { self.grads.as_mut_slice() }
    }

    /// The parameters as f32, without a copy (f32 jobs only).
    pub fn params_f32(&self) -> Option<&[f32]> {
        (self.layout.dtype == DType::F32).then(|| bytemuck::cast_slice(self.params_bytes()))
    }

    /// The gradient buffer as f32, without a copy (f32 jobs only).
    pub fn grads_f32_mut(&mut self) -> Option<&mut [f32]> {
        (self.layout.dtype == DType::F32).then(|| bytemuck::cast_slice_mut(self.grads_bytes_mut()))
    }

    /// Parameters and gradient buffer together, without copies (f32 jobs only).
    pub fn buffers_f32(&mut self) -> Option<(&[f32], &mut [f32])> {
        if self.layout.dtype != DType::F32 {
            return None;
        }
        // SAFETY: no transfer is in flight between calls (crate docs); `&mut self`
        // excludes starting one while the slices live, and the two regions are
        // distinct registrations.
        let (p, g) = unsafe { (self.params.as_slice(), self.grads.as_mut_slice()) };
        Some((bytemuck::cast_slice(p), bytemuck::cast_slice_mut(g)))
    }

    /// Widens the parameters into `out` (any dtype).
    pub fn read_params(&self, out: &mut [f32]) -> Result<(), WorkerError> {
        let n = self.layout.total as usize;
        if out.len() != n {
            return Err(WorkerError::Length { what: "parameters", expected: n, got: out.len() });
        }
        let b = self.params_bytes();
        let dtype = self.layout.dtype;
        if let Some(p) = self.params_f32() {
            out.copy_from_slice(p);
        } else {
            eps_agg::reduce::sum(dtype, &[b], out, 1);
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

    fn need_after_push(&self, t: u64) -> u64 {
        match self.mode {
            Consistency::Bsp => t + 1,
            Consistency::Ssp => (t + 1).saturating_sub(self.spec.job.staleness as u64),
            Consistency::Asp => 0,
        }
    }

    /// Pushes this iteration's gradients and pulls the parameters of the next one,
    /// shard by shard, all shards in flight at once. Returns when every shard's new
    /// parameters are in the buffer.
    pub fn push_pull(&mut self) -> Result<(), WorkerError> {
        let start = Instant::now();
        let t = self.iteration;
        let need = self.need_after_push(t);
        let es = self.layout.dtype.size_bytes() as u64;
        let mut posted = 0usize;
        self.pulled = 0;
        for sid in 0..self.layout.shards.len() {
            self.wait_until(|w| w.credit[sid], "a credit for the landing slot")?;
            let s = self.layout.shards[sid];
            let (slot_base, rkey) = self.servers[s.server as usize].landing[self.rank as usize];
            let slot_off = self.slot_offset(s.server, s.local);
            let push = Imm { kind: ImmKind::Push, shard: s.local, seq: t as u16 }.encode();
            let to = RemoteAddr { addr: slot_base + slot_off, rkey };
            self.post(s.server, WR_PUSH | sid as u64, to, push, Some((s.start * es, (s.len * es) as u32)))?;
            if self.mode != Consistency::Asp {
                let req = Imm { kind: ImmKind::PullReq, shard: s.local, seq: need as u16 }.encode();
                self.post(s.server, WR_PULLREQ | sid as u64, RemoteAddr { addr: slot_base, rkey }, req, None)?;
            }
            self.credit[sid] = false;
            posted += 1;
            self.stats.pushed_bytes += s.len * es;
        }
        if self.mode == Consistency::Asp {
            self.read_pull()?;
        } else {
            self.wait_pulls(posted)?;
        }
        self.iteration += 1;
        self.stats.comm += start.elapsed();
        Ok(())
    }

    /// Pulls every shard once `need` is met (see `ShardSync::on_pull`).
    fn pull(&mut self, need: u64) -> Result<(), WorkerError> {
        let start = Instant::now();
        self.pulled = 0;
        for sid in 0..self.layout.shards.len() {
            let s = self.layout.shards[sid];
            let (slot_base, rkey) = self.servers[s.server as usize].landing[self.rank as usize];
            let req = Imm { kind: ImmKind::PullReq, shard: s.local, seq: need as u16 }.encode();
            self.post(s.server, WR_PULLREQ | sid as u64, RemoteAddr { addr: slot_base, rkey }, req, None)?;
        }
        self.wait_pulls(self.layout.shards.len())?;
        self.stats.comm += start.elapsed();
        Ok(())
    }

    /// Posts a WRITE_WITH_IMM to server `server` (payload: `grad` = (byte offset,
    /// length) of the gradient buffer, or none); a full send queue is backpressure:
    /// reap completions and retry.
    fn post(&mut self, server: u32, wr_id: u64, to: RemoteAddr, imm: u32, grad: Option<(u64, u32)>) -> Result<(), WorkerError> {
        loop {
            let res = {
                let sg_buf;
                let sg: &[Sge<'_, SoftMr>] = match grad {
                    Some((off, len)) => {
                        sg_buf = [Sge::new(&self.grads, off, len)];
                        &sg_buf
                    }
                    None => &[],
                };
                let signaled = grad.is_some();
                self.qps[server as usize].post_send(&SendWr { wr_id, op: SendOp::WriteImm(to, imm), sg, signaled })
            };
            match res {
                Err(FabricError::QueueFull { .. }) => {
                    if !self.reap()? {
                        std::thread::yield_now();
                    }
                }
                r => return Ok(r?),
            }
        }
    }

    /// ASP pull: RDMA-READ every shard's newest published buffer straight into the
    /// parameter buffer, checking its version stamp before and after (a buffer the
    /// server rewrote meanwhile is read again). The server does no work for it.
    fn read_pull(&mut self) -> Result<(), WorkerError> {
        let start = Instant::now();
        let es = self.layout.dtype.size_bytes() as u64;
        let n = self.layout.shards.len();
        let mut todo: Vec<usize> = (0..n).collect();
        let mut chosen = vec![(0usize, 0u64); n];
        for _round in 0..1000 {
            // 1. Stamps of every server, then pick each shard's newest buffer.
            self.read_stamps()?;
            for &sid in &todo {
                let s = self.layout.shards[sid];
                let (a, b) = self.stamp(s.server, s.local);
                let valid = |v: u64| v != eps_proto::layout::STAMP_WRITING;
                chosen[sid] = match (valid(a), valid(b)) {
                    (true, true) if b > a => (1, b),
                    (true, _) => (0, a),
                    (false, true) => (1, b),
                    (false, false) => (0, u64::MAX),
                };
            }
            // 2. The buffers.
            let ready: Vec<usize> = todo.iter().copied().filter(|&sid| chosen[sid].1 != u64::MAX).collect();
            self.reads_done = 0;
            for &sid in &ready {
                let s = self.layout.shards[sid];
                let ep = &self.servers[s.server as usize];
                let off = self.layout.published_offset(s.server, s.local, chosen[sid].0);
                let from = RemoteAddr { addr: ep.published_addr + off, rkey: ep.published_rkey };
                let sg = [Sge::new(&self.params, s.start * es, (s.len * es) as u32)];
                self.post_read(s.server, from, &sg)?;
                self.stats.pulled_bytes += s.len * es;
            }
            let k = ready.len();
            self.wait_until(|w| w.reads_done >= k, "RDMA READs of the published parameters")?;
            // 3. Stamps again: keep the shards whose buffer did not change.
            self.read_stamps()?;
            todo.retain(|&sid| {
                let s = self.layout.shards[sid];
                let (a, b) = self.stamp(s.server, s.local);
                let now = if chosen[sid].0 == 0 { a } else { b };
                now != chosen[sid].1 || chosen[sid].1 == u64::MAX
            });
            if todo.is_empty() {
                self.stats.comm += start.elapsed();
                return Ok(());
            }
        }
        Err(WorkerError::Timeout("a consistent read of the published parameters"))
    }

    fn stamp(&self, server: u32, local: u32) -> (u64, u64) {
        let mut b = [0u8; 16];
        self.stamps.read_at(self.stamp_off[server as usize] + 16 * local as usize, &mut b);
        (u64::from_le_bytes(b[..8].try_into().expect("8")), u64::from_le_bytes(b[8..].try_into().expect("8")))
    }

    fn read_stamps(&mut self) -> Result<(), WorkerError> {
        self.reads_done = 0;
        for r in 0..self.servers.len() {
            let len = 16 * self.local_to_global[r].len();
            if len == 0 {
                continue;
            }
            let ep = &self.servers[r];
            let from = RemoteAddr { addr: ep.published_addr, rkey: ep.published_rkey };
            let sg = [Sge::new(&self.stamps, self.stamp_off[r] as u64, len as u32)];
            self.post_read(r as u32, from, &sg)?;
        }
        let k = self.local_to_global.iter().filter(|l| !l.is_empty()).count();
        self.wait_until(|w| w.reads_done >= k, "RDMA READs of the published parameters")
    }

    fn post_read(&self, server: u32, from: RemoteAddr, sg: &[Sge<'_, SoftMr>]) -> Result<(), WorkerError> {
        loop {
            match self.qps[server as usize].post_send(&SendWr { wr_id: WR_READ, op: SendOp::Read(from), sg, signaled: true }) {
                Err(FabricError::QueueFull { .. }) => {
                    // Drive the queue without taking completions (wait_until counts them).
                    self.cq.poll(&mut [])?;
                    std::thread::yield_now();
                }
                r => return Ok(r?),
            }
        }
    }

    /// Byte offset of local shard `local` within this server's landing region.
    fn slot_offset(&self, server: u32, local: u32) -> u64 {
        let es = self.layout.dtype.size_bytes() as u64;
        self.local_to_global[server as usize][..local as usize].iter().map(|&g| self.layout.shards[g as usize].len * es).sum()
    }

    /// Reaps completions until `done` holds: spinning while they flow, sleeping on
    /// the CQ after 200 us without any; fails after the worker's timeout.
    fn wait_until(&mut self, done: impl Fn(&Self) -> bool, what: &'static str) -> Result<(), WorkerError> {
        let deadline = Instant::now() + self.timeout;
        let mut idle = Instant::now();
        while !done(self) {
            if self.reap()? {
                idle = Instant::now();
            } else if Instant::now() > deadline {
                return Err(WorkerError::Timeout(what));
            } else if idle.elapsed() > Duration::from_micros(200) {
                self.cq.wait(Duration::from_millis(1));
            }
        }
        Ok(())
    }

    fn wait_pulls(&mut self, n: usize) -> Result<(), WorkerError> {
        self.wait_until(|w| w.pulled >= n, "pull answers from the servers")
    }

    /// Polls once; counts pull answers and acknowledged hellos. True if anything came.
    fn reap(&mut self) -> Result<bool, WorkerError> {
        let mut wc = [Completion::EMPTY; 64];
        let k = self.cq.poll(&mut wc)?;
        for c in &wc[..k] {
            let server = self.qps.iter().position(|q| q.qp_num() == c.qp_num).unwrap_or(0);
            if !c.status.is_ok() {
                let what = if c.wr_id & (3 << 62) == WR_PUSH { "push" } else { "pull" };
                return Err(WorkerError::Transfer { what, shard: (c.wr_id & 0xFFFF_FFFF) as u32, status: c.status });
            }
            match c.opcode {
                WcOpcode::RecvWithImm => {
                    self.qps[server].post_recv(&RecvWr { wr_id: 0, sg: &[] })?;
                    let Some(m) = c.imm.and_then(Imm::decode) else { continue };
                    let Some(&gid) = self.local_to_global[server].get(m.shard as usize) else { continue };
                    match m.kind {
                        ImmKind::PullDone => {
                            self.pulled += 1;
                            self.stats.pulled_bytes += c.byte_len as u64;
                            if self.mode == Consistency::Bsp {
                                self.credit[gid as usize] = true;
                            }
                        }
                        ImmKind::Credit => self.credit[gid as usize] = true,
                        _ => {}
                    }
                }
                _ if c.wr_id == WR_HELLO => self.hellos_acked += 1,
                WcOpcode::Read if c.wr_id == WR_READ => self.reads_done += 1,
                _ => {}
            }
        }
        Ok(k > 0)
    }

    /// Tells the control plane this worker is done and disconnects.
    pub fn finish(mut self) -> Result<WorkerStats, WorkerError> {
        // In SSP/ASP the last pushes may still await their credits: drain them so the
        // servers have applied everything before we leave.
        let deadline = Instant::now() + self.timeout;
        while self.credit.iter().any(|c| !c) && Instant::now() < deadline {
            if !self.reap()? {
                self.cq.wait(Duration::from_millis(1));
            }
        }
        self.ctl.call(&ControlMsg::Finished { role: Role::Worker, rank: self.rank })?;
        Ok(self.stats)
    }
}
