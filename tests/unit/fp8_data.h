/* tests/unit/fp8_data.h - the FP8 tests' inventory and checks, shared by test_qcopy (the host
 * path) and test_xfer_nccl_self (the nccl transport on one GPU): bf16 trainer shards (rows
 * split in two, experts split) planned into FP8 engine shards (rows in four, one expert each)
 * of a format, every installed FP8 byte and scale compared with the scalar reference
 * (rf_quant_ref) of the trainers' values (xd_fill's bytes: random, so NaN, Inf, subnormals and
 * values past 448 among them). Header-only, after xfer_data.h: each test program includes it
 * once. */
#ifndef RF_TEST_FP8_DATA_H
#define RF_TEST_FP8_DATA_H

#include "quant.h"
#include "quant_ref.h"
#include "xfer_data.h"

enum { W_ROWS = 256, W_COLS = 384, E_N = 4, E_ROWS = 128, E_COLS = 96 };

typedef struct fixture {
    rf_inv *inv;
    uint32_t w, e, n;              /* tensors: a weight, experts, a norm (never FP8) */
    uint32_t dst_w[4], dst_e[4];   /* destination piece ids */
    uint8_t **bases;
    size_t *lens;
    uint32_t nregions;
} fixture;

static uint32_t region(fixture *f, uint32_t ep, uint64_t size)
{
    rf_err err = {0};
    uint32_t id;

    cr_assert_eq(rf_inv_add_region(f->inv, ep, size, &id, &err), 0, "%s", err.msg);
    return id;
}

/* A dense piece of box (start, extent) in a region of its own. */
static int add(fixture *f, uint32_t ep, uint32_t tensor, int nd, const int64_t *start,
               const int64_t *extent, const rf_quant_fmt *q, uint32_t *id, rf_err *err)
{
    rf_piece p = {0};
    int64_t s = 1;
    uint64_t n = 1;

    for (int d = 0; d < nd; d++)
        n *= (uint64_t)extent[d];
    for (int d = RF_MAX_DIMS - 1; d >= 0; d--) {
        p.box.start[d] = d < nd ? start[d] : 0;
        p.box.extent[d] = d < nd ? extent[d] : 1;
        p.strides[d] = d < nd ? s : 0;
        s *= d < nd ? extent[d] : 1;
    }
    p.tensor = tensor;
    if (q == NULL) {
        p.region = region(f, ep, n * 2);
    } else {
        rf_quant_decl qd = {.kind = q->kind, .br = q->br, .bc = q->bc};
        rf_box sb;
        int64_t ss = 1;
        int64_t shape[RF_MAX_DIMS];
        const rf_tensor *t = rf_inv_tensor(f->inv, tensor);
        int rc;

        memcpy(shape, t->shape, sizeof(shape));
        rf_inv_scale_box(&qd, nd, shape, &p.box, &sb);
        for (int d = nd - 1; d >= 0; d--) {
            qd.scale_strides[d] = ss;
            ss *= sb.extent[d];
        }
        p.region = region(f, ep, n);
        qd.scale_region = region(f, ep, (uint64_t)ss * rf_dtype_size(rf_quant_scale_dtype(q)));
        if ((rc = rf_inv_add_quant(f->inv, &qd, &p.quant, err)) < 0)
            return rc;
    }
    return rf_inv_add_piece(f->inv, &p, id, err);
}

/* Trainers: w rows in halves, experts two each, the norm on the first. Engines: w rows in
 * quarters and one expert each as FP8 in format q (e only when e_only), the norm on each.
 * fp8_src: the trainers hold the weights the engines hold in FP8 in FP8 too (format q).
 * one_host: every endpoint on host 7 (local copies), else trainers on host 1 and engines on
 * host 2 (messages between daemons). The inventory only: the test maps its regions into
 * f->bases (the memory its checks read). */
