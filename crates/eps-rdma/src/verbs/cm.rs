//! Connections through rdma_cm: the listener, the dialer, and their events
//! (the job-secret handshake's messages are in `handshake.rs`).

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::ptr;
use std::time::{Duration, Instant};

use eps_fabric::Result;
use eps_fabric::prelude::*;
use rdma_sys as sys;

use super::{RdmaCq, RdmaPd, RdmaQp, verbs_err};
use crate::handshake::{self, Msg};

/// Waits up to `timeout` for the next event on `ch`; returns (type, id, status).
/// One rdma_cm event: its type, id, status and private data (connection events).
pub(super) struct Event {
    pub(super) kind: u32,
    id: *mut sys::rdma_cm_id,
    status: i32,
    private: Vec<u8>,
}

pub(super) fn next_event(ch: *mut sys::rdma_event_channel, timeout: Duration) -> Result<Event> {
    // SAFETY: the channel is live.
    let fd = unsafe { (*ch).fd };
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, timeout.as_millis().clamp(0, i32::MAX as u128) as i32) };
    if r <= 0 {
        return Err(FabricError::Timeout("an rdma_cm event"));
    }
    let mut ev = ptr::null_mut();
    // SAFETY: an event is ready; `ev` receives it and is acknowledged below.
    if unsafe { sys::rdma_get_cm_event(ch, &mut ev) } != 0 {
        return Err(verbs_err("rdma_get_cm_event"));
    }
    // SAFETY: `ev` is a live event until acknowledged; for connection events its
    // `param.conn` names `private_data_len` bytes owned by the event.
    let out = unsafe {
        let e = &*ev;
        let conn = e.param.conn;
        let private = if conn.private_data.is_null() {
            Vec::new()
        } else {
            std::slice::from_raw_parts(conn.private_data.cast::<u8>(), conn.private_data_len as usize).to_vec()
        };
        Event { kind: e.event, id: e.id, status: e.status, private }
    };
    // SAFETY: acknowledged once, after the private data was copied.
    unsafe { sys::rdma_ack_cm_event(ev) };
    Ok(out)
}

fn expect_event(ch: *mut sys::rdma_event_channel, want: u32, deadline: Instant, stage: &'static str) -> Result<Event> {
    let e = next_event(ch, deadline.saturating_duration_since(Instant::now()))?;
    if e.kind != want {
        return Err(FabricError::Connect {
            peer: String::new(),
            stage,
            source: io::Error::other(format!("rdma_cm event {} (status {}) instead of {want}", e.kind, e.status)),
        });
    }
    Ok(e)
}

/// The QP's ACK timeout exponent (4.096 us x 2^16: about 0.27 s; a vanished peer
/// is declared after 7 retries, about 2 s), set before the QP is connected.
const ACK_TIMEOUT: u8 = 16;

fn set_ack_timeout(id: *mut sys::rdma_cm_id) {
    let mut t = ACK_TIMEOUT;
    // SAFETY: `id` is live; the option is one byte (RDMA_OPTION_ID = 0,
    // RDMA_OPTION_ID_ACK_TIMEOUT = 3 in rdma_cma.h). A kernel without the option
    // keeps its default.
    unsafe { sys::rdma_set_option(id, 0, 3, (&mut t as *mut u8).cast(), 1) };
}

fn sockaddr(a: SocketAddr) -> Result<libc::sockaddr_in> {
    let SocketAddr::V4(v4) = a else { return Err(FabricError::InvalidArgument("rdma needs an IPv4 address")) };
    Ok(libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: v4.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*v4.ip()).to_be() },
        sin_zero: [0; 8],
    })
}

fn qp_attr(send: &RdmaCq, recv: &RdmaCq, o: &QpOptions) -> sys::ibv_qp_init_attr {
    // SAFETY: ibv_qp_init_attr is plain data; zero is a valid value.
    let mut a: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    a.send_cq = send.0.cq;
    a.recv_cq = recv.0.cq;
    a.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
    a.cap.max_send_wr = o.max_send_wr;
    a.cap.max_recv_wr = o.max_recv_wr;
    a.cap.max_send_sge = o.max_sge;
    a.cap.max_recv_sge = o.max_sge;
    a.sq_sig_all = 0;
    a
}

