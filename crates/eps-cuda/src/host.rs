//! The kernels run on the CPU, for the tests: `kernels/eps_kernels.cu` compiled
//! by the host's C++ compiler (with `host/cuda_on_host.h` standing in for CUDA),
//! each launch's grid run thread by thread. The launches are planned by the same
//! code as on the GPU (`kernels::plan_*`: arguments, vector flag, grid), so what
//! these tests check is everything but the GPU itself: the kernels' index math,
//! vector and tail paths, grid-stride loops, rounding, and the launch arguments,
//! bit for bit against the CPU aggregator. They need `g++` (or `$CXX`) and an x86
//! CPU with F16C; they say plainly when they skip, and fail instead when
//! `EPS_HOST_KERNELS_REQUIRE=1` (CI).

use std::path::{Path, PathBuf};
use std::process::Command;

use eps_agg::{Aggregator, CpuAggregator, DType, Optimizer};

use crate::Span;
use crate::kernels::{AdamArgs, Inputs, Launch, Planned, plan_narrow, plan_step, plan_sum};

type SumFn = unsafe extern "C" fn(i32, u32, u32, *const Inputs, i32, f32, *mut f32, u64, i32);
type SgdFn = unsafe extern "C" fn(u32, u32, *mut f32, *const f32, u64, f32, f32, i32);
type MomentumFn = unsafe extern "C" fn(u32, u32, *mut f32, *const f32, *mut f32, u64, f32, f32, f32, i32, i32);
type AdamFn = unsafe extern "C" fn(u32, u32, *mut f32, *const f32, *mut f32, u64, *const AdamArgs, i32);
type NarrowFn = unsafe extern "C" fn(i32, u32, u32, *const f32, *mut u16, u64);

/// The kernels compiled for the CPU.
struct HostKernels {
    sum: SumFn,
    sgd: SgdFn,
    momentum: MomentumFn,
    adam: AdamFn,
    narrow: NarrowFn,
    /// Keeps the entry points above loaded.
    _lib: libloading::Library,
}

fn skip(why: &str) -> Option<HostKernels> {
    if std::env::var("EPS_HOST_KERNELS_REQUIRE").is_ok_and(|v| v == "1") {
        panic!("EPS_HOST_KERNELS_REQUIRE=1 but {why}");
    }
    println!("skipped: {why}");
    None
}

impl HostKernels {
    /// Compiles and loads the kernels, or says why not.
    fn load() -> Option<Self> {
        if !cfg!(target_arch = "x86_64") {
            return skip("the host build of the kernels needs x86-64 (F16C)");
        }
        #[cfg(target_arch = "x86_64")]
        if !std::arch::is_x86_feature_detected!("f16c") {
            return skip("this CPU has no F16C");
        }
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/host/host_kernels.cpp");
        let out =
            std::env::temp_dir().join(format!("eps-host-kernels-{}-{:?}.so", std::process::id(), std::thread::current().id()));
        let r = Command::new(&cxx)
            .args(["-std=c++17", "-O2", "-ffp-contract=off", "-fno-fast-math", "-fno-strict-aliasing", "-mf16c"])
            .args(["-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-o"])
            .arg(&out)
            .arg(&src)
            .output();
        let o = match r {
            Ok(o) => o,
            Err(e) => return skip(&format!("no C++ compiler ({cxx}: {e})")),
        };
        assert!(o.status.success(), "{cxx} failed on {}:\n{}", src.display(), String::from_utf8_lossy(&o.stderr));
        // SAFETY: a library just built from our source; its initializers do nothing.
        let lib = unsafe { libloading::Library::new(&out) }.expect("load the host kernels");
        std::fs::remove_file(&out).ok();
        fn f<T: Copy>(lib: &libloading::Library, name: &[u8]) -> T {
            // SAFETY: the symbols are the `extern "C"` functions of
            // host_kernels.cpp, whose signatures the types above repeat; the
            // library stays loaded as long as the pointers (`_lib`).
            unsafe { *lib.get::<T>(name).expect("a host kernel entry point") }
        }
        Some(Self {
            sum: f(&lib, b"host_eps_sum"),
            sgd: f(&lib, b"host_eps_sgd"),
            momentum: f(&lib, b"host_eps_momentum"),
            adam: f(&lib, b"host_eps_adam"),
            narrow: f(&lib, b"host_eps_narrow"),
            _lib: lib,
        })
    }

