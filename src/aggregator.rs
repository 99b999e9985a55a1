//! `--aggregator auto|cpu|cuda`: where a server sums contributions and applies
//! the optimizer. Taken from the flag, then `EPS_AGGREGATOR`, then the spec's
//! `job.aggregator`; `auto` (the default) takes a GPU when a driver and a device
//! are present (an eps built with `--features cuda`), else the CPU, and says which.

use std::sync::Arc;

use eps_agg::{Aggregator, CpuAggregator};
use eps_proto::spec::AGGREGATORS;

/// The `--aggregator` flag of `eps server` and `eps train`.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct AggregatorFlag {
    /// Where servers sum gradients and apply the optimizer: `cpu`, `cuda` (a GPU;
    /// fails, saying why, when none is usable) or `auto` (a GPU when one is usable,
    /// else the CPU; it says which). Default: EPS_AGGREGATOR, else the spec's
    /// job.aggregator, else auto.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(AGGREGATORS))]
    pub aggregator: Option<String>,
}

/// `cpu` or `cuda`, as resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AggKind {
    /// CPU threads.
    Cpu,
    /// The first GPU.
    Cuda,
}

impl AggKind {
    /// `cpu` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            AggKind::Cpu => "cpu",
            AggKind::Cuda => "cuda",
        }
    }
}

/// Whether a GPU can aggregate here, or why not.
#[cfg(feature = "cuda")]
fn gpu() -> Result<String, String> {
    eps_cuda::probe().map(|g| g.to_string()).map_err(|e| e.to_string())
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

/// The aggregator of `kind`; the CPU one with `threads` threads.
pub fn build(kind: AggKind, threads: usize) -> Result<Arc<dyn Aggregator>, String> {
    match kind {
        AggKind::Cpu => Ok(Arc::new(CpuAggregator::new(threads))),
        #[cfg(feature = "cuda")]
        AggKind::Cuda => Ok(Arc::new(eps_cuda::CudaAggregator::open(0).map_err(|e| format!("the GPU aggregator: {e}"))?)),
        #[cfg(not(feature = "cuda"))]
        AggKind::Cuda => Err(gpu().unwrap_err()),
    }
}