/// Bytes of inline data asked for (the device may give more, or none).
const INLINE_ASK: u32 = 64;

/// Creates `id`'s QP, with inline data when the device allows it; returns the
/// inline size it got.
fn create_qp(id: *mut sys::rdma_cm_id, pd: *mut sys::ibv_pd, send: &RdmaCq, recv: &RdmaCq, o: &QpOptions) -> Result<u32> {
    for inline in [INLINE_ASK, 0] {
        let mut attr = qp_attr(send, recv, o);
        attr.cap.max_inline_data = inline;
        // SAFETY: `id` is bound to the PD's device; `attr` is valid for the call.
        if unsafe { sys::rdma_create_qp(id, pd, &mut attr) } == 0 {
            return Ok(attr.cap.max_inline_data.min(inline));
        }
    }
    Err(verbs_err("rdma_create_qp"))
}

fn conn_param(o: &QpOptions) -> sys::rdma_conn_param {
    // SAFETY: rdma_conn_param is plain data; zero is a valid value.
    let mut p: sys::rdma_conn_param = unsafe { std::mem::zeroed() };
    p.responder_resources = 16;
    p.initiator_depth = 16;
    p.retry_count = 7;
    // 7: wait for a receive forever; otherwise a few retries.
    p.rnr_retry_count = if o.rnr_timeout.is_none() { 7 } else { 3 };
    p
}

/// A challenge given out: (nonce_s, the dialer's nonce_c and message limit, when).
type Challenge = ([u8; 16], [u8; 16], u32, Instant);

/// An rdma_cm listener.
#[derive(Debug)]
pub struct RdmaListener {
    id: *mut sys::rdma_cm_id,
    ch: *mut sys::rdma_event_channel,
    addr: SocketAddr,
    pd: RdmaPd,
    opts: QpOptions,
    /// Challenges given out and not answered yet.
    challenges: std::sync::Mutex<std::collections::VecDeque<Challenge>>,
}

// SAFETY: the listener's id and channel are used by one accept at a time (&self
// methods only read the handles; rdma_cm locks internally).
unsafe impl Send for RdmaListener {}
// SAFETY: as above.
unsafe impl Sync for RdmaListener {}

impl Drop for RdmaListener {
    fn drop(&mut self) {
        // SAFETY: ours, destroyed once, id before its channel.
        unsafe {
            sys::rdma_destroy_id(self.id);
            sys::rdma_destroy_event_channel(self.ch);
        }
    }
}

fn new_id() -> Result<(*mut sys::rdma_event_channel, *mut sys::rdma_cm_id)> {
    // SAFETY: creates a channel we own.
    let ch = unsafe { sys::rdma_create_event_channel() };
    if ch.is_null() {
        return Err(verbs_err("rdma_create_event_channel"));
    }
    let mut id = ptr::null_mut();
    // SAFETY: `ch` is live; `id` receives the new id.
    if unsafe { sys::rdma_create_id(ch, &mut id, ptr::null_mut(), sys::rdma_port_space::RDMA_PS_TCP) } != 0 {
        let e = verbs_err("rdma_create_id");
        // SAFETY: ours, no id on it.
        unsafe { sys::rdma_destroy_event_channel(ch) };
        return Err(e);
    }
    Ok((ch, id))
}

impl Listener for RdmaListener {
    type Qp = RdmaQp;
    type Cq = RdmaCq;

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn accept(&self, send_cq: &RdmaCq, recv_cq: &RdmaCq, timeout: Duration) -> Result<RdmaQp> {
        self.accept_prepared(send_cq, recv_cq, timeout, &mut |_| Ok(()))
    }

