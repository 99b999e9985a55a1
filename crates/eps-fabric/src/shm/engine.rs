//! The progress thread: the responder side of every shm QP of a device.
//!
//! It polls the request rings its peers write, and for each request, in order,
//! acts as the NIC: it checks the rkey, bounds and access flags against its own
//! registration table, takes a posted RECV where the operation needs one, and
//! only then moves the bytes, once, between the peer's memory (a mapping of the
//! memfd the peer announced, or the peer's address space for memory registered
//! in place) and its own region. It spins for a while after activity, then
//! raises the sleep flag of every ring and sleeps on its eventfd (which peers
//! ring) and on the QP sockets (whose closing says a peer is gone).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::api::{Access, WcOpcode};
use crate::error::{FabricError, Result, WcStatus};
use crate::soft::qp::RecvWqe;
use crate::soft::{MAX_SGE, MrTable};
use crate::wire::{Response, WireOp};

use super::msg;
use super::qp::QpShared;
use super::ring::Slot;
use super::sys::{self, Got, PeerMap};

/// Requests executed on one QP before the others get a turn.
const BATCH: u64 = 32;
/// How often a busy thread looks at the sockets for peers that went away.
const SOCKET_CHECK: Duration = Duration::from_millis(2);

/// What the user side shares with the progress thread.
#[derive(Debug)]
pub(crate) struct EngineShared {
    new_conns: Mutex<Vec<Arc<QpShared>>>,
    pub(crate) wake_fd: OwnedFd,
    stop: AtomicBool,
}

impl EngineShared {
    /// Wakes the progress thread.
    pub(crate) fn wake(&self) {
        sys::signal(&self.wake_fd);
    }

