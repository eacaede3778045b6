/* common/err.h - an error code plus a sentence for a person, filled where the error is found. */
#ifndef RF_ERR_H
#define RF_ERR_H

#include <errno.h>
#include <stddef.h>

typedef struct rf_err {
    int code;        /* negative errno, 0 when no error */
    char msg[512];   /* what failed, on what, and what to do */
} rf_err;

/* Records code and a formatted message in err (which may be NULL) and returns code, so that
 * callers can write `return rf_err_set(err, -EINVAL, "...", ...);`. */
int rf_err_set(rf_err *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Prefixes err->msg with context ("inventory of node 3: ") and returns err->code. */
int rf_err_wrap(rf_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static inline void rf_err_clear(rf_err *err)
{
    if (err) {
        err->code = 0;
        err->msg[0] = '\0';
    }
}

#endif
