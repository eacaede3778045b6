/* common/data/copy.h - batched box gather (piece memory -> dense row-major staging) and scatter
 * (staging -> piece memory) on the host, with the semantics the CUDA kernels share. */
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

#endif
