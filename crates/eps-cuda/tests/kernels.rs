//! The CUDA kernels against the CPU: every kernel on fresh random inputs, checked
//! against an f64 computation (relative error) and against eps-agg's CPU code
//! (bit for bit), with outputs poisoned before each run, odd lengths, unaligned
//! spans and tails. These need a GPU: without one they say plainly that they
//! skipped (with `EPS_CUDA_REQUIRE` set, a missing GPU fails them).
//!
//! Without a GPU the kernels are still compiled here when NVRTC is installed
//! (`EPS_NVRTC_REQUIRE` makes its absence a failure; `ci/test.sh` installs it).

use eps_agg::{Aggregator, CpuAggregator, DType, Optimizer};
use eps_cuda::{CudaAggregator, Gpu};
use eps_fabric::Span;
use std::sync::Arc;

/// `bytes` in host memory of a span's own, as a landing slot lends them.
fn host_span(bytes: &[u8]) -> Span {
    let s = Span::alloc_host(bytes.len()).unwrap();
    s.copy_in(0, bytes).unwrap();
    s
}

#[test]
fn kernels_compile_for_sm80_and_sm90() {
    if !eps_cuda::nvrtc_present() && !eps_cuda::ptx_built_in() {
        assert!(std::env::var_os("EPS_NVRTC_REQUIRE").is_none(), "EPS_NVRTC_REQUIRE is set but libnvrtc.so is not loadable");
        println!("skipped: NVRTC (libnvrtc.so) is not installed here and no PTX is built in, so the kernels were not compiled");
        return;
    }
    for arch in ["sm_80", "sm_90"] {
        let ptx = eps_cuda::ptx_for(arch).unwrap_or_else(|e| panic!("{e}"));
        for f in [
            "eps_sum_f32",
            "eps_sum_bf16",
            "eps_sum_f16",
            "eps_sgd",
            "eps_momentum",
            "eps_adam",
            "eps_narrow_bf16",
            "eps_narrow_f16",
        ] {
            assert!(ptx.contains(&format!(".entry {f}(")), "{arch}: no entry {f}");
        }
        assert!(ptx.contains(&format!(".target {arch}")), "{arch}: the PTX targets it");
        // No contraction into fused multiply-adds: results stay the CPU's.
        assert!(!ptx.contains("fma.rn.f32"), "{arch}: an fma.rn.f32 in the PTX");
        println!("{arch}: {} bytes of PTX", ptx.len());
        // With a ptxas (EPS_PTXAS), assemble it for the architecture too: what the
        // driver's JIT does on a GPU host.
        if let Some(ptxas) = std::env::var_os("EPS_PTXAS") {
            let dir = std::env::temp_dir().join(format!("eps-ptx-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let (src, bin) = (dir.join(format!("{arch}.ptx")), dir.join(format!("{arch}.cubin")));
            std::fs::write(&src, &ptx).unwrap();
            let o = std::process::Command::new(&ptxas)
                .arg(format!("-arch={arch}"))
                .arg("-v")
                .arg(&src)
                .arg("-o")
                .arg(&bin)
                .output()
                .expect("run EPS_PTXAS");
            let log = String::from_utf8_lossy(&o.stderr);
            assert!(o.status.success(), "ptxas {arch}: {log}");
            assert!(!log.contains("spill stores") || log.contains("0 bytes spill stores"), "{arch}: register spills: {log}");
            let regs: Vec<&str> = log.lines().filter(|l| l.contains("registers")).collect();
            println!("{arch}: ptxas assembled {} kernels: {}", regs.len(), regs.join(" | "));
            std::fs::remove_dir_all(&dir).ok();
        }
    }
}

/// The GPU, or `None` (the test skips, saying so) where there is none.
fn gpu() -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => {
            println!("{}", g.info());
            Some(g)
        }
        Err(e) => {
            assert!(std::env::var_os("EPS_CUDA_REQUIRE").is_none(), "EPS_CUDA_REQUIRE is set but: {e}");
            println!("skipped: no usable GPU here ({e})");
            None
        }
    }
}

