//! The provider's software layer over the verbs queues, for what the fabric API
//! promises and a NIC does not give by itself: queue depths exactly as asked (a
//! NIC may allocate more; the API answers `QueueFull` at the asked depth), the
//! opcode of a failed or flushed request (verbs leave it undefined), completions
//! for requests refused before the NIC sees them, and periodic signaling: in a
//! long run of unsignaled requests every `depth / 2`-th is signaled inside (its
//! successful completion is not reported), so their slots come back.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use eps_fabric::Result;
use eps_fabric::prelude::*;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A request on the send queue.
#[derive(Clone, Copy, Debug)]
struct Posted {
    wr_id: u64,
    /// The opcode of its completion.
    opcode: WcOpcode,
    /// The NIC reports its completion (asked, or signaled inside).
    signaled: bool,
    /// Signaled inside only: its success is not reported.
    inside: bool,
}

/// Requests posted on one QP and not completed yet, oldest first.
#[derive(Debug)]
pub(crate) struct Acct {
    /// Send queue, in posting order.
    send: Mutex<VecDeque<Posted>>,
    /// Unsignaled requests posted since the last signaled one.
    run: Mutex<u32>,
    /// Receive queue: wr_ids.
    recv: Mutex<VecDeque<u64>>,
    max_send: u32,
    max_recv: u32,
}

impl Acct {
    pub(crate) fn new(max_send: u32, max_recv: u32) -> Self {
        Self { send: Mutex::new(VecDeque::new()), recv: Mutex::new(VecDeque::new()), run: Mutex::new(0), max_send, max_recv }
    }

    /// Takes a send-queue slot for `wr_id`, or says the queue is full. Returns
    /// whether the request must be signaled (asked, or signaled inside).
    pub(crate) fn take_send(&self, wr_id: u64, opcode: WcOpcode, signaled: bool) -> Result<bool> {
        let mut q = lock(&self.send);
        if q.len() >= self.max_send as usize {
            return Err(FabricError::QueueFull { queue: "send", depth: self.max_send });
        }
        let mut run = lock(&self.run);
        let inside = !signaled && *run + 1 >= (self.max_send / 2).max(1);
        *run = if signaled || inside { 0 } else { *run + 1 };
        q.push_back(Posted { wr_id, opcode, signaled: signaled || inside, inside });
        Ok(signaled || inside)
    }

    /// Gives back the slot just taken (the post failed).
    pub(crate) fn untake_send(&self) {
        lock(&self.send).pop_back();
    }

    /// Takes a receive-queue slot, or says the queue is full.
    pub(crate) fn take_recv(&self, wr_id: u64) -> Result<()> {
        let mut q = lock(&self.recv);
        if q.len() >= self.max_recv as usize {
            return Err(FabricError::QueueFull { queue: "receive", depth: self.max_recv });
        }
        q.push_back(wr_id);
        Ok(())
    }

    /// Gives back the slot just taken (the post failed).
    pub(crate) fn untake_recv(&self) {
        lock(&self.recv).pop_back();
    }

