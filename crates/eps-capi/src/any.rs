//! A worker on whichever transport was chosen: `soft` and `shm` always, `rdma`
//! when this library is built with the `rdma` feature and a device is usable.

use std::ops::Range;

use ::eps_worker as lib;
use eps_agg::DType;
use eps_fabric::prelude::*;
use eps_proto::JobSpec;
use eps_proto::layout::Layout;
use eps_proto::membership::Membership;
use lib::{Registration, Worker, WorkerConfig, WorkerError, WorkerStats};

use crate::status::{Res, eps_status::*, fail};

/// The transport a worker asked for (`eps_worker_options`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Transport {
    /// `soft`, `shm`, `rdma` or `auto`.
    pub kind: String,
    /// RDMA device, port and GID index (None: the fixed rule, after `EPS_RDMA_*`).
    pub device: Option<String>,
    pub port: Option<u8>,
    pub gid_index: Option<u32>,
}

/// A worker on one of the providers.
pub(crate) enum AnyWorker {
    Soft(Worker<SoftPd>),
    Shm(Worker<eps_fabric::shm::ShmPd>),
    Mixed(Worker<eps_fabric::mixed::MixedPd>),
    #[cfg(feature = "rdma")]
    Rdma(Worker<eps_rdma::RdmaPd>),
}

macro_rules! on {
    ($self:expr, $w:ident => $body:expr) => {
        match $self {
            AnyWorker::Soft($w) => $body,
            AnyWorker::Shm($w) => $body,
            AnyWorker::Mixed($w) => $body,
            #[cfg(feature = "rdma")]
            AnyWorker::Rdma($w) => $body,
        }
    };
}

/// Joins on `pd`, with the caller's buffers if given.
///
/// # Safety
/// When `borrowed` is given: both buffers hold `len` bytes and stay valid,
/// and are not freed, until the worker is closed (see
/// `eps_fabric::RegionBuf::borrowed`).
unsafe fn join_on<P: Fabric>(
    cfg: &WorkerConfig,
    reg: Registration,
    pd: P,
    borrowed: Option<(*mut u8, *mut u8, usize)>,
) -> Result<Worker<P>, WorkerError> {
    match borrowed {
        Some((p, g, len)) => {
            // SAFETY: the caller's contract, passed on: both buffers stay
            // valid until the worker is closed (which waits until nothing
            // is in flight).
            let (p, g) = unsafe { (eps_fabric::RegionBuf::borrowed(p, len)?, eps_fabric::RegionBuf::borrowed(g, len)?) };
            Worker::join_borrowed(cfg, reg, pd, p, g)
        }
        None => Worker::join_on(cfg, reg, pd),
    }
}

fn soft(cfg: &WorkerConfig, reg: Registration, borrowed: Option<(*mut u8, *mut u8, usize)>) -> Res<AnyWorker> {
    let pd = SoftDevice::open().map_err(WorkerError::from)?.alloc_pd();
    // SAFETY: the caller's contract (see `AnyWorker::join`).
    Ok(AnyWorker::Soft(unsafe { join_on(cfg, reg, pd, borrowed) }?))
}

fn shm(cfg: &WorkerConfig, reg: Registration, borrowed: Option<(*mut u8, *mut u8, usize)>) -> Res<AnyWorker> {
    let pd = eps_fabric::shm::ShmDevice::open().map_err(WorkerError::from)?.alloc_pd();
    // SAFETY: the caller's contract (see `AnyWorker::join`).
    Ok(AnyWorker::Shm(unsafe { join_on(cfg, reg, pd, borrowed) }?))
}

/// `auto` without an RDMA device: shm to servers on this host, soft to the others.
fn mixed(cfg: &WorkerConfig, reg: Registration, borrowed: Option<(*mut u8, *mut u8, usize)>) -> Res<AnyWorker> {
    let pd = eps_fabric::mixed::MixedDevice::open().map_err(WorkerError::from)?.alloc_pd();
    // SAFETY: the caller's contract (see `AnyWorker::join`).
    Ok(AnyWorker::Mixed(unsafe { join_on(cfg, reg, pd, borrowed) }?))
}

#[cfg(feature = "rdma")]
fn rdma_selection(t: &Transport) -> Result<eps_rdma::Selection, String> {
    let choice = eps_rdma::DeviceChoice { device: t.device.clone(), port: t.port, gid_index: t.gid_index };
    let choice = choice.with_env().map_err(|e| e.to_string())?;
    eps_rdma::select(&choice).map_err(|e| e.to_string())
}

impl AnyWorker {
    /// Joins on the transport `t` asks for (`auto`: rdma when a device is
    /// usable, else soft).
    ///
    /// # Safety
    /// When `borrowed` is given: as `join_on`.
    pub(crate) unsafe fn join(
        t: &Transport,
        cfg: &WorkerConfig,
        reg: Registration,
        borrowed: Option<(*mut u8, *mut u8, usize)>,
    ) -> Res<Self> {
        match t.kind.as_str() {
            // SAFETY: the caller's contract, passed on.
            "soft" => soft(cfg, reg, borrowed),
            // SAFETY: the caller's contract, passed on.
            "shm" => shm(cfg, reg, borrowed),
            #[cfg(feature = "rdma")]
            "rdma" | "auto" => match rdma_selection(t) {
                Ok(sel) => {
                    let dev = eps_rdma::RdmaDevice::open(&sel.device)
                        .map_err(|e| fail(EPS_ERR_FABRIC, format!("{}: {e}", sel.device)))?;
                    let pd = dev.alloc_pd().map_err(|e| fail(EPS_ERR_FABRIC, format!("{}: {e}", sel.device)))?;
                    // SAFETY: the caller's contract, passed on.
                    Ok(AnyWorker::Rdma(unsafe { join_on(cfg, reg, pd, borrowed) }?))
                }
                Err(e) if t.kind == "rdma" => Err(fail(EPS_ERR_FABRIC, format!("transport rdma: {e}"))),
                // SAFETY: the caller's contract, passed on.
                Err(_) => mixed(cfg, reg, borrowed),
            },
            #[cfg(not(feature = "rdma"))]
            "rdma" => Err(fail(EPS_ERR_UNSUPPORTED, "this libeps was built without the rdma transport (feature `rdma`)")),
            #[cfg(not(feature = "rdma"))]
            // SAFETY: the caller's contract, passed on.
            _ => mixed(cfg, reg, borrowed),
            #[cfg(feature = "rdma")]
            other => Err(fail(EPS_ERR_INVALID_ARGUMENT, format!("transport {other:?}: use soft, shm, rdma or auto"))),
        }
    }

