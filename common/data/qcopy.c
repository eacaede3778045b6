/* common/data/qcopy.c - FP8 transfers on the host: quantize a box into a payload, install a
 * payload into an FP8 piece and its scales. */
#include "qcopy.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "copy.h"
#include "quant.h"

static rf_quant_fmt fmt_of(const rf_quant_decl *q)
{
    return (rf_quant_fmt){q->kind, q->br, q->bc};
}

/* The scale box of box b of a tensor whose matrix is rows x cols. */
static void scale_box(const rf_quant_decl *q, int ndim, int64_t rows, int64_t cols,
                      const rf_box *b, rf_box *out)
{
    int64_t shape[RF_MAX_DIMS] = {0};

    shape[ndim - 2] = rows;
    shape[ndim - 1] = cols;
    rf_inv_scale_box(q, ndim, shape, b, out);
}

uint64_t rf_qcopy_bytes(const rf_quant_decl *q, int ndim, int64_t rows, int64_t cols,
                        const rf_box *box, uint64_t *fp8)
{
    rf_quant_fmt f = fmt_of(q);
    rf_box sb;
    uint64_t n = (uint64_t)rf_box_numel(box, ndim);

    if (fp8)
        *fp8 = n;
    scale_box(q, ndim, rows, cols, box, &sb);
    return n + (uint64_t)rf_box_numel(&sb, ndim) * rf_dtype_size(rf_quant_scale_dtype(&f));
}

/* The descriptor of the scales of it's box, at payload offset off. */
static void scale_desc(const rf_xfer_item *it, uint64_t off, rf_copy_desc *d)
{
    const rf_xfer_quant *x = &it->quant;
    rf_quant_fmt f = fmt_of(&x->q);
    rf_box sb;

    scale_box(&x->q, it->ndim, x->rows, x->cols, &it->box, &sb);
    rf_copy_desc_set(d, x->scale_base, &x->scale, it->ndim,
                     rf_dtype_size(rf_quant_scale_dtype(&f)), &sb, off);
}

int rf_qcopy_check(const rf_xfer_item *it, bool dst, rf_err *err)
{
    const rf_xfer_quant *x = &it->quant;
    rf_quant_fmt f = fmt_of(&x->q);
    rf_copy_desc d;
    int nd = it->ndim, rc;

    if ((rc = rf_quant_fmt_check(&f, err)) < 0)
        return rc;
    if (nd < 2 || (x->dt != RF_DT_BF16 && x->dt != RF_DT_FP16 && x->dt != RF_DT_FP32))
        return rf_err_set(err, -EINVAL, "quantizes a %d-dim %s box: FP8 needs 2 dims or more of "
                          "bf16, fp16 or fp32", nd, rf_dtype_name(x->dt));
    if (x->rows < it->box.start[nd - 2] + it->box.extent[nd - 2] ||
        x->cols < it->box.start[nd - 1] + it->box.extent[nd - 1])
        return rf_err_set(err, -EINVAL, "quantizes a box outside its %" PRId64 "x%" PRId64
                          " matrix", x->rows, x->cols);
    if ((rc = rf_quant_box_ok(&f, (uint64_t)x->rows, (uint64_t)x->cols,
                              (uint64_t)it->box.start[nd - 2], (uint64_t)it->box.start[nd - 1],
                              (uint64_t)it->box.extent[nd - 2], (uint64_t)it->box.extent[nd - 1],
                              err)) < 0)
        return rc;
    if (it->bytes != rf_qcopy_bytes(&x->q, nd, x->rows, x->cols, &it->box, NULL))
        return rf_err_set(err, -EINVAL, "holds %" PRIu64 " bytes, its FP8 elements and scales "
                          "%" PRIu64, it->bytes,
                          rf_qcopy_bytes(&x->q, nd, x->rows, x->cols, &it->box, NULL));
    if (!dst && it->piece.quant == 0) {
        if (it->esize != rf_dtype_size(x->dt) || it->piece.strides[nd - 1] != 1)
            return rf_err_set(err, -EINVAL, "quantizes from %zu-byte elements %" PRId64 " apart: "
                              "a source must hold its %s rows contiguously", it->esize,
                              it->piece.strides[nd - 1], rf_dtype_name(x->dt));
        return 0;
    }
    if (it->esize != 1 || it->piece.strides[nd - 1] != 1)
        return rf_err_set(err, -EINVAL, "%s FP8 %s %zu-byte elements %" PRId64 " apart: the "
                          "piece must be float8_e4m3fn with contiguous rows",
                          dst ? "installs" : "sends", dst ? "into" : "from", it->esize,
                          it->piece.strides[nd - 1]);
    if (x->scale_base == NULL)
        return rf_err_set(err, -EINVAL, "has no mapped memory for its scales");
    scale_desc(it, 0, &d);
    if ((rc = rf_copy_check(&d, 0, err)) < 0)
        return rc;
    return 0;
}

uint64_t rf_qcopy_nmatrices(const rf_box *b, int nd)
{
    uint64_t n = 1;

    for (int d = 0; d < nd - 2; d++)
        n *= (uint64_t)b->extent[d];
    return n;
}

