//! The data path over libibverbs and librdmacm: protection domain, registered
//! memory, completion queues, and reliable connected queue pairs set up through
//! rdma_cm, implementing the fabric API (`eps_fabric::api`).
//!
//! Not done yet (so not reachable from the `eps` command line): the job-secret
//! handshake before remote access is enabled, a registration cache, periodic
//! signaling of unsignaled writes, inline sends, and the conformance suite's
//! error cases; see the crate docs.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use eps_fabric::prelude::*;
use eps_fabric::{QpState, Result};
use rdma_sys as sys;

use crate::acct::{Acct, CqSide};
use crate::handshake::{self, Msg};

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
    pub fn alloc_pd(&self) -> Result<RdmaPd> {
        // SAFETY: `ctx` is open (above).
        let pd = unsafe { sys::ibv_alloc_pd(self.ctx) };
        if pd.is_null() {
            return Err(verbs_err("ibv_alloc_pd"));
        }
        Ok(RdmaPd(Arc::new(PdInner { pd, ctx: self.ctx })))
    }
}

#[derive(Debug)]
struct PdInner {
    pd: *mut sys::ibv_pd,
    ctx: *mut sys::ibv_context,
}

// SAFETY: verbs objects may be used from any thread; libibverbs locks internally.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every region, QP and CQ holds an Arc of this, so none is left.
        unsafe { sys::ibv_dealloc_pd(self.pd) };
    }
}

/// A protection domain.
#[derive(Clone, Debug)]
pub struct RdmaPd(Arc<PdInner>);

/// A registered memory region.
#[derive(Debug)]
pub struct RdmaMr {
    mr: *mut sys::ibv_mr,
    buf: RegionBuf,
    access: Access,
    _pd: Arc<PdInner>,
}

// SAFETY: the region's bytes are reached through `read_at`/`write_at` (copies) and
// by the NIC; the ibv_mr handle is immutable after registration.
unsafe impl Send for RdmaMr {}
// SAFETY: as above.
unsafe impl Sync for RdmaMr {}

impl Drop for RdmaMr {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once; the buffer outlives it.
        unsafe { sys::ibv_dereg_mr(self.mr) };
    }
}

impl MemoryRegion for RdmaMr {
    fn lkey(&self) -> u32 {
        // SAFETY: `mr` is registered for the life of self.
        unsafe { (*self.mr).lkey }
    }
    fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }
    fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }
    fn len(&self) -> usize {
        self.buf.len()
    }
    fn access(&self) -> Access {
        self.access
    }
    fn read_at(&self, offset: usize, out: &mut [u8]) {
        out.copy_from_slice(&self.buf.as_slice()[offset..offset + out.len()]);
    }
    fn write_at(&mut self, offset: usize, data: &[u8]) {
        self.buf.as_mut_slice()[offset..offset + data.len()].copy_from_slice(data);
    }
}

