/* common/data/copy.c - host implementation of batched box gather/scatter and of pair copies
 * between two strided pieces, with the semantics the CUDA kernels share. */
#include "copy.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

typedef rf_copy_flat flat;

void rf_copy_desc_set(rf_copy_desc *d, void *base, const rf_piece *p, int ndim, size_t esize,
                      const rf_box *sub, uint64_t staging_off)
{
    memset(d, 0, sizeof(*d));
    d->base = base;
    d->offset = p->offset;
    d->staging_off = staging_off;
    d->esize = (uint32_t)esize;
    d->ndim = (uint32_t)ndim;
    d->piece = p->box;
    d->sub = *sub;
    memcpy(d->strides, p->strides, sizeof(d->strides));
}

uint64_t rf_copy_desc_bytes(const rf_copy_desc *d)
{
    uint64_t n = d->esize;

    for (uint32_t i = 0; i < d->ndim && i < RF_MAX_DIMS; i++)
        n *= (uint64_t)d->sub.extent[i];
    return n;
}

static int check(const rf_copy_desc *d, size_t i, rf_err *err)
{
    char bs[256], ps[256];

    if (d->ndim < 1 || d->ndim > RF_MAX_DIMS || d->esize == 0)
        return rf_err_set(err, -EINVAL, "copy: descriptor %zu has ndim %u and element size %u; "
                          "ndim must be 1..%d and the size non-zero", i, d->ndim, d->esize,
                          RF_MAX_DIMS);
    for (uint32_t k = 0; k < d->ndim; k++) {
        if (d->strides[k] < 0)
            return rf_err_set(err, -EINVAL, "copy: descriptor %zu has negative stride %lld "
                              "in dim %u", i, (long long)d->strides[k], k);
    }
    if (rf_box_empty(&d->sub, (int)d->ndim) || !rf_box_contains(&d->piece, &d->sub, (int)d->ndim)) {
        rf_box_format(&d->sub, (int)d->ndim, bs, sizeof(bs));
        rf_box_format(&d->piece, (int)d->ndim, ps, sizeof(ps));
        return rf_err_set(err, -EINVAL, "copy: descriptor %zu box %s is empty or not inside its "
                          "piece %s", i, bs, ps);
    }
    return 0;
}

int rf_copy_check(const rf_copy_desc *d, size_t i, rf_err *err)
{
    return check(d, i, err);
}

void rf_copy_flatten(const rf_copy_desc *d, rf_copy_flat *f)
{
    int64_t ext[RF_MAX_DIMS], str[RF_MAX_DIMS];
    int n = 0;
    int64_t el = 0;

    for (uint32_t k = 0; k < d->ndim; k++) {
        el += (d->sub.start[k] - d->piece.start[k]) * d->strides[k];
        if (d->sub.extent[k] == 1)
            continue;
        ext[n] = d->sub.extent[k];
        str[n] = d->strides[k] * (int64_t)d->esize;
        n++;
    }
    f->first = d->offset + (uint64_t)el * d->esize;
    /* Merge each dim into the one inside it when they are contiguous together. */
    for (int k = n - 1; k > 0; k--) {
        if (str[k - 1] == str[k] * ext[k]) {
            ext[k - 1] *= ext[k];
            str[k - 1] = str[k];
            memmove(&ext[k], &ext[k + 1], (size_t)(n - k - 1) * sizeof(ext[0]));
            memmove(&str[k], &str[k + 1], (size_t)(n - k - 1) * sizeof(str[0]));
            n--;
        }
    }
    if (n == 0) {
        f->n = 0;
        f->run = d->esize;
        f->inner_ext = 1;
        f->inner_str = 0;
    } else if (str[n - 1] == (int64_t)d->esize) {
        f->n = n - 1;
        f->run = (uint64_t)ext[n - 1] * d->esize;
        f->inner_ext = 1;
        f->inner_str = 0;
    } else {
        f->n = n - 1;
        f->run = d->esize;
        f->inner_ext = ext[n - 1];
        f->inner_str = str[n - 1];
    }
    memcpy(f->ext, ext, sizeof(ext[0]) * (size_t)f->n);
    memcpy(f->str, str, sizeof(str[0]) * (size_t)f->n);
}

static bool staging_pair(const rf_copy_desc *d, const flat *f, uint8_t *st, bool to_staging,
                         rf_copy_pair_flat *g);

