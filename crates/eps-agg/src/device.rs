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

use eps_fabric::Span;

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

/// The memory attached to a shard (`DeviceShard::attach`): what a device keeps
/// (the spans, so the memory stays allocated while it may use it) and checks,
/// whatever its kind.
#[derive(Clone, Debug, Default)]
pub struct Attachments {
    slots: Vec<Option<Span>>,
    published: Option<Span>,
}

impl Attachments {
    /// Records `mem` as `what`; a landing slot must hold `slot_bytes` (one
    /// contribution), and the memory must be of the kind the device uses in
    /// place (`host`: host memory, else the device's own).
    pub fn set(&mut self, what: Attached, mem: Span, slot_bytes: usize, host: bool) -> Result<(), AggError> {
        if mem.is_host() != host {
            let (is, wants) = if host { ("a device's", "host") } else { ("host", "its own") };
            return Err(AggError::Device(format!("attached memory is {is} memory; this device uses {wants} memory in place")));
        }
        match what {
            Attached::Slot(slot) => {
                AggError::check_len("attached landing slot", slot_bytes, mem.len())?;
                if self.slots.len() <= slot {
                    self.slots.resize(slot + 1, None);
                }
                self.slots[slot] = Some(mem);
            }
            Attached::Published => self.published = Some(mem),
        }
        Ok(())
    }

    /// The address of slot `slot`'s attached memory (`slot_bytes` long), if any.
    pub fn slot(&self, slot: usize) -> Option<u64> {
        self.slots.get(slot).and_then(Option::as_ref).map(Span::addr)
    }

    /// The address of published bytes `off..off + bytes`, checked against the
    /// attached published memory.
    pub fn published(&self, off: usize, bytes: usize) -> Result<u64, AggError> {
        let p = self.published.as_ref().ok_or_else(|| AggError::Device("no published memory is attached".into()))?;
        if off.checked_add(bytes).is_none_or(|e| e > p.len()) {
            return Err(AggError::Device(format!("published bytes {off}+{bytes} lie outside the {} attached", p.len())));
        }
        Ok(p.addr() + off as u64)
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

    /// Lets the device copy from host memory `host` (a landing slot) by DMA,
    /// without bouncing through a buffer of its own (page-locks it), for this
    /// shard's life: the shard keeps the span. An error leaves copies from it
    /// working, only slower.
    fn pin(&mut self, host: Span) -> Result<(), AggError> {
        let _ = host;
        Ok(())
    }

    /// Makes the shard use `mem`, memory of the device's own (for a GPU, device
    /// memory), as `what`, keeping the span: an update then reads that slot's
    /// contribution there (ignoring its host bytes and any staged copy), or
    /// writes `Out::Attached` there. Others reach the memory under the rules of
    /// `update` (nothing writes a slot while an update reads it, nothing reads
    /// the published bytes an update writes); one that breaks them tears the
    /// values, as with DMA. Devices that cannot say why.
    fn attach(&mut self, what: Attached, mem: Span) -> Result<(), AggError> {
        let _ = (what, mem);
        Err(AggError::Device("this device cannot use memory in place".into()))
    }

    /// Starts copying contribution `slot` (a worker rank) from host memory
    /// `host` while other contributions are still on the wire; the next `update`
    /// naming `slot` uses this copy. A later `stage` of the slot replaces it.
    /// The shard keeps the span until the copy is used; a write into the bytes
    /// meanwhile tears the copy's values, as with DMA.
    fn stage(&mut self, slot: usize, host: Span) -> Result<(), AggError>;

    /// One update: `grad = (inputs[0] + inputs[1] + ...) * scale` (rank order,
    /// f32 accumulation, as `Aggregator::reduce`), copied to `fwd` when given,
    /// then the optimizer step, then the master parameters narrowed into
    /// `out`. Each input is `(slot, host memory)`: the slot's attached memory
    /// when it has some, else its staged copy when there is one, else the host
    /// memory, copied now.
    fn update(
        &mut self,
        inputs: &[(usize, Option<Span>)],
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
    /// Attached memory (host memory).
    attached: Attachments,
}

/// A copy of the first `bytes` of host memory `mem`.
fn copy_host(mem: &Span, bytes: usize) -> Result<Vec<u8>, AggError> {
    if !mem.is_host() {
        return Err(AggError::Device("the host device reads host memory only".into()));
    }
    AggError::check_len("contribution", bytes, mem.len().min(bytes))?;
    let mut out = vec![0u8; bytes];
    // SAFETY: the span keeps `bytes` (checked above) of host memory mapped at its
    // address while it lives; the copy reads them by address, as a device's DMA
    // does (no reference to them is formed), so a write racing it only tears
    // the values copied.
    unsafe { std::ptr::copy_nonoverlapping(mem.addr() as usize as *const u8, out.as_mut_ptr(), bytes) };
    Ok(out)
}

impl HostShard {
    /// The bytes `out` names, checked against the published size.
    fn out_bytes<'a>(&self, out: Out<'a>) -> Result<&'a mut [u8], AggError> {
        let bytes = self.len * self.dtype.size_bytes();
        let dst = match out {
            Out::Host(d) => d,
            Out::Attached(off) => {
                let addr = self.attached.published(off, bytes)?;
                // SAFETY: the attached span keeps the host memory mapped for this
                // shard's life, and `published` checked the range; peers only READ
                // these bytes, by DMA, and `update`'s rules keep them off the
                // buffer being written (one that breaks them reads torn values).
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

    fn attach(&mut self, what: Attached, mem: Span) -> Result<(), AggError> {
        // This device's own memory is the host's.
        self.attached.set(what, mem, self.len * self.dtype.size_bytes(), true)
    }

    fn stage(&mut self, slot: usize, host: Span) -> Result<(), AggError> {
        let copy = copy_host(&host, self.len * self.dtype.size_bytes())?;
        if self.staged.len() <= slot {
            self.staged.resize(slot + 1, None);
        }
        self.staged[slot] = Some(copy);
        Ok(())
    }

    fn update(
        &mut self,
        inputs: &[(usize, Option<Span>)],
        scale: f32,
        opt: &Optimizer,
        s: StepScalars,
        fwd: Option<&mut [f32]>,
        out: Out<'_>,
    ) -> Result<(), AggError> {
        let host_bytes = self.len * self.dtype.size_bytes();
        // Each contribution copied out, as a device copies it to its memory.
        let mut data: Vec<Vec<u8>> = Vec::with_capacity(inputs.len());
        for (slot, host) in inputs {
            let staged = self.staged.get_mut(*slot).and_then(Option::take);
            data.push(match (self.attached.slots.get(*slot).and_then(Option::as_ref), staged, host) {
                (Some(mem), _, _) => copy_host(mem, host_bytes)?,
                (None, Some(st), _) => st,
                (None, None, Some(h)) => copy_host(h, host_bytes)?,
                (None, None, None) => return Err(AggError::Device(format!("contribution {slot}: no memory to read it from"))),
            });
        }
        let data: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
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
