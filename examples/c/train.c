/* A small data-parallel training program in C over libeps.
 *
 * Logistic regression on a synthetic, deterministic data set (a hidden
 * teacher labels points in 32 dimensions), trained by every worker process
 * that runs this program against one job: each iteration, a worker takes its
 * own samples (eps_worker_begin deals them out), writes the gradient straight
 * into EPS's registered gradient buffer, pushes it and pulls the parameters
 * the servers' optimizer produced, which land straight in the buffer the
 * model reads. Rank 0 prints the held-out accuracy.
 *
 *   eps up --workers 2 --steps 300 > job.env &     # EPS_CONTROL=..., EPS_JOB_SECRET_FILE=...
 *   export $(cat job.env)
 *   ./train & ./train; wait
 *
 * Build: cc -I include examples/c/train.c -L target/release -leps -lm -o train
 */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "eps.h"

#define DIM 32

/* A deterministic pseudo-random value in [-1, 1) for (sample, feature). */
static float feature(uint64_t sample, uint64_t j) {
    uint64_t x = sample * 0x9E3779B97F4A7C15ull + j * 0xBF58476D1CE4E5B9ull + 0x94D049BB133111EBull;
    x ^= x >> 31;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 32;
    return (float)((double)(x >> 11) / (double)(1ull << 53) * 2.0 - 1.0);
}

/* The teacher's label of a sample: 1 or 0. */
static int label(uint64_t sample) {
    double s = 0.3;
    for (uint64_t j = 0; j < DIM; j++) s += feature(sample, j) * ((j % 3 == 0) ? 1.0 : -0.5) * (1.0 + 0.1 * (double)j);
    return s > 0;
}

static int check(eps_status s, const char *what) {
    if (s != EPS_OK) {
        fprintf(stderr, "train: %s: %s (%s)\n", what, eps_status_string(s), eps_last_error());
        exit(1);
    }
    return 0;
}

int main(void) {
    check(eps_check_version(EPS_VERSION), "eps_check_version");
    eps_worker *w;
    /* The control address and the secret come from the environment (EPS_CONTROL,
     * EPS_JOB_SECRET or EPS_JOB_SECRET_FILE), as `eps up` prints them. */
    check(eps_worker_create(NULL, NULL, &w), "eps_worker_create");
    eps_tensor_decl tensors[2] = {{"linear.weight", DIM, EPS_DTYPE_F32}, {"linear.bias", 1, EPS_DTYPE_F32}};
    check(eps_worker_join(w, tensors, 2), "eps_worker_join");
    eps_worker_info info;
    check(eps_worker_get_info(w, &info), "eps_worker_get_info");
    eps_tensor_info wt, bt;
    check(eps_worker_get_tensor(w, 0, &wt), "eps_worker_get_tensor");
    check(eps_worker_get_tensor(w, 1, &bt), "eps_worker_get_tensor");
    const float *weight = wt.params, *bias = bt.params; /* views: no copies */
    float *gw = wt.grads, *gb = bt.grads;
    const uint64_t batch = 64;
    fprintf(stderr, "train: rank %u joined at iteration %llu of %llu (%s transport)\n", info.rank,
            (unsigned long long)info.iteration, (unsigned long long)info.steps, info.transport);
    for (;;) {
        eps_iteration it;
        check(eps_worker_begin(w, batch, &it), "eps_worker_begin");
        if (it.iteration >= info.steps || !it.contributes) break;
        for (int j = 0; j < DIM; j++) gw[j] = 0.0f;
        gb[0] = 0.0f;
        /* The mean logistic-loss gradient over this worker's samples; the
         * servers average the contributions into the whole batch's mean. */
        const float scale = 1.0f / (float)batch;
        for (uint64_t s = it.sample_begin; s < it.sample_end; s++) {
            float z = bias[0];
            for (int j = 0; j < DIM; j++) z += weight[j] * feature(s, j);
            float err = 1.0f / (1.0f + expf(-z)) - (float)label(s);
            for (int j = 0; j < DIM; j++) gw[j] += err * feature(s, j) * scale;
            gb[0] += err * scale;
        }
        /* Push, then wait for the next parameters (a framework would start
         * pushes tensor by tensor during its backward pass instead). */
        eps_request req;
        check(eps_worker_push_pull_start(w, NULL, 0, &req), "eps_worker_push_pull_start");
        check(eps_request_wait(&req, 0), "eps_request_wait");
    }
    if (info.rank == 0) {
        int right = 0, n = 2000;
        for (uint64_t s = 1u << 30; s < (1u << 30) + (uint64_t)n; s++) {
            float z = bias[0];
            for (int j = 0; j < DIM; j++) z += weight[j] * feature(s, j);
            right += (z > 0) == label(s);
        }
        printf("accuracy=%.4f\n", (double)right / n);
    }
    eps_worker_stats st;
    check(eps_worker_get_stats(w, &st), "eps_worker_get_stats");
    fprintf(stderr, "train: rank %u done: %llu iterations, %llu bytes pushed, %llu pulled\n", info.rank,
            (unsigned long long)st.iteration, (unsigned long long)st.pushed_bytes, (unsigned long long)st.pulled_bytes);
    check(eps_worker_finish(w), "eps_worker_finish");
    check(eps_worker_close(w), "eps_worker_close");
    return 0;
}
