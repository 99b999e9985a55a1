//! GB/s of the kernels against the device's own limit measured in the same run:
//! a device-to-device copy (`cuMemcpyDtoD`, which reads and writes every byte
//! once). Each figure is the median of timed repetitions (CUDA events around each
//! one) after a warm-up; bytes counted are those each kernel must move at least:
//! an 8-way f32 sum reads 8 inputs and writes 1 output, a fused Adam step reads
//! parameters, gradient and two state values and writes parameters and state. A
//! whole shard update of the GPUDirect path (8 f32 contributions attached where
//! they landed, the Adam step, the f32 parameters narrowed into the attached
//! published copy) must read 8 inputs and 3 values and write 3 values and the
//! published copy: 15 buffers.

use cudarc::driver::sys::CUevent_flags;

use std::sync::Arc;

use eps_agg::{Attached, DType, Optimizer, Out, ShardDevice};

use crate::{CudaError, Gpu};

/// What one run measured.
#[derive(Clone, Debug)]
pub struct GpuBench {
    /// Elements per buffer.
    pub elements: usize,
    /// Device-to-device copy, GB/s (bytes read + written).
    pub copy_gbps: f64,
    /// 8-way f32 sum, GB/s (9 buffers moved).
    pub sum8_gbps: f64,
    /// Fused Adam step, GB/s (7 f32 values per parameter moved).
    pub adam_gbps: f64,
    /// A shard update on attached memory (8 contributions, Adam, publish), GB/s
    /// (15 f32 values per parameter moved).
    pub update_gbps: f64,
    /// Repetitions timed per figure.
    pub reps: usize,
}

impl GpuBench {
    /// `sum8_gbps / copy_gbps`.
    pub fn sum8_ratio(&self) -> f64 {
        self.sum8_gbps / self.copy_gbps
    }
    /// `adam_gbps / copy_gbps`.
    pub fn adam_ratio(&self) -> f64 {
        self.adam_gbps / self.copy_gbps
    }
    /// `update_gbps / copy_gbps`.
    pub fn update_ratio(&self) -> f64 {
        self.update_gbps / self.copy_gbps
    }
}

/// Median milliseconds of `reps` runs of `f` (after `reps / 4 + 1` warm-ups), each
/// timed by events on the stream.
fn time_ms(gpu: &Gpu, reps: usize, mut f: impl FnMut() -> Result<(), CudaError>) -> Result<f64, CudaError> {
    for _ in 0..reps / 4 + 1 {
        f()?;
    }
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut ms = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let (a, b) = (gpu.ctx().new_event(timing)?, gpu.ctx().new_event(timing)?);
        a.record(gpu.stream())?;
        f()?;
        b.record(gpu.stream())?;
        b.synchronize()?;
        ms.push(f64::from(a.elapsed_ms(&b)?));
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

/// Measures with buffers of `elements` f32 values (the sum needs 10 of them, the
/// Adam step 5 with its state): `reps` timed repetitions per figure.
pub fn run(gpu: &Arc<Gpu>, elements: usize, reps: usize) -> Result<GpuBench, CudaError> {
    let n = elements.max(1024);
    let gb = |bytes: f64, ms: f64| bytes / (ms * 1e-3) / 1e9;
    let copy_ms = {
        let src = gpu.alloc::<f32>(n)?;
        let mut dst = gpu.alloc::<f32>(n)?;
        time_ms(gpu, reps, || Ok(gpu.stream().memcpy_dtod(&src, &mut dst)?))?
    };
    // The 8-way sum: eight inputs in one allocation, one output.
    let sum_ms = {
        let ins = gpu.alloc::<u8>(8 * n * 4)?;
        let out = gpu.alloc::<f32>(n)?;
        let spans = (0..8).map(|r| gpu.span(&ins, r * n * 4, n * 4)).collect::<Result<Vec<_>, _>>()?;
        let out_span = gpu.span(&out, 0, n)?;
        time_ms(gpu, reps, || gpu.sum(DType::F32, &spans, 0.125, out_span))?
    };
    // The fused Adam step.
    let adam_ms = {
        let opt = Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, decoupled: true };
        let (p, g, st) = (gpu.alloc::<f32>(n)?, gpu.alloc::<f32>(n)?, gpu.alloc::<f32>(2 * n)?);
        let (ps, gs, ss) = (gpu.span(&p, 0, n)?, gpu.span(&g, 0, n)?, gpu.span(&st, 0, 2 * n)?);
        let scalars = opt.scalars(10, 1e-3);
        time_ms(gpu, reps, || gpu.step(&opt, scalars, ps, gs, ss))?
    };
    // A whole shard update on attached memory, as a GPUDirect server runs it.
    let update_ms = {
        let opt = Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, decoupled: true };
        let (ins, out) = (std::sync::Arc::new(gpu.alloc::<u8>(8 * n * 4)?), std::sync::Arc::new(gpu.alloc::<u8>(n * 4)?));
        let dev = crate::CudaDevice::from_gpu(gpu.clone());
        let agg = |e: eps_agg::AggError| CudaError::Driver(e.to_string());
        let mut shard = dev.alloc(DType::F32, n, opt.state_per_param()).map_err(agg)?;
        for r in 0..8 {
            shard.attach(Attached::Slot(r), gpu.lend(&ins, r * n * 4, n * 4)?).map_err(agg)?;
        }
        shard.attach(Attached::Published, gpu.lend(&out, 0, n * 4)?).map_err(agg)?;
        let inputs: Vec<(usize, Option<eps_fabric::Span>)> = (0..8).map(|r| (r, None)).collect();
        let scalars = opt.scalars(10, 1e-3);
        time_ms(gpu, reps, || shard.update(&inputs, 0.125, &opt, scalars, None, Out::Attached(0)).map_err(agg))?
    };
    let bytes = (n * 4) as f64;
    Ok(GpuBench {
        elements: n,
        copy_gbps: gb(2.0 * bytes, copy_ms),
        sum8_gbps: gb(9.0 * bytes, sum_ms),
        adam_gbps: gb(7.0 * bytes, adam_ms),
        update_gbps: gb(15.0 * bytes, update_ms),
        reps: reps.max(1),
    })
}
