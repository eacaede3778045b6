/* common/data/quant_cuda.h - FP8 (float8_e4m3fn) quantization on the GPU: the arithmetic of
 * common/data/quant.h (its contract), giving byte for byte what rf_quant_host gives, read from
 * and written to GPU memory. */
#ifndef RF_QUANT_CUDA_H
#define RF_QUANT_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "err.h"
#include "quant.h"

/* rf_quant_host on the GPU: the same arguments with the same meaning (src_row_stride in source
 * elements, q_row_stride in bytes, scale_row_stride in scale elements), except that src, q and
 * scales are memory of the current device (or memory it can access), and the work is enqueued
 * on stream s of the current device and this returns before it is done. The same checks and
 * errors as rf_quant_host (-EINVAL, nothing enqueued, err says which), plus -EINVAL for a src
 * or scales pointer not aligned to its element size (a GPU faults on a misaligned access).
 * CUDA failures come back as negative errnos with CUDA's message. An empty matrix enqueues
 * nothing. TENSOR accumulates its amax in the one scale itself before it turns it into the
 * scale: until the stream has passed this work, that scale holds neither. */
int rf_quant_cuda_quantize(const rf_quant_fmt *f, rf_dtype src_dt, const void *src,
                           int64_t src_row_stride, uint64_t rows, uint64_t cols, uint8_t *q,
                           int64_t q_row_stride, void *scales, int64_t scale_row_stride,
                           cudaStream_t s, rf_err *err);

/* Many matrices at once (a transport's kept plan, as rf_copy_cuda_plan): checked, their
 * descriptors uploaded once to the current device (synchronously), then quantized any number
 * of times, any run of them per launch: one kernel launch for every BLOCK, CHANNEL and MXFP8
 * matrix of the run, TENSOR matrices one by one (three launches each). The bytes are those of
 * rf_quant_cuda_quantize on each matrix. The matrices' outputs must not overlap. */
typedef struct rf_quant_cuda_op {
    rf_quant_fmt fmt;
    rf_dtype dt;
    const void *src;
    int64_t src_row_stride; /* source elements */
    uint64_t rows, cols;
    uint8_t *q;
    int64_t q_row_stride;   /* bytes */
    void *scales;
    int64_t scale_row_stride; /* scale elements */
} rf_quant_cuda_op;

typedef struct rf_quant_cuda_plan rf_quant_cuda_plan;

/* rf_quant_cuda_quantize's checks on every op (-EINVAL naming the op, nothing kept), -ENOMEM,
 * or CUDA's failures. */
int rf_quant_cuda_plan_new(const rf_quant_cuda_op *ops, size_t n, rf_quant_cuda_plan **out,
                           rf_err *err);
/* Enqueues ops [first, first + count) on s (a stream of the plan's GPU). */
int rf_quant_cuda_plan_launch(const rf_quant_cuda_plan *pl, size_t first, size_t count,
                              cudaStream_t s, rf_err *err);
/* Device memory the plan holds. */
uint64_t rf_quant_cuda_plan_bytes(const rf_quant_cuda_plan *pl);
/* Tiles of the plan's batch kernel (blocks of BLOCK, rows of CHANNEL, 32 blocks of MXFP8);
 * *scalar gets those of matrices read element by element (a base, stride or width that 16-byte
 * loads cannot take), the slow path. */
uint64_t rf_quant_cuda_plan_tiles(const rf_quant_cuda_plan *pl, uint64_t *scalar);
/* Frees the plan; the caller waited for its launches. */
void rf_quant_cuda_plan_free(rf_quant_cuda_plan *pl);

#ifdef __cplusplus
}
#endif

#endif
