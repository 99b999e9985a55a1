//! N-way reduction of gradient buffers into an f32 accumulator.
//!
//! Summation order is fixed: contribution 0 first, then 1, 2, ... (rank order), each
//! element independently. Nothing depends on an element's position in a vector
//! register or on how the range is split across threads, so a result is bitwise the
//! same whatever the thread count, SIMD width, or shard boundaries.

use half::{bf16, f16};

use crate::DType;

/// Block of elements processed per inner step (keeps the accumulator in L1).
const BLOCK: usize = 2048;

#[inline(always)]
fn load(dtype: DType, src: &[u8], i: usize) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes([src[4 * i], src[4 * i + 1], src[4 * i + 2], src[4 * i + 3]]),
        DType::Bf16 => bf16::from_bits(u16::from_le_bytes([src[2 * i], src[2 * i + 1]])).to_f32(),
        DType::F16 => f16::from_bits(u16::from_le_bytes([src[2 * i], src[2 * i + 1]])).to_f32(),
    }
}

/// Converts `dst.len()` elements of `src` (little-endian `dtype`) to f32 into `dst`.
#[inline(always)]
fn widen(dtype: DType, src: &[u8], dst: &mut [f32]) {
    match dtype {
        DType::F32 => match bytemuck::try_cast_slice::<u8, f32>(src) {
            Ok(s) if cfg!(target_endian = "little") => dst.copy_from_slice(s),
            _ => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                    *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                }
            }
        },
        DType::Bf16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f32::from_bits((u16::from_le_bytes([s[0], s[1]]) as u32) << 16);
            }
        }
        DType::F16 => match bytemuck::try_cast_slice::<u8, f16>(src) {
            // half converts slices with F16C when the CPU has it (detected at run time).
            Ok(s) if cfg!(target_endian = "little") => half::slice::HalfFloatSliceExt::convert_to_f32_slice(s, dst),
            _ => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = f16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32();
                }
            }
        },
    }
}

/// Adds `dtype` elements of `src` into `acc`.
#[inline(always)]
fn accumulate(dtype: DType, src: &[u8], acc: &mut [f32], tmp: &mut [f32]) {
    if dtype == DType::F32
        && cfg!(target_endian = "little")
        && let Ok(s) = bytemuck::try_cast_slice::<u8, f32>(src)
    {
        for (a, b) in acc.iter_mut().zip(s) {
            *a += *b;
        }
        return;
    }
    let t = &mut tmp[..acc.len()];
    widen(dtype, src, t);
    for (a, b) in acc.iter_mut().zip(t.iter()) {
        *a += *b;
    }
}

/// `out[i] = in_0[i] + in_1[i] + ... ` (f32 accumulation, rank order), single thread.
///
/// Every input holds `out.len()` elements of `dtype`. The output is produced block by
/// block, so it is written to memory once and each input is read once.
pub fn sum_serial(dtype: DType, inputs: &[&[u8]], out: &mut [f32]) {
    let n = out.len();
    debug_assert!(inputs.iter().all(|x| x.len() == n * dtype.size_bytes()));
    let Some((first, rest)) = inputs.split_first() else {
        out.fill(0.0);
        return;
    };
    let aligned = |a: usize| cfg!(target_endian = "little") && inputs.iter().all(|x| x.as_ptr() as usize % a == 0);
    match dtype {
        DType::F32 if aligned(4) => return sum_streams::<f32>(inputs, out, |x| x),
        DType::Bf16 if aligned(2) => return sum_streams::<u16>(inputs, out, |x| f32::from_bits((x as u32) << 16)),
        DType::F16 if aligned(2) => {
            // F16C when the CPU has it (detected at run time), else a widening table.
            let mut first = true;
            let mut fast = true;
            for group in inputs.chunks(8) {
                let g: [&[u16]; 8] = std::array::from_fn(|r| group.get(r).map_or(&[][..], |x| bytemuck::cast_slice(x)));
                if !crate::simd::sum_f16(&g[..group.len()], out, first) {
                    fast = false;
                    break;
                }
                first = false;
            }
            if fast {
                return;
            }
            let t = f16_table();
            return sum_streams::<u16>(inputs, out, |x| t[x as usize]);
        }
        _ => {}
    }
    let es = dtype.size_bytes();
    let mut tmp = [0f32; BLOCK];
    let mut start = 0;
    while start < n {
        let len = BLOCK.min(n - start);
        let acc = &mut out[start..start + len];
        let range = start * es..(start + len) * es;
        widen(dtype, &first[range.clone()], acc);
        for inp in rest {
            accumulate(dtype, &inp[range.clone()], acc, &mut tmp);
        }
        start += len;
    }
}

