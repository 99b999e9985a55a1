//! Queue pairs of the shm provider: the state shared with the progress thread,
//! and the requester half that runs on the caller's thread (posting writes a
//! slot and publishes it; polling the CQ reaps responses).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering, fence};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::api::{Access, Completion, QpState, QueuePair, RecvWr, SendOp, SendWr, WcOpcode};
use crate::error::{FabricError, Result, WcStatus};
use crate::soft::cq::{CqInner, Drive, WaitOn};
use crate::soft::qp::{RecvPost, RecvWqe, SgEnt, load_sges};
use crate::soft::{MAX_SGE, MrInner, SoftMr};
use crate::wire::{Request, Response, WireOp};

use super::ring::{PeerSge, Segment, Slot};
use super::{engine::EngineShared, msg, sys};

pub(crate) const RTS: u8 = 0;
const ERR: u8 = 1;

/// State shared by the user's QP handle and the progress thread.
#[derive(Debug)]
pub(crate) struct QpShared {
    pub(crate) qp_num: u32,
    pub(crate) pd: u32,
    pub(crate) state: AtomicU8,
    /// The peer's end of the socket closed: it is gone (or destroyed its QP).
    pub(crate) peer_gone: AtomicBool,
    pub(crate) recv_q: Mutex<VecDeque<RecvWqe>>,
    pub(crate) max_recv_wr: u32,
    pub(crate) recv_cq: Arc<CqInner>,
    pub(crate) send_cq: Arc<CqInner>,
    /// Set by the progress thread while a request waits for a RECV.
    pub(crate) rnr_waiting: AtomicBool,
    pub(crate) rnr_timeout: Option<Duration>,
    /// Largest message this side accepts.
    pub(crate) max_msg_bytes: u32,
    /// The set-up socket: region announcements travel on it, and its closing is
    /// how each side learns that the other is gone.
    pub(crate) sock: OwnedFd,
    pub(crate) seg: Segment,
    /// 0 on the dialer's side, 1 on the listener's: this side's requests use
    /// direction `side`; it serves direction `1 - side`.
    pub(crate) side: usize,
    pub(crate) peer_pid: u32,
    /// Wakes the peer's progress thread.
    pub(crate) peer_engine: OwnedFd,
    /// Wakes a poller sleeping on the peer's send CQ.
    pub(crate) peer_cq: OwnedFd,
    pub(crate) engine: Arc<EngineShared>,
}

impl QpShared {
    pub(crate) fn is_error(&self) -> bool {
        self.state.load(Ordering::Acquire) == ERR
    }

    pub(crate) fn peer_gone(&self) -> bool {
        self.peer_gone.load(Ordering::Acquire)
    }

    /// Moves the QP to the error state: posted receives flush, the peer learns
    /// it from the socket closing, and a poller asleep on the send CQ wakes.
    pub(crate) fn set_error(&self) {
        if self.state.swap(ERR, Ordering::AcqRel) == ERR {
            return;
        }
        crate::soft::sys::shutdown(&self.sock, libc::SHUT_RDWR);
        let mut q = self.recv_q.lock().unwrap_or_else(|p| p.into_inner());
        for w in q.drain(..) {
            self.recv_cq.push(self.recv_completion(w.wr_id, WcStatus::WrFlush, WcOpcode::Recv, 0, None));
        }
        drop(q);
        self.send_cq.wake();
    }

