//! Loading the kernels and launching them on device spans.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, Ptx};
use eps_agg::{DType, Optimizer, StepScalars};

use crate::{CudaError, Gpu, Span};

/// The kernels' source, built into the binary.
pub(crate) const SOURCE: &str = include_str!("../../../kernels/eps_kernels.cu");

/// The architectures PTX is made for: sm_80 (A100) and sm_90 (H100/H200); later
/// devices JIT the sm_90 PTX.
const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

/// Most contributions one sum takes (`EPS_MAX_INPUTS` in the source).
pub const MAX_INPUTS: usize = 64;

/// Threads per block of every launch.
const BLOCK: u32 = 256;

/// The `Inputs` struct of the source: the contributions' device addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Inputs([u64; MAX_INPUTS]);

// SAFETY: plain data laid out as the kernel's `struct Inputs` (64 pointers).
unsafe impl DeviceRepr for Inputs {}

/// The `AdamArgs` struct of the source.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AdamArgs {
    step: f32,
    beta1: f32,
    beta2: f32,
    one_b1: f32,
    one_b2: f32,
    eps: f32,
    bc2_sqrt: f32,
    wd: f32,
    decay: f32,
    decoupled: i32,
}

// SAFETY: plain data laid out as the kernel's `struct AdamArgs` (nine floats, an int).
unsafe impl DeviceRepr for AdamArgs {}

/// Whether the PTX is built into this binary (nvcc at build time, or
/// `EPS_CUDA_PTX_DIR`), so no NVRTC is needed at run time.
pub fn ptx_built_in() -> bool {
    cfg!(eps_cuda_ptx)
}

/// The PTX of the kernels for `arch` (`sm_80` or `sm_90`): built in when nvcc ran
/// at build time, else compiled now by NVRTC (which must be installed).
pub fn ptx_for(arch: &'static str) -> Result<String, CudaError> {
    #[cfg(eps_cuda_ptx)]
    {
        match arch {
            "sm_80" => return Ok(include_str!(concat!(env!("OUT_DIR"), "/eps_kernels_sm80.ptx")).to_string()),
            "sm_90" => return Ok(include_str!(concat!(env!("OUT_DIR"), "/eps_kernels_sm90.ptx")).to_string()),
            _ => {}
        }
    }
    compile(arch)
}

/// Compiles the source with NVRTC for `arch`, with the options that keep the
/// results equal to the CPU's (no FMA contraction, IEEE division and square root,
/// denormals kept).
pub(crate) fn compile(arch: &'static str) -> Result<String, CudaError> {
    if !crate::nvrtc_present() {
        return Err(CudaError::NoCompiler);
    }
    let opts = CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        arch: Some(arch),
        name: Some("eps_kernels.cu".into()),
        ..CompileOptions::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| CudaError::Compile { arch, log: e.to_string() })?;
    Ok(ptx.to_src())
}

/// The loaded functions.
#[derive(Debug)]
pub(crate) struct Kernels {
    sum: [CudaFunction; 3],
    sgd: CudaFunction,
    momentum: CudaFunction,
    adam: CudaFunction,
    narrow_bf16: CudaFunction,
    narrow_f16: CudaFunction,
}

impl Kernels {
    pub(crate) fn load(ctx: &Arc<CudaContext>, (major, _): (i32, i32)) -> Result<Self, CudaError> {
        let arch = if major >= 9 { ARCHS[1] } else { ARCHS[0] };
        if major < 8 {
            return Err(CudaError::Driver(format!(
                "compute capability {major}.x: the kernels need sm_80 or newer (A100, H100, ...)"
            )));
        }
        let m = ctx.load_module(Ptx::from_src(ptx_for(arch)?))?;
        let f = |name: &str| m.load_function(name);
        Ok(Self {
            sum: [f("eps_sum_f32")?, f("eps_sum_bf16")?, f("eps_sum_f16")?],
            sgd: f("eps_sgd")?,
            momentum: f("eps_momentum")?,
            adam: f("eps_adam")?,
            narrow_bf16: f("eps_narrow_bf16")?,
            narrow_f16: f("eps_narrow_f16")?,
        })
    }
}

