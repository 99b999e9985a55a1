//! Shards whose master parameters and optimizer state live in a device's own
//! memory (a GPU's): the server hands the device each update's contributions and
//! gets the published parameters back, and the master copy and state move
//! between host and device only when the host needs them (a migration snapshot,
//! a split).
//!
//! A shard may also read its contributions from, and publish into, memory of
//! the device's own that the fabric reaches in place (`attach`: GPU memory
//! registered with the NIC, GPUDirect RDMA), so that contributions and
//! published parameters never cross into host memory.
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

/// Memory of the device's own that a shard reads or writes in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attached {
    /// The landing slot of a contributor (a worker rank).
    Slot(usize),
    /// The published copies (an update writes one at the offset it is given).
    Published,
}

/// The memory attached to a shard (`DeviceShard::attach`), by address in the
/// device's memory: what a device keeps and checks, whatever its kind.
#[derive(Clone, Debug, Default)]
pub struct Attachments {
    slots: Vec<Option<u64>>,
    published: Option<(u64, usize)>,
}

impl Attachments {
    /// Records `len` bytes at `addr` as `what`; a landing slot must hold
    /// `slot_bytes` (one contribution).
    pub fn set(&mut self, what: Attached, addr: u64, len: usize, slot_bytes: usize) -> Result<(), AggError> {
        match what {
            Attached::Slot(slot) => {
                AggError::check_len("attached landing slot", slot_bytes, len)?;
                if self.slots.len() <= slot {
                    self.slots.resize(slot + 1, None);
                }
                self.slots[slot] = Some(addr);
            }
            Attached::Published => self.published = Some((addr, len)),
        }
        Ok(())
    }

    /// The address of slot `slot`'s attached memory (`slot_bytes` long), if any.
    pub fn slot(&self, slot: usize) -> Option<u64> {
        self.slots.get(slot).copied().flatten()
    }

    /// The address of published bytes `off..off + bytes`, checked against the
    /// attached published memory.
    pub fn published(&self, off: usize, bytes: usize) -> Result<u64, AggError> {
        let (base, len) = self.published.ok_or_else(|| AggError::Device("no published memory is attached".into()))?;
        if off.checked_add(bytes).is_none_or(|e| e > len) {
            return Err(AggError::Device(format!("published bytes {off}+{bytes} lie outside the {len} attached")));
        }
        Ok(base + off as u64)
    }
}

/// Where an update writes the published parameters (`elements` values in the wire
/// dtype).
#[derive(Debug)]
pub enum Out<'a> {
    /// Host memory.
    Host(&'a mut [u8]),
    /// The attached published memory, from this byte offset.
    Attached(usize),
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

    /// Makes the shard use `len` bytes at `addr`, an address in the device's own
    /// memory (for a GPU, a device pointer), as `what`: an update then reads that
    /// slot's contribution there (ignoring its host bytes and any staged copy),
    /// or writes `Out::Attached` there. Devices that cannot say why.
    ///
    /// # Safety
    /// The memory stays allocated, at `addr`, for this shard's life, and is
    /// accessed by others under the rules of `update`: nothing writes a slot
    /// while an update reads it, and nothing reads the published bytes an update
    /// writes while it runs.
    unsafe fn attach(&mut self, what: Attached, addr: u64, len: usize) -> Result<(), AggError> {
        let _ = (what, addr, len);
        Err(AggError::Device("this device cannot use memory in place".into()))
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
    /// `out`. Each input is `(slot, host bytes)`: the slot's attached memory
    /// when it has some, else its staged copy when there is one, else the host
    /// bytes, copied now.
    fn update(
        &mut self,
        inputs: &[(usize, &[u8])],
        scale: f32,
        opt: &Optimizer,
        s: StepScalars,
        fwd: Option<&mut [f32]>,
        out: Out<'_>,
    ) -> Result<(), AggError>;

    /// The optimizer step with an averaged gradient from the host (a forwarded
    /// update), then the master parameters narrowed into `out`.
    fn apply(&mut self, grad: &[f32], opt: &Optimizer, s: StepScalars, out: Out<'_>) -> Result<(), AggError>;

    /// The master parameters narrowed into `out`.
    fn publish(&mut self, out: Out<'_>) -> Result<(), AggError>;
}

/// A device made of host memory that computes with the CPU code: for running and
/// testing the device path without a GPU. Its "own memory" is the host's: an
/// attached address is a host address.
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
            attached: Attachments::default(),
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
    /// Attached memory (host addresses).
    attached: Attachments,
}

impl HostShard {
    /// The bytes `out` names, checked against the published size.
    fn out_bytes<'a>(&self, out: Out<'a>) -> Result<&'a mut [u8], AggError> {
        let bytes = self.len * self.dtype.size_bytes();
        let dst = match out {
            Out::Host(d) => d,
            Out::Attached(off) => {
                let addr = self.attached.published(off, bytes)?;
                // SAFETY: `attach`'s contract: the memory is mapped for this shard's
                // life and nothing reads these bytes while an update writes them;
                // the range was checked by `published`.
                unsafe { std::slice::from_raw_parts_mut(addr as usize as *mut u8, bytes) }
            }
        };
        AggError::check_len("published buffer", bytes, dst.len())?;
        Ok(dst)
    }

    fn step_and_publish(&mut self, opt: &Optimizer, s: StepScalars, out: Out<'_>) -> Result<(), AggError> {
        let published = self.out_bytes(out)?;
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

    unsafe fn attach(&mut self, what: Attached, addr: u64, len: usize) -> Result<(), AggError> {
        self.attached.set(what, addr, len, self.len * self.dtype.size_bytes())
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
        out: Out<'_>,
    ) -> Result<(), AggError> {
        let host_bytes = self.len * self.dtype.size_bytes();
        let taken: Vec<Option<Vec<u8>>> =
            inputs.iter().map(|&(slot, _)| self.staged.get_mut(slot).and_then(Option::take)).collect();
        let data: Vec<&[u8]> = inputs
            .iter()
            .zip(&taken)
            .map(|(&(slot, host), st)| match self.attached.slot(slot) {
                // SAFETY: `attach`'s contract: mapped for this shard's life, and not
                // written while an update reads it; `set` checked it holds one
                // contribution.
                Some(addr) => unsafe { std::slice::from_raw_parts(addr as usize as *const u8, host_bytes) },
                None => st.as_deref().unwrap_or(host),
            })
            .collect();
        crate::Aggregator::reduce(&CpuAggregator::new(1), self.dtype, &data, scale, &mut self.grad)?;
        if let Some(f) = fwd {
            AggError::check_len("forward buffer", self.len * 4, f.len() * 4)?;
            f.copy_from_slice(&self.grad);
        }
        self.step_and_publish(opt, s, out)
    }

    fn apply(&mut self, grad: &[f32], opt: &Optimizer, s: StepScalars, out: Out<'_>) -> Result<(), AggError> {
        AggError::check_len("gradient", self.len * 4, grad.len() * 4)?;
        self.grad.copy_from_slice(grad);
        self.step_and_publish(opt, s, out)
    }

    fn publish(&mut self, out: Out<'_>) -> Result<(), AggError> {
        let published = self.out_bytes(out)?;
        reduce::narrow(self.dtype, &self.ms[..self.len], published);
        Ok(())
    }
}