fn access_flags(a: Access) -> u32 {
    let mut f = 0;
    if a.contains(Access::LOCAL_WRITE) {
        f |= sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    }
    if a.contains(Access::REMOTE_WRITE) {
        // Verbs require local write with remote write.
        f |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0 | sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    }
    if a.contains(Access::REMOTE_READ) {
        f |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
    }
    f
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
            let Ok(e) = next_event(ch, Duration::ZERO) else { continue };
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
        let n = self.qp_num();
        // SAFETY: the id's QP is live.
        let qp = unsafe { (*self.id).qp } as usize;
        for cq in [&self._cqs.0, &self._cqs.1] {
            cq.side.attach(n, self.acct.clone());
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
        if wr.sg.iter().any(|s| !Arc::ptr_eq(&s.mr._pd, &self._pd)) {
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

/// Waits up to `timeout` for the next event on `ch`; returns (type, id, status).
/// One rdma_cm event: its type, id, status and private data (connection events).
struct Event {
    kind: u32,
    id: *mut sys::rdma_cm_id,
    status: i32,
    private: Vec<u8>,
}

fn next_event(ch: *mut sys::rdma_event_channel, timeout: Duration) -> Result<Event> {
    // SAFETY: the channel is live.
    let fd = unsafe { (*ch).fd };
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, timeout.as_millis().clamp(0, i32::MAX as u128) as i32) };
    if r <= 0 {
        return Err(FabricError::Timeout("an rdma_cm event"));
    }
    let mut ev = ptr::null_mut();
    // SAFETY: an event is ready; `ev` receives it and is acknowledged below.
    if unsafe { sys::rdma_get_cm_event(ch, &mut ev) } != 0 {
        return Err(verbs_err("rdma_get_cm_event"));
    }
    // SAFETY: `ev` is a live event until acknowledged; for connection events its
    // `param.conn` names `private_data_len` bytes owned by the event.
    let out = unsafe {
        let e = &*ev;
        let conn = e.param.conn;
        let private = if conn.private_data.is_null() {
            Vec::new()
        } else {
            std::slice::from_raw_parts(conn.private_data.cast::<u8>(), conn.private_data_len as usize).to_vec()
        };
        Event { kind: e.event, id: e.id, status: e.status, private }
    };
    // SAFETY: acknowledged once, after the private data was copied.
    unsafe { sys::rdma_ack_cm_event(ev) };
    Ok(out)
}

fn expect_event(ch: *mut sys::rdma_event_channel, want: u32, deadline: Instant, stage: &'static str) -> Result<Event> {
    let e = next_event(ch, deadline.saturating_duration_since(Instant::now()))?;
    if e.kind != want {
        return Err(FabricError::Connect {
            peer: String::new(),
            stage,
            source: io::Error::other(format!("rdma_cm event {} (status {}) instead of {want}", e.kind, e.status)),
        });
    }
    Ok(e)
}

/// The QP's ACK timeout exponent (4.096 us x 2^16: about 0.27 s; a vanished peer
/// is declared after 7 retries, about 2 s), set before the QP is connected.
const ACK_TIMEOUT: u8 = 16;

fn set_ack_timeout(id: *mut sys::rdma_cm_id) {
    let mut t = ACK_TIMEOUT;
    // SAFETY: `id` is live; the option is one byte (RDMA_OPTION_ID = 0,
    // RDMA_OPTION_ID_ACK_TIMEOUT = 3 in rdma_cma.h). A kernel without the option
    // keeps its default.
    unsafe { sys::rdma_set_option(id, 0, 3, (&mut t as *mut u8).cast(), 1) };
}

fn sockaddr(a: SocketAddr) -> Result<libc::sockaddr_in> {
    let SocketAddr::V4(v4) = a else { return Err(FabricError::InvalidArgument("rdma needs an IPv4 address")) };
    Ok(libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: v4.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*v4.ip()).to_be() },
        sin_zero: [0; 8],
    })
}

fn qp_attr(send: &RdmaCq, recv: &RdmaCq, o: &QpOptions) -> sys::ibv_qp_init_attr {
    // SAFETY: ibv_qp_init_attr is plain data; zero is a valid value.
    let mut a: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    a.send_cq = send.0.cq;
    a.recv_cq = recv.0.cq;
    a.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
    a.cap.max_send_wr = o.max_send_wr;
    a.cap.max_recv_wr = o.max_recv_wr;
    a.cap.max_send_sge = o.max_sge;
    a.cap.max_recv_sge = o.max_sge;
    a.sq_sig_all = 0;
    a
}

/// Bytes of inline data asked for (the device may give more, or none).
const INLINE_ASK: u32 = 64;

/// Creates `id`'s QP, with inline data when the device allows it; returns the
/// inline size it got.
fn create_qp(id: *mut sys::rdma_cm_id, pd: *mut sys::ibv_pd, send: &RdmaCq, recv: &RdmaCq, o: &QpOptions) -> Result<u32> {
    for inline in [INLINE_ASK, 0] {
        let mut attr = qp_attr(send, recv, o);
        attr.cap.max_inline_data = inline;
        // SAFETY: `id` is bound to the PD's device; `attr` is valid for the call.
        if unsafe { sys::rdma_create_qp(id, pd, &mut attr) } == 0 {
            return Ok(attr.cap.max_inline_data.min(inline));
        }
    }
    Err(verbs_err("rdma_create_qp"))
}

fn conn_param(o: &QpOptions) -> sys::rdma_conn_param {
    // SAFETY: rdma_conn_param is plain data; zero is a valid value.
    let mut p: sys::rdma_conn_param = unsafe { std::mem::zeroed() };
    p.responder_resources = 16;
    p.initiator_depth = 16;
    p.retry_count = 7;
    // 7: wait for a receive forever; otherwise a few retries.
    p.rnr_retry_count = if o.rnr_timeout.is_none() { 7 } else { 3 };
    p
}

/// A challenge given out: (nonce_s, the dialer's nonce_c and message limit, when).
type Challenge = ([u8; 16], [u8; 16], u32, Instant);

