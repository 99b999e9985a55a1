//! The soft provider through a userspace TCP proxy that injects faults on a
//! connection that stays up: it hands bytes on in random pieces after random
//! delays, stalls (holds everything) for a while, or cuts both channels. Delays
//! and stalls shorter than the retry timer change nothing: every request
//! completes and moves exactly its bytes. A stall longer than the timer fails
//! the requests with `RetryExceeded`, and a cut fails them with an error, never
//! a hang; the listener goes on serving other peers.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eps_fabric::prelude::*;

const SECRET: &str = "proxy-faults-test-secret";
const REGION: usize = 1 << 20;

fn opts(ack_timeout: Duration) -> QpOptions {
    let mut o = QpOptions::new(Secret::new(SECRET).unwrap());
    o.max_msg_bytes = 1 << 20;
    o.ack_timeout = Some(ack_timeout);
    o
}

/// What the proxy does to the bytes it carries.
#[derive(Default)]
struct Faults {
    /// Hold every byte while set.
    stalled: AtomicBool,
    /// Close every connection (both sides) once set.
    cut: AtomicBool,
    /// Largest delay before a piece is handed on, in microseconds.
    max_delay_us: AtomicU64,
    /// Pieces handed on so far.
    pieces: AtomicU64,
}

/// A TCP proxy in front of `target`, with `faults` applied to both directions
/// of every connection it carries.
struct Proxy {
    addr: SocketAddr,
    faults: Arc<Faults>,
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    fn start(target: SocketAddr, seed: u64) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let faults = Arc::new(Faults::default());
        let open = Arc::new(Mutex::new(Vec::new()));
        let (f, o) = (faults.clone(), open.clone());
        std::thread::spawn(move || {
            for (k, client) in l.incoming().map_while(Result::ok).enumerate() {
                let Ok(server) = TcpStream::connect(target) else { return };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                o.lock().unwrap().extend([client.try_clone().unwrap(), server.try_clone().unwrap()]);
                let s = seed ^ ((k as u64) << 32);
                pump(client.try_clone().unwrap(), server.try_clone().unwrap(), f.clone(), s);
                pump(server, client, f.clone(), s ^ 1);
            }
        });
        Self { addr, faults, open }
    }

    fn cut(&self) {
        self.faults.cut.store(true, Ordering::SeqCst);
        for s in self.open.lock().unwrap().iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Carries `from` to `to` in pieces of random sizes, each after a random delay.
fn pump(mut from: TcpStream, mut to: TcpStream, f: Arc<Faults>, mut seed: u64) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mut at = 0;
            while at < n {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let piece = (1 + (seed >> 33) as usize % 3000).min(n - at);
                let max = f.max_delay_us.load(Ordering::Relaxed);
                if max > 0 {
                    std::thread::sleep(Duration::from_micros((seed >> 20) % max));
                }
                while f.stalled.load(Ordering::Relaxed) && !f.cut.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                if f.cut.load(Ordering::Relaxed) || to.write_all(&buf[at..at + piece]).is_err() {
                    let _ = (from.shutdown(Shutdown::Both), to.shutdown(Shutdown::Both));
                    return;
                }
                f.pieces.fetch_add(1, Ordering::Relaxed);
                at += piece;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}

/// A listener with a region, and a dialer connected to it through a proxy.
struct Pair {
    pd: SoftPd,
    cq: SoftCq,
    listener: SoftListener,
    target_mr: SoftMr,
    qp: SoftQp,
    proxy: Proxy,
    _accepted: SoftQp,
    _accepted_cq: SoftCq,
}

fn pair(ack_timeout: Duration, seed: u64) -> Pair {
    let pd = SoftDevice::open().unwrap().alloc_pd();
    let cq = pd.create_cq(1024).unwrap();
    let o = opts(ack_timeout);
    let listener = pd.listen("127.0.0.1:0".parse().unwrap(), &o).unwrap();
    let target_mr = pd.alloc_mr(REGION, Access::ALL).unwrap();
    let proxy = Proxy::start(listener.local_addr(), seed);
    let tcq = pd.create_cq(1024).unwrap();
    let (accepted, qp) = dial(&pd, &listener, &tcq, proxy.addr, &cq, &o);
    Pair { pd, cq, listener, target_mr, qp, proxy, _accepted: accepted, _accepted_cq: tcq }
}

/// Dials `addr` (the listener, or a proxy in front of it) while `listener`
/// accepts onto `tcq`: (the accepted QP, the dialer's QP).
fn dial(pd: &SoftPd, listener: &SoftListener, tcq: &SoftCq, addr: SocketAddr, cq: &SoftCq, o: &QpOptions) -> (SoftQp, SoftQp) {
    std::thread::scope(|s| {
        let h = s.spawn(|| listener.accept(tcq, tcq, Duration::from_secs(10)).unwrap());
        let qp = pd.connect(addr, cq, cq, o).unwrap();
        (h.join().unwrap(), qp)
    })
}

/// Waits for `n` completions (at most `limit`), returning their ids and statuses.
fn completions(cq: &SoftCq, n: usize, limit: Duration) -> Vec<(u64, WcStatus)> {
    let start = Instant::now();
    let mut wc = [Completion::EMPTY; 64];
    let mut got = Vec::new();
    while got.len() < n {
        assert!(start.elapsed() < limit, "{} of {n} completions after {limit:?}: requests wait forever", got.len());
        let k = cq.poll(&mut wc).unwrap();
        got.extend(wc[..k].iter().map(|c| (c.wr_id, c.status)));
        if k == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    got
}

fn fill(seed: u64, out: &mut [u8]) {
    let mut x = seed | 1;
    for b in out {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

#[test]
fn delays_and_short_stalls_change_nothing() {
    let p = pair(Duration::from_secs(5), 7);
    p.proxy.faults.max_delay_us.store(300, Ordering::Relaxed);
    let mut src = p.pd.alloc_mr(REGION, Access::ALL).unwrap();
    let back = p.pd.alloc_mr(REGION, Access::ALL).unwrap();
    let mut data = vec![0u8; REGION];
    fill(42, &mut data);
    src.write_at(0, &data);
    // Writes of every size from a few bytes to 64 KiB at scattered offsets,
    // then reads of the same ranges back; stalls of 50-200 ms come and go.
    let mut ranges = Vec::new();
    let (mut off, mut len) = (0usize, 3usize);
    while off + len <= REGION {
        ranges.push((off, len));
        off += len + 17;
        len = (len * 5 / 3 + 1) % (64 << 10) + 1;
    }
    let faults = p.proxy.faults.clone();
    let staller = std::thread::spawn(move || {
        for k in 0..6u64 {
            std::thread::sleep(Duration::from_millis(40 + 13 * k));
            faults.stalled.store(true, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(50 + 30 * k));
            faults.stalled.store(false, Ordering::Relaxed);
        }
    });
    // Writes from `src`, then reads into `back`, 32 in flight at a time.
    for (local, read) in [(&src, false), (&back, true)] {
        for chunk in ranges.chunks(32) {
            for (i, &(o, l)) in chunk.iter().enumerate() {
                let sg = [Sge::new(local, o as u64, l as u32)];
                let remote = p.target_mr.remote(o as u64);
                let op = if read { SendOp::Read(remote) } else { SendOp::Write(remote) };
                p.qp.post_send(&SendWr { wr_id: i as u64, op, sg: &sg, signaled: true }).unwrap();
            }
            let got = completions(&p.cq, chunk.len(), Duration::from_secs(30));
            assert!(got.iter().all(|(_, s)| *s == WcStatus::Success), "{got:?}");
        }
    }
    staller.join().unwrap();
    let (mut at_target, mut read_back) = (vec![0u8; REGION], vec![0u8; REGION]);
    p.target_mr.read_at(0, &mut at_target);
    back.read_at(0, &mut read_back);
    for &(o, l) in &ranges {
        assert!(at_target[o..o + l] == data[o..o + l], "write at {o} ({l} bytes) differs at the target");
        assert!(read_back[o..o + l] == data[o..o + l], "read at {o} ({l} bytes) differs");
    }
    assert!(p.proxy.faults.pieces.load(Ordering::Relaxed) > ranges.len() as u64, "the proxy did not split the traffic");
}

#[test]
fn a_stall_past_the_retry_timer_fails_the_requests() {
    let p = pair(Duration::from_millis(300), 9);
    let src = p.pd.alloc_mr(4096, Access::ALL).unwrap();
    p.proxy.faults.stalled.store(true, Ordering::Relaxed);
    let start = Instant::now();
    for i in 0..4 {
        let sg = [Sge::whole(&src)];
        p.qp.post_send(&SendWr { wr_id: i, op: SendOp::Write(p.target_mr.remote(0)), sg: &sg, signaled: true }).unwrap();
    }
    let got = completions(&p.cq, 4, Duration::from_secs(10));
    assert!(start.elapsed() >= Duration::from_millis(300), "failed before the timer ran out");
    assert_eq!(got[0], (0, WcStatus::RetryExceeded), "{got:?}");
    assert!(got[1..].iter().all(|(_, s)| *s != WcStatus::Success), "{got:?}");
    p.proxy.faults.stalled.store(false, Ordering::Relaxed);
}

#[test]
fn a_cut_fails_the_requests_in_flight_and_others_are_still_served() {
    let p = pair(Duration::from_secs(5), 11);
    p.proxy.faults.max_delay_us.store(2000, Ordering::Relaxed);
    let src = p.pd.alloc_mr(64 << 10, Access::ALL).unwrap();
    for i in 0..16 {
        let sg = [Sge::whole(&src)];
        p.qp.post_send(&SendWr { wr_id: i, op: SendOp::Write(p.target_mr.remote(0)), sg: &sg, signaled: true }).unwrap();
    }
    std::thread::sleep(Duration::from_millis(5));
    p.proxy.cut();
    let start = Instant::now();
    let got = completions(&p.cq, 16, Duration::from_secs(10));
    assert!(start.elapsed() < Duration::from_secs(4), "the cut was noticed only after {:?}", start.elapsed());
    assert!(got.iter().any(|(_, s)| *s != WcStatus::Success), "every request succeeded across a cut: {got:?}");
    // In order: once one failed, none after it succeeded.
    let first_bad = got.iter().position(|(_, s)| *s != WcStatus::Success).unwrap();
    assert!(got[first_bad..].iter().all(|(_, s)| *s != WcStatus::Success), "{got:?}");
    // The listener still serves a peer that dials it directly.
    let cq = p.pd.create_cq(16).unwrap();
    let o = opts(Duration::from_secs(5));
    let tcq = p.pd.create_cq(16).unwrap();
    let (_theirs, qp) = dial(&p.pd, &p.listener, &tcq, p.listener.local_addr(), &cq, &o);
    let sg = [Sge::new(&src, 0, 8)];
    qp.post_send(&SendWr { wr_id: 99, op: SendOp::Write(p.target_mr.remote(100)), sg: &sg, signaled: true }).unwrap();
    assert_eq!(completions(&cq, 1, Duration::from_secs(10)), vec![(99, WcStatus::Success)]);
}
