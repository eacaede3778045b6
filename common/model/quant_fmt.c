/* common/model/quant_fmt.c - FP8 formats: names, block grids, scale shapes and the shard-box
 * rule (the arithmetic is common/data/quant.c). */
#include "quant_fmt.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#define BLOCK_MAX (UINT32_C(1) << 31)

int rf_quant_fmt_check(const rf_quant_fmt *f, rf_err *err)
{
    if (f == NULL)
        return rf_err_set(err, -EINVAL, "quantization format is missing (NULL)");
    if (f->kind < RF_QUANT_BLOCK || f->kind > RF_QUANT_MXFP8 ||
        (f->kind == RF_QUANT_BLOCK && (f->br == 0 || f->bc == 0 || f->br > BLOCK_MAX ||
                                       f->bc > BLOCK_MAX)))
        return rf_err_set(err, -EINVAL, "malformed quantization format (kind %d, block %" PRIu32
                          "x%" PRIu32 "): build it with rf_quant_fmt_parse", f->kind, f->br, f->bc);
    return 0;
}

void rf_quant_fmt_block(const rf_quant_fmt *f, uint64_t rows, uint64_t cols, uint64_t *br,
                        uint64_t *bc)
{
    switch (f->kind) {
    case RF_QUANT_BLOCK:
        *br = f->br;
        *bc = f->bc;
        break;
    case RF_QUANT_CHANNEL:
        *br = 1;
        *bc = cols;
        break;
    case RF_QUANT_TENSOR:
        *br = rows;
        *bc = cols;
        break;
    default:
        *br = 1;
        *bc = RF_QUANT_MX_BLOCK;
        break;
    }
}

static uint64_t ceil_div(uint64_t a, uint64_t b)
{
    return b == 0 ? 0 : a / b + (a % b != 0);
}

int rf_quant_fmt_parse(const char *s, rf_quant_fmt *out, rf_err *err)
{
    uint64_t dim[2] = {0, 0};
    const char *p;

    if (s == NULL)
        s = "";
    memset(out, 0, sizeof(*out));
    if (strcmp(s, "block") == 0) {
        *out = (rf_quant_fmt){RF_QUANT_BLOCK, 128, 128};
        return 0;
    }
    if (strcmp(s, "channel") == 0) {
        out->kind = RF_QUANT_CHANNEL;
        return 0;
    }
    if (strcmp(s, "tensor") == 0) {
        out->kind = RF_QUANT_TENSOR;
        return 0;
    }
    if (strcmp(s, "mxfp8") == 0) {
        *out = (rf_quant_fmt){RF_QUANT_MXFP8, 1, RF_QUANT_MX_BLOCK};
        return 0;
    }
    if (strncmp(s, "block:", 6) != 0)
        return rf_err_set(err, -EINVAL, "unknown quantization format \"%s\": expected block, "
                          "block:<rows>x<cols>, channel, tensor or mxfp8", s);
    p = s + 6;
    for (int k = 0; k < 2; k++) {
        const char *d = p;

        while (*p >= '0' && *p <= '9' && dim[k] <= BLOCK_MAX)
            dim[k] = dim[k] * 10 + (uint64_t)(*p++ - '0');
        if (p == d || dim[k] == 0 || dim[k] > BLOCK_MAX || *p != (k == 0 ? 'x' : '\0'))
            return rf_err_set(err, -EINVAL, "quantization format \"%s\": the block must be "
                              "<rows>x<cols>, each a number 1..%" PRIu32 " (block:128x128)", s,
                              BLOCK_MAX);
        p++;
    }
    *out = (rf_quant_fmt){RF_QUANT_BLOCK, (uint32_t)dim[0], (uint32_t)dim[1]};
    return 0;
}

int rf_quant_fmt_format(const rf_quant_fmt *f, char *buf, size_t len)
{
    if (rf_quant_fmt_check(f, NULL) < 0)
        return snprintf(buf, len, "?");
    switch (f->kind) {
    case RF_QUANT_BLOCK:
        return snprintf(buf, len, "block:%" PRIu32 "x%" PRIu32, f->br, f->bc);
    case RF_QUANT_CHANNEL:
        return snprintf(buf, len, "channel");
    case RF_QUANT_TENSOR:
        return snprintf(buf, len, "tensor");
    default:
        return snprintf(buf, len, "mxfp8");
    }
}