/// A grid covering `units` work items (grid-stride loops do the rest).
fn grid(units: usize) -> LaunchConfig {
    let blocks = units.div_ceil(BLOCK as usize).clamp(1, 65_535 * 4) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

impl Gpu {
    /// `out = (inputs[0] + inputs[1] + ...) * scale` element by element, f32
    /// accumulation in input order (the multiply only when `scale != 1`), as
    /// `eps_agg::CpuAggregator::reduce`. Every input is a byte span of
    /// `out.len()` elements of `dtype`.
    pub fn sum(&self, dtype: DType, inputs: &[Span<'_, u8>], scale: f32, out: Span<'_, f32>) -> Result<(), CudaError> {
        if inputs.len() > MAX_INPUTS {
            return Err(CudaError::Bounds(format!("{} inputs: a sum takes at most {MAX_INPUTS}", inputs.len())));
        }
        let n = out.len();
        let es = dtype.size_bytes();
        if let Some(bad) = inputs.iter().find(|x| x.len() != n * es) {
            return Err(CudaError::Bounds(format!("an input of {} bytes; expected {}", bad.len(), n * es)));
        }
        let mut ptrs = Inputs([0; MAX_INPUTS]);
        for (p, x) in ptrs.0.iter_mut().zip(inputs) {
            *p = x.device_ptr();
        }
        let vec = i32::from(out.aligned16() && inputs.iter().all(|x| x.aligned16()));
        let per = if dtype == DType::F32 { 4 } else { 8 };
        let (k, n64, out_ptr) = (inputs.len() as i32, n as u64, out.device_ptr());
        let f = &self.k.sum[dtype.code() as usize];
        let mut b = self.stream.launch_builder(f);
        b.arg(&ptrs).arg(&k).arg(&scale).arg(&out_ptr).arg(&n64).arg(&vec);
        // SAFETY: the spans were bounds-checked against live allocations and every
        // input holds `n` elements (checked above); the kernel reads `k` inputs.
        unsafe { b.launch(grid(n.div_ceil(per).max(1)))? };
        Ok(())
    }

    /// One optimizer step, as `eps_agg::Optimizer::apply`: `state` holds
    /// `opt.state_per_param()` values per parameter, interleaved.
    pub fn step(
        &self,
        opt: &Optimizer,
        s: StepScalars,
        params: Span<'_, f32>,
        grad: Span<'_, f32>,
        state: Span<'_, f32>,
    ) -> Result<(), CudaError> {
        let n = params.len();
        let k = opt.state_per_param();
        if grad.len() != n || state.len() != n * k {
            return Err(CudaError::Bounds(format!(
                "{n} parameters, {} gradients, {} state values (expected {})",
                grad.len(),
                state.len(),
                n * k
            )));
        }
        let vec = i32::from(params.aligned16() && grad.aligned16() && (k == 0 || state.aligned16()));
        let (p, g, st, n64) = (params.device_ptr(), grad.device_ptr(), state.device_ptr(), n as u64);
        let cfg = grid(n.div_ceil(4).max(1));
        match *opt {
            Optimizer::Sgd { weight_decay } => {
                let mut b = self.stream.launch_builder(&self.k.sgd);
                b.arg(&p).arg(&g).arg(&n64).arg(&s.lr).arg(&weight_decay).arg(&vec);
                // SAFETY: bounds checked above and when the spans were made.
                unsafe { b.launch(cfg)? };
            }
            Optimizer::Momentum { momentum, nesterov, weight_decay } => {
                let nesterov = i32::from(nesterov);
                let mut b = self.stream.launch_builder(&self.k.momentum);
                b.arg(&p).arg(&g).arg(&st).arg(&n64).arg(&s.lr).arg(&momentum).arg(&weight_decay).arg(&nesterov).arg(&vec);
                // SAFETY: as above.
                unsafe { b.launch(cfg)? };
            }
            Optimizer::Adam { beta1, beta2, eps, weight_decay, decoupled } => {
                // The scalars as the CPU folds them (eps_agg::optim), in f32.
                let a = AdamArgs {
                    step: s.lr / s.bc1,
                    beta1,
                    beta2,
                    one_b1: 1.0 - beta1,
                    one_b2: 1.0 - beta2,
                    eps,
                    bc2_sqrt: s.bc2_sqrt,
                    wd: weight_decay,
                    decay: 1.0 - s.lr * weight_decay,
                    decoupled: i32::from(decoupled),
                };
                let mut b = self.stream.launch_builder(&self.k.adam);
                b.arg(&p).arg(&g).arg(&st).arg(&n64).arg(&a).arg(&vec);
                // SAFETY: as above.
                unsafe { b.launch(cfg)? };
            }
        }
        Ok(())
    }

    /// `dst = src` in `dtype` (round to nearest even), as `eps_agg::reduce::narrow`;
    /// `dst` is a byte span of `src.len()` elements of `dtype`.
    pub fn narrow(&self, dtype: DType, src: Span<'_, f32>, dst: Span<'_, u8>) -> Result<(), CudaError> {
        let n = src.len();
        if dst.len() != n * dtype.size_bytes() {
            return Err(CudaError::Bounds(format!("{n} values into {} bytes of {}", dst.len(), dtype.name())));
        }
        let f = match dtype {
            // f32 to f32: a one-input sum is a copy.
            DType::F32 => {
                let out = Span { ptr: dst.device_ptr(), len: n, _of: std::marker::PhantomData };
                let src = Span { ptr: src.device_ptr(), len: n * 4, _of: std::marker::PhantomData };
                return self.sum(DType::F32, &[src], 1.0, out);
            }
            DType::Bf16 => &self.k.narrow_bf16,
            DType::F16 => &self.k.narrow_f16,
        };
        let (s, d, n64) = (src.device_ptr(), dst.device_ptr(), n as u64);
        let mut b = self.stream.launch_builder(f);
        b.arg(&s).arg(&d).arg(&n64);
        // SAFETY: `dst` holds `n` 16-bit values (checked above).
        unsafe { b.launch(grid(n.max(1)))? };
        Ok(())
    }
}