    /// Hands a new QP to the progress thread.
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
        let shared = Arc::new(EngineShared {
            new_conns: Mutex::new(Vec::new()),
            wake_fd: crate::soft::sys::eventfd().map_err(FabricError::Engine)?,
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let spin = crate::soft::spin_budget();
        let thread = std::thread::Builder::new()
            .name("eps-shm-progress".into())
            .spawn(move || Engine { shared: s, mrs, conns: Vec::new(), spin, fds: Vec::new() }.run())
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

/// A region of the peer this thread may copy from and into.
#[derive(Debug)]
enum PeerRegion {
    /// Its memfd, mapped here.
    Mapped(PeerMap, u64),
    /// At this address of the peer's address space (memory it registered in place).
    InPlace(u64, u64),
}

impl PeerRegion {
    fn len(&self) -> u64 {
        match self {
            PeerRegion::Mapped(_, len) | PeerRegion::InPlace(_, len) => *len,
        }
    }
}

/// What became of one request.
enum Outcome {
    Done,
    /// Waits for a RECV (receiver not ready).
    Rnr,
    /// Failed: answer with this status and end the QP.
    Fail(WcStatus),
    /// The peer broke the protocol: end the QP without an answer.
    Kill,
}

struct Conn {
    qp: Arc<QpShared>,
    /// The direction this side serves.
    dir: usize,
    /// Next request to execute.
    head: u64,
    regions: HashMap<u64, PeerRegion>,
    rnr_deadline: Option<Instant>,
    waiting_recv: bool,
}

struct Engine {
    shared: Arc<EngineShared>,
    mrs: Arc<MrTable>,
    conns: Vec<Conn>,
    spin: crate::spin::Spin,
    /// The wake eventfd and every QP socket, for `poll(2)` (kept to reuse).
    fds: Vec<libc::pollfd>,
}

impl Engine {
    fn run(mut self) {
        let mut last_check = Instant::now();
        loop {
            if self.shared.stop.load(Ordering::Acquire) {
                for c in &self.conns {
                    c.qp.set_error();
                }
                return;
            }
            self.adopt_new();
            let mut busy = false;
            for i in 0..self.conns.len() {
                busy |= self.serve(i);
            }
            let now = Instant::now();
            if now.duration_since(last_check) >= SOCKET_CHECK {
                last_check = now;
                self.check_sockets(0);
            }
            self.conns.retain(|c| !c.qp.is_error());
            if busy {
                self.spin.worked();
                continue;
            }
            if self.spin.spinning() {
                // (Yielding: see `soft::spin_budget`.)
                std::thread::yield_now();
                continue;
            }
            self.sleep();
            // The sleep counts as a gap between bursts; it spins again after it.
            self.spin.worked();
        }
    }

    fn adopt_new(&mut self) {
        let new = std::mem::take(&mut *self.shared.new_conns.lock().unwrap_or_else(|p| p.into_inner()));
        for qp in new {
            let dir = 1 - qp.side;
            self.conns.push(Conn { qp, dir, head: 0, regions: HashMap::new(), rnr_deadline: None, waiting_recv: false });
        }
    }

    /// Whether a request waits on `c` that could run now.
    fn has_work(c: &Conn) -> bool {
        if c.waiting_recv {
            return !c.qp.recv_q.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
                || c.rnr_deadline.is_some_and(|d| Instant::now() >= d);
        }
        c.qp.seg.req_tail(c.dir).load(Ordering::Acquire) != c.head
    }

    /// Raises every ring's sleep flag, looks once more, and sleeps on the eventfd
    /// and the sockets until a peer rings, a socket changes, or an RNR wait ends.
    fn sleep(&mut self) {
        for c in &self.conns {
            c.qp.seg.resp_sleep(c.dir).store(1, Ordering::Relaxed);
        }
        // Pairs with the requester's fence between publishing and reading the flag.
        fence(Ordering::SeqCst);
        let ready =
            self.conns.iter().any(Self::has_work) || !self.shared.new_conns.lock().unwrap_or_else(|p| p.into_inner()).is_empty();
        if !ready && !self.shared.stop.load(Ordering::Acquire) {
            let rnr = self.conns.iter().any(|c| c.waiting_recv);
            self.check_sockets(if rnr { 2 } else { 1000 });
        }
        for c in &self.conns {
            c.qp.seg.resp_sleep(c.dir).store(0, Ordering::Relaxed);
        }
    }

    /// Polls the wake eventfd and every socket for `timeout_ms`; takes in region
    /// announcements and notices peers that went away.
    fn check_sockets(&mut self, timeout_ms: i32) {
        let mut fds = std::mem::take(&mut self.fds);
        fds.clear();
        fds.push(libc::pollfd { fd: self.shared.wake_fd.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        fds.extend(self.conns.iter().map(|c| libc::pollfd { fd: c.qp.sock.as_raw_fd(), events: libc::POLLIN, revents: 0 }));
        crate::soft::sys::poll_fds(&mut fds, timeout_ms);
        if fds[0].revents != 0 {
            crate::soft::sys::eventfd_drain(&self.shared.wake_fd);
        }
        for (i, f) in fds[1..].iter().enumerate() {
            if f.revents != 0 {
                self.take_messages(i, None);
            }
        }
        self.fds = fds;
    }

    /// Reads the control messages waiting on conn `i`'s socket, until `want`
    /// (a region id) is known if given. Returns whether it is.
    fn take_messages(&mut self, i: usize, want: Option<u64>) -> bool {
        let c = &mut self.conns[i];
        loop {
            if want.is_some_and(|u| c.regions.contains_key(&u)) {
                return true;
            }
            match sys::recv_msg(c.qp.sock.as_raw_fd(), true) {
                Ok(Got::Msg(bytes, n, mut fds)) => {
                    let Some(m) = msg::decode(&bytes[..n]) else {
                        c.qp.set_error();
                        return false;
                    };
                    match (m.kind, fds.len()) {
                        (msg::REGION, 1) if m.addr() == 0 => match PeerMap::new(&fds.remove(0), m.d as usize) {
                            Ok(map) => {
                                c.regions.insert(m.c, PeerRegion::Mapped(map, m.d));
                            }
                            Err(e) => {
                                crate::stats::warn(&format!("eps-fabric: shm: cannot map a region of the peer: {e}"));
                                c.qp.set_error();
                                return false;
                            }
                        },
                        (msg::REGION, 0) if m.addr() != 0 => {
                            c.regions.insert(m.c, PeerRegion::InPlace(m.addr(), m.d));
                        }
                        (msg::FORGET, 0) => {
                            c.regions.remove(&m.c);
                        }
                        _ => {
                            c.qp.set_error();
                            return false;
                        }
                    }
                }
                Ok(Got::Empty) => return want.is_none(),
                Ok(Got::Closed) | Err(_) => {
                    c.qp.set_peer_gone();
                    return false;
                }
            }
        }
    }

    /// Executes what waits on conn `i`; returns whether anything ran.
    fn serve(&mut self, i: usize) -> bool {
        let c = &self.conns[i];
        if c.qp.is_error() || !Self::has_work(c) {
            return false;
        }
        let (dir, ring) = (c.dir, c.qp.seg.ring(c.dir) as u64);
        let tail = c.qp.seg.req_tail(dir).load(Ordering::Acquire);
        if tail < c.head || tail - c.head > ring {
            c.qp.set_error();
            return true;
        }
        let mut ran = 0;
        while self.conns[i].head < tail && ran < BATCH {
            let c = &self.conns[i];
            if c.qp.is_error() {
                // Destroyed or failed meanwhile: nothing more is executed.
                break;
            }
            let head = c.head;
            let Some(slot) = Slot::decode(&c.qp.seg.read_slot(dir, head)) else {
                c.qp.set_error();
                return true;
            };
            let status = match self.execute(i, &slot) {
                Outcome::Done => WcStatus::Success,
                Outcome::Rnr => break,
                // A QP destroyed during the checks (its regions with it) is not
                // answered: its requester is gone or already flushed.
                Outcome::Fail(_) if self.conns[i].qp.is_error() => break,
                Outcome::Fail(st) => st,
                Outcome::Kill => {
                    self.conns[i].qp.set_error();
                    return true;
                }
            };
            let c = &mut self.conns[i];
            c.waiting_recv = false;
            c.rnr_deadline = None;
            let len = if slot.req.op == WireOp::Read && status.is_ok() { slot.req.len } else { 0 };
            let resp = Response { op: slot.req.op, status, seq: slot.req.seq, len };
            c.qp.seg.write_resp(dir, head, &resp.encode());
            c.head = head + 1;
            c.qp.seg.resp_tail(dir).store(head + 1, Ordering::Release);
            ran += 1;
            if !status.is_ok() {
                // The responder executes nothing after a failed request.
                c.qp.set_error();
                break;
            }
        }
        let c = &self.conns[i];
        if ran > 0 {
            // Pairs with the requester's fence between raising its sleep flag and
            // looking at the responses once more.
            fence(Ordering::SeqCst);
            if c.qp.seg.req_sleep(dir).load(Ordering::Relaxed) != 0 {
                sys::signal(&c.qp.peer_cq);
            }
        }
        ran > 0
    }

    /// Checks one request like a NIC, then moves its bytes.
    fn execute(&mut self, i: usize, slot: &Slot) -> Outcome {
        let req = slot.req;
        if req.len > self.conns[i].qp.max_msg_bytes {
            return Outcome::Fail(WcStatus::RemoteInvalidRequest);
        }
        // The requester's SGEs must name regions it announced, within their bounds.
        for s in &slot.sg[..slot.nsg] {
            if !self.take_messages(i, Some(s.uid)) {
                return Outcome::Kill;
            }
            let r = &self.conns[i].regions[&s.uid];
            if s.off.checked_add(s.len as u64).is_none_or(|e| e > r.len()) {
                return Outcome::Kill;
            }
        }
        let c = &mut self.conns[i];
        let target = match req.op {
            WireOp::Write | WireOp::WriteImm | WireOp::Read => {
                let need = if req.op == WireOp::Read { Access::REMOTE_READ } else { Access::REMOTE_WRITE };
                let pd = c.qp.pd;
                let checked = self
                    .mrs
                    .lookup(req.rkey)
                    .filter(|m| m.pd == pd && m.access.contains(need))
                    .and_then(|m| m.range(req.addr, req.len as u64).map(|p| (m, p)));
                let Some(t) = checked else { return Outcome::Fail(WcStatus::RemoteAccess) };
                Some(t)
            }
            WireOp::Send => None,
        };
        let recv = if matches!(req.op, WireOp::Send | WireOp::WriteImm) {
            match Self::take_recv(c) {
                Some(w) => Some(w),
                None if c.rnr_deadline.is_some_and(|d| Instant::now() >= d) => {
                    c.qp.rnr_waiting.store(false, Ordering::Release);
                    return Outcome::Fail(WcStatus::RnrRetryExceeded);
                }
                None => return Outcome::Rnr,
            }
        } else {
            None
        };
        c.qp.rnr_waiting.store(false, Ordering::Release);
        if req.op == WireOp::Send && recv.as_ref().is_some_and(|w| w.capacity() < req.len as u64) {
            let w = recv.expect("checked above");
            c.qp.recv_cq.push(c.qp.recv_completion(w.wr_id, WcStatus::LocalLength, WcOpcode::Recv, 0, None));
            return Outcome::Fail(WcStatus::RemoteInvalidRequest);
        }
        // Local pieces the bytes go to (or come from, for READ), in order.
        let mut local = [(std::ptr::null_mut::<u8>(), 0usize); MAX_SGE];
        let n = match (&target, &recv) {
            (Some((_, p)), _) => {
                local[0] = (*p, req.len as usize);
                1
            }
            (None, Some(w)) => {
                for (l, s) in local.iter_mut().zip(&w.sg[..w.nsg]) {
                    *l = (s.ptr as *mut u8, s.len as usize);
                }
                w.nsg
            }
            (None, None) => 0,
        };
        let from_peer = req.op != WireOp::Read;
        let moved = Self::copy(c, slot, &local[..n], from_peer);
        if let Some(w) = recv {
            if !moved {
                c.qp.recv_cq.push(c.qp.recv_completion(w.wr_id, WcStatus::WrFlush, WcOpcode::Recv, 0, None));
            } else {
                let (opcode, imm) =
                    if req.op == WireOp::WriteImm { (WcOpcode::RecvWithImm, Some(req.imm)) } else { (WcOpcode::Recv, None) };
                c.qp.recv_cq.push(c.qp.recv_completion(w.wr_id, WcStatus::Success, opcode, req.len, imm));
            }
        }
        // The target region stayed mapped through the copy: `target` held it.
        drop(target);
        if moved { Outcome::Done } else { Outcome::Fail(WcStatus::RemoteOperation) }
    }

    /// Takes a posted RECV, or starts (or goes on) waiting for one.
    fn take_recv(c: &mut Conn) -> Option<RecvWqe> {
        let mut w = c.qp.recv_q.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
        if w.is_none() {
            // Announce the wait, then look again so a RECV posted meanwhile is not missed.
            c.qp.rnr_waiting.store(true, Ordering::Release);
            w = c.qp.recv_q.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
        }
        if w.is_none() && !c.waiting_recv {
            c.waiting_recv = true;
            // Without a timeout the wait is forever; a far deadline keeps the arithmetic simple.
            c.rnr_deadline = c.qp.rnr_timeout.map(|t| Instant::now() + t);
        }
        w
    }

    /// Moves `slot`'s bytes between the peer's SGEs and the `local` pieces
    /// (`from_peer`: into the local pieces). Lengths were checked to agree.
    fn copy(c: &Conn, slot: &Slot, local: &[(*mut u8, usize)], from_peer: bool) -> bool {
        let (mut li, mut loff) = (0usize, 0usize);
        for s in &slot.sg[..slot.nsg] {
            let (mut soff, mut left) = (s.off, s.len as usize);
            while left > 0 {
                let Some(&(lp, llen)) = local.get(li) else { return false };
                if loff == llen {
                    li += 1;
                    loff = 0;
                    continue;
                }
                let n = left.min(llen - loff);
                let lptr = lp.wrapping_add(loff);
                let ok = match &c.regions[&s.uid] {
                    PeerRegion::Mapped(map, _) => {
                        let pptr = map.ptr.wrapping_add(soff as usize);
                        // SAFETY: the peer range lies inside the mapping (checked against
                        // the announced length, which the mapping covers); the local range
                        // lies inside a region this request was checked against and whose
                        // Arc (target, or the RECV's SGEs) is held across the copy.
                        unsafe {
                            if from_peer {
                                super::copy::copy(lptr, pptr, n);
                            } else {
                                super::copy::copy(pptr, lptr, n);
                            }
                        }
                        true
                    }
                    PeerRegion::InPlace(addr, _) => {
                        // SAFETY: the local range is as above; a bad peer address only fails the call.
                        let moved = unsafe { sys::vm_copy(c.qp.peer_pid, lptr, addr + soff, n, from_peer) };
                        moved.is_ok()
                    }
                };
                if !ok {
                    return false;
                }
                loff += n;
                soff += n as u64;
                left -= n;
            }
        }
        true
    }
}