void rf_qcopy_matrix_start(const rf_box *b, int nd, uint64_t l, int64_t *idx)
{
    for (int d = nd - 1; d >= 0; d--) {
        if (d >= nd - 2) {
            idx[d] = b->start[d];
            continue;
        }
        idx[d] = b->start[d] + (int64_t)(l % (uint64_t)b->extent[d]);
        l /= (uint64_t)b->extent[d];
    }
}

void rf_qcopy_matrix_at(const rf_xfer_item *s, const rf_xfer_item *d, uint64_t l,
                        rf_qcopy_matrix *m)
{
    const rf_xfer_quant *x = &d->quant;
    rf_quant_fmt f = fmt_of(&x->q);
    int nd = d->ndim, L = nd - 2;
    int64_t shape[RF_MAX_DIMS] = {0}, idx[RF_MAX_DIMS], sidx[RF_MAX_DIMS];
    rf_box sb;

    shape[L] = x->rows;
    shape[L + 1] = x->cols;
    rf_inv_scale_box(&x->q, nd, shape, &d->box, &sb);
    rf_qcopy_matrix_start(&d->box, nd, l, idx);
    memcpy(sidx, idx, sizeof(sidx));
    sidx[L] = sb.start[L];
    sidx[L + 1] = sb.start[L + 1];
    m->src = s->base + rf_piece_byte_offset(&s->piece, nd, s->esize, idx);
    m->src_row_stride = s->piece.strides[L];
    m->q = d->base + rf_piece_byte_offset(&d->piece, nd, 1, idx);
    m->q_row_stride = d->piece.strides[L];
    m->scales = x->scale_base + rf_piece_byte_offset(&x->scale, nd,
                                                     rf_dtype_size(rf_quant_scale_dtype(&f)),
                                                     sidx);
    m->scale_row_stride = x->scale.strides[L];
}

static void move(const rf_xfer_item *it, uint8_t *payload, bool to_payload);

void rf_qcopy_pack_matrix(const rf_xfer_item *it, uint64_t l, uint8_t *out, rf_qcopy_matrix *m)
{
    const rf_xfer_quant *x = &it->quant;
    rf_quant_fmt f = fmt_of(&x->q);
    int nd = it->ndim;
    uint64_t rows = (uint64_t)it->box.extent[nd - 2], cols = (uint64_t)it->box.extent[nd - 1];
    uint64_t fp8, srows, scols;
    int64_t idx[RF_MAX_DIMS];

    rf_qcopy_bytes(&x->q, nd, x->rows, x->cols, &it->box, &fp8);
    /* The box lies on the grid (checked): quantized alone it gives the global result. */
    rf_quant_scale_shape(&f, rows, cols, &srows, &scols, NULL);
    rf_qcopy_matrix_start(&it->box, nd, l, idx);
    m->src = it->base + rf_piece_byte_offset(&it->piece, nd, it->esize, idx);
    m->src_row_stride = it->piece.strides[nd - 2];
    m->q = out + l * rows * cols;
    m->q_row_stride = (int64_t)cols;
    m->scales = out + fp8 + l * srows * scols * rf_dtype_size(rf_quant_scale_dtype(&f));
    m->scale_row_stride = (int64_t)scols;
}

void rf_qcopy_pack(const rf_xfer_item *it, uint8_t *out)
{
    const rf_xfer_quant *x = &it->quant;
    rf_quant_fmt f = fmt_of(&x->q);
    int nd = it->ndim;
    uint64_t rows = (uint64_t)it->box.extent[nd - 2], cols = (uint64_t)it->box.extent[nd - 1];
    uint64_t nm = rf_qcopy_nmatrices(&it->box, nd);

    if (it->piece.quant != 0) {
        /* An FP8 piece (a trainer's, or a replica's that relays): its elements and its
         * blocks' scales, as they are. */
        move(it, out, true);
        return;
    }
    for (uint64_t l = 0; l < nm; l++) {
        rf_qcopy_matrix m;

        rf_qcopy_pack_matrix(it, l, out, &m);
        rf_quant_host(&f, x->dt, m.src, m.src_row_stride, rows, cols, m.q, m.q_row_stride,
                      m.scales, m.scale_row_stride, NULL);
    }
}

static void move(const rf_xfer_item *it, uint8_t *payload, bool to_payload)
{
    rf_copy_desc d;
    uint64_t fp8;

    rf_qcopy_bytes(&it->quant.q, it->ndim, it->quant.rows, it->quant.cols, &it->box, &fp8);
    rf_copy_desc_set(&d, it->base, &it->piece, it->ndim, 1, &it->box, 0);
    rf_copy_run(&d, payload, to_payload);
    scale_desc(it, fp8, &d);
    rf_copy_run(&d, payload, to_payload);
}

void rf_qcopy_descs(const rf_xfer_item *it, rf_copy_desc *elems, rf_copy_desc *scales)
{
    rf_copy_desc_set(elems, it->base, &it->piece, it->ndim, 1, &it->box, 0);
    scale_desc(it, 0, scales);
}

void rf_qcopy_unpack(const rf_xfer_item *it, const uint8_t *in)
{
    move(it, (uint8_t *)in, false);
}

void rf_qcopy_read(const rf_xfer_item *it, uint8_t *out)
{
    move(it, out, true);
}
