/* Numbers and waits with bounds: declarations and specs whose element counts
 * add up past 2^64 are refused (they once wrapped to a tiny layout that
 * became the job's), and every wait ends: eps_request_wait(req, 0) returns
 * EPS_ERR_TIMEOUT after the worker's timeout when a peer stalls (here the
 * job's second worker, which never pushes), instead of waiting for ever.
 * Built and run (under AddressSanitizer and UBSan where available) by
 * crates/eps-capi/tests/c_api.rs. */

#define _POSIX_C_SOURCE 199309L

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "eps.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

int main(void) {
    const char *secret = "bounded-test-secret";

    /* A spec whose tensors add up past 2^64: refused, naming the field. */
    eps_cluster *cl = NULL;
    EXPECT(eps_cluster_start("[job]\n[model]\ntensors = [{ name = \"a\", elements = 9223372036854775807 },"
                             " { name = \"b\", elements = 9223372036854775807 }, { name = \"c\", elements = 10 }]\n",
                             NULL, secret, &cl),
           EPS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(eps_last_error(), "model.tensors.elements") != NULL);
    CHECK(cl == NULL);

    EXPECT(eps_cluster_start("[job]\nworkers = 2\nservers = 1\nsteps = 5\n[model]\ndeclare = true\n"
                             "[optimizer]\nkind = \"none\"\n",
                             "127.0.0.1:0", secret, &cl),
           EPS_OK);
    char addr[64];
    EXPECT(eps_cluster_get_address(cl, addr, sizeof addr), EPS_OK);
    eps_worker_options o;
    EXPECT(eps_worker_options_init(&o), EPS_OK);
    o.secret = secret;
    o.timeout_ms = 1500;
    o.transport = "soft";
    eps_worker *w0 = NULL, *w1 = NULL;
    EXPECT(eps_worker_create(addr, &o, &w0), EPS_OK);
    EXPECT(eps_worker_create(addr, &o, &w1), EPS_OK);

    /* A first declaration that wraps: 2^63 + 2^63 + 8 is 8 in uint64_t. */
    eps_tensor_decl wrap[3] = {{"a", UINT64_C(1) << 63, EPS_DTYPE_F32},
                               {"b", UINT64_C(1) << 63, EPS_DTYPE_F32},
                               {"c", 8, EPS_DTYPE_F32}};
    EXPECT(eps_worker_join(w0, wrap, 3), EPS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(eps_last_error(), "add up past") != NULL);
    wrap[0].elements = UINT64_MAX - 7;
    wrap[1].elements = 16;
    EXPECT(eps_worker_join(w0, wrap, 2), EPS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(eps_last_error(), "add up past") != NULL);

    /* The refusal left the job as it was: a correct declaration fixes it. */
    eps_tensor_decl t[1] = {{"w", 1000, EPS_DTYPE_F32}};
    EXPECT(eps_worker_join(w0, t, 1), EPS_OK);
    EXPECT(eps_worker_join(w1, t, 1), EPS_OK);
    eps_worker_info info;
    EXPECT(eps_worker_get_info(w0, &info), EPS_OK);
    CHECK(info.elements == 1000 && info.bytes == 4000 && info.tensor_count == 1);

    /* Worker 1 stalls (never pushes): worker 0's pull of iteration 0 can
     * never complete. wait(0) is bounded by the worker's 1.5 s timeout. */
    eps_iteration it;
    EXPECT(eps_worker_begin(w0, 1, &it), EPS_OK);
    eps_request r;
    EXPECT(eps_worker_push_pull_start(w0, NULL, 0, &r), EPS_OK);
    double t0 = now_s();
    EXPECT(eps_request_wait(&r, 0), EPS_ERR_TIMEOUT);
    double waited = now_s() - t0;
    printf("eps_request_wait(req, 0) with a stalled peer returned after %.2f s\n", waited);
    CHECK(waited >= 1.4 && waited < 10.0);
    CHECK(strstr(eps_last_error(), "not complete after 1500 ms") != NULL);
    /* An explicit bound is kept too. */
    t0 = now_s();
    EXPECT(eps_request_wait(&r, 200), EPS_ERR_TIMEOUT);
    waited = now_s() - t0;
    CHECK(waited >= 0.19 && waited < 5.0);

    /* Counts past their bounds are refused before anything is asked, and a
     * refusal of the control plane (2 worker ranks in all) changes nothing. */
    EXPECT(eps_scale(addr, secret, 5000, -1), EPS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(eps_last_error(), "at most 1024") != NULL);
    EXPECT(eps_scale(addr, secret, -1, 1000), EPS_ERR_INVALID_ARGUMENT);
    EXPECT(eps_scale(addr, secret, -1, 3), EPS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(eps_last_error(), "max_workers") != NULL);

    /* Index arithmetic that would wrap. */
    float init[8];
    EXPECT(eps_initial_params(1, UINT64_MAX - 2, init, 8), EPS_ERR_INVALID_ARGUMENT);
    EXPECT(eps_initial_params(1, UINT64_MAX - 6, init, 8), EPS_ERR_INVALID_ARGUMENT);
    EXPECT(eps_initial_params(1, UINT64_MAX - 7, init, 8), EPS_OK); /* the last index is 2^64 - 1 */

    /* The stalled worker pushes at last: the request completes. */
    EXPECT(eps_worker_begin(w1, 1, &it), EPS_OK);
    eps_request r1;
    EXPECT(eps_worker_push_pull_start(w1, NULL, 0, &r1), EPS_OK);
    EXPECT(eps_request_wait(&r1, 20000), EPS_OK);
    EXPECT(eps_request_wait(&r, 20000), EPS_OK);

    EXPECT(eps_worker_close(w0), EPS_OK);
    EXPECT(eps_worker_close(w1), EPS_OK);
    EXPECT(eps_cluster_close(cl), EPS_OK);
    return report("bounded");
}
