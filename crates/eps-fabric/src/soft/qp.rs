//! Queue pairs of the soft provider: the shared QP state, the receive queue, and the
//! requester half that runs on the caller's thread.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::api::{Access, Completion, QpState, QueuePair, RecvWr, SendOp, SendWr, Sge, WcOpcode};
use crate::error::{FabricError, Result, WcStatus};
use crate::wire::{REQ_LEN, RESP_LEN, Request, Response, WireOp};

use super::cq::CqInner;
use super::sys::{self, Xfer};
use super::{MAX_SGE, MrInner, SoftMr};

/// One local scatter/gather entry, holding its region alive.
#[derive(Debug, Default, Clone)]
pub(crate) struct SgEnt {
    /// Keeps the region mapped while the request is outstanding (the soft
    /// provider reaches the bytes through `ptr`; shm names the region to its peer).
    pub(crate) mr: Option<Arc<MrInner>>,
    pub(crate) ptr: usize,
    pub(crate) len: u32,
}

/// A posted receive.
#[derive(Debug, Clone, Default)]
pub(crate) struct RecvWqe {
    pub(crate) wr_id: u64,
    pub(crate) sg: [SgEnt; MAX_SGE],
    pub(crate) nsg: usize,
}

impl RecvWqe {
    pub(crate) fn capacity(&self) -> u64 {
        self.sg[..self.nsg].iter().map(|s| s.len as u64).sum()
    }
}

/// State shared by the user's QP handle and the progress thread.
#[derive(Debug)]
pub(crate) struct QpShared {
    pub(crate) qp_num: u32,
    pub(crate) pd: u32,
    state: AtomicU8,
    pub(crate) recv_q: Mutex<VecDeque<RecvWqe>>,
    pub(crate) max_recv_wr: u32,
    pub(crate) recv_cq: Arc<CqInner>,
    /// Set by the progress thread while a request waits for a RECV.
    pub(crate) rnr_waiting: AtomicBool,
    pub(crate) rnr_timeout: Option<Duration>,
    /// Largest message this side accepts.
    pub(crate) max_msg_bytes: u32,
    pub(crate) req_fd: Arc<OwnedFd>,
    pub(crate) resp_fd: Arc<OwnedFd>,
    pub(crate) engine: Arc<super::engine::EngineShared>,
}

const RTS: u8 = 0;
const ERR: u8 = 1;

impl QpShared {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        qp_num: u32,
        pd: u32,
        max_recv_wr: u32,
        recv_cq: Arc<CqInner>,
        rnr_timeout: Option<Duration>,
        max_msg_bytes: u32,
        req_fd: OwnedFd,
        resp_fd: OwnedFd,
        engine: Arc<super::engine::EngineShared>,
    ) -> Self {
        Self {
            qp_num,
            pd,
            state: AtomicU8::new(RTS),
            recv_q: Mutex::new(VecDeque::with_capacity(max_recv_wr as usize)),
            max_recv_wr,
            recv_cq,
            rnr_waiting: AtomicBool::new(false),
            rnr_timeout,
            max_msg_bytes,
            req_fd: Arc::new(req_fd),
            resp_fd: Arc::new(resp_fd),
            engine,
        }
    }

    pub(crate) fn is_error(&self) -> bool {
        self.state.load(Ordering::Acquire) == ERR
    }

    /// Moves the QP to the error state and flushes posted receives. The requester
    /// channel is shut for writing only: responses already on their way are still read
    /// (so the request that failed reports its real status) until the peer closes it.
    /// `from_engine`: the progress thread calls, and closes the responder channel itself
    /// once its error response is out; otherwise that channel is shut here.
    pub(crate) fn set_error(&self, from_engine: bool) {
        if self.state.swap(ERR, Ordering::AcqRel) == ERR {
            return;
        }
        sys::shutdown(&self.req_fd, libc::SHUT_WR);
        if !from_engine {
            sys::shutdown(&self.resp_fd, libc::SHUT_RDWR);
        }
        self.flush_recvs();
    }

    pub(crate) fn flush_recvs(&self) {
        let mut q = self.recv_q.lock().unwrap_or_else(|p| p.into_inner());
        for w in q.drain(..) {
            self.recv_cq.push(self.recv_completion(w.wr_id, WcStatus::WrFlush, WcOpcode::Recv, 0, None));
        }
    }

    pub(crate) fn recv_completion(
        &self,
        wr_id: u64,
        status: WcStatus,
        opcode: WcOpcode,
        len: u32,
        imm: Option<u32>,
    ) -> Completion {
        Completion { wr_id, status, opcode, byte_len: len, imm, qp_num: self.qp_num }
    }
}

