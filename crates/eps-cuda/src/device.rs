//! Shards in GPU memory (`eps_agg::ShardDevice`): each shard's master parameters
//! and optimizer state stay on the GPU between updates. Contributions land in
//! host memory (where the fabric puts them), page-locked for DMA; each starts its
//! asynchronous copy to the GPU as soon as it lands (`stage`), while the others
//! are still on the wire; the update then sums, steps and narrows on the GPU and
//! copies the published parameters out. Per update the bus carries the
//! contributions and one published copy, never the master copy or the state.
//!
//! With GPUDirect RDMA the landing slots and published copies are GPU memory
//! registered with the NIC and attached to the shard (`attach`): contributions
//! are summed where they landed and parameters narrowed where peers read them,
//! and the bus carries nothing per update.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtrMut};
use eps_agg::{AggError, Attached, Attachments, DType, DeviceShard, Optimizer, Out, ShardDevice, StepScalars};
use eps_fabric::Span as Lent;

use crate::{CudaError, Gpu};

/// A GPU holding shards.
#[derive(Debug, Clone)]
pub struct CudaDevice {
    gpu: Arc<Gpu>,
}

impl CudaDevice {
    /// On device `ordinal`.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        Ok(Self { gpu: Arc::new(Gpu::open(ordinal)?) })
    }

    /// On a device already open.
    pub fn from_gpu(gpu: Arc<Gpu>) -> Self {
        Self { gpu }
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Runs a small shard through every kernel (each dtype, each optimizer, a
    /// staged and an unstaged contribution, an odd length) and compares the bits
    /// with the same shard on the CPU (`eps_agg::HostDevice`): a GPU path that does
    /// not give the CPU's results is refused before it trains anything.
    pub fn self_check(&self) -> Result<(), CudaError> {
        use eps_agg::HostDevice;
        let n = 4099;
        let opts = [
            Optimizer::Average,
            Optimizer::Sgd { weight_decay: 0.01 },
            Optimizer::Momentum { momentum: 0.9, nesterov: true, weight_decay: 0.01 },
            Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, decoupled: true },
        ];
        let val = |i: usize, salt: usize| ((i * 37 + salt * 101) % 1000) as f32 / 500.0 - 1.0;
        let fail = |what: String| CudaError::Driver(format!("self-check against the CPU failed: {what}"));
        for dtype in [DType::F32, DType::Bf16, DType::F16] {
            let es = dtype.size_bytes();
            let enc: Vec<Vec<u8>> = (0..2)
                .map(|r| {
                    let v: Vec<f32> = (0..n).map(|i| val(i, r + 1)).collect();
                    let mut b = vec![0u8; n * es];
                    eps_agg::reduce::narrow(dtype, &v, &mut b);
                    b
                })
                .collect();
            for o in &opts {
                let k = o.state_per_param();
                let err = |e: AggError| fail(format!("{}/{}: {e}", dtype.name(), o.name()));
                let (mut g, mut c) = (self.alloc(dtype, n, k).map_err(err)?, HostDevice.alloc(dtype, n, k).map_err(err)?);
                let ms: Vec<f32> = (0..n * (1 + k)).map(|i| val(i, 7).abs() * if i < n { 1.0 } else { 0.01 }).collect();
                g.upload(&ms).map_err(err)?;
                c.upload(&ms).map_err(err)?;
                let ins = [(0, Some(host_span(&enc[0])?)), (1, Some(host_span(&enc[1])?))];
                g.stage(1, ins[1].1.clone().expect("made above")).map_err(err)?;
                c.stage(1, ins[1].1.clone().expect("made above")).map_err(err)?;
                let (mut pg, mut pc) = (vec![0xFFu8; n * es], vec![0u8; n * es]);
                let s = o.scalars(2, 0.01);
                g.update(&ins, 0.5, o, s, None, Out::Host(&mut pg)).map_err(err)?;
                c.update(&ins, 0.5, o, s, None, Out::Host(&mut pc)).map_err(err)?;
                let (mut dg, mut dc) = (vec![f32::NAN; ms.len()], vec![0f32; ms.len()]);
                g.download(&mut dg).map_err(err)?;
                c.download(&mut dc).map_err(err)?;
                if pg != pc || dg.iter().zip(&dc).any(|(a, b)| a.to_bits() != b.to_bits()) {
                    return Err(fail(format!("{} {}: the GPU's bits differ from the CPU's", dtype.name(), o.name())));
                }
                // The GPUDirect path: contributions and the published copy in GPU
                // memory attached by address.
                let dev_in = enc.iter().map(|e| self.gpu.upload(e).map(Arc::new)).collect::<Result<Vec<_>, _>>()?;
                let dev_out = Arc::new(self.gpu.alloc::<u8>(n * es + 24)?);
                let mut a = self.alloc(dtype, n, k).map_err(err)?;
                a.upload(&ms).map_err(err)?;
                for (r, d) in dev_in.iter().enumerate() {
                    a.attach(Attached::Slot(r), self.gpu.lend(d, 0, n * es)?).map_err(err)?;
                }
                a.attach(Attached::Published, self.gpu.lend(&dev_out, 0, n * es + 24)?).map_err(err)?;
                a.update(&[(0, None), (1, None)], 0.5, o, s, None, Out::Attached(24)).map_err(err)?;
                let mut pa = vec![0xFFu8; n * es + 24];
                self.gpu.copy_out(&dev_out, &mut pa)?;
                if pa[24..] != pc[..] {
                    return Err(fail(format!(
                        "{} {}: attached memory: the GPU's bits differ from the CPU's",
                        dtype.name(),
                        o.name()
                    )));
                }
            }
        }
        Ok(())
    }
}

