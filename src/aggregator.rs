//! `--aggregator auto|cpu|cuda`: where a server sums contributions and applies
//! the optimizer. Taken from the flag, then `EPS_AGGREGATOR`, then the spec's
//! `job.aggregator`; `auto` (the default) takes a GPU when a driver and a device
//! are present (an eps built with `--features cuda`), else the CPU, and says which.
//!
//! On the `rdma` transport (an eps built with both features) a GPU server also
//! keeps its landing slots and published copies in GPU memory registered with
//! the NIC (GPUDirect RDMA) when the GPU, NIC and kernel allow it; otherwise, and
//! with `EPS_GPUDIRECT=0`, in page-locked host memory. It says which.

use std::sync::Arc;

use clap::builder::PossibleValue;
use eps_agg::{Aggregator, CpuAggregator, ShardDevice};

/// The `--aggregator` flag of `eps server` and `eps train`.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct AggregatorFlag {
    /// Where servers sum gradients and apply the optimizer: `cpu`, `cuda` (the
    /// first GPU, which then holds the shards' parameters and optimizer state;
    /// fails, saying why, when none is usable) or `auto` (a GPU when one is usable,
    /// else the CPU; it says which). On the rdma transport a GPU server also
    /// keeps its landing slots and published copies in GPU memory registered
    /// with the NIC (GPUDirect RDMA) where the GPU, NIC and kernel allow it
    /// (EPS_GPUDIRECT=0: in page-locked host memory). Default: EPS_AGGREGATOR,
    /// else the spec's job.aggregator, else auto.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new([
        PossibleValue::new("auto"),
        PossibleValue::new("cpu"),
        PossibleValue::new("cuda"),
        // The device path (shards' master copies and state in separate memory)
        // with host memory as the device: for tests of that path without a GPU.
        PossibleValue::new("host-device").hide(true),
        // As host-device, with the landing slots and published copies used in
        // place by the device (the GPUDirect path, with host memory).
        PossibleValue::new("host-direct").hide(true),
    ]))]
    pub aggregator: Option<String>,
}

/// `cpu` or `cuda`, as resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AggKind {
    /// CPU threads.
    Cpu,
    /// The first GPU, holding the shards' master copies and optimizer state.
    Cuda,
    /// The device path with host memory as the device (testing).
    HostDevice,
    /// As `HostDevice`, with the landing slots and published copies the
    /// device's own memory (the GPUDirect path, testing).
    HostDirect,
}

impl AggKind {
    /// `cpu` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            AggKind::Cpu => "cpu",
            AggKind::Cuda => "cuda",
            AggKind::HostDevice => "host-device",
            AggKind::HostDirect => "host-direct",
        }
    }
}

/// Whether a GPU can aggregate here, or why not: a driver and a device, and the
/// kernels give the CPU's bits on it (`CudaDevice::self_check`).
#[cfg(feature = "cuda")]
fn gpu() -> Result<String, String> {
    let info = eps_cuda::probe().map_err(|e| e.to_string())?;
    let d = eps_cuda::CudaDevice::open(info.ordinal).map_err(|e| format!("{info}: {e}"))?;
    d.self_check().map_err(|e| format!("{info}: {e}"))?;
    Ok(info.to_string())
}

#[cfg(not(feature = "cuda"))]
fn gpu() -> Result<String, String> {
    Err("this eps was built without CUDA support: rebuild it with `cargo build --release --features cuda`".into())
}

/// The aggregator asked for: the flag, else `EPS_AGGREGATOR`, else the
/// spec's, else `auto` (not probed).
pub fn requested(flag: &AggregatorFlag, spec: Option<&str>) -> String {
    let env = std::env::var("EPS_AGGREGATOR").ok().filter(|v| !v.is_empty());
    flag.aggregator.clone().or(env).or_else(|| spec.map(str::to_string)).unwrap_or_else(|| "auto".into())
}

/// Resolves the flag, `EPS_AGGREGATOR` and the spec's value (flag first).
pub fn choose(flag: &AggregatorFlag, spec: Option<&str>) -> Result<AggKind, String> {
    match requested(flag, spec).as_str() {
        "cpu" => Ok(AggKind::Cpu),
        "host-device" => Ok(AggKind::HostDevice),
        "host-direct" => Ok(AggKind::HostDirect),
        "cuda" => match gpu() {
            Ok(g) => {
                eps_proto::say!("eps: aggregating on {g}");
                Ok(AggKind::Cuda)
            }
            Err(e) => Err(format!("--aggregator cuda: {e}; use --aggregator cpu")),
        },
        "auto" => match gpu() {
            Ok(g) => {
                eps_proto::say!("eps: --aggregator auto: using {g}");
                Ok(AggKind::Cuda)
            }
            Err(e) => {
                eps_proto::say!("eps: --aggregator auto: using the CPU ({e})");
                Ok(AggKind::Cpu)
            }
        },
        other => Err(format!("unknown aggregator {other:?} (from EPS_AGGREGATOR or job.aggregator): use auto, cpu or cuda")),
    }
}