    /// The peer is gone: what it had not answered fails with a transport error.
    pub(crate) fn set_peer_gone(&self) {
        self.peer_gone.store(true, Ordering::Release);
        self.set_error();
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

/// A send work request in the requester's ring.
#[derive(Debug, Default)]
struct Wqe {
    wr_id: u64,
    op: Option<WireOp>,
    opcode: Option<WcOpcode>,
    signaled: bool,
    seq: u32,
    sg: [SgEnt; MAX_SGE],
    nsg: usize,
    len: u32,
    /// Failed local validation: completes with this status when it reaches the head.
    local_err: Option<WcStatus>,
}

/// The requester half of a QP. Positions only grow: `head` is the oldest
/// outstanding request, `published` the next one to write to the shared ring
/// (all before it are there), `tail` the next free slot; position `p` is slot
/// `p` of the shared ring and `p % depth` of `ring`.
#[derive(Debug)]
pub(crate) struct Requester {
    qp: Arc<QpShared>,
    ring: Vec<Wqe>,
    head: u64,
    published: u64,
    tail: u64,
    seq: u32,
    max_sge: usize,
    max_msg_bytes: u32,
    /// Regions the peer was told of, by unique id (dead ones are forgotten).
    announced: HashMap<u64, Weak<MrInner>>,
    ack_timeout: Option<Duration>,
    last_progress: Instant,
}

impl Requester {
    pub(crate) fn new(qp: Arc<QpShared>, depth: u32, max_sge: u32, max_msg_bytes: u32, ack_timeout: Option<Duration>) -> Self {
        Self {
            qp,
            ring: (0..depth.max(1)).map(|_| Wqe::default()).collect(),
            head: 0,
            published: 0,
            tail: 0,
            seq: 0,
            max_sge: max_sge as usize,
            max_msg_bytes,
            announced: HashMap::new(),
            ack_timeout,
            last_progress: Instant::now(),
        }
    }

    fn dir(&self) -> usize {
        self.qp.side
    }

    /// The next position to publish (for tests that play a hostile requester).
    #[cfg(test)]
    pub(crate) fn published_at(&self) -> u64 {
        self.published
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
            self.last_progress = Instant::now();
        }
        self.seq = self.seq.wrapping_add(1);
        let (seq, pd, max_sge, max_msg) = (self.seq, self.qp.pd, self.max_sge, self.max_msg_bytes);
        let (op, opcode, need) = match wr.op {
            SendOp::Send => (WireOp::Send, WcOpcode::Send, Access::NONE),
            SendOp::Write(_) => (WireOp::Write, WcOpcode::Write, Access::NONE),
            SendOp::WriteImm(..) => (WireOp::WriteImm, WcOpcode::Write, Access::NONE),
            SendOp::Read(_) => (WireOp::Read, WcOpcode::Read, Access::LOCAL_WRITE),
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
            }
            Err(st) => {
                w.sg = Default::default();
                w.local_err = Some(st);
            }
        }
        self.tail += 1;
        if self.published == tail && !self.qp.is_error() && self.at(tail).local_err.is_none() {
            self.publish(tail, wr.op);
        }
        Ok(())
    }

    /// Writes the request at `p` into the shared ring and rings the peer if it sleeps.
    fn publish(&mut self, p: u64, op: SendOp) {
        let (remote, imm) = match op {
            SendOp::Send => (crate::api::RemoteAddr { addr: 0, rkey: 0 }, 0),
            SendOp::Write(r) | SendOp::Read(r) => (r, 0),
            SendOp::WriteImm(r, imm) => (r, imm),
        };
        let mut slot = Slot {
            req: Request { op: WireOp::Send, seq: 0, len: 0, rkey: remote.rkey, addr: remote.addr, imm },
            nsg: 0,
            sg: [PeerSge::default(); MAX_SGE],
        };
        let nsg = self.at(p).nsg;
        for i in 0..nsg {
            let Some(mr) = self.at(p).sg[i].mr.clone() else { continue };
            if let Err(e) = self.announce(&mr) {
                crate::stats::warn(&format!("eps-fabric: shm: cannot tell the peer of a memory region: {e}"));
                return self.fail_transport(WcStatus::LocalQpOperation);
            }
            let s = &self.at(p).sg[i];
            slot.sg[i] = PeerSge { uid: mr.uid, off: s.ptr as u64 - mr.base(), len: s.len };
        }
        let w = self.at(p);
        slot.req.op = w.op.expect("a posted request has an op");
        slot.req.seq = w.seq;
        slot.req.len = w.len;
        slot.nsg = nsg;
        let (seg, dir) = (&self.qp.seg, self.dir());
        seg.write_slot(dir, p, &slot.encode());
        seg.req_tail(dir).store(p + 1, Ordering::Release);
        self.published = p + 1;
        // Pairs with the progress thread's fence between raising its sleep flag
        // and looking at the rings once more.
        fence(Ordering::SeqCst);
        if seg.resp_sleep(dir).load(Ordering::Relaxed) != 0 {
            sys::signal(&self.qp.peer_engine);
        }
    }

    /// Tells the peer of `mr` once (its memfd, or where it lies in this process),
    /// and of the regions it knew that are gone since.
    fn announce(&mut self, mr: &Arc<MrInner>) -> std::io::Result<()> {
        if self.announced.contains_key(&mr.uid) {
            return Ok(());
        }
        let fd = self.qp.sock.as_raw_fd();
        let mut gone = Vec::new();
        self.announced.retain(|&uid, w| {
            let live = w.strong_count() > 0;
            if !live {
                gone.push(uid);
            }
            live
        });
        for uid in gone {
            sys::send_msg(fd, &msg::forget(uid), &[])?;
        }
        match mr.buf.shared_fd() {
            Some(mfd) => sys::send_msg(fd, &msg::region(mr.uid, mr.buf.len() as u64, 0), &[mfd.as_raw_fd()])?,
            None => {
                sys::allow_same_user_peers();
                sys::send_msg(fd, &msg::region(mr.uid, mr.buf.len() as u64, mr.base()), &[])?
            }
        }
        self.announced.insert(mr.uid, Arc::downgrade(mr));
        Ok(())
    }

