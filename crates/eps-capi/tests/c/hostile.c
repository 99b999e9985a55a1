/* The hostile-caller suite: hostile.h's driver makes every exported call of
 * libeps with generated arguments (seeded, so a failure replays) for
 * EPS_HOSTILE_SECONDS (default 20), while a well-behaved worker of another
 * job hosted in this process trains beside it through the same library:
 * with optimizer "none" and one worker, the parameters it pulls each
 * iteration must be, bit for bit, the gradient it pushed. Prints how often
 * each call was made and failed. Built and run (under AddressSanitizer and
 * UBSan) by crates/eps-capi/tests/c_api.rs. */

#define _POSIX_C_SOURCE 200809L

#include <pthread.h>

#include "check.h"
#include "hostile.h"

static const char *SECRET = "hostile-test-secret";
static const char *GOOD_SPEC =
    "[job]\nworkers = 1\nservers = 2\nsteps = 1000000\nshard_bytes = 4096\n"
    "[model]\ndeclare = true\n[optimizer]\nkind = \"none\"\n";

struct good {
    char addr[64];
    volatile int stop;
    uint64_t steps, wrong, errors;
};

/* The well-behaved worker: every iteration, gradients that depend on the
 * step, then the check that the parameters pulled are exactly them. */
static void *good_worker(void *arg) {
    struct good *g = arg;
    eps_worker_options o;
    eps_worker_options_init(&o);
    o.secret = SECRET;
    o.transport = "soft";
    o.timeout_ms = 30000;
    eps_worker *w = NULL;
    eps_tensor_decl t[2] = {{"fc.weight", 3000, EPS_DTYPE_F32}, {"fc.bias", 10, EPS_DTYPE_F32}};
    if (eps_worker_create(g->addr, &o, &w) != EPS_OK || eps_worker_join(w, t, 2) != EPS_OK) {
        fprintf(stderr, "the good worker cannot join: %s\n", eps_last_error());
        g->errors++;
        return NULL;
    }
    eps_worker_info info;
    eps_worker_get_info(w, &info);
    float *params = info.params, *grads = info.grads;
    while (!g->stop) {
        eps_iteration it;
        if (eps_worker_begin(w, 0, &it) != EPS_OK) {
            fprintf(stderr, "the good worker's begin failed: %s\n", eps_last_error());
            g->errors++;
            break;
        }
        for (uint64_t i = 0; i < info.elements; i++) grads[i] = (float)((i * 7 + it.iteration * 13) % 1000) * 0.001f - 0.5f;
        if (eps_worker_push_pull(w) != EPS_OK) {
            fprintf(stderr, "the good worker's push_pull failed: %s\n", eps_last_error());
            g->errors++;
            break;
        }
        for (uint64_t i = 0; i < info.elements; i++) {
            float want = (float)((i * 7 + it.iteration * 13) % 1000) * 0.001f - 0.5f;
            if (memcmp(&params[i], &want, sizeof want) != 0) g->wrong++;
        }
        g->steps++;
    }
    eps_worker_finish(w);
    eps_worker_close(w);
    return NULL;
}

/* xorshift64*: the bytes of round `r` of seed `seed`. */
static void fill(uint8_t *b, size_t n, uint64_t seed, uint64_t r) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (r + 1) * 0xD1B54A32D192ED03ull;
    for (size_t i = 0; i < n; i++) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        b[i] = (uint8_t)((x * 0x2545F4914F6CDD1Dull) >> 56);
    }
}

int main(void) {
    const char *env = getenv("EPS_HOSTILE_SECONDS");
    double seconds = env ? atof(env) : 20.0;
    uint64_t seed = getenv("EPS_HOSTILE_SEED") ? strtoull(getenv("EPS_HOSTILE_SEED"), NULL, 10) : 1;

    struct good g = {0};
    eps_cluster *other = NULL;
    EXPECT(eps_cluster_start(GOOD_SPEC, "127.0.0.1:0", SECRET, &other), EPS_OK);
    EXPECT(eps_cluster_get_address(other, g.addr, sizeof g.addr), EPS_OK);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, good_worker, &g) == 0);

    static struct hostile h;
    h_init(&h, SECRET, other, g.addr);
    double start = h_now();
    uint64_t rounds = 0;
    uint8_t bytes[512];
    while (h_now() - start < seconds || h_uncovered(&h)) {
        if (h_now() - start > 10 * seconds + 60) break;
        fill(bytes, sizeof bytes, seed, rounds);
        h_drive(&h, bytes, sizeof bytes);
        rounds++;
    }
    g.stop = 1;
    pthread_join(t, NULL);

    uint64_t total = 0;
    printf("hostile: seed %llu, %llu rounds of %zu bytes in %.1f s; the driver's job started %llu times\n",
           (unsigned long long)seed, (unsigned long long)rounds, sizeof bytes, h_now() - start,
           (unsigned long long)h.restarts);
    for (int i = 0; i < H_CALLS; i++) {
        printf("  %-28s %8llu calls, %8llu refused\n", H_NAMES[i], (unsigned long long)h.calls[i],
               (unsigned long long)h.failed[i]);
        total += h.calls[i];
    }
    printf("hostile: %llu calls of %d exported functions; the good worker trained %llu steps, %llu values wrong\n",
           (unsigned long long)total, H_CALLS, (unsigned long long)g.steps, (unsigned long long)g.wrong);
    CHECK(h_uncovered(&h) == NULL);
    if (h_uncovered(&h)) fprintf(stderr, "never called: %s\n", h_uncovered(&h));
    failures += h.failures;
    CHECK(g.errors == 0);
    CHECK(g.wrong == 0);
    CHECK(g.steps >= 10);
    EXPECT(eps_cluster_close(other), EPS_OK);
    return report("hostile");
}