/// `bytes` in host memory of a span's own (the self-check's contributions).
fn host_span(bytes: &[u8]) -> Result<Lent, CudaError> {
    let span = Lent::alloc_host(bytes.len()).map_err(|e| CudaError::Driver(e.to_string()))?;
    span.copy_in(0, bytes).map_err(|e| CudaError::Driver(e.to_string()))?;
    Ok(span)
}

fn dev_err(e: CudaError) -> AggError {
    AggError::Device(e.to_string())
}

impl ShardDevice for CudaDevice {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn alloc(&self, dtype: DType, elements: usize, state_k: usize) -> Result<Box<dyn DeviceShard>, AggError> {
        let g = &self.gpu;
        let ms = g.alloc::<f32>(elements * (1 + state_k)).map_err(dev_err)?;
        let grad = g.alloc::<f32>(elements).map_err(dev_err)?;
        let published = g.alloc::<u8>(elements * dtype.size_bytes()).map_err(dev_err)?;
        Ok(Box::new(CudaShard {
            gpu: g.clone(),
            dtype,
            len: elements,
            state_k,
            ms,
            grad,
            published,
            slots: Vec::new(),
            staged: Vec::new(),
            copying: Vec::new(),
            pinned: Vec::new(),
            attached: Attachments::default(),
        }))
    }
}

#[derive(Debug)]
struct CudaShard {
    gpu: Arc<Gpu>,
    dtype: DType,
    len: usize,
    state_k: usize,
    /// Master parameters, then the optimizer state.
    ms: CudaSlice<f32>,
    grad: CudaSlice<f32>,
    published: CudaSlice<u8>,
    /// By slot (worker rank): the contribution's device copy, made on first use.
    slots: Vec<Option<CudaSlice<u8>>>,
    /// By slot: a copy was started by `stage` and not used yet.
    staged: Vec<bool>,
    /// The host memory of the copies queued since the last update (kept until
    /// the stream has done them).
    copying: Vec<Lent>,
    /// Host memory page-locked by `pin` (unlocked on drop, then let go).
    pinned: Vec<Lent>,
    /// Attached memory (device addresses).
    attached: Attachments,
}

// SAFETY: the pinned addresses are only handed back to the driver on drop; the
// device buffers are cudarc's (Send).
unsafe impl Send for CudaShard {}

impl Drop for CudaShard {
    fn drop(&mut self) {
        // Copies from host slots may be in flight: they end before the slots may go.
        let _ = self.gpu.sync();
        for p in &self.pinned {
            // SAFETY: registered by `pin`, unregistered once; the span keeps the
            // memory mapped until after this.
            unsafe { cudarc::driver::sys::cuMemHostUnregister(p.addr() as usize as *mut std::ffi::c_void) };
        }
    }
}

