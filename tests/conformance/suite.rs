//! The conformance cases. Each takes a factory of protection domains (each call is a
//! fresh "host": its own device) so the same cases run against every provider.

use std::time::Duration;

use eps_fabric::prelude::*;

use super::harness::*;

const RW: Access = Access::ALL;

fn pair<P: ProtectionDomain>(mk: &impl Fn() -> P) -> Pair<P> {
    pair_with(mk(), mk(), &opts(), &opts())
}

pub fn write_then_read<P: ProtectionDomain>(mk: impl Fn() -> P) {
    let p = pair(&mk);
    let data = pattern(10_000, 1);
    let mut src = p.a_pd.alloc_mr(10_000, RW).unwrap();
    src.write_at(0, &data);
    let dst = p.b_pd.alloc_mr(20_000, RW).unwrap();
    p.a.post_send(&sw(1, SendOp::Write(dst.remote(5_000)), &[Sge::whole(&src)])).unwrap();
    let c = wait(&p.a_cq, 1);
    assert_eq!((c[0].wr_id, c[0].status, c[0].opcode, c[0].byte_len), (1, WcStatus::Success, WcOpcode::Write, 10_000));
    assert_eq!(&read_all(&dst)[5_000..15_000], &data[..]);
    assert!(read_all(&dst)[..5_000].iter().all(|&x| x == 0), "bytes before the target range untouched");
    // READ back into two scattered local pieces.
    let back = p.a_pd.alloc_mr(12_000, RW).unwrap();
    let sg = [Sge::new(&back, 0, 4_000), Sge::new(&back, 8_000, 4_000)];
    p.a.post_send(&sw(2, SendOp::Read(dst.remote(7_000)), &sg)).unwrap();
    let c = wait(&p.a_cq, 1);
    assert_eq!((c[0].wr_id, c[0].status, c[0].opcode, c[0].byte_len), (2, WcStatus::Success, WcOpcode::Read, 8_000));
    let b = read_all(&back);
    assert_eq!(&b[..4_000], &data[2_000..6_000]);
    assert_eq!(&b[8_000..], &data[6_000..10_000]);
    expect_none(&p.b_cq, Duration::from_millis(20));
}

/// Receives posted while accepting (`accept_prepared`: before the peer can send)
/// take the SEND the peer posts as soon as it is connected.
pub fn prepared_receives_take_the_first_send<P: ProtectionDomain>(mk: impl Fn() -> P) {
    let (a_pd, b_pd) = (mk(), mk());
    let (a_cq, b_cq) = (a_pd.create_cq(64).unwrap(), b_pd.create_cq(64).unwrap());
    let o = opts();
    let l = b_pd.listen(loopback(), &o).expect("listen");
    let addr = l.local_addr();
    let dst = b_pd.alloc_mr(64, RW).unwrap();
    let mut src = a_pd.alloc_mr(64, RW).unwrap();
    src.write_at(0, &pattern(64, 9));
    let (_a, b) = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let mut prepare = |qp: &P::Qp| qp.post_recv(&RecvWr { wr_id: 11, sg: &[Sge::whole(&dst)] });
            l.accept_prepared(&b_cq, &b_cq, Duration::from_secs(20), &mut prepare).expect("accept")
        });
        let a = a_pd.connect(addr, &a_cq, &a_cq, &o).expect("connect");
        a.post_send(&sw(1, SendOp::Send, &[Sge::whole(&src)])).unwrap();
        (a, h.join().unwrap())
    });
    assert_eq!(wait(&a_cq, 1)[0].status, WcStatus::Success);
    let cb = wait(&b_cq, 1);
    assert_eq!((cb[0].wr_id, cb[0].opcode, cb[0].byte_len), (11, WcOpcode::Recv, 64));
    assert_eq!(cb[0].qp_num, b.qp_num());
    assert_eq!(read_all(&dst), pattern(64, 9));
}

