//! The verbs-semantics API every provider implements.
//!
//! The shape follows libibverbs: a device context hands out protection domains; a
//! protection domain registers memory (returning lkey/rkey) and owns queue pairs;
//! queue pairs carry work requests whose completions land on completion queues.
//! Server and worker code written against these traits runs unchanged on every
//! provider.

use std::net::SocketAddr;
use std::time::Duration;

use crate::error::{Result, WcStatus};

/// Access rights of a memory region (bit set, like `ibv_access_flags`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Access(u8);

impl Access {
    /// Local reads only (every region allows them).
    pub const NONE: Access = Access(0);
    /// The local HCA may write the region (needed for RECV and READ targets).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Peers may RDMA WRITE into the region.
    pub const REMOTE_WRITE: Access = Access(2);
    /// Peers may RDMA READ from the region.
    pub const REMOTE_READ: Access = Access(4);
    /// All of the above.
    pub const ALL: Access = Access(7);

    /// True if every bit of `other` is set here.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// Raw bits.
    pub fn bits(self) -> u8 {
        self.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

/// A registered memory region.
pub trait MemoryRegion: Send + Sync + std::fmt::Debug {
    /// Key for local SGEs.
    fn lkey(&self) -> u32;
    /// Key peers name in RDMA operations.
    fn rkey(&self) -> u32;
    /// Virtual address of the first byte, as peers name it in RDMA operations.
    fn addr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Never true: a region holds at least one byte.
    fn is_empty(&self) -> bool {
        false
    }
    /// Access rights.
    fn access(&self) -> Access;
    /// Copies `out.len()` bytes at `offset` out of the region. Bytes that an operation
    /// in flight is writing may be torn, exactly as with a NIC's DMA.
    fn read_at(&self, offset: usize, out: &mut [u8]);
    /// Copies `data` into the region at `offset`.
    fn write_at(&mut self, offset: usize, data: &[u8]);
    /// The remote address of `offset` within this region, for handing to a peer.
    fn remote(&self, offset: u64) -> RemoteAddr {
        RemoteAddr { addr: self.addr() + offset, rkey: self.rkey() }
    }
}

/// A slice of a registered region named in a work request.
#[derive(Debug)]
pub struct Sge<'a, M> {
    /// The region.
    pub mr: &'a M,
    /// Byte offset within the region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
}

impl<M> Clone for Sge<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<M> Copy for Sge<'_, M> {}

impl<'a, M: MemoryRegion> Sge<'a, M> {
    /// An SGE covering `len` bytes at `offset` of `mr`.
    pub fn new(mr: &'a M, offset: u64, len: u32) -> Self {
        Self { mr, offset, len }
    }
    /// An SGE covering the whole region.
    pub fn whole(mr: &'a M) -> Self {
        Self { mr, offset: 0, len: mr.len() as u32 }
    }
}

/// Remote memory named by a peer's virtual address and rkey.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteAddr {
    /// Virtual address in the peer's region.
    pub addr: u64,
    /// The peer region's rkey.
    pub rkey: u32,
}

/// What a send-queue work request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided send; consumes a RECV at the peer.
    Send,
    /// One-sided write into peer memory.
    Write(RemoteAddr),
    /// One-sided write that also consumes a RECV at the peer and delivers `imm` there.
    WriteImm(RemoteAddr, u32),
    /// One-sided read of peer memory into the local SGEs.
    Read(RemoteAddr),
}

/// A send-queue work request.
#[derive(Debug)]
pub struct SendWr<'a, M> {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// Local scatter/gather list (gather for SEND/WRITE, scatter for READ).
    pub sg: &'a [Sge<'a, M>],
    /// Whether a successful completion is reported (errors always are).
    pub signaled: bool,
}

/// A receive-queue work request.
#[derive(Debug)]
pub struct RecvWr<'a, M> {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND is scattered (may be empty for WRITE_IMM-only use).
    pub sg: &'a [Sge<'a, M>],
}

/// Opcode of a completion (like `ibv_wc_opcode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    /// A SEND completed at the requester.
    Send,
    /// A WRITE or WRITE_IMM completed at the requester.
    Write,
    /// A READ completed at the requester.
    Read,
    /// A SEND arrived into a posted RECV.
    Recv,
    /// A WRITE_IMM arrived and consumed a posted RECV.
    RecvWithImm,
}

