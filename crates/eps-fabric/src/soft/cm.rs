//! Connection management (like rdma_cm): a listener and a dialer that set up the two
//! TCP channels of a QP and authenticate both with the job secret before any memory
//! is reachable.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::api::{Listener, QpOptions};
use crate::auth;
use crate::error::{FabricError, Result};
use crate::wire::{
    ACCEPT_LEN, AcceptFrame, CLIENT_AUTH_LEN, CLIENT_HELLO_LEN, ClientHello, SERVER_HELLO_LEN, ServerHello, decode_client_auth,
    encode_client_auth,
};

use super::qp::{QpShared, Requester};
use super::{MAX_SGE, SoftCq, SoftPd, SoftQp, sys};

const ACCEPT_OK: u8 = 0;
const ACCEPT_AUTH_FAILED: u8 = 1;
const ACCEPT_BAD_TOKEN: u8 = 2;
/// A half-set-up QP (first channel in, second not yet) is forgotten after this long.
const PENDING_TTL: Duration = Duration::from_secs(30);

fn check_opts(o: &QpOptions) -> Result<()> {
    if o.max_send_wr == 0 || o.max_recv_wr == 0 {
        return Err(FabricError::InvalidArgument("queue depths must be at least 1"));
    }
    if o.max_sge == 0 || o.max_sge as usize > MAX_SGE {
        return Err(FabricError::InvalidArgument("max_sge must be between 1 and 8"));
    }
    Ok(())
}

fn io_err(peer: &str, stage: &'static str) -> impl FnOnce(std::io::Error) -> FabricError + use<> {
    let peer = peer.to_string();
    move |source| FabricError::Connect { peer, stage, source }
}

/// Builds a connected QP from its two authenticated channels.
#[allow(clippy::too_many_arguments)]
fn build_qp(
    pd: &SoftPd,
    req: TcpStream,
    resp: TcpStream,
    qp_num: u32,
    send_cq: &SoftCq,
    recv_cq: &SoftCq,
    opts: &QpOptions,
    peer: SocketAddr,
) -> Result<SoftQp> {
    for s in [&req, &resp] {
        sys::prepare_stream(s).map_err(io_err(&peer.to_string(), "socket setup"))?;
    }
    let shared = Arc::new(QpShared::new(
        qp_num,
        pd.pd,
        opts.max_recv_wr,
        recv_cq.inner.clone(),
        opts.rnr_timeout,
        opts.max_msg_bytes,
        OwnedFd::from(req),
        OwnedFd::from(resp),
        pd.dev.engine.shared.clone(),
    ));
    let r = Arc::new(Mutex::new(Requester::new(
        shared.clone(),
        send_cq.inner.clone(),
        opts.max_send_wr,
        opts.max_sge,
        opts.max_msg_bytes,
        opts.ack_timeout,
    )));
    send_cq.inner.attach(r.clone());
    pd.dev.engine.shared.adopt(shared.clone());
    Ok(SoftQp { shared, req: r, send_cq: send_cq.inner.clone(), peer, max_sge: opts.max_sge as usize })
}

/// Dialer side of one channel: hello, check the listener's proof, prove ours.
fn dial_channel(
    addr: SocketAddr,
    channel: u8,
    token: u64,
    opts: &QpOptions,
    deadline: Instant,
) -> Result<(TcpStream, AcceptFrame)> {
    let peer = addr.to_string();
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let mut s = TcpStream::connect_timeout(&addr, left).map_err(io_err(&peer, "tcp connect"))?;
    s.set_read_timeout(Some(left)).map_err(io_err(&peer, "tcp connect"))?;
    s.set_nodelay(true).map_err(io_err(&peer, "tcp connect"))?;
    let nonce_c = auth::nonce().map_err(io_err(&peer, "handshake"))?;
    let hello = ClientHello { channel, token, nonce: nonce_c, max_msg_bytes: opts.max_msg_bytes };
    s.write_all(&hello.encode()).map_err(io_err(&peer, "handshake"))?;
    let mut b = [0u8; SERVER_HELLO_LEN];
    s.read_exact(&mut b).map_err(io_err(&peer, "handshake"))?;
    let sh = ServerHello::decode(&b).map_err(|_| FabricError::Protocol { peer: peer.clone(), reason: "bad server hello" })?;
    let expect = auth::listener_proof(&opts.secret, &nonce_c, &sh.nonce, token, channel);
    if !auth::proofs_equal(&expect, &sh.proof) {
        return Err(FabricError::AuthFailed { peer, reason: "the listener does not hold the job secret" });
    }
    let proof = auth::dialer_proof(&opts.secret, &nonce_c, &sh.nonce, token, channel);
    s.write_all(&encode_client_auth(&proof)).map_err(io_err(&peer, "handshake"))?;
    let mut a = [0u8; ACCEPT_LEN];
    s.read_exact(&mut a).map_err(io_err(&peer, "handshake"))?;
    let acc = AcceptFrame::decode(&a).map_err(|_| FabricError::Protocol { peer: peer.clone(), reason: "bad accept frame" })?;
    match acc.status {
        ACCEPT_OK => Ok((s, acc)),
        ACCEPT_AUTH_FAILED => Err(FabricError::AuthFailed { peer, reason: "the listener rejected our proof of the job secret" }),
        _ => Err(FabricError::Protocol { peer, reason: "the listener did not recognise the connection token" }),
    }
}