    /// The QP exists (in INIT, receives allowed) before `rdma_accept`: `prepare`
    /// posts the receives the peer's first SEND needs before the peer can send it.
    fn accept_prepared(
        &self,
        send_cq: &RdmaCq,
        recv_cq: &RdmaCq,
        timeout: Duration,
        prepare: &mut dyn FnMut(&RdmaQp) -> Result<()>,
    ) -> Result<RdmaQp> {
        let deadline = Instant::now() + timeout;
        let (id, reply, peer_max) = self.next_proven(deadline)?;
        // Its own channel, so its events do not mix with other connections'.
        // SAFETY: creates a channel we own.
        let ch = unsafe { sys::rdma_create_event_channel() };
        if ch.is_null() {
            return Err(verbs_err("rdma_create_event_channel"));
        }
        // SAFETY: `id` is the new connection's id; `ch` is live.
        if unsafe { sys::rdma_migrate_id(id, ch) } != 0 {
            return Err(verbs_err("rdma_migrate_id"));
        }
        set_ack_timeout(id);
        let max_inline = create_qp(id, self.pd.0.pd, send_cq, recv_cq, &self.opts)?;
        // SAFETY: a connect request's id holds the peer's address in its route.
        let peer = unsafe { peer_of(id) };
        // From here the QP owns the id and the channel (torn down on error).
        let mut qp = RdmaQp::new(id, ch, peer, &self.opts, (send_cq, recv_cq), &self.pd);
        (qp.peer_max_msg, qp.max_inline) = (peer_max, max_inline);
        qp.account();
        prepare(&qp)?;
        let mut param = conn_param(&self.opts);
        let reply = reply.encode();
        param.private_data = reply.as_ptr().cast();
        param.private_data_len = reply.len() as u8;
        // SAFETY: `id` has a QP; `param` and the bytes it names are valid for the call.
        if unsafe { sys::rdma_accept(id, &mut param) } != 0 {
            return Err(verbs_err("rdma_accept"));
        }
        expect_event(ch, sys::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED, deadline, "establishing")?;
        qp.watch();
        Ok(qp)
    }
}

impl RdmaListener {
    /// Waits for a connect request whose peer proved the job secret (see
    /// `handshake.rs`), answering the others; returns its id and the reply to
    /// accept it with.
    fn next_proven(&self, deadline: Instant) -> Result<(*mut sys::rdma_cm_id, Msg, u32)> {
        loop {
            let e = next_event(self.ch, deadline.saturating_duration_since(Instant::now()))?;
            if e.kind != sys::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
                continue;
            }
            let mut ch = self.challenges.lock().unwrap_or_else(|p| p.into_inner());
            ch.retain(|c| c.3.elapsed() < Duration::from_secs(60));
            let answer = match Msg::decode(&e.private) {
                Some(Msg::Hello { nonce_c, max_msg }) => {
                    let nonce_s = eps_fabric::auth::nonce().map_err(FabricError::Engine)?;
                    if ch.len() >= 256 {
                        ch.pop_front();
                    }
                    ch.push_back((nonce_s, nonce_c, max_msg, Instant::now()));
                    Msg::Challenge { nonce_s }
                }
                Some(Msg::Proof { nonce_s, proof_c }) => {
                    // Each challenge answers once.
                    let pos = ch.iter().position(|c| c.0 == nonce_s);
                    let given = pos.and_then(|i| ch.remove(i));
                    match given {
                        Some((_, nonce_c, peer_max, _))
                            if eps_fabric::auth::proofs_equal(
                                &proof_c,
                                &handshake::proof_c(&self.opts.secret, &nonce_c, &nonce_s),
                            ) =>
                        {
                            let proof_s = handshake::proof_s(&self.opts.secret, &nonce_c, &nonce_s);
                            return Ok((e.id, Msg::Accepted { proof_s, max_msg: self.opts.max_msg_bytes }, peer_max));
                        }
                        _ => Msg::Denied,
                    }
                }
                _ => Msg::Denied,
            };
            drop(ch);
            let b = answer.encode();
            // SAFETY: `e.id` is the request's id; the bytes live through the call;
            // the id is destroyed once, after the reject.
            unsafe {
                sys::rdma_reject(e.id, b.as_ptr().cast(), b.len() as u8);
                sys::rdma_destroy_id(e.id);
            }
        }
    }
}

