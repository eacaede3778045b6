/* tests/unit/member_inv.c - see member_inv.h. */
#include "member_inv.h"

#include <criterion/criterion.h>

typedef struct sink_ctx {
    rf_inv *inv;
    uint32_t ep;
    uint32_t region_base; /* the inventory's region id of the rank's region 0 */
} sink_ctx;

static int sink_region(void *ctx, uint32_t local, uint64_t size)
{
    sink_ctx *s = ctx;
    rf_err err = {0};
    uint32_t id;

    cr_assert_eq(rf_inv_add_region(s->inv, s->ep, size, &id, &err), 0, "%s", err.msg);
    cr_assert_eq(id, s->region_base + local);
    return 0;
}

static int sink_piece(void *ctx, const rf_piece *p)
{
    sink_ctx *s = ctx;
    rf_piece q = *p;
    rf_err err = {0};

    q.region = s->region_base + p->region;
    cr_assert_eq(rf_inv_add_piece(s->inv, &q, NULL, &err), 0, "%s", err.msg);
    return 0;
}

rf_inv *test_member_inv(const rf_model *model, const char *layout, rf_side side, int first,
                        int n)
{
    rf_inv *inv = rf_inv_new();
    rf_err err = {0};
    rf_par par;

    cr_assert_not_null(inv);
    cr_assert_eq(rf_par_parse(layout, side, model, &par, &err), 0, "%s", err.msg);
    for (uint32_t t = 0; t < rf_model_ntensors(model); t++) {
        const rf_tensor *d = rf_model_tensor(model, t);
        uint32_t id;

        cr_assert_eq(rf_inv_add_tensor(inv, d->name, d->dtype, d->ndim, d->shape, &id, &err),
                     0, "%s", err.msg);
        cr_assert_eq(id, t);
    }
    for (int r = first; r < first + n; r++) {
        sink_ctx s = {inv, 0, rf_inv_nregions(inv)};
        rf_rank_sink sink = {&s, sink_region, sink_piece};

        cr_assert_eq(rf_inv_add_endpoint(inv, side, 0, &s.ep, &err), 0, "%s", err.msg);
        cr_assert_eq(rf_model_rank(model, &par, side, r, &sink, &err), 0, "%s", err.msg);
    }
    return inv;
}
