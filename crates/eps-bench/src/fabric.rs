//! `eps bench fabric`: perftest-style bandwidth and latency of one fabric operation
//! between this process and a peer process it starts on this machine: over the
//! `soft` provider on 127.0.0.1, the `shm` provider (named by 127.0.0.1), or the
//! `rdma` provider at the selected RDMA device's address (the code is generic over
//! the provider). On shm the limit is a single thread's memcpy, which
//! [`memcpy_gbytes_per_s`] measures.
//!
//! Latency is the full operation latency: from posting one signaled operation to its
//! completion at the initiator. For a WRITE that includes the target's
//! acknowledgement, so it is a round trip; it is not halved.

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use eps_fabric::prelude::*;
use hdrhistogram::Histogram;

/// Environment variable that carries the job secret to the peer process.
pub const SECRET_ENV: &str = "EPS_JOB_SECRET";
const READY: &str = "EPS_PEER_READY";

/// Which operation is measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// RDMA WRITE into the peer's registered memory.
    Write,
    /// RDMA READ from the peer's registered memory.
    Read,
    /// SEND into a RECV the peer has posted.
    Send,
}

impl Op {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::Read => "read",
            Op::Send => "send",
        }
    }
}

/// What went wrong in a benchmark.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A fabric call failed.
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// A work request completed with an error.
    #[error("{op} #{wr_id} completed with status: {status}")]
    Completion {
        /// The operation.
        op: &'static str,
        /// Its id.
        wr_id: u64,
        /// The status.
        status: WcStatus,
    },
    /// The peer process could not be started or did not come up.
    #[error("benchmark peer process: {what}")]
    Peer {
        /// What failed.
        what: &'static str,
        /// The OS error, if any.
        #[source]
        source: Option<std::io::Error>,
    },
    /// The configuration cannot be run.
    #[error("invalid benchmark configuration: {0}")]
    Config(&'static str),
    /// The transport cannot be used.
    #[error("{0}")]
    Transport(String),
}

/// Parameters of one run.
#[derive(Clone, Debug)]
pub struct FabricBench {
    /// The operation.
    pub op: Op,
    /// Bytes per operation.
    pub size: u64,
    /// Measured operations (after a warm-up).
    pub iters: u64,
    /// Operations in flight.
    pub depth: u32,
}

/// What one run measured.
#[derive(Clone, Debug)]
pub struct FabricReport {
    /// Parameters.
    pub cfg: FabricBench,
    /// Payload bytes per second over the measured phase, in GB/s (1e9 B/s).
    pub bw_gbytes_per_s: f64,
    /// Operation latency percentiles, microseconds.
    pub lat_us_p50: f64,
    /// 99th percentile.
    pub lat_us_p99: f64,
    /// Maximum.
    pub lat_us_max: f64,
    /// Measured phase duration.
    pub elapsed: Duration,
}

impl FabricBench {
    fn validate(&self) -> Result<u32, BenchError> {
        if self.size == 0 {
            return Err(BenchError::Config("--size must be at least 1 byte"));
        }
        if self.size > (1 << 30) {
            return Err(BenchError::Config("--size is at most 1GiB (the fabric's message limit)"));
        }
        if self.iters == 0 {
            return Err(BenchError::Config("--iters must be at least 1"));
        }
        if self.depth == 0 || self.depth > 1024 {
            return Err(BenchError::Config("--depth must be between 1 and 1024"));
        }
        Ok(self.size as u32)
    }

    fn opts(&self, secret: Secret) -> QpOptions {
        let mut o = QpOptions::new(secret);
        o.max_send_wr = self.depth + 1;
        o.max_recv_wr = self.depth * 2 + 2;
        o.max_sge = 1;
        o.max_msg_bytes = (self.size as u32).max(4096);
        o
    }
}

fn random_secret() -> Result<String, BenchError> {
    let n = eps_fabric::auth::nonce().map_err(|e| BenchError::Peer { what: "cannot read random bytes", source: Some(e) })?;
    Ok(n.iter().map(|b| format!("{b:02x}")).collect())
}

