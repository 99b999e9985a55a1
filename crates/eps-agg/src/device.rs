//! Shards whose master parameters and optimizer state live in a device's own
//! memory (a GPU's): the server hands the device each update's contributions and
//! gets the published parameters back, and the master copy and state move
//! between host and device only when the host needs them (a migration snapshot,
//! a split).
//!
//! [`HostDevice`] is such a device made of host memory, computing with this
//! crate's CPU code: the server's device path runs (and is tested) everywhere,
//! with results bitwise those of the CPU path.

use crate::{AggError, CpuAggregator, DType, Optimizer, StepScalars, reduce};

/// A device that holds shards.
pub trait ShardDevice: Send + Sync + std::fmt::Debug {
    /// Name for logs (`cuda`, `host`).
    fn name(&self) -> &'static str;

    /// Device memory for one shard of `elements` parameters in wire dtype `dtype`,
    /// with `state_k` optimizer values per parameter.
    fn alloc(&self, dtype: DType, elements: usize, state_k: usize) -> Result<Box<dyn DeviceShard>, AggError>;
}

/// One shard's device memory: the master parameters followed by the optimizer
/// state (`elements * (1 + state_k)` f32, the layout of the server's host
/// region), and what an update needs.
pub trait DeviceShard: Send + std::fmt::Debug {
    /// Copies the host's master parameters and state to the device.
    fn upload(&mut self, master_state: &[f32]) -> Result<(), AggError>;

    /// Copies the device's master parameters and state to the host.
    fn download(&mut self, master_state: &mut [f32]) -> Result<(), AggError>;

    /// Lets the device copy from host buffer `host` (a landing slot) by DMA,
    /// without bouncing through a buffer of its own (page-locks it), for this
    /// shard's life. An error leaves copies from it working, only slower.
    ///
    /// # Safety
    /// `host` stays mapped, at its address, until this shard is dropped.
    unsafe fn pin(&mut self, host: &[u8]) -> Result<(), AggError> {
        let _ = host;
        Ok(())
    }

    /// Starts copying contribution `slot` (a worker rank) from `host` while other
    /// contributions are still on the wire; the next `update` naming `slot` uses
    /// this copy. A later `stage` of the slot replaces it.
    ///
    /// # Safety
    /// `host` is neither written nor unmapped until the next `update` naming
    /// `slot`, or the drop of this shard, returns.
    unsafe fn stage(&mut self, slot: usize, host: &[u8]) -> Result<(), AggError>;

    /// One update: `grad = (inputs[0] + inputs[1] + ...) * scale` (rank order,
    /// f32 accumulation, as `Aggregator::reduce`), copied to `fwd` when given,
    /// then the optimizer step, then the master parameters narrowed into
    /// `published` (wire dtype). Each input is `(slot, host bytes)`: the staged
    /// copy of the slot when there is one, else the host bytes, copied now.
    fn update(
        &mut self,
        inputs: &[(usize, &[u8])],
        scale: f32,
        opt: &Optimizer,
        s: StepScalars,
        fwd: Option<&mut [f32]>,
        published: &mut [u8],
    ) -> Result<(), AggError>;

    /// The optimizer step with an averaged gradient from the host (a forwarded
    /// update), then the master parameters narrowed into `published`.
    fn apply(&mut self, grad: &[f32], opt: &Optimizer, s: StepScalars, published: &mut [u8]) -> Result<(), AggError>;

    /// The master parameters narrowed into `published`.
    fn publish(&mut self, published: &mut [u8]) -> Result<(), AggError>;
}

/// A device made of host memory that computes with the CPU code: for running and
/// testing the device path without a GPU.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostDevice;

impl ShardDevice for HostDevice {
    fn name(&self) -> &'static str {
        "host"
    }

    fn alloc(&self, dtype: DType, elements: usize, state_k: usize) -> Result<Box<dyn DeviceShard>, AggError> {
        Ok(Box::new(HostShard {
            dtype,
            len: elements,
            ms: vec![0.0; elements * (1 + state_k)],
            grad: vec![0.0; elements],
            staged: Vec::new(),
        }))
    }
}

#[derive(Debug)]
struct HostShard {
    dtype: DType,
    len: usize,
    ms: Vec<f32>,
    grad: Vec<f32>,
    /// By slot: the contribution copied when it was staged (a device's copy), so
    /// the server's staging is exercised: a stale or missing stage shows in the
    /// results.
    staged: Vec<Option<Vec<u8>>>,
}

impl HostShard {
    fn step_and_publish(&mut self, opt: &Optimizer, s: StepScalars, published: &mut [u8]) -> Result<(), AggError> {
        AggError::check_len("published buffer", self.len * self.dtype.size_bytes(), published.len())?;
        let (m, st) = self.ms.split_at_mut(self.len);
        opt.apply(s, m, &self.grad, st);
        reduce::narrow(self.dtype, m, published);
        Ok(())
    }
}

impl DeviceShard for HostShard {
    fn upload(&mut self, master_state: &[f32]) -> Result<(), AggError> {
        AggError::check_len("master parameters and state", self.ms.len() * 4, master_state.len() * 4)?;
        self.ms.copy_from_slice(master_state);
        Ok(())
    }

    fn download(&mut self, master_state: &mut [f32]) -> Result<(), AggError> {
        AggError::check_len("master parameters and state", self.ms.len() * 4, master_state.len() * 4)?;
        master_state.copy_from_slice(&self.ms);
        Ok(())
    }

    unsafe fn stage(&mut self, slot: usize, host: &[u8]) -> Result<(), AggError> {
        AggError::check_len("staged contribution", self.len * self.dtype.size_bytes(), host.len())?;
        if self.staged.len() <= slot {
            self.staged.resize(slot + 1, None);
        }
        self.staged[slot] = Some(host.to_vec());
        Ok(())
    }

    fn update(
        &mut self,
        inputs: &[(usize, &[u8])],
        scale: f32,
        opt: &Optimizer,
        s: StepScalars,
        fwd: Option<&mut [f32]>,
        published: &mut [u8],
    ) -> Result<(), AggError> {
        let taken: Vec<Option<Vec<u8>>> =
            inputs.iter().map(|&(slot, _)| self.staged.get_mut(slot).and_then(Option::take)).collect();
        let data: Vec<&[u8]> = inputs.iter().zip(&taken).map(|(&(_, host), st)| st.as_deref().unwrap_or(host)).collect();
        crate::Aggregator::reduce(&CpuAggregator::new(1), self.dtype, &data, scale, &mut self.grad)?;
        if let Some(f) = fwd {
            AggError::check_len("forward buffer", self.len * 4, f.len() * 4)?;
            f.copy_from_slice(&self.grad);
        }
        self.step_and_publish(opt, s, published)
    }

    fn apply(&mut self, grad: &[f32], opt: &Optimizer, s: StepScalars, published: &mut [u8]) -> Result<(), AggError> {
        AggError::check_len("gradient", self.len * 4, grad.len() * 4)?;
        self.grad.copy_from_slice(grad);
        self.step_and_publish(opt, s, published)
    }

    fn publish(&mut self, published: &mut [u8]) -> Result<(), AggError> {
        AggError::check_len("published buffer", self.len * self.dtype.size_bytes(), published.len())?;
        reduce::narrow(self.dtype, &self.ms[..self.len], published);
        Ok(())
    }
}