void rf_copy_run(const rf_copy_desc *d, void *staging, bool to_staging)
{
    flat f;
    rf_copy_pair_flat g;
    int64_t idx[RF_MAX_DIMS] = {0};
    uint8_t *s = (uint8_t *)staging + d->staging_off;

    rf_copy_flatten(d, &f);
    if (staging_pair(d, &f, s, to_staging, &g)) {
        rf_copy_pair_range(&g, 0, g.bytes);
        return;
    }
    for (;;) {
        uint8_t *m = d->base + f.first;
        int k;
        for (k = 0; k < f.n; k++)
            m += idx[k] * f.str[k];
        if (f.inner_str == 0) {
            if (to_staging)
                memcpy(s, m, f.run);
            else
                memcpy(m, s, f.run);
            s += f.run;
        } else {
            for (int64_t i = 0; i < f.inner_ext; i++) {
                if (to_staging)
                    memcpy(s, m, f.run);
                else
                    memcpy(m, s, f.run);
                s += f.run;
                m += f.inner_str;
            }
        }
        for (k = f.n - 1; k >= 0; k--) {
            if (++idx[k] < f.ext[k])
                break;
            idx[k] = 0;
        }
        if (k < 0)
            break;
    }
}

int rf_copy_gather(const rf_copy_desc *d, size_t n, void *staging, rf_err *err)
{
    int rc;

    for (size_t i = 0; i < n; i++)
        if ((rc = check(&d[i], i, err)) != 0)
            return rc;
    for (size_t i = 0; i < n; i++)
        rf_copy_run(&d[i], staging, true);
    return 0;
}

int rf_copy_scatter(const rf_copy_desc *d, size_t n, const void *staging, rf_err *err)
{
    int rc;

    for (size_t i = 0; i < n; i++)
        if ((rc = check(&d[i], i, err)) != 0)
            return rc;
    for (size_t i = 0; i < n; i++)
        rf_copy_run(&d[i], (void *)(uintptr_t)staging, false);
    return 0;
}

/* ---- pairs: piece memory -> piece memory ---- */

int rf_copy_pair_check(const rf_copy_pair *p, size_t i, rf_err *err)
{
    const rf_copy_desc *s = &p->src, *d = &p->dst;
    char bs[256], bd[256];
    int rc;

    if ((rc = check(s, i, err)) != 0) {
        rf_err_wrap(err, "source side of pair %zu: ", i);
        return rc;
    }
    if ((rc = check(d, i, err)) != 0) {
        rf_err_wrap(err, "destination side of pair %zu: ", i);
        return rc;
    }
    if (s->ndim != d->ndim || s->esize != d->esize)
        return rf_err_set(err, -EINVAL, "copy: pair %zu copies %u dims of %u-byte elements "
                          "into %u dims of %u-byte elements; both sides must agree", i,
                          s->ndim, s->esize, d->ndim, d->esize);
    for (uint32_t k = 0; k < s->ndim; k++) {
        if (s->sub.extent[k] != d->sub.extent[k]) {
            rf_box_format(&s->sub, (int)s->ndim, bs, sizeof(bs));
            rf_box_format(&d->sub, (int)d->ndim, bd, sizeof(bd));
            return rf_err_set(err, -EINVAL, "copy: pair %zu copies box %s into box %s of "
                              "another shape (dim %u)", i, bs, bd, k);
        }
    }
    return 0;
}