impl CudaShard {
    /// Starts copying one contribution from host memory `host` into the device
    /// copy of `slot` (made on first use); the span is kept until the stream has
    /// done the copy.
    fn copy_slot(&mut self, slot: usize, host: &Lent) -> Result<(), CudaError> {
        let bytes = self.len * self.dtype.size_bytes();
        if !host.is_host() || host.len() < bytes {
            return Err(CudaError::Bounds(format!("a contribution of {bytes} bytes from {host:?}")));
        }
        if self.slots.len() <= slot {
            self.slots.resize_with(slot + 1, || None);
            self.staged.resize(slot + 1, false);
        }
        if self.slots[slot].is_none() {
            self.slots[slot] = Some(self.gpu.alloc::<u8>(bytes)?);
        }
        let dst = self.slots[slot].as_mut().expect("made above");
        let stream = self.gpu.stream().clone();
        let (ptr, _sync) = dst.device_ptr_mut(&stream);
        // SAFETY: the span keeps `bytes` of host memory (checked above) mapped; it
        // is kept in `copying` until the stream, which orders the copy before the
        // kernels, is done with it (the update waits for the stream). The slice
        // only names the bytes for the driver's DMA; a peer's write racing it
        // tears the values, as with a NIC.
        let src = unsafe { std::slice::from_raw_parts(host.addr() as usize as *const u8, bytes) };
        // SAFETY: the device buffer holds `bytes` (made for this shard's
        // contribution size).
        unsafe { cudarc::driver::result::memcpy_htod_async(ptr, src, stream.cu_stream()) }?;
        self.copying.push(host.clone());
        Ok(())
    }

    /// Steps on the gradient in `grad`, narrows into the device's published copy and
    /// copies that to `published`.
    fn step_publish(&mut self, opt: &Optimizer, s: StepScalars, out: Out<'_>) -> Result<(), CudaError> {
        let (g, n, k) = (&self.gpu, self.len, self.state_k);
        g.step(opt, s, g.span(&self.ms, 0, n)?, g.span(&self.grad, 0, n)?, g.span(&self.ms, n, n * k)?)?;
        self.narrow_out(out)
    }

    fn narrow_out(&mut self, out: Out<'_>) -> Result<(), CudaError> {
        let (g, n, bytes) = (&self.gpu, self.len, self.len * self.dtype.size_bytes());
        match out {
            Out::Host(published) => {
                g.narrow(self.dtype, g.span(&self.ms, 0, n)?, g.span(&self.published, 0, bytes)?)?;
                g.copy_out(&self.published, published)
            }
            Out::Attached(off) => {
                let addr = self.attached.published(off, bytes).map_err(|e| CudaError::Bounds(e.to_string()))?;
                // SAFETY: attached memory of this context, allocated for the shard's
                // life (`attach`'s contract); `published` checked the range.
                let dst = unsafe { g.raw_span::<u8>(addr, bytes) };
                g.narrow(self.dtype, g.span(&self.ms, 0, n)?, dst)?;
                // Peers may read the bytes once the caller sets the stamp: done here.
                g.sync()
            }
        }
    }

    /// Checks `out`'s size before any work is queued.
    fn check_out(&self, out: &Out<'_>) -> Result<(), AggError> {
        let bytes = self.len * self.dtype.size_bytes();
        match out {
            Out::Host(p) => AggError::check_len("published buffer", bytes, p.len()),
            Out::Attached(off) => self.attached.published(*off, bytes).map(|_| ()),
        }
    }
}

impl DeviceShard for CudaShard {
    fn upload(&mut self, master_state: &[f32]) -> Result<(), AggError> {
        AggError::check_len("master parameters and state", self.ms.len() * 4, master_state.len() * 4)?;
        self.gpu.copy_in(master_state, &mut self.ms).map_err(dev_err)
    }

