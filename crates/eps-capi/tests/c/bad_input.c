/* Bad input to every kind of call returns a status with a message and never
 * crashes: NULL handles and pointers, foreign and closed handles, wrong sizes,
 * unknown tensors, calls out of order, a double close, mismatched
 * declarations. Then a short correct run on a job hosted in this process.
 * Built and run (under AddressSanitizer where the compiler has it) by
 * crates/eps-capi/tests/c_api.rs. */

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "eps.h"

static const char *SPEC =
    "[job]\nworkers = 1\nservers = 2\nsteps = 3\nshard_bytes = 4096\n"
    "[model]\ndeclare = true\n[[model.tables]]\nname = \"emb\"\ndim = 2\noptimizer = \"sgd\"\nlr = 1.0\n"
    "max_keys = 8\n[optimizer]\nkind = \"none\"\n";

int main(void) {
    const char *secret = "bad-input-test-secret";

    /* Versions and status names. */
    EXPECT(eps_check_version(EPS_VERSION), EPS_OK);
    EXPECT(eps_check_version((EPS_VERSION_MAJOR + 1) * 10000), EPS_ERR_VERSION);
    CHECK(strstr(eps_last_error(), "compiled with") != NULL);
    CHECK(eps_version() == EPS_VERSION);
    for (unsigned s = 0; s <= EPS_ERR_INTERNAL; s++) CHECK(strcmp(eps_status_string(s), "unknown status") != 0);
    CHECK(strcmp(eps_status_string(999), "unknown status") == 0);

    /* A job hosted in this process. */
    eps_cluster *cl = NULL;
    EXPECT(eps_cluster_start(NULL, NULL, secret, &cl), EPS_ERR_NULL_POINTER);
    EXPECT(eps_cluster_start("[job]\nworkerz = 1\n", NULL, secret, &cl), EPS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(eps_last_error(), "workerz") != NULL);
    EXPECT(eps_cluster_start(SPEC, "not an address", secret, &cl), EPS_ERR_INVALID_ARGUMENT);
    EXPECT(eps_cluster_start(SPEC, NULL, secret, NULL), EPS_ERR_NULL_POINTER);
    EXPECT(eps_cluster_start(SPEC, "127.0.0.1:0", secret, &cl), EPS_OK);
    char addr[64];
    EXPECT(eps_cluster_get_address(cl, addr, 3), EPS_ERR_INVALID_ARGUMENT);
    EXPECT(eps_cluster_get_address(cl, NULL, 64), EPS_ERR_NULL_POINTER);
    EXPECT(eps_cluster_get_address(cl, addr, sizeof addr), EPS_OK);

    /* NULL, foreign and mistyped handles. */
    int not_a_handle = 7;
    eps_worker *foreign = (eps_worker *)&not_a_handle;
    EXPECT(eps_worker_push_pull(NULL), EPS_ERR_NULL_POINTER);
    EXPECT(eps_worker_push_pull(foreign), EPS_ERR_INVALID_HANDLE);
    EXPECT(eps_worker_push_pull((eps_worker *)cl), EPS_ERR_INVALID_HANDLE);
    EXPECT(eps_worker_close(NULL), EPS_ERR_NULL_POINTER);
    EXPECT(eps_worker_close(foreign), EPS_ERR_INVALID_HANDLE);
    EXPECT(eps_cluster_wait((eps_cluster *)foreign, 1), EPS_ERR_INVALID_HANDLE);

    /* Creating a worker. */
    eps_worker_options o;
    EXPECT(eps_worker_options_init(NULL), EPS_ERR_NULL_POINTER);
    EXPECT(eps_worker_options_init(&o), EPS_OK);
    o.secret = secret;
    o.timeout_ms = 20000;
    eps_worker *w = NULL;
    EXPECT(eps_worker_create(addr, &o, NULL), EPS_ERR_NULL_POINTER);
    EXPECT(eps_worker_create("nonsense", &o, &w), EPS_ERR_INVALID_ARGUMENT);
    eps_worker_options bad = o;
    bad.struct_size = 0;
    EXPECT(eps_worker_create(addr, &bad, &w), EPS_ERR_VERSION);
    bad = o;
    bad.transport = "carrier-pigeon";
    EXPECT(eps_worker_create(addr, &bad, &w), EPS_ERR_INVALID_ARGUMENT);
    bad.transport = "rdma"; /* this build has no rdma transport */
    EXPECT(eps_worker_create(addr, &bad, &w), EPS_ERR_UNSUPPORTED);
    bad = o;
    bad.rdma_port = 300;
    EXPECT(eps_worker_create(addr, &bad, &w), EPS_ERR_INVALID_ARGUMENT);
    /* An older header's smaller struct: the fields past it take their defaults. */
    bad = o;
    bad.struct_size = offsetof(eps_worker_options, rdma_device);
    bad.rdma_port = 300; /* past struct_size: not read */
    eps_worker *old_header = NULL;
    EXPECT(eps_worker_create(addr, &bad, &old_header), EPS_OK);
    EXPECT(eps_worker_close(old_header), EPS_OK);
    EXPECT(eps_worker_create(addr, &o, &w), EPS_OK);

    /* Calls before join. */
    eps_request req;
    eps_worker_info info;
    EXPECT(eps_worker_push_pull(w), EPS_ERR_STATE);
    CHECK(strstr(eps_last_error(), "not joined") != NULL);
    EXPECT(eps_worker_push_start(w, NULL, 0, &req), EPS_ERR_STATE);
    EXPECT(eps_worker_get_info(w, &info), EPS_ERR_STATE);
    EXPECT(eps_worker_finish(w), EPS_ERR_STATE);
    EXPECT(eps_worker_leave(w), EPS_ERR_STATE);

    /* Bad declarations. */
    eps_tensor_decl t[2] = {{"fc.weight", 3000, EPS_DTYPE_F32}, {"fc.bias", 10, EPS_DTYPE_F32}};
    EXPECT(eps_worker_join(w, NULL, 2), EPS_ERR_NULL_POINTER);
    eps_tensor_decl d[2];
    memcpy(d, t, sizeof d);
    d[1].name = NULL;
    EXPECT(eps_worker_join(w, d, 2), EPS_ERR_NULL_POINTER);
    memcpy(d, t, sizeof d);
    d[1].elements = 0;
    EXPECT(eps_worker_join(w, d, 2), EPS_ERR_INVALID_ARGUMENT);
    memcpy(d, t, sizeof d);
    d[1].name = "fc.weight";
    EXPECT(eps_worker_join(w, d, 2), EPS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(eps_last_error(), "twice") != NULL);
    memcpy(d, t, sizeof d);
    d[0].dtype = (eps_dtype)7;
    EXPECT(eps_worker_join(w, d, 2), EPS_ERR_INVALID_ARGUMENT);
    memcpy(d, t, sizeof d);
    d[1].dtype = EPS_DTYPE_BF16;
    EXPECT(eps_worker_join(w, d, 2), EPS_ERR_INVALID_ARGUMENT);

    /* The first declaration fixes the layout. */
    EXPECT(eps_worker_join(w, t, 2), EPS_OK);
    EXPECT(eps_worker_join(w, t, 2), EPS_ERR_STATE);

    /* A second worker whose declaration differs is refused, naming the difference. */
    eps_worker *w2 = NULL;
    EXPECT(eps_worker_create(addr, &o, &w2), EPS_OK);
    memcpy(d, t, sizeof d);
    d[1].elements = 11;
    EXPECT(eps_worker_join(w2, d, 2), EPS_ERR_MISMATCH);
    CHECK(strstr(eps_last_error(), "(\"fc.bias\") has 10 elements in the job but 11") != NULL);
    EXPECT(eps_worker_join(w2, t, 1), EPS_ERR_MISMATCH);
    CHECK(strstr(eps_last_error(), "missing") != NULL);
    EXPECT(eps_worker_close(w2), EPS_OK);
    EXPECT(eps_worker_close(w2), EPS_ERR_INVALID_HANDLE);

    /* The job's only worker cannot leave it. */
    EXPECT(eps_worker_leave(w), EPS_ERR_CONTROL);
    CHECK(strstr(eps_last_error(), "last worker") != NULL);

    /* Layout queries with bad arguments. */
    EXPECT(eps_worker_get_info(w, NULL), EPS_ERR_NULL_POINTER);
    EXPECT(eps_worker_get_info(w, &info), EPS_OK);
    CHECK(info.tensor_count == 2 && info.dtype == EPS_DTYPE_F32 && info.rank == 0);
    /* auto without an RDMA device: shm to servers on this host, soft to others. */
    CHECK(strcmp(info.transport, "soft+shm") == 0);
    eps_tensor_info ti;
    EXPECT(eps_worker_get_tensor(w, 2, &ti), EPS_ERR_NOT_FOUND);
    EXPECT(eps_worker_get_tensor(w, 0, NULL), EPS_ERR_NULL_POINTER);
    uint32_t idx = 99;
    EXPECT(eps_worker_find_tensor(w, "nope", &idx), EPS_ERR_NOT_FOUND);
    EXPECT(eps_worker_find_tensor(w, NULL, &idx), EPS_ERR_NULL_POINTER);
    EXPECT(eps_worker_find_tensor(w, "fc.bias", &idx), EPS_OK);
    CHECK(idx == 1);
    size_t count = 0;
    uint32_t ranks[4];
    EXPECT(eps_worker_members(w, 0, NULL, 4, &count), EPS_ERR_NULL_POINTER);
    EXPECT(eps_worker_members(w, 0, ranks, 4, &count), EPS_OK);
    CHECK(count == 1 && ranks[0] == 0);
    uint64_t at = 0;
    EXPECT(eps_worker_next_change(w, 0, &at), EPS_ERR_NOT_FOUND);

    /* Sparse tables: names, NULLs, lengths. */
    uint32_t tab = 99, dim = 0;
    EXPECT(eps_table_find(w, "nope", &tab), EPS_ERR_NOT_FOUND);
    EXPECT(eps_table_find(w, NULL, &tab), EPS_ERR_NULL_POINTER);
    EXPECT(eps_table_find(w, "emb", NULL), EPS_ERR_NULL_POINTER);
    EXPECT(eps_table_find(w, "emb", &tab), EPS_OK);
    EXPECT(eps_table_dim(w, tab, &dim), EPS_OK);
    CHECK(tab == 0 && dim == 2);
    EXPECT(eps_table_dim(w, 7, &dim), EPS_ERR_NOT_FOUND);
    uint64_t keys[3] = {5, 9, 5}, many[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    float rows[18], grads[6] = {1, 2, 3, 4, 5, 6};
    uint32_t index[9];
    const float *view = NULL;
    size_t nrows = 0;
    EXPECT(eps_sparse_pull(w, tab, NULL, 3, rows, 6), EPS_ERR_NULL_POINTER);
    EXPECT(eps_sparse_pull(w, tab, keys, 3, NULL, 6), EPS_ERR_NULL_POINTER);
    EXPECT(eps_sparse_pull(w, tab, keys, 3, rows, 5), EPS_ERR_INVALID_ARGUMENT);
    EXPECT(eps_sparse_pull(w, tab, many, 9, rows, 18), EPS_ERR_INVALID_ARGUMENT);
    CHECK(strstr(eps_last_error(), "max_keys is 8") != NULL);
    EXPECT(eps_sparse_pull(w, 7, keys, 3, rows, 6), EPS_ERR_NOT_FOUND);
    EXPECT(eps_sparse_pull_rows(w, tab, keys, 3, index, NULL, &nrows), EPS_ERR_NULL_POINTER);
    EXPECT(eps_sparse_pull_rows(w, tab, keys, 3, NULL, &view, &nrows), EPS_ERR_NULL_POINTER);
    EXPECT(eps_sparse_push(w, tab, keys, 3, grads, 4), EPS_ERR_INVALID_ARGUMENT);
    EXPECT(eps_sparse_push(w, tab, keys, 3, NULL, 6), EPS_ERR_NULL_POINTER);
    EXPECT(eps_sparse_pull(w, tab, NULL, 0, NULL, 0), EPS_OK);
    EXPECT(eps_sparse_flush(w, 7), EPS_ERR_NOT_FOUND);

    /* Push/pull out of order and with bad tensor lists. */
    uint32_t bogus[1] = {5};
    EXPECT(eps_worker_pull_start(w, NULL, 0, &req), EPS_ERR_STATE);
    EXPECT(eps_worker_push_start(w, bogus, 1, &req), EPS_ERR_NOT_FOUND);
    EXPECT(eps_worker_push_start(w, NULL, 3, &req), EPS_ERR_NULL_POINTER);
    EXPECT(eps_worker_push_start(w, bogus, 100, &req), EPS_ERR_INVALID_ARGUMENT);
    EXPECT(eps_worker_push_start(w, NULL, 0, NULL), EPS_ERR_NULL_POINTER);
    eps_request fake = {w, 12345};
    int done = 0;
    EXPECT(eps_request_test(&fake, &done), EPS_ERR_INVALID_ARGUMENT);
    EXPECT(eps_request_test(NULL, &done), EPS_ERR_NULL_POINTER);
    eps_request wrong = {(eps_worker *)&not_a_handle, 1};
    EXPECT(eps_request_wait(&wrong, 10), EPS_ERR_INVALID_HANDLE);

    /* Three correct iterations: with optimizer "none" and one worker, the
     * parameters pulled are this worker's gradient. */
    eps_tensor_info wt, bt;
    EXPECT(eps_worker_get_tensor(w, 0, &wt), EPS_OK);
    EXPECT(eps_worker_get_tensor(w, 1, &bt), EPS_OK);
    CHECK(strcmp(wt.name, "fc.weight") == 0 && wt.elements == 3000 && bt.elements == 10);
    for (uint64_t step = 0; step < 3; step++) {
        eps_iteration it;
        EXPECT(eps_worker_begin(w, 8, &it), EPS_OK);
        CHECK(it.iteration == step && it.contributes == 1 && it.contributors == 1);
        CHECK(it.sample_begin == 8 * step && it.sample_end == 8 * step + 8);
        /* Key 5 twice, key 9 once: rows pulled without a copy, then
         * gradient rows pushed (key 5's summed in order). */
        EXPECT(eps_sparse_pull_rows(w, tab, keys, 3, index, &view, &nrows), EPS_OK);
        CHECK(nrows == 2 && index[0] == index[2] && index[0] != index[1]);
        float before[4] = {view[2 * index[0]], view[2 * index[0] + 1], view[2 * index[1]], view[2 * index[1] + 1]};
        EXPECT(eps_sparse_push(w, tab, keys, 3, grads, 6), EPS_OK);
        EXPECT(eps_sparse_push(w, tab, keys, 3, grads, 6), EPS_ERR_INVALID_ARGUMENT);
        CHECK(strstr(eps_last_error(), "pushed twice") != NULL);
        float *gw = (float *)wt.grads, *gb = (float *)bt.grads;
        for (uint64_t i = 0; i < wt.elements; i++) gw[i] = (float)(i + step);
        for (uint64_t i = 0; i < bt.elements; i++) gb[i] = -(float)(i + step);
        uint32_t bias_first[1] = {1}, weight_next[1] = {0};
        eps_request r1, r2;
        EXPECT(eps_worker_push_start(w, bias_first, 1, &r1), EPS_OK);
        EXPECT(eps_worker_push_start(w, bias_first, 1, &r2), EPS_ERR_STATE);
        EXPECT(eps_worker_pull_start(w, weight_next, 1, &r2), EPS_ERR_STATE);
        EXPECT(eps_worker_push_pull_start(w, weight_next, 1, &r2), EPS_OK);
        EXPECT(eps_request_wait(&r1, 0), EPS_OK);
        EXPECT(eps_request_test(&r1, &done), EPS_ERR_INVALID_ARGUMENT); /* released */
        eps_request all;
        EXPECT(eps_worker_pull_start(w, NULL, 0, &all), EPS_OK);
        EXPECT(eps_request_wait(&all, 0), EPS_OK);
        EXPECT(eps_request_wait(&r2, 0), EPS_OK);
        const float *pw = (const float *)wt.params, *pb = (const float *)bt.params;
        for (uint64_t i = 0; i < wt.elements; i++) CHECK(pw[i] == (float)(i + step));
        for (uint64_t i = 0; i < bt.elements; i++) CHECK(pb[i] == -(float)(i + step));
        /* One worker, SGD at lr 1: each row less its gradient. */
        float after[4];
        EXPECT(eps_sparse_pull(w, tab, keys, 2, after, 4), EPS_OK);
        CHECK(after[0] == before[0] - 6.0f && after[1] == before[1] - 8.0f);
        CHECK(after[2] == before[2] - 3.0f && after[3] == before[3] - 4.0f);
    }
    eps_worker_stats st;
    EXPECT(eps_worker_get_stats(w, &st), EPS_OK);
    CHECK(st.iteration == 3 && st.pushed_bytes > 0 && st.pulled_bytes > 0);

    /* Finish, then everything after it. */
    EXPECT(eps_worker_finish(w), EPS_OK);
    EXPECT(eps_worker_finish(w), EPS_ERR_STATE);
    EXPECT(eps_worker_push_pull(w), EPS_ERR_STATE);
    EXPECT(eps_worker_push_start(w, NULL, 0, &req), EPS_ERR_STATE);
    /* The last parameters stay readable until close. */
    EXPECT(eps_worker_get_tensor(w, 1, &bt), EPS_OK);
    CHECK(((const float *)bt.params)[3] == -5.0f);
    EXPECT(eps_worker_close(w), EPS_OK);
    EXPECT(eps_worker_close(w), EPS_ERR_INVALID_HANDLE);
    EXPECT(eps_worker_push_pull(w), EPS_ERR_INVALID_HANDLE);
    EXPECT(eps_worker_get_info(w, &info), EPS_ERR_INVALID_HANDLE);

    EXPECT(eps_cluster_wait(cl, 30000), EPS_OK);
    EXPECT(eps_cluster_close(cl), EPS_OK);
    EXPECT(eps_cluster_close(cl), EPS_ERR_INVALID_HANDLE);
    EXPECT(eps_cluster_get_address(cl, addr, sizeof addr), EPS_ERR_INVALID_HANDLE);

    return report("bad_input");
}