void rf_copy_pair_flatten(const rf_copy_pair *p, rf_copy_pair_flat *f)
{
    const rf_copy_desc *s = &p->src, *d = &p->dst;
    int64_t es = (int64_t)s->esize, so = 0, dof = 0;
    int n = 0;

    memset(f, 0, sizeof(*f));
    for (uint32_t k = 0; k < s->ndim; k++) {
        so += (s->sub.start[k] - s->piece.start[k]) * s->strides[k];
        dof += (d->sub.start[k] - d->piece.start[k]) * d->strides[k];
        if (s->sub.extent[k] == 1)
            continue;
        f->ext[n] = s->sub.extent[k];
        f->sstr[n] = s->strides[k] * es;
        f->dstr[n] = d->strides[k] * es;
        n++;
    }
    f->src = s->base + s->offset + (uint64_t)(so * es);
    f->dst = d->base + d->offset + (uint64_t)(dof * es);
    f->bytes = rf_copy_desc_bytes(s);
    /* A dim joins the one inside it only when both memories hold them back to back. */
    for (int k = n - 1; k > 0; k--) {
        if (f->sstr[k - 1] == f->sstr[k] * f->ext[k] && f->dstr[k - 1] == f->dstr[k] * f->ext[k]) {
            f->ext[k - 1] *= f->ext[k];
            f->sstr[k - 1] = f->sstr[k];
            f->dstr[k - 1] = f->dstr[k];
            memmove(&f->ext[k], &f->ext[k + 1], (size_t)(n - k - 1) * sizeof(f->ext[0]));
            memmove(&f->sstr[k], &f->sstr[k + 1], (size_t)(n - k - 1) * sizeof(f->sstr[0]));
            memmove(&f->dstr[k], &f->dstr[k + 1], (size_t)(n - k - 1) * sizeof(f->dstr[0]));
            n--;
        }
    }
    /* The innermost dim is the run when it is dense on both sides; else runs are elements. */
    if (n > 0 && f->sstr[n - 1] == es && f->dstr[n - 1] == es) {
        f->run = (uint64_t)f->ext[n - 1] * (uint64_t)es;
        n--;
    } else {
        f->run = (uint64_t)es;
    }
    f->n = n;
    for (int k = n; k < RF_MAX_DIMS; k++) {
        f->ext[k] = 1;
        f->sstr[k] = f->dstr[k] = 0;
    }
}

/* Walks runs of bytes [lo, hi) of the packing: fn gets both sides' pointers of each piece.
 * Destination offsets are less dbias (a buffer that holds packed bytes from dbias on). */
static void pair_walk(const rf_copy_pair_flat *f, int64_t dbias, uint64_t lo, uint64_t hi,
                      void (*fn)(void *ctx, const uint8_t *s, uint8_t *d, uint64_t n), void *ctx)
{
    int64_t idx[RF_MAX_DIMS], so, dof;
    uint64_t r, off, pos = lo;
    int k;

    if (hi > f->bytes)
        hi = f->bytes;
    if (lo >= hi)
        return;
    r = lo / f->run;
    off = lo - r * f->run;
    so = (int64_t)off;
    dof = (int64_t)off - dbias;
    for (k = f->n - 1; k >= 0; k--) {
        idx[k] = (int64_t)(r % (uint64_t)f->ext[k]);
        r /= (uint64_t)f->ext[k];
        so += idx[k] * f->sstr[k];
        dof += idx[k] * f->dstr[k];
    }
    for (;;) {
        uint64_t len = f->run - off < hi - pos ? f->run - off : hi - pos;

        fn(ctx, f->src + so, f->dst + dof, len);
        pos += len;
        if (pos >= hi)
            return;
        so -= (int64_t)off;
        dof -= (int64_t)off;
        off = 0;
        for (k = f->n - 1; k >= 0; k--) {
            if (++idx[k] < f->ext[k]) {
                so += f->sstr[k];
                dof += f->dstr[k];
                break;
            }
            so -= (f->ext[k] - 1) * f->sstr[k];
            dof -= (f->ext[k] - 1) * f->dstr[k];
            idx[k] = 0;
        }
        /* Runs past the last one do not exist: pos < hi <= bytes keeps k >= 0 here. */
    }
}

static void copy_fn(void *ctx, const uint8_t *s, uint8_t *d, uint64_t n)
{
    (void)ctx;
    memcpy(d, s, n);
}

/* ---- tiles: boxes whose runs are an element or a few, strided on a side ---- */

/* Runs up to this many bytes go through tiles when a side holds the innermost dim strided:
 * from half a cache line on, the element walk reads and writes most of each line it touches. */
#define TILE_RUN_MAX 32u
/* Rows and columns of a tile, in runs: 128 bytes (two cache lines) a row for runs of 2 bytes
 * and more, so that a tile reads and writes whole lines on both sides and its 8 KiB or less a
 * side stay in L1 while it is copied; 64 for single bytes. On four bf16 [4096 x 8192]
 * (bench/bench_transpose.c) 64 bf16 a tile beat 32 and 128. */
#define TILE 64
#define TILE_BYTES 128

static inline int tile_edge(size_t run)
{
    return run <= TILE_BYTES / TILE ? TILE : (int)(TILE_BYTES / run);
}

/* Rows whose pointers are taken at once; their tiles are copied column tile by column tile, so
 * that the side holding columns back to back reads or writes 512 bytes of each column in a
 * row (measured a little faster than one tile of rows at a time). */
