/* common/data/copy_cuda.h - batched box gather (piece memory -> dense staging), scatter (staging
 * -> piece memory) and pair copies (piece memory -> piece memory) on the GPU, with exactly the
 * semantics of rf_copy_gather/rf_copy_scatter/rf_copy_pairs (common/data/copy.h): the same
 * descriptors, whose base pointers are device pointers here. One kernel launch per batch; the
 * descriptors travel in one array. */
#ifndef RF_COPY_CUDA_H
#define RF_COPY_CUDA_H

#include <stddef.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "copy.h"
#include "err.h"

/* Device and pinned host memory for the descriptors of one batch, on one GPU, reused from
 * round to round (it only grows). One user at a time. */
typedef struct rf_copy_cuda_buf rf_copy_cuda_buf;

/* A buffer for the current device. */
int rf_copy_cuda_buf_new(rf_copy_cuda_buf **out, rf_err *err);
/* Caps the blocks of this buffer's launches (0: the default, 16 per SM). Fewer blocks copy
 * more slowly but leave SMs and memory bandwidth to kernels running beside them (NCCL's). */
void rf_copy_cuda_buf_set_blocks(rf_copy_cuda_buf *b, unsigned max_blocks);
/* Waits for the buffer's last batch and frees it. */
void rf_copy_cuda_buf_free(rf_copy_cuda_buf *b);

/* Enqueues the copies of d[0..n) on stream s of the buffer's GPU and returns; staging_dev is
 * device memory of at least max(staging_off + bytes) bytes. Before the next batch of the same
 * buffer is written, the previous one's launch is waited for (not the caller's stream). The
 * same checks as the host copy: -EINVAL, nothing enqueued, err naming the descriptor. CUDA
 * failures come back as negative errnos with CUDA's message. */
int rf_copy_cuda_gather_buf(rf_copy_cuda_buf *b, const rf_copy_desc *d, size_t n,
                            void *staging_dev, cudaStream_t s, rf_err *err);
int rf_copy_cuda_scatter_buf(rf_copy_cuda_buf *b, const rf_copy_desc *d, size_t n,
                             const void *staging_dev, cudaStream_t s, rf_err *err);

/* The same with a buffer of the calling thread for its current device (a GPU worker thread
 * per device keeps one buffer per device). rf_copy_cuda_thread_release frees them. */
int rf_copy_cuda_gather(const rf_copy_desc *d, size_t n, void *staging_dev, cudaStream_t s,
                        rf_err *err);
int rf_copy_cuda_scatter(const rf_copy_desc *d, size_t n, const void *staging_dev,
                         cudaStream_t s, rf_err *err);
void rf_copy_cuda_thread_release(void);

/* Pair copies (rf_copy_pairs) enqueued on stream s of the buffer's GPU, one launch: the same
 * checks (-EINVAL, nothing enqueued), the same waiting for the buffer's previous batch. Both
 * memories must be readable/writable from that GPU (its own, or a peer's with access on). */
int rf_copy_cuda_pairs_buf(rf_copy_cuda_buf *b, const rf_copy_pair *p, size_t n,
                           cudaStream_t s, rf_err *err);
int rf_copy_cuda_pairs(const rf_copy_pair *p, size_t n, cudaStream_t s, rf_err *err);

/* Pair copies whose descriptors stay on the GPU (a transport's kept plan): checked, reduced and
 * uploaded once to the current device (synchronously), then launched any number of times, any
 * run of them per launch, with no host work beyond the launch. */
typedef struct rf_copy_cuda_plan rf_copy_cuda_plan;

int rf_copy_cuda_plan_new(const rf_copy_pair *p, size_t n, rf_copy_cuda_plan **out,
                          rf_err *err);
/* Enqueues pairs [first, first + count) on s (a stream of the plan's GPU); max_blocks as for
 * rf_copy_cuda_buf_set_blocks. */
int rf_copy_cuda_plan_launch(const rf_copy_cuda_plan *pl, size_t first, size_t count,
                             cudaStream_t s, unsigned max_blocks, rf_err *err);
/* Device memory the plan holds. */
uint64_t rf_copy_cuda_plan_bytes(const rf_copy_cuda_plan *pl);
/* Frees the plan; the caller waited for its launches. */
void rf_copy_cuda_plan_free(rf_copy_cuda_plan *pl);

#ifdef __cplusplus
}
#endif

#endif