/// xorshift: values in [-1, 1).
fn rng(seed: &mut u64) -> f32 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn random(n: usize, seed: &mut u64, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng(seed) * scale).collect()
}

fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
    let mut b = vec![0u8; v.len() * dtype.size_bytes()];
    eps_agg::reduce::narrow(dtype, v, &mut b);
    b
}

/// 0xFF bytes: NaN as f32, NaN as bf16 and f16.
const POISON: u8 = 0xFF;

/// The lengths every kernel runs on: tiny, odd, around the 16-byte groups, large
/// and odd.
const LENGTHS: [usize; 7] = [1, 3, 7, 8, 33, 4097, (1 << 20) + 5];

/// `got` against the f64 sum of the contributions as the wire holds them: within
/// the bound of recursive f32 summation plus the scaling, (k + 1) * 2^-24 of the
/// sum of magnitudes (under 4e-6 for 64 inputs).
fn check_sum(dtype: DType, enc: &[Vec<u8>], scale: f32, got: &[f32], what: &str) {
    let bound = (enc.len() as f64 + 1.0) * f64::from(f32::EPSILON) / 2.0;
    for (i, &x) in got.iter().enumerate() {
        let (mut want, mut mag) = (0f64, 0f64);
        for e in enc {
            let v = f64::from(eps_agg::reduce::element(dtype, e, i));
            want += v;
            mag += v.abs();
        }
        let (want, mag) = (want * f64::from(scale), mag * f64::from(scale));
        let err = (f64::from(x) - want).abs() / mag.max(1e-30);
        assert!(err <= bound, "{what} element {i}: {x} vs {want} (rel {err:e} > {bound:e})");
    }
}

/// The f64 checks of the GPU tests hold for the CPU aggregator (so a failure on
/// the GPU is the GPU's): runs everywhere.
#[test]
fn the_f64_checks_hold_for_the_cpu() {
    let cpu = CpuAggregator::new(2);
    let mut seed = 5u64;
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        for &n in &LENGTHS {
            for k in [1usize, 3, 64] {
                let scale = 1.0 / k as f32;
                let enc: Vec<Vec<u8>> = (0..k).map(|_| encode(dtype, &random(n, &mut seed, 50.0))).collect();
                let ins: Vec<&[u8]> = enc.iter().map(|e| e.as_slice()).collect();
                let mut out = vec![f32::NAN; n];
                cpu.reduce(dtype, &ins, scale, &mut out).unwrap();
                check_sum(dtype, &enc, scale, &out, &format!("cpu {dtype:?} n={n} k={k}"));
            }
        }
    }
    for o in OPTIMIZERS {
        for &n in &LENGTHS {
            let mut p = random(n, &mut seed, 1.0);
            let mut st = vec![0f32; n * o.state_per_param()];
            let mut r = Reference::new(&p);
            for step in 0..4u64 {
                let g = random(n, &mut seed, 1.0);
                o.apply(o.scalars(step, LR), &mut p, &g, &mut st);
                r.step(&o, &g, step);
            }
            r.check(&p, &format!("cpu {} n={n}", o.name()));
        }
    }
}