/// A server's math: the aggregator for shards in host memory, the device that
/// holds the shards instead, if any, and what its landing slots and published
/// copies may be.
#[derive(Clone, Debug)]
pub struct Built {
    /// The aggregator for shards in host memory.
    pub agg: Arc<dyn Aggregator>,
    /// The device holding the shards' master copies and state, if any.
    pub device: Option<Arc<dyn ShardDevice>>,
    kind: AggKind,
    #[cfg(feature = "cuda")]
    cuda: Option<eps_cuda::CudaDevice>,
}

/// The aggregator of `kind` (the CPU one with `threads` threads for shards in host
/// memory) and the device that holds the shards, if any.
pub fn build(kind: AggKind, threads: usize) -> Result<Built, String> {
    let agg: Arc<dyn Aggregator> = Arc::new(CpuAggregator::new(threads));
    let host = |device: Option<Arc<dyn ShardDevice>>| Built {
        agg: agg.clone(),
        device,
        kind,
        #[cfg(feature = "cuda")]
        cuda: None,
    };
    match kind {
        AggKind::Cpu => Ok(host(None)),
        AggKind::HostDevice | AggKind::HostDirect => Ok(host(Some(Arc::new(eps_agg::HostDevice)))),
        #[cfg(feature = "cuda")]
        AggKind::Cuda => {
            let d = eps_cuda::CudaDevice::open(0).map_err(|e| format!("the GPU: {e}"))?;
            Ok(Built { agg: agg.clone(), device: Some(Arc::new(d.clone())), kind, cuda: Some(d) })
        }
        #[cfg(not(feature = "cuda"))]
        AggKind::Cuda => Err(gpu().unwrap_err()),
    }
}

impl Built {
    /// The device's own memory for landing slots and published copies on any
    /// provider: only the host device's (for tests).
    pub fn direct<P: eps_fabric::Fabric>(&self) -> Option<Arc<dyn eps_server::DirectRegions<P>>> {
        (self.kind == AggKind::HostDirect).then(|| Arc::new(eps_server::HostRegions) as Arc<dyn eps_server::DirectRegions<P>>)
    }

    /// On the `rdma` provider: also GPU memory registered with the NIC
    /// (GPUDirect RDMA), when `EPS_GPUDIRECT` is not `0` and a trial region
    /// registers; says which memory it takes.
    #[cfg(feature = "rdma")]
    pub fn direct_rdma(&self, pd: &eps_rdma::RdmaPd) -> Option<Arc<dyn eps_server::DirectRegions<eps_rdma::RdmaPd>>> {
        #[cfg(feature = "cuda")]
        if let Some(d) = &self.cuda {
            return gpudirect::regions(d, pd);
        }
        let _ = pd;
        self.direct()
    }
}

/// GPU memory registered with the NIC for a server's landing slots and
/// published copies.
#[cfg(all(feature = "rdma", feature = "cuda"))]
mod gpudirect {
    use std::sync::Arc;

    use eps_fabric::{Access, FabricError};
    use eps_rdma::{RdmaMr, RdmaPd};
    use eps_server::DirectRegions;

    #[derive(Debug)]
    struct GpuRegions(Arc<eps_cuda::Gpu>);

    impl DirectRegions<RdmaPd> for GpuRegions {
        fn describe(&self) -> String {
            format!("memory of {} registered with the NIC through dmabuf (GPUDirect RDMA)", self.0.info())
        }
        fn alloc(&self, pd: &RdmaPd, bytes: usize, access: Access) -> Result<RdmaMr, FabricError> {
            let buf = eps_cuda::dmabuf::GpuBuffer::new(self.0.clone(), bytes)
                .map_err(|e| FabricError::Alloc { bytes: bytes as u64, source: std::io::Error::other(e.to_string()) })?;
            eps_cuda::dmabuf::register(pd, buf, access)
        }
    }

    /// The GPU's regions when a trial one registers (and `EPS_GPUDIRECT` is not
    /// `0`), saying why not otherwise.
    pub(super) fn regions(d: &eps_cuda::CudaDevice, pd: &RdmaPd) -> Option<Arc<dyn DirectRegions<RdmaPd>>> {
        if std::env::var("EPS_GPUDIRECT").is_ok_and(|v| v == "0") {
            eps_proto::say!("eps: EPS_GPUDIRECT=0: landing slots and published copies in page-locked host memory");
            return None;
        }
        let r = GpuRegions(d.gpu().clone());
        match r.alloc(pd, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE) {
            Ok(_) => {
                eps_proto::say!("eps: landing slots and published copies in {}", r.describe());
                Some(Arc::new(r))
            }
            Err(e) => {
                let why = std::error::Error::source(&e).map_or(e.to_string(), |s| format!("{e}: {s}"));
                eps_proto::say!("eps: no GPUDirect RDMA ({why}): landing slots and published copies in page-locked host memory");
                None
            }
        }
    }
}
