/* common/data/copy.h - batched box gather (piece memory -> dense row-major staging), scatter
 * (staging -> piece memory) and pair copies (piece memory -> piece memory, both strided) on the
 * host, with the semantics the CUDA kernels share. */
#ifndef RF_COPY_H
#define RF_COPY_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"
#include "layout.h"
#include "plan.h"

/* One box copy: the elements of `sub` (global coordinates, inside `piece`) of a piece whose
 * origin lies at base + offset with element strides `strides`, to or from staging at
 * staging_off as sub's elements in row-major order. */
typedef struct rf_copy_desc {
    uint8_t *base;          /* region base */
    uint64_t offset;        /* bytes from base to the piece's origin */
    uint64_t staging_off;   /* bytes from the staging buffer's start */
    uint32_t esize;         /* bytes per element */
    uint32_t ndim;
    rf_box piece;           /* the piece's box */
    int64_t strides[RF_MAX_DIMS];
    rf_box sub;             /* the box to copy, inside piece */
} rf_copy_desc;

/* Fills d from a piece of the inventory's geometry. */
void rf_copy_desc_set(rf_copy_desc *d, void *base, const rf_piece *p, int ndim, size_t esize,
                      const rf_box *sub, uint64_t staging_off);
/* Bytes one descriptor moves. */
uint64_t rf_copy_desc_bytes(const rf_copy_desc *d);

/* A copy reduced to its essentials: dims of extent 1 dropped, neighbouring dims that are
 * contiguous in piece memory merged, so the innermost loop is one memcpy per run. The host
 * copy and the CUDA kernels (common/data/copy_cuda.h) walk the same reduction. */
typedef struct rf_copy_flat {
    int n;                     /* outer dims */
    int64_t ext[RF_MAX_DIMS];  /* outer extents */
    int64_t str[RF_MAX_DIMS];  /* outer strides, bytes */
    uint64_t run;              /* bytes of one innermost run when inner is contiguous */
    int64_t inner_ext;         /* elements of the innermost dim when it is strided */
    int64_t inner_str;         /* its stride in bytes, 0 when contiguous */
    uint64_t first;            /* bytes from base to the first element */
} rf_copy_flat;

/* The checks gather and scatter make of descriptor d (index i names it in err). */
int rf_copy_check(const rf_copy_desc *d, size_t i, rf_err *err);
/* Reduces a checked descriptor. */
void rf_copy_flatten(const rf_copy_desc *d, rf_copy_flat *f);
/* Copies one checked descriptor's box between its piece and staging + d->staging_off;
 * to_staging picks the direction (gather when true). */
void rf_copy_run(const rf_copy_desc *d, void *staging, bool to_staging);

/* Piece memory -> staging, for every descriptor. -EINVAL (nothing copied) when a descriptor
 * is malformed: ndim outside 1..RF_MAX_DIMS, esize 0, a negative stride, or sub not inside
 * the piece; err names the descriptor. */
int rf_copy_gather(const rf_copy_desc *d, size_t n, void *staging, rf_err *err);
/* Staging -> piece memory, for every descriptor; same checks. */
int rf_copy_scatter(const rf_copy_desc *d, size_t n, const void *staging, rf_err *err);

/* One box copied from one piece's memory straight into another's (a local transfer): the
 * elements of src.sub go to dst.sub, element by element in row-major order. The two subs have
 * the same extents (their starts may differ), ndim and esize; staging_off is unused. */
typedef struct rf_copy_pair {
    rf_copy_desc src, dst;
} rf_copy_pair;

/* A pair reduced like rf_copy_flat, for both sides at once: dims of extent 1 dropped,
 * neighbouring dims merged only when they are contiguous together on both sides, so the
 * innermost run is contiguous in both memories. The host copy, the digests of a local transport
 * and the CUDA pair kernel walk the same reduction. */
typedef struct rf_copy_pair_flat {
    const uint8_t *src;          /* the first element of each side */
    uint8_t *dst;
    uint64_t run;                /* bytes of one run, contiguous on both sides */
    uint64_t bytes;              /* the whole box */
    int n;                       /* dims walked around the runs, outermost first */
    int64_t ext[RF_MAX_DIMS];
    int64_t sstr[RF_MAX_DIMS];   /* strides of those dims, bytes, source side */
    int64_t dstr[RF_MAX_DIMS];   /* the same, destination side */
} rf_copy_pair_flat;

/* The checks of a pair: each side as rf_copy_check, then the same ndim, esize and extents on
 * both; -EINVAL with err naming pair i and what differs. */
int rf_copy_pair_check(const rf_copy_pair *p, size_t i, rf_err *err);
/* Reduces a checked pair. */
void rf_copy_pair_flatten(const rf_copy_pair *p, rf_copy_pair_flat *f);
/* Copies bytes [lo, hi) of the box's row-major packing from source to destination: a part of
 * the copy, so that a large one can be split over threads and stopped between parts. */
void rf_copy_pair_range(const rf_copy_pair_flat *f, uint64_t lo, uint64_t hi);
/* Hands bytes [lo, hi) of one side's row-major packing to fn, run by run in order (what a
 * digest of the packed bytes reads, without packing them). */
void rf_copy_pair_visit(const rf_copy_pair_flat *f, bool dst_side, uint64_t lo, uint64_t hi,
                        void (*fn)(void *ctx, const uint8_t *p, uint64_t n), void *ctx);
/* Whether rf_copy_pair_range copies f's whole rows through tiles (a transpose: short runs,
 * the innermost dim strided on a side); what the tests check they reach. */
bool rf_copy__pair_tiled(const rf_copy_pair_flat *f);
/* rf_copy_pair_visit with the buffer it packs a side held in short strided runs into (cap
 * bytes; the visit hands fn the buffer, up to cap bytes at a time). */
void rf_copy__pair_visit_buf(const rf_copy_pair_flat *f, bool dst_side, uint64_t lo, uint64_t hi,
                             void (*fn)(void *ctx, const uint8_t *p, uint64_t n), void *ctx,
                             uint8_t *buf, uint64_t cap);
/* Every pair, source memory -> destination memory; nothing copied when one is malformed. */
int rf_copy_pairs(const rf_copy_pair *p, size_t n, rf_err *err);

/* Elements [lo, hi) of box b in row-major order as boxes, in that order: at most
 * RF_COPY_SPAN_MAX of them (a part of a box that fits a buffer, split along its outer dims).
 * Returns their number; 0 for an empty range. */
#define RF_COPY_SPAN_MAX (2 * RF_MAX_DIMS)
int rf_copy_box_span(const rf_box *b, int ndim, uint64_t lo, uint64_t hi, rf_box *out);

#endif