int rf_quant_scale_shape(const rf_quant_fmt *f, uint64_t rows, uint64_t cols, uint64_t *srows,
                         uint64_t *scols, rf_err *err)
{
    uint64_t br, bc;
    int rc = rf_quant_fmt_check(f, err);

    if (rc < 0)
        return rc;
    if (f->kind == RF_QUANT_TENSOR) {
        *srows = *scols = 1;
        return 0;
    }
    if (f->kind == RF_QUANT_CHANNEL) {
        *srows = rows;
        *scols = 1;
        return 0;
    }
    rf_quant_fmt_block(f, rows, cols, &br, &bc);
    *srows = ceil_div(rows, br);
    *scols = ceil_div(cols, bc);
    return 0;
}

rf_dtype rf_quant_scale_dtype(const rf_quant_fmt *f)
{
    return f->kind == RF_QUANT_MXFP8 ? RF_DT_UINT8 : RF_DT_FP32;
}

int rf_quant_box_ok(const rf_quant_fmt *f, uint64_t grows, uint64_t gcols, uint64_t row0,
                    uint64_t col0, uint64_t rows, uint64_t cols, rf_err *err)
{
    char fs[64];
    uint64_t br, bc, r1 = row0 + rows, c1 = col0 + cols;
    int rc = rf_quant_fmt_check(f, err);

    if (rc < 0)
        return rc;
    rf_quant_fmt_format(f, fs, sizeof(fs));
    if (rows == 0 || cols == 0 || row0 > grows || rows > grows - row0 || col0 > gcols ||
        cols > gcols - col0)
        return rf_err_set(err, -EINVAL, "quantization box [%" PRIu64 ":%" PRIu64 ", %" PRIu64 ":%"
                          PRIu64 "] is empty or outside the %" PRIu64 "x%" PRIu64 " matrix",
                          row0, r1, col0, c1, grows, gcols);
    rf_quant_fmt_block(f, grows, gcols, &br, &bc);
    if (f->kind == RF_QUANT_TENSOR && (rows != grows || cols != gcols))
        return rf_err_set(err, -EINVAL, "quantization box [%" PRIu64 ":%" PRIu64 ", %" PRIu64 ":%"
                          PRIu64 "] is part of the %" PRIu64 "x%" PRIu64 " matrix, whose format "
                          "tensor has one scale for the whole matrix: only the whole matrix can be "
                          "quantized", row0, r1, col0, c1, grows, gcols);
    if (f->kind == RF_QUANT_CHANNEL && cols != gcols)
        return rf_err_set(err, -EINVAL, "quantization box [%" PRIu64 ":%" PRIu64 ", %" PRIu64 ":%"
                          PRIu64 "] of the %" PRIu64 "x%" PRIu64 " matrix splits its rows; format "
                          "channel has one scale per row: the box must span all %" PRIu64
                          " columns", row0, r1, col0, c1, grows, gcols, gcols);
    if (row0 % br != 0 || (r1 % br != 0 && r1 != grows))
        return rf_err_set(err, -EINVAL, "quantization box [%" PRIu64 ":%" PRIu64 ", %" PRIu64 ":%"
                          PRIu64 "] of the %" PRIu64 "x%" PRIu64 " matrix cuts the %" PRIu64 "x%"
                          PRIu64 " blocks of format %s: its row edges must fall on multiples of %"
                          PRIu64 " or on the matrix's end (%" PRIu64 ")", row0, r1, col0, c1,
                          grows, gcols, br, bc, fs, br, grows);
    if (col0 % bc != 0 || (c1 % bc != 0 && c1 != gcols))
        return rf_err_set(err, -EINVAL, "quantization box [%" PRIu64 ":%" PRIu64 ", %" PRIu64 ":%"
                          PRIu64 "] of the %" PRIu64 "x%" PRIu64 " matrix cuts the %" PRIu64 "x%"
                          PRIu64 " blocks of format %s: its column edges must fall on multiples "
                          "of %" PRIu64 " or on the matrix's end (%" PRIu64 ")", row0, r1, col0,
                          c1, grows, gcols, br, bc, fs, bc, gcols);
    return 0;
}