static void build(fixture *f, const rf_quant_fmt *q, bool e_only, bool fp8_src, bool one_host)
{
    int64_t ws[2] = {W_ROWS, W_COLS}, es[3] = {E_N, E_ROWS, E_COLS}, ns[1] = {W_COLS};
    uint32_t ep, id;
    rf_err err = {0};

    memset(f, 0, sizeof(*f));
    f->inv = rf_inv_new();
    cr_assert_eq(rf_inv_add_tensor(f->inv, "w.weight", RF_DT_BF16, 2, ws, &f->w, &err), 0);
    cr_assert_eq(rf_inv_add_tensor(f->inv, "e.weight", RF_DT_BF16, 3, es, &f->e, &err), 0);
    cr_assert_eq(rf_inv_add_tensor(f->inv, "n.weight", RF_DT_BF16, 1, ns, &f->n, &err), 0);
    for (int r = 0; r < 2; r++) {
        int64_t s2[2] = {r * W_ROWS / 2, 0}, x2[2] = {W_ROWS / 2, W_COLS};
        int64_t s3[3] = {r * 2, 0, 0}, x3[3] = {2, E_ROWS, E_COLS}, s1[1] = {0}, x1[1] = {W_COLS};

        cr_assert_eq(rf_inv_add_endpoint(f->inv, RF_SRC, 0, &ep, &err), 0);
        cr_assert_eq(rf_inv_set_endpoint_host(f->inv, ep, one_host ? 7 : 1, &err), 0);
        cr_assert_eq(add(f, ep, f->w, 2, s2, x2, fp8_src && !e_only ? q : NULL, &id, &err), 0,
                     "%s", err.msg);
        cr_assert_eq(add(f, ep, f->e, 3, s3, x3, fp8_src ? q : NULL, &id, &err), 0, "%s",
                     err.msg);
        if (r == 0)
            cr_assert_eq(add(f, ep, f->n, 1, s1, x1, NULL, &id, &err), 0, "%s", err.msg);
    }
    for (int r = 0; r < 4; r++) {
        int64_t s2[2] = {r * W_ROWS / 4, 0}, x2[2] = {W_ROWS / 4, W_COLS};
        int64_t s3[3] = {r, 0, 0}, x3[3] = {1, E_ROWS, E_COLS}, s1[1] = {0}, x1[1] = {W_COLS};

        cr_assert_eq(rf_inv_add_endpoint(f->inv, RF_DST, 1, &ep, &err), 0);
        cr_assert_eq(rf_inv_set_endpoint_host(f->inv, ep, one_host ? 7 : 2, &err), 0);
        cr_assert_eq(add(f, ep, f->w, 2, s2, x2, e_only ? NULL : q, &f->dst_w[r], &err), 0,
                     "%s", err.msg);
        cr_assert_eq(add(f, ep, f->e, 3, s3, x3, q, &f->dst_e[r], &err), 0, "%s", err.msg);
        cr_assert_eq(add(f, ep, f->n, 1, s1, x1, NULL, &id, &err), 0, "%s", err.msg);
    }
    f->nregions = rf_inv_nregions(f->inv);
}

/* The trainers' bf16 value (xd_fill's bytes) of element lin of tensor t, version v. */
static uint16_t src_value(uint32_t t, uint64_t lin, uint64_t v)
{
    return (uint16_t)(xd_pattern(t, lin, 0, v) | xd_pattern(t, lin, 1, v) << 8);
}

/* FP8 piece id of side: the reference of the trainers' values of version v compared with its
 * bytes and scales (returns the wrong ones), or, fill, written into them (a trainer's FP8
 * piece). Pieces are dense, their scales row-major over each matrix's block grid (add). */