/// Validates SGEs against the QP's domain; fills `out`. Returns the total length.
pub(crate) fn load_sges(pd: u32, sg: &[Sge<'_, SoftMr>], need: Access, out: &mut [SgEnt; MAX_SGE]) -> Result<u64, WcStatus> {
    if sg.len() > MAX_SGE {
        return Err(WcStatus::LocalQpOperation);
    }
    let mut total = 0u64;
    for (s, o) in sg.iter().zip(out.iter_mut()) {
        let m = s.mr.inner();
        if m.pd != pd || !m.access.contains(need) {
            return Err(WcStatus::LocalProtection);
        }
        let ptr = m.range(m.base() + s.offset, s.len as u64).ok_or(WcStatus::LocalProtection)?;
        *o = SgEnt { mr: Some(m.clone()), ptr: ptr as usize, len: s.len };
        total += s.len as u64;
    }
    Ok(total)
}

/// What posting a RECV needs of a QP (the same on soft and shm).
pub(crate) struct RecvPost<'a> {
    pub(crate) queue: &'a Mutex<VecDeque<RecvWqe>>,
    pub(crate) depth: u32,
    pub(crate) pd: u32,
    pub(crate) max_sge: usize,
    pub(crate) cq: &'a CqInner,
    pub(crate) qp_num: u32,
}

impl RecvPost<'_> {
    /// Checks and queues `wr`: a full queue is backpressure; in the error state it
    /// completes flushed; a bad SGE completes with its status and moves the QP to
    /// the error state (`set_error`). Returns whether it was queued.
    pub(crate) fn post(&self, wr: &RecvWr<'_, SoftMr>, in_error: bool, set_error: impl FnOnce()) -> Result<bool> {
        if wr.sg.len() > self.max_sge {
            return Err(FabricError::InvalidArgument("more SGEs than the QP's max_sge"));
        }
        let mut w = RecvWqe { wr_id: wr.wr_id, nsg: wr.sg.len(), ..RecvWqe::default() };
        let loaded = load_sges(self.pd, wr.sg, Access::LOCAL_WRITE, &mut w.sg);
        let mut rq = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if rq.len() >= self.depth as usize {
            return Err(FabricError::QueueFull { queue: "receive", depth: self.depth });
        }
        let status = match loaded {
            _ if in_error => WcStatus::WrFlush,
            Err(st) => st,
            Ok(_) => {
                rq.push_back(w);
                return Ok(true);
            }
        };
        drop(rq);
        self.cq.push(Completion { wr_id: wr.wr_id, status, opcode: WcOpcode::Recv, byte_len: 0, imm: None, qp_num: self.qp_num });
        if status != WcStatus::WrFlush {
            set_error();
        }
        Ok(false)
    }
}

/// A send work request in the requester's ring.
#[derive(Debug, Default)]
struct Wqe {
    wr_id: u64,
    op: Option<WireOp>,
    opcode: Option<WcOpcode>,
    signaled: bool,
    hdr: [u8; REQ_LEN],
    seq: u32,
    sg: [SgEnt; MAX_SGE],
    nsg: usize,
    len: u32,
    /// Failed local validation: completes with this status when it reaches the head.
    local_err: Option<WcStatus>,
}

impl Wqe {
    fn wire_bytes(&self) -> usize {
        let payload = match self.op {
            Some(op) if op.carries_payload() => self.len as usize,
            _ => 0,
        };
        REQ_LEN + payload
    }
}

