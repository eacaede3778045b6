/* common/data/copy.c - host implementation of batched box gather/scatter, with the semantics the
 * CUDA kernels share. */
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