    /// A completion of this QP arrived: frees its slot (and, on the send queue,
    /// those of the unsignaled requests posted before it), and for a failed one
    /// supplies the opcode the NIC left undefined. Returns false for the success
    /// of a request signaled only inside (not reported).
    pub(crate) fn completed(&self, c: &mut Completion) -> bool {
        let recv_side = matches!(c.opcode, WcOpcode::Recv | WcOpcode::RecvWithImm);
        if c.status.is_ok() && recv_side {
            let mut q = lock(&self.recv);
            if let Some(i) = q.iter().position(|&w| w == c.wr_id) {
                q.remove(i);
            }
            return true;
        }
        if c.status.is_ok() {
            // The send queue completes in order and a success is reported for
            // signaled requests only: this is the oldest signaled one, and the
            // unsignaled ones before it are done too. (Matching by wr_id would
            // stop at the first request sharing it: callers may reuse ids.)
            let mut q = lock(&self.send);
            while let Some(p) = q.pop_front() {
                if p.signaled {
                    debug_assert_eq!(p.wr_id, c.wr_id, "send completions come in posting order");
                    return !p.inside;
                }
            }
            return true;
        }
        // Failed or flushed: the oldest outstanding request of either queue with
        // this wr_id (both queues complete in order).
        let mut s = lock(&self.send);
        if s.front().is_some_and(|p| p.wr_id == c.wr_id) {
            c.opcode = s.pop_front().map_or(WcOpcode::Send, |p| p.opcode);
            return true;
        }
        let mut r = lock(&self.recv);
        if r.front() == Some(&c.wr_id) {
            r.pop_front();
            c.opcode = WcOpcode::Recv;
            return true;
        }
        if let Some(i) = s.iter().position(|p| p.wr_id == c.wr_id) {
            // Requests before it succeeded unsignaled.
            let p = s.drain(..=i).next_back();
            c.opcode = p.map_or(WcOpcode::Send, |p| p.opcode);
        } else if let Some(i) = r.iter().position(|&w| w == c.wr_id) {
            r.remove(i);
            c.opcode = WcOpcode::Recv;
        }
        true
    }
}

/// Per completion queue: completions made here, and the QPs completing on it.
#[derive(Debug, Default)]
pub(crate) struct CqSide {
    injected: Mutex<VecDeque<Completion>>,
    qps: Mutex<HashMap<u32, Arc<Acct>>>,
}

impl CqSide {
    /// A completion for a request refused before the NIC saw it.
    pub(crate) fn inject(&self, c: Completion) {
        lock(&self.injected).push_back(c);
    }

    /// Moves injected completions into `out`; returns how many.
    pub(crate) fn drain(&self, out: &mut [Completion]) -> usize {
        let mut q = lock(&self.injected);
        let n = out.len().min(q.len());
        for (o, c) in out.iter_mut().zip(q.drain(..n)) {
            *o = c;
        }
        n
    }

    pub(crate) fn attach(&self, qp_num: u32, acct: Arc<Acct>) {
        lock(&self.qps).insert(qp_num, acct);
    }

    pub(crate) fn detach(&self, qp_num: u32) {
        lock(&self.qps).remove(&qp_num);
    }