/// Most iovecs handed to one `sendmsg`/`recvmsg`.
const MAX_IOV: usize = 64;
/// Most response headers read in one `recvmsg`.
const RX_BATCH: usize = 64;

/// The requester half of a QP, driven from the caller's thread (post and poll).
///
/// Positions are monotonically increasing: `head` is the oldest outstanding request,
/// `sent` the next one to transmit (all before it are fully on the wire), `tail` the
/// next free slot. The ring index of position `p` is `p % depth`.
#[derive(Debug)]
pub(crate) struct Requester {
    qp: Arc<QpShared>,
    cq: Arc<CqInner>,
    ring: Vec<Wqe>,
    head: u64,
    sent: u64,
    tail: u64,
    /// Bytes of the request at `sent` already written to the socket.
    tx_off: usize,
    /// The socket buffer was full at the last attempt.
    tx_full: bool,
    /// Current SO_RCVLOWAT of the requester socket.
    rx_lowat: usize,
    seq: u32,
    max_sge: usize,
    max_msg_bytes: u32,
    rx: [u8; RESP_LEN * RX_BATCH],
    rx_have: usize,
    /// Data bytes of the head READ received so far, once its header is in.
    read_got: Option<u32>,
    /// The retry timer: how long requests may go without progress.
    ack_timeout: Option<std::time::Duration>,
    /// When requests last made progress (or the first was posted).
    last_progress: std::time::Instant,
}

impl Requester {
    pub(crate) fn new(
        qp: Arc<QpShared>,
        cq: Arc<CqInner>,
        depth: u32,
        max_sge: u32,
        max_msg_bytes: u32,
        ack_timeout: Option<std::time::Duration>,
    ) -> Self {
        Self {
            qp,
            cq,
            ring: (0..depth.max(1)).map(|_| Wqe::default()).collect(),
            head: 0,
            sent: 0,
            tail: 0,
            tx_off: 0,
            tx_full: false,
            rx_lowat: 1,
            seq: 0,
            max_sge: max_sge as usize,
            max_msg_bytes,
            rx: [0; RESP_LEN * RX_BATCH],
            rx_have: 0,
            read_got: None,
            ack_timeout,
            last_progress: std::time::Instant::now(),
        }
    }

    fn at(&self, p: u64) -> &Wqe {
        &self.ring[(p % self.ring.len() as u64) as usize]
    }

    fn at_mut(&mut self, p: u64) -> &mut Wqe {
        let n = self.ring.len() as u64;
        &mut self.ring[(p % n) as usize]
    }

    fn post(&mut self, wr: &SendWr<'_, SoftMr>) -> Result<()> {
        if (self.tail - self.head) as usize == self.ring.len() {
            return Err(FabricError::QueueFull { queue: "send", depth: self.ring.len() as u32 });
        }
        if self.head == self.tail {
            // The retry timer starts with the first outstanding request.
            self.last_progress = std::time::Instant::now();
        }
        self.seq = self.seq.wrapping_add(1);
        let (seq, pd, max_sge, max_msg) = (self.seq, self.qp.pd, self.max_sge, self.max_msg_bytes);
        let (op, opcode, remote, imm, need) = match wr.op {
            SendOp::Send => (WireOp::Send, WcOpcode::Send, None, 0, Access::NONE),
            SendOp::Write(r) => (WireOp::Write, WcOpcode::Write, Some(r), 0, Access::NONE),
            SendOp::WriteImm(r, imm) => (WireOp::WriteImm, WcOpcode::Write, Some(r), imm, Access::NONE),
            SendOp::Read(r) => (WireOp::Read, WcOpcode::Read, Some(r), 0, Access::LOCAL_WRITE),
        };
        let tail = self.tail;
        let w = self.at_mut(tail);
        *w = Wqe { wr_id: wr.wr_id, op: Some(op), opcode: Some(opcode), signaled: wr.signaled, seq, ..Wqe::default() };
        let loaded = if wr.sg.len() > max_sge { Err(WcStatus::LocalQpOperation) } else { load_sges(pd, wr.sg, need, &mut w.sg) };
        match loaded {
            Ok(total) if total > max_msg as u64 => w.local_err = Some(WcStatus::LocalLength),
            Ok(total) => {
                w.nsg = wr.sg.len();
                w.len = total as u32;
                let r = remote.unwrap_or(crate::api::RemoteAddr { addr: 0, rkey: 0 });
                w.hdr = Request { op, seq, len: w.len, rkey: r.rkey, addr: r.addr, imm }.encode();
            }
            Err(st) => {
                w.sg = Default::default();
                w.local_err = Some(st);
            }
        }
        self.tail += 1;
        Ok(())
    }