#define BATCH 256
/* Bytes a visit packs at a time through tiles: 64 rows of 8192 bf16, enough rows for whole
 * tiles (a smaller buffer packs a few rows at a time at a fraction of the speed), and a
 * buffer on the stack for short ranges, or when none can be allocated. */
#define VISIT_BUF (1u << 20)
#define VISIT_STACK (64u << 10)

/* Whether no two elements of the box share a destination byte: the dims sorted by stride each
 * step past everything the smaller ones span. Tiles write in another order than the element
 * walk, which only a byte written twice could tell. */
static bool dst_distinct(const rf_copy_pair_flat *f)
{
    int64_t ext[RF_MAX_DIMS], str[RF_MAX_DIMS], reach = (int64_t)f->run;
    int n = f->n;

    for (int k = 0; k < n; k++) {
        int j = k;

        while (j > 0 && str[j - 1] > f->dstr[k]) {
            str[j] = str[j - 1];
            ext[j] = ext[j - 1];
            j--;
        }
        str[j] = f->dstr[k];
        ext[j] = f->ext[k];
    }
    for (int k = 0; k < n; k++) {
        if (str[k] < reach)
            return false;
        reach += str[k] * (ext[k] - 1);
    }
    return true;
}

/* Whether f goes through tiles: short runs, and each side that holds the innermost dim
 * strided holds the dim outside it closer together, so that a tile of rows x columns reads and
 * writes whole cache lines on both sides. */
static bool tiled(const rf_copy_pair_flat *f)
{
    int n = f->n;
    int64_t run = (int64_t)f->run;

    if (n < 2 || f->run > TILE_RUN_MAX)
        return false;
    if (f->sstr[n - 1] != run && f->sstr[n - 2] >= f->sstr[n - 1])
        return false;
    if (f->dstr[n - 1] != run && f->dstr[n - 2] >= f->dstr[n - 1])
        return false;
    return dst_distinct(f);
}

bool rf_copy__pair_tiled(const rf_copy_pair_flat *f)
{
    return tiled(f);
}

/* True when p[0..v) lie run bytes apart, in order: v rows of a tile held back to back. */
static inline bool back_to_back(const uint8_t *const *p, int v, size_t run)
{
    for (int i = 1; i < v; i++)
        if (p[i] != p[0] + (size_t)i * run)
            return false;
    return true;
}

#ifdef __SSE2__
/* Transposes a v x v block of run-byte elements, v = 16 / run: in[i] holds row i (16 bytes),
 * out[i] gets column i. log2(v) rounds of interleaving row i with row i + v/2 transpose it. */
static inline __attribute__((always_inline)) void tr_block(const uint8_t *const *in,
                                                           uint8_t *const *out, size_t run)
{
    __m128i x[16], y[16];
    const int v = (int)(16 / run), h = v / 2;

#pragma GCC unroll 16
    for (int i = 0; i < v; i++)
        x[i] = _mm_loadu_si128((const __m128i *)(const void *)in[i]);
#pragma GCC unroll 4
    for (int w = 1; w < v; w *= 2) {
#pragma GCC unroll 8
        for (int i = 0; i < h; i++) {
            switch (run) {
            case 1:
                y[2 * i] = _mm_unpacklo_epi8(x[i], x[i + h]);
                y[2 * i + 1] = _mm_unpackhi_epi8(x[i], x[i + h]);
                break;
            case 2:
                y[2 * i] = _mm_unpacklo_epi16(x[i], x[i + h]);
                y[2 * i + 1] = _mm_unpackhi_epi16(x[i], x[i + h]);
                break;
            case 4:
                y[2 * i] = _mm_unpacklo_epi32(x[i], x[i + h]);
                y[2 * i + 1] = _mm_unpackhi_epi32(x[i], x[i + h]);
                break;
            default:
                y[2 * i] = _mm_unpacklo_epi64(x[i], x[i + h]);
                y[2 * i + 1] = _mm_unpackhi_epi64(x[i], x[i + h]);
                break;
            }
        }
#pragma GCC unroll 16
        for (int i = 0; i < v; i++)
            x[i] = y[i];
    }
#pragma GCC unroll 16
    for (int i = 0; i < v; i++)
        _mm_storeu_si128((__m128i *)(void *)out[i], x[i]);
}
#endif