/// An rdma_cm listener.
#[derive(Debug)]
pub struct RdmaListener {
    id: *mut sys::rdma_cm_id,
    ch: *mut sys::rdma_event_channel,
    addr: SocketAddr,
    pd: RdmaPd,
    opts: QpOptions,
    /// Challenges given out and not answered yet.
    challenges: std::sync::Mutex<std::collections::VecDeque<Challenge>>,
}

// SAFETY: the listener's id and channel are used by one accept at a time (&self
// methods only read the handles; rdma_cm locks internally).
unsafe impl Send for RdmaListener {}
// SAFETY: as above.
unsafe impl Sync for RdmaListener {}

impl Drop for RdmaListener {
    fn drop(&mut self) {
        // SAFETY: ours, destroyed once, id before its channel.
        unsafe {
            sys::rdma_destroy_id(self.id);
            sys::rdma_destroy_event_channel(self.ch);
        }
    }
}

fn new_id() -> Result<(*mut sys::rdma_event_channel, *mut sys::rdma_cm_id)> {
    // SAFETY: creates a channel we own.
    let ch = unsafe { sys::rdma_create_event_channel() };
    if ch.is_null() {
        return Err(verbs_err("rdma_create_event_channel"));
    }
    let mut id = ptr::null_mut();
    // SAFETY: `ch` is live; `id` receives the new id.
    if unsafe { sys::rdma_create_id(ch, &mut id, ptr::null_mut(), sys::rdma_port_space::RDMA_PS_TCP) } != 0 {
        let e = verbs_err("rdma_create_id");
        // SAFETY: ours, no id on it.
        unsafe { sys::rdma_destroy_event_channel(ch) };
        return Err(e);
    }
    Ok((ch, id))
}

impl Listener for RdmaListener {
    type Qp = RdmaQp;
    type Cq = RdmaCq;

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn accept(&self, send_cq: &RdmaCq, recv_cq: &RdmaCq, timeout: Duration) -> Result<RdmaQp> {
        let deadline = Instant::now() + timeout;
        let (id, reply, peer_max) = self.next_proven(deadline)?;
        // Its own channel, so its events do not mix with other connections'.
        // SAFETY: creates a channel we own.
        let ch = unsafe { sys::rdma_create_event_channel() };
        if ch.is_null() {
            return Err(verbs_err("rdma_create_event_channel"));
        }
        // SAFETY: `id` is the new connection's id; `ch` is live.
        if unsafe { sys::rdma_migrate_id(id, ch) } != 0 {
            return Err(verbs_err("rdma_migrate_id"));
        }
        set_ack_timeout(id);
        let max_inline = create_qp(id, self.pd.0.pd, send_cq, recv_cq, &self.opts)?;
        let mut param = conn_param(&self.opts);
        let reply = reply.encode();
        param.private_data = reply.as_ptr().cast();
        param.private_data_len = reply.len() as u8;
        // SAFETY: `id` has a QP; `param` and the bytes it names are valid for the call.
        if unsafe { sys::rdma_accept(id, &mut param) } != 0 {
            return Err(verbs_err("rdma_accept"));
        }
        expect_event(ch, sys::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED, deadline, "establishing")?;
        // SAFETY: the id's route holds the peer's address once connected.
        let peer = unsafe { peer_of(id) };
        let qp = RdmaQp {
            id,
            ch,
            peer,
            max_sge: self.opts.max_sge,
            max_msg: self.opts.max_msg_bytes,
            peer_max_msg: peer_max,
            max_inline,
            acct: Arc::new(Acct::new(self.opts.max_send_wr, self.opts.max_recv_wr)),
            _cqs: (send_cq.0.clone(), recv_cq.0.clone()),
            _pd: self.pd.0.clone(),
        };
        qp.attach();
        Ok(qp)
    }
}