pub fn write_imm_consumes_recv<P: ProtectionDomain>(mk: impl Fn() -> P) {
    let p = pair(&mk);
    let mut src = p.a_pd.alloc_mr(4096, RW).unwrap();
    src.write_at(0, &pattern(4096, 2));
    let dst = p.b_pd.alloc_mr(4096, RW).unwrap();
    p.b.post_recv(&RecvWr { wr_id: 77, sg: &[] }).unwrap();
    p.a.post_send(&sw(3, SendOp::WriteImm(dst.remote(0), 0xDEAD_BEEF), &[Sge::whole(&src)])).unwrap();
    let ca = wait(&p.a_cq, 1);
    assert_eq!((ca[0].status, ca[0].opcode), (WcStatus::Success, WcOpcode::Write));
    let cb = wait(&p.b_cq, 1);
    assert_eq!(cb[0].wr_id, 77);
    assert_eq!(cb[0].opcode, WcOpcode::RecvWithImm);
    assert_eq!(cb[0].imm, Some(0xDEAD_BEEF));
    assert_eq!(cb[0].byte_len, 4096);
    assert_eq!(cb[0].qp_num, p.b.qp_num());
    assert_eq!(read_all(&dst), pattern(4096, 2));
    // Zero-length WRITE_IMM: a pure notification.
    p.b.post_recv(&RecvWr { wr_id: 78, sg: &[] }).unwrap();
    p.a.post_send(&sw(4, SendOp::WriteImm(dst.remote(0), 5), &[])).unwrap();
    wait(&p.a_cq, 1);
    let cb = wait(&p.b_cq, 1);
    assert_eq!((cb[0].wr_id, cb[0].imm, cb[0].byte_len), (78, Some(5), 0));
}

pub fn send_recv_scatter_gather<P: ProtectionDomain>(mk: impl Fn() -> P) {
    let p = pair(&mk);
    let mut s1 = p.a_pd.alloc_mr(100, RW).unwrap();
    let mut s2 = p.a_pd.alloc_mr(1000, RW).unwrap();
    s1.write_at(0, &pattern(100, 3));
    s2.write_at(0, &pattern(1000, 4));
    let r = p.b_pd.alloc_mr(5000, RW).unwrap();
    let rsg = [Sge::new(&r, 0, 50), Sge::new(&r, 1000, 4000)];
    p.b.post_recv(&RecvWr { wr_id: 9, sg: &rsg }).unwrap();
    let ssg = [Sge::new(&s1, 0, 100), Sge::new(&s2, 10, 990), Sge::new(&s1, 0, 1)];
    p.a.post_send(&sw(1, SendOp::Send, &ssg)).unwrap();
    assert_eq!(wait(&p.a_cq, 1)[0].status, WcStatus::Success);
    let c = wait(&p.b_cq, 1);
    assert_eq!((c[0].wr_id, c[0].status, c[0].opcode, c[0].byte_len), (9, WcStatus::Success, WcOpcode::Recv, 1091));
    let mut msg = pattern(100, 3);
    msg.extend_from_slice(&pattern(1000, 4)[10..]);
    msg.push(pattern(1, 3)[0]);
    let got = read_all(&r);
    assert_eq!(&got[..50], &msg[..50]);
    assert_eq!(&got[1000..1000 + 1041], &msg[50..]);
    assert!(got[50..1000].iter().all(|&x| x == 0));
}