/* Copies columns [j0, j0 + nb) of rows ps[0..m) -> pd[0..m): column j of row a lies at
 * ps[a] + j * sj and goes to pd[a] + j * dj. With SSE2 and runs of 1, 2, 4 or 8 bytes, blocks of
 * 16 bytes on both sides are transposed in registers where one side holds the block's rows back
 * to back; the rest, one run at a time in row order (the tile is in L1 by then). */
static inline __attribute__((always_inline)) void tile(const uint8_t *const *ps,
                                                       uint8_t *const *pd, int m, int64_t j0,
                                                       int nb, int64_t sj, int64_t dj,
                                                       size_t run)
{
    int a = 0;

#ifdef __SSE2__
    const int v = run == 1 ? 16 : run == 2 ? 8 : run == 4 ? 4 : run == 8 ? 2 : 0;

    if (v == 0)
        goto rest;

    for (; v > 0 && a + v <= m; a += v) {
        const uint8_t *in[16];
        uint8_t *out[16];
        int b = 0;

        if ((size_t)dj == run && back_to_back(ps + a, v, run)) {
            /* Columns of the source are rows of the block: read 16 bytes down the source's
             * rows, write 16 bytes along each destination row. */
            for (; b + v <= nb; b += v) {
                for (int i = 0; i < v; i++) {
                    in[i] = ps[a] + (j0 + b + i) * sj;
                    out[i] = pd[a + i] + (j0 + b) * dj;
                }
                tr_block(in, out, run);
            }
        } else if ((size_t)sj == run && back_to_back((const uint8_t *const *)pd + a, v, run)) {
            for (; b + v <= nb; b += v) {
                for (int i = 0; i < v; i++) {
                    in[i] = ps[a + i] + (j0 + b) * sj;
                    out[i] = pd[a] + (j0 + b + i) * dj;
                }
                tr_block(in, out, run);
            }
        } else if (back_to_back(ps + a, v, run) &&
                   back_to_back((const uint8_t *const *)pd + a, v, run)) {
            /* Both sides hold the rows back to back: 16 bytes per column. */
            for (; b < nb; b++)
                memcpy(pd[a] + (j0 + b) * dj, ps[a] + (j0 + b) * sj, 16);
        }
        for (; b < nb; b++)
            for (int i = 0; i < v; i++)
                memcpy(pd[a + i] + (j0 + b) * dj, ps[a + i] + (j0 + b) * sj, run);
    }
rest:
#endif
    for (; a < m; a++)
        for (int b = 0; b < nb; b++)
            memcpy(pd[a] + (j0 + b) * dj, ps[a] + (j0 + b) * sj, run);
}

/* Runs of other sizes, one at a time. */
static void tile_any(const uint8_t *const *ps, uint8_t *const *pd, int m, int64_t j0, int nb,
                     int64_t sj, int64_t dj, size_t run)
{
    for (int a = 0; a < m; a++)
        for (int b = 0; b < nb; b++)
            memcpy(pd[a] + (j0 + b) * dj, ps[a] + (j0 + b) * sj, run);
}

/* Asks for the cache lines of the tile at columns [j0, j0 + nb) of rows ps/pd: a tile's lines
 * lie far apart (a line per column or per row), which the hardware's prefetchers do not
 * follow, so without this each line is a miss the copy waits for. */
static void prefetch_tile(const uint8_t *const *ps, uint8_t *const *pd, int m, int64_t j0,
                          int nb, int64_t sj, int64_t dj, size_t run)
{
    int as = m > 1 && ps[1] == ps[0] + run ? (int)(64 / run) : 1;
    int ad = m > 1 && pd[1] == pd[0] + run ? (int)(64 / run) : 1;
    int bs = sj < 64 ? (int)(64 / sj) : 1, bd = dj < 64 ? (int)(64 / dj) : 1;

    for (int a = 0; a < m; a += as)
        for (int b = 0; b < nb; b += bs)
            __builtin_prefetch(ps[a] + (j0 + b) * sj, 0, 3);
    for (int a = 0; a < m; a += ad)
        for (int b = 0; b < nb; b += bd)
            __builtin_prefetch(pd[a] + (j0 + b) * dj, 1, 3);
}

