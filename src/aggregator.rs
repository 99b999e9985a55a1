//! `--aggregator auto|cpu|cuda`: where a server sums contributions and applies
//! the optimizer. Taken from the flag, then `EPS_AGGREGATOR`, then the spec's
//! `job.aggregator`; `auto` (the default) takes a GPU when a driver and a device
//! are present (an eps built with `--features cuda`), else the CPU, and says which.

use std::sync::Arc;

use clap::builder::PossibleValue;
use eps_agg::{Aggregator, CpuAggregator, ShardDevice};

/// The `--aggregator` flag of `eps server` and `eps train`.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct AggregatorFlag {
    /// Where servers sum gradients and apply the optimizer: `cpu`, `cuda` (the
    /// first GPU, which then holds the shards' parameters and optimizer state;
    /// fails, saying why, when none is usable) or `auto` (a GPU when one is usable,
    /// else the CPU; it says which). Default: EPS_AGGREGATOR, else the spec's
    /// job.aggregator, else auto.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new([
        PossibleValue::new("auto"),
        PossibleValue::new("cpu"),
        PossibleValue::new("cuda"),
        // The device path (shards' master copies and state in separate memory)
        // with host memory as the device: for tests of that path without a GPU.
        PossibleValue::new("host-device").hide(true),
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
}

impl AggKind {
    /// `cpu` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            AggKind::Cpu => "cpu",
            AggKind::Cuda => "cuda",
            AggKind::HostDevice => "host-device",
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

/// Resolves the flag, `EPS_AGGREGATOR` and the spec's value (flag first).
pub fn choose(flag: &AggregatorFlag, spec: Option<&str>) -> Result<AggKind, String> {
    let env = std::env::var("EPS_AGGREGATOR").ok().filter(|v| !v.is_empty());
    let requested = flag.aggregator.clone().or(env).or_else(|| spec.map(str::to_string)).unwrap_or_else(|| "auto".into());
    match requested.as_str() {
        "cpu" => Ok(AggKind::Cpu),
        "host-device" => Ok(AggKind::HostDevice),
        "cuda" => match gpu() {
            Ok(g) => {
                eprintln!("eps: aggregating on {g}");
                Ok(AggKind::Cuda)
            }
            Err(e) => Err(format!("--aggregator cuda: {e}; use --aggregator cpu")),
        },
        "auto" => match gpu() {
            Ok(g) => {
                eprintln!("eps: --aggregator auto: using {g}");
                Ok(AggKind::Cuda)
            }
            Err(e) => {
                eprintln!("eps: --aggregator auto: using the CPU ({e})");
                Ok(AggKind::Cpu)
            }
        },
        other => Err(format!("unknown aggregator {other:?} (from EPS_AGGREGATOR or job.aggregator): use auto, cpu or cuda")),
    }
}

/// A server's math: the aggregator for shards in host memory, and the device that
/// holds the shards instead, if any.
pub type Built = (Arc<dyn Aggregator>, Option<Arc<dyn ShardDevice>>);

/// The aggregator of `kind` (the CPU one with `threads` threads for shards in host
/// memory) and the device that holds the shards, if any.
pub fn build(kind: AggKind, threads: usize) -> Result<Built, String> {
    let cpu: Arc<dyn Aggregator> = Arc::new(CpuAggregator::new(threads));
    match kind {
        AggKind::Cpu => Ok((cpu, None)),
        AggKind::HostDevice => Ok((cpu, Some(Arc::new(eps_agg::HostDevice)))),
        #[cfg(feature = "cuda")]
        AggKind::Cuda => {
            let d = eps_cuda::CudaDevice::open(0).map_err(|e| format!("the GPU: {e}"))?;
            Ok((cpu, Some(Arc::new(d))))
        }
        #[cfg(not(feature = "cuda"))]
        AggKind::Cuda => Err(gpu().unwrap_err()),
    }
}