#[test]
fn sums_match_f64_and_the_cpu() {
    let Some(g) = gpu() else { return };
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let cpu = CpuAggregator::new(1);
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        let es = dtype.size_bytes();
        for &n in &LENGTHS {
            for k in [1usize, 2, 3, 8, 64] {
                for offset in [0usize, 1] {
                    let scale = if k == 1 { 1.0 } else { 1.0 / k as f32 };
                    let vals: Vec<Vec<f32>> = (0..k).map(|_| random(n, &mut seed, 50.0)).collect();
                    let enc: Vec<Vec<u8>> = vals.iter().map(|v| encode(dtype, v)).collect();
                    // Inputs back to back in one allocation, `offset` elements in:
                    // offset 1 makes every span unaligned (the scalar path).
                    let mut all = vec![POISON; (offset + k * n) * es];
                    for (r, e) in enc.iter().enumerate() {
                        all[(offset + r * n) * es..(offset + (r + 1) * n) * es].copy_from_slice(e);
                    }
                    let dev = g.upload(&all).unwrap();
                    let spans: Vec<_> = (0..k).map(|r| g.span(&dev, (offset + r * n) * es, n * es).unwrap()).collect();
                    let out = g.upload(&vec![f32::NAN; n + offset]).unwrap();
                    g.sum(dtype, &spans, scale, g.span(&out, offset, n).unwrap()).unwrap();
                    let mut got = vec![0f32; n + offset];
                    g.copy_out(&out, &mut got).unwrap();
                    let got = &got[offset..];
                    check_sum(dtype, &enc, scale, got, &format!("{dtype:?} n={n} k={k} offset={offset}"));
                    // The CPU aggregator gives the same bits.
                    let mut want = vec![0f32; n];
                    let ins: Vec<&[u8]> = enc.iter().map(|e| e.as_slice()).collect();
                    cpu.reduce(dtype, &ins, scale, &mut want).unwrap();
                    let diff = got.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits());
                    assert_eq!(diff, None, "{dtype:?} n={n} k={k} offset={offset}: differs from the CPU");
                }
            }
        }
    }
}

/// The optimizers every step test runs.
const OPTIMIZERS: [Optimizer; 6] = [
    Optimizer::Average,
    Optimizer::Sgd { weight_decay: 0.01 },
    Optimizer::Momentum { momentum: 0.9, nesterov: false, weight_decay: 0.01 },
    Optimizer::Momentum { momentum: 0.9, nesterov: true, weight_decay: 0.0 },
    Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, decoupled: false },
    Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, decoupled: true },
];

/// Learning rate of the step tests.
const LR: f64 = 0.05;

/// Each optimizer's f64 definition (as eps-agg's own test transcribes it).
struct Reference {
    p: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
}

impl Reference {
    fn new(p: &[f32]) -> Self {
        Self { p: p.iter().map(|&x| f64::from(x)).collect(), m: vec![0.0; p.len()], v: vec![0.0; p.len()] }
    }

    fn step(&mut self, o: &Optimizer, g: &[f32], step: u64) {
        let (p, m, v, lr) = (&mut self.p, &mut self.m, &mut self.v, LR);
        for i in 0..p.len() {
            let gi = f64::from(g[i]);
            match *o {
                Optimizer::Average => p[i] = gi,
                Optimizer::Sgd { weight_decay: wd } => p[i] -= lr * (gi + f64::from(wd) * p[i]),
                Optimizer::Momentum { momentum: mu, nesterov, weight_decay: wd } => {
                    let gg = gi + f64::from(wd) * p[i];
                    m[i] = f64::from(mu) * m[i] + gg;
                    p[i] -= lr * if nesterov { gg + f64::from(mu) * m[i] } else { m[i] };
                }
                Optimizer::Adam { beta1, beta2, eps, weight_decay: wd, decoupled } => {
                    let (b1, b2) = (f64::from(beta1), f64::from(beta2));
                    let gg = if decoupled { gi } else { gi + f64::from(wd) * p[i] };
                    if decoupled {
                        p[i] *= 1.0 - lr * f64::from(wd);
                    }
                    m[i] = b1 * m[i] + (1.0 - b1) * gg;
                    v[i] = b2 * v[i] + (1.0 - b2) * gg * gg;
                    let t = step as i32 + 1;
                    p[i] -= lr * (m[i] / (1.0 - b1.powi(t))) / ((v[i] / (1.0 - b2.powi(t))).sqrt() + f64::from(eps));
                }
            }
        }
    }

    /// Relative error under 1e-5, of the parameter or of 1 (their scale here:
    /// they start in [-1, 1), and one near zero has cancelled values of that size).
    fn check(&self, got: &[f32], what: &str) {
        for (i, (&x, &want)) in got.iter().zip(&self.p).enumerate() {
            let err = (f64::from(x) - want).abs() / want.abs().max(1.0);
            assert!(err < 1e-5, "{what} element {i}: {x} vs {want} (rel {err:e})");
        }
    }
}