/* One tile, the run size a constant in each call of tile(). */
static inline void tile_run(const uint8_t *const *ps, uint8_t *const *pd, int m, int64_t j0,
                            int nb, int64_t sj, int64_t dj, size_t run)
{
    switch (run) {
    case 1:
        tile(ps, pd, m, j0, nb, sj, dj, 1);
        break;
    case 2:
        tile(ps, pd, m, j0, nb, sj, dj, 2);
        break;
    case 4:
        tile(ps, pd, m, j0, nb, sj, dj, 4);
        break;
    case 8:
        tile(ps, pd, m, j0, nb, sj, dj, 8);
        break;
    case 16:
        tile(ps, pd, m, j0, nb, sj, dj, 16);
        break;
    default:
        tile_any(ps, pd, m, j0, nb, sj, dj, run);
        break;
    }
}

/* The columns of m rows (at most BATCH), a tile at a time: column tiles outer, rows inner, the
 * next tile's lines asked for while one is copied. */
static void tile_rows_batch(const uint8_t *const *ps, uint8_t *const *pd, int m, int64_t J,
                            int64_t sj, int64_t dj, size_t run)
{
    const int te = tile_edge(run);

    for (int64_t j0 = 0; j0 < J; j0 += te) {
        int nb = J - j0 < te ? (int)(J - j0) : te;

        for (int a0 = 0; a0 < m; a0 += te) {
            int ma = m - a0 < te ? m - a0 : te;

            if (a0 + te < m)
                prefetch_tile(ps + a0 + te, pd + a0 + te, m - a0 - te < te ? m - a0 - te : te,
                              j0, nb, sj, dj, run);
            else if (j0 + te < J)
                prefetch_tile(ps, pd, m < te ? m : te, j0 + te,
                              J - j0 - te < te ? (int)(J - j0 - te) : te, sj, dj, run);
            tile_run(ps + a0, pd + a0, ma, j0, nb, sj, dj, run);
        }
    }
}

/* Copies whole rows [r0, r1) of f through tiles: a row is the innermost dim's runs, rows are
 * numbered in row-major order over the outer dims; BATCH rows at a time. Destination offsets
 * are less dbias (a packing buffer that holds the range from its first byte). */
static void tile_rows(const rf_copy_pair_flat *f, int64_t dbias, uint64_t r0, uint64_t r1)
{
    const int n = f->n;
    const uint8_t *ps[BATCH];
    uint8_t *pd[BATCH];
    int64_t idx[RF_MAX_DIMS], so = 0, dof = -dbias;
    uint64_t r = r0;

    assert(n >= 2 && f->sstr[n - 1] > 0 && f->dstr[n - 1] > 0);
    for (int k = n - 2; k >= 0; k--) {
        idx[k] = (int64_t)(r % (uint64_t)f->ext[k]);
        r /= (uint64_t)f->ext[k];
        so += idx[k] * f->sstr[k];
        dof += idx[k] * f->dstr[k];
    }
    for (r = r0; r < r1;) {
        int m = r1 - r < BATCH ? (int)(r1 - r) : BATCH;

        for (int a = 0; a < m; a++) {
            ps[a] = f->src + so;
            pd[a] = f->dst + dof;
            for (int k = n - 2; k >= 0; k--) {
                if (++idx[k] < f->ext[k]) {
                    so += f->sstr[k];
                    dof += f->dstr[k];
                    break;
                }
                so -= (f->ext[k] - 1) * f->sstr[k];
                dof -= (f->ext[k] - 1) * f->dstr[k];
                idx[k] = 0;
            }
        }
        tile_rows_batch(ps, pd, m, f->ext[n - 1], f->sstr[n - 1], f->dstr[n - 1], f->run);
        r += (uint64_t)m;
    }
}

/* A gather or scatter as a pair between piece memory and its dense row-major staging, when
 * it goes through tiles (a transposed piece): true and g set. */
static bool staging_pair(const rf_copy_desc *d, const flat *f, uint8_t *st, bool to_staging,
                         rf_copy_pair_flat *g)
{
    int64_t mstr[RF_MAX_DIMS], pstr[RF_MAX_DIMS];
    int n = f->n + (f->inner_str != 0);

    if (n < 2 || f->run > TILE_RUN_MAX)
        return false;
    memset(g, 0, sizeof(*g));
    memcpy(g->ext, f->ext, sizeof(f->ext[0]) * (size_t)f->n);
    memcpy(mstr, f->str, sizeof(f->str[0]) * (size_t)f->n);
    if (f->inner_str != 0) {
        g->ext[n - 1] = f->inner_ext;
        mstr[n - 1] = f->inner_str;
    }
    for (int k = n - 1; k >= 0; k--)
        pstr[k] = k == n - 1 ? (int64_t)f->run : pstr[k + 1] * g->ext[k + 1];
    for (int k = n; k < RF_MAX_DIMS; k++)
        g->ext[k] = 1;
    g->n = n;
    g->run = f->run;
    g->bytes = rf_copy_desc_bytes(d);
    if (to_staging) {
        g->src = d->base + f->first;
        g->dst = st;
        memcpy(g->sstr, mstr, sizeof(mstr[0]) * (size_t)n);
        memcpy(g->dstr, pstr, sizeof(pstr[0]) * (size_t)n);
    } else {
        g->src = st;
        g->dst = d->base + f->first;
        memcpy(g->sstr, pstr, sizeof(pstr[0]) * (size_t)n);
        memcpy(g->dstr, mstr, sizeof(mstr[0]) * (size_t)n);
    }
    return tiled(g);
}

