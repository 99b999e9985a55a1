/* The checks of the C tests: EXPECT a call's status (a failure must come with
 * a message), CHECK a condition; each failure is printed and counted. */
#ifndef EPS_TEST_CHECK_H
#define EPS_TEST_CHECK_H

#include <stdio.h>

#include "eps.h"

static int failures = 0;

#define EXPECT(call, want)                                                                               \
    do {                                                                                                 \
        eps_status got_ = (call);                                                                        \
        if (got_ != (want)) {                                                                            \
            fprintf(stderr, "FAIL line %d: %s\n  returned %d (%s), expected %d (%s)\n  last error: %s\n", \
                    __LINE__, #call, (int)got_, eps_status_string(got_), (int)(want),                     \
                    eps_status_string(want), eps_last_error());                                          \
            failures++;                                                                                  \
        } else if (got_ != EPS_OK && eps_last_error()[0] == '\0') {                                       \
            fprintf(stderr, "FAIL line %d: %s failed without a message\n", __LINE__, #call);              \
            failures++;                                                                                  \
        }                                                                                                \
    } while (0)

#define CHECK(cond)                                                   \
    do {                                                              \
        if (!(cond)) {                                                \
            fprintf(stderr, "FAIL line %d: %s\n", __LINE__, #cond); \
            failures++;                                               \
        }                                                             \
    } while (0)

/* The exit status: 0 when every check passed. */
static int report(const char *name) {
    if (failures) {
        fprintf(stderr, "%s: %d checks failed\n", name, failures);
        return 1;
    }
    printf("%s: every check passed\n", name);
    return 0;
}

#endif