#[test]
fn optimizer_steps_match_f64_and_the_cpu() {
    let Some(g) = gpu() else { return };
    let mut seed = 42u64;
    for o in OPTIMIZERS {
        let k = o.state_per_param();
        for &n in &LENGTHS {
            for offset in [0usize, 1] {
                let p0 = random(n, &mut seed, 1.0);
                let mut cpu_p = p0.clone();
                let mut cpu_s = vec![0f32; n * k];
                let mut r = Reference::new(&p0);
                let mut host_p = vec![f32::NAN; offset];
                host_p.extend_from_slice(&p0);
                let dp = g.upload(&host_p).unwrap();
                let ds = g.alloc::<f32>(offset * k + n * k).unwrap();
                for step in 0..4u64 {
                    let grad = random(n, &mut seed, 1.0);
                    let s = o.scalars(step, LR);
                    let mut host_g = vec![f32::NAN; offset];
                    host_g.extend_from_slice(&grad);
                    let dg = g.upload(&host_g).unwrap();
                    let (ps, gs, ss) = (
                        g.span(&dp, offset, n).unwrap(),
                        g.span(&dg, offset, n).unwrap(),
                        g.span(&ds, offset * k, n * k).unwrap(),
                    );
                    g.step(&o, s, ps, gs, ss).unwrap();
                    o.apply(s, &mut cpu_p, &grad, &mut cpu_s);
                    r.step(&o, &grad, step);
                }
                let mut got = vec![0f32; offset + n];
                g.copy_out(&dp, &mut got).unwrap();
                let got = &got[offset..];
                r.check(got, &format!("{} n={n} offset={offset}", o.name()));
                let diff = got.iter().zip(&cpu_p).position(|(a, b)| a.to_bits() != b.to_bits());
                assert_eq!(diff, None, "{} n={n} offset={offset}: parameters differ from the CPU", o.name());
                let mut st = vec![0f32; offset * k + n * k];
                g.copy_out(&ds, &mut st).unwrap();
                assert!(st[offset * k..].iter().zip(&cpu_s).all(|(a, b)| a.to_bits() == b.to_bits()), "{}: state", o.name());
            }
        }
    }
}

#[test]
fn narrowing_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let mut seed = 7u64;
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        for &n in &LENGTHS {
            let mut v = random(n, &mut seed, 1000.0);
            // Ties, subnormals, overflow and infinities.
            let specials = [0.0, -0.0, 1.0 + 1.0 / 256.0, 65520.0, 1e-7, -1e-40, f32::INFINITY, f32::NEG_INFINITY, 3.0e38];
            for (x, s) in v.iter_mut().zip(specials) {
                *x = s;
            }
            let src = g.upload(&v).unwrap();
            let es = dtype.size_bytes();
            let dst = g.upload(&vec![POISON; n * es]).unwrap();
            g.narrow(dtype, g.span(&src, 0, n).unwrap(), g.span(&dst, 0, n * es).unwrap()).unwrap();
            let mut got = vec![0u8; n * es];
            g.copy_out(&dst, &mut got).unwrap();
            assert_eq!(got, encode(dtype, &v), "{dtype:?} n={n}");
        }
    }
}

