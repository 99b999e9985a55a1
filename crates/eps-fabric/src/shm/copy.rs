//! The one copy of a payload. Large copies store around the cache
//! (non-temporal stores on x86-64): a store that misses the cache first reads
//! the line it overwrites, so a plain copy of data bigger than the cache moves
//! three bytes through memory per byte copied, a streaming one two.

/// Copies of at least this many bytes stream (`EPS_SHM_STREAM_BYTES`; 0: never).
fn stream_min() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| {
        let v = std::env::var("EPS_SHM_STREAM_BYTES").ok().and_then(|v| v.parse().ok()).unwrap_or(1usize << 20);
        if v == 0 { usize::MAX } else { v }
    })
}

/// Copies `n` bytes from `src` to `dst`.
///
/// # Safety
/// `src` is valid for `n` bytes of reads and `dst` for `n` bytes of writes, and
/// no Rust reference aliases `dst` meanwhile (they may overlap only as two views
/// of shared pages do: the result is then torn, never undefined for this process).
pub(crate) unsafe fn copy(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if n >= stream_min() {
        // SAFETY: the caller's contract.
        return unsafe { stream(dst, src, n) };
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy(src, dst, n) }
}

#[cfg(target_arch = "x86_64")]
unsafe fn stream(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    // Up to the first 16-byte boundary of the destination, plainly.
    let head = dst.align_offset(16).min(n);
    // SAFETY: within the caller's ranges.
    unsafe { std::ptr::copy(src, dst, head) };
    let mut i = head;
    while i + 64 <= n {
        // SAFETY: bytes i..i+64 lie in both ranges; `dst + i` is 16-byte aligned;
        // SSE2 is part of x86-64.
        unsafe {
            let s = src.add(i).cast::<__m128i>();
            let d = dst.add(i).cast::<__m128i>();
            let (a, b, c, e) =
                (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)), _mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        i += 64;
    }
    // SAFETY: the streaming stores are ordered before what follows (the response
    // that says the bytes are there); the tail is within both ranges.
    unsafe {
        _mm_sfence();
        std::ptr::copy(src.add(i), dst.add(i), n - i);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn every_size_and_alignment_copies_exactly() {
        let src: Vec<u8> = (0..(3 << 20) + 200).map(|i: usize| (i * 7 % 251) as u8).collect();
        for &(so, d_off, n) in &[(0, 0, 0), (1, 3, 17), (5, 0, 4096), (3, 7, (1 << 20) + 65), (0, 9, (2 << 20) + 3)] {
            let mut dst = vec![0u8; n + 32];
            // SAFETY: both ranges lie inside their vectors.
            unsafe { super::stream(dst.as_mut_ptr().add(d_off), src.as_ptr().add(so), n) };
            assert_eq!(&dst[d_off..d_off + n], &src[so..so + n], "offsets {so}/{d_off}, {n} bytes");
            assert!(dst[..d_off].iter().chain(&dst[d_off + n..]).all(|&x| x == 0), "nothing outside");
            let mut plain = vec![0u8; n + 32];
            // SAFETY: as above.
            unsafe { super::copy(plain.as_mut_ptr().add(d_off), src.as_ptr().add(so), n) };
            assert_eq!(plain, dst);
        }
    }
}
