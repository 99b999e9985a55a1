//! Connection management of the shm provider. A listener binds its TCP address
//! (which reserves the port and names it) and an abstract Unix socket named after
//! it, `eps-shm/IP:PORT` (`eps-shm/*:PORT` for a wildcard address); a dialer on
//! the same host, as the same user, connects there. Both prove the job secret
//! as the soft provider's peers do, then exchange eventfds and the QP's segment
//! with `SCM_RIGHTS`, and no memory is reachable before that.

use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::api::{Listener, QpOptions};
use crate::auth;
use crate::error::{FabricError, Result};
use crate::soft::SoftCq;
use crate::wire::{
    ACCEPT_LEN, AcceptFrame, CLIENT_AUTH_LEN, CLIENT_HELLO_LEN, ClientHello, SERVER_HELLO_LEN, ServerHello, decode_client_auth,
    encode_client_auth,
};

use super::qp::{QpShared, Requester, ShmQp};
use super::ring::{MAX_RING, Segment, ring_for, segment_bytes};
use super::sys::{self, Got, PeerMap};
use super::{ShmPd, msg};

const ACCEPT_OK: u8 = 0;
const ACCEPT_AUTH_FAILED: u8 = 1;

fn check_opts(o: &QpOptions) -> Result<()> {
    if o.max_send_wr == 0 || o.max_recv_wr == 0 {
        return Err(FabricError::InvalidArgument("queue depths must be at least 1"));
    }
    if o.max_send_wr > MAX_RING {
        return Err(FabricError::InvalidArgument("max_send_wr must be at most 4096 on the shm transport"));
    }
    if o.max_sge == 0 || o.max_sge as usize > crate::soft::MAX_SGE {
        return Err(FabricError::InvalidArgument("max_sge must be between 1 and 8"));
    }
    Ok(())
}

/// The abstract socket names a listener on `addr` answers to, most specific first.
fn names(addr: SocketAddr) -> [String; 2] {
    [format!("eps-shm/{addr}"), format!("eps-shm/*:{}", addr.port())]
}

fn err(peer: &str, stage: &'static str) -> impl FnOnce(std::io::Error) -> FabricError + use<> {
    let peer = peer.to_string();
    move |source| FabricError::Connect { peer, stage, source }
}

fn protocol(peer: &str, reason: &'static str) -> FabricError {
    FabricError::Protocol { peer: peer.to_string(), reason }
}

/// Reads one control message of `want` bytes (blocking, under the socket's timeouts).
fn recv_exact(fd: RawFd, want: usize, peer: &str) -> Result<([u8; sys::MSG_MAX], Vec<OwnedFd>)> {
    match sys::recv_msg(fd, false).map_err(err(peer, "shm handshake"))? {
        Got::Msg(b, n, fds) if n == want => Ok((b, fds)),
        Got::Msg(..) => Err(protocol(peer, "a set-up message of the wrong size")),
        Got::Empty | Got::Closed => Err(err(peer, "shm handshake")(std::io::ErrorKind::UnexpectedEof.into())),
    }
}

/// Reads a set-up control message of `kind` carrying `nfds` descriptors.
fn recv_ctl(fd: RawFd, kind: u8, nfds: usize, peer: &str) -> Result<(msg::Msg, Vec<OwnedFd>)> {
    let (b, fds) = recv_exact(fd, msg::LEN, peer)?;
    match msg::decode(&b[..msg::LEN]) {
        Some(m) if m.kind == kind && fds.len() == nfds => Ok((m, fds)),
        _ => Err(protocol(peer, "an unexpected set-up message")),
    }
}

/// Checks that the peer runs as this user (the kernel's word, not the peer's).
fn same_user(fd: RawFd, peer: &str) -> Result<u32> {
    let (pid, uid) = sys::peer_cred(fd).map_err(err(peer, "peer credentials"))?;
    if uid != sys::my_uid() {
        return Err(FabricError::AuthFailed { peer: peer.to_string(), reason: "the peer runs as another user" });
    }
    Ok(pid)
}

/// What each side hands the other: its eventfds, to be woken by it.
fn send_setup(fd: RawFd, pd: &ShmPd, send_cq: &SoftCq, depth: u32, peer: &str) -> Result<()> {
    let fds = [pd.dev.engine.shared.wake_fd.as_raw_fd(), send_cq.inner.notify_fd().as_raw_fd()];
    sys::send_msg(fd, &msg::setup(depth), &fds).map_err(err(peer, "shm handshake"))
}