    /// Runs `plan` on its own grid, or on `grid` (blocks, threads per block).
    ///
    /// # Safety
    /// The plan's addresses are host memory holding what it says (it was planned
    /// from spans of live host buffers).
    unsafe fn run(&self, (launch, cfg): Planned, grid: Option<(u32, u32)>) {
        let (b, t) = grid.unwrap_or((cfg.grid_dim.0, cfg.block_dim.0));
        let Self { sum, sgd, momentum, adam, narrow, .. } = *self;
        // SAFETY: the caller's contract; each function reads and writes only the
        // spans the plan was made from.
        unsafe {
            match launch {
                Launch::Sum { dtype, inputs, k, scale, out, n, vec } => {
                    sum(dtype.code() as i32, b, t, &inputs, k, scale, out as *mut f32, n, vec)
                }
                Launch::Sgd { p, g, n, lr, wd, vec } => sgd(b, t, p as *mut f32, g as *const f32, n, lr, wd, vec),
                Launch::Momentum { p, g, b: st, n, lr, mu, wd, nesterov, vec } => {
                    momentum(b, t, p as *mut f32, g as *const f32, st as *mut f32, n, lr, mu, wd, nesterov, vec)
                }
                Launch::Adam { p, g, mv, n, a, vec } => adam(b, t, p as *mut f32, g as *const f32, mv as *mut f32, n, &a, vec),
                Launch::Narrow { f16, src, dst, n } => narrow(i32::from(f16), b, t, src as *const f32, dst as *mut u16, n),
            }
        }
    }
}

/// A span over host memory (what a device span is to the kernels).
fn span<T>(s: &[T]) -> Span<'_, T> {
    Span { ptr: s.as_ptr() as u64, len: s.len(), _of: std::marker::PhantomData }
}

/// A span over host memory the kernel writes.
fn span_mut<T>(s: &mut [T]) -> Span<'_, T> {
    Span { ptr: s.as_mut_ptr() as u64, len: s.len(), _of: std::marker::PhantomData }
}

/// 16-byte aligned storage; views start `skew` bytes in (0: aligned, so the
/// kernels take their vector paths; 4: not).
struct Buf {
    words: Vec<u128>,
    skew: usize,
    len: usize,
}

impl Buf {
    fn new(len: usize, skew: usize) -> Self {
        Self { words: vec![0; (len + skew).div_ceil(16) + 1], skew, len }
    }
    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[self.skew..self.skew + self.len]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[self.skew..self.skew + self.len]
    }
    fn f32s(&self) -> &[f32] {
        bytemuck::cast_slice(self.bytes())
    }
    fn f32s_mut(&mut self) -> &mut [f32] {
        bytemuck::cast_slice_mut(self.bytes_mut())
    }
    fn of_f32(v: &[f32], skew: usize) -> Self {
        let mut b = Self::new(v.len() * 4, skew);
        b.f32s_mut().copy_from_slice(v);
        b
    }
}

/// Deterministic values: magnitudes over many binades, both signs, exact zeros
/// now and then (a xorshift generator).
fn values(n: usize, seed: &mut u64, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            let u = (*seed >> 40) as f32 / (1u64 << 24) as f32;
            let e = ((*seed >> 8) % 24) as i32 - 12;
            if *seed % 97 == 0 { 0.0 } else { (u * 2.0 - 1.0) * scale * 2f32.powi(e) }
        })
        .collect()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn vec_flag(l: &Launch) -> i32 {
    match *l {
        Launch::Sum { vec, .. } | Launch::Sgd { vec, .. } | Launch::Momentum { vec, .. } | Launch::Adam { vec, .. } => vec,
        Launch::Narrow { .. } => 0,
    }
}

/// Element counts around the vector widths (4 and 8) and larger.
const LENGTHS: [usize; 10] = [1, 3, 4, 5, 8, 9, 31, 33, 1000, 4099];
/// The planned grid, and a small one that makes every thread loop (grid-stride).
const GRIDS: [Option<(u32, u32)>; 2] = [None, Some((2, 32))];

