//! The soft provider facing broken or hostile peers that speak raw bytes: the target
//! never writes outside a registered region, never panics, and keeps serving others.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use eps_fabric::auth;
use eps_fabric::prelude::*;
use eps_fabric::wire::*;

const SECRET: &str = "hostile-test-secret";

fn opts() -> QpOptions {
    let mut o = QpOptions::new(Secret::new(SECRET).unwrap());
    o.max_msg_bytes = 1 << 20;
    o
}

/// Performs the dialer's side of the handshake by hand for one channel.
fn raw_channel(addr: SocketAddr, channel: u8, token: u64) -> (TcpStream, AcceptFrame) {
    let secret = Secret::new(SECRET).unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let nonce = auth::nonce().unwrap();
    s.write_all(&ClientHello { channel, token, nonce, max_msg_bytes: 1 << 20 }.encode()).unwrap();
    let mut b = [0u8; SERVER_HELLO_LEN];
    s.read_exact(&mut b).unwrap();
    let sh = ServerHello::decode(&b).unwrap();
    assert!(auth::proofs_equal(&sh.proof, &auth::listener_proof(&secret, &nonce, &sh.nonce, token, channel)));
    s.write_all(&encode_client_auth(&auth::dialer_proof(&secret, &nonce, &sh.nonce, token, channel))).unwrap();
    let mut a = [0u8; ACCEPT_LEN];
    s.read_exact(&mut a).unwrap();
    let acc = AcceptFrame::decode(&a).unwrap();
    assert_eq!(acc.status, 0);
    (s, acc)
}

/// An authenticated raw peer: `req` carries our requests, `resp` the listener's.
fn raw_dial(addr: SocketAddr) -> (TcpStream, TcpStream) {
    let (req, acc) = raw_channel(addr, 0, 0);
    let (resp, _) = raw_channel(addr, 1, acc.token);
    (req, resp)
}

struct Target {
    pd: SoftPd,
    cq: SoftCq,
    listener: SoftListener,
    mr: SoftMr,
    guard: SoftMr,
}

fn target() -> Target {
    let pd = SoftDevice::open().unwrap().alloc_pd();
    let cq = pd.create_cq(256).unwrap();
    let listener = pd.listen("127.0.0.1:0".parse().unwrap(), &opts()).unwrap();
    let mr = pd.alloc_mr(4096, Access::ALL).unwrap();
    let guard = pd.alloc_mr(4096, Access::ALL).unwrap();
    Target { pd, cq, listener, mr, guard }
}

/// Accepts on a thread while `f` dials.
fn accept_while<T: Send>(t: &Target, f: impl FnOnce() -> T + Send) -> (SoftQp, T) {
    std::thread::scope(|s| {
        let h = s.spawn(|| t.listener.accept(&t.cq, &t.cq, Duration::from_secs(10)).unwrap());
        let r = f();
        (h.join().unwrap(), r)
    })
}

/// A well-behaved peer still gets full service: write 8 bytes and read them back.
fn check_still_serving(t: &Target) {
    let pd = SoftDevice::open().unwrap().alloc_pd();
    let cq = pd.create_cq(64).unwrap();
    let addr = t.listener.local_addr();
    let (_theirs, qp) = accept_while(t, || pd.connect(addr, &cq, &cq, &opts()).unwrap());
    let mut src = pd.alloc_mr(8, Access::ALL).unwrap();
    src.write_at(0, b"healthy!");
    let sg = [Sge::whole(&src)];
    qp.post_send(&SendWr { wr_id: 1, op: SendOp::Write(t.mr.remote(100)), sg: &sg, signaled: true }).unwrap();
    let mut wc = [Completion::EMPTY; 4];
    let end = Instant::now() + Duration::from_secs(10);
    while cq.poll(&mut wc).unwrap() == 0 {
        assert!(Instant::now() < end, "no completion from a healthy peer");
    }
    assert_eq!(wc[0].status, WcStatus::Success);
    let mut got = [0u8; 8];
    t.mr.read_at(100, &mut got);
    assert_eq!(&got, b"healthy!");
}

fn guard_untouched(t: &Target) {
    let mut g = vec![0u8; 4096];
    t.guard.read_at(0, &mut g);
    assert!(g.iter().all(|&x| x == 0), "a region nobody wrote to changed");
}

