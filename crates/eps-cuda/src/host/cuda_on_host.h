// What kernels/eps_kernels.cu needs from CUDA, for compiling it for the CPU in
// the tests (crates/eps-cuda/src/host.rs): the thread coordinates of a launch,
// the vector types, the bit casts, and the two f16 conversions (F16C, which
// rounds to nearest even and keeps subnormals, as PTX's cvt.rn does);
// sqrtf is the C library's, correctly rounded like the GPU's IEEE square root.
#pragma once

#include <cmath>
#include <cstring>
#include <immintrin.h>

#define __device__
#define __global__
#define __forceinline__ inline
#define EPS_KERNELS_ON_HOST 1

struct eps_host_dim3 {
    unsigned x, y, z;
};

// The launch being emulated: set for each thread in turn.
static eps_host_dim3 threadIdx, blockIdx, blockDim, gridDim;

struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

static inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

static inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}


static inline float eps_host_f16_to_f32(unsigned short x) { return _cvtsh_ss(x); }

static inline unsigned short eps_host_f32_to_f16(float x) {
    return (unsigned short)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
