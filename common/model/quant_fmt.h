/* common/model/quant_fmt.h - FP8 formats (issue 15): what a format is, its block grid and scale
 * shape, and which boxes of a matrix can be quantized by themselves (the rule the planner and the
 * registry check shard boxes with). The arithmetic and its contract are common/data/quant.h. */
#ifndef RF_QUANT_FMT_H
#define RF_QUANT_FMT_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"
#include "layout.h"

typedef enum rf_quant_kind {
    RF_QUANT_BLOCK = 1,
    RF_QUANT_CHANNEL,
    RF_QUANT_TENSOR,
    RF_QUANT_MXFP8,
} rf_quant_kind;

/* A format. br x bc is BLOCK's block (1..2^31 each); the other kinds ignore them
 * (rf_quant_fmt_parse sets MXFP8's to 1 x 32, CHANNEL's and TENSOR's to 0 x 0). */
typedef struct rf_quant_fmt {
    int kind; /* rf_quant_kind */
    uint32_t br, bc;
} rf_quant_fmt;

#define RF_QUANT_E4M3_MAX 448.0f
#define RF_QUANT_MX_BLOCK 32u

/* "block" (128x128), "block:<br>x<bc>" (decimal, 1..2^31 each), "channel", "tensor",
 * "mxfp8". 0, or -EINVAL with err naming the text. */
int rf_quant_fmt_parse(const char *s, rf_quant_fmt *out, rf_err *err);
/* The name rf_quant_fmt_parse reads back ("block:128x128", "mxfp8"); what snprintf returns. */
int rf_quant_fmt_format(const rf_quant_fmt *f, char *buf, size_t len);
/* The scales' shape for a rows x cols matrix; 0, or -EINVAL for a malformed format. */
int rf_quant_scale_shape(const rf_quant_fmt *f, uint64_t rows, uint64_t cols, uint64_t *srows,
                         uint64_t *scols, rf_err *err);
/* The scales' dtype: RF_DT_FP32, or RF_DT_UINT8 (E8M0) for MXFP8. */
rf_dtype rf_quant_scale_dtype(const rf_quant_fmt *f);

/* 0, or -EINVAL (err says why) for a format rf_quant_fmt_parse would not make. */
int rf_quant_fmt_check(const rf_quant_fmt *f, rf_err *err);
/* The block of a checked format on a rows x cols matrix: br x bc (channel: one row of cols;
 * tensor: the matrix; mxfp8: 1 x 32). */
void rf_quant_fmt_block(const rf_quant_fmt *f, uint64_t rows, uint64_t cols, uint64_t *br,
                        uint64_t *bc);

/* Whether the box [row0, row0 + rows) x [col0, col0 + cols) of a grows x gcols matrix can be
 * quantized by itself (rf_quant_host on the box alone gives the global result): every edge
 * falls on a block boundary of the global grid or on the matrix's end. BLOCK: row edges on
 * multiples of br, column edges on multiples of bc; CHANNEL: any rows, all columns; TENSOR:
 * the whole matrix; MXFP8: any rows, column edges on multiples of 32. Its scales are then the
 * box [row0 / br, ceil((row0 + rows) / br)) x [col0 / bc, ceil((col0 + cols) / bc)) of the
 * global scales (CHANNEL: rows [row0, row0 + rows); TENSOR: the one scale). 0, or -EINVAL
 * with err naming the box, the matrix and the grid (an empty box, or one outside the matrix,
 * is refused too). */
int rf_quant_box_ok(const rf_quant_fmt *f, uint64_t grows, uint64_t gcols, uint64_t row0,
                    uint64_t col0, uint64_t rows, uint64_t cols, rf_err *err);

/* A copy of inventory in whose destination pieces of bf16/fp16/fp32 tensors of 2 dims or more
 * with a box on f's grid are FP8 in format f, as an FP8-serving engine registers them (their
 * elements dense in a new region, their scales row-major in another, on the piece's
 * endpoint); the other pieces as they were. *nfp8 (may be NULL) gets how many became FP8. For
 * planning offline (refitctl plan --fp8). 0, or the error of a piece that does not validate. */
int rf_quant_inv_fp8(const rf_inv *in, const rf_quant_fmt *f, rf_inv **out, uint32_t *nfp8,
                     rf_err *err);

#endif