/// The peer's eventfds, made nonblocking (a peer cannot make us block on them).
fn take_eventfds(mut fds: Vec<OwnedFd>, peer: &str) -> Result<(OwnedFd, OwnedFd)> {
    for f in &fds {
        sys::set_nonblocking(f.as_raw_fd(), true).map_err(err(peer, "shm handshake"))?;
    }
    let cq = fds.pop().expect("two descriptors");
    Ok((fds.pop().expect("two descriptors"), cq))
}

#[allow(clippy::too_many_arguments)]
fn build_qp(
    pd: &ShmPd,
    sock: OwnedFd,
    seg: Segment,
    side: usize,
    peer_pid: u32,
    (peer_engine, peer_cq): (OwnedFd, OwnedFd),
    send_cq: &SoftCq,
    recv_cq: &SoftCq,
    opts: &QpOptions,
    peer: SocketAddr,
) -> Result<ShmQp> {
    // Announcements are small and the progress thread reads them without blocking;
    // the send timeout only matters if the peer stalls.
    sys::set_timeouts(sock.as_raw_fd(), Duration::from_secs(5)).map_err(err(&peer.to_string(), "socket setup"))?;
    let qp_num = pd.dev.next_qp.fetch_add(1, Ordering::Relaxed);
    let shared = Arc::new(QpShared {
        qp_num,
        pd: pd.pd,
        state: std::sync::atomic::AtomicU8::new(super::qp::RTS),
        peer_gone: AtomicBool::new(false),
        recv_q: Mutex::new(std::collections::VecDeque::with_capacity(opts.max_recv_wr as usize)),
        max_recv_wr: opts.max_recv_wr,
        recv_cq: recv_cq.inner.clone(),
        send_cq: send_cq.inner.clone(),
        rnr_waiting: AtomicBool::new(false),
        rnr_timeout: opts.rnr_timeout,
        max_msg_bytes: opts.max_msg_bytes,
        sock,
        seg,
        side,
        peer_pid,
        peer_engine,
        peer_cq,
        engine: pd.dev.engine.shared.clone(),
    });
    let r = Arc::new(Mutex::new(Requester::new(
        shared.clone(),
        opts.max_send_wr,
        opts.max_sge,
        opts.max_msg_bytes,
        opts.ack_timeout,
    )));
    send_cq.inner.attach(r.clone());
    Ok(ShmQp { shared, req: r, peer, max_sge: opts.max_sge as usize })
}

