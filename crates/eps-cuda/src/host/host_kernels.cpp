// The kernels compiled for the CPU, for the tests (crates/eps-cuda/src/host.rs):
// each entry point runs every thread of a launch's grid in turn. The kernels'
// threads share no memory and do not synchronize, so running them one after
// another computes what the GPU computes.
#include "cuda_on_host.h"

#include "../../../../kernels/eps_kernels.cu"

template <class F>
static void run_grid(unsigned blocks, unsigned threads, F kernel) {
    gridDim = eps_host_dim3{blocks, 1, 1};
    blockDim = eps_host_dim3{threads, 1, 1};
    for (unsigned b = 0; b < blocks; b++) {
        for (unsigned t = 0; t < threads; t++) {
            blockIdx = eps_host_dim3{b, 0, 0};
            threadIdx = eps_host_dim3{t, 0, 0};
            kernel();
        }
    }
}

extern "C" {

void host_eps_sum(int dtype, unsigned blocks, unsigned threads, const Inputs* in, int k, float scale, float* out, u64 n,
                  int vec) {
    run_grid(blocks, threads, [&] {
        if (dtype == DT_F32) eps_sum_f32(*in, k, scale, out, n, vec);
        if (dtype == DT_BF16) eps_sum_bf16(*in, k, scale, out, n, vec);
        if (dtype == DT_F16) eps_sum_f16(*in, k, scale, out, n, vec);
    });
}

void host_eps_sgd(unsigned blocks, unsigned threads, float* p, const float* g, u64 n, float lr, float wd, int vec) {
    run_grid(blocks, threads, [&] { eps_sgd(p, g, n, lr, wd, vec); });
}

void host_eps_momentum(unsigned blocks, unsigned threads, float* p, const float* g, float* b, u64 n, float lr, float mu,
                       float wd, int nesterov, int vec) {
    run_grid(blocks, threads, [&] { eps_momentum(p, g, b, n, lr, mu, wd, nesterov, vec); });
}

void host_eps_adam(unsigned blocks, unsigned threads, float* p, const float* g, float* mv, u64 n, const AdamArgs* a,
                   int vec) {
    run_grid(blocks, threads, [&] { eps_adam(p, g, mv, n, *a, vec); });
}

void host_eps_narrow(int f16, unsigned blocks, unsigned threads, const float* src, u16* dst, u64 n) {
    run_grid(blocks, threads, [&] {
        if (f16)
            eps_narrow_f16(src, dst, n);
        else
            eps_narrow_bf16(src, dst, n);
    });
}
}