/* Bytes [lo, hi) of f's packing copied, destination offsets less dbias: the whole rows through
 * tiles when f takes them, the parts of rows at either end and every other flat run by run. */
static void range_copy(const rf_copy_pair_flat *f, int64_t dbias, uint64_t lo, uint64_t hi)
{
    uint64_t row, a, b;

    if (hi > f->bytes)
        hi = f->bytes;
    if (lo >= hi)
        return;
    if (!tiled(f)) {
        pair_walk(f, dbias, lo, hi, copy_fn, NULL);
        return;
    }
    row = (uint64_t)f->ext[f->n - 1] * f->run;
    a = (lo + row - 1) / row;
    b = hi / row;
    if (a >= b) {
        pair_walk(f, dbias, lo, hi, copy_fn, NULL);
        return;
    }
    pair_walk(f, dbias, lo, a * row, copy_fn, NULL);
    tile_rows(f, dbias, a, b);
    pair_walk(f, dbias, b * row, hi, copy_fn, NULL);
}

void rf_copy_pair_range(const rf_copy_pair_flat *f, uint64_t lo, uint64_t hi)
{
    range_copy(f, 0, lo, hi);
}

/* Drops dim k of g, whose extent the dim outside it has taken. */
static void drop_dim(rf_copy_pair_flat *g, int n, int k)
{
    memmove(&g->ext[k], &g->ext[k + 1], (size_t)(n - k - 1) * sizeof(g->ext[0]));
    memmove(&g->sstr[k], &g->sstr[k + 1], (size_t)(n - k - 1) * sizeof(g->sstr[0]));
    memmove(&g->dstr[k], &g->dstr[k + 1], (size_t)(n - k - 1) * sizeof(g->dstr[0]));
}

/* One side of f as the source of a flat whose destination is the side's packing (strides of
 * a dense row-major box, dst left to the caller): dims merged where this side alone holds them
 * back to back, so the contiguous side of a transpose is visited in long runs. */
static void side_flat(const rf_copy_pair_flat *f, bool dst_side, rf_copy_pair_flat *g)
{
    int n = f->n;

    memset(g, 0, sizeof(*g));
    g->src = dst_side ? f->dst : f->src;
    g->run = f->run;
    g->bytes = f->bytes;
    memcpy(g->ext, f->ext, sizeof(g->ext));
    memcpy(g->sstr, dst_side ? f->dstr : f->sstr, sizeof(g->sstr));
    for (int k = n - 1; k > 0; k--) {
        if (g->sstr[k - 1] == g->sstr[k] * g->ext[k]) {
            g->ext[k - 1] *= g->ext[k];
            g->sstr[k - 1] = g->sstr[k];
            drop_dim(g, n, k);
            n--;
        }
    }
    while (n > 0 && g->sstr[n - 1] == (int64_t)g->run) {
        g->run *= (uint64_t)g->ext[n - 1];
        n--;
    }
    g->n = n;
    for (int k = n - 1; k >= 0; k--)
        g->dstr[k] = k == n - 1 ? (int64_t)g->run : g->dstr[k + 1] * g->ext[k + 1];
    for (int k = n; k < RF_MAX_DIMS; k++) {
        g->ext[k] = 1;
        g->sstr[k] = g->dstr[k] = 0;
    }
}

typedef struct visit_ctx {
    void (*fn)(void *ctx, const uint8_t *p, uint64_t n);
    void *ctx;
} visit_ctx;

static void visit_fn(void *ctx, const uint8_t *s, uint8_t *d, uint64_t n)
{
    visit_ctx *v = ctx;

    (void)d;
    v->fn(v->ctx, s, n);
}

