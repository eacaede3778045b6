/* common/copy.c - host implementation of batched box gather/scatter and the in-process plan
 * executor used as the reference in tests. */
#include "copy.h"

#include <stdlib.h>
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

static int base_of(const rf_inv *inv, void *const *bases, rf_side side, uint32_t piece,
                   uint8_t **out, rf_err *err)
{
    uint32_t r = rf_inv_piece_region(inv, side, piece);

    if (bases == NULL || bases[r] == NULL)
        return rf_err_set(err, -EINVAL, "copy: no base pointer for %s region %u (piece %u of "
                          "tensor %s); pass one for every region the plan uses",
                          side == RF_SRC ? "source" : "destination", r, piece,
                          rf_inv_tensor(inv, rf_inv_piece_tensor(inv, side, piece))->name);
    *out = bases[r];
    return 0;
}

/* A direct message: one transfer, one byte range on each side. */
static int exec_direct(const rf_plan *plan, const rf_msg *m, void *const *src_bases,
                       void *const *dst_bases, rf_err *err)
{
    const rf_inv *inv = rf_plan_inv(plan);
    const rf_xfer *x = rf_plan_xfer(plan, m->first);
    const rf_box *box = rf_plan_box(plan, x->box);
    rf_piece sp, dp;
    const rf_tensor *t;
    uint8_t *sb = NULL, *db = NULL;
    uint64_t so, doff;
    size_t es;
    int rc;

    rf_inv_piece(inv, RF_SRC, x->src, &sp);
    rf_inv_piece(inv, RF_DST, x->dst, &dp);
    t = rf_inv_tensor(inv, sp.tensor);
    es = rf_dtype_size(t->dtype);
    if ((rc = base_of(inv, src_bases, RF_SRC, x->src, &sb, err)) != 0 ||
        (rc = base_of(inv, dst_bases, RF_DST, x->dst, &db, err)) != 0)
        return rc;
    if (!rf_box_contains(&sp.box, box, t->ndim) || !rf_box_contains(&dp.box, box, t->ndim) ||
        !rf_piece_contiguous(&sp, t->ndim, es, box, &so) ||
        !rf_piece_contiguous(&dp, t->ndim, es, box, &doff)) {
        char bs[256];
        rf_box_format(box, t->ndim, bs, sizeof(bs));
        return rf_err_set(err, -EINVAL, "copy: direct transfer of %s %s is not one byte range "
                          "inside both pieces; the plan does not match the inventory",
                          t->name, bs);
    }
    memcpy(db + doff, sb + so, x->bytes);
    return 0;
}

int rf_copy_exec_plan_host(const rf_plan *plan, void *const *src_bases, void *const *dst_bases,
                           rf_err *err)
{
    const rf_inv *inv = rf_plan_inv(plan);
    rf_copy_desc *gd = NULL, *sd = NULL;
    uint8_t *stage = NULL;
    uint64_t capd = 0, caps = 0;
    int rc = 0;

    for (uint32_t mi = 0; mi < rf_plan_nmsgs(plan); mi++) {
        const rf_msg *m = rf_plan_msg(plan, mi);
        if (m->count > capd) {
            free(gd);
            free(sd);
            capd = m->count;
            gd = malloc(capd * sizeof(*gd));
            sd = malloc(capd * sizeof(*sd));
            if (gd == NULL || sd == NULL) {
                rc = rf_err_set(err, -ENOMEM, "copy: out of memory for %u descriptors", m->count);
                goto out;
            }
        }
        if (m->kind == RF_XFER_DIRECT) {
            rc = exec_direct(plan, m, src_bases, dst_bases, err);
            if (rc)
                goto out;
            continue;
        }
        if (m->bytes > caps) {
            free(stage);
            caps = m->bytes;
            stage = malloc(caps);
            if (stage == NULL) {
                rc = rf_err_set(err, -ENOMEM, "copy: out of memory for %llu bytes of staging",
                                (unsigned long long)caps);
                goto out;
            }
        }
        for (uint32_t k = 0; k < m->count; k++) {
            const rf_xfer *x = rf_plan_xfer(plan, (uint64_t)m->first + k);
            rf_piece sp, dp;
            const rf_tensor *t;
            uint8_t *sb = NULL, *db = NULL;
            rf_inv_piece(inv, RF_SRC, x->src, &sp);
            rf_inv_piece(inv, RF_DST, x->dst, &dp);
            t = rf_inv_tensor(inv, sp.tensor);
            if ((rc = base_of(inv, src_bases, RF_SRC, x->src, &sb, err)) != 0 ||
                (rc = base_of(inv, dst_bases, RF_DST, x->dst, &db, err)) != 0)
                goto out;
            rf_copy_desc_set(&gd[k], sb, &sp, t->ndim, rf_dtype_size(t->dtype),
                             rf_plan_box(plan, x->box), x->msg_off);
            rf_copy_desc_set(&sd[k], db, &dp, t->ndim, rf_dtype_size(t->dtype),
                             rf_plan_box(plan, x->box), x->msg_off);
        }
        if ((rc = rf_copy_gather(gd, m->count, stage, err)) != 0 ||
            (rc = rf_copy_scatter(sd, m->count, stage, err)) != 0) {
            rf_err_wrap(err, "message %u: ", mi);
            goto out;
        }
    }
out:
    free(gd);
    free(sd);
    free(stage);
    return rc;
}