    /// `"soft"`, `"shm"`, `"soft+shm"` (auto, per connection) or `"rdma"`.
    pub(crate) fn transport(&self) -> &'static std::ffi::CStr {
        match self {
            AnyWorker::Soft(_) => c"soft",
            AnyWorker::Shm(_) => c"shm",
            AnyWorker::Mixed(_) => c"soft+shm",
            #[cfg(feature = "rdma")]
            AnyWorker::Rdma(_) => c"rdma",
        }
    }

    pub(crate) fn tensor_count(&self) -> usize {
        on!(self, w => w.tensor_count())
    }
    pub(crate) fn layout(&self) -> &Layout {
        on!(self, w => w.layout())
    }
    pub(crate) fn spec(&self) -> &JobSpec {
        on!(self, w => w.spec())
    }
    pub(crate) fn rank(&self) -> u32 {
        on!(self, w => w.rank())
    }
    pub(crate) fn iteration(&self) -> u64 {
        on!(self, w => w.iteration())
    }
    pub(crate) fn timeout(&self) -> std::time::Duration {
        on!(self, w => w.timeout())
    }
    pub(crate) fn dtype(&self) -> DType {
        on!(self, w => w.dtype())
    }
    /// The parameter buffer's address, handed to C in place.
    pub(crate) fn params_ptr(&self) -> *mut u8 {
        on!(self, w => w.params_ptr())
    }
    pub(crate) fn grads_bytes_mut(&mut self) -> &mut [u8] {
        on!(self, w => w.grads_bytes_mut())
    }
    pub(crate) fn membership(&self) -> &Membership {
        on!(self, w => w.membership())
    }
    pub(crate) fn samples(&self, batch: u64) -> Option<Range<u64>> {
        on!(self, w => w.samples(batch))
    }
    pub(crate) fn stats(&self) -> WorkerStats {
        on!(self, w => w.stats())
    }
    pub(crate) fn in_round(&self) -> bool {
        on!(self, w => w.in_round())
    }
    pub(crate) fn is_pushed(&self, i: usize) -> bool {
        on!(self, w => w.is_pushed(i))
    }
    pub(crate) fn begin(&mut self) -> Result<bool, WorkerError> {
        on!(self, w => w.begin())
    }
    pub(crate) fn push_tensors(&mut self, ids: &[usize]) -> Result<(), WorkerError> {
        on!(self, w => w.push_tensors(ids))
    }
    pub(crate) fn pushes_sent(&mut self, ids: &[usize]) -> Result<bool, WorkerError> {
        on!(self, w => w.pushes_sent(ids))
    }
    pub(crate) fn test_pull(&mut self, ids: &[usize]) -> Result<bool, WorkerError> {
        on!(self, w => w.test_pull(ids))
    }
    pub(crate) fn push_pull(&mut self) -> Result<(), WorkerError> {
        on!(self, w => w.push_pull())
    }
    pub(crate) fn finish_in_place(&mut self) -> Result<WorkerStats, WorkerError> {
        on!(self, w => w.finish_in_place())
    }
    pub(crate) fn leave(&mut self) -> Result<(), WorkerError> {
        on!(self, w => w.leave())
    }
    pub(crate) fn quiesce(&mut self) -> Result<(), WorkerError> {
        on!(self, w => w.quiesce())
    }
    pub(crate) fn table(&self, name: &str) -> Result<u16, WorkerError> {
        on!(self, w => w.table(name))
    }
    pub(crate) fn table_dim(&self, table: u16) -> Result<usize, WorkerError> {
        on!(self, w => w.table_dim(table))
    }
    pub(crate) fn sparse_pull(&mut self, table: u16, keys: &[u64], out: &mut [f32]) -> Result<(), WorkerError> {
        on!(self, w => w.sparse_pull(table, keys, out))
    }
    /// A pull's distinct rows (where they lie in the worker's registered
    /// buffer, and how many) with each key's row index written into `index`.
    pub(crate) fn sparse_pull_rows(
        &mut self,
        table: u16,
        keys: &[u64],
        index: &mut [u32],
    ) -> Result<(*const f32, usize), WorkerError> {
        on!(self, w => {
            let p = w.sparse_pull_rows(table, keys)?;
            index.copy_from_slice(&p.index);
            Ok((p.rows.as_ptr(), p.rows.len() / p.dim.max(1)))
        })
    }
    pub(crate) fn sparse_push(&mut self, table: u16, keys: &[u64], grads: &[f32]) -> Result<(), WorkerError> {
        on!(self, w => w.sparse_push(table, keys, grads))
    }
    pub(crate) fn sparse_flush(&mut self, table: u16) -> Result<(), WorkerError> {
        on!(self, w => w.sparse_flush(table))
    }
}