#[test]
fn the_aggregator_seam_gives_the_cpu_results() {
    let Some(_) = gpu() else { return };
    let agg = CudaAggregator::open(0).unwrap();
    let cpu = CpuAggregator::new(2);
    let mut seed = 11u64;
    let n = 100_003;
    let enc: Vec<Vec<u8>> = (0..5).map(|_| encode(DType::Bf16, &random(n, &mut seed, 3.0))).collect();
    let ins: Vec<&[u8]> = enc.iter().map(|e| e.as_slice()).collect();
    let (mut a, mut b) = (vec![f32::NAN; n], vec![0f32; n]);
    agg.reduce(DType::Bf16, &ins, 0.2, &mut a).unwrap();
    cpu.reduce(DType::Bf16, &ins, 0.2, &mut b).unwrap();
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    let o = Optimizer::Adam { beta1: 0.9, beta2: 0.99, eps: 1e-6, weight_decay: 0.0, decoupled: false };
    let (mut p1, mut s1) = (random(n, &mut seed, 1.0), vec![0f32; 2 * n]);
    let (mut p2, mut s2) = (p1.clone(), s1.clone());
    agg.step(&o, o.scalars(3, 0.01), &mut p1, &a, &mut s1).unwrap();
    cpu.step(&o, o.scalars(3, 0.01), &mut p2, &b, &mut s2).unwrap();
    assert!(p1.iter().zip(&p2).all(|(x, y)| x.to_bits() == y.to_bits()));
    assert!(s1.iter().zip(&s2).all(|(x, y)| x.to_bits() == y.to_bits()));
    // Bad lengths are errors, not panics.
    assert!(agg.reduce(DType::F32, &[&[0u8; 8]], 1.0, &mut [0f32; 3]).is_err());
}

#[test]
fn without_a_driver_everything_is_an_error_not_a_panic() {
    if eps_cuda::driver_present() {
        println!("skipped: this host has the driver library");
        return;
    }
    assert!(matches!(eps_cuda::probe(), Err(eps_cuda::CudaError::NoDriver)));
    assert!(matches!(Gpu::open(0), Err(eps_cuda::CudaError::NoDriver)));
    assert!(CudaAggregator::open(0).is_err());
}

/// Shards in GPU memory give the bits of the same shard on the host device (the
/// CPU code): updates with and without a forward copy, forwarded updates,
/// publishing, and the master copy and state brought back.
#[test]
fn gpu_shards_track_the_cpu() {
    use eps_agg::{HostDevice, Out, ShardDevice};

    let Some(_) = gpu() else { return };
    let cuda = eps_cuda::CudaDevice::open(0).unwrap();
    cuda.self_check().unwrap();
    let mut seed = 99u64;
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        for o in OPTIMIZERS {
            for &n in &[1usize, 33, 4097, (1 << 20) + 5] {
                let k = o.state_per_param();
                let (mut a, mut b) = (cuda.alloc(dtype, n, k).unwrap(), HostDevice.alloc(dtype, n, k).unwrap());
                let mut ms = random(n, &mut seed, 1.0);
                ms.extend(random(n * k, &mut seed, 0.1).iter().map(|x| x.abs()));
                a.upload(&ms).unwrap();
                b.upload(&ms).unwrap();
                let es = dtype.size_bytes();
                for step in 0..3u64 {
                    let enc: Vec<Vec<u8>> = (0..3).map(|_| encode(dtype, &random(n, &mut seed, 2.0))).collect();
                    let ins: Vec<(usize, Option<Span>)> = enc.iter().enumerate().map(|(r, e)| (r, Some(host_span(e)))).collect();
                    let s = o.scalars(step, LR);
                    let (mut pa, mut pb) = (vec![POISON; n * es], vec![0u8; n * es]);
                    let (mut fa, mut fb) = (vec![f32::NAN; n], vec![0f32; n]);
                    let fwd = step == 1;
                    // Contributions 0 and 2 start for the device as they "land"
                    // (from step 1 on); contribution 1 is copied by the update.
                    if step > 0 {
                        for r in [0, 2] {
                            a.stage(r, ins[r].1.clone().unwrap()).unwrap();
                            b.stage(r, ins[r].1.clone().unwrap()).unwrap();
                        }
                    }
                    a.update(&ins, 1.0 / 3.0, &o, s, fwd.then_some(&mut fa[..]), Out::Host(&mut pa)).unwrap();
                    b.update(&ins, 1.0 / 3.0, &o, s, fwd.then_some(&mut fb[..]), Out::Host(&mut pb)).unwrap();
                    assert_eq!(pa, pb, "{dtype:?} {} n={n} step {step}: published", o.name());
                    if fwd {
                        assert!(fa.iter().zip(&fb).all(|(x, y)| x.to_bits() == y.to_bits()), "forwarded gradient");
                    }
                }
                let g = random(n, &mut seed, 0.01);
                let (mut pa, mut pb) = (vec![POISON; n * es], vec![0u8; n * es]);
                a.apply(&g, &o, o.scalars(3, LR), Out::Host(&mut pa)).unwrap();
                b.apply(&g, &o, o.scalars(3, LR), Out::Host(&mut pb)).unwrap();
                assert_eq!(pa, pb, "{dtype:?} {} n={n}: forwarded update", o.name());
                let (mut da, mut db) = (vec![f32::NAN; n * (1 + k)], vec![0f32; n * (1 + k)]);
                a.download(&mut da).unwrap();
                b.download(&mut db).unwrap();
                assert!(da.iter().zip(&db).all(|(x, y)| x.to_bits() == y.to_bits()), "master copy and state");
                let (mut pa, mut pb) = (vec![POISON; n * es], vec![0u8; n * es]);
                a.publish(Out::Host(&mut pa)).unwrap();
                b.publish(Out::Host(&mut pb)).unwrap();
                assert_eq!(pa, pb);
            }
        }
    }
}

