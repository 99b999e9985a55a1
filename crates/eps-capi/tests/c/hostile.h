/* A hostile caller of libeps: every exported call, made in any order with
 * arguments generated from bytes (NULL, foreign, mistyped and closed
 * handles; ids, counts, sizes and timeouts at and past their limits; calls
 * before join, after finish, twice), against a job hosted in this process.
 * It stays inside what the header calls defined behaviour (a buffer passed
 * with a count has room for it), and checks each answer: a known status,
 * a message with every failure, no EPS_ERR_INTERNAL (a caught panic), and
 * no call that takes longer than its documented bound.
 *
 * Used by hostile.c (a seeded run beside a well-behaved worker) and by
 * fuzz_capi.c (libFuzzer). */
#ifndef EPS_TEST_HOSTILE_H
#define EPS_TEST_HOSTILE_H

#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "eps.h"

/* Calls of the C ABI the driver makes (for its coverage report). */
enum {
    H_CHECK_VERSION, H_VERSION, H_STATUS_STRING, H_LAST_ERROR, H_INITIAL_PARAMS, H_CLUSTER_START,
    H_CLUSTER_GET_ADDRESS, H_CLUSTER_WAIT, H_CLUSTER_CLOSE, H_SCALE, H_TABLE_FIND, H_TABLE_DIM,
    H_SPARSE_PULL, H_SPARSE_PULL_ROWS, H_SPARSE_PUSH, H_SPARSE_FLUSH, H_OPTIONS_INIT, H_WORKER_CREATE,
    H_WORKER_JOIN, H_WORKER_JOIN_BORROWED, H_GET_INFO, H_GET_TENSOR, H_FIND_TENSOR, H_BEGIN, H_PUSH_START,
    H_PULL_START, H_PUSH_PULL_START, H_PUSH_PULL, H_REQUEST_TEST, H_REQUEST_WAIT, H_MEMBERS,
    H_NEXT_CHANGE, H_GET_STATS, H_LEAVE, H_FINISH, H_CLOSE, H_CALLS
};

static const char *const H_NAMES[H_CALLS] = {
    "eps_check_version", "eps_version", "eps_status_string", "eps_last_error", "eps_initial_params",
    "eps_cluster_start", "eps_cluster_get_address", "eps_cluster_wait", "eps_cluster_close", "eps_scale",
    "eps_table_find", "eps_table_dim", "eps_sparse_pull", "eps_sparse_pull_rows", "eps_sparse_push",
    "eps_sparse_flush", "eps_worker_options_init", "eps_worker_create", "eps_worker_join",
    "eps_worker_join_borrowed", "eps_worker_get_info", "eps_worker_get_tensor", "eps_worker_find_tensor",
    "eps_worker_begin", "eps_worker_push_start", "eps_worker_pull_start", "eps_worker_push_pull_start",
    "eps_worker_push_pull", "eps_request_test", "eps_request_wait", "eps_worker_members",
    "eps_worker_next_change", "eps_worker_get_stats", "eps_worker_leave", "eps_worker_finish",
    "eps_worker_close"};

/* The hostile caller's job: one worker (the driver's), one server, a sparse
 * table, tensors declared by the first join. */
static const char *H_SPEC =
    "[job]\nworkers = 1\nservers = 1\nsteps = 1000000000\nshard_bytes = 4096\n"
    "[model]\ndeclare = true\n[[model.tables]]\nname = \"emb\"\ndim = 2\noptimizer = \"sgd\"\n"
    "max_keys = 8\nkey_limit = 1000\n[optimizer]\nkind = \"none\"\n";

struct hostile {
    const char *secret;
    eps_cluster *job; /* the driver's own job (started again when it ends) */
    char addr[64];
    eps_worker *w;       /* joined to it, or NULL */
    eps_worker *spare;   /* created, not joined */
    eps_worker *closed;  /* a closed handle */
    eps_cluster *closed_job;
    eps_cluster *other;  /* another job's cluster (a well-behaved worker's): never closed here */
    char other_addr[64];
    eps_request reqs[4];
    float params[64]; /* join_borrowed's buffers (the driver's worker never uses them) */
    float grads[64];
    const uint8_t *d; /* the bytes left */
    size_t n;
    uint64_t calls[H_CALLS], failed[H_CALLS], restarts;
    int failures;
    /* The last calls and their answers, printed with a failure. */
    struct {
        int call;
        eps_status st;
        double took;
    } last[16];
    unsigned at;
};

