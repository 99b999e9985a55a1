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
//! host "device" reads and writes memory lent to it by address: an
//! `eps_fabric::Span`, which keeps the memory allocated while the device holds
//! it, so the trait's calls are safe.

#![deny(unsafe_code)]

#[allow(unsafe_code)]
pub mod device;
pub mod optim;
pub mod reduce;
#[allow(unsafe_code)]
mod simd;

pub use simd::prefetch;

pub use device::{Attached, Attachments, DeviceShard, HostDevice, Out, ShardDevice};
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

impl AggError {
    /// `Ok` when a buffer of `got` bytes is the `expected` size, else an error
    /// naming `what`.
    pub fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), AggError> {
        if expected == got { Ok(()) } else { Err(AggError::Length { what, expected, got }) }
    }

    /// Every contribution of a sum holds `n` elements of `dtype`.
    pub fn check_inputs<'a>(dtype: DType, n: usize, mut inputs: impl Iterator<Item = &'a [u8]>) -> Result<(), AggError> {
        let want = n * dtype.size_bytes();
        inputs.try_for_each(|x| Self::check_len("gradient contribution", want, x.len()))
    }

    /// The gradient and optimizer state of a step of `n` parameters fit `opt`.
    pub fn check_step(opt: &Optimizer, n: usize, grad: usize, state: usize) -> Result<(), AggError> {
        Self::check_len("gradient", n * 4, grad * 4)?;
        let k = opt.state_per_param();
        Self::check_len("optimizer state", n * k * 4, state * 4)
    }
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
        AggError::check_inputs(dtype, out.len(), inputs.iter().copied())?;
        reduce::sum(dtype, inputs, out, self.threads);
        if scale != 1.0 {
            for x in out.iter_mut() {
                *x *= scale;
            }
        }
        Ok(())
    }

    fn step(&self, opt: &Optimizer, s: StepScalars, params: &mut [f32], grad: &[f32], state: &mut [f32]) -> Result<(), AggError> {
        AggError::check_step(opt, params.len(), grad.len(), state.len())?;
        opt.apply(s, params, grad, state);
        Ok(())
    }
}