pub fn unsignaled_and_ordering<P: ProtectionDomain>(mk: impl Fn() -> P) {
    let p = pair(&mk);
    let mut src = p.a_pd.alloc_mr(8 * 50, RW).unwrap();
    let dst = p.b_pd.alloc_mr(8, RW).unwrap();
    for i in 0..50u64 {
        src.write_at(i as usize * 8, &(i + 1).to_le_bytes());
    }
    // 50 writes to the same 8 bytes, only the last signaled: RC delivers in order, so
    // the last value wins and only one completion appears.
    for i in 0..50u64 {
        let sg = [Sge::new(&src, i * 8, 8)];
        let wr = SendWr { wr_id: i, op: SendOp::Write(dst.remote(0)), sg: &sg, signaled: i == 49 };
        p.a.post_send(&wr).unwrap();
    }
    let c = wait(&p.a_cq, 1);
    assert_eq!(c[0].wr_id, 49);
    expect_none(&p.a_cq, Duration::from_millis(20));
    assert_eq!(read_all(&dst), 50u64.to_le_bytes());
    // SENDs arrive in posting order.
    let r = p.b_pd.alloc_mr(8 * 20, RW).unwrap();
    for i in 0..20u64 {
        let sg = [Sge::new(&r, i * 8, 8)];
        p.b.post_recv(&RecvWr { wr_id: 100 + i, sg: &sg }).unwrap();
    }
    for i in 0..20u64 {
        let sg = [Sge::new(&src, i * 8, 8)];
        p.a.post_send(&SendWr { wr_id: i, op: SendOp::Send, sg: &sg, signaled: false }).unwrap();
    }
    let c = wait(&p.b_cq, 20);
    for (i, c) in c.iter().enumerate() {
        assert_eq!(c.wr_id, 100 + i as u64);
        let mut v = [0u8; 8];
        r.read_at(i * 8, &mut v);
        assert_eq!(u64::from_le_bytes(v), i as u64 + 1);
    }
    // Ten queues' worth of unsignaled requests that all share one wr_id: the
    // provider gets their slots back, so the queue is never full for good, and
    // none is reported.
    let sg = [Sge::new(&src, 0, 8)];
    let wr = SendWr { wr_id: 7, op: SendOp::Write(dst.remote(0)), sg: &sg, signaled: false };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut buf = [Completion::EMPTY; 16];
    for _ in 0..10 * opts().max_send_wr {
        loop {
            match p.a.post_send(&wr) {
                Ok(()) => break,
                Err(FabricError::QueueFull { .. }) => {
                    assert!(std::time::Instant::now() < deadline, "the send queue stayed full");
                    assert_eq!(p.a_cq.poll(&mut buf).unwrap(), 0, "unsignaled successes are not reported");
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
}

pub fn many_qps_one_cq<P: ProtectionDomain>(mk: impl Fn() -> P) {
    let (a_pd, b_pd) = (mk(), mk());
    let a_cq = a_pd.create_cq(1024).unwrap();
    let b_cq = b_pd.create_cq(1024).unwrap();
    let mut qps = Vec::new();
    for _ in 0..8 {
        qps.push(connect(&a_pd, &b_pd, &opts(), &opts(), &a_cq, &b_cq));
    }
    let mut src = a_pd.alloc_mr(8 * 1024, RW).unwrap();
    src.write_at(0, &pattern(8 * 1024, 5));
    let dst = b_pd.alloc_mr(8 * 1024, RW).unwrap();
    for (i, (a, _)) in qps.iter().enumerate() {
        let sg = [Sge::new(&src, i as u64 * 1024, 1024)];
        for k in 0..10 {
            a.post_send(&sw((i * 100 + k) as u64, SendOp::Write(dst.remote(i as u64 * 1024)), &sg)).unwrap();
        }
    }
    let c = wait(&a_cq, 80);
    for (i, (a, _)) in qps.iter().enumerate() {
        let mine: Vec<u64> = c.iter().filter(|c| c.qp_num == a.qp_num()).map(|c| c.wr_id).collect();
        assert_eq!(mine, (0..10).map(|k| (i * 100 + k) as u64).collect::<Vec<_>>(), "per-QP order");
    }
    assert_eq!(read_all(&dst), pattern(8 * 1024, 5));
}

pub fn large_and_tiny<P: ProtectionDomain>(mk: impl Fn() -> P) {
    let p = pair(&mk);
    const BIG: usize = 64 << 20;
    let mut src = p.a_pd.alloc_mr(BIG, RW).unwrap();
    let data = pattern(BIG, 6);
    src.write_at(0, &data);
    let dst = p.b_pd.alloc_mr(BIG, RW).unwrap();
    p.a.post_send(&sw(1, SendOp::Write(dst.remote(0)), &[Sge::whole(&src)])).unwrap();
    assert_eq!(wait(&p.a_cq, 1)[0].status, WcStatus::Success);
    assert!(read_all(&dst) == data, "64 MiB write landed intact");
    let back = p.a_pd.alloc_mr(BIG, RW).unwrap();
    p.a.post_send(&sw(2, SendOp::Read(dst.remote(0)), &[Sge::whole(&back)])).unwrap();
    assert_eq!(wait(&p.a_cq, 1)[0].byte_len, BIG as u32);
    assert!(read_all(&back) == data, "64 MiB read intact");
    // One byte, at the very end of the region.
    let one = p.a_pd.alloc_mr(1, RW).unwrap();
    p.a.post_send(&sw(3, SendOp::Read(dst.remote(BIG as u64 - 1)), &[Sge::whole(&one)])).unwrap();
    assert_eq!(wait(&p.a_cq, 1)[0].byte_len, 1);
    assert_eq!(read_all(&one), [data[BIG - 1]]);
}

/// Posts one bad request and checks: the error status for it, QP in error, flush
/// for the one after it, and the responder's posted RECV flushed.
fn expect_fatal<P: ProtectionDomain>(p: &Pair<P>, wr: &SendWr<'_, P::Mr>, status: WcStatus, src: &P::Mr) {
    let dummy = p.b_pd.alloc_mr(64, RW).unwrap();
    let rsg = [Sge::new(&dummy, 0, 64)];
    p.b.post_recv(&RecvWr { wr_id: 500, sg: &rsg }).unwrap();
    let before = eps_fabric::stats::errors(status);
    p.a.post_send(wr).unwrap();
    let c = wait(&p.a_cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (wr.wr_id, status), "{c:?}");
    assert!(eps_fabric::stats::errors(status) > before, "the error completion is counted for the metrics");
    assert_eq!(p.a.state(), QpState::Error);
    let sg = [Sge::new(src, 0, 1)];
    p.a.post_send(&SendWr { wr_id: 999, op: SendOp::Send, sg: &sg, signaled: false }).unwrap();
    let c = wait(&p.a_cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (999, WcStatus::WrFlush), "posting after an error flushes");
    // The responder's QP goes to the error state too and flushes its RECVs.
    let cb = wait(&p.b_cq, 1);
    assert!(cb.iter().any(|c| c.wr_id == 500 && c.status == WcStatus::WrFlush), "{cb:?}");
}

pub fn remote_access_errors<P: ProtectionDomain>(mk: impl Fn() -> P) {
    // Unknown rkey, out of bounds, missing REMOTE_WRITE, missing REMOTE_READ,
    // deregistered region, region of another PD of the responder.
    for case in 0..6 {
        let p = pair(&mk);
        let src = p.a_pd.alloc_mr(4096, RW).unwrap();
        let ok = p.b_pd.alloc_mr(4096, RW).unwrap();
        let ro = p.b_pd.alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_READ).unwrap();
        let wo = p.b_pd.alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
        let sg = [Sge::whole(&src)];
        let op = match case {
            0 => SendOp::Write(RemoteAddr { addr: ok.addr(), rkey: ok.rkey() ^ 0x5500 }),
            1 => SendOp::Write(ok.remote(1)),
            2 => SendOp::Write(ro.remote(0)),
            3 => SendOp::Read(wo.remote(0)),
            4 => {
                let gone = p.b_pd.alloc_mr(4096, RW).unwrap();
                let r = gone.remote(0);
                drop(gone);
                SendOp::Write(r)
            }
            _ => {
                // A region registered by the responder in a different protection domain.
                let other = mk();
                let foreign = other.alloc_mr(4096, RW).unwrap();
                let r = foreign.remote(0);
                std::mem::forget(foreign); // keep it registered for the duration
                SendOp::Write(r)
            }
        };
        let wr = sw(10 + case, op, &sg);
        expect_fatal(&p, &wr, WcStatus::RemoteAccess, &src);
        // The responder's valid region was never touched.
        assert!(read_all(&ok).iter().all(|&x| x == 0), "case {case}");
    }
}

pub fn local_protection_errors<P: ProtectionDomain>(mk: impl Fn() -> P) {
    for case in 0..3 {
        let p = pair(&mk);
        let src = p.a_pd.alloc_mr(4096, RW).unwrap();
        let no_lw = p.a_pd.alloc_mr(4096, Access::REMOTE_READ).unwrap();
        let other_pd = mk();
        let foreign = other_pd.alloc_mr(4096, RW).unwrap();
        let dst = p.b_pd.alloc_mr(8192, RW).unwrap();
        let sg_oob = [Sge::new(&src, 4000, 200)];
        let sg_nolw = [Sge::whole(&no_lw)];
        let sg_foreign = [Sge::whole(&foreign)];
        let (sg, op) = match case {
            0 => (&sg_oob[..], SendOp::Write(dst.remote(0))),
            1 => (&sg_nolw[..], SendOp::Read(dst.remote(0))),
            _ => (&sg_foreign[..], SendOp::Write(dst.remote(0))),
        };
        p.a.post_send(&sw(1, op, sg)).unwrap();
        let c = wait(&p.a_cq, 1);
        assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::LocalProtection), "case {case}");
        assert_eq!(p.a.state(), QpState::Error);
        assert!(read_all(&dst).iter().all(|&x| x == 0));
    }
}

pub fn invalid_request_errors<P: ProtectionDomain>(mk: impl Fn() -> P) {
    // Larger than the responder accepts.
    let mut small = opts();
    small.max_msg_bytes = 1024;
    let p = pair_with(mk(), mk(), &opts(), &small);
    let src = p.a_pd.alloc_mr(4096, RW).unwrap();
    let dst = p.b_pd.alloc_mr(4096, RW).unwrap();
    let sg = [Sge::whole(&src)];
    let wr = sw(1, SendOp::Write(dst.remote(0)), &sg);
    expect_fatal(&p, &wr, WcStatus::RemoteInvalidRequest, &src);
    assert!(read_all(&dst).iter().all(|&x| x == 0));
    // SEND larger than the posted RECV: requester gets remote invalid request, the
    // responder's RECV completes with a local length error.
    let p = pair(&mk);
    let src = p.a_pd.alloc_mr(4096, RW).unwrap();
    let r = p.b_pd.alloc_mr(100, RW).unwrap();
    p.b.post_recv(&RecvWr { wr_id: 7, sg: &[Sge::whole(&r)] }).unwrap();
    p.a.post_send(&sw(2, SendOp::Send, &[Sge::whole(&src)])).unwrap();
    assert_eq!(wait(&p.a_cq, 1)[0].status, WcStatus::RemoteInvalidRequest);
    let c = wait(&p.b_cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (7, WcStatus::LocalLength));
    // Larger than this side's own limit: local length error, nothing sent.
    let mut tiny = opts();
    tiny.max_msg_bytes = 16;
    let p = pair_with(mk(), mk(), &tiny, &opts());
    let src = p.a_pd.alloc_mr(4096, RW).unwrap();
    let dst = p.b_pd.alloc_mr(4096, RW).unwrap();
    p.a.post_send(&sw(3, SendOp::Write(dst.remote(0)), &[Sge::whole(&src)])).unwrap();
    assert_eq!(wait(&p.a_cq, 1)[0].status, WcStatus::LocalLength);
}

pub fn rnr_waits_then_times_out<P: ProtectionDomain>(mk: impl Fn() -> P) {
    let mut o = opts();
    o.rnr_timeout = Some(Duration::from_millis(300));
    let p = pair_with(mk(), mk(), &o, &o);
    let src = p.a_pd.alloc_mr(64, RW).unwrap();
    let r = p.b_pd.alloc_mr(64, RW).unwrap();
    // A RECV posted late (within the timeout) still receives the SEND.
    p.a.post_send(&sw(1, SendOp::Send, &[Sge::whole(&src)])).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    p.b.post_recv(&RecvWr { wr_id: 5, sg: &[Sge::whole(&r)] }).unwrap();
    assert_eq!(wait(&p.b_cq, 1)[0].status, WcStatus::Success);
    assert_eq!(wait(&p.a_cq, 1)[0].status, WcStatus::Success);
    // No RECV at all: RNR retry exceeded.
    p.a.post_send(&sw(2, SendOp::Send, &[Sge::whole(&src)])).unwrap();
    let c = wait(&p.a_cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (2, WcStatus::RnrRetryExceeded));
}

pub fn queue_full_is_backpressure<P: ProtectionDomain>(mk: impl Fn() -> P) {
    let mut o = opts();
    o.max_send_wr = 4;
    o.max_recv_wr = 2;
    let p = pair_with(mk(), mk(), &o, &o);
    let src = p.a_pd.alloc_mr(1 << 20, RW).unwrap();
    let dst = p.b_pd.alloc_mr(1 << 20, RW).unwrap();
    let sg = [Sge::whole(&src)];
    for i in 0..4 {
        p.a.post_send(&sw(i, SendOp::Write(dst.remote(0)), &sg)).unwrap();
    }
    let e = p.a.post_send(&sw(4, SendOp::Write(dst.remote(0)), &sg)).unwrap_err();
    assert!(matches!(e, FabricError::QueueFull { queue: "send", depth: 4 }), "{e}");
    wait(&p.a_cq, 4);
    p.a.post_send(&sw(5, SendOp::Write(dst.remote(0)), &sg)).unwrap();
    wait(&p.a_cq, 1);
    p.b.post_recv(&RecvWr { wr_id: 1, sg: &[] }).unwrap();
    p.b.post_recv(&RecvWr { wr_id: 2, sg: &[] }).unwrap();
    assert!(matches!(p.b.post_recv(&RecvWr { wr_id: 3, sg: &[] }), Err(FabricError::QueueFull { queue: "receive", .. })));
}

pub fn wrong_secret_is_rejected<P: ProtectionDomain>(mk: impl Fn() -> P) {
    let (a_pd, b_pd) = (mk(), mk());
    let a_cq = a_pd.create_cq(64).unwrap();
    let b_cq = b_pd.create_cq(64).unwrap();
    let l = b_pd.listen(loopback(), &opts()).unwrap();
    let addr = l.local_addr();
    let mut bad = opts();
    bad.secret = Secret::new("not the job secret").unwrap();
    std::thread::scope(|s| {
        let h = s.spawn(|| l.accept(&b_cq, &b_cq, Duration::from_secs(20)));
        let e = a_pd.connect(addr, &a_cq, &a_cq, &bad).unwrap_err();
        assert!(matches!(e, FabricError::AuthFailed { .. }), "{e}");
        assert!(!format!("{e} {e:?} {bad:?}").contains("not the job secret"), "secret never printed");
        // The listener keeps serving: a peer with the right secret gets in.
        let good = a_pd.connect(addr, &a_cq, &a_cq, &opts()).expect("good peer after a bad one");
        let acc = h.join().unwrap().expect("accept");
        let src = a_pd.alloc_mr(8, RW).unwrap();
        let dst = b_pd.alloc_mr(8, RW).unwrap();
        good.post_send(&sw(1, SendOp::Write(dst.remote(0)), &[Sge::whole(&src)])).unwrap();
        assert_eq!(wait(&a_cq, 1)[0].status, WcStatus::Success);
        drop(acc);
    });
}

pub fn peer_vanishes_mid_transfer<P: ProtectionDomain>(mk: impl Fn() -> P) {
    let p = pair(&mk);
    let src = p.a_pd.alloc_mr(16 << 20, RW).unwrap();
    let dst = p.b_pd.alloc_mr(16 << 20, RW).unwrap();
    let sg = [Sge::whole(&src)];
    for i in 0..8 {
        p.a.post_send(&sw(i, SendOp::Write(dst.remote(0)), &sg)).unwrap();
    }
    let Pair { a_cq, a, b, b_pd, .. } = p;
    drop(b);
    drop(dst);
    drop(b_pd);
    // Every request completes: the ones acknowledged before, then an error, then flushes.
    let c = wait(&a_cq, 8);
    let first_err = c.iter().position(|c| !c.status.is_ok()).expect("some request must fail");
    assert!(c[..first_err].iter().all(|c| c.status.is_ok()));
    assert!(matches!(c[first_err].status, WcStatus::RetryExceeded | WcStatus::WrFlush), "{c:?}");
    assert!(c[first_err + 1..].iter().all(|c| c.status == WcStatus::WrFlush), "{c:?}");
    assert_eq!(a.state(), QpState::Error);
}

pub fn teardown_with_ops_in_flight<P: ProtectionDomain>(mk: impl Fn() -> P) {
    for round in 0..3 {
        let p = pair(&mk);
        let src = p.a_pd.alloc_mr(8 << 20, RW).unwrap();
        let dst = p.b_pd.alloc_mr(8 << 20, RW).unwrap();
        let back = p.a_pd.alloc_mr(8 << 20, RW).unwrap();
        for i in 0..16 {
            let (op, mr) = if i % 2 == 0 { (SendOp::Write(dst.remote(0)), &src) } else { (SendOp::Read(dst.remote(0)), &back) };
            p.a.post_send(&sw(i, op, &[Sge::whole(mr)])).unwrap();
        }
        // Drop everything in a different order each round while data is moving.
        match round {
            0 => drop(p),
            1 => {
                drop(src);
                drop(back);
                drop(dst);
                drop(p);
            }
            _ => {
                let Pair { a, b, a_pd, b_pd, a_cq, b_cq } = p;
                drop(b_pd);
                drop(b);
                drop(dst);
                drop(a_cq);
                drop(a);
                drop((a_pd, b_cq, src, back));
            }
        }
    }
}