    /// Reaps responses; completes and flushes what the error state ends.
    pub(crate) fn progress(&mut self) {
        if self.head == self.tail {
            return;
        }
        let before = self.head;
        self.reap();
        if self.qp.is_error() {
            // Responses published before the error was raised are read first.
            self.reap();
            if self.head < self.published {
                let st = if self.qp.peer_gone() { WcStatus::RetryExceeded } else { WcStatus::WrFlush };
                self.complete_head(st);
            }
            return self.flush_all();
        }
        if self.head == self.published && self.head < self.tail {
            // Only requests that failed locally are left unpublished.
            let st = self.at(self.head).local_err.unwrap_or(WcStatus::LocalQpOperation);
            self.complete_head(st);
            self.qp.set_error();
            return self.flush_all();
        }
        if self.head != before || self.head == self.tail {
            self.last_progress = Instant::now();
        } else if self.ack_timeout.is_some_and(|t| self.last_progress.elapsed() > t) {
            // The peer stopped without closing: the retry timer ran out.
            self.fail_transport(WcStatus::RetryExceeded);
        }
    }

    fn reap(&mut self) {
        let (dir, published) = (self.dir(), self.published);
        let tail = self.qp.seg.resp_tail(dir).load(Ordering::Acquire);
        if tail > published || tail < self.head.min(published) {
            // The peer answered what was never asked: it is broken or hostile.
            return self.fail_transport(WcStatus::RemoteOperation);
        }
        while self.head < tail {
            let resp = Response::decode(&self.qp.seg.read_resp(dir, self.head));
            let w = self.at(self.head);
            match resp {
                Ok(r) if r.seq == w.seq && Some(r.op) == w.op => {
                    if !r.status.is_ok() {
                        self.complete_head(r.status);
                        self.qp.set_error();
                        return self.flush_all();
                    }
                    self.complete_head(WcStatus::Success);
                }
                _ => return self.fail_transport(WcStatus::RemoteOperation),
            }
        }
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
            self.qp.send_cq.push(c);
        }
        w.sg = Default::default();
        self.head += 1;
        self.published = self.published.max(self.head);
    }

    fn fail_transport(&mut self, status: WcStatus) {
        if self.head < self.tail && !self.qp.is_error() {
            self.complete_head(status);
        }
        self.qp.set_error();
        self.flush_all();
    }

    fn flush_all(&mut self) {
        while self.head < self.tail {
            self.complete_head(WcStatus::WrFlush);
        }
        self.published = self.tail;
    }
}

impl Drive for Mutex<Requester> {
    fn progress(&self) {
        if let Ok(mut r) = self.try_lock() {
            r.progress();
        }
    }

    fn wait_on(&self) -> WaitOn {
        let Ok(r) = self.try_lock() else { return WaitOn::Nothing };
        if r.head == r.tail {
            return WaitOn::Nothing;
        }
        if r.head == r.published || r.qp.is_error() {
            return WaitOn::Ready;
        }
        let (seg, dir) = (&r.qp.seg, r.dir());
        seg.req_sleep(dir).store(1, Ordering::Relaxed);
        // Pairs with the progress thread's fence between publishing a response
        // and reading this flag: either it sees the flag, or we see its response.
        fence(Ordering::SeqCst);
        if seg.resp_tail(dir).load(Ordering::Acquire) > r.head { WaitOn::Ready } else { WaitOn::Nothing }
    }

    fn waited(&self) {
        if let Ok(r) = self.try_lock() {
            r.qp.seg.req_sleep(r.dir()).store(0, Ordering::Relaxed);
        }
    }
}

/// A reliable connected queue pair of the shm provider.
#[derive(Debug)]
pub struct ShmQp {
    pub(crate) shared: Arc<QpShared>,
    pub(crate) req: Arc<Mutex<Requester>>,
    pub(crate) peer: SocketAddr,
    pub(crate) max_sge: usize,
}

impl QueuePair for ShmQp {
    type Mr = SoftMr;

    fn post_send(&self, wr: &SendWr<'_, SoftMr>) -> Result<()> {
        let mut r = self.req.lock().unwrap_or_else(|p| p.into_inner());
        r.post(wr)?;
        if self.shared.is_error() || r.published < r.tail {
            r.progress();
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
        if recv.post(wr, q.is_error(), || q.set_error())? && q.rnr_waiting.load(Ordering::Acquire) {
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

impl Drop for ShmQp {
    fn drop(&mut self) {
        // Destroying a QP produces no completions: detach, then close the socket so
        // the progress thread forgets it and the peer sees the connection end.
        self.shared.send_cq.detach(&self.req);
        self.shared.state.store(ERR, Ordering::Release);
        crate::soft::sys::shutdown(&self.shared.sock, libc::SHUT_RDWR);
        self.shared.recv_q.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.shared.engine.wake();
    }
}
