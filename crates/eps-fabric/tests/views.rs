//! Views of registered memory: given only of regions that nothing but their
//! owner writes, and the providers refuse every operation that would write one
//! (a peer's WRITE, a local RECV or READ into it), so a view can never change
//! under its holder.

use std::time::{Duration, Instant};

use eps_fabric::prelude::*;
use eps_fabric::shm::ShmDevice;

fn opts() -> QpOptions {
    QpOptions::new(Secret::new("views-test").unwrap())
}

/// Two connected queue pairs of one provider, each with its own domain.
struct Pair<P: Fabric> {
    a_pd: P,
    b_pd: P,
    a_cq: P::Cq,
    b_cq: P::Cq,
    a: P::Qp,
    b: P::Qp,
}

fn pair<P: Fabric>(a_pd: P, b_pd: P) -> Pair<P>
where
    P::Qp: Send,
    P::Cq: Sync,
    P::Listener: Sync,
{
    let (a_cq, b_cq) = (a_pd.create_cq(64).unwrap(), b_pd.create_cq(64).unwrap());
    let l = b_pd.listen("127.0.0.1:0".parse().unwrap(), &opts()).unwrap();
    let (a, b) = std::thread::scope(|s| {
        let h = s.spawn(|| l.accept(&b_cq, &b_cq, Duration::from_secs(20)).unwrap());
        let a = a_pd.connect(l.local_addr(), &a_cq, &a_cq, &opts()).unwrap();
        (a, h.join().unwrap())
    });
    Pair { a_pd, b_pd, a_cq, b_cq, a, b }
}

fn poll_one<C: CompletionQueue>(cq: &C) -> Completion {
    let mut c = [Completion::EMPTY; 1];
    let end = Instant::now() + Duration::from_secs(10);
    while cq.poll(&mut c).unwrap() == 0 {
        assert!(Instant::now() < end, "no completion");
        std::thread::sleep(Duration::from_millis(1));
    }
    c[0]
}

fn views_follow_access<P: Fabric>(pd: &P) {
    for access in [Access::LOCAL_WRITE, Access::LOCAL_WRITE | Access::REMOTE_WRITE, Access::ALL] {
        let mut mr = pd.alloc_mr(64, access).unwrap();
        assert!(mr.view().is_err(), "{access:?}: a view of memory others may write");
        assert!(mr.view_mut().is_err(), "{access:?}: a mutable view of memory others may write");
        // Copies still work.
        mr.write_at(3, b"abc");
        let mut got = [0u8; 3];
        mr.read_at(3, &mut got);
        assert_eq!(&got, b"abc");
    }
    for access in [Access::NONE, Access::REMOTE_READ] {
        let mut mr = pd.alloc_mr(64, access).unwrap();
        mr.view_mut().unwrap()[..4].copy_from_slice(b"mine");
        assert_eq!(&mr.view().unwrap()[..4], b"mine");
    }
}

/// A peer's WRITE into a region registered for peers' READs only fails, and the
/// owner's bytes stay; a RECV or a READ that would land in an owner-only region
/// is refused when posted.
fn owner_only_regions_are_never_written<P: Fabric>(p: Pair<P>) {
    let mut owned = p.b_pd.alloc_mr(64, Access::REMOTE_READ).unwrap();
    owned.view_mut().unwrap().fill(7);
    let mut src = p.a_pd.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    src.write_at(0, &[1u8; 64]);
    let sg = [Sge::whole(&src)];
    p.a.post_send(&SendWr { wr_id: 1, op: SendOp::Write(owned.remote(0)), sg: &sg, signaled: true }).unwrap();
    let c = poll_one(&p.a_cq);
    assert_eq!((c.wr_id, c.status), (1, WcStatus::RemoteAccess), "a WRITE into a read-only region");
    assert!(owned.view().unwrap().iter().all(|&b| b == 7), "the owner's bytes changed");

    // The peer's READ of it still works.
    let sink = p.a_pd.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    let p2 = pair(p.a_pd.clone(), p.b_pd.clone());
    let sg = [Sge::whole(&sink)];
    p2.a.post_send(&SendWr { wr_id: 2, op: SendOp::Read(owned.remote(0)), sg: &sg, signaled: true }).unwrap();
    let c = poll_one(&p2.a_cq);
    assert_eq!((c.wr_id, c.status), (2, WcStatus::Success));
    let mut got = [0u8; 64];
    sink.read_at(0, &mut got);
    assert!(got.iter().all(|&b| b == 7));

    // Local operations that would write an owner-only region are refused.
    let mine = p2.b_pd.alloc_mr(64, Access::NONE).unwrap();
    let sg = [Sge::whole(&mine)];
    let posted = p2.b.post_recv(&RecvWr { wr_id: 3, sg: &sg });
    if posted.is_ok() {
        let c = poll_one(&p2.b_cq);
        assert_eq!((c.wr_id, c.status), (3, WcStatus::LocalProtection), "a RECV into an owner-only region");
    }
    let target = p.a_pd.alloc_mr(64, Access::REMOTE_READ).unwrap();
    let p3 = pair(p.a_pd.clone(), p.b_pd.clone());
    let read_into = [Sge::whole(&target)];
    let theirs = p.b_pd.alloc_mr(64, Access::REMOTE_READ).unwrap();
    let posted = p3.a.post_send(&SendWr { wr_id: 4, op: SendOp::Read(theirs.remote(0)), sg: &read_into, signaled: true });
    if posted.is_ok() {
        let c = poll_one(&p3.a_cq);
        assert_eq!((c.wr_id, c.status), (4, WcStatus::LocalProtection), "a READ into an owner-only region");
    }
    assert!(target.view().unwrap().iter().all(|&b| b == 0));
    drop((p.a, p.b, p.b_cq));
}

#[test]
fn soft_views_follow_access() {
    views_follow_access(&SoftDevice::open().unwrap().alloc_pd());
}

#[test]
fn shm_views_follow_access() {
    views_follow_access(&ShmDevice::open().unwrap().alloc_pd());
}

#[test]
fn soft_owner_only_regions_are_never_written() {
    let d = SoftDevice::open().unwrap();
    owner_only_regions_are_never_written(pair(d.alloc_pd(), d.alloc_pd()));
}

#[test]
fn shm_owner_only_regions_are_never_written() {
    owner_only_regions_are_never_written(pair(ShmDevice::open().unwrap().alloc_pd(), ShmDevice::open().unwrap().alloc_pd()));
}

/// A region is either viewed by its owner or lent to devices, never both; a
/// span keeps the memory after the region (and its registration) is gone.
fn spans_outlive_their_region<P: Fabric>(pd: &P) {
    let owned = pd.alloc_mr(64, Access::REMOTE_READ).unwrap();
    assert!(owned.span().is_err(), "a region with views lent to a device");
    let mut lent = pd.alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
    lent.write_at(100, b"still here");
    let span = lent.span().unwrap();
    assert_eq!((span.len(), span.is_host()), (4096, true));
    drop(lent);
    // Other regions take the freed slot meanwhile; the span's memory stays its own.
    let mut other = pd.alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
    other.write_at(100, b"someone el");
    let mut got = [0u8; 10];
    span.copy_out(100, &mut got).unwrap();
    assert_eq!(&got, b"still here");
    assert!(span.copy_out(4090, &mut got).is_err(), "a copy past the end");
}

#[test]
fn soft_spans_outlive_their_region() {
    spans_outlive_their_region(&SoftDevice::open().unwrap().alloc_pd());
}

#[test]
fn shm_spans_outlive_their_region() {
    spans_outlive_their_region(&ShmDevice::open().unwrap().alloc_pd());
}
