/* common/data/copy_tile.h - which box copies the GPU kernels move as tiles through shared memory
 * (a transpose): those whose run contiguous on both sides is one small unit while each side has
 * another dim contiguous. Host code, so that the choice builds and is tested without CUDA. */
#ifndef RF_COPY_TILE_H
#define RF_COPY_TILE_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "copy.h"

/* The largest unit a tile moves: from 32 bytes on, the element-wise kernel reads whole 32-byte
 * sectors anyway. */
#define RF_COPY_TILE_UNIT_MAX 16
/* The shortest tiled dim: below it the element-wise kernel's warps still read and write a few
 * long stretches, and a tile would leave most of its threads idle. */
#define RF_COPY_TILE_MIN_EXT 8
/* Units along each side of a tile: a warp's row is at least 32 bytes (one sector) and a tile
 * at most 16 KiB of shared memory. */
#define RF_COPY_TILE_SIDE(unit) ((unit) <= 4 ? 64u : 32u)

/* How a copy is tiled: tiles of SIDE x SIDE units over dims a and b of its walk, every other
 * dim walked around them. */
typedef struct rf_copy_tile {
    int a;          /* the dim contiguous in the source: sstr[a] == unit */
    int b;          /* the dim contiguous in the destination: dstr[b] == unit, b != a */
    uint32_t unit;  /* bytes moved as one: the run, 1, 2, 4, 8 or 16, every address aligned */
    uint64_t tiles; /* tiles of the whole copy */
} rf_copy_tile;

/* Whether the reduced copy f goes as tiles; fills t when it does. Tiled: a run of a power of two
 * up to RF_COPY_TILE_UNIT_MAX bytes, every address and stride a multiple of it, a dim a of at
 * least RF_COPY_TILE_MIN_EXT units contiguous in the source and another, b, in the destination;
 * tile counts, the two extents and a tile's span on each side within 32 bits. */
bool rf_copy_tile_choose(const rf_copy_pair_flat *f, rf_copy_tile *t);

/* A checked gather (piece memory -> staging) or scatter (staging -> piece memory) descriptor,
 * already reduced into fl, as a pair copy between piece memory and staging + staging_off packed
 * row-major, for rf_copy_tile_choose and the tiled kernel. */
void rf_copy_tile_desc_flat(const rf_copy_desc *d, const rf_copy_flat *fl, uint8_t *staging,
                            bool gather, rf_copy_pair_flat *out);

/* Reorders the dims of a reduced pair copy so that a dim contiguous on both sides (a box both
 * memories hold transposed the same way) joins the run, innermost: the same elements go to the
 * same places, read and written in longer runs. Walks that pack in row-major order (gather,
 * scatter, digests) must not take the reordered copy. */
void rf_copy_tile_reorder(rf_copy_pair_flat *f);

#ifdef __cplusplus
}
#endif

#endif
