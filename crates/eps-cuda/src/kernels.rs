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
pub(crate) struct Inputs(pub(crate) [u64; MAX_INPUTS]);

// SAFETY: plain data laid out as the kernel's `struct Inputs` (64 pointers).
unsafe impl DeviceRepr for Inputs {}

/// The `AdamArgs` struct of the source.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamArgs {
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

/// One kernel launch as planned from checked spans: the kernel, its arguments in
/// the order of its signature, and the grid. The GPU runs it (`Gpu::launch`); the
/// tests also run it on the CPU, with the kernels' source compiled for the host.
// The sum's 64 input addresses live on the stack for one launch: no box.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy, Debug)]
pub(crate) enum Launch {
    /// `eps_sum_f32`, `eps_sum_bf16` or `eps_sum_f16`.
    Sum { dtype: DType, inputs: Inputs, k: i32, scale: f32, out: u64, n: u64, vec: i32 },
    /// `eps_sgd`.
    Sgd { p: u64, g: u64, n: u64, lr: f32, wd: f32, vec: i32 },
    /// `eps_momentum`.
    Momentum { p: u64, g: u64, b: u64, n: u64, lr: f32, mu: f32, wd: f32, nesterov: i32, vec: i32 },
    /// `eps_adam`.
    Adam { p: u64, g: u64, mv: u64, n: u64, a: AdamArgs, vec: i32 },
    /// `eps_narrow_bf16` (`f16: false`) or `eps_narrow_f16`.
    Narrow { f16: bool, src: u64, dst: u64, n: u64 },
}

/// A launch and its grid.
pub(crate) type Planned = (Launch, LaunchConfig);

/// `out = (inputs[0] + inputs[1] + ...) * scale`: see [`Gpu::sum`].
pub(crate) fn plan_sum(dtype: DType, inputs: &[Span<'_, u8>], scale: f32, out: Span<'_, f32>) -> Result<Planned, CudaError> {
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
    let launch = Launch::Sum { dtype, inputs: ptrs, k: inputs.len() as i32, scale, out: out.device_ptr(), n: n as u64, vec };
    Ok((launch, grid(n.div_ceil(per).max(1))))
}

/// One optimizer step: see [`Gpu::step`].
pub(crate) fn plan_step(
    opt: &Optimizer,
    s: StepScalars,
    params: Span<'_, f32>,
    grad: Span<'_, f32>,
    state: Span<'_, f32>,
) -> Result<Planned, CudaError> {
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
    let launch = match *opt {
        // No optimizer: the parameters become the averaged gradient, a copy (a
        // one-input sum, as an f32 narrow is).
        Optimizer::Average => {
            let g = Span { ptr: g, len: n * 4, _of: std::marker::PhantomData };
            return plan_sum(DType::F32, &[g], 1.0, params);
        }
        Optimizer::Sgd { weight_decay } => Launch::Sgd { p, g, n: n64, lr: s.lr, wd: weight_decay, vec },
        Optimizer::Momentum { momentum, nesterov, weight_decay } => {
            Launch::Momentum { p, g, b: st, n: n64, lr: s.lr, mu: momentum, wd: weight_decay, nesterov: i32::from(nesterov), vec }
        }
        // The scalars as the CPU folds them (eps_agg::optim), in f32.
        Optimizer::Adam { beta1, beta2, eps, weight_decay, decoupled } => Launch::Adam {
            p,
            g,
            mv: st,
            n: n64,
            a: AdamArgs {
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
            },
            vec,
        },
    };
    Ok((launch, grid(n.div_ceil(4).max(1))))
}

/// `dst = src` in `dtype`: see [`Gpu::narrow`].
pub(crate) fn plan_narrow(dtype: DType, src: Span<'_, f32>, dst: Span<'_, u8>) -> Result<Planned, CudaError> {
    let n = src.len();
    if dst.len() != n * dtype.size_bytes() {
        return Err(CudaError::Bounds(format!("{n} values into {} bytes of {}", dst.len(), dtype.name())));
    }
    let f16 = match dtype {
        // f32 to f32: a one-input sum is a copy.
        DType::F32 => {
            let out = Span { ptr: dst.device_ptr(), len: n, _of: std::marker::PhantomData };
            let src = Span { ptr: src.device_ptr(), len: n * 4, _of: std::marker::PhantomData };
            return plan_sum(DType::F32, &[src], 1.0, out);
        }
        DType::Bf16 => false,
        DType::F16 => true,
    };
    Ok((Launch::Narrow { f16, src: src.device_ptr(), dst: dst.device_ptr(), n: n as u64 }, grid(n.max(1))))
}

impl Gpu {
    /// `out = (inputs[0] + inputs[1] + ...) * scale` element by element, f32
    /// accumulation in input order (the multiply only when `scale != 1`), as
    /// `eps_agg::CpuAggregator::reduce`. Every input is a byte span of
    /// `out.len()` elements of `dtype`.
    pub fn sum(&self, dtype: DType, inputs: &[Span<'_, u8>], scale: f32, out: Span<'_, f32>) -> Result<(), CudaError> {
        self.launch(plan_sum(dtype, inputs, scale, out)?)
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
        self.launch(plan_step(opt, s, params, grad, state)?)
    }

    /// `dst = src` in `dtype` (round to nearest even), as `eps_agg::reduce::narrow`;
    /// `dst` is a byte span of `src.len()` elements of `dtype`.
    pub fn narrow(&self, dtype: DType, src: Span<'_, f32>, dst: Span<'_, u8>) -> Result<(), CudaError> {
        self.launch(plan_narrow(dtype, src, dst)?)
    }

    /// Queues a planned launch on the stream.
    fn launch(&self, (launch, cfg): Planned) -> Result<(), CudaError> {
        let k = &self.k;
        match &launch {
            Launch::Sum { dtype, inputs, k: n_in, scale, out, n, vec } => {
                let mut b = self.stream.launch_builder(&k.sum[dtype.code() as usize]);
                b.arg(inputs).arg(n_in).arg(scale).arg(out).arg(n).arg(vec);
                // SAFETY: planned from spans bounds-checked against live allocations,
                // every input holding `n` elements; the kernel reads `k` inputs.
                unsafe { b.launch(cfg)? };
            }
            Launch::Sgd { p, g, n, lr, wd, vec } => {
                let mut b = self.stream.launch_builder(&k.sgd);
                b.arg(p).arg(g).arg(n).arg(lr).arg(wd).arg(vec);
                // SAFETY: planned from bounds-checked spans of `n` elements.
                unsafe { b.launch(cfg)? };
            }
            Launch::Momentum { p, g, b: st, n, lr, mu, wd, nesterov, vec } => {
                let mut b = self.stream.launch_builder(&k.momentum);
                b.arg(p).arg(g).arg(st).arg(n).arg(lr).arg(mu).arg(wd).arg(nesterov).arg(vec);
                // SAFETY: as above.
                unsafe { b.launch(cfg)? };
            }
            Launch::Adam { p, g, mv, n, a, vec } => {
                let mut b = self.stream.launch_builder(&k.adam);
                b.arg(p).arg(g).arg(mv).arg(n).arg(a).arg(vec);
                // SAFETY: as above (the state holds `2n` values).
                unsafe { b.launch(cfg)? };
            }
            Launch::Narrow { f16, src, dst, n } => {
                let mut b = self.stream.launch_builder(if *f16 { &k.narrow_f16 } else { &k.narrow_bf16 });
                b.arg(src).arg(dst).arg(n);
                // SAFETY: `dst` holds `n` 16-bit values (checked when planned).
                unsafe { b.launch(cfg)? };
            }
        }
        Ok(())
    }
}