/// # Safety
/// `id` is a live, connected rdma_cm id.
unsafe fn peer_of(id: *mut sys::rdma_cm_id) -> SocketAddr {
    // SAFETY: the caller's promise; the helper returns a reference into `id`.
    let sa: &libc::sockaddr = unsafe { sys::rdma_get_peer_addr(&*id) };
    if sa.sa_family != libc::AF_INET as libc::sa_family_t {
        return SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0));
    }
    // SAFETY: an AF_INET address is a sockaddr_in (the union's storage holds it).
    let sin = unsafe { &*(sa as *const libc::sockaddr).cast::<libc::sockaddr_in>() };
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)), u16::from_be(sin.sin_port)))
}

impl RdmaPd {
    /// One connection attempt to `addr` carrying `msg`: resolves, creates the QP,
    /// connects, and returns the QP with the event that answered (established or
    /// rejected, with the listener's private data).
    fn dial(
        &self,
        addr: SocketAddr,
        send_cq: &RdmaCq,
        recv_cq: &RdmaCq,
        opts: &QpOptions,
        msg: &Msg,
        deadline: Instant,
    ) -> Result<(RdmaQp, Event)> {
        let (ch, id) = new_id()?;
        // Owns id and channel from here (its Drop tears them down on error).
        let mut qp = RdmaQp::new(id, ch, addr, opts, (send_cq, recv_cq), self);
        let mut sin = sockaddr(addr)?;
        let ms = deadline.saturating_duration_since(Instant::now()).as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: `id` is live; `sin` is valid for the call.
        if unsafe { sys::rdma_resolve_addr(id, ptr::null_mut(), (&mut sin as *mut libc::sockaddr_in).cast(), ms) } != 0 {
            return Err(verbs_err("rdma_resolve_addr"));
        }
        expect_event(ch, sys::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED, deadline, "address resolution")?;
        set_ack_timeout(id);
        // SAFETY: the address is resolved.
        if unsafe { sys::rdma_resolve_route(id, ms) } != 0 {
            return Err(verbs_err("rdma_resolve_route"));
        }
        expect_event(ch, sys::rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED, deadline, "route resolution")?;
        // SAFETY: resolved ids name their device's context.
        if unsafe { (*id).verbs } != self.0.ctx {
            return Err(FabricError::InvalidArgument("the peer is reached through another RDMA device than this PD's"));
        }
        qp.max_inline = create_qp(id, self.0.pd, send_cq, recv_cq, opts)?;
        let mut param = conn_param(opts);
        let b = msg.encode();
        param.private_data = b.as_ptr().cast();
        param.private_data_len = b.len() as u8;
        // SAFETY: `id` has a QP; `param` and the bytes it names are valid for the call.
        if unsafe { sys::rdma_connect(id, &mut param) } != 0 {
            return Err(verbs_err("rdma_connect"));
        }
        let e = next_event(ch, deadline.saturating_duration_since(Instant::now()))?;
        Ok((qp, e))
    }
}

pub(super) fn listen(pd: &RdmaPd, addr: SocketAddr, opts: &QpOptions) -> Result<RdmaListener> {
    let (ch, id) = new_id()?;
    let mut l = RdmaListener { id, ch, addr, pd: pd.clone(), opts: opts.clone(), challenges: Default::default() };
    let mut sin = sockaddr(addr)?;
    let fail = |source| FabricError::Listen { addr, source };
    // SAFETY: `id` is live; `sin` is a valid IPv4 sockaddr for the call.
    if unsafe { sys::rdma_bind_addr(id, (&mut sin as *mut libc::sockaddr_in).cast()) } != 0 {
        return Err(fail(io::Error::last_os_error()));
    }
    // SAFETY: bound above.
    if unsafe { sys::rdma_listen(id, 64) } != 0 {
        return Err(fail(io::Error::last_os_error()));
    }
    // SAFETY: bound; the port is in its source address.
    let port = unsafe { sys::rdma_get_src_port(id) };
    l.addr = SocketAddr::new(addr.ip(), u16::from_be(port));
    Ok(l)
}