    /// What a sleeping poller should wait for on this QP's requester socket:
    /// responses while requests are outstanding, and room to send what is queued.
    pub(crate) fn wait_interest(&self) -> Option<(std::os::fd::RawFd, i16)> {
        if self.head == self.tail {
            return None;
        }
        let out = if self.sent < self.tail && !self.qp.is_error() { libc::POLLOUT } else { 0 };
        Some((self.qp.req_fd.as_raw_fd(), libc::POLLIN | out))
    }

    /// Transmits, reaps responses, and flushes everything if the QP is in error.
    pub(crate) fn progress(&mut self) {
        if self.head == self.tail {
            return;
        }
        let before = (self.head, self.sent, self.tx_off, self.rx_have, self.read_got);
        if !self.qp.is_error() {
            self.transmit();
        }
        // In the error state responses are still read until the peer closes the
        // channel; `receive` flushes what remains when it sees that.
        self.receive();
        if (self.head, self.sent, self.tx_off, self.rx_have, self.read_got) != before || self.head == self.tail {
            self.last_progress = std::time::Instant::now();
        } else if let Some(t) = self.ack_timeout
            && self.last_progress.elapsed() > t
        {
            // The peer stopped without closing: the retry timer ran out.
            self.fail_transport(WcStatus::RetryExceeded);
        }
    }

