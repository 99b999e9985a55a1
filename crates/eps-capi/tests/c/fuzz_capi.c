/* libFuzzer target over the C ABI: each input is a sequence of calls that
 * hostile.h's driver makes against a job hosted in this process (started
 * once; the driver starts it again when a call ends it). A failed check
 * aborts, which libFuzzer reports with the input that caused it.
 * Built with clang -fsanitize=fuzzer,address,undefined against libeps.so
 * and run for a bounded time by ci/fuzz-capi.sh. */

#include "hostile.h"

static const char *SECRET = "fuzz-capi-secret";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static struct hostile h;
    static int ready = 0;
    if (!ready) {
        h_init(&h, SECRET, NULL, NULL);
        ready = 1;
    }
    h_drive(&h, data, size);
    if (h.failures) {
        fprintf(stderr, "fuzz_capi: %d failed checks (see above)\n", h.failures);
        abort();
    }
    return 0;
}
