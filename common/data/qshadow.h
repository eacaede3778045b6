/* common/data/qshadow.h - the memory of a receiver's FP8 shadows (issue 15; control/slice.h
 * keeps them): bytes of a tensor's dtype, dense over an FP8 piece's box, where transfers that
 * trainers' shard boundaries cut off the piece's grid land, quantized into the piece once every
 * transfer landed. A shadow lives where its piece does: in host memory, or on the GPU that
 * holds the piece, where the transports write it as they write the piece and the GPU
 * quantizes it (quant_cuda.h). */
#ifndef RF_QSHADOW_H
#define RF_QSHADOW_H

#include <stdint.h>

#include "err.h"
#include "xfer.h"

typedef struct rf_qshadow {
    uint8_t *buf;
    int dev;       /* the GPU ordinal of buf, or -1: host memory */
} rf_qshadow;

/* bytes (> 0) for the shadow of a piece whose memory includes `near`: on the GPU that holds
 * near, else in host memory. 0, or -ENOMEM (err names the size and where). */
int rf_qshadow_alloc(rf_qshadow *sh, const void *near, uint64_t bytes, rf_err *err);
void rf_qshadow_free(rf_qshadow *sh);
/* Quantizes the box of src (in the shadow: the tensor's dtype, its box on dst's grid) into
 * FP8 item dst (its piece and scales, the same box), in the shadow's memory; done when this
 * returns. Host shadows go through *tmp (grown as needed, *cap bytes; the caller frees it).
 * 0, -ENOMEM, or the GPU's failure. */
int rf_qshadow_quantize(const rf_qshadow *sh, const rf_xfer_item *src, const rf_xfer_item *dst,
                        uint8_t **tmp, uint64_t *cap, rf_err *err);

/* The GPU parts (qshadow_cuda.c; not in a build without CUDA). */
int rf_qshadow__cuda_dev(const void *p);
int rf_qshadow__cuda_alloc(rf_qshadow *sh, uint64_t bytes, rf_err *err);
void rf_qshadow__cuda_free(rf_qshadow *sh);
int rf_qshadow__cuda_quantize(const rf_qshadow *sh, const rf_xfer_item *src,
                              const rf_xfer_item *dst, rf_err *err);

#endif