    /// Accounts a completion the NIC delivered; false if it is not reported.
    pub(crate) fn completed(&self, c: &mut Completion) -> bool {
        let acct = lock(&self.qps).get(&c.qp_num).cloned();
        acct.is_none_or(|a| a.completed(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(wr_id: u64, status: WcStatus, opcode: WcOpcode) -> Completion {
        Completion { wr_id, status, opcode, byte_len: 0, imm: None, qp_num: 1 }
    }

    #[test]
    fn depths_are_exact_and_a_signaled_completion_frees_the_unsignaled_before_it() {
        let u = Acct::new(4, 1);
        u.take_send(0, WcOpcode::Write, false).unwrap();
        for w in 1..4 {
            u.take_send(w, WcOpcode::Write, true).unwrap();
        }
        assert!(u.take_send(4, WcOpcode::Write, true).is_err());
        assert!(u.completed(&mut c(1, WcStatus::Success, WcOpcode::Write))); // frees 0 and 1
        u.take_send(4, WcOpcode::Write, true).unwrap();
        u.take_send(5, WcOpcode::Write, true).unwrap();
        assert!(u.take_send(6, WcOpcode::Write, true).is_err());
        let a = Acct::new(3, 1);
        for w in 0..3 {
            assert!(a.take_send(w, WcOpcode::Write, true).unwrap());
        }
        assert!(matches!(a.take_send(9, WcOpcode::Write, true), Err(FabricError::QueueFull { queue: "send", depth: 3 })));
        assert!(a.completed(&mut c(0, WcStatus::Success, WcOpcode::Write)));
        assert!(a.completed(&mut c(1, WcStatus::Success, WcOpcode::Write)));
        a.take_send(3, WcOpcode::Send, true).unwrap();
        a.take_send(4, WcOpcode::Send, true).unwrap();
        assert!(a.take_send(5, WcOpcode::Send, true).is_err());
        a.take_recv(7).unwrap();
        assert!(matches!(a.take_recv(8), Err(FabricError::QueueFull { queue: "receive", depth: 1 })));
        a.completed(&mut c(7, WcStatus::Success, WcOpcode::Recv));
        a.take_recv(8).unwrap();
    }

    #[test]
    fn failed_completions_get_the_opcode_of_their_request() {
        let a = Acct::new(8, 8);
        a.take_send(1, WcOpcode::Read, true).unwrap();
        a.take_send(2, WcOpcode::Send, true).unwrap();
        a.take_recv(2).unwrap();
        // The NIC leaves the opcode of a flushed completion undefined.
        let mut x = c(1, WcStatus::RemoteAccess, WcOpcode::Send);
        a.completed(&mut x);
        assert_eq!(x.opcode, WcOpcode::Read);
        let mut y = c(2, WcStatus::WrFlush, WcOpcode::Write);
        a.completed(&mut y);
        assert_eq!(y.opcode, WcOpcode::Send, "the send queue's request first");
        let mut z = c(2, WcStatus::WrFlush, WcOpcode::Write);
        a.completed(&mut z);
        assert_eq!(z.opcode, WcOpcode::Recv);
        a.take_send(3, WcOpcode::Write, true).unwrap();
    }

    #[test]
    fn long_unsignaled_runs_are_signaled_inside_and_those_successes_not_reported() {
        let a = Acct::new(8, 8);
        // Depth 8: every 4th unsignaled request is signaled inside.
        let sig: Vec<bool> = (0..8).map(|w| a.take_send(w, WcOpcode::Write, false).unwrap()).collect();
        assert_eq!(sig, [false, false, false, true, false, false, false, true]);
        assert!(a.take_send(8, WcOpcode::Write, false).is_err(), "full");
        // The NIC completes the inside-signaled ones: slots free, nothing reported.
        assert!(!a.completed(&mut c(3, WcStatus::Success, WcOpcode::Write)));
        assert!(!a.completed(&mut c(7, WcStatus::Success, WcOpcode::Write)));
        for w in 8..16 {
            a.take_send(w, WcOpcode::Write, false).unwrap();
        }
        // An error of an inside-signaled request is reported (errors always are).
        // (8..11 succeeded unsignaled before it.)
        let mut e = c(11, WcStatus::RemoteAccess, WcOpcode::Send);
        assert!(a.completed(&mut e));
        assert_eq!(e.opcode, WcOpcode::Write);
    }

    #[test]
    fn slots_come_back_when_every_request_shares_one_wr_id() {
        // Callers may give every unsignaled notice the same wr_id: each inside
        // signal still frees the whole run before it.
        let a = Acct::new(8, 8);
        for round in 0..100u32 {
            let mut inside = 0;
            for _ in 0..4 {
                if a.take_send(7, WcOpcode::Write, false).unwrap_or_else(|e| panic!("round {round}: {e}")) {
                    inside += 1;
                }
            }
            assert_eq!(inside, 1, "one of every depth/2 is signaled inside");
            assert!(!a.completed(&mut c(7, WcStatus::Success, WcOpcode::Write)), "not reported");
        }
        // A signaled request among them is reported, and frees what is before it.
        a.take_send(7, WcOpcode::Write, false).unwrap();
        a.take_send(7, WcOpcode::Send, true).unwrap();
        assert!(a.completed(&mut c(7, WcStatus::Success, WcOpcode::Send)));
        for _ in 0..8 {
            a.take_send(7, WcOpcode::Write, true).unwrap();
        }
    }
}