static void h_history(const struct hostile *h) {
    fprintf(stderr, "  the calls before it, oldest first:\n");
    for (unsigned i = 0; i < 16; i++) {
        unsigned k = (h->at + i) % 16;
        if (h->last[k].call >= 0 && h->last[k].took >= 0)
            fprintf(stderr, "    %s -> %s (%.3f s)\n", H_NAMES[h->last[k].call], eps_status_string(h->last[k].st), h->last[k].took);
    }
}

static double h_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static uint8_t h_u8(struct hostile *h) {
    if (h->n == 0) return 0;
    h->n--;
    return *h->d++;
}

static uint64_t h_u64(struct hostile *h) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = v << 8 | h_u8(h);
    return v;
}

/* A number at or around a limit, or a small one. */
static uint64_t h_num(struct hostile *h) {
    static const uint64_t edges[] = {0, 1, 2, 3, 7, 8, 9, 63, 64, 1000, 1024, 1025, 4096, 65536,
                                     UINT32_MAX, (uint64_t)UINT32_MAX + 1, INT64_MAX, UINT64_MAX - 1, UINT64_MAX};
    uint8_t b = h_u8(h);
    if (b < 128) return b % 16;
    if (b < 224) return edges[b % (sizeof edges / sizeof edges[0])];
    return h_u64(h);
}

/* A worker handle: NULL, foreign, closed, mistyped, the spare or the joined one. */
static eps_worker *h_worker(struct hostile *h) {
    static int foreign = 7;
    switch (h_u8(h) % 8) {
    case 0: return NULL;
    case 1: return (eps_worker *)&foreign;
    case 2: return h->closed;
    case 3: return (eps_worker *)h->job;
    case 4: return h->spare;
    default: return h->w;
    }
}

/* A cluster handle that may be closed or waited on: never the other job's. */
static eps_cluster *h_cluster(struct hostile *h) {
    static int foreign = 9;
    switch (h_u8(h) % 5) {
    case 0: return NULL;
    case 1: return (eps_cluster *)&foreign;
    case 2: return h->closed_job;
    case 3: return (eps_cluster *)h->w;
    default: return h->job;
    }
}

static const char *h_string(struct hostile *h) {
    static const char *const s[] = {NULL, "", "emb", "w", "b", "nope", "\x01\x02", "not an address", "fc.weight",
                                    "a very long name that is not a tensor of this job at all, really"};
    return s[h_u8(h) % (sizeof s / sizeof s[0])];
}

/* A control address: the driver's job, or one that is not an address (an
 * address nobody listens on is tried for the connect wait, 10 s: not here). */
static const char *h_control(struct hostile *h) {
    static const char *const s[] = {NULL, "", "not an address", "127.0.0.1", "1.2.3.4:99999", "127.0.0.1:80,"};
    uint8_t b = h_u8(h);
    return b % 4 ? h->addr : s[b / 4 % (sizeof s / sizeof s[0])];
}

/* Records a call's answer and checks it. */
static void h_answer(struct hostile *h, int call, eps_status st, double started, double bound_s) {
    h->calls[call]++;
    double took = h_now() - started;
    int before = h->failures;
    if ((unsigned)st > EPS_ERR_INTERNAL) {
        fprintf(stderr, "HOSTILE FAIL: %s returned unknown status %d\n", H_NAMES[call], (int)st);
        h->failures++;
    } else if (st == EPS_ERR_INTERNAL) {
        fprintf(stderr, "HOSTILE FAIL: %s returned EPS_ERR_INTERNAL: %s\n", H_NAMES[call], eps_last_error());
        h->failures++;
    } else if (st != EPS_OK && eps_last_error()[0] == '\0') {
        fprintf(stderr, "HOSTILE FAIL: %s returned %s without a message\n", H_NAMES[call], eps_status_string(st));
        h->failures++;
    }
    if (st != EPS_OK) h->failed[call]++;
    if (took > bound_s) {
        fprintf(stderr, "HOSTILE FAIL: %s took %.1f s (bound %.1f s): %s\n", H_NAMES[call], took, bound_s,
                st == EPS_OK ? "ok" : eps_last_error());
        h->failures++;
    }
    if (h->failures > before) h_history(h);
    h->last[h->at % 16].call = call;
    h->last[h->at % 16].st = st;
    h->last[h->at % 16].took = took;
    h->at++;
}