struct PeerProcess {
    child: Child,
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        // The peer exits by itself when the QP closes; give it a moment, then make sure.
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the peer process and returns it with its address and region.
fn start_peer(
    cfg: &FabricBench,
    secret: &str,
    transport: &str,
    peer_args: &[String],
) -> Result<(PeerProcess, SocketAddr, RemoteAddr), BenchError> {
    let exe =
        std::env::current_exe().map_err(|e| BenchError::Peer { what: "cannot find the eps executable", source: Some(e) })?;
    let mut child = Command::new(exe)
        .args(["bench", "fabric-peer", "--op", cfg.op.name(), "--size", &cfg.size.to_string(), "--depth", &cfg.depth.to_string()])
        .args(["--transport", transport])
        .args(peer_args)
        .env(SECRET_ENV, secret)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| BenchError::Peer { what: "cannot spawn", source: Some(e) })?;
    let out = child.stdout.take().ok_or(BenchError::Peer { what: "no stdout", source: None })?;
    let peer = PeerProcess { child };
    let mut line = String::new();
    BufReader::new(out)
        .read_line(&mut line)
        .map_err(|e| BenchError::Peer { what: "cannot read its ready line", source: Some(e) })?;
    let bad = || BenchError::Peer { what: "it exited or printed no ready line (see its message above)", source: None };
    let mut f = line.split_whitespace();
    if f.next() != Some(READY) {
        return Err(bad());
    }
    let at: SocketAddr = f.next().and_then(|x| x.parse().ok()).ok_or_else(bad)?;
    let addr: u64 = f.next().and_then(|x| x.parse().ok()).ok_or_else(bad)?;
    let rkey: u32 = f.next().and_then(|x| x.parse().ok()).ok_or_else(bad)?;
    Ok((peer, at, RemoteAddr { addr, rkey }))
}