/// Reads one response from the listener's responder channel, or None if it closed.
fn read_response(s: &mut TcpStream) -> Option<Response> {
    let mut b = [0u8; RESP_LEN];
    s.read_exact(&mut b).ok()?;
    Some(Response::decode(&b).expect("the target sends well-formed responses"))
}

#[test]
fn garbage_before_the_handshake_is_dropped() {
    let t = target();
    let addr = t.listener.local_addr();
    let (_qp, ()) = accept_while(&t, || {
        for junk in [&b"GET / HTTP/1.1\r\n\r\n"[..], &[0xFFu8; 100][..], &[][..]] {
            let mut s = TcpStream::connect(addr).unwrap();
            let _ = s.write_all(junk);
            drop(s);
        }
        // A hello with the right shape but a wrong proof.
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(&ClientHello { channel: 0, token: 0, nonce: [1; 16], max_msg_bytes: 64 }.encode()).unwrap();
        let mut b = [0u8; SERVER_HELLO_LEN];
        s.read_exact(&mut b).unwrap();
        s.write_all(&encode_client_auth(&[0u8; 32])).unwrap();
        let mut a = [0u8; ACCEPT_LEN];
        s.read_exact(&mut a).unwrap();
        assert_eq!(AcceptFrame::decode(&a).unwrap().status, 1, "wrong proof rejected");
        // A second channel naming a token that was never issued.
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let secret = Secret::new(SECRET).unwrap();
        let nonce = [2; 16];
        s.write_all(&ClientHello { channel: 1, token: 12345, nonce, max_msg_bytes: 64 }.encode()).unwrap();
        s.read_exact(&mut b).unwrap();
        let sh = ServerHello::decode(&b).unwrap();
        s.write_all(&encode_client_auth(&auth::dialer_proof(&secret, &nonce, &sh.nonce, 12345, 1))).unwrap();
        s.read_exact(&mut a).unwrap();
        assert_eq!(AcceptFrame::decode(&a).unwrap().status, 2, "unknown token rejected");
        // Finally a real peer, so accept returns.
        let (req, resp) = raw_dial(addr);
        drop((req, resp));
    });
    guard_untouched(&t);
}