#define H_CALL(call, bound_s, expr)                    \
    do {                                               \
        double t0_ = h_now();                          \
        eps_status st_ = (expr);                       \
        h_answer(h, call, st_, t0_, bound_s);          \
    } while (0)

/* Every wait of the driver's workers is bounded by this (ms). */
#define H_TIMEOUT_MS 2000
/* A call that waits for the control plane or a server at most this (s). */
#define H_BOUND_S 30.0

static void h_options(struct hostile *h, eps_worker_options *o) {
    eps_worker_options_init(o);
    o->secret = h->secret;
    o->timeout_ms = H_TIMEOUT_MS;
    o->transport = "soft";
}

/* Starts (again) the driver's own job and its joined worker. */
static void h_restart(struct hostile *h) {
    if (h->w) {
        eps_worker_close(h->w);
        h->w = NULL;
    }
    if (h->spare) {
        eps_worker_close(h->spare);
        h->spare = NULL;
    }
    if (h->job) {
        eps_cluster_close(h->job);
        h->closed_job = h->job;
        h->job = NULL;
    }
    h->restarts++;
    if (eps_cluster_start(H_SPEC, "127.0.0.1:0", h->secret, &h->job) != EPS_OK ||
        eps_cluster_get_address(h->job, h->addr, sizeof h->addr) != EPS_OK) {
        fprintf(stderr, "HOSTILE FAIL: cannot start the driver's job: %s\n", eps_last_error());
        h->failures++;
        exit(1);
    }
    eps_worker_options o;
    h_options(h, &o);
    eps_tensor_decl t[2] = {{"w", 40, EPS_DTYPE_F32}, {"b", 24, EPS_DTYPE_F32}};
    /* The worker's timeout is short (H_TIMEOUT_MS) for the waits under test; a
       join on a loaded machine may take longer, so it is tried three times. */
    for (int attempt = 1;; attempt++) {
        if (eps_worker_create(h->addr, &o, &h->w) == EPS_OK && eps_worker_join(h->w, t, 2) == EPS_OK) break;
        if (attempt == 3) {
            fprintf(stderr, "HOSTILE FAIL: cannot join the driver's job: %s\n", eps_last_error());
            h->failures++;
            exit(1);
        }
        fprintf(stderr, "hostile: join attempt %d failed (%s); trying again\n", attempt, eps_last_error());
        if (h->w) {
            eps_worker_close(h->w);
            h->w = NULL;
        }
    }
    if (eps_worker_create(h->addr, &o, &h->spare) != EPS_OK) h->spare = NULL;
}

static void h_init(struct hostile *h, const char *secret, eps_cluster *other, const char *other_addr) {
    memset(h, 0, sizeof *h);
    for (int i = 0; i < 16; i++) h->last[i].took = -1;
    h->secret = secret;
    h->other = other;
    snprintf(h->other_addr, sizeof h->other_addr, "%s", other_addr ? other_addr : "127.0.0.1:9");
    h_restart(h);
    /* A closed worker handle to pass around. */
    eps_worker_options o;
    h_options(h, &o);
    if (eps_worker_create(h->addr, &o, &h->closed) == EPS_OK) eps_worker_close(h->closed);
}

