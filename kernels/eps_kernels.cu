// EPS GPU kernels: the N-way gradient sum and the fused optimizer steps of a
// parameter server, plus the narrowing of f32 parameters to the wire dtype.
//
// Every kernel computes exactly what the CPU aggregator (crates/eps-agg) computes,
// operation for operation: sums in rank order with f32 accumulation, the same
// expression order in the optimizers, host-computed per-step scalars, and no
// contraction into fused multiply-adds (compiled with -fmad=false; division and
// square root are IEEE round-to-nearest, as without fast math). A BSP run is then
// bitwise the same on either aggregator.
//
// Layout: grid-stride loops over groups of 16 bytes (four f32, or eight 16-bit
// values) when every pointer is 16-byte aligned (the host says so in `vec`),
// then the tail element by element; any length works.
//
// Built to PTX by nvcc for sm_80 and sm_90 when the toolkit is there, else
// compiled at run time by NVRTC (crates/eps-cuda/build.rs). No header is needed.
//
// The tests also compile this file for the CPU (EPS_KERNELS_ON_HOST, with
// crates/eps-cuda/src/host/cuda_on_host.h): every thread of a launch's grid runs
// in turn, and the two f16 conversions below use the CPU's F16C instructions,
// which round as the PTX ones do.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

// Most contributions one sum takes (a server sums at most 64 workers).
#define EPS_MAX_INPUTS 64

// The contributions, passed by value (512 bytes of kernel parameters).
struct Inputs {
    const void* p[EPS_MAX_INPUTS];
};

// dtype codes, as eps_agg::DType::code.
#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2

__device__ __forceinline__ float bf16_to_f32(u16 x) { return __uint_as_float(((u32)x) << 16); }

__device__ __forceinline__ float f16_to_f32(u16 x) {
#ifdef EPS_KERNELS_ON_HOST
    return eps_host_f16_to_f32(x);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#endif
}

template <int DT>
__device__ __forceinline__ float load_one(const void* p, u64 i) {
    if (DT == DT_F32) return ((const float*)p)[i];
    u16 x = ((const u16*)p)[i];
    return DT == DT_BF16 ? bf16_to_f32(x) : f16_to_f32(x);
}

__device__ __forceinline__ u64 first_index() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ u64 stride() { return (u64)gridDim.x * blockDim.x; }

// out[i] = (in0[i] + in1[i] + ... ) * scale, the multiply only when scale != 1.
template <int DT>
__device__ void sum_scalar(const Inputs& in, int k, float scale, float* __restrict__ out, u64 from, u64 n) {
    for (u64 i = from + first_index(); i < n; i += stride()) {
        float acc = 0.0f;
        if (k > 0) acc = load_one<DT>(in.p[0], i);
        for (int r = 1; r < k; r++) acc = acc + load_one<DT>(in.p[r], i);
        if (scale != 1.0f) acc = acc * scale;
        out[i] = acc;
    }
}

extern "C" __global__ void eps_sum_f32(Inputs in, int k, float scale, float* __restrict__ out, u64 n, int vec) {
    u64 done = 0;
    if (vec && k > 0) {
        u64 quads = n / 4;
        for (u64 q = first_index(); q < quads; q += stride()) {
            float4 acc = ((const float4*)in.p[0])[q];
            for (int r = 1; r < k; r++) {
                float4 x = ((const float4*)in.p[r])[q];
                acc.x = acc.x + x.x;
                acc.y = acc.y + x.y;
                acc.z = acc.z + x.z;
                acc.w = acc.w + x.w;
            }
            if (scale != 1.0f) {
                acc.x = acc.x * scale;
                acc.y = acc.y * scale;
                acc.z = acc.z * scale;
                acc.w = acc.w * scale;
            }
            ((float4*)out)[q] = acc;
        }
        done = quads * 4;
    }
    sum_scalar<DT_F32>(in, k, scale, out, done, n);
}

// Eight 16-bit values of one 16-byte load, widened.
template <int DT>
__device__ __forceinline__ void widen8(uint4 v, float* f) {
    u32 w[4] = {v.x, v.y, v.z, v.w};
    for (int j = 0; j < 4; j++) {
        u16 lo = (u16)(w[j] & 0xffff), hi = (u16)(w[j] >> 16);
        f[2 * j] = DT == DT_BF16 ? bf16_to_f32(lo) : f16_to_f32(lo);
        f[2 * j + 1] = DT == DT_BF16 ? bf16_to_f32(hi) : f16_to_f32(hi);
    }
}

template <int DT>
__device__ void sum_16bit(const Inputs& in, int k, float scale, float* __restrict__ out, u64 n, int vec) {
    u64 done = 0;
    if (vec && k > 0) {
        u64 octs = n / 8;
        for (u64 o = first_index(); o < octs; o += stride()) {
            float acc[8], x[8];
            widen8<DT>(((const uint4*)in.p[0])[o], acc);
            for (int r = 1; r < k; r++) {
                widen8<DT>(((const uint4*)in.p[r])[o], x);
                for (int j = 0; j < 8; j++) acc[j] = acc[j] + x[j];
            }
            if (scale != 1.0f)
                for (int j = 0; j < 8; j++) acc[j] = acc[j] * scale;
            float4* dst = (float4*)out + 2 * o;
            dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
            dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        }
        done = octs * 8;
    }
    sum_scalar<DT>(in, k, scale, out, done, n);
}

extern "C" __global__ void eps_sum_bf16(Inputs in, int k, float scale, float* __restrict__ out, u64 n, int vec) {
    sum_16bit<DT_BF16>(in, k, scale, out, n, vec);
}

