//! Hostile and unusual peers of the shm provider, which the conformance suite
//! cannot stage through the public API: a requester that writes garbage into the
//! shared ring, names memory it never announced or beyond what it announced,
//! runs its tail ahead, or hands over memory that is not sealed; and memory
//! registered in place, which moves with `process_vm_readv`/`writev`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::ring::{PeerSge, SLOT, Slot};
use super::{ShmPd, ShmQp, msg, sys};
use crate::api::*;
use crate::soft::{MAX_SGE, SoftCq, SoftMr};
use crate::wire::{Request, WireOp};
use crate::{RegionBuf, WcStatus};

struct Pair {
    a_pd: ShmPd,
    b_pd: ShmPd,
    a_cq: SoftCq,
    a: ShmQp,
    b: ShmQp,
}

fn pair() -> Pair {
    let (a_pd, b_pd) = (super::ShmDevice::open().unwrap().alloc_pd(), super::ShmDevice::open().unwrap().alloc_pd());
    let (a_cq, b_cq) = (a_pd.create_cq(256).unwrap(), b_pd.create_cq(256).unwrap());
    let o = QpOptions::new(Secret::new("shm-tests").unwrap());
    let l = b_pd.listen("127.0.0.1:0".parse().unwrap(), &o).unwrap();
    let (a, b) = std::thread::scope(|s| {
        let h = s.spawn(|| l.accept(&b_cq, &b_cq, Duration::from_secs(20)).unwrap());
        let a = a_pd.connect(l.local_addr(), &a_cq, &a_cq, &o).unwrap();
        (a, h.join().unwrap())
    });
    Pair { a_pd, b_pd, a_cq, a, b }
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn poll_one(cq: &SoftCq) -> Completion {
    let mut c = [Completion::EMPTY; 1];
    let mut got = None;
    wait_for("a completion", || {
        if cq.poll(&mut c).unwrap() == 1 {
            got = Some(c[0]);
        }
        got.is_some()
    });
    got.unwrap()
}

/// Writes `slot` as the next request of `a`, as a hostile requester would
/// (bypassing the requester's own checks), with `tail` as its tail.
fn inject(p: &Pair, slot: &[u8; SLOT], tail_ahead: u64) {
    let r = p.a.req.lock().unwrap();
    let (seg, dir, at) = (&p.a.shared.seg, p.a.shared.side, r.published_at());
    seg.write_slot(dir, at, slot);
    seg.req_tail(dir).store(at + 1 + tail_ahead, Ordering::Release);
    sys::signal(&p.a.shared.peer_engine);
}

fn write_slot(dst: &SoftMr, sg: PeerSge) -> [u8; SLOT] {
    let req = Request { op: WireOp::Write, seq: 1, len: sg.len, rkey: dst.rkey(), addr: dst.addr(), imm: 0 };
    let mut sgs = [PeerSge::default(); MAX_SGE];
    sgs[0] = sg;
    Slot { req, nsg: 1, sg: sgs }.encode()
}

/// The responder ends the QP; its region is untouched and its process goes on.
fn expect_refused(p: &Pair, dst: &SoftMr) {
    wait_for("the responder to end the QP", || p.b.state() == QpState::Error);
    let mut v = vec![0u8; dst.len()];
    dst.read_at(0, &mut v);
    assert!(v.iter().all(|&x| x == 0), "nothing landed");
    // The device still serves others.
    let q = pair();
    let src = q.a_pd.alloc_mr(64, Access::ALL).unwrap();
    let d = q.b_pd.alloc_mr(64, Access::ALL).unwrap();
    q.a.post_send(&SendWr { wr_id: 1, op: SendOp::Write(d.remote(0)), sg: &[Sge::whole(&src)], signaled: true }).unwrap();
    assert_eq!(poll_one(&q.a_cq).status, WcStatus::Success);
}

#[test]
fn garbage_in_the_ring_ends_the_qp() {
    let p = pair();
    let dst = p.b_pd.alloc_mr(4096, Access::ALL).unwrap();
    inject(&p, &[0xab; SLOT], 0);
    expect_refused(&p, &dst);
}

#[test]
fn a_tail_more_than_a_ring_ahead_ends_the_qp() {
    let p = pair();
    let dst = p.b_pd.alloc_mr(4096, Access::ALL).unwrap();
    let src = p.a_pd.alloc_mr(4096, Access::ALL).unwrap();
    let slot = write_slot(&dst, PeerSge { uid: src.inner().uid, off: 0, len: 64 });
    inject(&p, &slot, 1 << 20);
    expect_refused(&p, &dst);
}

#[test]
fn memory_never_announced_is_refused() {
    let p = pair();
    let dst = p.b_pd.alloc_mr(4096, Access::ALL).unwrap();
    let slot = write_slot(&dst, PeerSge { uid: 987_654_321, off: 0, len: 64 });
    inject(&p, &slot, 0);
    expect_refused(&p, &dst);
}

#[test]
fn beyond_the_announced_region_is_refused() {
    let p = pair();
    let dst = p.b_pd.alloc_mr(1 << 16, Access::ALL).unwrap();
    let src = p.a_pd.alloc_mr(4096, Access::ALL).unwrap();
    // A legitimate WRITE announces `src`, then one names bytes past its end.
    let sg = [Sge::new(&src, 0, 0)];
    p.a.post_send(&SendWr { wr_id: 1, op: SendOp::Write(dst.remote(0)), sg: &sg, signaled: true }).unwrap();
    assert_eq!(poll_one(&p.a_cq).status, WcStatus::Success);
    let map_len = src.inner().buf.map_len() as u64;
    let slot = write_slot(&dst, PeerSge { uid: src.inner().uid, off: map_len - 64, len: 4096 });
    inject(&p, &slot, 0);
    expect_refused(&p, &dst);
}

#[test]
fn memory_that_is_not_sealed_is_refused() {
    let p = pair();
    let dst = p.b_pd.alloc_mr(4096, Access::ALL).unwrap();
    // SAFETY: a fresh memfd, owned below; sized but never sealed.
    let fd = unsafe { OwnedFd::from_raw_fd(libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC)) };
    // SAFETY: ftruncate on the descriptor just made.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
    sys::send_msg(p.a.shared.sock.as_raw_fd(), &msg::region(5, 4096, 0), &[fd.as_raw_fd()]).unwrap();
    let slot = write_slot(&dst, PeerSge { uid: 5, off: 0, len: 64 });
    inject(&p, &slot, 0);
    expect_refused(&p, &dst);
}

