//! Shards in GPU memory (`eps_agg::ShardDevice`): each shard's master parameters
//! and optimizer state stay on the GPU between updates. An update copies the
//! contributions in (they land in host memory, where the fabric puts them), sums,
//! steps and narrows on the GPU, and copies the published parameters out: per
//! update the bus carries the contributions and one published copy, never the
//! master copy or the optimizer state.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use eps_agg::{AggError, DType, DeviceShard, Optimizer, ShardDevice, StepScalars};

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

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
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
        Ok(Box::new(CudaShard { gpu: g.clone(), dtype, len: elements, state_k, ms, grad, published, inputs: None }))
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
    /// The contributions of an update, back to back (grown to the most seen).
    inputs: Option<CudaSlice<u8>>,
}

impl CudaShard {
    fn check(&self, what: &'static str, expected: usize, got: usize) -> Result<(), AggError> {
        if expected == got { Ok(()) } else { Err(AggError::Length { what, expected, got }) }
    }

    /// Steps on the gradient in `grad`, narrows into the device's published copy and
    /// copies that to `published`.
    fn step_publish(&mut self, opt: &Optimizer, s: StepScalars, published: &mut [u8]) -> Result<(), CudaError> {
        let (g, n, k) = (&self.gpu, self.len, self.state_k);
        g.step(opt, s, g.span(&self.ms, 0, n)?, g.span(&self.grad, 0, n)?, g.span(&self.ms, n, n * k)?)?;
        self.narrow_out(published)
    }

    fn narrow_out(&mut self, published: &mut [u8]) -> Result<(), CudaError> {
        let (g, n) = (&self.gpu, self.len);
        g.narrow(self.dtype, g.span(&self.ms, 0, n)?, g.span(&self.published, 0, n * self.dtype.size_bytes())?)?;
        g.copy_out(&self.published, published)
    }
}

impl DeviceShard for CudaShard {
    fn upload(&mut self, master_state: &[f32]) -> Result<(), AggError> {
        self.check("master parameters and state", self.ms.len() * 4, master_state.len() * 4)?;
        self.gpu.copy_in(master_state, &mut self.ms).map_err(dev_err)
    }

    fn download(&mut self, master_state: &mut [f32]) -> Result<(), AggError> {
        self.check("master parameters and state", self.ms.len() * 4, master_state.len() * 4)?;
        self.gpu.copy_out(&self.ms, master_state).map_err(dev_err)
    }

    fn update(
        &mut self,
        inputs: &[&[u8]],
        scale: f32,
        opt: &Optimizer,
        s: StepScalars,
        fwd: Option<&mut [f32]>,
        published: &mut [u8],
    ) -> Result<(), AggError> {
        let (n, bytes) = (self.len, self.len * self.dtype.size_bytes());
        if let Some(bad) = inputs.iter().find(|x| x.len() != bytes) {
            return Err(AggError::Length { what: "gradient contribution", expected: bytes, got: bad.len() });
        }
        self.check("published buffer", bytes, published.len())?;
        let run = |me: &mut Self| -> Result<(), CudaError> {
            let g = me.gpu.clone();
            let need = (bytes * inputs.len()).max(1);
            if me.inputs.as_ref().is_none_or(|b| b.len() < need) {
                me.inputs = Some(g.alloc::<u8>(need)?);
            }
            let ins = me.inputs.as_mut().expect("allocated above");
            for (r, x) in inputs.iter().enumerate() {
                let mut dst = ins.slice_mut(r * bytes..(r + 1) * bytes);
                g.stream().memcpy_htod(*x, &mut dst)?;
            }
            let ins = me.inputs.as_ref().expect("allocated above");
            let spans = (0..inputs.len()).map(|r| g.span(ins, r * bytes, bytes)).collect::<Result<Vec<_>, _>>()?;
            g.sum(me.dtype, &spans, scale, g.span(&me.grad, 0, n)?)?;
            if let Some(f) = fwd {
                g.copy_out(&me.grad, f)?;
            }
            me.step_publish(opt, s, published)
        };
        run(self).map_err(dev_err)
    }

    fn apply(&mut self, grad: &[f32], opt: &Optimizer, s: StepScalars, published: &mut [u8]) -> Result<(), AggError> {
        self.check("gradient", self.len * 4, grad.len() * 4)?;
        self.check("published buffer", self.len * self.dtype.size_bytes(), published.len())?;
        let gpu = self.gpu.clone();
        gpu.copy_in(grad, &mut self.grad).map_err(dev_err)?;
        self.step_publish(opt, s, published).map_err(dev_err)
    }

    fn publish(&mut self, published: &mut [u8]) -> Result<(), AggError> {
        self.check("published buffer", self.len * self.dtype.size_bytes(), published.len())?;
        self.narrow_out(published).map_err(dev_err)
    }
}