/// Whether `ip` is an address of this host (in this network namespace).
pub(crate) fn is_local(ip: std::net::IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

/// Connects to the shm listener of `addr` on this host, if there is one.
pub(crate) fn dial_socket(addr: SocketAddr) -> std::io::Result<OwnedFd> {
    let [exact, wild] = names(addr);
    match sys::connect(&exact) {
        // A wildcard listener answers for every address of this host only.
        Err(_) if is_local(addr.ip()) => sys::connect(&wild),
        r => r,
    }
}

pub(crate) fn dial(pd: &ShmPd, addr: SocketAddr, send_cq: &SoftCq, recv_cq: &SoftCq, opts: &QpOptions) -> Result<ShmQp> {
    check_opts(opts)?;
    let sock =
        dial_socket(addr).map_err(err(&addr.to_string(), "shm connect (no shm listener of this host has that address)"))?;
    dial_on(pd, sock, addr, send_cq, recv_cq, opts)
}

/// The dialer's half of the set-up, on a socket connected to the listener.
pub(crate) fn dial_on(
    pd: &ShmPd,
    sock: OwnedFd,
    addr: SocketAddr,
    send_cq: &SoftCq,
    recv_cq: &SoftCq,
    opts: &QpOptions,
) -> Result<ShmQp> {
    check_opts(opts)?;
    let peer = addr.to_string();
    let fd = sock.as_raw_fd();
    sys::set_timeouts(fd, opts.connect_timeout.max(Duration::from_millis(1))).map_err(err(&peer, "shm connect"))?;
    let peer_pid = same_user(fd, &peer)?;
    // The job secret, as on the soft transport.
    let nonce_c = auth::nonce().map_err(err(&peer, "shm handshake"))?;
    let hello = ClientHello { channel: 0, token: 0, nonce: nonce_c, max_msg_bytes: opts.max_msg_bytes };
    sys::send_msg(fd, &hello.encode(), &[]).map_err(err(&peer, "shm handshake"))?;
    let (b, _) = recv_exact(fd, SERVER_HELLO_LEN, &peer)?;
    let sh = ServerHello::decode(&b[..SERVER_HELLO_LEN]).map_err(|_| protocol(&peer, "bad server hello"))?;
    if !auth::proofs_equal(&auth::listener_proof(&opts.secret, &nonce_c, &sh.nonce, 0, 0), &sh.proof) {
        return Err(FabricError::AuthFailed { peer, reason: "the listener does not hold the job secret" });
    }
    let proof = auth::dialer_proof(&opts.secret, &nonce_c, &sh.nonce, 0, 0);
    sys::send_msg(fd, &encode_client_auth(&proof), &[]).map_err(err(&peer, "shm handshake"))?;
    let (a, _) = recv_exact(fd, ACCEPT_LEN, &peer)?;
    let acc = AcceptFrame::decode(&a[..ACCEPT_LEN]).map_err(|_| protocol(&peer, "bad accept frame"))?;
    if acc.status != ACCEPT_OK {
        return Err(FabricError::AuthFailed { peer, reason: "the listener rejected our proof of the job secret" });
    }
    // Eventfds both ways, then the segment, sized for both send queues.
    send_setup(fd, pd, send_cq, opts.max_send_wr, &peer)?;
    let (m, fds) = recv_ctl(fd, msg::SETUP, 2, &peer)?;
    if m.a == 0 || m.a > MAX_RING {
        return Err(protocol(&peer, "a send-queue depth out of range"));
    }
    let eventfds = take_eventfds(fds, &peer)?;
    let ring = [ring_for(opts.max_send_wr), ring_for(m.a)];
    let seg = Segment::create(ring)?;
    let seg_fd = seg.fd().expect("the dialer's own segment").as_raw_fd();
    sys::send_msg(fd, &msg::segment(ring), &[seg_fd]).map_err(err(&peer, "shm handshake"))?;
    recv_ctl(fd, msg::READY, 0, &peer)?;
    let qp = build_qp(pd, sock, seg, 0, peer_pid, eventfds, send_cq, recv_cq, opts, addr)?;
    pd.dev.engine.shared.adopt(qp.shared.clone());
    Ok(qp)
}

/// Listens for shm QP connections.
pub struct ShmListener {
    pd: ShmPd,
    /// Holds the TCP port that names this listener (nothing is accepted on it),
    /// unless the soft listener of the same address holds it (`auto`).
    _tcp: Option<TcpListener>,
    addr: SocketAddr,
    sock: OwnedFd,
    opts: QpOptions,
}

impl std::fmt::Debug for ShmListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmListener").field("addr", &self.addr).finish()
    }
}

impl ShmListener {
    pub(crate) fn bind(pd: ShmPd, addr: SocketAddr, opts: QpOptions) -> Result<Self> {
        let tcp = TcpListener::bind(addr).map_err(|source| FabricError::Listen { addr, source })?;
        let local = tcp.local_addr().map_err(|source| FabricError::Listen { addr, source })?;
        Self::named(pd, local, Some(tcp), opts)
    }

    /// A listener answering to `addr`, whose port the caller holds (or `tcp`).
    pub(crate) fn named(pd: ShmPd, addr: SocketAddr, tcp: Option<TcpListener>, opts: QpOptions) -> Result<Self> {
        check_opts(&opts)?;
        let name = if addr.ip().is_unspecified() { names(addr)[1].clone() } else { names(addr)[0].clone() };
        let sock = sys::listen(&name).map_err(|source| FabricError::Listen { addr, source })?;
        Ok(Self { pd, _tcp: tcp, addr, sock, opts })
    }

