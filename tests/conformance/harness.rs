//! Provider-independent helpers of the conformance suite.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use eps_fabric::prelude::*;

/// Two connected QPs: `a` dials `b`. Each side has its own PD and one CQ.
pub struct Pair<P: ProtectionDomain> {
    pub a_pd: P,
    pub b_pd: P,
    pub a_cq: P::Cq,
    pub b_cq: P::Cq,
    pub a: P::Qp,
    pub b: P::Qp,
}

pub fn opts() -> QpOptions {
    let mut o = QpOptions::new(Secret::new("conformance-secret").unwrap());
    o.max_sge = 4;
    o.max_send_wr = 64;
    o.max_recv_wr = 64;
    o
}

/// Where listeners bind: 127.0.0.1, or `EPS_CONFORMANCE_ADDR` (an RDMA device's
/// address when the rdma provider runs the suite).
pub fn loopback() -> SocketAddr {
    std::env::var("EPS_CONFORMANCE_ADDR").ok().and_then(|a| a.parse().ok()).unwrap_or_else(|| "127.0.0.1:0".parse().unwrap())
}

/// Connects `a_pd` (dialer) to `b_pd` (listener).
pub fn connect<P: ProtectionDomain>(
    a_pd: &P,
    b_pd: &P,
    a_opts: &QpOptions,
    b_opts: &QpOptions,
    a_cq: &P::Cq,
    b_cq: &P::Cq,
) -> (P::Qp, P::Qp) {
    let l = b_pd.listen(loopback(), b_opts).expect("listen");
    let addr = l.local_addr();
    std::thread::scope(|s| {
        let h = s.spawn(|| l.accept(b_cq, b_cq, Duration::from_secs(20)).expect("accept"));
        let a = a_pd.connect(addr, a_cq, a_cq, a_opts).expect("connect");
        (a, h.join().unwrap())
    })
}

pub fn pair_with<P: ProtectionDomain>(a_pd: P, b_pd: P, a_opts: &QpOptions, b_opts: &QpOptions) -> Pair<P> {
    let a_cq = a_pd.create_cq(4096).unwrap();
    let b_cq = b_pd.create_cq(4096).unwrap();
    let (a, b) = connect(&a_pd, &b_pd, a_opts, b_opts, &a_cq, &b_cq);
    Pair { a_pd, b_pd, a_cq, b_cq, a, b }
}

/// Polls until `n` completions arrived; panics after 20 s with what it has.
pub fn wait<C: CompletionQueue>(cq: &C, n: usize) -> Vec<Completion> {
    let mut got = Vec::new();
    let mut buf = [Completion::EMPTY; 32];
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.len() < n {
        let k = cq.poll(&mut buf).expect("poll");
        got.extend_from_slice(&buf[..k]);
        if k == 0 {
            assert!(Instant::now() < deadline, "timed out waiting for {n} completions, got {got:?}");
            std::thread::yield_now();
        }
    }
    got
}

/// Polls for `d` and asserts that nothing arrives.
pub fn expect_none<C: CompletionQueue>(cq: &C, d: Duration) {
    let mut buf = [Completion::EMPTY; 8];
    let end = Instant::now() + d;
    while Instant::now() < end {
        let k = cq.poll(&mut buf).expect("poll");
        assert_eq!(k, 0, "unexpected completion {:?}", &buf[..k]);
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Deterministic test bytes.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed).collect()
}

pub fn read_all<M: MemoryRegion>(mr: &M) -> Vec<u8> {
    let mut v = vec![0u8; mr.len()];
    mr.read_at(0, &mut v);
    v
}

pub fn sw<'a, M>(wr_id: u64, op: SendOp, sg: &'a [Sge<'a, M>]) -> SendWr<'a, M> {
    SendWr { wr_id, op, sg, signaled: true }
}
