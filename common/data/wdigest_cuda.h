/* common/data/wdigest_cuda.h - the linear payload digest (wdigest.h) computed on the GPU: a plan of
 * segments (dense staging, or strided boxes walked as the copy kernels walk them) uploaded once,
 * then digested by ranges, each launch adding into per-message accumulators on the device that
 * one small copy brings to the host. The lanes equal rf_wdigest_add's on the same bytes. */
#ifndef RF_WDIGEST_CUDA_H
#define RF_WDIGEST_CUDA_H

#include <stddef.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "err.h"
#include "wdigest.h"

typedef struct rf_wdigest_cuda_plan rf_wdigest_cuda_plan;

/* Uploads key and segs[0..n) (device pointers as bases; seg.acc < nacc) to the current device,
 * synchronously, with nacc accumulators on the device and their pinned host mirror. A segment
 * of 0 bytes digests nothing. -EINVAL (err names the segment) for a segment whose acc is out of
 * range or whose walk is malformed (run 0, n outside 0..RF_MAX_DIMS, an extent below 1). */
int rf_wdigest_cuda_plan_new(const rf_wdigest_key *key, const rf_wdigest_seg *segs, size_t n,
                             uint32_t nacc, rf_wdigest_cuda_plan **out, rf_err *err);
/* Enqueued on stream s (of the plan's GPU): accumulators [first, first + count) set to zero;
 * segments [first, first + count) digested into their accumulators (one launch; any order of
 * their tiles, across any number of thread blocks); accumulators [first, first + count) copied
 * to the host mirror. A range of segments adds only into accumulators zeroed before it. */
int rf_wdigest_cuda_zero(rf_wdigest_cuda_plan *pl, uint32_t first, uint32_t count,
                         cudaStream_t s, rf_err *err);
int rf_wdigest_cuda_run(rf_wdigest_cuda_plan *pl, size_t first, size_t count, cudaStream_t s,
                        rf_err *err);
int rf_wdigest_cuda_fetch(rf_wdigest_cuda_plan *pl, uint32_t first, uint32_t count,
                          cudaStream_t s, rf_err *err);
/* Accumulator acc as the host mirror holds it (after the stream passed its fetch). */
void rf_wdigest_cuda_result(const rf_wdigest_cuda_plan *pl, uint32_t acc, rf_wdigest_acc *out);
/* Device memory the plan holds. */
uint64_t rf_wdigest_cuda_plan_bytes(const rf_wdigest_cuda_plan *pl);
/* Frees the plan; the caller waited for its launches. NULL is fine. */
void rf_wdigest_cuda_plan_free(rf_wdigest_cuda_plan *pl);

#ifdef __cplusplus
}
#endif

#endif
