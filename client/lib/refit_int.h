/* client/lib/refit_int.h - what the parts of librefit share beyond the public API
 * (client/refit.h): the error recorder and the RegisterRegion calls. */
#ifndef REFIT_INT_H
#define REFIT_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "refit.h"
#include "rpc.pb-c.h"

/* Records the message of a failed call (on c, and on the thread when c is NULL) and returns
 * code. */
int refit__fail(refit_client *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Sends RegisterRegion (kind: refit.rpc.MemKind) with passfd as SCM_RIGHTS when >= 0 and
 * handle as ipc_handle; *region gets the new id. vmm_base: for cuda_vmm_fd, where this
 * process maps the allocation (its regions then share the daemon's one mapping), else 0. */
int refit__register_region(refit_client *c, const char *device, int kind, const void *handle,
                           size_t handle_len, uint64_t offset, uint64_t size, int passfd,
                           uint64_t vmm_base, uint32_t *region);
/* RegisterRegion of kind cuda_vmm_fd made of n allocations mapped back to back from vmm_base
 * in this process, fds[i] sent for chunk_sizes[i], in order. */
int refit__register_vmm_chunks(refit_client *c, const char *device, uint64_t offset,
                               uint64_t size, const uint64_t *chunk_sizes, const int *fds,
                               size_t n, uint64_t vmm_base, uint32_t *region);

/* refit_connect without the check of kind (the installer's own connection). */
int refit__connect(const char *socket_path, const char *name, int rank, int kind,
                   refit_client **out);
/* Sends req and waits for its answer (*out, may be NULL: freed then). */
int refit__call(refit_client *c, Refit__Rpc__Request *req, int timeout_ms,
                Refit__Rpc__Response **out);
/* The same with fd passed as SCM_RIGHTS on the request (a back channel). */
int refit__call_fd(refit_client *c, Refit__Rpc__Request *req, int fd, int timeout_ms,
                   Refit__Rpc__Response **out);
/* The next pushed Install (the response holding it, caller frees), waiting up to timeout_ms
 * (< 0: for ever; 0: only what has arrived); -ETIMEDOUT, or the connection's error. */
int refit__next_install(refit_client *c, int timeout_ms, Refit__Rpc__Response **out);
int refit__fd(const refit_client *c);
int refit__kind(const refit_client *c);
/* Records how region is written: why NULL for the daemon, else in-process at ptr (gpu: GPU
 * memory) for that reason. */
int refit__region_mode_set(refit_client *c, uint32_t region, void *ptr, bool gpu,
                           const char *why);
/* RegisterRegion of kind in-process (device: "host" or a GPU UUID) at ptr, with why. */
int refit__register_inproc(refit_client *c, const char *device, void *ptr, uint64_t size,
                           const char *why, uint32_t *region);

/* The installer (refit_install.c): a thread of its own with a second connection that
 * attaches with token and installs into ptrs[region] (nptrs, NULL for regions the daemon
 * writes) what the receiverd hands it. Stop joins it; NULL is fine. */
typedef struct refit_installer refit_installer;
int refit__installer_start(refit_client *engine, const char *path, const char *name, int rank,
                           const uint8_t *token, size_t token_len, void *const *ptrs,
                           size_t nptrs, bool gpu, refit_installer **out);
void refit__installer_stop(refit_installer *in);

#endif
