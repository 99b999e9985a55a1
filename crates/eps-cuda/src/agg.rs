//! The `eps_agg::Aggregator` seam on a GPU, for buffers in host memory: each call
//! copies its inputs to device buffers (kept between calls and grown as needed),
//! runs the kernel and copies the results back. It gives the GPU's results to
//! code written for the CPU aggregator; shards whose memory lives on the GPU skip
//! the copies and call [`Gpu`]'s launches directly.

use std::sync::Mutex;

use cudarc::driver::CudaSlice;
use eps_agg::{AggError, Aggregator, DType, Optimizer, StepScalars};

use crate::{CudaError, Gpu};

/// Device buffers reused from call to call.
#[derive(Debug, Default)]
struct Staging {
    inputs: Option<CudaSlice<u8>>,
    a: Option<CudaSlice<f32>>,
    b: Option<CudaSlice<f32>>,
    c: Option<CudaSlice<f32>>,
}

/// Reduction and optimizer steps on a GPU.
#[derive(Debug)]
pub struct CudaAggregator {
    gpu: Gpu,
    staging: Mutex<Staging>,
}

/// A device buffer of at least `n` elements, reusing `slot`'s.
fn at_least<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    gpu: &Gpu,
    slot: &mut Option<CudaSlice<T>>,
    n: usize,
) -> Result<(), CudaError> {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        *slot = Some(gpu.alloc::<T>(n.max(1))?);
    }
    Ok(())
}

fn agg_err(e: CudaError) -> AggError {
    AggError::Device(e.to_string())
}

impl CudaAggregator {
    /// On device `ordinal`.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        Ok(Self { gpu: Gpu::open(ordinal)?, staging: Mutex::new(Staging::default()) })
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    fn reduce_on(&self, dtype: DType, inputs: &[&[u8]], scale: f32, out: &mut [f32]) -> Result<(), CudaError> {
        let g = &self.gpu;
        let n = out.len();
        let bytes = n * dtype.size_bytes();
        let mut st = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let st = &mut *st;
        at_least(g, &mut st.inputs, bytes * inputs.len())?;
        at_least(g, &mut st.a, n)?;
        let ins = st.inputs.as_mut().expect("allocated above");
        for (r, x) in inputs.iter().enumerate() {
            let mut dst = ins.slice_mut(r * bytes..(r + 1) * bytes);
            g.stream().memcpy_htod(*x, &mut dst)?;
        }
        let ins = st.inputs.as_ref().expect("allocated above");
        let spans = (0..inputs.len()).map(|r| g.span(ins, r * bytes, bytes)).collect::<Result<Vec<_>, _>>()?;
        let acc = st.a.as_ref().expect("allocated above");
        g.sum(dtype, &spans, scale, g.span(acc, 0, n)?)?;
        g.copy_out(acc, out)
    }

    fn step_on(
        &self,
        opt: &Optimizer,
        s: StepScalars,
        params: &mut [f32],
        grad: &[f32],
        state: &mut [f32],
    ) -> Result<(), CudaError> {
        let g = &self.gpu;
        let n = params.len();
        let mut st = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let st = &mut *st;
        at_least(g, &mut st.a, n)?;
        at_least(g, &mut st.b, n)?;
        at_least(g, &mut st.c, state.len())?;
        let (p, gr, sv) = (st.a.as_mut().expect("above"), st.b.as_mut().expect("above"), st.c.as_mut().expect("above"));
        g.copy_in(params, p)?;
        g.copy_in(grad, gr)?;
        g.copy_in(state, sv)?;
        g.step(opt, s, g.span(p, 0, n)?, g.span(gr, 0, n)?, g.span(sv, 0, state.len())?)?;
        g.copy_out(p, params)?;
        g.copy_out(sv, state)
    }
}

impl Aggregator for CudaAggregator {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn reduce(&self, dtype: DType, inputs: &[&[u8]], scale: f32, out: &mut [f32]) -> Result<(), AggError> {
        AggError::check_inputs(dtype, out.len(), inputs.iter().copied())?;
        self.reduce_on(dtype, inputs, scale, out).map_err(agg_err)
    }

    fn step(&self, opt: &Optimizer, s: StepScalars, params: &mut [f32], grad: &[f32], state: &mut [f32]) -> Result<(), AggError> {
        AggError::check_step(opt, params.len(), grad.len(), state.len())?;
        self.step_on(opt, s, params, grad, state).map_err(agg_err)
    }
}