extern "C" __global__ void eps_sum_f16(Inputs in, int k, float scale, float* __restrict__ out, u64 n, int vec) {
    sum_16bit<DT_F16>(in, k, scale, out, n, vec);
}

// --- optimizers: read the gradient once, write parameters and state once ---------

__device__ __forceinline__ void sgd1(float& p, float g, float lr, float wd) {
    float gg = g + wd * p;
    p = p - lr * gg;
}

extern "C" __global__ void eps_sgd(float* __restrict__ p, const float* __restrict__ g, u64 n, float lr, float wd, int vec) {
    u64 done = 0;
    if (vec) {
        u64 quads = n / 4;
        for (u64 q = first_index(); q < quads; q += stride()) {
            float4 pv = ((float4*)p)[q];
            float4 gv = ((const float4*)g)[q];
            sgd1(pv.x, gv.x, lr, wd);
            sgd1(pv.y, gv.y, lr, wd);
            sgd1(pv.z, gv.z, lr, wd);
            sgd1(pv.w, gv.w, lr, wd);
            ((float4*)p)[q] = pv;
        }
        done = quads * 4;
    }
    for (u64 i = done + first_index(); i < n; i += stride()) sgd1(p[i], g[i], lr, wd);
}

__device__ __forceinline__ void momentum1(float& p, float g, float& b, float lr, float mu, float wd, int nesterov) {
    float gg = g + wd * p;
    b = mu * b + gg;
    float upd = nesterov ? gg + mu * b : b;
    p = p - lr * upd;
}

extern "C" __global__ void eps_momentum(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ b, u64 n,
                                        float lr, float mu, float wd, int nesterov, int vec) {
    u64 done = 0;
    if (vec) {
        u64 quads = n / 4;
        for (u64 q = first_index(); q < quads; q += stride()) {
            float4 pv = ((float4*)p)[q];
            float4 gv = ((const float4*)g)[q];
            float4 bv = ((float4*)b)[q];
            momentum1(pv.x, gv.x, bv.x, lr, mu, wd, nesterov);
            momentum1(pv.y, gv.y, bv.y, lr, mu, wd, nesterov);
            momentum1(pv.z, gv.z, bv.z, lr, mu, wd, nesterov);
            momentum1(pv.w, gv.w, bv.w, lr, mu, wd, nesterov);
            ((float4*)p)[q] = pv;
            ((float4*)b)[q] = bv;
        }
        done = quads * 4;
    }
    for (u64 i = done + first_index(); i < n; i += stride()) momentum1(p[i], g[i], b[i], lr, mu, wd, nesterov);
}

// The host folds the bias corrections: step = lr / (1 - beta1^t),
// bc2_sqrt = sqrt(1 - beta2^t), decay = 1 - lr * wd; one_b1 = 1 - beta1,
// one_b2 = 1 - beta2 (all in f32, as the CPU computes them).
struct AdamArgs {
    float step, beta1, beta2, one_b1, one_b2, eps, bc2_sqrt, wd, decay;
    int decoupled;
};

__device__ __forceinline__ void adam1(float& p, float g, float& m, float& v, const AdamArgs& a) {
    float gg = a.decoupled ? g : g + a.wd * p;
    if (a.decoupled) p = p * a.decay;
    m = a.beta1 * m + a.one_b1 * gg;
    v = a.beta2 * v + a.one_b2 * gg * gg;
    p = p - a.step * m / (sqrtf(v) / a.bc2_sqrt + a.eps);
}

// State interleaved per parameter: mv[2i] = m, mv[2i+1] = v.
extern "C" __global__ void eps_adam(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ mv, u64 n,
                                    AdamArgs a, int vec) {
    u64 done = 0;
    if (vec) {
        u64 quads = n / 4;
        for (u64 q = first_index(); q < quads; q += stride()) {
            float4 pv = ((float4*)p)[q];
            float4 gv = ((const float4*)g)[q];
            float4 s0 = ((float4*)mv)[2 * q];
            float4 s1 = ((float4*)mv)[2 * q + 1];
            adam1(pv.x, gv.x, s0.x, s0.y, a);
            adam1(pv.y, gv.y, s0.z, s0.w, a);
            adam1(pv.z, gv.z, s1.x, s1.y, a);
            adam1(pv.w, gv.w, s1.z, s1.w, a);
            ((float4*)p)[q] = pv;
            ((float4*)mv)[2 * q] = s0;
            ((float4*)mv)[2 * q + 1] = s1;
        }
        done = quads * 4;
    }
    for (u64 i = done + first_index(); i < n; i += stride()) adam1(p[i], g[i], mv[2 * i], mv[2 * i + 1], a);
}

// --- the wire dtype ------------------------------------------------------------------

// Round to nearest even; a NaN stays a (quiet) NaN with its high mantissa bits.
__device__ __forceinline__ u16 f32_to_bf16(float x) {
    u32 b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (u16)((b >> 16) | 0x40u);
    return (u16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ u16 f32_to_f16(float x) {
#ifdef EPS_KERNELS_ON_HOST
    return eps_host_f32_to_f16(x);
#else
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#endif
}

extern "C" __global__ void eps_narrow_bf16(const float* __restrict__ src, u16* __restrict__ dst, u64 n) {
    for (u64 i = first_index(); i < n; i += stride()) dst[i] = f32_to_bf16(src[i]);
}

extern "C" __global__ void eps_narrow_f16(const float* __restrict__ src, u16* __restrict__ dst, u64 n) {
    for (u64 i = first_index(); i < n; i += stride()) dst[i] = f32_to_f16(src[i]);
}
