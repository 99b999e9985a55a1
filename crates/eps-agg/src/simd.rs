//! Run-time CPU feature dispatch: the only place in eps-agg with `unsafe`, which is
//! what calling a function compiled for CPU features the build does not assume takes
//! (and a prefetch hint, which is an intrinsic too).
//!
//! f32 and bf16 sums auto-vectorize well for the baseline target (they run at memory
//! bandwidth); the f16 widening does not, so on x86-64 CPUs with F16C it gets an
//! explicit kernel. Results are bitwise those of the portable code: the f16 -> f32
//! conversion is exact and each lane adds in the same (rank) order.

/// `out = in_0 + in_1 + ...` (or `out += ...` when `!first`) over f16 inputs of
/// `out.len()` elements, with F16C when the CPU has it. Returns false (and does
/// nothing) when it does not, so the caller falls back.
pub fn sum_f16(inputs: &[&[u16]], out: &mut [f32], first: bool) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("f16c") {
            // SAFETY: the features `x86::sum_f16` is compiled for were detected on this
            // CPU just above.
            unsafe { x86::sum_f16(inputs, out, first) };
            return true;
        }
    }
    let _ = (inputs, out, first);
    false
}

/// Asks the CPU to bring the cache line holding `at` closer (a hint: it
/// never faults and changes nothing, whatever the address). Lookups that
/// know their next addresses overlap their misses with it.
#[inline(always)]
pub fn prefetch<T>(at: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of every x86-64 CPU, and a prefetch neither reads
    // memory the program sees nor faults on any address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(at.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm256_add_ps, _mm256_cvtph_ps, _mm256_loadu_ps, _mm256_storeu_ps};

    /// # Safety
    /// The CPU must support AVX and F16C.
    #[target_feature(enable = "avx,f16c")]
    pub unsafe fn sum_f16(inputs: &[&[u16]], out: &mut [f32], first: bool) {
        let n = out.len();
        assert!(inputs.iter().all(|x| x.len() >= n), "every input holds out.len() elements");
        let lanes = n / 8 * 8;
        let mut i = 0;
        while i < lanes {
            // SAFETY: i + 8 <= n <= every input's length and out's length, so each
            // unaligned 16-byte load and 32-byte load/store stays inside its slice.
            unsafe {
                let (mut acc, rest) = if first {
                    (_mm256_cvtph_ps(_mm_loadu_si128(inputs[0].as_ptr().add(i).cast::<__m128i>())), &inputs[1..])
                } else {
                    (_mm256_loadu_ps(out.as_ptr().add(i)), inputs)
                };
                for x in rest {
                    acc = _mm256_add_ps(acc, _mm256_cvtph_ps(_mm_loadu_si128(x.as_ptr().add(i).cast::<__m128i>())));
                }
                _mm256_storeu_ps(out.as_mut_ptr().add(i), acc);
            }
            i += 8;
        }
        for j in lanes..n {
            let mut a = if first { half::f16::from_bits(inputs[0][j]).to_f32() } else { out[j] };
            for x in if first { &inputs[1..] } else { inputs } {
                a += half::f16::from_bits(x[j]).to_f32();
            }
            out[j] = a;
        }
    }
}
