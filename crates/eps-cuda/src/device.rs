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
                // SAFETY: `enc` outlives the update below and is not written.
                unsafe {
                    g.stage(1, &enc[1]).map_err(err)?;
                    c.stage(1, &enc[1]).map_err(err)?;
                }
                let ins = [(0, enc[0].as_slice()), (1, enc[1].as_slice())];
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
                let dev_in = enc.iter().map(|e| self.gpu.upload(e)).collect::<Result<Vec<_>, _>>()?;
                let dev_out = self.gpu.alloc::<u8>(n * es + 24)?;
                let mut a = self.alloc(dtype, n, k).map_err(err)?;
                a.upload(&ms).map_err(err)?;
                for (r, d) in dev_in.iter().enumerate() {
                    let ptr = self.gpu.span(d, 0, n * es)?.device_ptr();
                    // SAFETY: `dev_in` outlives `a` (declared before it) and is not
                    // written while it lives.
                    unsafe { a.attach(Attached::Slot(r), ptr, n * es) }.map_err(err)?;
                }
                let ptr = self.gpu.span(&dev_out, 0, n * es + 24)?.device_ptr();
                // SAFETY: as above, for `dev_out`, read only after the update.
                unsafe { a.attach(Attached::Published, ptr, n * es + 24) }.map_err(err)?;
                a.update(&[(0, &[]), (1, &[])], 0.5, o, s, None, Out::Attached(24)).map_err(err)?;
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
    /// Host ranges page-locked by `pin` (unlocked on drop).
    pinned: Vec<usize>,
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
        for &p in &self.pinned {
            // SAFETY: registered by `pin`, unregistered once; the memory is still
            // mapped (the caller of `pin` promised it for this shard's life).
            unsafe { cudarc::driver::sys::cuMemHostUnregister(p as *mut std::ffi::c_void) };
        }
    }
}

impl CudaShard {
    /// Starts copying `host` into the device copy of `slot` (made on first use).
    fn copy_slot(&mut self, slot: usize, host: &[u8]) -> Result<(), CudaError> {
        if self.slots.len() <= slot {
            self.slots.resize_with(slot + 1, || None);
            self.staged.resize(slot + 1, false);
        }
        if self.slots[slot].is_none() {
            self.slots[slot] = Some(self.gpu.alloc::<u8>(host.len())?);
        }
        let dst = self.slots[slot].as_mut().expect("made above");
        let stream = self.gpu.stream().clone();
        let (ptr, _sync) = dst.device_ptr_mut(&stream);
        // SAFETY: the device buffer holds `host.len()` bytes (made for this shard's
        // contribution size); the host bytes stay unchanged and mapped until the
        // copy is used or the shard dropped (the callers' contract), and the copy
        // is ordered before the kernels on the same stream.
        unsafe { cudarc::driver::result::memcpy_htod_async(ptr, host, stream.cu_stream()) }?;
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
        inputs: &[(usize, &[u8])],
        scale: f32,
        opt: &Optimizer,
        s: StepScalars,
        fwd: Option<&mut [f32]>,
        out: Out<'_>,
    ) -> Result<(), AggError> {
        let (n, bytes) = (self.len, self.len * self.dtype.size_bytes());
        let attached = |me: &Self, slot: usize| me.attached.slot(slot);
        AggError::check_inputs(self.dtype, n, inputs.iter().filter(|&&(s, _)| attached(self, s).is_none()).map(|&(_, x)| x))?;
        self.check_out(&out)?;
        let run = |me: &mut Self| -> Result<(), CudaError> {
            for &(slot, host) in inputs {
                if attached(me, slot).is_none() && !me.staged.get(slot).copied().unwrap_or(false) {
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
            for &(slot, _) in inputs {
                if let Some(st) = me.staged.get_mut(slot) {
                    *st = false;
                }
            }
            if let Some(f) = fwd {
                g.copy_out(&me.grad, f)?;
            }
            me.step_publish(opt, s, out)
        };
        run(self).map_err(dev_err)
    }

    unsafe fn pin(&mut self, host: &[u8]) -> Result<(), AggError> {
        let p = host.as_ptr() as *mut std::ffi::c_void;
        // SAFETY: the caller keeps `host` mapped for this shard's life; it is
        // unregistered in drop. Flags 0: page-locked, used by this context.
        let r = unsafe { cudarc::driver::sys::cuMemHostRegister_v2(p, host.len(), 0) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(AggError::Device(format!("cuMemHostRegister: {r:?}")));
        }
        self.pinned.push(p as usize);
        Ok(())
    }

    unsafe fn stage(&mut self, slot: usize, host: &[u8]) -> Result<(), AggError> {
        let bytes = self.len * self.dtype.size_bytes();
        AggError::check_len("staged contribution", bytes, host.len())?;
        self.copy_slot(slot, host).map_err(dev_err)?;
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

    unsafe fn attach(&mut self, what: Attached, addr: u64, len: usize) -> Result<(), AggError> {
        self.attached.set(what, addr, len, self.len * self.dtype.size_bytes())
    }
}
