/* common/data/qcopy.h - FP8 transfers on the host (issue 15): the sending side quantizes a
 * box of a bf16/fp16/fp32 piece into a transfer's payload (FP8 elements, then scales), the
 * receiving side installs that payload into an FP8 piece and its scales. The tcp transport
 * packs and unpacks through staging; the local transport packs into a buffer and unpacks at
 * once. The arithmetic is rf_quant_host's (quant.h). */
#ifndef RF_QCOPY_H
#define RF_QCOPY_H

#include <stdbool.h>
#include <stdint.h>

#include "copy.h"
#include "err.h"
#include "xfer.h"

/* Payload bytes of a transfer of box (ndim >= 2) into a piece with quantization q of a tensor
 * whose last two dims are rows x cols; *fp8 (may be NULL) gets the FP8 part's, numel. */
uint64_t rf_qcopy_bytes(const rf_quant_decl *q, int ndim, int64_t rows, int64_t cols,
                        const rf_box *box, uint64_t *fp8);
/* The matrices of box b (ndim >= 2): the product of its leading dims' extents; matrix l (its
 * leading dims row-major) starts at global index idx (its last two dims the box's start). */
uint64_t rf_qcopy_nmatrices(const rf_box *b, int ndim);
void rf_qcopy_matrix_start(const rf_box *b, int ndim, uint64_t l, int64_t *idx);
/* Matrix l of a transfer from checked source item s (rows of the tensor's dtype, not FP8)
 * into checked FP8 item d, as a quantizer takes it: where its rows start on both sides and
 * its scales, strides in elements (the source's), bytes (FP8) and scales. */
typedef struct rf_qcopy_matrix {
    const uint8_t *src;
    int64_t src_row_stride;
    uint8_t *q;
    int64_t q_row_stride;
    uint8_t *scales;
    int64_t scale_row_stride;
} rf_qcopy_matrix;
void rf_qcopy_matrix_at(const rf_xfer_item *s, const rf_xfer_item *d, uint64_t l,
                        rf_qcopy_matrix *m);
/* Matrix l of checked source item it (not an FP8 piece) packed into payload out, as
 * rf_qcopy_pack lays it out (the FP8 elements of each matrix row-major, then each matrix's
 * scales row-major): where a quantizer reads it and writes it (the GPU sender's kernel). */
void rf_qcopy_pack_matrix(const rf_xfer_item *it, uint64_t l, uint8_t *out, rf_qcopy_matrix *m);
/* The checks of a quantized item: its format, dtype, bytes; dst, or a source that is itself an
 * FP8 piece (piece.quant: a trainer holding the weight in FP8, a replica that relays): the FP8
 * piece (esize 1) and its scales' memory, else the source piece (its dtype's esize, rows
 * contiguous). 0, or -EINVAL with err saying what is wrong (the caller names the message and
 * item). */
int rf_qcopy_check(const rf_xfer_item *it, bool dst, rf_err *err);
/* Quantizes the box of checked source item it into out (it->bytes of them); a source that is an
 * FP8 piece gives its elements and scales as they are (rf_qcopy_read). */
void rf_qcopy_pack(const rf_xfer_item *it, uint8_t *out);
/* Writes payload in (it->bytes) into checked destination item it's FP8 piece and scales. */
void rf_qcopy_unpack(const rf_xfer_item *it, const uint8_t *in);
/* The copy descriptors of checked FP8 item it (an FP8 piece, either side): its elements (one
 * byte each, its box) and its scales (the box's blocks), offsets 0. */
void rf_qcopy_descs(const rf_xfer_item *it, rf_copy_desc *elems, rf_copy_desc *scales);
/* Reads back what rf_qcopy_unpack wrote, in payload order (for the digest of what was
 * installed). */
void rf_qcopy_read(const rf_xfer_item *it, uint8_t *out);

#endif