    fn transmit(&mut self) {
        // After the socket filled up, wait until the kernel reports it writable (a
        // third of the buffer free) instead of trickling tiny segments into it.
        if self.tx_full {
            if !sys::writable(self.qp.req_fd.as_raw_fd()) {
                return;
            }
            self.tx_full = false;
        }
        while self.sent < self.tail {
            let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_IOV];
            let mut n_iov = 0;
            let mut skip = self.tx_off;
            let mut p = self.sent;
            'build: while p < self.tail {
                let w = self.at(p);
                if w.local_err.is_some() {
                    break;
                }
                let payload = w.op.is_some_and(|o| o.carries_payload());
                let need = 1 + if payload { w.nsg } else { 0 };
                if n_iov + need > MAX_IOV {
                    break;
                }
                let segs = std::iter::once((w.hdr.as_ptr() as usize, REQ_LEN))
                    .chain(w.sg[..if payload { w.nsg } else { 0 }].iter().map(|s| (s.ptr, s.len as usize)));
                for (base, len) in segs {
                    if skip >= len {
                        skip -= len;
                        continue;
                    }
                    iov[n_iov] = libc::iovec { iov_base: (base + skip) as *mut _, iov_len: len - skip };
                    skip = 0;
                    n_iov += 1;
                    if n_iov == MAX_IOV {
                        break 'build;
                    }
                }
                p += 1;
            }
            if n_iov == 0 {
                return;
            }
            let fd = self.qp.req_fd.as_raw_fd();
            // SAFETY: every iovec names a WQE header in our ring or a range of a region
            // checked by load_sges and kept alive by the WQE's Arc, for the whole call.
            match unsafe { sys::send_iov(fd, &iov[..n_iov]) } {
                Ok(Xfer::Done(mut n)) => {
                    let asked: usize = iov[..n_iov].iter().map(|v| v.iov_len).sum();
                    let partial = n < asked;
                    while n > 0 {
                        let left = self.at(self.sent).wire_bytes() - self.tx_off;
                        if n >= left {
                            n -= left;
                            self.sent += 1;
                            self.tx_off = 0;
                        } else {
                            self.tx_off += n;
                            n = 0;
                        }
                    }
                    if partial {
                        self.tx_full = true;
                        return;
                    }
                }
                Ok(Xfer::WouldBlock) | Ok(Xfer::Eof) => {
                    self.tx_full = true;
                    return;
                }
                Err(_) => return self.fail_transport(WcStatus::RetryExceeded),
            }
        }
    }

    fn receive(&mut self) {
        loop {
            if self.head == self.tail {
                return;
            }
            if self.head == self.sent && self.tx_off == 0 {
                if let Some(st) = self.at(self.head).local_err {
                    self.complete_head(st);
                    self.qp.set_error(false);
                    self.flush_all();
                } else if self.qp.is_error() {
                    // Nothing awaits a response: flush what was posted after the error.
                    self.flush_all();
                }
                return;
            }
            let fd = self.qp.req_fd.as_raw_fd();
            if let Some(got) = self.read_got {
                // Large READ data: poll until a good chunk is queued rather than
                // copying each segment as it trickles in.
                let left = (self.at(self.head).len - got) as usize;
                if !self.ready_for(fd, if left >= sys::LOWAT_MIN { left.min(sys::LOWAT_MAX) } else { 1 }) {
                    return;
                }
                let w = self.at(self.head);
                let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_SGE];
                let (mut n_iov, mut skip) = (0, got as usize);
                for s in &w.sg[..w.nsg] {
                    if skip >= s.len as usize {
                        skip -= s.len as usize;
                        continue;
                    }
                    iov[n_iov] = libc::iovec { iov_base: (s.ptr + skip) as *mut _, iov_len: s.len as usize - skip };
                    skip = 0;
                    n_iov += 1;
                }
                // SAFETY: the iovecs name the unfilled part of the READ's local SGEs,
                // validated with LOCAL_WRITE at post and kept alive by the WQE.
                match unsafe { sys::recv_iov(fd, &iov[..n_iov]) } {
                    Ok(Xfer::Done(n)) => {
                        let got = got + n as u32;
                        if got == w.len {
                            self.read_got = None;
                            self.complete_head(WcStatus::Success);
                        } else {
                            self.read_got = Some(got);
                        }
                        continue;
                    }
                    Ok(Xfer::WouldBlock) => return,
                    Ok(Xfer::Eof) | Err(_) => return self.fail_transport(WcStatus::RetryExceeded),
                }
            }
            // Read response headers, at most up to the first READ (its data follows it).
            let mut k = 0u64;
            let mut p = self.head;
            while (p < self.sent || (p == self.sent && self.tx_off > 0)) && k < RX_BATCH as u64 {
                k += 1;
                if self.at(p).op == Some(WireOp::Read) {
                    break;
                }
                p += 1;
            }
            let want = k as usize * RESP_LEN;
            if self.rx_lowat != 1 {
                sys::set_rcvlowat(fd, 1);
                self.rx_lowat = 1;
            }
            if self.rx_have < want {
                let iov = [libc::iovec { iov_base: self.rx[self.rx_have..].as_mut_ptr().cast(), iov_len: want - self.rx_have }];
                // SAFETY: the iovec names the unfilled tail of our own buffer.
                match unsafe { sys::recv_iov(fd, &iov) } {
                    Ok(Xfer::Done(n)) => self.rx_have += n,
                    Ok(Xfer::WouldBlock) => {}
                    Ok(Xfer::Eof) | Err(_) => return self.fail_transport(WcStatus::RetryExceeded),
                }
            }
            if self.rx_have < RESP_LEN {
                return;
            }
            let mut used = 0;
            while self.rx_have - used >= RESP_LEN && self.read_got.is_none() {
                let resp = Response::decode(&self.rx[used..used + RESP_LEN]);
                used += RESP_LEN;
                let w = self.at(self.head);
                let resp = match resp {
                    Ok(r) if r.seq == w.seq && Some(r.op) == w.op => r,
                    _ => {
                        self.rx_have = 0;
                        return self.fail_transport(WcStatus::RemoteOperation);
                    }
                };
                if !resp.status.is_ok() {
                    // The responder executes nothing after a failed request.
                    self.complete_head(resp.status);
                    self.qp.set_error(false);
                    self.rx_have = 0;
                    return self.flush_all();
                } else if resp.op == WireOp::Read && w.len > 0 {
                    if resp.len != w.len {
                        self.rx_have = 0;
                        return self.fail_transport(WcStatus::RemoteOperation);
                    }
                    self.read_got = Some(0);
                } else {
                    self.complete_head(WcStatus::Success);
                }
            }
            self.rx.copy_within(used..self.rx_have, 0);
            self.rx_have -= used;
        }
    }

    /// Sets the receive low-water mark to `lowat` and, when above 1, reports
    /// whether that much data is queued.
    fn ready_for(&mut self, fd: std::os::fd::RawFd, lowat: usize) -> bool {
        if self.rx_lowat != lowat {
            sys::set_rcvlowat(fd, lowat);
            self.rx_lowat = lowat;
        }
        lowat == 1 || sys::readable(fd)
    }

    fn complete_head(&mut self, status: WcStatus) {
        let (head, qp_num) = (self.head, self.qp.qp_num);
        let n = self.ring.len() as u64;
        let w = &mut self.ring[(head % n) as usize];
        if w.signaled || !status.is_ok() {
            let c = Completion {
                wr_id: w.wr_id,
                status,
                opcode: w.opcode.unwrap_or(WcOpcode::Send),
                byte_len: if status.is_ok() { w.len } else { 0 },
                imm: None,
                qp_num,
            };
            self.cq.push(c);
        }
        w.sg = Default::default();
        self.head += 1;
        if self.sent < self.head {
            self.sent = self.head;
            self.tx_off = 0;
        }
    }

    fn fail_transport(&mut self, status: WcStatus) {
        if self.head < self.tail && !self.qp.is_error() {
            self.complete_head(status);
        }
        self.qp.set_error(false);
        self.flush_all();
    }

    fn flush_all(&mut self) {
        while self.head < self.tail {
            self.complete_head(WcStatus::WrFlush);
        }
        self.sent = self.tail;
        self.tx_off = 0;
        self.rx_have = 0;
        self.read_got = None;
    }
}