/// A work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The work request's `wr_id`.
    pub wr_id: u64,
    /// Status.
    pub status: WcStatus,
    /// Opcode (for flushed requests: the opcode of the request that was flushed).
    pub opcode: WcOpcode,
    /// Bytes transferred (received bytes for RECV completions).
    pub byte_len: u32,
    /// Immediate data of a WRITE_IMM (RecvWithImm only).
    pub imm: Option<u32>,
    /// Number of the local QP.
    pub qp_num: u32,
}

impl Completion {
    /// An all-zero completion, for sizing poll buffers.
    pub const EMPTY: Completion =
        Completion { wr_id: 0, status: WcStatus::Success, opcode: WcOpcode::Send, byte_len: 0, imm: None, qp_num: 0 };
}

/// State of a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Ready to send and receive.
    ReadyToSend,
    /// An error happened; outstanding and new work requests complete with `WrFlush`.
    Error,
}

/// The job secret peers prove knowledge of before any memory becomes reachable.
/// Its `Debug` output never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// Wraps secret bytes (at least 1).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self> {
        let b = bytes.into();
        if b.is_empty() {
            return Err(crate::FabricError::InvalidArgument("the job secret is empty"));
        }
        Ok(Self(b))
    }
    /// The bytes, for the authentication code only.
    pub(crate) fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Sizes and timeouts of a queue pair.
#[derive(Clone, Debug)]
pub struct QpOptions {
    /// Job secret both peers must hold.
    pub secret: Secret,
    /// Send-queue depth (outstanding send work requests).
    pub max_send_wr: u32,
    /// Receive-queue depth.
    pub max_recv_wr: u32,
    /// Most SGEs per work request.
    pub max_sge: u32,
    /// Largest message this QP accepts or sends, in bytes.
    pub max_msg_bytes: u32,
    /// How long a SEND or WRITE_IMM waits at the responder for a RECV to be posted
    /// (`None`: forever, like `rnr_retry = 7`).
    pub rnr_timeout: Option<Duration>,
    /// Time allowed for TCP connect plus the authentication handshake.
    pub connect_timeout: Duration,
    /// How long requests outstanding on the QP may go without any progress
    /// (bytes taken by the peer, or a response) before the oldest completes
    /// with `RetryExceeded` and the QP moves to the error state, as an RC QP's
    /// retry timer does with a peer that stopped without closing (`None`:
    /// forever). The soft provider honours it; NICs have their own timers.
    pub ack_timeout: Option<Duration>,
}

impl QpOptions {
    /// Defaults for the given secret: depth 128/128, 4 SGEs, 1 GiB messages.
    pub fn new(secret: Secret) -> Self {
        Self {
            secret,
            max_send_wr: 128,
            max_recv_wr: 128,
            max_sge: 4,
            max_msg_bytes: 1 << 30,
            rnr_timeout: None,
            connect_timeout: Duration::from_secs(10),
            ack_timeout: Some(Duration::from_secs(30)),
        }
    }
}

/// A completion queue.
pub trait CompletionQueue: Send + Sync + std::fmt::Debug {
    /// Reaps up to `out.len()` completions into `out`, driving the requester side of
    /// the QPs attached to it from the caller's thread. Returns how many were written.
    fn poll(&self, out: &mut [Completion]) -> Result<usize>;

    /// Sleeps until a completion may be ready or `timeout` passes, for callers that
    /// would rather not spin. Completions a responder delivers (incoming SEND and
    /// WRITE_IMM) wake it at once; requester completions are found by the next poll.
    fn wait(&self, timeout: std::time::Duration);
}

