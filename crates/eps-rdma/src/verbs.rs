//! The data path over libibverbs and librdmacm: protection domain, registered
//! memory, completion queues, and reliable connected queue pairs set up through
//! rdma_cm (`cm.rs`, with the job-secret handshake before a connection is
//! accepted), implementing the fabric API (`eps_fabric::api`): periodic signaling
//! of unsignaled work requests and exact queue accounting (`acct.rs`), inline
//! sends of small messages, the registration cache (`regcache.rs`).

use std::io;
use std::net::SocketAddr;
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use eps_fabric::prelude::*;
use eps_fabric::{QpState, Result};
use rdma_sys as sys;

use crate::acct::{Acct, CqSide};

mod cm;
mod mr;
mod regcache;
pub use cm::RdmaListener;
pub use mr::{DeviceMemory, RdmaMr};
pub use regcache::{RegCacheConfig, RegCacheStats};

fn verbs_err(call: &'static str) -> FabricError {
    FabricError::Connect { peer: String::new(), stage: call, source: io::Error::last_os_error() }
}

/// The verbs context of one device, as rdma_cm uses it (rdma_cm's own contexts,
/// so that its connection ids and our protection domains match).
#[derive(Debug)]
pub struct RdmaDevice {
    ctx: *mut sys::ibv_context,
    name: String,
}

// SAFETY: an ibv_context is thread-safe in libibverbs (its calls lock internally);
// rdma_cm keeps it open for the life of the process.
unsafe impl Send for RdmaDevice {}
// SAFETY: as above.
unsafe impl Sync for RdmaDevice {}