/// Every f16 bit pattern widened to f32 (256 KiB, stays in L2): a table lookup per
/// element beats converting in registers on CPUs without F16C in the fold loop.
fn f16_table() -> &'static [f32; 65536] {
    static TABLE: std::sync::OnceLock<Box<[f32; 65536]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = Box::new([0f32; 65536]);
        for (i, v) in t.iter_mut().enumerate() {
            *v = f16::from_bits(i as u16).to_f32();
        }
        t
    })
}

/// Aligned inputs whose conversion is cheap: one streaming pass per group of up to
/// eight inputs, every input of the group read concurrently and the running sum kept
/// in registers: `out = ((in0 + in1) + in2) + ...`, then `out = ((out + in8) + ...`.
fn sum_streams<T: bytemuck::Pod>(inputs: &[&[u8]], out: &mut [f32], conv: impl Fn(T) -> f32 + Copy) {
    let mut first = true;
    fn cast<'a, T: bytemuck::Pod>(x: &&'a [u8]) -> &'a [T] {
        bytemuck::cast_slice(x)
    }
    for group in inputs.chunks(8) {
        match group {
            [a] => fold::<1, T>(out, [a].map(cast::<T>), first, conv),
            [a, b] => fold::<2, T>(out, [a, b].map(cast::<T>), first, conv),
            [a, b, c] => fold::<3, T>(out, [a, b, c].map(cast::<T>), first, conv),
            [a, b, c, d] => fold::<4, T>(out, [a, b, c, d].map(cast::<T>), first, conv),
            [a, b, c, d, e] => fold::<5, T>(out, [a, b, c, d, e].map(cast::<T>), first, conv),
            [a, b, c, d, e, f] => fold::<6, T>(out, [a, b, c, d, e, f].map(cast::<T>), first, conv),
            [a, b, c, d, e, f, g] => fold::<7, T>(out, [a, b, c, d, e, f, g].map(cast::<T>), first, conv),
            [a, b, c, d, e, f, g, h] => fold::<8, T>(out, [a, b, c, d, e, f, g, h].map(cast::<T>), first, conv),
            _ => unreachable!("chunks(8) yields 1 to 8 inputs"),
        }
        first = false;
    }
}

#[inline(always)]
fn fold<const K: usize, T: Copy>(out: &mut [f32], srcs: [&[T]; K], first: bool, conv: impl Fn(T) -> f32) {
    let n = out.len();
    let srcs: [&[T]; K] = srcs.map(|s| &s[..n]);
    if first {
        for (i, o) in out.iter_mut().enumerate() {
            let mut a = conv(srcs[0][i]);
            for s in &srcs[1..] {
                a += conv(s[i]);
            }
            *o = a;
        }
    } else {
        for (i, o) in out.iter_mut().enumerate() {
            let mut a = *o;
            for s in &srcs {
                a += conv(s[i]);
            }
            *o = a;
        }
    }
}

/// The sum as [`sum_serial`], split over `threads` threads by element range.
pub fn sum(dtype: DType, inputs: &[&[u8]], out: &mut [f32], threads: usize) {
    let n = out.len();
    let threads = threads.max(1).min(n.div_ceil(MIN_PER_THREAD).max(1));
    if threads == 1 {
        return sum_serial(dtype, inputs, out);
    }
    let es = dtype.size_bytes();
    let per = n.div_ceil(threads);
    std::thread::scope(|s| {
        let mut rest = out;
        let mut start = 0;
        while !rest.is_empty() {
            let len = per.min(rest.len());
            let (mine, tail) = rest.split_at_mut(len);
            rest = tail;
            let slices: [&[u8]; 64] =
                std::array::from_fn(|r| inputs.get(r).map_or(&[][..], |x| &x[start * es..(start + len) * es]));
            let k = inputs.len();
            if k <= 64 {
                s.spawn(move || sum_serial(dtype, &slices[..k], mine));
            } else {
                let owned: Vec<&[u8]> = inputs.iter().map(|x| &x[start * es..(start + len) * es]).collect();
                s.spawn(move || sum_serial(dtype, &owned, mine));
            }
            start += len;
        }
    });
}