/* One call, chosen and filled in from the bytes. */
static void h_step(struct hostile *h) {
    uint8_t op = h_u8(h) % H_CALLS;
    eps_request *req = &h->reqs[h_u8(h) % 4];
    uint64_t keys[8];
    float rows[16];
    uint32_t ids[4], ranks[4], index[8];
    for (int i = 0; i < 8; i++) keys[i] = h_num(h) % 2000; /* key_limit is 1000 */
    for (int i = 0; i < 4; i++) ids[i] = (uint32_t)h_num(h);
    for (int i = 0; i < 16; i++) rows[i] = 0.0f; /* pushes carry zeros */
    size_t kc = h_u8(h) % 9;                     /* keys[] has room for 8 */
    size_t ic = h_u8(h) % 5;                     /* ids[] for 4 */
    int null_out = h_u8(h) % 8 == 0;
    switch (op) {
    case H_CHECK_VERSION: H_CALL(op, 1, eps_check_version((uint32_t)h_num(h))); break;
    case H_VERSION: h->calls[op]++; (void)eps_version(); break;
    case H_STATUS_STRING:
        h->calls[op]++;
        if (eps_status_string((uint32_t)h_num(h)) == NULL) {
            fprintf(stderr, "HOSTILE FAIL: eps_status_string returned NULL\n");
            h->failures++;
        }
        break;
    case H_LAST_ERROR: h->calls[op]++; (void)strlen(eps_last_error()); break;
    case H_INITIAL_PARAMS: {
        float out[64];
        size_t count = h_u8(h) % 65;
        H_CALL(op, 5, eps_initial_params(h_num(h), h_num(h), null_out ? NULL : out, count));
        break;
    }
    case H_CLUSTER_START: {
        /* Bad specs and addresses only: a good one would start jobs. */
        static const char *const specs[] = {NULL, "", "[job]\nworkerz = 1\n", "[job]\nworkers = 0\n",
                                            "[job]\n[model]\ntensors = [{ name = \"a\", elements = 9223372036854775807 },"
                                            " { name = \"b\", elements = 9223372036854775807 }, { name = \"c\", elements = 3 }]\n",
                                            "[job]\nservers = 5000\n[model]\ndeclare = true\n", "not toml ["};
        eps_cluster *c = NULL;
        const char *spec = specs[h_u8(h) % (sizeof specs / sizeof specs[0])];
        H_CALL(op, H_BOUND_S, eps_cluster_start(spec, h_string(h), h->secret, null_out ? NULL : &c));
        if (c) { /* never for these specs; closed if it happens */
            fprintf(stderr, "HOSTILE FAIL: eps_cluster_start accepted a bad spec\n");
            h->failures++;
            eps_cluster_close(c);
        }
        break;
    }
    case H_CLUSTER_GET_ADDRESS: {
        char buf[64];
        size_t cap = h_u8(h) % 65;
        H_CALL(op, 1, eps_cluster_get_address(h_cluster(h), null_out ? NULL : buf, cap));
        break;
    }
    case H_CLUSTER_WAIT: {
        eps_cluster *c = h_u8(h) % 4 == 0 ? h->other : h_cluster(h);
        H_CALL(op, 5, eps_cluster_wait(c, 1 + h_u8(h) % 20));
        break;
    }
    case H_CLUSTER_CLOSE: {
        eps_cluster *c = h_cluster(h);
        if (c == h->job && h_u8(h) % 16) break; /* rarely: the driver's job then starts again */
        H_CALL(op, 5, eps_cluster_close(c));
        if (c == h->job) {
            h->job = NULL;
            h->closed_job = c;
            h_restart(h);
        }
        break;
    }
    case H_SCALE: {
        /* The driver's own job, or the other one with a wrong secret. */
        int own = h_u8(h) % 2;
        const char *control = own ? h_control(h) : h->other_addr;
        const char *secret = own ? h->secret : "not-the-secret";
        int s = (int)(int64_t)h_num(h), w = (int)(int64_t)h_num(h);
        /* Both at once waits for the servers the driver never starts. */
        if (s > 0 && w > 0) s = -1;
        H_CALL(op, H_BOUND_S, eps_scale(control, secret, s, w));
        break;
    }
    case H_TABLE_FIND: {
        uint32_t t;
        H_CALL(op, 1, eps_table_find(h_worker(h), h_string(h), null_out ? NULL : &t));
        break;
    }
    case H_TABLE_DIM: {
        uint32_t dim;
        H_CALL(op, 1, eps_table_dim(h_worker(h), (uint32_t)h_num(h), null_out ? NULL : &dim));
        break;
    }
    case H_SPARSE_PULL: {
        size_t len = h_u8(h) % 17; /* rows[] has room for 16 */
        H_CALL(op, H_BOUND_S, eps_sparse_pull(h_worker(h), (uint32_t)h_num(h) % 3, kc ? keys : NULL, kc, null_out ? NULL : rows, len));
        break;
    }
    case H_SPARSE_PULL_ROWS: {
        const float *view = NULL;
        size_t nrows = 0;
        H_CALL(op, H_BOUND_S,
               eps_sparse_pull_rows(h_worker(h), (uint32_t)h_num(h) % 3, kc ? keys : NULL, kc, null_out ? NULL : index,
                                    h_u8(h) % 8 ? &view : NULL, &nrows));
        break;
    }
    case H_SPARSE_PUSH: {
        size_t len = h_u8(h) % 17;
        H_CALL(op, H_BOUND_S, eps_sparse_push(h_worker(h), (uint32_t)h_num(h) % 3, kc ? keys : NULL, kc, null_out ? NULL : rows, len));
        break;
    }
    case H_SPARSE_FLUSH: H_CALL(op, H_BOUND_S, eps_sparse_flush(h_worker(h), (uint32_t)h_num(h) % 3)); break;
    case H_OPTIONS_INIT: {
        eps_worker_options o;
        H_CALL(op, 1, eps_worker_options_init(null_out ? NULL : &o));
        break;
    }
    case H_WORKER_CREATE: {
        eps_worker_options o;
        h_options(h, &o);
        switch (h_u8(h) % 6) {
        case 0: o.struct_size = h_u8(h); break;
        case 1: o.transport = h_string(h); break;
        case 2: o.secret = "not-the-secret"; break;
        case 3: o.rdma_port = (uint32_t)h_num(h); break;
        default: break;
        }
        eps_worker *nw = NULL;
        const char *control = h_control(h);
        H_CALL(op, H_BOUND_S, eps_worker_create(control, h_u8(h) % 8 ? &o : NULL, null_out ? NULL : &nw));
        if (nw) {
            if (h->spare) eps_worker_close(h->spare);
            h->spare = nw;
        }
        break;
    }
    case H_WORKER_JOIN:
    case H_WORKER_JOIN_BORROWED: {
        eps_tensor_decl t[3] = {{"w", 40, EPS_DTYPE_F32}, {"b", 24, EPS_DTYPE_F32}, {"x", 1, EPS_DTYPE_F32}};
        for (int i = 0; i < 3; i++) {
            switch (h_u8(h) % 6) {
            case 0: t[i].name = h_string(h); break;
            case 1: t[i].elements = h_num(h); break;
            case 2: t[i].dtype = (eps_dtype)(h_u8(h) % 5); break;
            default: break;
            }
        }
        size_t count = h_u8(h) % 4;
        eps_worker *w = h_worker(h);
        if (op == H_WORKER_JOIN) {
            H_CALL(op, H_BOUND_S, eps_worker_join(w, h_u8(h) % 8 ? t : NULL, count));
        } else {
            size_t bytes = h_u8(h) % 2 ? sizeof h->params : (size_t)(h_u8(h) % 65) * 4;
            /* The worker it joins keeps these buffers: only the spare may
             * take them (it is then the one that uses them, until closed). */
            if (w == h->spare || w == NULL || w == h->closed)
                H_CALL(op, H_BOUND_S, eps_worker_join_borrowed(w, h_u8(h) % 8 ? t : NULL, count, h->params, h->grads, bytes));
        }
        break;
    }
    case H_GET_INFO: {
        eps_worker_info info;
        H_CALL(op, 1, eps_worker_get_info(h_worker(h), null_out ? NULL : &info));
        break;
    }
    case H_GET_TENSOR: {
        eps_tensor_info ti;
        H_CALL(op, 1, eps_worker_get_tensor(h_worker(h), (uint32_t)h_num(h), null_out ? NULL : &ti));
        break;
    }
    case H_FIND_TENSOR: {
        uint32_t i;
        H_CALL(op, 1, eps_worker_find_tensor(h_worker(h), h_string(h), null_out ? NULL : &i));
        break;
    }
    case H_BEGIN: {
        eps_iteration it;
        H_CALL(op, H_BOUND_S, eps_worker_begin(h_worker(h), h_num(h), null_out ? NULL : &it));
        break;
    }
    case H_PUSH_START:
    case H_PULL_START:
    case H_PUSH_PULL_START: {
        eps_worker *w = h_worker(h);
        const uint32_t *list = h_u8(h) % 3 ? ids : NULL;
        eps_request *out = null_out ? NULL : req;
        if (op == H_PUSH_START) H_CALL(op, H_BOUND_S, eps_worker_push_start(w, list, list ? ic : 0, out));
        if (op == H_PULL_START) H_CALL(op, H_BOUND_S, eps_worker_pull_start(w, list, list ? ic : 0, out));
        if (op == H_PUSH_PULL_START) H_CALL(op, H_BOUND_S, eps_worker_push_pull_start(w, list, list ? ic : 0, out));
        break;
    }
    case H_PUSH_PULL: H_CALL(op, H_BOUND_S, eps_worker_push_pull(h_worker(h))); break;
    case H_REQUEST_TEST: {
        int done;
        eps_request forged = {h_worker(h), h_num(h)};
        H_CALL(op, 1, eps_request_test(h_u8(h) % 3 ? req : &forged, null_out ? NULL : &done));
        break;
    }
    case H_REQUEST_WAIT: {
        eps_request forged = {h_worker(h), h_num(h)};
        uint32_t ms = h_u8(h) % 4 == 0 ? 0 : (uint32_t)(h_u8(h) % 50);
        /* 0 is the worker's timeout: H_TIMEOUT_MS for the driver's workers. */
        H_CALL(op, H_TIMEOUT_MS / 1000.0 + 5, eps_request_wait(h_u8(h) % 3 ? req : &forged, ms));
        break;
    }
    case H_MEMBERS: {
        size_t count, cap = h_u8(h) % 5; /* ranks[] has room for 4 */
        H_CALL(op, 1, eps_worker_members(h_worker(h), h_num(h), h_u8(h) % 4 ? ranks : NULL, cap, null_out ? NULL : &count));
        break;
    }
    case H_NEXT_CHANGE: {
        uint64_t at;
        H_CALL(op, 1, eps_worker_next_change(h_worker(h), h_num(h), null_out ? NULL : &at));
        break;
    }
    case H_GET_STATS: {
        eps_worker_stats st;
        H_CALL(op, 1, eps_worker_get_stats(h_worker(h), null_out ? NULL : &st));
        break;
    }
    case H_LEAVE:
    case H_FINISH:
    case H_CLOSE: {
        eps_worker *w = h_worker(h);
        if (w != NULL && w == h->w && h_u8(h) % 8) break; /* the joined worker: rarely */
        eps_status st = EPS_OK;
        if (op == H_LEAVE) H_CALL(op, H_BOUND_S, (st = eps_worker_leave(w)));
        if (op == H_FINISH) H_CALL(op, H_BOUND_S, (st = eps_worker_finish(w)));
        if (op == H_CLOSE) H_CALL(op, H_BOUND_S, (st = eps_worker_close(w)));
        if (op == H_CLOSE && st == EPS_OK && w == h->spare) {
            h->closed = w;
            h->spare = NULL;
        } else if (op == H_CLOSE && st == EPS_OK && w == h->w) {
            h->closed = w;
            h->w = NULL;
        }
        /* The job's one worker finished or closed: the job ends. */
        if (h->w == NULL || (w == h->w && op == H_FINISH && st == EPS_OK)) h_restart(h);
        break;
    }
    default: break;
    }
}

/* Drives calls from `n` bytes at `d`. */
static void h_drive(struct hostile *h, const uint8_t *d, size_t n) {
    h->d = d;
    h->n = n;
    while (h->n > 0) h_step(h);
}

/* Every call made at least once, or the first one missing. */
static inline const char *h_uncovered(const struct hostile *h) {
    for (int i = 0; i < H_CALLS; i++)
        if (h->calls[i] == 0) return H_NAMES[i];
    return NULL;
}

#endif