/// A reliable connected queue pair of the soft provider.
#[derive(Debug)]
pub struct SoftQp {
    pub(crate) shared: Arc<QpShared>,
    pub(crate) req: Arc<Mutex<Requester>>,
    pub(crate) send_cq: Arc<CqInner>,
    pub(crate) peer: SocketAddr,
    pub(crate) max_sge: usize,
}

impl QueuePair for SoftQp {
    type Mr = SoftMr;

    fn post_send(&self, wr: &SendWr<'_, SoftMr>) -> Result<()> {
        let mut r = self.req.lock().unwrap_or_else(|p| p.into_inner());
        r.post(wr)?;
        if self.shared.is_error() {
            r.progress();
        } else {
            r.transmit();
        }
        Ok(())
    }

    fn post_recv(&self, wr: &RecvWr<'_, SoftMr>) -> Result<()> {
        let q = &self.shared;
        let recv = RecvPost {
            queue: &q.recv_q,
            depth: q.max_recv_wr,
            pd: q.pd,
            max_sge: self.max_sge,
            cq: &q.recv_cq,
            qp_num: q.qp_num,
        };
        if recv.post(wr, q.is_error(), || q.set_error(false))? && q.rnr_waiting.load(Ordering::Acquire) {
            q.engine.wake();
        }
        Ok(())
    }

    fn qp_num(&self) -> u32 {
        self.shared.qp_num
    }

    fn state(&self) -> QpState {
        if self.shared.is_error() { QpState::Error } else { QpState::ReadyToSend }
    }

    fn peer_addr(&self) -> SocketAddr {
        self.peer
    }
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        // Destroying a QP produces no completions: detach, then close both channels so
        // the progress thread drops its side and the peer sees the connection end.
        self.send_cq.detach(&self.req);
        self.shared.state.store(ERR, Ordering::Release);
        sys::shutdown(&self.shared.req_fd, libc::SHUT_RDWR);
        sys::shutdown(&self.shared.resp_fd, libc::SHUT_RDWR);
        self.shared.recv_q.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}
