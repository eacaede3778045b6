/* tests/unit/tile_shapes.h - boxes held in any dim order (transposed, per-expert transposed,
 * padded), for the tests of the tiled copy path (test_copy_tile.c on the host, test_copy_cuda.c
 * on the GPU). */
#ifndef RF_TEST_TILE_SHAPES_H
#define RF_TEST_TILE_SHAPES_H

#include <string.h>

#include "copy.h"

/* A box of extents ext[0..ndim) at offset off of base: a piece around it with `margin` more
 * elements on each side of every dim (so the box is off the piece's origin), its dims laid out
 * outermost first in the order ord[] (ord[ndim - 1] is the contiguous one), the innermost padded
 * by pad elements. Returns the piece's bytes from off. */
static inline uint64_t tile_side(rf_copy_desc *d, uint8_t *base, uint64_t off, uint32_t es,
                                 int ndim, const int64_t *ext, const int *ord, int64_t margin,
                                 int64_t pad)
{
    int64_t st = 1;

    memset(d, 0, sizeof(*d));
    d->base = base;
    d->offset = off;
    d->esize = es;
    d->ndim = (uint32_t)ndim;
    for (int k = 0; k < RF_MAX_DIMS; k++)
        d->piece.extent[k] = d->sub.extent[k] = 1;
    for (int k = 0; k < ndim; k++) {
        d->piece.start[k] = 7 + k;
        d->piece.extent[k] = ext[k] + 2 * margin;
        d->sub.start[k] = 7 + k + margin;
        d->sub.extent[k] = ext[k];
    }
    for (int j = ndim - 1; j >= 0; j--) {
        d->strides[ord[j]] = st;
        st *= d->piece.extent[ord[j]] + (j == ndim - 1 ? pad : 0);
    }
    return (uint64_t)st * es;
}

#endif