/// Below this many elements per thread, more threads cost more than they save.
const MIN_PER_THREAD: usize = 64 * 1024;

/// Element `i` of a `dtype` buffer, as f32 (for tests and references).
pub fn element(dtype: DType, src: &[u8], i: usize) -> f32 {
    load(dtype, src, i)
}

/// Narrows f32 values into `dst` as `dtype` (round to nearest even).
pub fn narrow(dtype: DType, src: &[f32], dst: &mut [u8]) {
    match dtype {
        DType::F32 => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&s.to_le_bytes());
            }
        }
        DType::Bf16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&bf16::from_f32(*s).to_bits().to_le_bytes());
            }
        }
        DType::F16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&f16::from_f32(*s).to_bits().to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: &mut u64) -> f32 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn inputs(dtype: DType, k: usize, n: usize, seed: u64) -> Vec<Vec<u8>> {
        let mut s = seed;
        (0..k)
            .map(|_| {
                let v: Vec<f32> = (0..n).map(|_| rng(&mut s) * 100.0).collect();
                let mut b = vec![0u8; n * dtype.size_bytes()];
                narrow(dtype, &v, &mut b);
                b
            })
            .collect()
    }

    #[test]
    fn matches_rank_order_reference_bitwise() {
        for dtype in [DType::F32, DType::Bf16, DType::F16] {
            for (k, n) in [(1, 7), (3, 5000), (8, 4099), (11, 70_001), (2, 0)] {
                let ins = inputs(dtype, k, n, 42 + k as u64);
                let refs: Vec<&[u8]> = ins.iter().map(|x| &x[..]).collect();
                let want: Vec<f32> = (0..n)
                    .map(|i| {
                        let mut a = element(dtype, refs[0], i);
                        for r in &refs[1..] {
                            a += element(dtype, r, i);
                        }
                        a
                    })
                    .collect();
                for threads in [1, 2, 3, 8] {
                    let mut out = vec![f32::NAN; n];
                    sum(dtype, &refs, &mut out, threads);
                    assert!(
                        out.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{dtype:?} k={k} n={n} threads={threads}"
                    );
                }
            }
        }
    }

    /// The portable f16 path (used where the CPU lacks F16C) agrees with the
    /// element-wise reference too.
    #[test]
    fn f16_table_path_matches_reference() {
        let ins = inputs(DType::F16, 10, 1001, 5);
        let refs: Vec<&[u8]> = ins.iter().map(|x| &x[..]).collect();
        let t = f16_table();
        let mut out = vec![f32::NAN; 1001];
        sum_streams::<u16>(&refs, &mut out, |x| t[x as usize]);
        for (i, o) in out.iter().enumerate() {
            let mut a = element(DType::F16, refs[0], i);
            for r in &refs[1..] {
                a += element(DType::F16, r, i);
            }
            assert_eq!(o.to_bits(), a.to_bits(), "element {i}");
        }
    }

    #[test]
    fn split_anywhere_gives_the_same_bits() {
        // Summing two halves separately equals summing the whole: what lets a result
        // be independent of shard boundaries.
        let ins = inputs(DType::F32, 5, 10_000, 7);
        let refs: Vec<&[u8]> = ins.iter().map(|x| &x[..]).collect();
        let mut whole = vec![0f32; 10_000];
        sum(DType::F32, &refs, &mut whole, 1);
        for cut in [1, 333, 4096, 9_999] {
            let a: Vec<&[u8]> = refs.iter().map(|x| &x[..cut * 4]).collect();
            let b: Vec<&[u8]> = refs.iter().map(|x| &x[cut * 4..]).collect();
            let mut oa = vec![0f32; cut];
            let mut ob = vec![0f32; 10_000 - cut];
            sum(DType::F32, &a, &mut oa, 2);
            sum(DType::F32, &b, &mut ob, 1);
            oa.extend(ob);
            assert!(oa.iter().zip(&whole).all(|(x, y)| x.to_bits() == y.to_bits()));
        }
    }
}
