/* tests/unit/copy_ref.h - the in-process plan executor the tests use as their reference
 * (tests/unit/copy_ref.c; linked into the unit tests only). */
#ifndef RF_COPY_REF_H
#define RF_COPY_REF_H

#include "copy.h"
#include "err.h"
#include "plan.h"

/* Executes a whole plan in this process: src_bases[r] / dst_bases[r] are the base pointers of
 * region r (global region ids; an entry of the other side may be NULL). Direct transfers are
 * copied straight, packed ones gathered into a staging buffer per message and scattered.
 * -EINVAL when a region a transfer needs has no base, -ENOMEM without staging memory. */
int rf_copy_exec_plan_host(const rf_plan *plan, void *const *src_bases, void *const *dst_bases,
                           rf_err *err);

#endif