static uint64_t fp8_piece(const fixture *f, rf_side side, uint32_t id, uint64_t v, bool fill)
{
    rf_piece p, sp;
    const rf_tensor *t;
    const rf_quant_decl *qd;
    rf_quant_fmt q;
    uint64_t wrong = 0, rows, cols, nm = 1, sr, sc;
    size_t ses;
    int nd;

    rf_inv_piece(f->inv, side, id, &p);
    cr_assert_neq(p.quant, 0);
    t = rf_inv_tensor(f->inv, p.tensor);
    nd = t->ndim;
    qd = rf_inv_quant(f->inv, p.quant);
    q = (rf_quant_fmt){qd->kind, qd->br, qd->bc};
    ses = rf_dtype_size(rf_quant_scale_dtype(&q));
    rf_inv_quant_scales(f->inv, &p, &sp);
    rows = (uint64_t)p.box.extent[nd - 2];
    cols = (uint64_t)p.box.extent[nd - 1];
    for (int d = 0; d < nd - 2; d++)
        nm *= (uint64_t)p.box.extent[d];
    cr_assert_eq(rf_quant_scale_shape(&q, rows, cols, &sr, &sc, NULL), 0);
    for (uint64_t l = 0; l < nm; l++) {
        uint16_t *src = malloc(rows * cols * 2);
        uint8_t *qw = malloc(rows * cols), *sw = malloc(sr * sc * ses);
        uint8_t *got = f->bases[p.region] + p.offset + l * rows * cols;
        uint8_t *gots = f->bases[sp.region] + sp.offset + l * sr * sc * ses;
        uint64_t lead = nd == 3 ? (uint64_t)p.box.start[0] + l : 0;

        for (uint64_t r = 0; r < rows; r++)
            for (uint64_t c = 0; c < cols; c++) {
                uint64_t gr = (uint64_t)p.box.start[nd - 2] + r;
                uint64_t lin = (lead * (uint64_t)t->shape[nd - 2] + gr) *
                               (uint64_t)t->shape[nd - 1] + (uint64_t)p.box.start[nd - 1] + c;

                src[r * cols + c] = src_value(p.tensor, lin, v);
            }
        rf_quant_ref(&q, RF_DT_BF16, src, (int64_t)cols, rows, cols, qw, (int64_t)cols, sw,
                     (int64_t)sc);
        if (fill) {
            memcpy(got, qw, rows * cols);
            memcpy(gots, sw, sr * sc * ses);
        }
        for (uint64_t b = 0; b < rows * cols; b++)
            wrong += got[b] != qw[b];
        for (uint64_t b = 0; b < sr * sc * ses; b++)
            wrong += gots[b] != sw[b];
        free(src);
        free(qw);
        free(sw);
    }
    return wrong;
}

static uint64_t check_fp8(const fixture *f, uint32_t id, uint64_t v)
{
    return fp8_piece(f, RF_DST, id, v, false);
}

/* xd_fill's counterpart for the trainers' FP8 pieces: each quantized from the version's values
 * (the reference), as a trainer holding FP8 weights would have them. */
static void fill_fp8_sources(const fixture *f, uint64_t v)
{
    for (uint32_t i = 0; i < rf_inv_npieces(f->inv, RF_SRC); i++)
        if (rf_inv_piece_recs(f->inv, RF_SRC)[i].quant)
            fp8_piece(f, RF_SRC, i, v, true);
}

/* xd_check reads every destination piece as its tensor's dtype, which FP8 pieces are not:
 * check_plain below applies its rule to the plain ones. */
static void (*const unused_xd_check)(const rf_inv *, uint8_t *const *, uint64_t, uint64_t *,
                                     uint64_t *) __attribute__((unused)) = xd_check;

/* Wrong bytes of the destination pieces that are not FP8 (xd_check's rule, plain ones). */
static uint64_t check_plain(const fixture *f, uint64_t v)
{
    uint64_t wrong = 0;
    uint8_t *mask = NULL;

    for (uint32_t i = 0; i < rf_inv_npieces(f->inv, RF_DST); i++) {
        rf_piece p;
        xd_elem e;

        rf_inv_piece(f->inv, RF_DST, i, &p);
        if (p.quant)
            continue;
        mask = calloc(rf_inv_region(f->inv, p.region)->size + 1, 1);
        e = (xd_elem){.base = f->bases[p.region], .p = &p,
                      .t = rf_inv_tensor(f->inv, p.tensor), .version = v, .mask = mask};
        e.esize = rf_dtype_size(e.t->dtype);
        xd_for_each(e.t, &p.box, xd_check_elem, &e);
        wrong += e.wrong;
        free(mask);
    }
    return wrong;
}

/* After a refit of version v in format name: every FP8 piece of the engines (w's unless
 * e_only, the experts') equal to the reference, every plain piece (the norm; w with e_only)
 * the trainers' bytes. */
static void check_refit(const fixture *f, const char *name, bool e_only, uint64_t v)
{
    uint64_t wrong = 0;

    for (int r = 0; r < 4; r++) {
        if (!e_only)
            wrong += check_fp8(f, f->dst_w[r], v);
        wrong += check_fp8(f, f->dst_e[r], v);
    }
    cr_assert_eq(wrong, 0, "%s version %llu: %llu FP8 bytes or scales differ from the "
                 "reference", name, (unsigned long long)v, (unsigned long long)wrong);
    wrong = check_plain(f, v);
    cr_assert_eq(wrong, 0, "%s version %llu: %llu bytes of plain pieces wrong", name,
                 (unsigned long long)v, (unsigned long long)wrong);
}

#endif