/// A reliable connected queue pair.
pub trait QueuePair: Send + Sync + std::fmt::Debug {
    /// The provider's memory region type.
    type Mr: MemoryRegion;
    /// Posts a send-queue work request; transmission starts from the caller's thread.
    /// Errors in the request itself (bad SGE, protection) come back as completions.
    fn post_send(&self, wr: &SendWr<'_, Self::Mr>) -> Result<()>;
    /// Posts a receive buffer.
    fn post_recv(&self, wr: &RecvWr<'_, Self::Mr>) -> Result<()>;
    /// The QP number.
    fn qp_num(&self) -> u32;
    /// Current state.
    fn state(&self) -> QpState;
    /// Address of the peer.
    fn peer_addr(&self) -> SocketAddr;
}

/// Accepts incoming queue-pair connections (like an rdma_cm listener).
pub trait Listener: Send + Sync + std::fmt::Debug {
    /// The provider's queue pair type.
    type Qp: QueuePair;
    /// The provider's completion queue type.
    type Cq: CompletionQueue;
    /// The bound address.
    fn local_addr(&self) -> SocketAddr;
    /// Waits up to `timeout` for one authenticated peer and returns its QP, whose
    /// completions go to `send_cq` and `recv_cq`.
    fn accept(&self, send_cq: &Self::Cq, recv_cq: &Self::Cq, timeout: Duration) -> Result<Self::Qp>;

    /// As [`Listener::accept`], calling `prepare` on the QP before the peer can
    /// send on it, so that the receives it posts are in place for the peer's
    /// first messages: a SEND that finds none waits for the receiver-not-ready
    /// retries of the transport (on real NICs milliseconds each; some soft-RoCE
    /// kernels never resend). An error from `prepare` refuses the peer. By
    /// default `prepare` runs right after `accept`; providers whose peers may send
    /// at once override it.
    fn accept_prepared(
        &self,
        send_cq: &Self::Cq,
        recv_cq: &Self::Cq,
        timeout: Duration,
        prepare: &mut dyn FnMut(&Self::Qp) -> Result<()>,
    ) -> Result<Self::Qp> {
        let qp = self.accept(send_cq, recv_cq, timeout)?;
        prepare(&qp)?;
        Ok(qp)
    }
}

/// A protection domain: registers memory and creates queue pairs. Memory of one
/// domain is not reachable through a QP of another.
pub trait ProtectionDomain: Send + Sync {
    /// Memory region type.
    type Mr: MemoryRegion;
    /// Completion queue type.
    type Cq: CompletionQueue;
    /// Queue pair type.
    type Qp: QueuePair<Mr = Self::Mr>;
    /// Listener type.
    type Listener: Listener<Qp = Self::Qp, Cq = Self::Cq>;
    /// Registers `buf` (taking ownership) with the given access rights.
    fn register(&self, buf: crate::RegionBuf, access: Access) -> Result<Self::Mr>;
    /// Allocates `len` zeroed bytes and registers them.
    fn alloc_mr(&self, len: usize, access: Access) -> Result<Self::Mr> {
        self.register(crate::RegionBuf::new(len)?, access)
    }
    /// Creates a completion queue holding up to `depth` completions.
    fn create_cq(&self, depth: u32) -> Result<Self::Cq>;
    /// Listens for queue-pair connections on `addr`.
    fn listen(&self, addr: SocketAddr, opts: &QpOptions) -> Result<Self::Listener>;
    /// Connects a queue pair to a listener at `addr`.
    fn connect(&self, addr: SocketAddr, send_cq: &Self::Cq, recv_cq: &Self::Cq, opts: &QpOptions) -> Result<Self::Qp>;
}

/// A memory region in host memory, which the CPU may read and write in place
/// (aggregation, the optimizer, a worker's compute) between transfers.
///
/// The roles reach its bytes through safe calls only: copies
/// ([`MemoryRegion::read_at`], [`MemoryRegion::write_at`]), and views
/// ([`HostRegion::view`], [`HostRegion::view_mut`]) of regions that nothing but
/// their owner can write: registered with neither [`Access::LOCAL_WRITE`] nor
/// [`Access::REMOTE_WRITE`]. Memory a peer or an operation in flight may write
/// (a landing slot, a receive buffer) is copied out, never viewed: a value that
/// is checked and then used cannot change in between.
///
/// # Safety
/// Implementors guarantee that `access()` is enforced: no operation of the
/// provider writes a region registered with neither `LOCAL_WRITE` nor
/// `REMOTE_WRITE` (a local RECV or READ into it, a peer's WRITE or SEND), so its
/// only writer is its owner through `&mut self`; that `as_slice` covers the live
/// mapping for as long as the borrow of `self`; and that `is_host` is false for
/// memory the CPU cannot address (a device's).
pub unsafe trait HostRegion: MemoryRegion {
    /// The region's bytes.
    ///
    /// # Safety
    /// No operation that writes this region (a peer's WRITE, an incoming SEND, a local
    /// READ or RECV) may be in flight while the slice lives.
    unsafe fn as_slice(&self) -> &[u8];

    /// The region's bytes, mutably.
    ///
    /// # Safety
    /// No operation that reads or writes this region may be in flight while the slice lives.
    unsafe fn as_mut_slice(&mut self) -> &mut [u8];

    /// The address of the first byte, for a foreign-function edge that hands
    /// the memory to code outside Rust (a framework's tensors over the C ABI);
    /// null for memory the CPU cannot address. Getting it is safe; what is
    /// read or written through it is the edge's business.
    fn as_mut_ptr(&self) -> *mut u8;

    /// The region's memory as a span, whatever its access.
    ///
    /// # Safety
    /// Implementors: the span keeps the memory allocated at its address while it
    /// lives. Callers: the region is not one that has views (see
    /// [`HostRegion::span`]).
    unsafe fn span_unchecked(&self) -> crate::Span;

    /// The region's memory, for a device that uses it after the call that hands
    /// it over returns (see [`crate::Span`]): it stays allocated while the span
    /// lives, even once the region is dropped. Refused for host memory that only
    /// its owner writes, which has views: a region is either viewed by its owner
    /// or lent to devices, never both (register it with LOCAL_WRITE when a device
    /// writes it).
    fn span(&self) -> Result<crate::Span> {
        if self.is_host() && owner_only(self).is_ok() {
            return Err(crate::FabricError::InvalidArgument(
                "a region only its owner writes has views and is not lent to devices: register it with LOCAL_WRITE",
            ));
        }
        // SAFETY: a region with views is refused above.
        Ok(unsafe { self.span_unchecked() })
    }

    /// Whether the bytes are host memory the CPU addresses (false: a device's
    /// memory, reached with `read_at`/`write_at` only).
    fn is_host(&self) -> bool {
        true
    }

    /// The bytes of a region that only its owner writes (see the trait's docs).
    ///
    /// Fails for a region registered with `LOCAL_WRITE` or `REMOTE_WRITE`, whose
    /// bytes an operation or a peer may change under the view: copy them out with
    /// `read_at` instead.
    fn view(&self) -> Result<&[u8]> {
        owner_only(self)?;
        // SAFETY: nothing but the owner writes this region (the trait's contract
        // for a region without LOCAL_WRITE or REMOTE_WRITE, checked above), and the
        // owner writes only through `&mut self`, which this borrow excludes.
        // Operations in flight and peers only read it, as a NIC's DMA reads.
        Ok(unsafe { self.as_slice() })
    }

    /// The bytes of a region that only its owner writes, mutably (see
    /// [`HostRegion::view`]).
    ///
    /// Operations in flight may still read the bytes (a WRITE from the region, a
    /// peer's READ), as a NIC reads by DMA, outside any reference of this
    /// process: a read that races the owner's writes sees torn bytes, which the
    /// protocols built on it exclude for the bytes they rely on (version stamps).
    fn view_mut(&mut self) -> Result<&mut [u8]> {
        owner_only(self)?;
        // SAFETY: as in `view`; `&mut self` excludes every other local reference.
        Ok(unsafe { self.as_mut_slice() })
    }
}

/// Refuses a view of a region that something but its owner may write.
fn owner_only<M: HostRegion + ?Sized>(mr: &M) -> Result<()> {
    if !mr.is_host() {
        return Err(crate::FabricError::InvalidArgument("a device's memory has no host view: copy it with read_at"));
    }
    if mr.access().contains(Access::LOCAL_WRITE) || mr.access().contains(Access::REMOTE_WRITE) {
        return Err(crate::FabricError::InvalidArgument(
            "a region that operations or peers may write has no view: copy it out with read_at",
        ));
    }
    Ok(())
}

/// Everything the server and worker roles need of a provider: a protection domain
/// that can be shared between threads, whose regions are host memory and whose
/// completion queues and listeners may move to threads of their own. Every
/// provider's protection domain is one (`SoftPd`, `RdmaPd`).
pub trait Fabric:
    ProtectionDomain<Mr: HostRegion + 'static, Cq: Clone + 'static, Qp: 'static, Listener: 'static> + Clone + 'static
{
    /// The provider's name, for logs (`soft`, `rdma`).
    const NAME: &'static str;
}
