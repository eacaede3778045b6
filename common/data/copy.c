/* common/data/copy.c - host implementation of batched box gather/scatter and of pair copies
 * between two strided pieces, with the semantics the CUDA kernels share. */
#include "copy.h"

#include <string.h>

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

void rf_copy_run(const rf_copy_desc *d, void *staging, bool to_staging)
{
    flat f;
    int64_t idx[RF_MAX_DIMS] = {0};
    uint8_t *s = (uint8_t *)staging + d->staging_off;

    rf_copy_flatten(d, &f);
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

/* Walks runs of bytes [lo, hi) of the packing: fn gets both sides' pointers of each piece. */
static void pair_walk(const rf_copy_pair_flat *f, uint64_t lo, uint64_t hi,
                      void (*fn)(void *ctx, const uint8_t *s, uint8_t *d, uint64_t n), void *ctx)
{
    int64_t idx[RF_MAX_DIMS];
    uint64_t r, off, pos = lo;
    const uint8_t *s;
    uint8_t *d;
    int k;

    if (hi > f->bytes)
        hi = f->bytes;
    if (lo >= hi)
        return;
    r = lo / f->run;
    off = lo - r * f->run;
    s = f->src + off;
    d = f->dst + off;
    for (k = f->n - 1; k >= 0; k--) {
        idx[k] = (int64_t)(r % (uint64_t)f->ext[k]);
        r /= (uint64_t)f->ext[k];
        s += idx[k] * f->sstr[k];
        d += idx[k] * f->dstr[k];
    }
    for (;;) {
        uint64_t len = f->run - off < hi - pos ? f->run - off : hi - pos;

        fn(ctx, s, d, len);
        pos += len;
        if (pos >= hi)
            return;
        s -= off;
        d -= off;
        off = 0;
        for (k = f->n - 1; k >= 0; k--) {
            if (++idx[k] < f->ext[k]) {
                s += f->sstr[k];
                d += f->dstr[k];
                break;
            }
            s -= (f->ext[k] - 1) * f->sstr[k];
            d -= (f->ext[k] - 1) * f->dstr[k];
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

void rf_copy_pair_range(const rf_copy_pair_flat *f, uint64_t lo, uint64_t hi)
{
    pair_walk(f, lo, hi, copy_fn, NULL);
}

typedef struct visit_ctx {
    bool dst_side;
    void (*fn)(void *ctx, const uint8_t *p, uint64_t n);
    void *ctx;
} visit_ctx;

static void visit_fn(void *ctx, const uint8_t *s, uint8_t *d, uint64_t n)
{
    visit_ctx *v = ctx;

    v->fn(v->ctx, v->dst_side ? d : s, n);
}

void rf_copy_pair_visit(const rf_copy_pair_flat *f, bool dst_side, uint64_t lo, uint64_t hi,
                        void (*fn)(void *ctx, const uint8_t *p, uint64_t n), void *ctx)
{
    visit_ctx v = {dst_side, fn, ctx};

    pair_walk(f, lo, hi, visit_fn, &v);
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