impl RdmaListener {
    /// Waits for a connect request whose peer proved the job secret (see
    /// `handshake.rs`), answering the others; returns its id and the reply to
    /// accept it with.
    fn next_proven(&self, deadline: Instant) -> Result<(*mut sys::rdma_cm_id, Msg, u32)> {
        loop {
            let e = next_event(self.ch, deadline.saturating_duration_since(Instant::now()))?;
            if e.kind != sys::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
                continue;
            }
            let mut ch = self.challenges.lock().unwrap_or_else(|p| p.into_inner());
            ch.retain(|c| c.3.elapsed() < Duration::from_secs(60));
            let answer = match Msg::decode(&e.private) {
                Some(Msg::Hello { nonce_c, max_msg }) => {
                    let nonce_s = eps_fabric::auth::nonce().map_err(FabricError::Engine)?;
                    if ch.len() >= 256 {
                        ch.pop_front();
                    }
                    ch.push_back((nonce_s, nonce_c, max_msg, Instant::now()));
                    Msg::Challenge { nonce_s }
                }
                Some(Msg::Proof { nonce_s, proof_c }) => {
                    // Each challenge answers once.
                    let pos = ch.iter().position(|c| c.0 == nonce_s);
                    let given = pos.and_then(|i| ch.remove(i));
                    match given {
                        Some((_, nonce_c, peer_max, _))
                            if eps_fabric::auth::proofs_equal(
                                &proof_c,
                                &handshake::proof_c(&self.opts.secret, &nonce_c, &nonce_s),
                            ) =>
                        {
                            let proof_s = handshake::proof_s(&self.opts.secret, &nonce_c, &nonce_s);
                            return Ok((e.id, Msg::Accepted { proof_s, max_msg: self.opts.max_msg_bytes }, peer_max));
                        }
                        _ => Msg::Denied,
                    }
                }
                _ => Msg::Denied,
            };
            drop(ch);
            let b = answer.encode();
            // SAFETY: `e.id` is the request's id; the bytes live through the call;
            // the id is destroyed once, after the reject.
            unsafe {
                sys::rdma_reject(e.id, b.as_ptr().cast(), b.len() as u8);
                sys::rdma_destroy_id(e.id);
            }
        }
    }
}

/// # Safety
/// `id` is a live, connected rdma_cm id.
unsafe fn peer_of(id: *mut sys::rdma_cm_id) -> SocketAddr {
    // SAFETY: the caller's promise; the helper returns a reference into `id`.
    let sa: &libc::sockaddr = unsafe { sys::rdma_get_peer_addr(&*id) };
    if sa.sa_family != libc::AF_INET as libc::sa_family_t {
        return SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0));
    }
    // SAFETY: an AF_INET address is a sockaddr_in (the union's storage holds it).
    let sin = unsafe { &*(sa as *const libc::sockaddr).cast::<libc::sockaddr_in>() };
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)), u16::from_be(sin.sin_port)))
}

impl RdmaPd {
    /// One connection attempt to `addr` carrying `msg`: resolves, creates the QP,
    /// connects, and returns the QP with the event that answered (established or
    /// rejected, with the listener's private data).
    fn dial(
        &self,
        addr: SocketAddr,
        send_cq: &RdmaCq,
        recv_cq: &RdmaCq,
        opts: &QpOptions,
        msg: &Msg,
        deadline: Instant,
    ) -> Result<(RdmaQp, Event)> {
        let (ch, id) = new_id()?;
        // Owns id and channel from here (its Drop tears them down on error).
        let mut qp = RdmaQp {
            id,
            ch,
            peer: addr,
            max_sge: opts.max_sge,
            max_msg: opts.max_msg_bytes,
            peer_max_msg: u32::MAX,
            max_inline: 0,
            acct: Arc::new(Acct::new(opts.max_send_wr, opts.max_recv_wr)),
            _cqs: (send_cq.0.clone(), recv_cq.0.clone()),
            _pd: self.0.clone(),
        };
        let mut sin = sockaddr(addr)?;
        let ms = deadline.saturating_duration_since(Instant::now()).as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: `id` is live; `sin` is valid for the call.
        if unsafe { sys::rdma_resolve_addr(id, ptr::null_mut(), (&mut sin as *mut libc::sockaddr_in).cast(), ms) } != 0 {
            return Err(verbs_err("rdma_resolve_addr"));
        }
        expect_event(ch, sys::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED, deadline, "address resolution")?;
        set_ack_timeout(id);
        // SAFETY: the address is resolved.
        if unsafe { sys::rdma_resolve_route(id, ms) } != 0 {
            return Err(verbs_err("rdma_resolve_route"));
        }
        expect_event(ch, sys::rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED, deadline, "route resolution")?;
        // SAFETY: resolved ids name their device's context.
        if unsafe { (*id).verbs } != self.0.ctx {
            return Err(FabricError::InvalidArgument("the peer is reached through another RDMA device than this PD's"));
        }
        qp.max_inline = create_qp(id, self.0.pd, send_cq, recv_cq, opts)?;
        let mut param = conn_param(opts);
        let b = msg.encode();
        param.private_data = b.as_ptr().cast();
        param.private_data_len = b.len() as u8;
        // SAFETY: `id` has a QP; `param` and the bytes it names are valid for the call.
        if unsafe { sys::rdma_connect(id, &mut param) } != 0 {
            return Err(verbs_err("rdma_connect"));
        }
        let e = next_event(ch, deadline.saturating_duration_since(Instant::now()))?;
        Ok((qp, e))
    }
}