int rf_quant_inv_fp8(const rf_inv *in, const rf_quant_fmt *f, rf_inv **out, uint32_t *nfp8,
                     rf_err *err)
{
    rf_inv *o = rf_inv_new();
    uint32_t id, n = 0;
    int rc = rf_quant_fmt_check(f, err);

    *out = NULL;
    if (rc == 0 && o == NULL)
        rc = rf_err_set(err, -ENOMEM, "out of memory copying an inventory");
    for (uint32_t i = 0; rc == 0 && i < rf_inv_ntensors(in); i++) {
        const rf_tensor *t = rf_inv_tensor(in, i);

        rc = rf_inv_add_tensor(o, t->name, t->dtype, t->ndim, t->shape, &id, err);
    }
    for (uint32_t e = 0; rc == 0 && e < rf_inv_nendpoints(in); e++) {
        const rf_endpoint *ep = rf_inv_endpoint(in, e);

        rc = rf_inv_add_endpoint(o, ep->side, ep->node, &id, err);
        if (rc == 0)
            rc = rf_inv_set_endpoint_host(o, id, ep->host, err);
    }
    for (uint32_t r = 0; rc == 0 && r < rf_inv_nregions(in); r++)
        rc = rf_inv_add_region(o, rf_inv_region(in, r)->endpoint, rf_inv_region(in, r)->size,
                               &id, err);
    for (int side = 0; rc == 0 && side < 2; side++) {
        for (uint32_t i = 0; rc == 0 && i < rf_inv_npieces(in, (rf_side)side); i++) {
            rf_piece p, sp;
            const rf_tensor *t;
            rf_quant_decl q = {.kind = f->kind, .br = f->br, .bc = f->bc};
            uint32_t ep;
            int nd;
            int64_t s = 1;

            rf_inv_piece(in, (rf_side)side, i, &p);
            t = rf_inv_tensor(in, p.tensor);
            nd = t->ndim;
            if (side == RF_SRC || nd < 2 ||
                (t->dtype != RF_DT_BF16 && t->dtype != RF_DT_FP16 && t->dtype != RF_DT_FP32) ||
                rf_quant_box_ok(f, (uint64_t)t->shape[nd - 2], (uint64_t)t->shape[nd - 1],
                                (uint64_t)p.box.start[nd - 2], (uint64_t)p.box.start[nd - 1],
                                (uint64_t)p.box.extent[nd - 2], (uint64_t)p.box.extent[nd - 1],
                                NULL) < 0) {
                rc = rf_inv_add_piece(o, &p, &id, err);
                continue;
            }
            /* FP8: the elements dense in a region of their own, the scales in another. */
            ep = rf_inv_region(in, p.region)->endpoint;
            for (int d = nd - 1; d >= 0; d--) {
                p.strides[d] = s;
                s *= p.box.extent[d];
            }
            p.offset = 0;
            if ((rc = rf_inv_add_region(o, ep, (uint64_t)s, &p.region, err)) < 0)
                break;
            rf_inv_scale_box(&q, nd, t->shape, &p.box, &sp.box);
            s = 1;
            for (int d = nd - 1; d >= 0; d--) {
                q.scale_strides[d] = s;
                s *= sp.box.extent[d];
            }
            if ((rc = rf_inv_add_region(o, ep, (uint64_t)s * rf_dtype_size(
                                            rf_quant_scale_dtype(f)), &q.scale_region, err)) < 0 ||
                (rc = rf_inv_add_quant(o, &q, &p.quant, err)) < 0)
                break;
            rc = rf_inv_add_piece(o, &p, &id, err);
            n++;
        }
    }
    if (rc < 0) {
        rf_inv_free(o);
        return rc;
    }
    *out = o;
    if (nfp8)
        *nfp8 = n;
    return 0;
}