pub(crate) fn dial(pd: &SoftPd, addr: SocketAddr, send_cq: &SoftCq, recv_cq: &SoftCq, opts: &QpOptions) -> Result<SoftQp> {
    check_opts(opts)?;
    let deadline = Instant::now() + opts.connect_timeout;
    let (req, acc) = dial_channel(addr, 0, 0, opts, deadline)?;
    let (resp, _) = dial_channel(addr, 1, acc.token, opts, deadline)?;
    let qp_num = pd.dev.next_qp.fetch_add(1, Ordering::Relaxed);
    build_qp(pd, req, resp, qp_num, send_cq, recv_cq, opts, addr)
}

struct Pending {
    stream: TcpStream,
    since: Instant,
}

type PendingMap = Arc<Mutex<HashMap<u64, Pending>>>;

/// Handshakes run at most this many at once (each on a thread of its own, so
/// a peer that connects and stays silent holds up nobody else).
const MAX_HANDSHAKES: usize = 64;

/// Listens for soft QP connections.
pub struct SoftListener {
    pd: SoftPd,
    listener: TcpListener,
    opts: QpOptions,
    /// First channels in, by token, waiting for their second.
    pending: PendingMap,
    /// Second channels whose handshake completed: (token, stream, peer).
    done_tx: std::sync::mpsc::Sender<(u64, TcpStream, SocketAddr)>,
    done_rx: Mutex<std::sync::mpsc::Receiver<(u64, TcpStream, SocketAddr)>>,
    /// Handshakes in flight.
    running: Arc<std::sync::atomic::AtomicUsize>,
}

impl std::fmt::Debug for SoftListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftListener").field("addr", &self.listener.local_addr().ok()).finish()
    }
}

impl SoftListener {
    pub(crate) fn bind(pd: SoftPd, addr: SocketAddr, opts: QpOptions) -> Result<Self> {
        check_opts(&opts)?;
        let listener = TcpListener::bind(addr).map_err(|source| FabricError::Listen { addr, source })?;
        listener.set_nonblocking(true).map_err(|source| FabricError::Listen { addr, source })?;
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        Ok(Self { pd, listener, opts, pending: Arc::default(), done_tx, done_rx: Mutex::new(done_rx), running: Arc::default() })
    }

