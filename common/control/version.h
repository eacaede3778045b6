/* common/control/version.h - the rule every version entering the cluster obeys (a trainer's Publish, an
 * operator's trigger, a member's Ready): strictly ahead of what was committed, and by a bounded
 * step, so no value near the top of the version space can be reached and none is a sentinel. */
#ifndef RF_VERSION_H
#define RF_VERSION_H

#include <inttypes.h>
#include <stdint.h>

#include "err.h"

/* How far ahead of the committed version a new one may be: far beyond any real training run's
 * step count, and small enough that committed + step never nears UINT64_MAX. */
#define RF_VERSION_MAX_STEP (UINT64_C(1) << 32)

/* 0 when version may follow base (the committed or released version), else -ERANGE with a
 * sentence naming what (e.g. "Publish") and the allowed range. */
static inline int rf_version_check(uint64_t version, uint64_t base, const char *what,
                                   rf_err *err)
{
    if (version > base && version - base <= RF_VERSION_MAX_STEP)
        return 0;
    return rf_err_set(err, -ERANGE, "%s of version %" PRIu64 " refused: a version must be "
                      "newer than the committed version %" PRIu64 " and at most %" PRIu64
                      " ahead of it", what, version, base, RF_VERSION_MAX_STEP);
}

#endif