/// Dials `addr` and runs the handshake; a connection the CM failed to set up
/// (`CONNECT_ERROR`, `UNREACHABLE`: on soft-RoCE now and then the dialer's move of
/// its QP to RTR/RTS fails) is dialed again, after a pause that doubles from 20 ms,
/// until `opts.connect_timeout`. Authentication failures are final.
pub(super) fn connect(pd: &RdmaPd, addr: SocketAddr, send_cq: &RdmaCq, recv_cq: &RdmaCq, opts: &QpOptions) -> Result<RdmaQp> {
    let deadline = Instant::now() + opts.connect_timeout;
    let mut pause = Duration::from_millis(20);
    loop {
        match connect_once(pd, addr, send_cq, recv_cq, opts, deadline) {
            Err((e, true)) if Instant::now() + pause < deadline => {
                let why = std::error::Error::source(&e).map_or_else(String::new, |s| format!(": {s}"));
                eps_fabric::stats::warn(&format!("eps: rdma: {e}{why}; dialing {addr} again in {} ms", pause.as_millis()));
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            r => return r.map_err(|(e, _)| e),
        }
    }
}

/// One dial and handshake; on error, whether dialing again may succeed.
fn connect_once(
    pd: &RdmaPd,
    addr: SocketAddr,
    send_cq: &RdmaCq,
    recv_cq: &RdmaCq,
    opts: &QpOptions,
    deadline: Instant,
) -> std::result::Result<RdmaQp, (FabricError, bool)> {
    use sys::rdma_cm_event_type::{
        RDMA_CM_EVENT_CONNECT_ERROR as CONNECT_ERROR, RDMA_CM_EVENT_ESTABLISHED as ESTABLISHED,
        RDMA_CM_EVENT_REJECTED as REJECTED, RDMA_CM_EVENT_UNREACHABLE as UNREACHABLE,
    };
    let fin = |e: FabricError| (e, false);
    let peer = addr.to_string();
    let auth = |reason| FabricError::AuthFailed { peer: peer.clone(), reason };
    let unexpected = |e: &Event| {
        let err = FabricError::Connect {
            peer: peer.clone(),
            stage: "the handshake",
            source: io::Error::other(format!("rdma_cm event {} (status {})", e.kind, e.status)),
        };
        (err, matches!(e.kind, CONNECT_ERROR | UNREACHABLE))
    };
    // 1. Hello: answered by a challenge (see handshake.rs).
    let nonce_c = eps_fabric::auth::nonce().map_err(FabricError::Engine).map_err(fin)?;
    let hello = Msg::Hello { nonce_c, max_msg: opts.max_msg_bytes };
    let (first, e) = pd.dial(addr, send_cq, recv_cq, opts, &hello, deadline).map_err(fin)?;
    drop(first);
    let nonce_s = match (e.kind, Msg::decode(&e.private)) {
        (REJECTED, Some(Msg::Challenge { nonce_s })) => nonce_s,
        (REJECTED, Some(Msg::Denied)) => return Err(fin(auth("the listener refused the connection"))),
        (ESTABLISHED, _) => return Err(fin(auth("the listener accepted without the handshake"))),
        _ => return Err(unexpected(&e)),
    };
    // 2. The proof; the listener's comes back with its accept.
    let proof_c = handshake::proof_c(&opts.secret, &nonce_c, &nonce_s);
    let (mut qp, e) = pd.dial(addr, send_cq, recv_cq, opts, &Msg::Proof { nonce_s, proof_c }, deadline).map_err(fin)?;
    let want = handshake::proof_s(&opts.secret, &nonce_c, &nonce_s);
    match (e.kind, Msg::decode(&e.private)) {
        (ESTABLISHED, Some(Msg::Accepted { proof_s, max_msg })) if eps_fabric::auth::proofs_equal(&proof_s, &want) => {
            qp.peer_max_msg = max_msg;
            qp.attach();
            Ok(qp)
        }
        (ESTABLISHED, _) => Err(fin(auth("the listener did not prove the job secret"))),
        (REJECTED, Some(Msg::Denied)) => Err(fin(auth("the listener refused the proof (a different job secret?)"))),
        _ => Err(unexpected(&e)),
    }
}
