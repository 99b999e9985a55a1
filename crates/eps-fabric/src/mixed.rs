//! `auto` between providers, chosen per connection: `shm` to a peer on this
//! host, `soft` (TCP) to any other.
//!
//! One registration table serves both, so a region registered once is reachable
//! by every QP of the domain; regions are memfd-backed, so shm peers can map
//! them. The listener takes TCP dialers on its address and shm dialers on the
//! abstract socket named after it; a dialer first tries the shm listener of the
//! address (there is one only if the listener is on this host, in this network
//! namespace) and otherwise dials TCP.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::*;
use crate::error::{FabricError, Result};
use crate::mem::RegionBuf;
use crate::shm::{ShmDevice, ShmListener, ShmPd, ShmQp};
use crate::soft::{MrTable, SoftCq, SoftDevice, SoftListener, SoftMr, SoftPd, SoftQp};

/// A device with both providers over one registration table.
#[derive(Clone, Debug)]
pub struct MixedDevice {
    soft: SoftDevice,
    shm: ShmDevice,
}

impl MixedDevice {
    /// Opens both providers' progress threads.
    pub fn open() -> Result<Self> {
        let mrs = Arc::new(MrTable::default());
        Ok(Self { soft: SoftDevice::open_with(mrs.clone())?, shm: ShmDevice::open_with(mrs)? })
    }

    /// Allocates a protection domain (one number for both providers).
    pub fn alloc_pd(&self) -> MixedPd {
        let pd = crate::soft::next_pd();
        MixedPd { soft: self.soft.pd_numbered(pd), shm: self.shm.pd_numbered(pd) }
    }
}

/// A protection domain whose QPs are shm or soft, per peer.
#[derive(Clone, Debug)]
pub struct MixedPd {
    soft: SoftPd,
    shm: ShmPd,
}

/// A QP of either provider.
#[derive(Debug)]
pub enum MixedQp {
    /// To a peer on another host (or in another network namespace).
    Soft(SoftQp),
    /// To a peer on this host.
    Shm(ShmQp),
}

impl MixedQp {
    /// `"soft"` or `"shm"`.
    pub fn provider(&self) -> &'static str {
        match self {
            MixedQp::Soft(_) => "soft",
            MixedQp::Shm(_) => "shm",
        }
    }
}

macro_rules! on {
    ($self:expr, $q:ident => $body:expr) => {
        match $self {
            MixedQp::Soft($q) => $body,
            MixedQp::Shm($q) => $body,
        }
    };
}

impl QueuePair for MixedQp {
    type Mr = SoftMr;
    fn post_send(&self, wr: &SendWr<'_, SoftMr>) -> Result<()> {
        on!(self, q => q.post_send(wr))
    }
    fn post_recv(&self, wr: &RecvWr<'_, SoftMr>) -> Result<()> {
        on!(self, q => q.post_recv(wr))
    }
    fn qp_num(&self) -> u32 {
        on!(self, q => q.qp_num())
    }
    fn state(&self) -> QpState {
        on!(self, q => q.state())
    }
    fn peer_addr(&self) -> SocketAddr {
        on!(self, q => q.peer_addr())
    }
}

/// Listens for both: TCP on its address, shm on the abstract socket named after it.
#[derive(Debug)]
pub struct MixedListener {
    soft: SoftListener,
    shm: ShmListener,
}

/// How long each provider's listener is watched before the other's turn.
const TURN: Duration = Duration::from_millis(5);

impl Listener for MixedListener {
    type Qp = MixedQp;
    type Cq = SoftCq;

    fn local_addr(&self) -> SocketAddr {
        self.soft.local_addr()
    }

    fn accept(&self, send_cq: &SoftCq, recv_cq: &SoftCq, timeout: Duration) -> Result<MixedQp> {
        self.accept_prepared(send_cq, recv_cq, timeout, &mut |_| Ok(()))
    }

    fn accept_prepared(
        &self,
        send_cq: &SoftCq,
        recv_cq: &SoftCq,
        timeout: Duration,
        prepare: &mut dyn FnMut(&MixedQp) -> Result<()>,
    ) -> Result<MixedQp> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(FabricError::Timeout("a queue-pair connection"));
            }
            match self.shm.accept_unready(send_cq, recv_cq, left.min(TURN)) {
                Ok(q) => {
                    let qp = MixedQp::Shm(q);
                    prepare(&qp)?;
                    let MixedQp::Shm(q) = &qp else { unreachable!("built as shm just above") };
                    self.shm.ready(q)?;
                    return Ok(qp);
                }
                Err(FabricError::Timeout(_)) => {}
                Err(e) => return Err(e),
            }
            match self.soft.accept(send_cq, recv_cq, Duration::from_millis(1)) {
                Ok(q) => {
                    let qp = MixedQp::Soft(q);
                    prepare(&qp)?;
                    return Ok(qp);
                }
                Err(FabricError::Timeout(_)) => {}
                Err(e) => return Err(e),
            }
        }
    }
}

