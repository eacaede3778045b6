/* common/err.c - formatting of rf_err. */
#include "err.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int rf_err_set(rf_err *err, int code, const char *fmt, ...)
{
    va_list ap;

    if (err == NULL)
        return code;
    err->code = code;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
    va_end(ap);
    return code;
}

int rf_err_wrap(rf_err *err, const char *fmt, ...)
{
    char prefix[256];
    char old[sizeof(err->msg)];
    va_list ap;

    if (err == NULL)
        return -EINVAL;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof(prefix), fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof(old));
    /* Truncation of an over-long message is acceptable: it stays a message. */
    size_t n = strlen(prefix);
    if (n >= sizeof(err->msg))
        n = sizeof(err->msg) - 1;
    memcpy(err->msg, prefix, n);
    snprintf(err->msg + n, sizeof(err->msg) - n, "%.*s", (int)(sizeof(err->msg) - n - 1), old);
    return err->code;
}