impl RdmaDevice {
    /// The device named `name` (see `device::select`).
    pub fn open(name: &str) -> Result<Self> {
        let mut n: libc::c_int = 0;
        // SAFETY: `n` is a valid out-parameter; the list is freed below and the
        // contexts it names stay open (rdma_cm owns them).
        let list = unsafe { sys::rdma_get_devices(&mut n) };
        if list.is_null() {
            return Err(verbs_err("rdma_get_devices"));
        }
        let mut found = None;
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` contexts.
            let ctx = unsafe { *list.add(i) };
            // SAFETY: a live context names its device, whose name is a C string.
            let dev_name = unsafe { std::ffi::CStr::from_ptr(sys::ibv_get_device_name((*ctx).device)) };
            if dev_name.to_bytes() == name.as_bytes() {
                found = Some(ctx);
            }
        }
        // SAFETY: `list` came from rdma_get_devices and is freed once.
        unsafe { sys::rdma_free_devices(list) };
        let ctx = found.ok_or(FabricError::InvalidArgument("no rdma_cm device of that name"))?;
        Ok(Self { ctx, name: name.to_string() })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A new protection domain.
    /// Its registration cache is configured by the environment
    /// (`RegCacheConfig::from_env`).
    pub fn alloc_pd(&self) -> Result<RdmaPd> {
        self.alloc_pd_with(RegCacheConfig::from_env()?)
    }

    /// A new protection domain whose registration cache behaves as `cache` says.
    pub fn alloc_pd_with(&self, cache: RegCacheConfig) -> Result<RdmaPd> {
        // SAFETY: `ctx` is open (above).
        let pd = unsafe { sys::ibv_alloc_pd(self.ctx) };
        if pd.is_null() {
            return Err(verbs_err("ibv_alloc_pd"));
        }
        Ok(RdmaPd(Arc::new(PdInner { pd, ctx: self.ctx, cache: regcache::RegCache::new(cache) })))
    }
}

#[derive(Debug)]
struct PdInner {
    pd: *mut sys::ibv_pd,
    ctx: *mut sys::ibv_context,
    /// Dropped regions kept registered for reuse (see `regcache`).
    cache: regcache::RegCache,
}

// SAFETY: verbs objects may be used from any thread; libibverbs locks internally.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        self.cache.clear();
        // SAFETY: every region, QP and CQ holds an Arc of this, so none is left,
        // and the pool was just emptied.
        unsafe { sys::ibv_dealloc_pd(self.pd) };
    }
}

/// A protection domain.
#[derive(Clone, Debug)]
pub struct RdmaPd(Arc<PdInner>);

impl RdmaPd {
    /// What the registration cache did so far.
    pub fn reg_cache_stats(&self) -> RegCacheStats {
        self.0.cache.stats()
    }
}

impl Fabric for RdmaPd {
    const NAME: &'static str = "rdma";
}

#[derive(Debug)]
struct CqInner {
    cq: *mut sys::ibv_cq,
    ch: *mut sys::ibv_comp_channel,
    depth: u32,
    side: CqSide,
    /// The connections completing here: QP number -> (rdma_cm event channel, QP),
    /// watched for a peer's disconnect; and when they were last looked at.
    watch: std::sync::Mutex<(Instant, Watched)>,
}

/// QP number -> (its rdma_cm event channel, its QP), as addresses.
type Watched = std::collections::HashMap<u32, (usize, usize)>;

/// How often `poll` looks at the connections' rdma_cm events.
const WATCH_EVERY: Duration = Duration::from_millis(5);

impl CqInner {
    /// A peer that disconnected (it closed its QP, or its process ended) fails our
    /// QP, so that its outstanding requests complete (flushed) instead of being
    /// retransmitted to nobody, and its receives flush.
    fn watch_disconnects(&self) {
        let mut w = self.watch.lock().unwrap_or_else(|p| p.into_inner());
        if w.0.elapsed() < WATCH_EVERY || w.1.is_empty() {
            return;
        }
        w.0 = Instant::now();
        for &(ch, qp) in w.1.values() {
            let ch = ch as *mut sys::rdma_event_channel;
            // SAFETY: entries are removed (under this lock) before their QP and
            // channel are destroyed, so both are live here.
            let fd = unsafe { (*ch).fd };
            let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd; no wait.
            if unsafe { libc::poll(&mut p, 1, 0) } <= 0 {
                continue;
            }
            let Ok(e) = cm::next_event(ch, Duration::ZERO) else { continue };
            use sys::rdma_cm_event_type::*;
            if matches!(e.kind, RDMA_CM_EVENT_DISCONNECTED | RDMA_CM_EVENT_DEVICE_REMOVAL | RDMA_CM_EVENT_TIMEWAIT_EXIT) {
                // SAFETY: as above; only the state is modified.
                unsafe { fail_qp(qp as *mut sys::ibv_qp) };
            }
        }
    }
}

/// Moves a QP to the error state (its outstanding requests flush).
///
/// # Safety
/// `qp` is a live QP.
unsafe fn fail_qp(qp: *mut sys::ibv_qp) {
    // SAFETY: plain data; zero is a valid value.
    let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
    // SAFETY: the caller's promise; only the state is modified.
    unsafe { sys::ibv_modify_qp(qp, &mut attr, sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as libc::c_int) };
}

// SAFETY: verbs objects may be used from any thread; libibverbs locks internally.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc of it, so none is left; the
        // channel is destroyed after its CQ.
        unsafe {
            sys::ibv_destroy_cq(self.cq);
            sys::ibv_destroy_comp_channel(self.ch);
        }
    }
}

/// A completion queue with its completion channel (for `wait`).
#[derive(Clone, Debug)]
pub struct RdmaCq(Arc<CqInner>);

fn status(s: u32) -> WcStatus {
    use sys::ibv_wc_status::*;
    match s {
        IBV_WC_SUCCESS => WcStatus::Success,
        IBV_WC_LOC_LEN_ERR => WcStatus::LocalLength,
        IBV_WC_LOC_QP_OP_ERR => WcStatus::LocalQpOperation,
        IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtection,
        IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlush,
        IBV_WC_REM_INV_REQ_ERR => WcStatus::RemoteInvalidRequest,
        IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
        IBV_WC_REM_OP_ERR => WcStatus::RemoteOperation,
        IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
        _ => WcStatus::RemoteOperation,
    }
}

fn opcode(o: u32) -> WcOpcode {
    use sys::ibv_wc_opcode::*;
    match o {
        IBV_WC_RDMA_WRITE => WcOpcode::Write,
        IBV_WC_RDMA_READ => WcOpcode::Read,
        IBV_WC_RECV => WcOpcode::Recv,
        IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvWithImm,
        _ => WcOpcode::Send,
    }
}

impl CompletionQueue for RdmaCq {
    fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        self.0.watch_disconnects();
        let made = self.0.side.drain(out);
        eps_fabric::stats::completions(&out[..made]);
        let out = &mut out[made..];
        const BATCH: usize = 32;
        // SAFETY: ibv_wc is plain data; zero is a valid value.
        let mut wc: [sys::ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
        let want = out.len().min(BATCH) as libc::c_int;
        // SAFETY: the CQ is live; `wc` holds `want` entries.
        let n = unsafe { sys::ibv_poll_cq(self.0.cq, want, wc.as_mut_ptr()) };
        if n < 0 {
            return Err(FabricError::CqOverrun { depth: self.0.depth });
        }
        let mut kept = 0;
        for w in &wc[..n as usize] {
            let with_imm = w.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            let mut c = Completion {
                wr_id: w.wr_id,
                status: status(w.status),
                opcode: opcode(w.opcode),
                byte_len: w.byte_len,
                // SAFETY: the union holds the immediate when the flag says so.
                imm: with_imm.then(|| u32::from_be(unsafe { w.imm_data_invalidated_rkey_union.imm_data })),
                qp_num: w.qp_num,
            };
            if self.0.side.completed(&mut c) {
                out[kept] = c;
                kept += 1;
            }
        }
        eps_fabric::stats::completions(&out[..kept]);
        Ok(made + kept)
    }

    fn wait(&self, timeout: Duration) {
        // Arm, then sleep on the channel; a completion that came before arming is
        // found by the caller's next poll.
        // SAFETY: the CQ is live.
        unsafe { sys::ibv_req_notify_cq(self.0.cq, 0) };
        // SAFETY: the channel is live.
        let fd = unsafe { (*self.0.ch).fd };
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, timeout.as_millis().clamp(1, i32::MAX as u128) as i32) };
        if r > 0 {
            let mut cq = ptr::null_mut();
            let mut ctx = ptr::null_mut();
            // SAFETY: an event is ready on this channel (non-blocking below).
            if unsafe { sys::ibv_get_cq_event(self.0.ch, &mut cq, &mut ctx) } == 0 {
                // SAFETY: acknowledges the one event just taken.
                unsafe { sys::ibv_ack_cq_events(cq, 1) };
            }
        }
    }
}

/// A reliable connected queue pair and its rdma_cm id.
#[derive(Debug)]
pub struct RdmaQp {
    id: *mut sys::rdma_cm_id,
    ch: *mut sys::rdma_event_channel,
    peer: SocketAddr,
    max_sge: u32,
    max_msg: u32,
    /// The largest message the peer accepts (from the handshake).
    peer_max_msg: u32,
    /// Bytes a request may carry inline (0: none).
    max_inline: u32,
    acct: Arc<Acct>,
    _cqs: (Arc<CqInner>, Arc<CqInner>),
    _pd: Arc<PdInner>,
}

// SAFETY: posting to a QP from several threads is allowed by libibverbs.
unsafe impl Send for RdmaQp {}
// SAFETY: as above.
unsafe impl Sync for RdmaQp {}

impl Drop for RdmaQp {
    fn drop(&mut self) {
        // SAFETY: the id's QP is live until destroyed below.
        if let Some(n) = unsafe { (*self.id).qp.as_ref() }.map(|q| q.qp_num) {
            for cq in [&self._cqs.0, &self._cqs.1] {
                cq.side.detach(n);
                cq.watch.lock().unwrap_or_else(|p| p.into_inner()).1.remove(&n);
            }
        }
        // SAFETY: the id, its QP and the channel are ours and torn down once, in
        // this order.
        unsafe {
            sys::rdma_disconnect(self.id);
            if !(*self.id).qp.is_null() {
                sys::rdma_destroy_qp(self.id);
            }
            sys::rdma_destroy_id(self.id);
            sys::rdma_destroy_event_channel(self.ch);
        }
    }
}

impl RdmaQp {
    /// A QP owning `id` and its channel `ch` (its Drop tears them down), with the
    /// depths and limits of `o`; the peer's limit and inline size start unknown.
    fn new(
        id: *mut sys::rdma_cm_id,
        ch: *mut sys::rdma_event_channel,
        peer: SocketAddr,
        o: &QpOptions,
        cqs: (&RdmaCq, &RdmaCq),
        pd: &RdmaPd,
    ) -> Self {
        RdmaQp {
            id,
            ch,
            peer,
            max_sge: o.max_sge,
            max_msg: o.max_msg_bytes,
            peer_max_msg: u32::MAX,
            max_inline: 0,
            acct: Arc::new(Acct::new(o.max_send_wr, o.max_recv_wr)),
            _cqs: (cqs.0.0.clone(), cqs.1.0.clone()),
            _pd: pd.0.clone(),
        }
    }

    /// Completes `wr_id` with `status` without the NIC (it never saw the request)
    /// and moves the QP to the error state (its outstanding requests flush).
    fn fail_locally(&self, wr_id: u64, status: WcStatus, opcode: WcOpcode) -> Result<()> {
        let qp_num = self.qp_num();
        self._cqs.0.side.inject(Completion { wr_id, status, opcode, byte_len: 0, imm: None, qp_num });
        // SAFETY: the QP is live.
        unsafe { fail_qp((*self.id).qp) };
        Ok(())
    }

    /// Accounts the QP's requests on its CQs (once it exists).
    fn attach(&self) {
        self.account();
        self.watch();
    }

    /// Its CQs account its completions from now on (before any receive is posted).
    fn account(&self) {
        let n = self.qp_num();
        for cq in [&self._cqs.0, &self._cqs.1] {
            cq.side.attach(n, self.acct.clone());
        }
    }

    /// Its CQs watch its rdma_cm channel for the peer's disconnect from now on:
    /// only once it is established, since the watch takes the channel's events.
    fn watch(&self) {
        let n = self.qp_num();
        // SAFETY: the id's QP is live.
        let qp = unsafe { (*self.id).qp } as usize;
        for cq in [&self._cqs.0, &self._cqs.1] {
            cq.watch.lock().unwrap_or_else(|p| p.into_inner()).1.insert(n, (self.ch as usize, qp));
        }
    }
}

impl QueuePair for RdmaQp {
    type Mr = RdmaMr;

    fn post_send(&self, wr: &SendWr<'_, RdmaMr>) -> Result<()> {
        if wr.sg.len() > self.max_sge as usize {
            return Err(FabricError::InvalidArgument("more SGEs than the QP's max_sge"));
        }
        let mut sge: Vec<sys::ibv_sge> =
            wr.sg.iter().map(|s| sys::ibv_sge { addr: s.mr.addr() + s.offset, length: s.len, lkey: s.mr.lkey() }).collect();
        // SAFETY: ibv_send_wr is plain data; zero is a valid value.
        let mut w: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        w.wr_id = wr.wr_id;
        w.sg_list = if sge.is_empty() { ptr::null_mut() } else { sge.as_mut_ptr() };
        w.num_sge = sge.len() as libc::c_int;
        w.send_flags = if wr.signaled { sys::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
        use sys::ibv_wr_opcode::*;
        let remote = |w: &mut sys::ibv_send_wr, r: RemoteAddr| {
            w.wr.rdma = sys::rdma_t { remote_addr: r.addr, rkey: r.rkey };
        };
        match wr.op {
            SendOp::Send => w.opcode = IBV_WR_SEND,
            SendOp::Write(r) => {
                w.opcode = IBV_WR_RDMA_WRITE;
                remote(&mut w, r);
            }
            SendOp::WriteImm(r, imm) => {
                w.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
                w.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
                remote(&mut w, r);
            }
            SendOp::Read(r) => {
                w.opcode = IBV_WR_RDMA_READ;
                remote(&mut w, r);
            }
        }
        let op = match wr.op {
            SendOp::Send => WcOpcode::Send,
            SendOp::Write(_) | SendOp::WriteImm(..) => WcOpcode::Write,
            SendOp::Read(_) => WcOpcode::Read,
        };
        // Refused before the NIC: an SGE of another protection domain, or more
        // bytes than this QP sends. Completes with the error, and the QP fails.
        let total: u64 = wr.sg.iter().map(|s| u64::from(s.len)).sum();
        if wr.sg.iter().any(|s| !Arc::ptr_eq(&s.mr.pd, &self._pd)) {
            return self.fail_locally(wr.wr_id, WcStatus::LocalProtection, op);
        }
        if total > u64::from(self.max_msg) {
            return self.fail_locally(wr.wr_id, WcStatus::LocalLength, op);
        }
        // More than the peer accepts: its error, as its responder would give it;
        // the connection is closed so that the peer's QP fails too.
        if total > u64::from(self.peer_max_msg) {
            self.fail_locally(wr.wr_id, WcStatus::RemoteInvalidRequest, op)?;
            // SAFETY: the id is live; the peer sees a disconnect.
            unsafe { sys::rdma_disconnect(self.id) };
            return Ok(());
        }
        if self.acct.take_send(wr.wr_id, op, wr.signaled)? {
            w.send_flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        // Small payloads go inline (copied at post time), once their SGEs are
        // checked to lie inside their regions (the NIC does not check inline data).
        let inside = wr.sg.iter().all(|s| s.offset + u64::from(s.len) <= s.mr.len() as u64);
        if op != WcOpcode::Read && total > 0 && total <= u64::from(self.max_inline) && inside {
            w.send_flags |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
        }
        let mut bad = ptr::null_mut();
        // SAFETY: the QP is connected; `w` and the SGEs it points to live through
        // the call (verbs copy the request into the send queue).
        let rc = unsafe { sys::ibv_post_send((*self.id).qp, &mut w, &mut bad) };
        if rc != 0 {
            self.acct.untake_send();
        }
        match rc {
            0 => Ok(()),
            libc::ENOMEM => Err(FabricError::QueueFull { queue: "send", depth: 0 }),
            _ => Err(FabricError::InvalidArgument("ibv_post_send refused the request")),
        }
    }

    fn post_recv(&self, wr: &RecvWr<'_, RdmaMr>) -> Result<()> {
        let mut sge: Vec<sys::ibv_sge> =
            wr.sg.iter().map(|s| sys::ibv_sge { addr: s.mr.addr() + s.offset, length: s.len, lkey: s.mr.lkey() }).collect();
        // SAFETY: ibv_recv_wr is plain data; zero is a valid value.
        let mut w: sys::ibv_recv_wr = unsafe { std::mem::zeroed() };
        w.wr_id = wr.wr_id;
        w.sg_list = if sge.is_empty() { ptr::null_mut() } else { sge.as_mut_ptr() };
        w.num_sge = sge.len() as libc::c_int;
        self.acct.take_recv(wr.wr_id)?;
        let mut bad = ptr::null_mut();
        // SAFETY: as for post_send.
        let rc = unsafe { sys::ibv_post_recv((*self.id).qp, &mut w, &mut bad) };
        if rc != 0 {
            self.acct.untake_recv();
        }
        match rc {
            0 => Ok(()),
            libc::ENOMEM => Err(FabricError::QueueFull { queue: "receive", depth: 0 }),
            _ => Err(FabricError::InvalidArgument("ibv_post_recv refused the request")),
        }
    }

    fn qp_num(&self) -> u32 {
        // SAFETY: the id's QP lives as long as self.
        unsafe { (*(*self.id).qp).qp_num }
    }

    fn state(&self) -> QpState {
        // SAFETY: plain data; zero is a valid value of both.
        let (mut attr, mut init): (sys::ibv_qp_attr, sys::ibv_qp_init_attr) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        // SAFETY: the QP is live; both out-parameters are whole.
        let rc = unsafe {
            sys::ibv_query_qp((*self.id).qp, &mut attr, sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as libc::c_int, &mut init)
        };
        if rc == 0 && attr.qp_state == sys::ibv_qp_state::IBV_QPS_RTS { QpState::ReadyToSend } else { QpState::Error }
    }

    fn peer_addr(&self) -> SocketAddr {
        self.peer
    }
}

impl ProtectionDomain for RdmaPd {
    type Mr = RdmaMr;
    type Cq = RdmaCq;
    type Qp = RdmaQp;
    type Listener = RdmaListener;

    fn register(&self, buf: RegionBuf, access: Access) -> Result<RdmaMr> {
        mr::register_host(&self.0, buf, access)
    }

    fn alloc_mr(&self, len: usize, access: Access) -> Result<RdmaMr> {
        mr::alloc_host(&self.0, len, access)
    }

    fn create_cq(&self, depth: u32) -> Result<RdmaCq> {
        // SAFETY: the context is open.
        let ch = unsafe { sys::ibv_create_comp_channel(self.0.ctx) };
        if ch.is_null() {
            return Err(verbs_err("ibv_create_comp_channel"));
        }
        // Non-blocking, so `wait` never blocks past its poll.
        // SAFETY: the channel's fd is ours.
        unsafe {
            let fd = (*ch).fd;
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        // SAFETY: context and channel are live.
        let cq = unsafe { sys::ibv_create_cq(self.0.ctx, depth.max(1) as libc::c_int, ptr::null_mut(), ch, 0) };
        if cq.is_null() {
            let e = verbs_err("ibv_create_cq");
            // SAFETY: ours, no CQ on it.
            unsafe { sys::ibv_destroy_comp_channel(ch) };
            return Err(e);
        }
        Ok(RdmaCq(Arc::new(CqInner {
            cq,
            ch,
            depth,
            side: CqSide::default(),
            watch: std::sync::Mutex::new((Instant::now(), Default::default())),
        })))
    }

    fn listen(&self, addr: SocketAddr, opts: &QpOptions) -> Result<RdmaListener> {
        cm::listen(self, addr, opts)
    }

    fn connect(&self, addr: SocketAddr, send_cq: &RdmaCq, recv_cq: &RdmaCq, opts: &QpOptions) -> Result<RdmaQp> {
        cm::connect(self, addr, send_cq, recv_cq, opts)
    }
}
