//! The progress thread: the responder side of every soft QP, driven by io_uring.
//!
//! For each responder channel it reads a request header into a small per-connection
//! buffer, checks rkey, bounds and access against the registration table, then has
//! the kernel receive the payload straight into the target region (or the posted
//! RECV's SGEs), or send READ data straight from the region. Responses are queued in
//! a bounded per-connection ring; when it is full the connection stops reading
//! requests (backpressure). Every buffer an io_uring operation refers to is owned by
//! a boxed connection (or kept alive by an `Arc` it holds) until that operation's
//! completion has been reaped; a connection is freed only with nothing in flight.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use io_uring::{IoUring, opcode, squeue, types};

use crate::api::{Access, WcOpcode};
use crate::error::{FabricError, Result, WcStatus};
use crate::wire::{REQ_LEN, RESP_LEN, Request, Response, WireOp};

mod tx;

use super::qp::{QpShared, RecvWqe};
use super::{MAX_SGE, MrInner, MrTable, sys};

/// Responses queued per connection before it stops reading requests.
const RESP_RING: usize = 64;
/// Responses gathered into one `sendmsg`.
const TX_BATCH: usize = 16;
const WAKE: u64 = u64::MAX;
use super::sys::{LOWAT_MAX, LOWAT_MIN};
const KIND_RX: u64 = 1;
const KIND_TX: u64 = 2;

/// What the user side shares with the progress thread.
#[derive(Debug)]
pub(crate) struct EngineShared {
    new_conns: Mutex<Vec<Arc<QpShared>>>,
    wake_fd: OwnedFd,
    stop: AtomicBool,
}

impl EngineShared {
    /// Wakes the progress thread (new connection, RECV posted for a waiting request, stop).
    pub(crate) fn wake(&self) {
        sys::eventfd_signal(&self.wake_fd);
    }

    /// Hands a new QP's responder channel to the progress thread.
    pub(crate) fn adopt(&self, qp: Arc<QpShared>) {
        self.new_conns.lock().unwrap_or_else(|p| p.into_inner()).push(qp);
        self.wake();
    }
}

/// Owner of the progress thread; stopping it is dropping it.
#[derive(Debug)]
pub(crate) struct EngineHandle {
    pub(crate) shared: Arc<EngineShared>,
    thread: Option<JoinHandle<()>>,
}