#[test]
fn garbage_frames_close_only_that_connection() {
    let t = target();
    let addr = t.listener.local_addr();
    for junk in [vec![0u8; REQ_LEN], vec![0xE5; REQ_LEN], vec![0xAB; 4096]] {
        let (qp, (mut req, _resp)) = accept_while(&t, || raw_dial(addr));
        req.write_all(&junk).unwrap();
        // The target closes the connection: we read EOF (or reset), never a response.
        req.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 1];
        assert!(matches!(req.read(&mut b), Ok(0) | Err(_)), "connection closed after garbage");
        let end = Instant::now() + Duration::from_secs(10);
        while qp.state() != QpState::Error {
            assert!(Instant::now() < end, "QP not moved to error");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    guard_untouched(&t);
    check_still_serving(&t);
}

#[test]
fn out_of_bounds_and_oversized_requests_get_errors() {
    let t = target();
    let addr = t.listener.local_addr();
    let mr = t.mr.remote(0);
    let cases: Vec<(Request, WcStatus)> = vec![
        // Offset past the end; length that wraps the address space; unknown key.
        (Request { op: WireOp::Write, seq: 1, len: 16, rkey: mr.rkey, addr: mr.addr + 4090, imm: 0 }, WcStatus::RemoteAccess),
        (Request { op: WireOp::Read, seq: 1, len: 16, rkey: mr.rkey, addr: u64::MAX - 4, imm: 0 }, WcStatus::RemoteAccess),
        (Request { op: WireOp::Write, seq: 1, len: 16, rkey: 0xFFFF_FF01, addr: mr.addr, imm: 0 }, WcStatus::RemoteAccess),
        (Request { op: WireOp::Read, seq: 1, len: 16, rkey: mr.rkey, addr: mr.addr - 1, imm: 0 }, WcStatus::RemoteAccess),
        // Larger than the listener's message limit.
        (
            Request { op: WireOp::Write, seq: 1, len: u32::MAX, rkey: mr.rkey, addr: mr.addr, imm: 0 },
            WcStatus::RemoteInvalidRequest,
        ),
    ];
    for (req, want) in cases {
        let (_qp, (mut rq, resp)) = accept_while(&t, || raw_dial(addr));
        let _ = resp; // the listener's requests would arrive here; it sends none
        rq.write_all(&req.encode()).unwrap();
        if req.op == WireOp::Write && req.len < 1 << 20 {
            let _ = rq.write_all(&vec![0x77; req.len as usize]);
        }
        let r = read_response(&mut rq).expect("an error response before the close");
        assert_eq!((r.status, r.seq), (want, 1), "{req:?}");
        assert_eq!(read_response(&mut rq), None, "then the connection closes");
    }
    let mut all = vec![0u8; 4096];
    t.mr.read_at(0, &mut all);
    assert!(all.iter().all(|&x| x == 0), "rejected writes wrote nothing");
    guard_untouched(&t);
    check_still_serving(&t);
}

#[test]
fn peer_disconnecting_mid_payload_writes_only_inside_the_region() {
    let t = target();
    let addr = t.listener.local_addr();
    let mr = t.mr.remote(0);
    let (qp, (mut rq, _resp)) = accept_while(&t, || raw_dial(addr));
    rq.write_all(&Request { op: WireOp::Write, seq: 1, len: 4096, rkey: mr.rkey, addr: mr.addr, imm: 0 }.encode()).unwrap();
    rq.write_all(&[0x42; 1000]).unwrap();
    drop(rq);
    let end = Instant::now() + Duration::from_secs(10);
    while qp.state() != QpState::Error {
        assert!(Instant::now() < end, "QP not moved to error after the peer vanished");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut all = vec![0u8; 4096];
    t.mr.read_at(0, &mut all);
    assert!(all[..1000].iter().all(|&x| x == 0x42), "what arrived landed in place");
    assert!(all[1000..].iter().all(|&x| x == 0), "nothing beyond what arrived");
    guard_untouched(&t);
    check_still_serving(&t);
    drop(t.pd);
}

#[test]
fn a_peer_that_stops_answering_fails_requests_when_the_retry_timer_runs_out() {
    let t = target();
    let cq = t.pd.create_cq(16).unwrap();
    let mut o = opts();
    o.ack_timeout = Some(Duration::from_millis(300));
    let listener = t.pd.listen("127.0.0.1:0".parse().unwrap(), &o).unwrap();
    let addr = listener.local_addr();
    // The accepted QP's requests go to a raw peer that takes them and never
    // answers, as a process stopped with SIGSTOP would (its kernel still takes
    // the bytes).
    let (qp, raw) = std::thread::scope(|s| {
        let h = s.spawn(|| listener.accept(&cq, &cq, Duration::from_secs(10)).unwrap());
        let raw = raw_dial(addr);
        (h.join().unwrap(), raw)
    });
    let sg = [Sge::whole(&t.mr)];
    let start = Instant::now();
    qp.post_send(&SendWr { wr_id: 7, op: SendOp::Write(eps_fabric::RemoteAddr { addr: 0, rkey: 1 }), sg: &sg, signaled: true })
        .unwrap();
    qp.post_send(&SendWr { wr_id: 8, op: SendOp::Write(eps_fabric::RemoteAddr { addr: 0, rkey: 1 }), sg: &sg, signaled: true })
        .unwrap();
    let mut wc = [Completion::EMPTY; 4];
    let mut got = Vec::new();
    while got.len() < 2 {
        assert!(start.elapsed() < Duration::from_secs(10), "the requests wait forever");
        let n = cq.poll(&mut wc).unwrap();
        got.extend(wc[..n].iter().map(|c| (c.wr_id, c.status)));
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(start.elapsed() >= Duration::from_millis(300), "failed before the timer ran out");
    assert_eq!(got, vec![(7, WcStatus::RetryExceeded), (8, WcStatus::WrFlush)]);
    drop(raw);
}

#[test]
fn a_silent_dialer_does_not_hold_up_the_accept_of_others() {
    let t = target();
    let addr = t.listener.local_addr();
    // Connected, never a byte: its handshake waits on a thread of its own.
    let _silent = TcpStream::connect(addr).unwrap();
    let start = Instant::now();
    check_still_serving(&t);
    assert!(start.elapsed() < Duration::from_secs(3), "accept waited {:?} behind a silent peer", start.elapsed());
}
