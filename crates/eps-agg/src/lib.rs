//! # eps-agg
//!
//! The math of a parameter server, free of I/O: reducing gradient contributions
//! ([`reduce`]), and applying optimizers with learning-rate schedules ([`optim`]).
//! [`Aggregator`] is the seam behind which the CPU implementation here and a GPU one
//! live; servers call it and nothing else.
//!
//! Determinism: a sum is taken in contribution (worker rank) order, element by
//! element, and every optimizer update is element-wise with per-step scalars. The
//! result for an element is therefore bitwise the same whichever thread, shard or
//! server computes it, which is what makes a BSP run reproducible and independent of
//! the number of servers.
//!
//! # Safety
//! `unsafe` is denied except in `simd`, which calls kernels compiled for CPU
//! features (AVX, F16C) after detecting them at run time, and in `device`, whose
//! trait declares the unsafe contract of a device reading host memory after a
//! call returns (its own code needs no `unsafe`).

#![deny(unsafe_code)]

#[allow(unsafe_code)]
pub mod device;
pub mod optim;
pub mod reduce;
#[allow(unsafe_code)]
mod simd;

pub use device::{DeviceShard, HostDevice, ShardDevice};
pub use optim::{Decay, LrSchedule, Optimizer, StepScalars};

/// Element type of gradients and published parameters on the wire. Accumulation and
/// master parameters are always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    Bf16,
    /// IEEE binary16.
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }

    /// Lower-case name (`f32`, `bf16`, `f16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
        }
    }

    /// Parses a name as printed by [`DType::name`].
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "f32" => Some(DType::F32),
            "bf16" => Some(DType::Bf16),
            "f16" => Some(DType::F16),
            _ => None,
        }
    }

    /// Wire code.
    pub fn code(self) -> u8 {
        match self {
            DType::F32 => 0,
            DType::Bf16 => 1,
            DType::F16 => 2,
        }
    }

    /// From a wire code.
    pub fn from_code(c: u8) -> Option<Self> {
        match c {
            0 => Some(DType::F32),
            1 => Some(DType::Bf16),
            2 => Some(DType::F16),
            _ => None,
        }
    }
}

/// Errors of an aggregator.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AggError {
    /// Buffers of the wrong size were passed.
    #[error("{what}: expected {expected} bytes, got {got}")]
    Length {
        /// Which buffer.
        what: &'static str,
        /// Expected bytes.
        expected: usize,
        /// Actual bytes.
        got: usize,
    },
    /// The device (a GPU) failed.
    #[error("aggregator device: {0}")]
    Device(String),
}

/// Reduction and optimizer steps over one shard's memory.
pub trait Aggregator: Send + Sync + std::fmt::Debug {
    /// Name for logs (`cpu`, `cuda`).
    fn name(&self) -> &'static str;

    /// `out = (inputs[0] + inputs[1] + ...) * scale`, f32 accumulation in rank order.
    fn reduce(&self, dtype: DType, inputs: &[&[u8]], scale: f32, out: &mut [f32]) -> Result<(), AggError>;

    /// One optimizer step on a shard.
    fn step(&self, opt: &Optimizer, s: StepScalars, params: &mut [f32], grad: &[f32], state: &mut [f32]) -> Result<(), AggError>;
}

/// The CPU aggregator: multi-threaded by element range.
#[derive(Clone, Debug)]
pub struct CpuAggregator {
    threads: usize,
}

impl CpuAggregator {
    /// With `threads` worker threads (0: one per available core).
    pub fn new(threads: usize) -> Self {
        let threads = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
        Self { threads }
    }

    /// Threads used.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

impl Aggregator for CpuAggregator {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn reduce(&self, dtype: DType, inputs: &[&[u8]], scale: f32, out: &mut [f32]) -> Result<(), AggError> {
        let want = out.len() * dtype.size_bytes();
        if let Some(bad) = inputs.iter().find(|x| x.len() != want) {
            return Err(AggError::Length { what: "gradient contribution", expected: want, got: bad.len() });
        }
        reduce::sum(dtype, inputs, out, self.threads);
        if scale != 1.0 {
            for x in out.iter_mut() {
                *x *= scale;
            }
        }
        Ok(())
    }

    fn step(&self, opt: &Optimizer, s: StepScalars, params: &mut [f32], grad: &[f32], state: &mut [f32]) -> Result<(), AggError> {
        let n = params.len();
        if grad.len() != n {
            return Err(AggError::Length { what: "gradient", expected: n * 4, got: grad.len() * 4 });
        }
        let k = opt.state_per_param();
        if state.len() != n * k {
            return Err(AggError::Length { what: "optimizer state", expected: n * k * 4, got: state.len() * 4 });
        }
        opt.apply(s, params, grad, state);
        Ok(())
    }
}