/* Bytes [lo, hi) of side flat g (side_flat) handed to fn: as they lie when g's runs are long,
 * else packed through tiles into buf (cap bytes), whole rows at a time where buf holds one. */
static void visit_side(rf_copy_pair_flat *g, uint64_t lo, uint64_t hi,
                       void (*fn)(void *ctx, const uint8_t *p, uint64_t n), void *ctx,
                       uint8_t *buf, uint64_t cap)
{
    uint64_t row, e;

    if (hi > g->bytes)
        hi = g->bytes;
    if (!tiled(g) || cap == 0) {
        /* The walk reads the side on both of its sides. */
        visit_ctx v = {fn, ctx};

        g->dst = (uint8_t *)(uintptr_t)g->src;
        memcpy(g->dstr, g->sstr, sizeof(g->dstr));
        pair_walk(g, 0, lo, hi, visit_fn, &v);
        return;
    }
    g->dst = buf;
    row = (uint64_t)g->ext[g->n - 1] * g->run;
    for (; lo < hi; lo = e) {
        e = row <= cap ? (lo + cap) / row * row : lo + cap;
        if (e > hi)
            e = hi;
        range_copy(g, (int64_t)lo, lo, e);
        fn(ctx, buf, e - lo);
    }
}

void rf_copy__pair_visit_buf(const rf_copy_pair_flat *f, bool dst_side, uint64_t lo, uint64_t hi,
                             void (*fn)(void *ctx, const uint8_t *p, uint64_t n), void *ctx,
                             uint8_t *buf, uint64_t cap)
{
    rf_copy_pair_flat g;

    side_flat(f, dst_side, &g);
    visit_side(&g, lo, hi, fn, ctx, buf, cap);
}

void rf_copy_pair_visit(const rf_copy_pair_flat *f, bool dst_side, uint64_t lo, uint64_t hi,
                        void (*fn)(void *ctx, const uint8_t *p, uint64_t n), void *ctx)
{
    uint8_t small[VISIT_STACK], *heap = NULL;
    uint64_t cap = sizeof(small);
    rf_copy_pair_flat g;

    side_flat(f, dst_side, &g);
    if (hi > g.bytes)
        hi = g.bytes;
    if (lo < hi && hi - lo > cap && tiled(&g)) {
        cap = hi - lo < VISIT_BUF ? hi - lo : VISIT_BUF;
        heap = malloc(cap);
        if (!heap)
            cap = sizeof(small);
    }
    visit_side(&g, lo, hi, fn, ctx, heap ? heap : small, cap);
    free(heap);
}

int rf_copy_pairs(const rf_copy_pair *p, size_t n, rf_err *err)
{
    rf_copy_pair_flat f;
    int rc;

    for (size_t i = 0; i < n; i++)
        if ((rc = rf_copy_pair_check(&p[i], i, err)) != 0)
            return rc;
    for (size_t i = 0; i < n; i++) {
        rf_copy_pair_flatten(&p[i], &f);
        rf_copy_pair_range(&f, 0, f.bytes);
    }
    return 0;
}

int rf_copy_box_span(const rf_box *b, int ndim, uint64_t lo, uint64_t hi, rf_box *out)
{
    uint64_t inner[RF_MAX_DIMS], numel = 1;
    int n = 0;

    for (int k = ndim - 1; k >= 0; k--) {
        inner[k] = numel;
        numel *= (uint64_t)b->extent[k];
    }
    if (hi > numel)
        hi = numel;
    while (lo < hi) {
        /* The outermost dim at whose step lo lies, and that still fits before hi. */
        for (int k = 0; k < ndim; k++) {
            uint64_t dig = (lo / inner[k]) % (uint64_t)b->extent[k], cnt;

            if (lo % inner[k] != 0)
                continue;
            cnt = (hi - lo) / inner[k];
            if (cnt > (uint64_t)b->extent[k] - dig)
                cnt = (uint64_t)b->extent[k] - dig;
            if (cnt == 0)
                continue;
            out[n] = *b;
            for (int j = 0; j < k; j++) {
                out[n].start[j] = b->start[j] + (int64_t)((lo / inner[j]) % (uint64_t)b->extent[j]);
                out[n].extent[j] = 1;
            }
            out[n].start[k] = b->start[k] + (int64_t)dig;
            out[n].extent[k] = (int64_t)cnt;
            n++;
            lo += cnt * inner[k];
            break;
        }
    }
    return n;
}
