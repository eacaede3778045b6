/* common/data/copy_tile.c - the choice of the GPU's tiled (transposing) copy path, and the views
 * of a copy it is made on. */
#include "copy_tile.h"

#include <assert.h>
#include <string.h>

bool rf_copy_tile_choose(const rf_copy_pair_flat *f, rf_copy_tile *t)
{
    uint64_t u = f->run, align = (uint64_t)(uintptr_t)f->src | (uint64_t)(uintptr_t)f->dst;
    uint64_t side, tiles = 1;
    int a = -1, b = -1;

    if (u == 0 || u > RF_COPY_TILE_UNIT_MAX || (u & (u - 1)) != 0)
        return false;
    for (int k = 0; k < f->n; k++)
        align |= (uint64_t)f->sstr[k] | (uint64_t)f->dstr[k];
    if ((align & (u - 1)) != 0)
        return false;
    for (int k = 0; k < f->n && a < 0; k++)
        if ((uint64_t)f->sstr[k] == u && f->ext[k] >= RF_COPY_TILE_MIN_EXT)
            a = k;
    for (int k = 0; k < f->n && b < 0; k++)
        if (k != a && (uint64_t)f->dstr[k] == u && f->ext[k] >= RF_COPY_TILE_MIN_EXT)
            b = k;
    if (a < 0 || b < 0)
        return false;
    side = RF_COPY_TILE_SIDE(u);
    /* The kernel counts tiles and extents, and steps inside a tile, in 32 bits. */
    if ((uint64_t)f->ext[a] > UINT32_MAX || (uint64_t)f->ext[b] > UINT32_MAX ||
        (uint64_t)f->sstr[b] > UINT32_MAX / side || (uint64_t)f->dstr[a] > UINT32_MAX / side)
        return false;
    for (int k = 0; k < f->n; k++) {
        uint64_t e = (uint64_t)f->ext[k];
        uint64_t fac = k == a || k == b ? (e + side - 1) / side : e;

        /* Both factors below 2^32: the product cannot wrap. */
        if (fac > UINT32_MAX || (tiles *= fac) > UINT32_MAX)
            return false;
    }
    t->a = a;
    t->b = b;
    t->unit = (uint32_t)u;
    t->tiles = tiles;
    return true;
}

void rf_copy_tile_desc_flat(const rf_copy_desc *d, const rf_copy_flat *fl, uint8_t *staging,
                            bool gather, rf_copy_pair_flat *out)
{
    int64_t mstr[RF_MAX_DIMS], sstr[RF_MAX_DIMS], st = (int64_t)fl->run;
    uint8_t *mem = d->base + fl->first, *stg = staging + d->staging_off;
    int n = fl->n;

    memset(out, 0, sizeof(*out));
    /* The strided innermost dim is one of the box's dims, so the walk has at most ndim. */
    assert(n + (fl->inner_str != 0) <= RF_MAX_DIMS);
    for (int k = 0; k < n; k++) {
        out->ext[k] = fl->ext[k];
        mstr[k] = fl->str[k];
    }
    if (fl->inner_str != 0) {
        out->ext[n] = fl->inner_ext;
        mstr[n] = fl->inner_str;
        n++;
    }
    /* Staging holds the runs back to back in row-major order of the walk. */
    for (int k = n - 1; k >= 0; k--) {
        sstr[k] = st;
        st *= out->ext[k];
    }
    out->src = gather ? mem : stg;
    out->dst = gather ? stg : mem;
    out->run = fl->run;
    out->bytes = rf_copy_desc_bytes(d);
    out->n = n;
    memcpy(out->sstr, gather ? mstr : sstr, (size_t)n * sizeof(int64_t));
    memcpy(out->dstr, gather ? sstr : mstr, (size_t)n * sizeof(int64_t));
    for (int k = n; k < RF_MAX_DIMS; k++)
        out->ext[k] = 1;
}

void rf_copy_tile_reorder(rf_copy_pair_flat *f)
{
    for (;;) {
        int k = 0;

        while (k < f->n && !((uint64_t)f->sstr[k] == f->run && (uint64_t)f->dstr[k] == f->run))
            k++;
        if (k == f->n)
            return;
        /* Dim k holds the runs back to back on both sides: it becomes part of the run. */
        f->run *= (uint64_t)f->ext[k];
        memmove(&f->ext[k], &f->ext[k + 1], (size_t)(f->n - k - 1) * sizeof(f->ext[0]));
        memmove(&f->sstr[k], &f->sstr[k + 1], (size_t)(f->n - k - 1) * sizeof(f->sstr[0]));
        memmove(&f->dstr[k], &f->dstr[k + 1], (size_t)(f->n - k - 1) * sizeof(f->dstr[0]));
        f->n--;
        f->ext[f->n] = 1;
        f->sstr[f->n] = f->dstr[f->n] = 0;
    }
}