    fn download(&mut self, master_state: &mut [f32]) -> Result<(), AggError> {
        AggError::check_len("master parameters and state", self.ms.len() * 4, master_state.len() * 4)?;
        self.gpu.copy_out(&self.ms, master_state).map_err(dev_err)
    }

    fn update(
        &mut self,
        inputs: &[(usize, Option<Lent>)],
        scale: f32,
        opt: &Optimizer,
        s: StepScalars,
        fwd: Option<&mut [f32]>,
        out: Out<'_>,
    ) -> Result<(), AggError> {
        let (n, bytes) = (self.len, self.len * self.dtype.size_bytes());
        let attached = |me: &Self, slot: usize| me.attached.slot(slot);
        self.check_out(&out)?;
        let run = |me: &mut Self| -> Result<(), CudaError> {
            for (slot, host) in inputs {
                let slot = *slot;
                if attached(me, slot).is_none() && !me.staged.get(slot).copied().unwrap_or(false) {
                    let host = host.as_ref().ok_or_else(|| CudaError::Bounds(format!("contribution {slot}: no memory")))?;
                    me.copy_slot(slot, host)?;
                }
            }
            if inputs.iter().any(|&(slot, _)| attached(me, slot).is_some()) {
                me.gpu.flush_rdma_writes()?;
            }
            let g = me.gpu.clone();
            let spans = inputs
                .iter()
                .map(|&(slot, _)| match attached(me, slot) {
                    // SAFETY: attached memory of this context, `bytes` long (checked
                    // by `attach`), allocated for the shard's life.
                    Some(ptr) => Ok(unsafe { g.raw_span::<u8>(ptr, bytes) }),
                    None => g.span(me.slots[slot].as_ref().expect("copied above"), 0, bytes),
                })
                .collect::<Result<Vec<_>, _>>()?;
            g.sum(me.dtype, &spans, scale, g.span(&me.grad, 0, n)?)?;
            drop(spans);
            for (slot, _) in inputs {
                if let Some(st) = me.staged.get_mut(*slot) {
                    *st = false;
                }
            }
            if let Some(f) = fwd {
                g.copy_out(&me.grad, f)?;
            }
            me.step_publish(opt, s, out)?;
            // The stream is done (the publish waits for it): so are the copies.
            me.copying.clear();
            Ok(())
        };
        run(self).map_err(dev_err)
    }

    fn pin(&mut self, host: Lent) -> Result<(), AggError> {
        if !host.is_host() {
            return Err(AggError::Device("only host memory is page-locked".into()));
        }
        let p = host.addr() as usize as *mut std::ffi::c_void;
        // SAFETY: the span keeps the memory mapped; it is kept in `pinned` and
        // unregistered in drop before it goes. Flags 0: page-locked, used by this
        // context.
        let r = unsafe { cudarc::driver::sys::cuMemHostRegister_v2(p, host.len(), 0) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(AggError::Device(format!("cuMemHostRegister: {r:?}")));
        }
        self.pinned.push(host);
        Ok(())
    }

    fn stage(&mut self, slot: usize, host: Lent) -> Result<(), AggError> {
        let bytes = self.len * self.dtype.size_bytes();
        AggError::check_len("staged contribution", bytes, host.len().min(bytes))?;
        self.copy_slot(slot, &host).map_err(dev_err)?;
        self.staged[slot] = true;
        Ok(())
    }

    fn apply(&mut self, grad: &[f32], opt: &Optimizer, s: StepScalars, out: Out<'_>) -> Result<(), AggError> {
        AggError::check_len("gradient", self.len * 4, grad.len() * 4)?;
        self.check_out(&out)?;
        let gpu = self.gpu.clone();
        gpu.copy_in(grad, &mut self.grad).map_err(dev_err)?;
        self.step_publish(opt, s, out).map_err(dev_err)
    }

    fn publish(&mut self, out: Out<'_>) -> Result<(), AggError> {
        self.check_out(&out)?;
        self.narrow_out(out).map_err(dev_err)
    }

    fn attach(&mut self, what: Attached, mem: Lent) -> Result<(), AggError> {
        // This device uses its own memory in place.
        self.attached.set(what, mem, self.len * self.dtype.size_bytes(), false)
    }
}
