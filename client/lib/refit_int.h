/* client/lib/refit_int.h - what the parts of librefit share beyond the public API
 * (client/refit.h): the error recorder and the RegisterRegion calls. */
#ifndef REFIT_INT_H
#define REFIT_INT_H

#include <stddef.h>
#include <stdint.h>

#include "refit.h"

/* Records the message of a failed call (on c, and on the thread when c is NULL) and returns
 * code. */
int refit__fail(refit_client *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Sends RegisterRegion (kind: refit.rpc.MemKind) with passfd as SCM_RIGHTS when >= 0 and
 * handle as ipc_handle; *region gets the new id. */
int refit__register_region(refit_client *c, const char *device, int kind, const void *handle,
                           size_t handle_len, uint64_t offset, uint64_t size, int passfd,
                           uint32_t *region);
/* RegisterRegion of kind cuda_vmm_fd made of n allocations mapped back to back, fds[i] sent for
 * chunk_sizes[i], in order. */
int refit__register_vmm_chunks(refit_client *c, const char *device, uint64_t offset,
                               uint64_t size, const uint64_t *chunk_sizes, const int *fds,
                               size_t n, uint32_t *region);

#endif