/// The peer side on `pd` (listening on `ip`): registers a region, accepts
/// one QP, serves until it closes. The command line chooses the transport.
pub fn peer_on<P: ProtectionDomain>(pd: P, ip: IpAddr, op: Op, size: u64, depth: u32) -> Result<(), BenchError> {
    let cfg = FabricBench { op, size, iters: 1, depth };
    let len = cfg.validate()?;
    let secret = std::env::var(SECRET_ENV).map_err(|_| BenchError::Config("the peer needs EPS_JOB_SECRET in its environment"))?;
    let mr = pd.alloc_mr(len as usize, Access::ALL)?;
    let cq = pd.create_cq(depth * 4 + 16)?;
    let l = pd.listen(SocketAddr::new(ip, 0), &cfg.opts(Secret::new(secret)?))?;
    println!("{READY} {} {} {}", l.local_addr(), mr.addr(), mr.rkey());
    let qp = l.accept(&cq, &cq, Duration::from_secs(30))?;
    let sg = [Sge::whole(&mr)];
    if op == Op::Send {
        for i in 0..depth as u64 * 2 + 2 {
            qp.post_recv(&RecvWr { wr_id: i, sg: &sg })?;
        }
    }
    let mut wc = [Completion::EMPTY; 64];
    loop {
        let n = cq.poll(&mut wc)?;
        for c in &wc[..n] {
            if c.status.is_ok() && op == Op::Send {
                qp.post_recv(&RecvWr { wr_id: c.wr_id, sg: &sg })?;
            }
        }
        if qp.state() == QpState::Error {
            return Ok(());
        }
        if n == 0 {
            if op == Op::Send {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

/// Runs the benchmark over the `soft` provider against a fresh peer process.
pub fn run(cfg: &FabricBench) -> Result<FabricReport, BenchError> {
    run_on(SoftDevice::open()?.alloc_pd(), cfg, "soft", &[])
}

/// Runs the benchmark over the `shm` provider against a fresh peer process.
pub fn run_shm(cfg: &FabricBench) -> Result<FabricReport, BenchError> {
    run_on(eps_fabric::shm::ShmDevice::open()?.alloc_pd(), cfg, "shm", &[])
}

/// One thread copying `size` bytes from one buffer to another, the median of
/// `reps` timed copies after a warm-up (both buffers touched first): the limit
/// of a transport that moves each payload once with the CPU.
pub fn memcpy_gbytes_per_s(size: u64, reps: usize) -> Result<f64, BenchError> {
    let src = eps_fabric::RegionBuf::from_slice(&vec![7u8; size as usize])?;
    let mut dst = eps_fabric::RegionBuf::from_slice(&vec![1u8; size as usize])?;
    let mut times: Vec<f64> = (0..reps.max(1) + 2)
        .map(|_| {
            let t = Instant::now();
            dst.as_mut_slice().copy_from_slice(std::hint::black_box(src.as_slice()));
            std::hint::black_box(dst.as_slice());
            t.elapsed().as_secs_f64()
        })
        .skip(2)
        .collect();
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(size as f64 / times[times.len() / 2] / 1e9)
}

/// Runs the benchmark on `pd` over `transport` against a fresh peer process
/// started with `peer_args` (the flags that choose the same device), e.g. the
/// `rdma` provider's selected device.
pub fn run_on<P: ProtectionDomain>(
    pd: P,
    cfg: &FabricBench,
    transport: &str,
    peer_args: &[String],
) -> Result<FabricReport, BenchError> {
    let len = cfg.validate()?;
    let secret = random_secret()?;
    let (_peer, addr, remote) = start_peer(cfg, &secret, transport, peer_args)?;
    let mr = pd.alloc_mr(len as usize, Access::ALL)?;
    let cq = pd.create_cq(cfg.depth * 2 + 16)?;
    let qp = pd.connect(addr, &cq, &cq, &cfg.opts(Secret::new(secret)?))?;
    let op = match cfg.op {
        Op::Write => SendOp::Write(remote),
        Op::Read => SendOp::Read(remote),
        Op::Send => SendOp::Send,
    };
    let sg = [Sge::whole(&mr)];
    let warmup = (cfg.iters / 10).clamp(1, 1000);
    drive::<P>(&qp, &cq, op, &sg, cfg, warmup, None)?;
    let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("valid histogram bounds");
    let start = Instant::now();
    drive::<P>(&qp, &cq, op, &sg, cfg, cfg.iters, Some(&mut hist))?;
    let elapsed = start.elapsed();
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1e3;
    Ok(FabricReport {
        cfg: cfg.clone(),
        bw_gbytes_per_s: (cfg.size * cfg.iters) as f64 / elapsed.as_secs_f64() / 1e9,
        lat_us_p50: us(0.5),
        lat_us_p99: us(0.99),
        lat_us_max: hist.max() as f64 / 1e3,
        elapsed,
    })
}

/// Keeps `cfg.depth` operations in flight until `iters` have completed, recording
/// each one's post-to-completion latency.
fn drive<P: ProtectionDomain>(
    qp: &P::Qp,
    cq: &P::Cq,
    op: SendOp,
    sg: &[Sge<'_, P::Mr>],
    cfg: &FabricBench,
    iters: u64,
    mut hist: Option<&mut Histogram<u64>>,
) -> Result<(), BenchError> {
    let depth = cfg.depth as u64;
    let mut posted_at = vec![Instant::now(); depth as usize];
    let (mut posted, mut done) = (0u64, 0u64);
    let mut wc = [Completion::EMPTY; 64];
    while done < iters {
        while posted < iters && posted - done < depth {
            posted_at[(posted % depth) as usize] = Instant::now();
            qp.post_send(&SendWr { wr_id: posted, op, sg, signaled: true })?;
            posted += 1;
        }
        let n = cq.poll(&mut wc)?;
        let now = Instant::now();
        for c in &wc[..n] {
            if !c.status.is_ok() {
                return Err(BenchError::Completion { op: cfg.op.name(), wr_id: c.wr_id, status: c.status });
            }
            if let Some(h) = hist.as_deref_mut() {
                let ns = now.duration_since(posted_at[(c.wr_id % depth) as usize]).as_nanos() as u64;
                h.saturating_record(ns.max(1));
            }
            done += 1;
        }
    }
    Ok(())
}
