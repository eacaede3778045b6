/* common/data/xfer_local_int.h - the local transport's inside, shared by its host part
 * (xfer_local.c) and its GPU part (xfer_local_cuda.c, built with CUDA only), plus what the core,
 * tests and benchmarks ask of it beyond xfer.h. */
#ifndef RF_XFER_LOCAL_INT_H
#define RF_XFER_LOCAL_INT_H

#include "xfer_core.h"

/* The local backend's table (the tuning functions recognise their transport by it). */
extern const rf_xfer_backend rf_xfer__local_backend;

/* The GPU part's state, opaque to the host part. */
typedef struct rf_xfer_lgpu rf_xfer_lgpu;

/* What both parts share; the core first (xfer_core.h). */
typedef struct rf_xfer_local {
    rf_xfer_core base;
    bool gpu;
    unsigned threads;            /* host copies: threads per job, the worker included (0: auto) */
    uint64_t gpu_batch;          /* GPU: bytes per batch (0: the default) */
    uint64_t gpu_memcpy_min;     /* GPU: smallest box for the copy engines (0: the default) */
    _Atomic uint64_t allocs;     /* allocations the transport made, host and device, ever */
    _Atomic uint64_t mem_now, mem_peak; /* device memory it holds (gpu) */
    struct rf_xfer_lhost *host;  /* host part's kept state */
    rf_xfer_lgpu *g;             /* GPU part's kept state */
} rf_xfer_local;

/* One allocation counted, with dev_bytes of device memory; a negative dev_bytes is a release
 * of that much (xfer_local.c). */
void rf_xfer__local_alloc(rf_xfer_local *t, int64_t dev_bytes);

#ifdef RF_HAVE_CUDA
/* The GPU part's hooks (xfer_local_cuda.c), called by the local backend when gpu is set. */
int rf_xfer__lgpu_start(rf_xfer_local *t);
int rf_xfer__lgpu_progress(rf_xfer_local *t, double wait_s);
void rf_xfer__lgpu_describe(rf_xfer_local *t, char *buf, size_t len);
void rf_xfer__lgpu_finish(rf_xfer_local *t, int rc);
void rf_xfer__lgpu_teardown(rf_xfer_local *t);
void rf_xfer__lgpu_release(rf_xfer_local *t);
#endif

/* For benchmarks and tests, loop thread, no job running (-EBUSY otherwise): host copies with
 * this many threads, the worker included (0: as many as pay, at most RF_XFER_LOCAL_MAX_THREADS;
 * 1: the worker alone). */
#define RF_XFER_LOCAL_MAX_THREADS 16
int rf_xfer_local_set_threads(rf_xfer_transport *t, unsigned threads, rf_err *err);
/* GPU copies, for benchmarks: bytes per batch and the smallest box that goes to the copy
 * engines instead of the pair kernel (UINT64_MAX: none); 0 keeps each default. */
int rf_xfer_local_tune_gpu(rf_xfer_transport *t, uint64_t batch, uint64_t memcpy_min,
                           rf_err *err);
/* Allocations (host and device) the transport made since creation: a warm job with the same
 * plan_key makes none. Device memory held now and at most (gpu). Any thread. */
void rf_xfer_local_stats(const rf_xfer_transport *t, uint64_t *allocs, uint64_t *dev_now,
                         uint64_t *dev_peak);

#endif