impl Fabric for MixedPd {
    const NAME: &'static str = "soft+shm";
}

impl ProtectionDomain for MixedPd {
    type Mr = SoftMr;
    type Cq = SoftCq;
    type Qp = MixedQp;
    type Listener = MixedListener;

    fn register(&self, buf: RegionBuf, access: Access) -> Result<SoftMr> {
        self.soft.register(buf, access)
    }

    /// Allocates `len` zeroed bytes in a sealed memfd, so shm peers can map them.
    fn alloc_mr(&self, len: usize, access: Access) -> Result<SoftMr> {
        self.soft.register(RegionBuf::shared(len)?, access)
    }

    fn create_cq(&self, depth: u32) -> Result<SoftCq> {
        self.soft.create_cq(depth)
    }

    fn listen(&self, addr: SocketAddr, opts: &QpOptions) -> Result<MixedListener> {
        let soft = self.soft.listen(addr, opts)?;
        let shm = ShmListener::named(self.shm.clone(), soft.local_addr(), None, opts.clone())?;
        Ok(MixedListener { soft, shm })
    }

    fn connect(&self, addr: SocketAddr, send_cq: &SoftCq, recv_cq: &SoftCq, opts: &QpOptions) -> Result<MixedQp> {
        match crate::shm::dial_socket(addr) {
            Ok(sock) => crate::shm::dial_on(&self.shm, sock, addr, send_cq, recv_cq, opts).map(MixedQp::Shm),
            // No shm listener of this host has that address: the peer is elsewhere.
            Err(_) => self.soft.connect(addr, send_cq, recv_cq, opts).map(MixedQp::Soft),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait_ok(cq: &SoftCq) {
        let mut c = [Completion::EMPTY; 1];
        let end = Instant::now() + Duration::from_secs(10);
        while cq.poll(&mut c).unwrap() == 0 {
            assert!(Instant::now() < end, "no completion");
        }
        assert_eq!(c[0].status, crate::WcStatus::Success);
    }

    #[test]
    fn each_connection_takes_shm_on_this_host_and_soft_otherwise() {
        let o = QpOptions::new(Secret::new("mixed").unwrap());
        let pd = MixedDevice::open().unwrap().alloc_pd();
        let (cq, peer_cq) = (pd.create_cq(64).unwrap(), pd.create_cq(64).unwrap());
        let src = pd.alloc_mr(4096, Access::ALL).unwrap();
        let dst = pd.alloc_mr(4096, Access::ALL).unwrap();
        // A mixed peer of this host: shm, both ways.
        let other = MixedDevice::open().unwrap().alloc_pd();
        let l = other.listen("127.0.0.1:0".parse().unwrap(), &o).unwrap();
        let (a, b) = std::thread::scope(|s| {
            let h = s.spawn(|| l.accept(&peer_cq, &peer_cq, Duration::from_secs(20)).unwrap());
            (pd.connect(l.local_addr(), &cq, &cq, &o).unwrap(), h.join().unwrap())
        });
        assert_eq!((a.provider(), b.provider()), ("shm", "shm"));
        let dst_other = other.alloc_mr(4096, Access::ALL).unwrap();
        a.post_send(&SendWr { wr_id: 1, op: SendOp::Write(dst_other.remote(0)), sg: &[Sge::whole(&src)], signaled: true })
            .unwrap();
        wait_ok(&cq);
        // A soft-only listener (no shm socket): the mixed dialer goes over TCP.
        let soft = SoftDevice::open().unwrap().alloc_pd();
        let soft_cq = soft.create_cq(64).unwrap();
        let sl = soft.listen("127.0.0.1:0".parse().unwrap(), &o).unwrap();
        let q = std::thread::scope(|s| {
            let h = s.spawn(|| sl.accept(&soft_cq, &soft_cq, Duration::from_secs(20)).unwrap());
            let q = pd.connect(sl.local_addr(), &cq, &cq, &o).unwrap();
            drop(h.join().unwrap());
            q
        });
        assert_eq!(q.provider(), "soft");
        // A soft-only dialer reaches a mixed listener over TCP, and its WRITE lands.
        let ml = pd.listen("127.0.0.1:0".parse().unwrap(), &o).unwrap();
        let soft_src = soft.alloc_mr(4096, Access::ALL).unwrap();
        let (d, acc) = std::thread::scope(|s| {
            let h = s.spawn(|| ml.accept(&peer_cq, &peer_cq, Duration::from_secs(20)).unwrap());
            (soft.connect(ml.local_addr(), &soft_cq, &soft_cq, &o).unwrap(), h.join().unwrap())
        });
        assert_eq!(acc.provider(), "soft");
        d.post_send(&SendWr { wr_id: 2, op: SendOp::Write(dst.remote(0)), sg: &[Sge::whole(&soft_src)], signaled: true })
            .unwrap();
        wait_ok(&soft_cq);
    }
}