#[test]
fn memory_registered_in_place_moves_through_the_peer_address_space() {
    let p = pair();
    let mut own = vec![0u8; 10_000];
    for (i, b) in own.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let want = own.clone();
    // SAFETY: `own` outlives the region (dropped at the end of the test, after it).
    let buf = unsafe { RegionBuf::borrowed(own.as_mut_ptr(), own.len()) }.unwrap();
    assert!(buf.shared_fd().is_none());
    let src = p.a_pd.register(buf, Access::ALL).unwrap();
    let dst = p.b_pd.alloc_mr(10_000, Access::ALL).unwrap();
    p.a.post_send(&SendWr { wr_id: 1, op: SendOp::Write(dst.remote(0)), sg: &[Sge::whole(&src)], signaled: true }).unwrap();
    assert_eq!(poll_one(&p.a_cq).status, WcStatus::Success);
    let mut got = vec![0u8; 10_000];
    dst.read_at(0, &mut got);
    assert_eq!(got, want);
    // READ back into the in-place region, shifted.
    let sg = [Sge::new(&src, 100, 5_000)];
    p.a.post_send(&SendWr { wr_id: 2, op: SendOp::Read(dst.remote(0)), sg: &sg, signaled: true }).unwrap();
    assert_eq!(poll_one(&p.a_cq).status, WcStatus::Success);
    drop((src, p));
    assert_eq!(&own[100..5_100], &want[..5_000]);
}