#[test]
fn sums_on_the_cpu_give_the_aggregators_bits() {
    let Some(h) = HostKernels::load() else { return };
    let cpu = CpuAggregator::new(1);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        let es = dtype.size_bytes();
        for k in [1usize, 2, 3, 8, 64] {
            for n in LENGTHS {
                for skew in [0usize, 4] {
                    let ins: Vec<Buf> = (0..k)
                        .map(|_| {
                            let mut b = Buf::new(n * es, skew);
                            eps_agg::reduce::narrow(dtype, &values(n, &mut seed, 4.0), b.bytes_mut());
                            b
                        })
                        .collect();
                    let refs: Vec<&[u8]> = ins.iter().map(Buf::bytes).collect();
                    let scale = if k == 1 { 1.0 } else { 1.0 / k as f32 };
                    let mut want = vec![0f32; n];
                    cpu.reduce(dtype, &refs, scale, &mut want).unwrap();
                    for grid in GRIDS {
                        let mut out = Buf::of_f32(&vec![f32::NAN; n], skew);
                        let spans: Vec<Span<'_, u8>> = refs.iter().map(|r| span(r)).collect();
                        let plan = plan_sum(dtype, &spans, scale, span_mut(out.f32s_mut())).unwrap();
                        assert_eq!(vec_flag(&plan.0), i32::from(skew == 0), "vector path when aligned");
                        // SAFETY: planned from the live buffers above.
                        unsafe { h.run(plan, grid) };
                        assert!(same_bits(out.f32s(), &want), "{dtype:?} k={k} n={n} skew={skew} grid={grid:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn optimizer_steps_on_the_cpu_give_the_aggregators_bits() {
    let Some(h) = HostKernels::load() else { return };
    let opts = [
        Optimizer::Average,
        Optimizer::Sgd { weight_decay: 0.0 },
        Optimizer::Sgd { weight_decay: 0.01 },
        Optimizer::Momentum { momentum: 0.9, nesterov: false, weight_decay: 0.0 },
        Optimizer::Momentum { momentum: 0.9, nesterov: true, weight_decay: 1e-4 },
        Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false },
        Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, decoupled: false },
        Optimizer::Adam { beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 0.05, decoupled: true },
    ];
    let mut seed = 42u64;
    for o in opts {
        let k = o.state_per_param();
        for n in LENGTHS {
            for skew in [0usize, 4] {
                for grid in GRIDS {
                    let p0 = values(n, &mut seed, 1.0);
                    let (mut p, mut st) = (Buf::of_f32(&p0, skew), Buf::of_f32(&vec![0.0; n * k], skew));
                    let (mut cp, mut cst) = (p0.clone(), vec![0f32; n * k]);
                    for step in 0..3u64 {
                        let g = Buf::of_f32(&values(n, &mut seed, 0.1), skew);
                        let s = o.scalars(step, 0.01);
                        o.apply(s, &mut cp, g.f32s(), &mut cst);
                        let plan = plan_step(&o, s, span_mut(p.f32s_mut()), span(g.f32s()), span_mut(st.f32s_mut())).unwrap();
                        assert_eq!(vec_flag(&plan.0), i32::from(skew == 0), "vector path when aligned");
                        // SAFETY: planned from the live buffers above.
                        unsafe { h.run(plan, grid) };
                        let what = format!("{} n={n} skew={skew} grid={grid:?} step {step}", o.name());
                        assert!(same_bits(p.f32s(), &cp), "{what}: parameters");
                        assert!(same_bits(st.f32s(), &cst), "{what}: state");
                    }
                }
            }
        }
    }
}

#[test]
fn narrowing_on_the_cpu_gives_the_aggregators_bits() {
    let Some(h) = HostKernels::load() else { return };
    // Every class of f32: random bit patterns (NaNs with payloads, infinities,
    // subnormals, ties), and the edges by name.
    let mut seed = 7u64;
    let mut v: Vec<f32> = (0..40_000)
        .map(|_| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            f32::from_bits((seed >> 32) as u32)
        })
        .collect();
    v.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN_POSITIVE,
        65504.0,
        65520.0,
        6.0e-8,
        1.0 + 1.0 / 1024.0,
    ]);
    v.extend((0..2048u32).map(|i| f32::from_bits(0x3f80_0000 + (i << 8))));
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        let es = dtype.size_bytes();
        for skew in [0usize, 4] {
            let src = Buf::of_f32(&v, skew);
            let mut want = vec![0u8; v.len() * es];
            eps_agg::reduce::narrow(dtype, &v, &mut want);
            for grid in GRIDS {
                let mut dst = Buf::new(v.len() * es, skew);
                dst.bytes_mut().fill(0xA5);
                let plan = plan_narrow(dtype, span(src.f32s()), span_mut(dst.bytes_mut())).unwrap();
                // SAFETY: planned from the live buffers above.
                unsafe { h.run(plan, grid) };
                let bad: Vec<(f32, &[u8], &[u8])> = dst
                    .bytes()
                    .chunks(es)
                    .zip(want.chunks(es))
                    .zip(&v)
                    .filter(|((a, b), _)| a != b)
                    .map(|((a, b), x)| (*x, a, b))
                    .take(5)
                    .collect();
                assert!(bad.is_empty(), "{dtype:?} skew={skew} grid={grid:?}: (value, kernel, CPU) {bad:?}");
            }
        }
    }
}

/// The source the host build compiles is the one the GPU build embeds.
#[test]
fn the_host_build_compiles_the_embedded_source() {
    let path: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels/eps_kernels.cu");
    assert_eq!(std::fs::read_to_string(path).unwrap(), crate::kernels::SOURCE);
    let cpp = include_str!("host/host_kernels.cpp");
    assert!(cpp.contains("#include \"../../../../kernels/eps_kernels.cu\""));
}
