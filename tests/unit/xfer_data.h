/* tests/unit/xfer_data.h - the transport tests' data, shared by test_xfer (host memory) and
 * test_xfer_nccl (host mirrors of GPU memory): a byte pattern per (tensor, element, byte,
 * version), written into every source piece and checked in every destination piece, with
 * bytes outside the destination pieces required to keep their 0xee fill. Header-only: each
 * test program includes it once. */
#ifndef RF_TEST_XFER_DATA_H
#define RF_TEST_XFER_DATA_H

#include <stdint.h>
#include <stdlib.h>

#include "layout.h"

static uint8_t xd_pattern(uint32_t tensor, uint64_t lin, int byte, uint64_t version)
{
    uint64_t x = (lin + 1) * 0x9e3779b97f4a7c15ull ^ ((uint64_t)tensor << 40) ^ (version << 56);

    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 32;
    return (uint8_t)(x >> (8 * byte));
}

/* Calls fn on every element of box: its global index, row-major linear index in shape. */
static void xd_for_each(const rf_tensor *t, const rf_box *box,
                        void (*fn)(void *ctx, const int64_t *idx, uint64_t lin), void *ctx)
{
    int64_t idx[RF_MAX_DIMS];
    int d;

    for (d = 0; d < t->ndim; d++)
        idx[d] = box->start[d];
    for (;;) {
        uint64_t lin = 0;

        for (d = 0; d < t->ndim; d++)
            lin = lin * (uint64_t)t->shape[d] + (uint64_t)idx[d];
        fn(ctx, idx, lin);
        for (d = t->ndim - 1; d >= 0; d--) {
            if (++idx[d] < box->start[d] + box->extent[d])
                break;
            idx[d] = box->start[d];
        }
        if (d < 0)
            return;
    }
}

typedef struct xd_elem {
    uint8_t *base;
    const rf_piece *p;
    const rf_tensor *t;
    size_t esize;
    uint64_t version;
    uint8_t *mask; /* destination: bytes the pieces cover */
    uint64_t wrong;
} xd_elem;

static void xd_fill_elem(void *ctx, const int64_t *idx, uint64_t lin)
{
    xd_elem *c = ctx;
    uint64_t off = rf_piece_byte_offset(c->p, c->t->ndim, c->esize, idx);

    for (size_t b = 0; b < c->esize; b++)
        c->base[off + b] = xd_pattern(c->p->tensor, lin, (int)b, c->version);
}

static void xd_check_elem(void *ctx, const int64_t *idx, uint64_t lin)
{
    xd_elem *c = ctx;
    uint64_t off = rf_piece_byte_offset(c->p, c->t->ndim, c->esize, idx);

    for (size_t b = 0; b < c->esize; b++) {
        if (c->base[off + b] != xd_pattern(c->p->tensor, lin, (int)b, c->version))
            c->wrong++;
        c->mask[off + b] = 1;
    }
}

/* Writes the version's pattern into every source piece; mem[r] is region r's memory. FP8
 * pieces (a trainer holding a weight in FP8) are left to the test that declares them. */
static void xd_fill(const rf_inv *inv, uint8_t *const *mem, uint64_t version)
{
    for (uint32_t i = 0; i < rf_inv_npieces(inv, RF_SRC); i++) {
        rf_piece p;
        xd_elem e;

        rf_inv_piece(inv, RF_SRC, i, &p);
        if (p.quant != 0)
            continue;
        e = (xd_elem){.base = mem[p.region], .p = &p, .t = rf_inv_tensor(inv, p.tensor),
                      .version = version};
        e.esize = rf_dtype_size(e.t->dtype);
        xd_for_each(e.t, &p.box, xd_fill_elem, &e);
    }
}

/* Counts destination bytes that do not hold the version's pattern (*wrong) and bytes of
 * destination regions (one byte past each included) outside every piece that lost their 0xee
 * fill (*stray). */
static void xd_check(const rf_inv *inv, uint8_t *const *mem, uint64_t version, uint64_t *wrong,
                     uint64_t *stray)
{
    uint32_t nregions = rf_inv_nregions(inv);
    uint8_t **mask = calloc(nregions, sizeof(*mask));

    *wrong = *stray = 0;
    for (uint32_t i = 0; i < rf_inv_npieces(inv, RF_DST); i++) {
        rf_piece p;
        xd_elem e;

        rf_inv_piece(inv, RF_DST, i, &p);
        if (!mask[p.region])
            mask[p.region] = calloc(rf_inv_region(inv, p.region)->size + 1, 1);
        e = (xd_elem){.base = mem[p.region], .p = &p, .t = rf_inv_tensor(inv, p.tensor),
                      .version = version, .mask = mask[p.region]};
        e.esize = rf_dtype_size(e.t->dtype);
        xd_for_each(e.t, &p.box, xd_check_elem, &e);
        *wrong += e.wrong;
    }
    for (uint32_t r = 0; r < nregions; r++) {
        if (!mask[r])
            continue;
        for (uint64_t b = 0; b <= rf_inv_region(inv, r)->size; b++)
            if (!mask[r][b] && mem[r][b] != 0xee)
                (*stray)++;
        free(mask[r]);
    }
    free(mask);
}

#endif
