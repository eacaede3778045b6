/* tests/unit/copy_ref.c - the reference executor the tests check plans and transports
 * against: a whole plan copied inside one process with the host gather/scatter. Test-only, so
 * it lives with the tests and stays out of librfcommon and librefit. */
#include "copy_ref.h"

#include <stdlib.h>
#include <string.h>

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
static int exec_direct(const rf_plan *plan, const rf_plan_msg *m, void *const *src_bases,
                       void *const *dst_bases, rf_err *err)
{
    const rf_inv *inv = rf_plan_inv(plan);
    const rf_plan_xfer *x = rf_plan_xfer_at(plan, m->first);
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
        const rf_plan_msg *m = rf_plan_msg_at(plan, mi);
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
        if (m->kind == RF_PLAN_DIRECT) {
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
            const rf_plan_xfer *x = rf_plan_xfer_at(plan, (uint64_t)m->first + k);
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
