/* Buffers the caller owns, registered in place (eps_worker_join_borrowed):
 * the servers' answers land in the caller's memory and pushes read from it;
 * bad sizes and pointers are refused before the worker takes a rank; close
 * returns once nothing is in flight, after which the memory is the caller's.
 * Built and run (under AddressSanitizer where available) by tests/c_api.rs. */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "eps.h"

int main(void) {
    const char *secret = "borrowed-test-secret";
    const char *spec =
        "[job]\nworkers = 1\nservers = 2\nsteps = 4\nshard_bytes = 4096\n"
        "[model]\ndeclare = true\n[optimizer]\nkind = \"none\"\n";
    eps_cluster *cl;
    EXPECT(eps_cluster_start(spec, NULL, secret, &cl), EPS_OK);
    char addr[64];
    EXPECT(eps_cluster_get_address(cl, addr, sizeof addr), EPS_OK);
    eps_worker_options o;
    EXPECT(eps_worker_options_init(&o), EPS_OK);
    o.secret = secret;
    eps_worker *w;
    EXPECT(eps_worker_create(addr, &o, &w), EPS_OK);

    enum { N = 5000, B = 13 };
    size_t bytes = (N + B) * sizeof(float);
    /* Not page-aligned on purpose: any memory the caller has. */
    float *params = malloc(bytes + 4), *grads = malloc(bytes + 4);
    float *p = params + 1, *g = grads + 1;
    for (size_t i = 0; i < N + B; i++) p[i] = 12345.0f;
    eps_tensor_decl t[2] = {{"w", N, EPS_DTYPE_F32}, {"b", B, EPS_DTYPE_F32}};
    EXPECT(eps_worker_join_borrowed(w, t, 2, p, g, bytes - 4), EPS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(eps_last_error(), "take 20052") != NULL);
    EXPECT(eps_worker_join_borrowed(w, t, 2, NULL, g, bytes), EPS_ERR_NULL_POINTER);
    EXPECT(eps_worker_join_borrowed(w, t, 2, p, p, bytes), EPS_ERR_INVALID_ARGUMENT);
    EXPECT(eps_worker_join_borrowed(w, t, 2, p, g, bytes), EPS_OK);

    eps_worker_info info;
    EXPECT(eps_worker_get_info(w, &info), EPS_OK);
    CHECK(info.params == (void *)p && info.grads == (void *)g && info.bytes == bytes && info.rank == 0);
    /* Version 0, pulled at join, overwrote the caller's values. */
    CHECK(p[0] != 12345.0f && p[0] >= -0.01f && p[0] <= 0.01f);
    float first[1];
    EXPECT(eps_initial_params(info.seed, 0, first, 1), EPS_OK);
    CHECK(first[0] == p[0]);

    for (int step = 0; step < 4; step++) {
        for (size_t i = 0; i < N + B; i++) g[i] = (float)i * 0.5f - (float)step;
        EXPECT(eps_worker_push_pull(w), EPS_OK);
        /* One worker, optimizer "none": the average is this gradient. */
        for (size_t i = 0; i < N + B; i++) CHECK(p[i] == (float)i * 0.5f - (float)step);
    }
    EXPECT(eps_worker_finish(w), EPS_OK);
    EXPECT(eps_worker_close(w), EPS_OK);
    /* The memory is the caller's again. */
    free(params);
    free(grads);
    EXPECT(eps_cluster_wait(cl, 30000), EPS_OK);
    EXPECT(eps_cluster_close(cl), EPS_OK);
    return report("borrowed");
}