impl EngineHandle {
    pub(crate) fn start(mrs: Arc<MrTable>) -> Result<Self> {
        // COOP_TASKRUN + TASKRUN_FLAG: completions of socket operations are not forced on
        // the thread by an inter-processor interrupt; the kernel raises a flag in the
        // shared ring instead, which the spinning thread sees and acts on.
        let ring = IoUring::builder()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .build(512)
            .or_else(|_| IoUring::new(512))
            .map_err(FabricError::Engine)?;
        let shared = Arc::new(EngineShared {
            new_conns: Mutex::new(Vec::new()),
            wake_fd: sys::eventfd().map_err(FabricError::Engine)?,
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("eps-fabric-progress".into())
            .spawn(move || Engine::new(ring, s, mrs).run())
            .map_err(FabricError::Engine)?;
        Ok(Self { shared, thread: Some(thread) })
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    /// Reading a request header.
    Header,
    /// Receiving a payload into its destination.
    Payload,
    /// A SEND/WRITE_IMM waits for a RECV to be posted (RNR).
    WaitRecv,
    /// The response ring is full; reading resumes when it drains.
    Stalled,
    /// An error response is queued; after it is sent the connection drains.
    Failing,
    /// Reading and discarding until the peer closes.
    Drain,
    /// Finished; freed once nothing is in flight.
    Dead,
}

#[derive(Debug, Default)]
struct Landing {
    req: Option<Request>,
    got: u32,
    mr: Option<Arc<MrInner>>,
    ptr: usize,
    recv: Option<RecvWqe>,
}

#[derive(Debug)]
struct RespOut {
    hdr: [u8; RESP_LEN],
    data: Option<(Arc<MrInner>, usize, u32)>,
}

impl RespOut {
    fn bytes(&self) -> usize {
        RESP_LEN + self.data.as_ref().map_or(0, |d| d.2 as usize)
    }
}

struct Conn {
    qp: Arc<QpShared>,
    fd: RawFd,
    st: St,
    hdr: [u8; REQ_LEN],
    hdr_got: usize,
    land: Landing,
    rx_iov: [libc::iovec; MAX_SGE],
    rx_msg: libc::msghdr,
    resp: VecDeque<RespOut>,
    tx_iov: [libc::iovec; 2 * TX_BATCH],
    tx_msg: libc::msghdr,
    tx_off: usize,
    rx_inflight: bool,
    tx_inflight: bool,
    rnr_deadline: Option<Instant>,
    shut: bool,
    /// Current SO_RCVLOWAT of the socket.
    lowat: usize,
}

fn empty_iov() -> libc::iovec {
    libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }
}

fn empty_msghdr() -> libc::msghdr {
    // SAFETY: msghdr is plain old data; all-zero is a valid empty header.
    unsafe { std::mem::zeroed() }
}

struct Engine {
    ring: IoUring,
    shared: Arc<EngineShared>,
    mrs: Arc<MrTable>,
    conns: Vec<Option<Box<Conn>>>,
    free: Vec<usize>,
    wake_buf: Box<u64>,
    wake_armed: bool,
    scratch: Box<[u8]>,
    rnr: Vec<usize>,
    cqes: Vec<(u64, i32)>,
    spin: crate::spin::Spin,
}

/// How long a progress thread spins after activity before it sleeps: at
/// least `EPS_FABRIC_SPIN_US` (default 50 microseconds; 0 disables spinning),
/// and through the recent gaps between bursts when they are under 5 ms
/// ([`crate::spin::Spin`]). It spins yielding the CPU (`sched_yield`): a
/// woken thread costs little while the core is busy, and much (tens of
/// microseconds on virtual machines) once the core has gone idle.
pub(crate) fn spin_budget() -> crate::spin::Spin {
    let us = std::env::var("EPS_FABRIC_SPIN_US").ok().and_then(|v| v.parse().ok()).unwrap_or(50u64);
    crate::spin::Spin::new(std::time::Duration::from_micros(us), std::time::Duration::from_millis(5))
}

impl Engine {
    fn new(ring: IoUring, shared: Arc<EngineShared>, mrs: Arc<MrTable>) -> Self {
        Self {
            ring,
            shared,
            mrs,
            conns: Vec::new(),
            free: Vec::new(),
            wake_buf: Box::new(0),
            wake_armed: false,
            scratch: vec![0u8; 64 * 1024].into_boxed_slice(),
            rnr: Vec::new(),
            cqes: Vec::with_capacity(1024),
            spin: spin_budget(),
        }
    }

    fn push(&mut self, e: squeue::Entry) {
        loop {
            // SAFETY: every entry built by this engine points at memory owned by a boxed
            // Conn, the engine's own buffers, or a region whose Arc the Conn holds; all
            // of it outlives the operation (a Conn is freed only with nothing in flight).
            if unsafe { self.ring.submission().push(&e) }.is_ok() {
                return;
            }
            let _ = self.ring.submit();
        }
    }

    fn arm_wake(&mut self) {
        let e = opcode::Read::new(types::Fd(self.shared.wake_fd.as_raw_fd()), (&mut *self.wake_buf as *mut u64).cast(), 8)
            .build()
            .user_data(WAKE);
        self.push(e);
        self.wake_armed = true;
    }

    fn run(mut self) {
        self.arm_wake();
        loop {
            let stopping = self.shared.stop.load(Ordering::Acquire);
            if stopping {
                for i in 0..self.conns.len() {
                    if let Some(c) = self.conns[i].as_mut() {
                        c.st = St::Dead;
                        self.maybe_close(i);
                    }
                }
            } else {
                self.adopt_new();
            }
            if !self.rnr.is_empty() {
                self.check_rnr();
            }
            if stopping && !self.wake_armed && self.conns.iter().all(Option::is_none) {
                return;
            }
            if let Err(e) = self.wait_for_work()
                && e.raw_os_error() != Some(libc::ETIME)
                && e.raw_os_error() != Some(libc::EINTR)
                && e.raw_os_error() != Some(libc::EBUSY)
            {
                // The ring itself failed: nothing can make progress. Fail every QP.
                for c in self.conns.iter_mut().flatten() {
                    c.qp.set_error(false);
                }
                return;
            }
            let mut cqes = std::mem::take(&mut self.cqes);
            cqes.clear();
            cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            if !cqes.is_empty() {
                self.spin.worked();
            }
            for &(ud, res) in &cqes {
                if ud == WAKE {
                    self.wake_armed = false;
                    if !self.shared.stop.load(Ordering::Acquire) {
                        self.arm_wake();
                    }
                    continue;
                }
                let slot = (ud >> 8) as usize;
                match ud & 0xff {
                    KIND_RX => self.on_rx(slot, res),
                    KIND_TX => self.on_tx(slot, res),
                    _ => {}
                }
            }
            self.cqes = cqes;
        }
    }

    /// Submits queued work, then waits for a completion: first by spinning on the
    /// completion ring for `spin` after the last activity (a blocked thread's wake-up
    /// costs more than the wire on loopback), then by blocking in the kernel.
    fn wait_for_work(&mut self) -> std::io::Result<()> {
        self.ring.submit()?;
        let budget = self.spin.budget();
        let spin_until = self.spin.last() + budget;
        while !budget.is_zero() && self.ring.completion().is_empty() {
            if self.ring.submission().taskrun() {
                // Work for us is pending in the kernel: enter to run it.
                self.ring.submit()?;
                continue;
            }
            if Instant::now() >= spin_until {
                break;
            }
            // Spinning, it gives way to any thread that can run: on a machine
            // with few cores the thread it waits for may be the one it would
            // keep off the CPU (the caller's, or a peer's progress thread).
            std::thread::yield_now();
        }
        if !self.ring.completion().is_empty() {
            return Ok(());
        }
        if self.rnr.is_empty() {
            self.ring.submit_and_wait(1).map(drop)
        } else {
            let ts = types::Timespec::new().nsec(2_000_000);
            let args = types::SubmitArgs::new().timespec(&ts);
            self.ring.submitter().submit_with_args(1, &args).map(drop)
        }
    }

    fn adopt_new(&mut self) {
        let new: Vec<Arc<QpShared>> = std::mem::take(&mut *self.shared.new_conns.lock().unwrap_or_else(|p| p.into_inner()));
        for qp in new {
            let fd = qp.resp_fd.as_raw_fd();
            let conn = Box::new(Conn {
                qp,
                fd,
                st: St::Header,
                hdr: [0; REQ_LEN],
                hdr_got: 0,
                land: Landing::default(),
                rx_iov: [empty_iov(); MAX_SGE],
                rx_msg: empty_msghdr(),
                resp: VecDeque::with_capacity(RESP_RING),
                tx_iov: [empty_iov(); 2 * TX_BATCH],
                tx_msg: empty_msghdr(),
                tx_off: 0,
                rx_inflight: false,
                tx_inflight: false,
                rnr_deadline: None,
                shut: false,
                lowat: 1,
            });
            let slot = match self.free.pop() {
                Some(s) => {
                    self.conns[s] = Some(conn);
                    s
                }
                None => {
                    self.conns.push(Some(conn));
                    self.conns.len() - 1
                }
            };
            self.post_header(slot);
        }
    }

    fn conn(&mut self, slot: usize) -> &mut Conn {
        self.conns[slot].as_mut().expect("completion for a live connection")
    }

    /// Frees a dead connection once nothing is in flight on it.
    fn maybe_close(&mut self, slot: usize) {
        let Some(c) = self.conns[slot].as_mut() else { return };
        if c.st != St::Dead {
            return;
        }
        if !c.shut {
            c.shut = true;
            sys::shutdown(&c.qp.resp_fd, libc::SHUT_RDWR);
        }
        if c.rx_inflight || c.tx_inflight {
            return;
        }
        if let Some(w) = c.land.recv.take() {
            c.qp.recv_cq.push(c.qp.recv_completion(w.wr_id, WcStatus::WrFlush, WcOpcode::Recv, 0, None));
        }
        c.qp.rnr_waiting.store(false, Ordering::Release);
        self.conns[slot] = None;
        self.free.push(slot);
        self.rnr.retain(|&s| s != slot);
    }

    fn kill(&mut self, slot: usize) {
        let c = self.conn(slot);
        c.qp.set_error(true);
        c.st = St::Dead;
        self.maybe_close(slot);
    }

    fn post_header(&mut self, slot: usize) {
        let c = self.conn(slot);
        if c.lowat != 1 {
            sys::set_rcvlowat(c.fd, 1);
            c.lowat = 1;
        }
        c.st = St::Header;
        let ptr = c.hdr[c.hdr_got..].as_mut_ptr();
        let e = opcode::Recv::new(types::Fd(c.fd), ptr, (REQ_LEN - c.hdr_got) as u32)
            .build()
            .user_data(((slot as u64) << 8) | KIND_RX);
        c.rx_inflight = true;
        self.push(e);
    }

    fn post_payload(&mut self, slot: usize) {
        let c = self.conn(slot);
        c.st = St::Payload;
        let req = c.land.req.expect("payload without a request");
        let left = (req.len - c.land.got) as usize;
        // Large payload: ask the kernel to wake us only once a good chunk has arrived
        // (each wake-up costs more than copying tens of kilobytes). Never above what
        // is still owed, so the last chunk wakes us when it is complete; such receives
        // go without MSG_WAITALL so that each completion can lower the mark.
        let lowat = if left >= LOWAT_MIN { left.min(LOWAT_MAX) } else { 1 };
        if lowat != c.lowat {
            sys::set_rcvlowat(c.fd, lowat);
            c.lowat = lowat;
        }
        let waitall = if lowat == 1 { libc::MSG_WAITALL } else { 0 };
        let e = if let Some(mr_ptr) = c.land.mr.as_ref().map(|_| c.land.ptr) {
            opcode::Recv::new(types::Fd(c.fd), (mr_ptr + c.land.got as usize) as *mut u8, left as u32).flags(waitall).build()
        } else {
            let w = c.land.recv.as_ref().expect("SEND lands in a RECV");
            let (mut n, mut skip, mut want) = (0, c.land.got as usize, left);
            for s in &w.sg[..w.nsg] {
                if want == 0 {
                    break;
                }
                if skip >= s.len as usize {
                    skip -= s.len as usize;
                    continue;
                }
                let take = (s.len as usize - skip).min(want);
                c.rx_iov[n] = libc::iovec { iov_base: (s.ptr + skip) as *mut _, iov_len: take };
                want -= take;
                skip = 0;
                n += 1;
            }
            c.rx_msg = empty_msghdr();
            c.rx_msg.msg_iov = c.rx_iov.as_mut_ptr();
            c.rx_msg.msg_iovlen = n as _;
            opcode::RecvMsg::new(types::Fd(c.fd), &mut c.rx_msg).flags(waitall as u32).build()
        };
        c.rx_inflight = true;
        self.push(e.user_data(((slot as u64) << 8) | KIND_RX));
    }

    fn post_drain(&mut self, slot: usize) {
        let (ptr, len) = (self.scratch.as_mut_ptr(), self.scratch.len() as u32);
        let c = self.conn(slot);
        c.st = St::Drain;
        c.rx_inflight = true;
        let e = opcode::Recv::new(types::Fd(c.fd), ptr, len).build().user_data(((slot as u64) << 8) | KIND_RX);
        self.push(e);
    }

    fn on_rx(&mut self, slot: usize, res: i32) {
        let c = self.conn(slot);
        c.rx_inflight = false;
        if c.st == St::Dead {
            return self.maybe_close(slot);
        }
        if res == -libc::EINTR || res == -libc::EAGAIN {
            return match c.st {
                St::Header => self.post_header(slot),
                St::Payload => self.post_payload(slot),
                _ => self.post_drain(slot),
            };
        }
        if res <= 0 {
            // Peer gone (or the QP was destroyed locally): a SEND being landed is
            // flushed by maybe_close, as are the posted RECVs by set_error.
            return self.kill(slot);
        }
        let n = res as usize;
        match c.st {
            St::Header => {
                c.hdr_got += n;
                if c.hdr_got < REQ_LEN {
                    return self.post_header(slot);
                }
                c.hdr_got = 0;
                self.on_header(slot);
            }
            St::Payload => {
                c.land.got += n as u32;
                if c.land.got < c.land.req.map_or(0, |r| r.len) {
                    return self.post_payload(slot);
                }
                self.finish(slot);
            }
            St::Drain => self.post_drain(slot),
            _ => {}
        }
    }

    /// Validates a freshly read header and starts executing it.
    fn on_header(&mut self, slot: usize) {
        let c = self.conn(slot);
        let req = match Request::decode(&c.hdr) {
            Ok(r) => r,
            // Garbage: the peer is broken or hostile. Close without answering.
            Err(_) => return self.kill(slot),
        };
        if c.qp.is_error() {
            return self.kill(slot);
        }
        c.land = Landing { req: Some(req), ..Landing::default() };
        if req.len > c.qp.max_msg_bytes {
            return self.fail(slot, WcStatus::RemoteInvalidRequest);
        }
        match req.op {
            WireOp::Write | WireOp::WriteImm | WireOp::Read => {
                let need = if req.op == WireOp::Read { Access::REMOTE_READ } else { Access::REMOTE_WRITE };
                let pd = c.qp.pd;
                let checked = self
                    .mrs
                    .lookup(req.rkey)
                    .filter(|m| m.pd == pd && m.access.contains(need))
                    .and_then(|m| m.range(req.addr, req.len as u64).map(|p| (m, p as usize)));
                let Some((mr, ptr)) = checked else {
                    return self.fail(slot, WcStatus::RemoteAccess);
                };
                if req.op == WireOp::Read {
                    let resp = Response { op: req.op, status: WcStatus::Success, seq: req.seq, len: req.len };
                    let data = (req.len > 0).then_some((mr, ptr, req.len));
                    self.conn(slot).land = Landing::default();
                    return self.respond(slot, RespOut { hdr: resp.encode(), data });
                }
                let c = self.conn(slot);
                c.land.mr = Some(mr);
                c.land.ptr = ptr;
                if req.op == WireOp::WriteImm {
                    return self.need_recv(slot);
                }
                self.start_payload(slot)
            }
            WireOp::Send => self.need_recv(slot),
        }
    }

    /// Takes a posted RECV for the current request, or waits for one (RNR).
    fn need_recv(&mut self, slot: usize) {
        let c = self.conn(slot);
        let mut w = c.qp.recv_q.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
        if w.is_none() {
            // Announce the wait, then look again so a RECV posted meanwhile is not missed.
            c.qp.rnr_waiting.store(true, Ordering::Release);
            w = c.qp.recv_q.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
        }
        let Some(w) = w else {
            if c.st != St::WaitRecv {
                c.st = St::WaitRecv;
                c.rnr_deadline = c.qp.rnr_timeout.map(|t| Instant::now() + t);
                self.rnr.push(slot);
            }
            return;
        };
        c.qp.rnr_waiting.store(false, Ordering::Release);
        c.st = St::Payload;
        self.rnr.retain(|&s| s != slot);
        let c = self.conn(slot);
        let req = c.land.req.expect("request");
        if req.op == WireOp::Send && w.capacity() < req.len as u64 {
            // The message does not fit: the RECV fails locally, the requester is told.
            c.qp.recv_cq.push(c.qp.recv_completion(w.wr_id, WcStatus::LocalLength, WcOpcode::Recv, 0, None));
            return self.fail(slot, WcStatus::RemoteInvalidRequest);
        }
        c.land.recv = Some(w);
        self.start_payload(slot);
    }

    fn check_rnr(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.rnr.len() {
            let slot = self.rnr[i];
            i += 1;
            let Some(c) = self.conns[slot].as_mut() else { continue };
            if c.st != St::WaitRecv {
                continue;
            }
            if c.qp.is_error() {
                self.kill(slot);
            } else if !c.qp.recv_q.lock().unwrap_or_else(|p| p.into_inner()).is_empty() {
                self.need_recv(slot);
            } else if c.rnr_deadline.is_some_and(|d| now >= d) {
                c.qp.rnr_waiting.store(false, Ordering::Release);
                self.rnr.retain(|&s| s != slot);
                self.fail(slot, WcStatus::RnrRetryExceeded);
            }
        }
    }

    fn start_payload(&mut self, slot: usize) {
        let c = self.conn(slot);
        if c.land.req.is_some_and(|r| r.len > 0) { self.post_payload(slot) } else { self.finish(slot) }
    }

    /// The payload has landed: report to the RECV (if any) and acknowledge.
    fn finish(&mut self, slot: usize) {
        let c = self.conn(slot);
        let land = std::mem::take(&mut c.land);
        let req = land.req.expect("finished request");
        if let Some(w) = land.recv {
            let (opcode, imm) =
                if req.op == WireOp::WriteImm { (WcOpcode::RecvWithImm, Some(req.imm)) } else { (WcOpcode::Recv, None) };
            c.qp.recv_cq.push(c.qp.recv_completion(w.wr_id, WcStatus::Success, opcode, req.len, imm));
        }
        let resp = Response { op: req.op, status: WcStatus::Success, seq: req.seq, len: 0 };
        self.respond(slot, RespOut { hdr: resp.encode(), data: None });
    }
}