    /// Runs the handshake of a connection just accepted on a thread of its own.
    fn start_handshake(&self, s: TcpStream, peer: SocketAddr) {
        let (opts, pending, done, running) =
            (self.opts.clone(), self.pending.clone(), self.done_tx.clone(), self.running.clone());
        running.fetch_add(1, Ordering::AcqRel);
        let spawned = std::thread::Builder::new().name("eps-soft-handshake".into()).spawn(move || {
            // A failed handshake concerns that peer only.
            if let Ok(Some(token)) = serve_channel(&opts, &pending, &s, &peer.to_string()) {
                let _ = done.send((token, s, peer));
            }
            running.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            self.running.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Listener side of one channel. A first channel (0) is left in `pending`
/// under its new token; a second one (1) is returned with its token.
fn serve_channel(opts: &QpOptions, pending: &Mutex<HashMap<u64, Pending>>, s: &TcpStream, peer: &str) -> Result<Option<u64>> {
    let mut s = s;
    s.set_nonblocking(false).map_err(io_err(peer, "handshake"))?;
    s.set_read_timeout(Some(opts.connect_timeout)).map_err(io_err(peer, "handshake"))?;
    s.set_nodelay(true).map_err(io_err(peer, "handshake"))?;
    let mut b = [0u8; CLIENT_HELLO_LEN];
    s.read_exact(&mut b).map_err(io_err(peer, "handshake"))?;
    let hello =
        ClientHello::decode(&b).map_err(|_| FabricError::Protocol { peer: peer.to_string(), reason: "bad client hello" })?;
    let token = if hello.channel == 0 {
        u64::from_le_bytes(auth::nonce().map_err(io_err(peer, "handshake"))?[..8].try_into().expect("8 bytes")) | 1
    } else {
        hello.token
    };
    let nonce_s = auth::nonce().map_err(io_err(peer, "handshake"))?;
    let proof = auth::listener_proof(&opts.secret, &hello.nonce, &nonce_s, hello.token, hello.channel);
    s.write_all(&ServerHello { nonce: nonce_s, proof }.encode()).map_err(io_err(peer, "handshake"))?;
    let mut p = [0u8; CLIENT_AUTH_LEN];
    s.read_exact(&mut p).map_err(io_err(peer, "handshake"))?;
    let got = decode_client_auth(&p).map_err(|_| FabricError::Protocol { peer: peer.to_string(), reason: "bad client proof" })?;
    let expect = auth::dialer_proof(&opts.secret, &hello.nonce, &nonce_s, hello.token, hello.channel);
    let mut acc = AcceptFrame { status: ACCEPT_OK, token, qp_num: 0, max_msg_bytes: opts.max_msg_bytes };
    if !auth::proofs_equal(&expect, &got) {
        acc.status = ACCEPT_AUTH_FAILED;
        let _ = s.write_all(&acc.encode());
        return Err(FabricError::AuthFailed { peer: peer.to_string(), reason: "the dialer does not hold the job secret" });
    }
    {
        let mut pending = pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.retain(|_, p| p.since.elapsed() < PENDING_TTL);
        if hello.channel == 0 {
            // In place before the dialer can start its second channel.
            let stream = s.try_clone().map_err(io_err(peer, "handshake"))?;
            pending.insert(token, Pending { stream, since: Instant::now() });
        } else if !pending.contains_key(&token) {
            acc.status = ACCEPT_BAD_TOKEN;
            let _ = s.write_all(&acc.encode());
            return Err(FabricError::Protocol { peer: peer.to_string(), reason: "unknown connection token" });
        }
    }
    if let Err(e) = s.write_all(&acc.encode()) {
        pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&token);
        return Err(io_err(peer, "handshake")(e));
    }
    Ok((hello.channel == 1).then_some(token))
}

impl Listener for SoftListener {
    type Qp = SoftQp;
    type Cq = SoftCq;

    fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound listener has an address")
    }

    fn accept(&self, send_cq: &SoftCq, recv_cq: &SoftCq, timeout: Duration) -> Result<SoftQp> {
        let deadline = Instant::now() + timeout;
        loop {
            // A second channel whose handshake completed makes a QP with its first.
            while let Ok((token, stream, peer)) = self.done_rx.lock().unwrap_or_else(|p| p.into_inner()).try_recv() {
                let Some(first) = self.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&token) else { continue };
                let qp_num = self.pd.dev.next_qp.fetch_add(1, Ordering::Relaxed);
                // The dialer's channel 0 carries its requests: it is our responder channel.
                return build_qp(&self.pd, stream, first.stream, qp_num, send_cq, recv_cq, &self.opts, peer);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(FabricError::Timeout("a queue-pair connection"));
            }
            // While handshakes run, look at their results every millisecond.
            let busy = self.running.load(Ordering::Acquire);
            let ms = if busy > 0 { 1 } else { left.as_millis().clamp(1, 1000) as i32 };
            if busy >= MAX_HANDSHAKES
                || !sys::wait_readable(self.listener.as_raw_fd(), ms)
                    .map_err(|e| FabricError::Listen { addr: self.local_addr(), source: e })?
            {
                if busy >= MAX_HANDSHAKES {
                    std::thread::sleep(Duration::from_millis(1));
                }
                continue;
            }
            match self.listener.accept() {
                Ok((s, peer)) => self.start_handshake(s, peer),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(source) => return Err(FabricError::Listen { addr: self.local_addr(), source }),
            }
        }
    }
}