/// The GPUDirect path: contributions read where they landed in GPU memory and
/// parameters narrowed into GPU memory at an odd offset, attached by address,
/// give the bits of the host device with host memory attached the same way.
#[test]
fn gpu_shards_on_attached_memory_track_the_cpu() {
    use eps_agg::{Attached, HostDevice, Out, ShardDevice};

    let Some(_) = gpu() else { return };
    let cuda = eps_cuda::CudaDevice::open(0).unwrap();
    let g = cuda.gpu();
    let mut seed = 7u64;
    let o = OPTIMIZERS[OPTIMIZERS.len() - 1];
    for dtype in [DType::F32, DType::Bf16] {
        for &n in &[1usize, 4097, (1 << 20) + 5] {
            let (es, k, off) = (dtype.size_bytes(), o.state_per_param(), 10usize);
            let enc: Vec<Vec<u8>> = (0..4).map(|_| encode(dtype, &random(n, &mut seed, 2.0))).collect();
            let dev_in: Vec<_> = enc.iter().map(|e| Arc::new(g.upload(e).unwrap())).collect();
            let dev_out = Arc::new(g.alloc::<u8>(off + n * es).unwrap());
            let host_out = Span::alloc_host(off + n * es).unwrap();
            let (mut a, mut b) = (cuda.alloc(dtype, n, k).unwrap(), HostDevice.alloc(dtype, n, k).unwrap());
            let mut ms = random(n, &mut seed, 1.0);
            ms.extend(random(n * k, &mut seed, 0.1).iter().map(|x| x.abs()));
            a.upload(&ms).unwrap();
            b.upload(&ms).unwrap();
            for r in 0..4 {
                a.attach(Attached::Slot(r), g.lend(&dev_in[r], 0, n * es).unwrap()).unwrap();
                b.attach(Attached::Slot(r), host_span(&enc[r])).unwrap();
            }
            a.attach(Attached::Published, g.lend(&dev_out, 0, off + n * es).unwrap()).unwrap();
            b.attach(Attached::Published, host_out.clone()).unwrap();
            for step in 0..2u64 {
                let ins = [(3usize, None), (0, None), (2, None)];
                a.update(&ins, 0.25, &o, o.scalars(step, LR), None, Out::Attached(off)).unwrap();
                b.update(&ins, 0.25, &o, o.scalars(step, LR), None, Out::Attached(off)).unwrap();
                let (mut pa, mut pb) = (vec![POISON; off + n * es], vec![0u8; off + n * es]);
                g.copy_out(&dev_out, &mut pa).unwrap();
                host_out.copy_out(0, &mut pb).unwrap();
                assert_eq!(pa[off..], pb[off..], "{dtype:?} n={n} step {step}: published in place");
            }
            drop((a, b));
        }
    }
}