    /// The listener's half of the handshake on a socket just accepted.
    fn handshake(&self, sock: OwnedFd, send_cq: &SoftCq, recv_cq: &SoftCq) -> Result<ShmQp> {
        let fd = sock.as_raw_fd();
        let peer = "a local dialer";
        sys::set_timeouts(fd, self.opts.connect_timeout.max(Duration::from_millis(1))).map_err(err(peer, "shm handshake"))?;
        let peer_pid = same_user(fd, peer)?;
        let (b, _) = recv_exact(fd, CLIENT_HELLO_LEN, peer)?;
        let hello = ClientHello::decode(&b[..CLIENT_HELLO_LEN]).map_err(|_| protocol(peer, "bad client hello"))?;
        let nonce_s = auth::nonce().map_err(err(peer, "shm handshake"))?;
        let proof = auth::listener_proof(&self.opts.secret, &hello.nonce, &nonce_s, 0, 0);
        sys::send_msg(fd, &ServerHello { nonce: nonce_s, proof }.encode(), &[]).map_err(err(peer, "shm handshake"))?;
        let (p, _) = recv_exact(fd, CLIENT_AUTH_LEN, peer)?;
        let got = decode_client_auth(&p[..CLIENT_AUTH_LEN]).map_err(|_| protocol(peer, "bad client proof"))?;
        let expect = auth::dialer_proof(&self.opts.secret, &hello.nonce, &nonce_s, 0, 0);
        let mut acc = AcceptFrame { status: ACCEPT_OK, token: 0, qp_num: 0, max_msg_bytes: self.opts.max_msg_bytes };
        if !auth::proofs_equal(&expect, &got) {
            acc.status = ACCEPT_AUTH_FAILED;
            let _ = sys::send_msg(fd, &acc.encode(), &[]);
            return Err(FabricError::AuthFailed { peer: peer.to_string(), reason: "the dialer does not hold the job secret" });
        }
        sys::send_msg(fd, &acc.encode(), &[]).map_err(err(peer, "shm handshake"))?;
        let (m, fds) = recv_ctl(fd, msg::SETUP, 2, peer)?;
        if m.a == 0 || m.a > MAX_RING {
            return Err(protocol(peer, "a send-queue depth out of range"));
        }
        let eventfds = take_eventfds(fds, peer)?;
        send_setup(fd, &self.pd, send_cq, self.opts.max_send_wr, peer)?;
        let (s, mut fds) = recv_ctl(fd, msg::SEGMENT, 1, peer)?;
        let ring = [s.a, s.b];
        if ring != [ring_for(m.a), ring_for(self.opts.max_send_wr)] {
            return Err(protocol(peer, "a segment of the wrong shape"));
        }
        let map = PeerMap::new(&fds.remove(0), segment_bytes(ring)).map_err(err(peer, "mapping the QP's segment"))?;
        let seg = Segment::from_peer(map, ring).ok_or_else(|| protocol(peer, "a segment of the wrong shape"))?;
        let local = self.local_addr();
        let peer_addr = SocketAddr::new(local.ip(), 0);
        let qp = build_qp(&self.pd, sock, seg, 1, peer_pid, eventfds, send_cq, recv_cq, &self.opts, peer_addr)?;
        Ok(qp)
    }
}

impl Listener for ShmListener {
    type Qp = ShmQp;
    type Cq = SoftCq;

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn accept(&self, send_cq: &SoftCq, recv_cq: &SoftCq, timeout: Duration) -> Result<ShmQp> {
        self.accept_prepared(send_cq, recv_cq, timeout, &mut |_| Ok(()))
    }

    fn accept_prepared(
        &self,
        send_cq: &SoftCq,
        recv_cq: &SoftCq,
        timeout: Duration,
        prepare: &mut dyn FnMut(&ShmQp) -> Result<()>,
    ) -> Result<ShmQp> {
        let qp = self.accept_unready(send_cq, recv_cq, timeout)?;
        prepare(&qp)?;
        self.ready(&qp)?;
        Ok(qp)
    }
}

impl ShmListener {
    /// Waits for one authenticated dialer; its QP is not running yet: receives
    /// posted on it now are in place for the dialer's first SEND, which cannot
    /// come before [`ShmListener::ready`].
    pub(crate) fn accept_unready(&self, send_cq: &SoftCq, recv_cq: &SoftCq, timeout: Duration) -> Result<ShmQp> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(FabricError::Timeout("a queue-pair connection"));
            }
            let ms = left.as_millis().clamp(1, 1000) as i32;
            let ready = crate::soft::sys::wait_readable(self.sock.as_raw_fd(), ms)
                .map_err(|source| FabricError::Listen { addr: self.local_addr(), source })?;
            if !ready {
                continue;
            }
            let Some(s) =
                sys::accept(self.sock.as_raw_fd()).map_err(|source| FabricError::Listen { addr: self.local_addr(), source })?
            else {
                continue;
            };
            // A failed handshake concerns that peer only.
            if let Ok(qp) = self.handshake(s, send_cq, recv_cq) {
                return Ok(qp);
            }
        }
    }

    /// Tells the dialer the QP is ready and hands it to the progress thread.
    pub(crate) fn ready(&self, qp: &ShmQp) -> Result<()> {
        sys::send_msg(qp.shared.sock.as_raw_fd(), &msg::ready(), &[]).map_err(err("a local dialer", "shm handshake"))?;
        self.pd.dev.engine.shared.adopt(qp.shared.clone());
        Ok(())
    }
}