impl ProtectionDomain for RdmaPd {
    type Mr = RdmaMr;
    type Cq = RdmaCq;
    type Qp = RdmaQp;
    type Listener = RdmaListener;

    fn register(&self, mut buf: RegionBuf, access: Access) -> Result<RdmaMr> {
        let flags = access_flags(access);
        // SAFETY: the buffer is ours and lives in the returned region as long as
        // the registration.
        let mr = unsafe { sys::ibv_reg_mr(self.0.pd, buf.as_mut_slice().as_mut_ptr().cast(), buf.len(), flags as libc::c_int) };
        if mr.is_null() {
            return Err(FabricError::Alloc { bytes: buf.len() as u64, source: io::Error::last_os_error() });
        }
        Ok(RdmaMr { mr, buf, access, _pd: self.0.clone() })
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
        let (ch, id) = new_id()?;
        let mut l = RdmaListener { id, ch, addr, pd: self.clone(), opts: opts.clone(), challenges: Default::default() };
        let mut sin = sockaddr(addr)?;
        let fail = |source| FabricError::Listen { addr, source };
        // SAFETY: `id` is live; `sin` is a valid IPv4 sockaddr for the call.
        if unsafe { sys::rdma_bind_addr(id, (&mut sin as *mut libc::sockaddr_in).cast()) } != 0 {
            return Err(fail(io::Error::last_os_error()));
        }
        // SAFETY: bound above.
        if unsafe { sys::rdma_listen(id, 64) } != 0 {
            return Err(fail(io::Error::last_os_error()));
        }
        // SAFETY: bound; the port is in its source address.
        let port = unsafe { sys::rdma_get_src_port(id) };
        l.addr = SocketAddr::new(addr.ip(), u16::from_be(port));
        Ok(l)
    }

    fn connect(&self, addr: SocketAddr, send_cq: &RdmaCq, recv_cq: &RdmaCq, opts: &QpOptions) -> Result<RdmaQp> {
        use sys::rdma_cm_event_type::{RDMA_CM_EVENT_ESTABLISHED as ESTABLISHED, RDMA_CM_EVENT_REJECTED as REJECTED};
        let deadline = Instant::now() + opts.connect_timeout;
        let peer = addr.to_string();
        let auth = |reason| FabricError::AuthFailed { peer: peer.clone(), reason };
        let unexpected = |e: &Event| FabricError::Connect {
            peer: peer.clone(),
            stage: "the handshake",
            source: io::Error::other(format!("rdma_cm event {} (status {})", e.kind, e.status)),
        };
        // 1. Hello: answered by a challenge (see handshake.rs).
        let nonce_c = eps_fabric::auth::nonce().map_err(FabricError::Engine)?;
        let hello = Msg::Hello { nonce_c, max_msg: opts.max_msg_bytes };
        let (first, e) = self.dial(addr, send_cq, recv_cq, opts, &hello, deadline)?;
        drop(first);
        let nonce_s = match (e.kind, Msg::decode(&e.private)) {
            (REJECTED, Some(Msg::Challenge { nonce_s })) => nonce_s,
            (REJECTED, Some(Msg::Denied)) => return Err(auth("the listener refused the connection")),
            (ESTABLISHED, _) => return Err(auth("the listener accepted without the handshake")),
            _ => return Err(unexpected(&e)),
        };
        // 2. The proof; the listener's comes back with its accept.
        let proof_c = handshake::proof_c(&opts.secret, &nonce_c, &nonce_s);
        let (mut qp, e) = self.dial(addr, send_cq, recv_cq, opts, &Msg::Proof { nonce_s, proof_c }, deadline)?;
        let want = handshake::proof_s(&opts.secret, &nonce_c, &nonce_s);
        match (e.kind, Msg::decode(&e.private)) {
            (ESTABLISHED, Some(Msg::Accepted { proof_s, max_msg })) if eps_fabric::auth::proofs_equal(&proof_s, &want) => {
                qp.peer_max_msg = max_msg;
                qp.attach();
                Ok(qp)
            }
            (ESTABLISHED, _) => Err(auth("the listener did not prove the job secret")),
            (REJECTED, Some(Msg::Denied)) => Err(auth("the listener refused the proof (a different job secret?)")),
            _ => Err(unexpected(&e)),
        }
    }
}
