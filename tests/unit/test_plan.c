/* tests/unit/test_plan.c - the planner on random and real layouts, executed in host memory and
 * checked byte for byte; determinism, replica dedup, fail-closed coverage, and refitctl plan. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "copy.h"
#include "copy_ref.h"
#include "layout.h"
#include "model.h"
#include "plan.h"

/* ---- a cluster in host memory ------------------------------------------------------------ */

typedef struct hpiece {
    uint32_t tensor, ep;
    rf_box box;
    int64_t strides[RF_MAX_DIMS];
    uint64_t foot; /* bytes spanned */
    uint64_t offset;
    uint32_t region;
} hpiece;

typedef struct cluster {
    rf_inv *inv;
    uint8_t **bases; /* per global region */
    uint32_t nregions;
} cluster;

static uint64_t rng_state;

static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static int64_t rndi(int64_t lo, int64_t hi) /* inclusive */
{
    return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1));
}

static uint8_t pattern(uint32_t tensor, uint64_t lin, int byte)
{
    uint64_t x = (lin + 1) * 0x9e3779b97f4a7c15ull ^ ((uint64_t)tensor << 40);
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 32;
    return (uint8_t)(x >> (8 * byte));
}

static uint64_t linear(const rf_tensor *t, const int64_t *idx)
{
    uint64_t l = 0;

    for (int d = 0; d < t->ndim; d++)
        l = l * (uint64_t)t->shape[d] + (uint64_t)idx[d];
    return l;
}

/* Strides for a box: row-major, transposed (a random dim order) and/or padded. */
static uint64_t make_strides(int ndim, const rf_box *b, int mode, int64_t *strides)
{
    int order[RF_MAX_DIMS];
    int64_t acc = 1, foot = 0;

    for (int d = 0; d < ndim; d++)
        order[d] = d;
    if (mode & 1) {
        for (int d = ndim - 1; d > 0; d--) {
            int j = (int)rndi(0, d), tmp = order[d];
            order[d] = order[j];
            order[j] = tmp;
        }
    }
    for (int d = 0; d < RF_MAX_DIMS; d++)
        strides[d] = d < ndim ? 0 : 1;
    for (int k = ndim - 1; k >= 0; k--) {
        int d = order[k];
        strides[d] = acc;
        acc *= b->extent[d] + ((mode & 2) ? rndi(0, 2) : 0);
    }
    for (int d = 0; d < ndim; d++)
        foot += (b->extent[d] - 1) * strides[d];
    return (uint64_t)foot + 1;
}

static void add_hpiece(hpiece **ps, size_t *n, uint32_t tensor, uint32_t ep, int ndim,
                       const rf_box *box, int mode, size_t esize)
{
    hpiece *p;

    *ps = realloc(*ps, (*n + 1) * sizeof(**ps));
    cr_assert_not_null(*ps);
    p = &(*ps)[(*n)++];
    memset(p, 0, sizeof(*p));
    p->tensor = tensor;
    p->ep = ep;
    p->box = *box;
    for (int d = ndim; d < RF_MAX_DIMS; d++) {
        p->box.start[d] = 0;
        p->box.extent[d] = 1;
    }
    p->foot = make_strides(ndim, &p->box, mode, p->strides) * esize;
}

/* Places the pieces of one side into regions (two per endpoint, pieces alternating, each at
 * a 16-byte aligned offset) and adds regions and pieces to the inventory. */
static void place(cluster *c, hpiece *ps, size_t n, const uint32_t *eps, uint32_t nep,
                  rf_side side)
{
    uint64_t *used = calloc((size_t)nep * 2, sizeof(uint64_t));
    uint32_t *rid = calloc((size_t)nep * 2, sizeof(uint32_t));
    rf_err err;

    cr_assert_not_null(used);
    for (size_t i = 0; i < n; i++) {
        uint32_t slot = ps[i].ep * 2 + (uint32_t)(i & 1);
        ps[i].offset = (used[slot] + 15) & ~15ull;
        used[slot] = ps[i].offset + ps[i].foot;
        ps[i].region = slot;
    }
    for (uint32_t s = 0; s < nep * 2; s++) {
        cr_assert_eq(rf_inv_add_region(c->inv, eps[s / 2], used[s] + 1, &rid[s], &err), 0,
                     "%s", err.msg);
        c->bases = realloc(c->bases, (rid[s] + 1) * sizeof(*c->bases));
        c->bases[rid[s]] = calloc(used[s] + 1, 1);
        c->nregions = rid[s] + 1;
    }
    for (size_t i = 0; i < n; i++) {
        rf_piece p;
        memset(&p, 0, sizeof(p));
        p.tensor = ps[i].tensor;
        p.region = rid[ps[i].region];
        p.offset = ps[i].offset;
        p.box = ps[i].box;
        memcpy(p.strides, ps[i].strides, sizeof(p.strides));
        cr_assert_eq(rf_inv_add_piece(c->inv, &p, NULL, &err), 0, "%s", err.msg);
    }
    (void)side;
    free(used);
    free(rid);
}

/* Calls fn for every element index of box. */
#define FOR_EACH_INDEX(box, ndim, idx)                                                         \
    for (int64_t idx[RF_MAX_DIMS], _go = (memcpy(idx, (box)->start, sizeof(idx)), 1); _go;    \
         _go = next_index(box, ndim, idx))

static int next_index(const rf_box *b, int ndim, int64_t *idx)
{
    for (int d = ndim - 1; d >= 0; d--) {
        if (++idx[d] < b->start[d] + b->extent[d])
            return 1;
        idx[d] = b->start[d];
    }
    return 0;
}

static void fill_sources(cluster *c)
{
    rf_piece p;

    for (uint32_t i = 0; i < rf_inv_npieces(c->inv, RF_SRC); i++) {
        rf_inv_piece(c->inv, RF_SRC, i, &p);
        const rf_tensor *t = rf_inv_tensor(c->inv, p.tensor);
        size_t es = rf_dtype_size(t->dtype);
        FOR_EACH_INDEX(&p.box, t->ndim, idx) {
            uint8_t *m = c->bases[p.region] + rf_piece_byte_offset(&p, t->ndim, es, idx);
            uint64_t l = linear(t, idx);
            for (size_t b = 0; b < es; b++)
                m[b] = pattern(p.tensor, l, (int)b);
        }
    }
}

/* Every destination byte holds the pattern of its tensor and index. */
static void check_destinations(cluster *c)
{
    rf_piece p;
    uint64_t bad = 0;

    for (uint32_t i = 0; i < rf_inv_npieces(c->inv, RF_DST); i++) {
        rf_inv_piece(c->inv, RF_DST, i, &p);
        const rf_tensor *t = rf_inv_tensor(c->inv, p.tensor);
        size_t es = rf_dtype_size(t->dtype);
        FOR_EACH_INDEX(&p.box, t->ndim, idx) {
            const uint8_t *m = c->bases[p.region] + rf_piece_byte_offset(&p, t->ndim, es, idx);
            uint64_t l = linear(t, idx);
            for (size_t b = 0; b < es; b++)
                bad += m[b] != pattern(p.tensor, l, (int)b);
        }
    }
    cr_assert_eq(bad, 0, "%llu destination bytes wrong", (unsigned long long)bad);
}

/* Structure of the plan: each destination element written by exactly one transfer, every
 * box inside both pieces, messages and rounds well formed; a message is local exactly when
 * its endpoints share a host, and then lies in round 0 within half the budget (or is one
 * transfer). A relay message goes between destination endpoints, never local, and its
 * transfers read destination pieces of the same tensor. */
static void check_plan(const rf_plan *pl, const rf_plan_opts *o)
{
    const rf_inv *inv = rf_plan_inv(pl);
    uint32_t nd = rf_inv_npieces(inv, RF_DST), ne = rf_inv_nendpoints(inv);
    uint8_t **cnt = calloc(nd + 1, sizeof(*cnt));
    uint64_t *sent = calloc(ne + 1, sizeof(uint64_t)), *recv = calloc(ne + 1, sizeof(uint64_t));
    uint64_t *path = calloc(3 * (size_t)ne + 1, sizeof(uint64_t));
    uint64_t next = 0;
    rf_piece sp, dp;

    for (uint32_t i = 0; i < nd; i++) {
        rf_inv_piece(inv, RF_DST, i, &dp);
        cnt[i] = calloc((size_t)rf_box_numel(&dp.box, rf_inv_tensor(inv, dp.tensor)->ndim), 1);
    }
    for (uint32_t mi = 0; mi < rf_plan_nmsgs(pl); mi++) {
        const rf_plan_msg *m = rf_plan_msg_at(pl, mi);
        uint64_t off = 0;
        if (mi > 0) {
            const rf_plan_msg *q = rf_plan_msg_at(pl, mi - 1);
            cr_assert(q->round < m->round || (q->round == m->round &&
                      (q->src_ep < m->src_ep || (q->src_ep == m->src_ep && q->dst_ep <= m->dst_ep))),
                      "messages out of order at %u", mi);
        }
        uint32_t sh = rf_inv_endpoint(inv, m->src_ep)->host;
        rf_side sside = m->relay ? RF_DST : RF_SRC;
        cr_assert_eq(m->first, next);
        cr_assert(m->count >= 1);
        cr_assert(m->round < rf_plan_nrounds(pl));
        cr_assert_eq(m->pad_, 0);
        cr_assert_eq(rf_inv_endpoint(inv, m->src_ep)->side, sside, "message %u", mi);
        cr_assert(m->relay <= rf_plan_stats_get(pl)->relay_depth);
        next += m->count;
        cr_assert_eq(m->kind == RF_PLAN_LOCAL,
                     !m->relay && sh != RF_HOST_NONE &&
                     sh == rf_inv_endpoint(inv, m->dst_ep)->host,
                     "message %u of kind %u between endpoints %u and %u", mi, m->kind,
                     m->src_ep, m->dst_ep);
        if (m->kind == RF_PLAN_DIRECT)
            cr_assert_eq(m->count, 1);
        else if (m->kind == RF_PLAN_PACKED)
            cr_assert(m->bytes <= o->staging_bytes / 2, "packed message of %llu bytes",
                      (unsigned long long)m->bytes);
        else
            cr_assert(m->round == 0 && (m->bytes <= o->staging_bytes / 2 || m->count == 1),
                      "local message %u: %llu bytes in %u transfers, round %u", mi,
                      (unsigned long long)m->bytes, m->count, m->round);
        for (uint32_t k = 0; k < m->count; k++) {
            const rf_plan_xfer *x = rf_plan_xfer_at(pl, m->first + k);
            const rf_box *b = rf_plan_box(pl, x->box);
            rf_inv_piece(inv, sside, x->src, &sp);
            rf_inv_piece(inv, RF_DST, x->dst, &dp);
            const rf_tensor *t = rf_inv_tensor(inv, dp.tensor);
            cr_assert_eq(sp.tensor, dp.tensor);
            cr_assert_eq(x->msg, mi);
            cr_assert_eq(rf_inv_piece_endpoint(inv, sside, x->src), m->src_ep);
            cr_assert_eq(rf_inv_piece_endpoint(inv, RF_DST, x->dst), m->dst_ep);
            cr_assert(rf_box_contains(&sp.box, b, t->ndim), "source read outside its piece");
            cr_assert(rf_box_contains(&dp.box, b, t->ndim), "write outside its piece");
            cr_assert_eq(x->bytes, (uint64_t)rf_box_numel(b, t->ndim) * rf_dtype_size(t->dtype));
            if (m->kind != RF_PLAN_DIRECT)
                cr_assert_eq(x->msg_off, off);
            off += x->bytes;
            sent[m->src_ep] += x->bytes;
            recv[m->dst_ep] += x->bytes;
            if (!m->relay) /* a destination's path bytes are what it receives */
                path[(size_t)m->kind * ne + m->src_ep] += x->bytes;
            path[(size_t)m->kind * ne + m->dst_ep] += x->bytes;
            FOR_EACH_INDEX(b, t->ndim, idx) {
                uint64_t l = 0;
                for (int d = 0; d < t->ndim; d++)
                    l = l * (uint64_t)dp.box.extent[d] + (uint64_t)(idx[d] - dp.box.start[d]);
                cr_assert_eq(cnt[x->dst][l]++, 0, "destination element written twice");
            }
        }
        cr_assert_eq(off, m->bytes);
    }
    cr_assert_eq(next, rf_plan_nxfers(pl));
    for (uint32_t i = 0; i < nd; i++) {
        rf_inv_piece(inv, RF_DST, i, &dp);
        int64_t n = rf_box_numel(&dp.box, rf_inv_tensor(inv, dp.tensor)->ndim);
        for (int64_t j = 0; j < n; j++)
            cr_assert_eq(cnt[i][j], 1, "destination piece %u element %lld written %d times", i,
                         (long long)j, cnt[i][j]);
        free(cnt[i]);
    }
    for (uint32_t e = 0; e < ne; e++) {
        cr_assert_eq(sent[e], rf_plan_sent_bytes(pl, e));
        cr_assert_eq(recv[e], rf_plan_recv_bytes(pl, e));
        for (uint32_t k = RF_PLAN_DIRECT; k <= RF_PLAN_LOCAL; k++)
            cr_assert_eq(path[(size_t)k * ne + e], rf_plan_path_bytes(pl, e, k),
                         "endpoint %u path %u", e, k);
    }
    /* Staging per endpoint and round stays within half the budget. */
    {
        uint32_t R = rf_plan_nrounds(pl);
        uint64_t *use = calloc((size_t)R * ne + 1, sizeof(uint64_t));
        for (uint32_t mi = 0; mi < rf_plan_nmsgs(pl); mi++) {
            const rf_plan_msg *m = rf_plan_msg_at(pl, mi);
            if (m->kind != RF_PLAN_PACKED)
                continue;
            use[(size_t)m->round * ne + m->src_ep] += m->bytes;
            use[(size_t)m->round * ne + m->dst_ep] += m->bytes;
        }
        for (size_t i = 0; i < (size_t)R * ne; i++)
            cr_assert(use[i] <= o->staging_bytes / 2);
        free(use);
    }
    free(cnt);
    free(sent);
    free(recv);
    free(path);
}

/* The same transfers, boxes and messages (the ids may differ). */
static void check_same_moves(const rf_plan *a, const rf_plan *b)
{
    cr_assert_eq(rf_plan_nxfers(a), rf_plan_nxfers(b));
    cr_assert_eq(rf_plan_nmsgs(a), rf_plan_nmsgs(b));
    cr_assert_eq(rf_plan_nrounds(a), rf_plan_nrounds(b));
    for (uint64_t i = 0; i < rf_plan_nxfers(a); i++) {
        const rf_plan_xfer *x = rf_plan_xfer_at(a, i), *y = rf_plan_xfer_at(b, i);
        cr_assert_eq(memcmp(x, y, sizeof(*x)), 0, "transfer %llu differs", (unsigned long long)i);
        cr_assert(rf_box_equal(rf_plan_box(a, x->box), rf_plan_box(b, y->box), RF_MAX_DIMS));
    }
    for (uint32_t i = 0; i < rf_plan_nmsgs(a); i++)
        cr_assert_eq(memcmp(rf_plan_msg_at(a, i), rf_plan_msg_at(b, i), sizeof(rf_plan_msg)), 0);
}

static void check_same(const rf_plan *a, const rf_plan *b)
{
    cr_assert_eq(memcmp(rf_plan_id(a), rf_plan_id(b), 32), 0);
    check_same_moves(a, b);
}

static void cluster_free(cluster *c)
{
    for (uint32_t r = 0; r < c->nregions; r++)
        free(c->bases[r]);
    free(c->bases);
    rf_inv_free(c->inv);
}

/* Random meshes: per tensor a mesh of 1-3 dims with Shard/Replicate placements on each
 * side, plus, on the source side, a few extra pieces with random boxes (overlapping
 * holders). */
static void random_cluster(cluster *c, uint64_t seed)
{
    static const rf_dtype dts[] = {RF_DT_BF16, RF_DT_FP32, RF_DT_INT8, RF_DT_INT64};
    uint32_t nsrc, ndst, nt;
    uint32_t seps[8], deps[8];
    hpiece *sp = NULL, *dp = NULL;
    size_t ns = 0, nd = 0;
    rf_err err;

    rng_state = seed * 2654435761u + 1;
    nsrc = (uint32_t)rndi(1, 6);
    ndst = (uint32_t)rndi(1, 6);
    nt = (uint32_t)rndi(1, 6);
    memset(c, 0, sizeof(*c));
    c->inv = rf_inv_new();
    cr_assert_not_null(c->inv);
    for (uint32_t i = 0; i < nsrc; i++)
        cr_assert_eq(rf_inv_add_endpoint(c->inv, RF_SRC, i / 2, &seps[i], &err), 0);
    for (uint32_t i = 0; i < ndst; i++)
        cr_assert_eq(rf_inv_add_endpoint(c->inv, RF_DST, 100 + i / 3, &deps[i], &err), 0);
    for (uint32_t t = 0; t < nt; t++) {
        int ndim = (int)rndi(1, 3);
        int64_t shape[RF_MAX_DIMS];
        char name[64];
        uint32_t tid;
        rf_dtype dt = dts[rndi(0, 3)];
        for (int d = 0; d < ndim; d++)
            shape[d] = rndi(1, ndim == 1 ? 300 : 24);
        snprintf(name, sizeof(name), "model.layers.%u.w", t);
        cr_assert_eq(rf_inv_add_tensor(c->inv, name, dt, ndim, shape, &tid, &err), 0, "%s",
                     err.msg);
        for (int side = 0; side < 2; side++) {
            int mnd = (int)rndi(1, 3);
            int64_t mesh[3], coord[3] = {0};
            int plc[3];
            uint32_t nep = side ? ndst : nsrc, base = (uint32_t)rndi(0, 5);
            int mode = side ? (int)rndi(0, 3) : (int)rndi(0, 1) * 2;
            int64_t world = 1;
            for (int k = 0; k < mnd; k++) {
                mesh[k] = rndi(1, 3);
                plc[k] = rndi(0, 2) == 0 ? RF_REPLICATE : (int)rndi(0, ndim - 1);
                world *= mesh[k];
            }
            for (int64_t r = 0; r < world; r++) {
                rf_box b;
                int64_t q = r;
                for (int k = mnd - 1; k >= 0; k--) {
                    coord[k] = q % mesh[k];
                    q /= mesh[k];
                }
                if (!rf_placement_box(ndim, shape, mnd, mesh, plc, coord, &b))
                    continue;
                if (side)
                    add_hpiece(&dp, &nd, tid, (uint32_t)((base + r) % nep), ndim, &b, mode,
                               rf_dtype_size(dt));
                else
                    add_hpiece(&sp, &ns, tid, (uint32_t)((base + r) % nep), ndim, &b, mode,
                               rf_dtype_size(dt));
            }
        }
        /* Extra overlapping source boxes. */
        for (int e = (int)rndi(0, 2); e > 0; e--) {
            rf_box b;
            memset(&b, 0, sizeof(b));
            for (int d = 0; d < ndim; d++) {
                b.start[d] = rndi(0, shape[d] - 1);
                b.extent[d] = rndi(1, shape[d] - b.start[d]);
            }
            add_hpiece(&sp, &ns, tid, (uint32_t)rndi(0, nsrc - 1), ndim, &b, (int)rndi(0, 3),
                       rf_dtype_size(dt));
        }
    }
    place(c, sp, ns, seps, nsrc, RF_SRC);
    place(c, dp, nd, deps, ndst, RF_DST);
    cr_assert_eq(rf_inv_check_dst_overlap(c->inv, &err), 0, "%s", err.msg);
    free(sp);
    free(dp);
}

Test(plan, random_layouts_execute_exactly)
{
    static const rf_plan_opts optsets[] = {
        {.staging_bytes = 256ull << 20, .direct_min_bytes = 4ull << 20},
        {.staging_bytes = 4096, .direct_min_bytes = 64},
        {.staging_bytes = 8192, .direct_min_bytes = 1},
    };

    for (uint64_t seed = 1; seed <= 150; seed++) {
        const rf_plan_opts *o = &optsets[seed % 3];
        cluster c;
        rf_plan *a = NULL, *b = NULL;
        rf_err err;
        random_cluster(&c, seed);
        cr_assert_eq(rf_plan_build(c.inv, o, &a, &err), 0, "seed %llu: %s",
                     (unsigned long long)seed, err.msg);
        check_plan(a, o);
        fill_sources(&c);
        cr_assert_eq(rf_copy_exec_plan_host(a, (void *const *)c.bases, (void *const *)c.bases,
                                            &err), 0, "%s", err.msg);
        check_destinations(&c);
        cr_assert_eq(rf_plan_build(c.inv, o, &b, &err), 0, "%s", err.msg);
        check_same(a, b);
        {
            const rf_plan_stats *st = rf_plan_stats_get(a);
            cr_assert_eq(st->transfers, rf_plan_nxfers(a));
            cr_assert_eq(st->direct_bytes + st->packed_bytes, st->dst_bytes);
            cr_assert_eq(st->direct_transfers + st->packed_transfers, st->transfers);
            cr_assert(st->runs >= 2 * st->transfers);
            cr_assert(st->max_staging_bytes <= o->staging_bytes / 2);
        }
        rf_plan_free(a);
        rf_plan_free(b);
        cluster_free(&c);
    }
}

void rf_plan__set_limits(uint64_t geom_cache_bytes, uint64_t link_matrix_entries);

/* The paths for inventories too large for the geometry cache and the dense link matrix (and
 * open-message) tables give the same plans as the fast ones. */
Test(plan, large_inventory_paths_match)
{
    for (uint64_t seed = 200; seed < 240; seed++) {
        rf_plan_opts o = {.staging_bytes = 4096, .direct_min_bytes = 64};
        cluster c;
        rf_plan *a = NULL, *b = NULL;
        rf_err err;
        random_cluster(&c, seed);
        rf_plan__set_limits(256ull << 20, 1ull << 22);
        cr_assert_eq(rf_plan_build(c.inv, &o, &a, &err), 0, "%s", err.msg);
        rf_plan__set_limits(0, 0);
        cr_assert_eq(rf_plan_build(c.inv, &o, &b, &err), 0, "%s", err.msg);
        check_plan(b, &o);
        check_same(a, b);
        cr_assert_eq(rf_plan_stats_get(a)->max_link_bytes, rf_plan_stats_get(b)->max_link_bytes);
        fill_sources(&c);
        cr_assert_eq(rf_copy_exec_plan_host(b, (void *const *)c.bases, (void *const *)c.bases,
                                            &err), 0, "%s", err.msg);
        check_destinations(&c);
        rf_plan_free(a);
        rf_plan_free(b);
        cluster_free(&c);
    }
    rf_plan__set_limits(256ull << 20, 1ull << 22);
}

/* Small staging forces splitting and many rounds; direct_min 1 makes contiguous boxes go
 * direct. One tensor both ways so each path is certainly taken. */
Test(plan, split_direct_and_rounds)
{
    cluster c;
    rf_plan *pl = NULL;
    rf_plan_opts o = {.staging_bytes = 4096, .direct_min_bytes = 1024};
    int64_t shape[2] = {64, 64};
    uint32_t tid, s, d0, d1;
    hpiece *sp = NULL, *dp = NULL;
    size_t ns = 0, nd = 0;
    rf_box full, half;
    rf_err err;
    uint32_t seps[1], deps[2];

    memset(&c, 0, sizeof(c));
    c.inv = rf_inv_new();
    cr_assert_eq(rf_inv_add_tensor(c.inv, "w", RF_DT_FP32, 2, shape, &tid, &err), 0);
    cr_assert_eq(rf_inv_add_endpoint(c.inv, RF_SRC, 0, &s, &err), 0);
    cr_assert_eq(rf_inv_add_endpoint(c.inv, RF_DST, 1, &d0, &err), 0);
    cr_assert_eq(rf_inv_add_endpoint(c.inv, RF_DST, 1, &d1, &err), 0);
    seps[0] = s;
    deps[0] = d0;
    deps[1] = d1;
    rf_box_full(&full, 2, shape);
    half = full;
    half.extent[1] = 32;
    add_hpiece(&sp, &ns, tid, 0, 2, &full, 0, 4);
    add_hpiece(&dp, &nd, tid, 0, 2, &full, 0, 4); /* contiguous: direct, 16 KiB */
    add_hpiece(&dp, &nd, tid, 1, 2, &half, 0, 4); /* strided in the source: packed, split */
    place(&c, sp, ns, seps, 1, RF_SRC);
    place(&c, dp, nd, deps, 2, RF_DST);
    cr_assert_eq(rf_plan_build(c.inv, &o, &pl, &err), 0, "%s", err.msg);
    check_plan(pl, &o);
    const rf_plan_stats *st = rf_plan_stats_get(pl);
    cr_assert_eq(st->direct_transfers, 1);
    cr_assert_eq(st->direct_bytes, 64 * 64 * 4);
    cr_assert_eq(st->packed_bytes, 64 * 32 * 4);
    cr_assert_eq(st->packed_transfers, 4, "8 KiB split into 2 KiB slabs");
    cr_assert_eq(rf_plan_nrounds(pl), 4);
    cr_assert_eq(st->max_staging_bytes, 2048);
    fill_sources(&c);
    cr_assert_eq(rf_copy_exec_plan_host(pl, (void *const *)c.bases, (void *const *)c.bases, &err),
                 0, "%s", err.msg);
    check_destinations(&c);
    rf_plan_free(pl);
    free(sp);
    free(dp);
    cluster_free(&c);
}

Test(plan, uncovered_byte_names_tensor_and_box)
{
    rf_inv *inv = rf_inv_new();
    int64_t shape[2] = {128, 128};
    uint32_t tid, s, d, rs, rd;
    rf_piece p;
    rf_plan *pl = NULL;
    rf_err err;

    cr_assert_eq(rf_inv_add_tensor(inv, "model.layers.0.mlp.up_proj.weight", RF_DT_BF16, 2, shape,
                                   &tid, &err), 0);
    cr_assert_eq(rf_inv_add_endpoint(inv, RF_SRC, 0, &s, &err), 0);
    for (int i = 0; i < 5; i++)
        cr_assert_eq(rf_inv_add_endpoint(inv, RF_DST, 1, &d, &err), 0);
    cr_assert_eq(rf_inv_add_region(inv, s, 1 << 20, &rs, &err), 0);
    cr_assert_eq(rf_inv_add_region(inv, d, 1 << 20, &rd, &err), 0);
    memset(&p, 0, sizeof(p));
    p.tensor = tid;
    p.region = rs;
    rf_box_full(&p.box, 2, shape);
    p.box.start[0] = 64;
    p.box.extent[0] = 64;
    p.strides[0] = 128;
    p.strides[1] = 1;
    cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
    p.region = rd;
    rf_box_full(&p.box, 2, shape);
    cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_build(inv, NULL, &pl, &err), -EINVAL);
    cr_assert_null(pl);
    cr_assert(strstr(err.msg, "no source holds model.layers.0.mlp.up_proj.weight [0:64, 0:128] "
                              "(destination piece on endpoint 5)") != NULL, "%s", err.msg);
    rf_inv_free(inv);
}

Test(plan, staging_below_minimum_is_refused)
{
    rf_inv *inv = rf_inv_new();
    rf_plan *pl = NULL;
    rf_plan_opts o = {.staging_bytes = 100, .direct_min_bytes = 1};
    rf_err err;

    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), -EINVAL);
    cr_assert(strstr(err.msg, "staging") != NULL, "%s", err.msg);
    rf_plan_opts_default(&o);
    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_nxfers(pl), 0);
    cr_assert_eq(rf_plan_nrounds(pl), 0);
    cr_assert_eq(rf_plan_xfer_at(pl, 0), NULL);
    cr_assert_eq(rf_plan_msg_at(pl, 0), NULL);
    cr_assert_eq(rf_plan_sent_bytes(pl, 7), 0);
    rf_plan_free(pl);
    rf_inv_free(inv);
}

/* The id covers the options and every piece: a changed inventory changes it. */
Test(plan, id_changes_with_inputs)
{
    cluster c;
    rf_plan_opts o;
    uint8_t a[32], b[32];
    char hex[65];
    rf_plan *pl = NULL;
    rf_err err;

    random_cluster(&c, 7);
    rf_plan_opts_default(&o);
    rf_plan_digest(c.inv, &o, a);
    cr_assert_eq(rf_plan_build(c.inv, &o, &pl, &err), 0, "%s", err.msg);
    cr_assert_eq(memcmp(a, rf_plan_id(pl), 32), 0);
    rf_plan_id_hex(pl, hex);
    cr_assert_eq(strlen(hex), 64);
    cr_assert(rf_plan_memory(pl) > 0);
    o.staging_bytes *= 2;
    rf_plan_digest(c.inv, &o, b);
    cr_assert_neq(memcmp(a, b, 32), 0);
    rf_plan_free(pl);
    cluster_free(&c);
}

/* A copy of inv in which piece `bump` of `side` (UINT32_MAX: none) lies one element further
 * into its region; every region gets 4 KiB of slack so that the moved piece still fits. */
static rf_inv *copy_inv(const rf_inv *inv, rf_side side, uint32_t bump)
{
    rf_inv *c = rf_inv_new();
    rf_err err;
    rf_piece p;

    cr_assert_not_null(c);
    for (uint32_t t = 0; t < rf_inv_ntensors(inv); t++) {
        const rf_tensor *tt = rf_inv_tensor(inv, t);
        cr_assert_eq(rf_inv_add_tensor(c, tt->name, tt->dtype, tt->ndim, tt->shape, NULL, &err),
                     0, "%s", err.msg);
    }
    for (uint32_t e = 0; e < rf_inv_nendpoints(inv); e++) {
        cr_assert_eq(rf_inv_add_endpoint(c, rf_inv_endpoint(inv, e)->side,
                                         rf_inv_endpoint(inv, e)->node, NULL, &err), 0);
        cr_assert_eq(rf_inv_set_endpoint_host(c, e, rf_inv_endpoint(inv, e)->host, &err), 0);
    }
    for (uint32_t r = 0; r < rf_inv_nregions(inv); r++)
        cr_assert_eq(rf_inv_add_region(c, rf_inv_region(inv, r)->endpoint,
                                       rf_inv_region(inv, r)->size + 4096, NULL, &err), 0);
    for (int s = RF_SRC; s <= RF_DST; s++) {
        for (uint32_t i = 0; i < rf_inv_npieces(inv, (rf_side)s); i++) {
            rf_inv_piece(inv, (rf_side)s, i, &p);
            if (s == (int)side && i == bump)
                p.offset += rf_dtype_size(rf_inv_tensor(inv, p.tensor)->dtype);
            cr_assert_eq(rf_inv_add_piece(c, &p, NULL, &err), 0, "%s", err.msg);
        }
    }
    return c;
}

/* The id covers every piece: equal inventories give equal ids, and moving one piece of
 * either side by one element gives another. */
Test(plan, id_changes_with_one_piece_offset)
{
    cluster c;
    rf_plan_opts o;
    uint8_t a[32], b[32], x[32];

    random_cluster(&c, 11);
    rf_plan_opts_default(&o);
    rf_inv *ia = copy_inv(c.inv, RF_SRC, UINT32_MAX), *ib = copy_inv(c.inv, RF_DST, UINT32_MAX);
    rf_plan_digest(ia, &o, a);
    rf_plan_digest(ib, &o, b);
    cr_assert_eq(memcmp(a, b, 32), 0, "equal inventories must give equal ids");
    for (int s = RF_SRC; s <= RF_DST; s++) {
        uint32_t np = rf_inv_npieces(c.inv, (rf_side)s);
        uint32_t picks[3] = {0, np / 2, np - 1};
        cr_assert(np > 0);
        for (int k = 0; k < 3; k++) {
            rf_inv *ix = copy_inv(c.inv, (rf_side)s, picks[k]);
            rf_plan_digest(ix, &o, x);
            cr_assert_neq(memcmp(a, x, 32), 0, "moving %s piece %u left the id unchanged",
                          s == RF_SRC ? "source" : "destination", picks[k]);
            rf_inv_free(ix);
        }
    }
    rf_inv_free(ia);
    rf_inv_free(ib);
    cluster_free(&c);
}

/* Trainer DP 8, engine DP 1: each byte read once, sender loads within one transfer. */
Test(plan, replica_dedup_random)
{
    rf_inv *inv = rf_inv_new();
    uint32_t seps[8], dep[2], rs[8], rd[2], tid;
    rf_plan *pl = NULL;
    rf_err err;
    uint64_t total = 0, maxx = 0, lo = UINT64_MAX, hi = 0, sum = 0;

    rng_state = 99;
    for (int i = 0; i < 8; i++) {
        cr_assert_eq(rf_inv_add_endpoint(inv, RF_SRC, (uint32_t)i, &seps[i], &err), 0);
        cr_assert_eq(rf_inv_add_region(inv, seps[i], 1ull << 30, &rs[i], &err), 0);
    }
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(rf_inv_add_endpoint(inv, RF_DST, 100 + (uint32_t)i, &dep[i], &err), 0);
        cr_assert_eq(rf_inv_add_region(inv, dep[i], 1ull << 30, &rd[i], &err), 0);
    }
    uint64_t soff = 0, doff[2] = {0, 0};
    for (int t = 0; t < 200; t++) {
        int64_t shape[2] = {rndi(2, 64) * 2, rndi(1, 64)};
        char name[32];
        rf_piece p;
        snprintf(name, sizeof(name), "t%d", t);
        cr_assert_eq(rf_inv_add_tensor(inv, name, RF_DT_BF16, 2, shape, &tid, &err), 0);
        memset(&p, 0, sizeof(p));
        p.tensor = tid;
        p.strides[0] = shape[1];
        p.strides[1] = 1;
        rf_box_full(&p.box, 2, shape);
        p.offset = soff;
        for (int i = 0; i < 8; i++) {
            p.region = rs[i];
            cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
        }
        soff += (uint64_t)(shape[0] * shape[1] * 2);
        total += (uint64_t)(shape[0] * shape[1] * 2);
        for (int i = 0; i < 2; i++) { /* engine TP 2 on dim 0 */
            p.box.start[0] = i * shape[0] / 2;
            p.box.extent[0] = shape[0] / 2;
            p.region = rd[i];
            p.offset = doff[i];
            doff[i] += (uint64_t)(shape[0] / 2 * shape[1] * 2);
            cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
        }
    }
    cr_assert_eq(rf_plan_build(inv, NULL, &pl, &err), 0, "%s", err.msg);
    for (uint64_t i = 0; i < rf_plan_nxfers(pl); i++)
        if (rf_plan_xfer_at(pl, i)->bytes > maxx)
            maxx = rf_plan_xfer_at(pl, i)->bytes;
    for (int i = 0; i < 8; i++) {
        uint64_t s = rf_plan_sent_bytes(pl, seps[i]);
        sum += s;
        lo = s < lo ? s : lo;
        hi = s > hi ? s : hi;
    }
    cr_assert_eq(sum, total, "bytes read %llu, model %llu", (unsigned long long)sum,
                 (unsigned long long)total);
    cr_assert(hi - lo <= maxx, "sender loads %llu..%llu, largest transfer %llu",
              (unsigned long long)lo, (unsigned long long)hi, (unsigned long long)maxx);
    rf_plan_free(pl);
    rf_inv_free(inv);
}

/* ---- same-host transfers (RF_PLAN_LOCAL) --------------------------------------------------- */

/* A small fixed cluster: dp trainer replicas, replica i sharded tps[i] ways along dim 0,
 * every trainer rank its own endpoint (replica by replica) on node snode[rank] (NULL: node
 * 0, 1, ...); ndst engine ranks sharded along the last dim (so strided on the trainer side),
 * on nodes 100 + rank. shost/dhost (NULL: none) put the endpoints on hosts. Tensors of
 * several dtypes and sizes, one of them large. */
static void node_cluster(cluster *c, int dp, const int *tps, const uint32_t *snode, int ndst,
                         const uint32_t *shost, const uint32_t *dhost)
{
    static const struct {
        const char *name;
        rf_dtype dt;
        int ndim;
        int64_t shape[2];
    } ts[] = {
        {"model.embed_tokens.weight", RF_DT_BF16, 2, {96, 64}},
        {"model.layers.0.mlp.up_proj.weight", RF_DT_FP32, 2, {48, 40}},
        {"model.layers.0.input_layernorm.weight", RF_DT_FP32, 1, {24}},
        {"model.layers.1.mlp.down_proj.weight", RF_DT_BF16, 2, {256, 128}},
    };
    uint32_t seps[16], deps[16];
    hpiece *sp = NULL, *dpcs = NULL;
    size_t ns = 0, nd = 0;
    int nsrc = 0;
    rf_err err;

    for (int i = 0; i < dp; i++)
        nsrc += tps[i];
    cr_assert(nsrc <= 16 && ndst <= 16);
    memset(c, 0, sizeof(*c));
    c->inv = rf_inv_new();
    cr_assert_not_null(c->inv);
    for (int i = 0; i < nsrc; i++) {
        cr_assert_eq(rf_inv_add_endpoint(c->inv, RF_SRC, snode ? snode[i] : (uint32_t)i,
                                         &seps[i], &err), 0);
        if (shost)
            cr_assert_eq(rf_inv_set_endpoint_host(c->inv, seps[i], shost[i], &err), 0);
    }
    for (int i = 0; i < ndst; i++) {
        cr_assert_eq(rf_inv_add_endpoint(c->inv, RF_DST, 100 + (uint32_t)i, &deps[i], &err), 0);
        if (dhost)
            cr_assert_eq(rf_inv_set_endpoint_host(c->inv, deps[i], dhost[i], &err), 0);
    }
    for (size_t t = 0; t < sizeof(ts) / sizeof(ts[0]); t++) {
        uint32_t tid;
        size_t es = rf_dtype_size(ts[t].dt);
        rf_box b;
        cr_assert_eq(rf_inv_add_tensor(c->inv, ts[t].name, ts[t].dt, ts[t].ndim, ts[t].shape,
                                       &tid, &err), 0, "%s", err.msg);
        for (int i = 0, r = 0; i < dp; i++) {
            for (int k = 0; k < tps[i]; k++, r++) {
                int64_t s, l;
                rf_box_full(&b, ts[t].ndim, ts[t].shape);
                rf_chunk(ts[t].shape[0], tps[i], k, &s, &l);
                b.start[0] = s;
                b.extent[0] = l;
                add_hpiece(&sp, &ns, tid, (uint32_t)r, ts[t].ndim, &b, 0, es);
            }
        }
        for (int r = 0; r < ndst; r++) {
            int64_t s, l;
            int d = ts[t].ndim - 1;
            rf_box_full(&b, ts[t].ndim, ts[t].shape);
            rf_chunk(ts[t].shape[d], ndst, r, &s, &l);
            if (l == 0)
                continue;
            b.start[d] = s;
            b.extent[d] = l;
            add_hpiece(&dpcs, &nd, tid, (uint32_t)r, ts[t].ndim, &b, 0, es);
        }
    }
    place(c, sp, ns, seps, (uint32_t)nsrc, RF_SRC);
    place(c, dpcs, nd, deps, (uint32_t)ndst, RF_DST);
    cr_assert_eq(rf_inv_check_dst_overlap(c->inv, &err), 0, "%s", err.msg);
    free(sp);
    free(dpcs);
}

static void host_cluster(cluster *c, int dp, const int *tps, int ndst, const uint32_t *shost,
                         const uint32_t *dhost)
{
    node_cluster(c, dp, tps, NULL, ndst, shost, dhost);
}

/* Inventories without hosts plan as they did before the planner knew hosts: the id of this
 * fixed cluster was recorded from the planner before same-host transfers existed. */
Test(plan_local, no_host_plan_id_unchanged)
{
    cluster c;
    rf_plan_opts o = {.staging_bytes = 8192, .direct_min_bytes = 1024};
    rf_plan *pl = NULL;
    rf_err err;
    char hex[RF_PLAN_ID_HEX];

    host_cluster(&c, 2, (const int[]){2, 2}, 3, NULL, NULL);
    cr_assert_eq(rf_plan_build(c.inv, &o, &pl, &err), 0, "%s", err.msg);
    rf_plan_id_hex(pl, hex);
    cr_assert_str_eq(hex, "937d3fbc93387ac7fb140e38803622ae699ec61f7b200c30fcdf7f4a66ff665a");
    rf_plan_free(pl);
    cluster_free(&c);
}


/* Runs pl on c's memory with the reference executor (which copies a local message through a
 * buffer at its transfers' msg_off, as it does a packed one) and checks every destination
 * byte. */
static void execute_check(cluster *c, const rf_plan *pl)
{
    rf_err err;

    fill_sources(c);
    cr_assert_eq(rf_copy_exec_plan_host(pl, (void *const *)c->bases, (void *const *)c->bases,
                                        &err), 0, "%s", err.msg);
    check_destinations(c);
}

static uint64_t max_xfer_bytes(const rf_plan *pl)
{
    uint64_t m = 0;

    for (uint64_t i = 0; i < rf_plan_nxfers(pl); i++)
        if (rf_plan_xfer_at(pl, i)->bytes > m)
            m = rf_plan_xfer_at(pl, i)->bytes;
    return m;
}

/* Trainer and engine on one host (colocated RL): every byte is copied locally, in round 0,
 * no staging, no link; messages of one pair hold at most half the budget, and a transfer
 * larger than that is a message of its own; the copies put every byte where it belongs. */
Test(plan_local, colocated_every_byte_local)
{
    static const uint32_t sh[2] = {5, 5}, dh[3] = {5, 5, 5};
    rf_plan_opts o = {.staging_bytes = 8192, .direct_min_bytes = 1024};
    cluster c;
    rf_plan *pl = NULL, *big = NULL;
    rf_err err;
    const rf_plan_stats *st;
    int large = 0, grouped = 0;

    host_cluster(&c, 1, (const int[]){2}, 3, sh, dh);
    cr_assert_eq(rf_plan_build(c.inv, &o, &pl, &err), 0, "%s", err.msg);
    check_plan(pl, &o);
    st = rf_plan_stats_get(pl);
    cr_assert(st->dst_bytes > 0);
    cr_assert_eq(st->local_bytes, st->dst_bytes);
    cr_assert_eq(st->direct_bytes + st->packed_bytes, 0);
    cr_assert_eq(st->local_transfers, st->transfers);
    cr_assert_eq(st->local_messages, st->messages);
    cr_assert_eq(st->messages, rf_plan_nmsgs(pl));
    cr_assert_eq(rf_plan_nrounds(pl), 1);
    cr_assert_eq(st->max_staging_bytes, 0);
    cr_assert_eq(st->max_link_bytes, 0);
    for (uint32_t mi = 0; mi < rf_plan_nmsgs(pl); mi++) {
        const rf_plan_msg *m = rf_plan_msg_at(pl, mi);
        cr_assert_eq(m->kind, RF_PLAN_LOCAL);
        cr_assert_eq(m->round, 0);
        large += m->count == 1 && m->bytes > o.staging_bytes / 2;
        grouped += m->count > 1;
    }
    cr_assert(large > 0, "the 64 KiB tensor's transfers exceed half the budget: own messages");
    cr_assert(grouped > 0, "small transfers of one pair share a message");
    for (uint32_t e = 0; e < rf_inv_nendpoints(c.inv); e++)
        cr_assert_eq(rf_plan_path_bytes(pl, e, RF_PLAN_DIRECT) +
                     rf_plan_path_bytes(pl, e, RF_PLAN_PACKED), 0);
    cr_assert_eq(rf_plan_path_bytes(pl, 99, RF_PLAN_LOCAL), 0);
    cr_assert_eq(rf_plan_path_bytes(pl, 0, 3), 0);
    execute_check(&c, pl);
    /* With a budget that holds everything, one message per endpoint pair (2 x 3). */
    rf_plan_opts_default(&o);
    cr_assert_eq(rf_plan_build(c.inv, &o, &big, &err), 0, "%s", err.msg);
    check_plan(big, &o);
    cr_assert_eq(rf_plan_nmsgs(big), 6);
    cr_assert_eq(rf_plan_stats_get(big)->local_messages, 6);
    execute_check(&c, big);
    rf_plan_free(big);
    rf_plan_free(pl);
    cluster_free(&c);
}

/* Engines 0 and 1 on the trainers' host, 2 on another, 3 on none: transfers to 0 and 1 are
 * local, the others go over the network, and only those load the links and staging. */
Test(plan_local, mixed_local_and_network)
{
    static const uint32_t sh[2] = {3, 3}, dh[4] = {3, 3, 4, RF_HOST_NONE};
    rf_plan_opts o = {.staging_bytes = 8192, .direct_min_bytes = 1024};
    cluster c;
    rf_plan *pl = NULL;
    rf_err err;
    const rf_plan_stats *st;
    const rf_inv *inv;
    uint64_t local = 0, link[2][2] = {{0}}, maxlink = 0;

    host_cluster(&c, 1, (const int[]){2}, 4, sh, dh);
    inv = c.inv;
    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
    check_plan(pl, &o);
    st = rf_plan_stats_get(pl);
    for (uint32_t d = 2; d < 6; d++) { /* endpoints 0, 1 are the trainers */
        uint64_t r = rf_plan_recv_bytes(pl, d), l = rf_plan_path_bytes(pl, d, RF_PLAN_LOCAL);
        cr_assert(r > 0);
        cr_assert_eq(l, d < 4 ? r : 0, "engine endpoint %u: %llu of %llu bytes local", d,
                     (unsigned long long)l, (unsigned long long)r);
        local += l;
    }
    cr_assert_eq(st->local_bytes, local);
    cr_assert_eq(st->direct_bytes + st->packed_bytes + st->local_bytes, st->dst_bytes);
    cr_assert(st->direct_bytes + st->packed_bytes > 0);
    cr_assert_eq(st->direct_transfers + st->packed_transfers + st->local_transfers,
                 st->transfers);
    for (uint32_t mi = 0; mi < rf_plan_nmsgs(pl); mi++) {
        const rf_plan_msg *m = rf_plan_msg_at(pl, mi);
        if (m->kind != RF_PLAN_LOCAL)
            link[rf_inv_endpoint(inv, m->src_ep)->node][rf_inv_endpoint(inv, m->dst_ep)->node -
                                                        102] += m->bytes;
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            maxlink = link[i][j] > maxlink ? link[i][j] : maxlink;
    cr_assert_eq(st->max_link_bytes, maxlink, "links carry the network bytes alone");
    execute_check(&c, pl);
    rf_plan_free(pl);
    cluster_free(&c);
}

/* Trainer DP 2 with one replica on the engines' host: every byte comes from that replica. */
Test(plan_local, replica_on_the_engines_host_sends_everything)
{
    static const uint32_t sh[4] = {7, 7, 9, 9}, dh[2] = {9, 9};
    rf_plan_opts o = {.staging_bytes = 8192, .direct_min_bytes = 1024};
    cluster c;
    rf_plan *pl = NULL;
    rf_err err;
    const rf_plan_stats *st;

    host_cluster(&c, 2, (const int[]){2, 2}, 2, sh, dh);
    cr_assert_eq(rf_plan_build(c.inv, &o, &pl, &err), 0, "%s", err.msg);
    check_plan(pl, &o);
    st = rf_plan_stats_get(pl);
    cr_assert_eq(rf_plan_sent_bytes(pl, 0) + rf_plan_sent_bytes(pl, 1), 0,
                 "the replica on host 7 sent %llu + %llu bytes",
                 (unsigned long long)rf_plan_sent_bytes(pl, 0),
                 (unsigned long long)rf_plan_sent_bytes(pl, 1));
    cr_assert_eq(rf_plan_sent_bytes(pl, 2) + rf_plan_sent_bytes(pl, 3), st->dst_bytes);
    cr_assert_eq(st->local_bytes, st->dst_bytes);
    execute_check(&c, pl);
    rf_plan_free(pl);
    cluster_free(&c);
}

/* A remote trainer holds each engine piece whole, the local replica only in shards: the
 * local shards still send every byte (the whole-piece shortcut takes same-host holders
 * only). */
Test(plan_local, local_shards_beat_a_remote_whole_copy)
{
    static const uint32_t sh[3] = {7, 9, 9}, dh[2] = {9, 9};
    rf_plan_opts o = {.staging_bytes = 8192, .direct_min_bytes = 1024};
    cluster c;
    rf_plan *pl = NULL;
    rf_err err;

    host_cluster(&c, 2, (const int[]){1, 2}, 2, sh, dh);
    cr_assert_eq(rf_plan_build(c.inv, &o, &pl, &err), 0, "%s", err.msg);
    check_plan(pl, &o);
    cr_assert_eq(rf_plan_sent_bytes(pl, 0), 0, "the whole copy on host 7 sent %llu bytes",
                 (unsigned long long)rf_plan_sent_bytes(pl, 0));
    cr_assert_eq(rf_plan_stats_get(pl)->local_bytes, rf_plan_stats_get(pl)->dst_bytes);
    cr_assert(rf_plan_sent_bytes(pl, 1) > 0 && rf_plan_sent_bytes(pl, 2) > 0);
    execute_check(&c, pl);
    rf_plan_free(pl);
    cluster_free(&c);
}

/* Only shard 0 of replica 0 is on the engines' host: shard 0 comes from it, locally; shard 1
 * over the network, spread over both replicas' shard 1 by their network loads. */
Test(plan_local, partial_local_holder)
{
    static const uint32_t sh[4] = {9, 7, 7, 7}, dh[2] = {9, 9};
    rf_plan_opts o = {.staging_bytes = 8192, .direct_min_bytes = 1024};
    cluster c;
    rf_plan *pl = NULL;
    rf_err err;
    const rf_plan_stats *st;
    uint64_t s1, s3, mx;

    host_cluster(&c, 2, (const int[]){2, 2}, 2, sh, dh);
    cr_assert_eq(rf_plan_build(c.inv, &o, &pl, &err), 0, "%s", err.msg);
    check_plan(pl, &o);
    st = rf_plan_stats_get(pl);
    cr_assert(st->local_bytes > 0);
    cr_assert_eq(rf_plan_sent_bytes(pl, 0), st->local_bytes);
    cr_assert_eq(rf_plan_path_bytes(pl, 0, RF_PLAN_LOCAL), st->local_bytes);
    cr_assert_eq(rf_plan_sent_bytes(pl, 2), 0, "shard 0 of the remote replica sent %llu",
                 (unsigned long long)rf_plan_sent_bytes(pl, 2));
    s1 = rf_plan_sent_bytes(pl, 1);
    s3 = rf_plan_sent_bytes(pl, 3);
    mx = max_xfer_bytes(pl);
    cr_assert_eq(s1 + s3 + st->local_bytes, st->dst_bytes);
    cr_assert(s1 > 0 && s3 > 0 && (s1 > s3 ? s1 - s3 : s3 - s1) <= mx,
              "network senders %llu and %llu, largest transfer %llu", (unsigned long long)s1,
              (unsigned long long)s3, (unsigned long long)mx);
    execute_check(&c, pl);
    rf_plan_free(pl);
    cluster_free(&c);
}

/* Two replicas on the engines' host share the local reads: their loads differ by at most
 * one transfer. */
Test(plan_local, local_reads_spread_over_local_replicas)
{
    static const uint32_t sh[2] = {9, 9}, dh[3] = {9, 9, 9};
    rf_plan_opts o = {.staging_bytes = 8192, .direct_min_bytes = 1024};
    cluster c;
    rf_plan *pl = NULL;
    rf_err err;
    uint64_t s0, s1, mx;

    host_cluster(&c, 2, (const int[]){1, 1}, 3, sh, dh);
    cr_assert_eq(rf_plan_build(c.inv, &o, &pl, &err), 0, "%s", err.msg);
    check_plan(pl, &o);
    s0 = rf_plan_sent_bytes(pl, 0);
    s1 = rf_plan_sent_bytes(pl, 1);
    mx = max_xfer_bytes(pl);
    cr_assert_eq(s0 + s1, rf_plan_stats_get(pl)->local_bytes);
    cr_assert(s0 > 0 && s1 > 0 && (s0 > s1 ? s0 - s1 : s1 - s0) <= mx,
              "local senders %llu and %llu, largest transfer %llu", (unsigned long long)s0,
              (unsigned long long)s1, (unsigned long long)mx);
    execute_check(&c, pl);
    rf_plan_free(pl);
    cluster_free(&c);
}

/* Folding each side into one endpoint (one GPU pair) keeps a side's host when all its
 * endpoints share it: a colocated cluster folds into a colocated pair, planned all local and
 * executed exactly; a side spread over hosts folds onto none. */
Test(plan_local, fold_keeps_a_shared_host)
{
    static const uint32_t sh[2] = {5, 5}, dh[3] = {5, 5, 5}, dmix[3] = {5, 6, 5};
    rf_plan_opts o = {.staging_bytes = 8192, .direct_min_bytes = 1024};
    cluster c, m;
    rf_inv *f = NULL, *g = NULL;
    rf_plan *pl = NULL;
    rf_err err;

    host_cluster(&c, 1, (const int[]){2}, 3, sh, dh);
    cr_assert_eq(rf_inv_fold_sides(c.inv, &f, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_inv_nendpoints(f), 2);
    cr_assert_eq(rf_inv_endpoint(f, 0)->host, 5);
    cr_assert_eq(rf_inv_endpoint(f, 1)->host, 5);
    cr_assert_eq(rf_plan_build(f, &o, &pl, &err), 0, "%s", err.msg);
    check_plan(pl, &o);
    cr_assert_eq(rf_plan_stats_get(pl)->local_bytes, rf_plan_stats_get(pl)->dst_bytes);
    {
        cluster fc = c; /* same regions and pieces, folded endpoints */
        fc.inv = f;
        execute_check(&fc, pl);
    }
    rf_plan_free(pl);
    host_cluster(&m, 1, (const int[]){2}, 3, sh, dmix);
    cr_assert_eq(rf_inv_fold_sides(m.inv, &g, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_inv_endpoint(g, 0)->host, 5);
    cr_assert_eq(rf_inv_endpoint(g, 1)->host, RF_HOST_NONE);
    rf_inv_free(f);
    rf_inv_free(g);
    cluster_free(&c);
    cluster_free(&m);
}

/* Hosts are in the id: explicit RF_HOST_NONE changes nothing; hosts that join no pair change
 * the id but not the moves; hosts that do, or a different placement, give other ids. */
Test(plan_local, id_covers_hosts)
{
    static const uint32_t none4[4] = {RF_HOST_NONE, RF_HOST_NONE, RF_HOST_NONE, RF_HOST_NONE};
    static const uint32_t none3[3] = {RF_HOST_NONE, RF_HOST_NONE, RF_HOST_NONE};
    static const uint32_t s1111[4] = {1, 1, 1, 1}, d222[3] = {2, 2, 2}, d111[3] = {1, 1, 1};
    static const uint32_t d112[3] = {1, 1, 2}, d211[3] = {2, 1, 1};
    const uint32_t *dsts[5] = {NULL, none3, d222, d111, d112};
    rf_plan_opts o = {.staging_bytes = 8192, .direct_min_bytes = 1024};
    rf_plan *pl[6] = {NULL};
    cluster c[6];
    uint8_t dig[32];
    rf_err err;

    for (int i = 0; i < 6; i++) {
        host_cluster(&c[i], 2, (const int[]){2, 2}, 3, i == 0 ? NULL : i == 1 ? none4 : s1111,
                     i == 5 ? d211 : dsts[i]);
        cr_assert_eq(rf_plan_build(c[i].inv, &o, &pl[i], &err), 0, "%s", err.msg);
        check_plan(pl[i], &o);
        rf_plan_digest(c[i].inv, &o, dig);
        cr_assert_eq(memcmp(dig, rf_plan_id(pl[i]), 32), 0);
    }
    check_same(pl[0], pl[1]);
    cr_assert_neq(memcmp(rf_plan_id(pl[0]), rf_plan_id(pl[2]), 32), 0);
    check_same_moves(pl[0], pl[2]);
    for (int i = 2; i < 6; i++)
        for (int j = i + 1; j < 6; j++)
            cr_assert_neq(memcmp(rf_plan_id(pl[i]), rf_plan_id(pl[j]), 32), 0,
                          "placements %d and %d give one id", i, j);
    cr_assert_eq(rf_plan_stats_get(pl[2])->local_bytes, 0);
    cr_assert(rf_plan_stats_get(pl[3])->local_bytes > 0);
    for (int i = 0; i < 6; i++) {
        rf_plan_free(pl[i]);
        cluster_free(&c[i]);
    }
}

/* Random layouts with endpoints on random hosts (or none): every plan covers each byte once,
 * keeps its local messages in round 0 under the limit, executes exactly, is deterministic,
 * and the large-inventory paths (open local messages in a hash table) give the same plan. */
Test(plan_local, random_hosts_execute_exactly)
{
    static const rf_plan_opts optsets[] = {
        {.staging_bytes = 256ull << 20, .direct_min_bytes = 4ull << 20},
        {.staging_bytes = 4096, .direct_min_bytes = 64},
        {.staging_bytes = 8192, .direct_min_bytes = 1},
    };
    uint64_t any_local = 0, any_net = 0;

    for (uint64_t seed = 1; seed <= 90; seed++) {
        const rf_plan_opts *o = &optsets[seed % 3];
        cluster c;
        rf_plan *a = NULL, *b = NULL;
        rf_err err;
        const rf_plan_stats *st;
        uint64_t lm = 0;
        random_cluster(&c, seed);
        for (uint32_t e = 0; e < rf_inv_nendpoints(c.inv); e++) {
            uint64_t r = rnd() % 3;
            cr_assert_eq(rf_inv_set_endpoint_host(c.inv, e, r == 2 ? RF_HOST_NONE : (uint32_t)r,
                                                  &err), 0);
        }
        cr_assert_eq(rf_plan_build(c.inv, o, &a, &err), 0, "seed %llu: %s",
                     (unsigned long long)seed, err.msg);
        check_plan(a, o);
        execute_check(&c, a);
        st = rf_plan_stats_get(a);
        cr_assert_eq(st->direct_bytes + st->packed_bytes + st->local_bytes, st->dst_bytes);
        cr_assert_eq(st->direct_transfers + st->packed_transfers + st->local_transfers,
                     st->transfers);
        for (uint32_t mi = 0; mi < rf_plan_nmsgs(a); mi++)
            lm += rf_plan_msg_at(a, mi)->kind == RF_PLAN_LOCAL;
        cr_assert_eq(st->local_messages, lm);
        cr_assert(st->max_staging_bytes <= o->staging_bytes / 2);
        any_local += st->local_bytes;
        any_net += st->direct_bytes + st->packed_bytes;
        cr_assert_eq(rf_plan_build(c.inv, o, &b, &err), 0, "%s", err.msg);
        check_same(a, b);
        rf_plan_free(b);
        b = NULL;
        rf_plan__set_limits(0, 0);
        cr_assert_eq(rf_plan_build(c.inv, o, &b, &err), 0, "%s", err.msg);
        rf_plan__set_limits(256ull << 20, 1ull << 22);
        check_same(a, b);
        rf_plan_free(a);
        rf_plan_free(b);
        cluster_free(&c);
    }
    cr_assert(any_local > 0 && any_net > 0);
}

/* ---- real layouts through model.h ------------------------------------------------------ */

static rf_inv *model_inv(const char *name, int shrink, const char *src, const char *dst,
                         rf_model **mout)
{
    rf_model *m = NULL, *s = NULL;
    rf_par ps, pd;
    rf_inv *inv = rf_inv_new();
    rf_err err;

    cr_assert_eq(rf_model_load(name, &m, &err), 0, "%s", err.msg);
    if (shrink > 1) {
        cr_assert_eq(rf_model_shrink(m, shrink, &s, &err), 0, "%s", err.msg);
        rf_model_free(m);
        m = s;
    }
    cr_assert_eq(rf_par_parse(src, RF_SRC, m, &ps, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_par_parse(dst, RF_DST, m, &pd, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_model_build_inv(m, &ps, &pd, 8, inv, &err), 0, "%s", err.msg);
    *mout = m;
    return inv;
}

static void execute_inv(rf_inv *inv)
{
    cluster c = {.inv = inv};
    rf_plan_opts o = {.staging_bytes = 1 << 16, .direct_min_bytes = 4096};
    rf_plan *pl = NULL;
    rf_err err;

    c.nregions = rf_inv_nregions(inv);
    c.bases = calloc(c.nregions, sizeof(*c.bases));
    for (uint32_t r = 0; r < c.nregions; r++) {
        c.bases[r] = calloc(rf_inv_region(inv, r)->size + 1, 1);
        cr_assert_not_null(c.bases[r]);
    }
    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
    check_plan(pl, &o);
    fill_sources(&c);
    cr_assert_eq(rf_copy_exec_plan_host(pl, (void *const *)c.bases, (void *const *)c.bases, &err),
                 0, "%s", err.msg);
    check_destinations(&c);
    rf_plan_free(pl);
    cluster_free(&c);
}

static const char qwen_4kv[] =
    "{\"model_type\": \"qwen3\", \"name\": \"qwen3-4kv\", \"hidden_size\": 1024, "
    "\"intermediate_size\": 3072, \"num_hidden_layers\": 2, \"num_attention_heads\": 16, "
    "\"num_key_value_heads\": 4, \"head_dim\": 128, \"vocab_size\": 4096, "
    "\"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\"}";

Test(plan_model, qwen3_4_kv_heads_tp8_both_sides)
{
    char path[] = "/tmp/rf_test_plan_XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fdopen(fd, "w");
    rf_model *m = NULL;
    rf_inv *inv;

    cr_assert_not_null(f);
    fputs(qwen_4kv, f);
    fclose(f);
    inv = model_inv(path, 8, "tp=8", "tp=8", &m);
    unlink(path);
    execute_inv(inv);
    rf_model_free(m);
}

Test(plan_model, qwen3_30b_a3b_shrunk_executes)
{
    rf_model *m = NULL;
    rf_inv *inv = model_inv("qwen3-30b-a3b", 64, "tp=2,ep=4,dp=2", "tp=4,dp=4", &m);

    execute_inv(inv);
    rf_model_free(m);
}

Test(plan_model, qwen3_30b_a3b_full_size_covered, .timeout = 60)
{
    rf_model *m = NULL;
    rf_inv *inv = model_inv("qwen3-30b-a3b", 1, "tp=2,ep=4,dp=2", "tp=4,dp=4", &m);
    rf_plan *pl = NULL;
    rf_err err;
    const rf_plan_stats *st;

    cr_assert_eq(rf_plan_build(inv, NULL, &pl, &err), 0, "%s", err.msg);
    st = rf_plan_stats_get(pl);
    uint64_t held = 0;
    for (uint32_t i = 0; i < rf_inv_npieces(inv, RF_DST); i++) {
        rf_piece p;
        rf_inv_piece(inv, RF_DST, i, &p);
        const rf_tensor *t = rf_inv_tensor(inv, p.tensor);
        held += (uint64_t)rf_box_numel(&p.box, t->ndim) * rf_dtype_size(t->dtype);
    }
    cr_assert_eq(st->dst_bytes, held, "every destination byte is planned");
    cr_assert(st->dst_bytes >= 4 * rf_model_bytes(m), "engine dp=4 holds the model 4 times");
    cr_assert_eq(st->direct_bytes + st->packed_bytes, st->dst_bytes);
    cr_assert(st->max_sender_bytes >= st->mean_sender_bytes);
    cr_assert(st->max_staging_bytes <= 128ull << 20);
    rf_plan_free(pl);
    rf_inv_free(inv);
    rf_model_free(m);
}

Test(plan_model, trainer_dp8_engine_dp1_reads_each_byte_once)
{
    rf_model *m = NULL;
    rf_inv *inv = model_inv("qwen3-0.6b", 1, "dp=8", "", &m);
    rf_plan *pl = NULL;
    rf_err err;
    uint64_t sum = 0, lo = UINT64_MAX, hi = 0, maxx = 0;

    cr_assert_eq(rf_plan_build(inv, NULL, &pl, &err), 0, "%s", err.msg);
    for (uint32_t e = 0; e < rf_inv_nendpoints(inv); e++) {
        if (rf_inv_endpoint(inv, e)->side != RF_SRC)
            continue;
        uint64_t s = rf_plan_sent_bytes(pl, e);
        sum += s;
        lo = s < lo ? s : lo;
        hi = s > hi ? s : hi;
    }
    for (uint64_t i = 0; i < rf_plan_nxfers(pl); i++)
        if (rf_plan_xfer_at(pl, i)->bytes > maxx)
            maxx = rf_plan_xfer_at(pl, i)->bytes;
    cr_assert_eq(sum, rf_model_bytes(m));
    cr_assert(hi - lo <= maxx, "sender loads %llu..%llu, largest transfer %llu",
              (unsigned long long)lo, (unsigned long long)hi, (unsigned long long)maxx);
    rf_plan_free(pl);
    rf_inv_free(inv);
    rf_model_free(m);
}

/* vLLM expert parallelism on the engine (ep = tp*dp): executed byte for byte on a shrunk model. */
Test(plan_model, qwen3_30b_a3b_vllm_ep_shrunk_executes, .timeout = 60)
{
    static const char *dst[] = {"tp=1,dp=8,ep=8", "tp=2,dp=4,ep=8"};

    for (size_t i = 0; i < sizeof(dst) / sizeof(dst[0]); i++) {
        rf_model *m = NULL;
        rf_inv *inv = model_inv("qwen3-30b-a3b", 64, "tp=2,ep=4,dp=2", dst[i], &m);

        execute_inv(inv);
        rf_model_free(m);
    }
}

/* SGLang DP attention on the engine (attn=dp: tp ranks in all, attention per DP group, the
 * embedding whole on every rank): executed byte for byte on shrunk models. */
Test(plan_model, sglang_dp_attention_shrunk_executes, .timeout = 60)
{
    static const char *dst[] = {"tp=8,dp=8,attn=dp", "tp=8,dp=2,ep=4,attn=dp"};
    rf_model *m = NULL;
    rf_inv *inv;

    for (size_t i = 0; i < sizeof(dst) / sizeof(dst[0]); i++) {
        inv = model_inv("qwen3-30b-a3b", 64, "tp=2,ep=4,dp=2", dst[i], &m);
        execute_inv(inv);
        rf_model_free(m);
    }
    inv = model_inv("qwen3-0.6b", 8, "tp=2,pp=2", "tp=4,dp=4,attn=dp", &m);
    execute_inv(inv);
    rf_model_free(m);
}

/* Colocated RL on one machine (issue #12's case: Megatron tp=2,ep=2 trainers and a vLLM tp=4
 * engine on the same GPUs), shrunk: every byte is a local copy and lands right; then trainers
 * tp=2,dp=2 (ranks 0-1 one replica, 2-3 the other) where only the second replica shares the
 * engines' machine, which then sends everything. */
Test(plan_model, qwen3_30b_a3b_colocated_executes, .timeout = 60)
{
    rf_model *m = NULL;
    rf_inv *inv = model_inv("qwen3-30b-a3b", 64, "tp=2,ep=2", "tp=4", &m);
    rf_plan *pl = NULL;
    rf_err err;

    for (uint32_t e = 0; e < rf_inv_nendpoints(inv); e++)
        cr_assert_eq(rf_inv_set_endpoint_host(inv, e, 0, &err), 0);
    cr_assert_eq(rf_plan_build(inv, NULL, &pl, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_stats_get(pl)->local_bytes, rf_plan_stats_get(pl)->dst_bytes);
    rf_plan_free(pl);
    execute_inv(inv);
    rf_model_free(m);

    inv = model_inv("qwen3-30b-a3b", 64, "tp=2,dp=2", "tp=4", &m);
    cr_assert_eq(rf_inv_endpoint(inv, 3)->side, RF_SRC);
    cr_assert_eq(rf_inv_endpoint(inv, 4)->side, RF_DST);
    for (uint32_t e = 0; e < rf_inv_nendpoints(inv); e++)
        cr_assert_eq(rf_inv_set_endpoint_host(inv, e, e < 2 ? 1 : 2, &err), 0);
    cr_assert_eq(rf_plan_build(inv, NULL, &pl, &err), 0, "%s", err.msg);
    for (uint32_t e = 0; e < 2; e++)
        cr_assert_eq(rf_plan_sent_bytes(pl, e), 0, "trainer %u on another machine sent %llu", e,
                     (unsigned long long)rf_plan_sent_bytes(pl, e));
    cr_assert_eq(rf_plan_stats_get(pl)->local_bytes, rf_plan_stats_get(pl)->dst_bytes);
    rf_plan_free(pl);
    execute_inv(inv);
    rf_model_free(m);
}

/* What engine rank r of a tp=1 layout with experts over all ranks must hold of tensor t,
 * counted from its name alone: a non-expert tensor whole, an expert whole when it lies in
 * [r*E/ep, (r+1)*E/ep), else nothing. */
static uint64_t ep_rank_bytes(const rf_tensor *ten, int experts, int ep, int r)
{
    const char *x = strstr(ten->name, ".experts.");
    uint64_t n = (uint64_t)ten->shape[0] * (uint64_t)(ten->ndim > 1 ? ten->shape[1] : 1);

    if (x && atoi(x + 9) / (experts / ep) != r)
        return 0;
    return n * rf_dtype_size(ten->dtype);
}

/* Full size, from Megatron trainers to engines with experts over tp*dp: the plan builds (so
 * every destination byte has a source) and each engine rank receives exactly its share, tensor
 * by tensor, counted from the plan's transfers. */
typedef struct ep_case {
    const char *model, *src, *dst;
    int experts, ep;
} ep_case;

Test(plan_model, vllm_ep_full_size_each_rank_receives_its_share, .timeout = 60)
{
    static const ep_case cases[] = {
        {"qwen3-30b-a3b", "tp=2,ep=4,dp=2", "tp=1,dp=8,ep=8", 128, 8},
        {"qwen3-30b-a3b", "tp=4,pp=2,ep=8,dp=2", "tp=1,dp=16,ep=16", 128, 16},
        {"deepseek-v3", "tp=8,pp=4,ep=8", "tp=1,dp=8,ep=8", 256, 8},
    };

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const ep_case *c = &cases[i];
        rf_model *m = NULL;
        rf_inv *inv = model_inv(c->model, 1, c->src, c->dst, &m);
        uint32_t nt = rf_inv_ntensors(inv), dst0 = UINT32_MAX;
        uint64_t *got;
        rf_plan *pl = NULL;
        rf_err err;

        cr_assert_eq(rf_plan_build(inv, NULL, &pl, &err), 0, "%s -> %s: %s", c->src, c->dst,
                     err.msg);
        for (uint32_t e = 0; e < rf_inv_nendpoints(inv) && dst0 == UINT32_MAX; e++)
            if (rf_inv_endpoint(inv, e)->side == RF_DST)
                dst0 = e;
        cr_assert_eq(rf_inv_nendpoints(inv) - dst0, (uint32_t)c->ep);
        got = calloc((size_t)c->ep * nt, sizeof(*got));
        cr_assert_not_null(got);
        for (uint64_t x = 0; x < rf_plan_nxfers(pl); x++) {
            const rf_plan_xfer *xf = rf_plan_xfer_at(pl, x);
            uint32_t r = rf_plan_msg_at(pl, xf->msg)->dst_ep - dst0;
            rf_piece p;

            rf_inv_piece(inv, RF_DST, xf->dst, &p);
            got[(size_t)r * nt + p.tensor] += xf->bytes;
        }
        for (int r = 0; r < c->ep; r++) {
            for (uint32_t t = 0; t < nt; t++) {
                const rf_tensor *ten = rf_inv_tensor(inv, t);
                uint64_t want = ep_rank_bytes(ten, c->experts, c->ep, r);

                cr_assert_eq(got[(size_t)r * nt + t], want, "%s %s rank %d receives %llu of %s, "
                             "holds %llu", c->model, c->dst, r,
                             (unsigned long long)got[(size_t)r * nt + t], ten->name,
                             (unsigned long long)want);
            }
        }
        free(got);
        rf_plan_free(pl);
        rf_inv_free(inv);
        rf_model_free(m);
    }
}

/* ---- refitctl plan as a process -------------------------------------------------------- */

static int run_ctl(const char *args, char *out, size_t len)
{
    const char *build = getenv("REFIT_BUILD");
    char cmd[1024];
    size_t n = 0;
    FILE *p;

    snprintf(cmd, sizeof(cmd), "%s/refitctl %s 2>&1", build && *build ? build : "build", args);
    p = popen(cmd, "r");
    cr_assert_not_null(p);
    while (n + 1 < len) {
        size_t k = fread(out + n, 1, len - 1 - n, p);
        if (k == 0)
            break;
        n += k;
    }
    out[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(refitctl, plan_json)
{
    static char out[1 << 16];
    json_t *j;
    json_error_t je;

    cr_assert_eq(run_ctl("plan --model qwen3-0.6b --src tp=2,dp=4 --dst tp=4 --json", out,
                         sizeof(out)), 0, "%s", out);
    j = json_loads(out, 0, &je);
    cr_assert_not_null(j, "not JSON: %s (%s)", out, je.text);
    cr_assert(json_is_true(json_object_get(j, "covered")));
    cr_assert(json_integer_value(json_object_get(j, "tensors")) > 100);
    cr_assert(json_integer_value(json_object_get(j, "transfers")) > 0);
    cr_assert(json_integer_value(json_object_get(j, "dst_bytes")) > 0);
    cr_assert(json_integer_value(json_object_get(j, "max_sender_bytes")) > 0);
    cr_assert(json_integer_value(json_object_get(j, "max_receiver_bytes")) > 0);
    cr_assert(json_number_value(json_object_get(j, "predicted_seconds")) > 0);
    cr_assert(json_is_number(json_object_get(j, "plan_seconds")));
    cr_assert_eq(strlen(json_string_value(json_object_get(j, "plan_id"))), 64);
    json_decref(j);
}

Test(refitctl, plan_text_explain_and_help)
{
    static char out[1 << 16];

    cr_assert_eq(run_ctl("plan --model qwen3-0.6b --src tp=2 --dst tp=2,dp=2 --explain", out,
                         sizeof(out)), 0, "%s", out);
    cr_assert(strstr(out, "transfers") != NULL, "%s", out);
    cr_assert(strstr(out, "predicted") != NULL, "%s", out);
    cr_assert(strstr(out, "top senders") != NULL, "%s", out);
    cr_assert_eq(run_ctl("plan --model qwen3-30b-a3b --src tp=2,ep=4,dp=2 --dst tp=1,dp=8,ep=8 "
                         "--explain", out, sizeof(out)), 0, "%s", out);
    cr_assert(strstr(out, "engine tp=1,dp=8,ep=8 (8 GPUs)") != NULL, "%s", out);
    cr_assert(strstr(out, "per receiver max 9.62 GiB, mean 9.62 GiB") != NULL, "%s", out);
    cr_assert_eq(run_ctl("--help", out, sizeof(out)), 0);
    cr_assert(strstr(out, "plan") != NULL, "%s", out);
    cr_assert_eq(run_ctl("plan --help", out, sizeof(out)), 0);
    cr_assert(strstr(out, "--link-gbps") != NULL, "%s", out);
    cr_assert_eq(run_ctl("nosuchcommand", out, sizeof(out)), 2);
}

/* refitctl plan with SGLang's DP attention: 8 engine ranks (tp=8 is the world), each receiving
 * the embedding and attention whole (dp = tp), 1/8 of lm_head and of every expert:
 * 151936*2048*2*(1 + 1/8) + 48 layers * (attention 37,748,736 + norms and router 532,992 +
 * experts 150,994,944) + 4096 bytes = 9.113 GiB. A trainer given attn is refused with exit 2. */
Test(refitctl, plan_sglang_dp_attention)
{
    static char out[1 << 16];

    cr_assert_eq(run_ctl("plan --model qwen3-30b-a3b --src tp=2,ep=4,dp=2 --dst "
                         "tp=8,dp=8,attn=dp", out, sizeof(out)), 0, "%s", out);
    cr_assert(strstr(out, "engine tp=8,dp=8,attn=dp (8 GPUs)") != NULL, "%s", out);
    cr_assert(strstr(out, "per receiver max 9.11 GiB, mean 9.11 GiB") != NULL, "%s", out);
    cr_assert_eq(run_ctl("plan --model qwen3-30b-a3b --src tp=2,attn=dp --dst tp=8,dp=8,attn=dp",
                         out, sizeof(out)), 2, "%s", out);
    cr_assert(strstr(out, "attn is an engine key") != NULL, "%s", out);
    cr_assert_eq(run_ctl("plan --model qwen3-30b-a3b --src tp=2 --dst tp=8,dp=3,attn=dp", out,
                         sizeof(out)), 2, "%s", out);
    cr_assert(strstr(out, "attn=dp needs dp=3 to divide tp=8") != NULL, "%s", out);
    cr_assert_eq(run_ctl("plan --help", out, sizeof(out)), 0);
    cr_assert(strstr(out, "attn=dp is\n") != NULL, "%s", out);
}

/* --colocate: every byte of a colocated refit is local (no link, no staging, one round);
 * --colocate=N puts only engine ranks 0..N-1 on the trainers' machines; --explain shows bytes
 * and messages per path. */
Test(refitctl, plan_colocate_and_paths)
{
    static char out[1 << 16];
    json_t *j, *paths;
    json_error_t je;
    int64_t dst, local = -1, local_msgs = -1;

    cr_assert_eq(run_ctl("plan --model qwen3-30b-a3b --src tp=2,ep=2 --dst tp=4 --colocate "
                         "--json --explain", out, sizeof(out)), 0, "%s", out);
    j = json_loads(out, 0, &je);
    cr_assert_not_null(j, "not JSON: %s (%s)", out, je.text);
    dst = json_integer_value(json_object_get(j, "dst_bytes"));
    cr_assert(dst > 0);
    cr_assert_eq(json_integer_value(json_object_get(j, "local_bytes")), dst);
    cr_assert_eq(json_integer_value(json_object_get(j, "direct_bytes")) +
                 json_integer_value(json_object_get(j, "packed_bytes")), 0);
    cr_assert_eq(json_integer_value(json_object_get(j, "max_link_bytes")), 0);
    cr_assert_eq(json_integer_value(json_object_get(j, "max_staging_bytes")), 0);
    cr_assert_eq(json_integer_value(json_object_get(j, "rounds")), 1);
    cr_assert_eq(json_integer_value(json_object_get(j, "colocated_engines")), 4);
    cr_assert_eq(json_number_value(json_object_get(j, "predicted_network_seconds")), 0.0);
    cr_assert(json_number_value(json_object_get(j, "predicted_local_seconds")) > 0);
    paths = json_object_get(j, "paths");
    cr_assert_eq(json_array_size(paths), 3);
    for (size_t i = 0; i < 3; i++) {
        json_t *p = json_array_get(paths, i);
        if (strcmp(json_string_value(json_object_get(p, "path")), "local") == 0) {
            local = json_integer_value(json_object_get(p, "bytes"));
            local_msgs = json_integer_value(json_object_get(p, "messages"));
        } else {
            cr_assert_eq(json_integer_value(json_object_get(p, "bytes")), 0);
        }
    }
    cr_assert_eq(local, dst);
    cr_assert_eq(local_msgs, json_integer_value(json_object_get(j, "local_messages")));
    cr_assert_eq(local_msgs, json_integer_value(json_object_get(j, "messages")));
    json_decref(j);

    /* Engine DP 4, only its first replica (ranks 0..3) on the trainers' machine. */
    cr_assert_eq(run_ctl("plan --model qwen3-30b-a3b --src tp=2,ep=4,dp=2 --dst tp=4,dp=4 "
                         "--colocate=4 --json", out, sizeof(out)), 0, "%s", out);
    j = json_loads(out, 0, &je);
    cr_assert_not_null(j, "not JSON: %s (%s)", out, je.text);
    dst = json_integer_value(json_object_get(j, "dst_bytes"));
    cr_assert_eq(json_integer_value(json_object_get(j, "local_bytes")) * 4, dst);
    cr_assert_eq(json_integer_value(json_object_get(j, "direct_bytes")) +
                 json_integer_value(json_object_get(j, "packed_bytes")), dst / 4 * 3);
    cr_assert_eq(json_integer_value(json_object_get(j, "colocated_engines")), 4);
    json_decref(j);

    cr_assert_eq(run_ctl("plan --model qwen3-0.6b --src tp=2 --dst tp=2,dp=2 --colocate=2 "
                         "--explain", out, sizeof(out)), 0, "%s", out);
    cr_assert(strstr(out, "colocated    engine ranks 0..1 on their trainer ranks' machines") !=
              NULL, "%s", out);
    cr_assert(strstr(out, "per path:") != NULL, "%s", out);
    cr_assert(strstr(out, "\n  local  ") != NULL, "%s", out);
    cr_assert(strstr(out, "local copies") != NULL, "%s", out);
    cr_assert_eq(run_ctl("plan --help", out, sizeof(out)), 0);
    cr_assert(strstr(out, "--colocate[=N]") != NULL, "%s", out);
    for (size_t i = 0; i < 3; i++) {
        static const char *bad[] = {"--colocate=0", "--colocate=1.5", "--local-gbps 0"};
        char args[256];
        snprintf(args, sizeof(args), "plan --model qwen3-0.6b --src tp=2 --dst tp=2 %s", bad[i]);
        cr_assert_eq(run_ctl(args, out, sizeof(out)), 2, "%s: %s", bad[i], out);
        cr_assert(strchr(out, '\n') == strrchr(out, '\n'), "one line expected: %s", out);
    }
}

Test(refitctl, bad_layout_exits_2)
{
    static char out[1 << 16];

    cr_assert_eq(run_ctl("plan --model qwen3-0.6b --src tp=3 --dst tp=2", out, sizeof(out)), 2,
                 "%s", out);
    cr_assert(strchr(out, '\n') == strrchr(out, '\n'), "one line expected: %s", out);
    cr_assert_eq(run_ctl("plan --model qwen3-30b-a3b --src tp=2,ep=4,dp=2 --dst tp=2,dp=4,ep=4",
                         out, sizeof(out)), 2, "%s", out);
    cr_assert(strstr(out, "or equal tp*dp=8") != NULL, "%s", out);
    cr_assert_eq(run_ctl("plan --model no-such-model --src tp=1 --dst tp=1", out, sizeof(out)), 2,
                 "%s", out);
    cr_assert_eq(run_ctl("plan --model qwen3-0.6b --src tp=1 --dst tp=1 --staging-mib 0", out,
                         sizeof(out)), 2, "%s", out);
    cr_assert_eq(run_ctl("plan --src tp=1 --dst tp=1", out, sizeof(out)), 2, "%s", out);
}

/* ---- relays (rf_plan_opts.relay) -------------------------------------------------------- */

/* Runs pl on c's memory round by round as the ordering rule of plan.h allows and no more:
 * every message of a round first reads all it sends (from source memory, or for a relay from
 * the destination memory of its source piece), then all of them write. A relay that read
 * bytes its source receives only in its own round or later would forward the zeros the
 * destination regions start with, and check_destinations would see them. */
static void relay_exec(cluster *c, const rf_plan *pl)
{
    const rf_inv *inv = c->inv;
    uint32_t nm = rf_plan_nmsgs(pl);

    fill_sources(c);
    for (uint32_t a = 0, z; a < nm; a = z) {
        uint32_t r = rf_plan_msg_at(pl, a)->round;
        uint64_t x0 = rf_plan_msg_at(pl, a)->first, x1;
        uint8_t **buf;
        for (z = a; z < nm && rf_plan_msg_at(pl, z)->round == r; z++)
            ;
        x1 = rf_plan_msg_at(pl, z - 1)->first + rf_plan_msg_at(pl, z - 1)->count;
        buf = calloc(x1 - x0 + 1, sizeof(*buf));
        cr_assert_not_null(buf);
        for (int write = 0; write < 2; write++) {
            for (uint64_t i = x0; i < x1; i++) {
                const rf_plan_xfer *x = rf_plan_xfer_at(pl, i);
                const rf_box *b = rf_plan_box(pl, x->box);
                rf_side sside = rf_plan_msg_at(pl, x->msg)->relay ? RF_DST : RF_SRC;
                rf_piece sp, dp;
                uint64_t o = 0;
                rf_inv_piece(inv, sside, x->src, &sp);
                rf_inv_piece(inv, RF_DST, x->dst, &dp);
                const rf_tensor *t = rf_inv_tensor(inv, dp.tensor);
                size_t es = rf_dtype_size(t->dtype);
                if (!write)
                    buf[i - x0] = malloc(x->bytes + 1);
                FOR_EACH_INDEX(b, t->ndim, idx) {
                    if (write)
                        memcpy(c->bases[dp.region] + rf_piece_byte_offset(&dp, t->ndim, es, idx),
                               buf[i - x0] + o, es);
                    else
                        memcpy(buf[i - x0] + o,
                               c->bases[sp.region] + rf_piece_byte_offset(&sp, t->ndim, es, idx),
                               es);
                    o += es;
                }
                cr_assert_eq(o, x->bytes);
                if (write)
                    free(buf[i - x0]);
            }
        }
        free(buf);
    }
    check_destinations(c);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

    return (x > y) - (x < y);
}

/* The ordering rule checked from the plan alone, by boxes: the transfers into the source
 * piece of each relay transfer, in rounds before the relay's, cover its box (the writes into
 * a piece are disjoint, check_plan makes sure, so covering means the volumes add up). Also:
 * hop counts chain (a relay of h hops reads bytes that came in h - 1), locally copied bytes
 * are never relayed, and no holder feeds one chunk (source piece and box) to more than
 * RF_PLAN_RELAY_FANOUT replicas, the most any does being the plan's relay_fanout. */
static void check_relay_order(const rf_plan *pl)
{
    const rf_inv *inv = rf_plan_inv(pl);
    uint32_t nd = rf_inv_npieces(inv, RF_DST);
    uint64_t n = rf_plan_nxfers(pl), *first = calloc((size_t)nd + 2, sizeof(uint64_t));
    uint64_t *by = malloc((n + 1) * sizeof(uint64_t)), relays = 0;
    uint64_t *feeds = malloc((n + 1) * sizeof(uint64_t)), maxfan = 0;

    cr_assert(first && by && feeds);
    for (uint64_t i = 0; i < n; i++)
        first[rf_plan_xfer_at(pl, i)->dst + 2]++;
    for (uint32_t p = 0; p < nd; p++)
        first[p + 2] += first[p + 1];
    for (uint64_t i = 0; i < n; i++)
        by[first[rf_plan_xfer_at(pl, i)->dst + 1]++] = i;
    for (uint64_t i = 0; i < n; i++) {
        const rf_plan_xfer *x = rf_plan_xfer_at(pl, i);
        const rf_plan_msg *m = rf_plan_msg_at(pl, x->msg);
        const rf_box *b = rf_plan_box(pl, x->box);
        int ndim = rf_inv_tensor(inv, rf_inv_piece_tensor(inv, RF_DST, x->dst))->ndim;
        int64_t need = rf_box_numel(b, ndim), got = 0;
        if (!m->relay)
            continue;
        feeds[relays++] = (uint64_t)x->src << 32 | x->box;
        cr_assert_neq(m->kind, RF_PLAN_LOCAL);
        for (uint64_t k = first[x->src]; k < first[x->src + 1]; k++) {
            const rf_plan_xfer *w = rf_plan_xfer_at(pl, by[k]);
            const rf_plan_msg *wm = rf_plan_msg_at(pl, w->msg);
            rf_box cut;
            if (!rf_box_intersect(rf_plan_box(pl, w->box), b, ndim, &cut))
                continue;
            cr_assert(wm->round < m->round, "relay in round %u reads bytes written in round %u",
                      m->round, wm->round);
            cr_assert_eq(wm->relay + 1, m->relay, "a relay of %u hops reads bytes of %u hops",
                         m->relay, wm->relay);
            cr_assert_neq(wm->kind, RF_PLAN_LOCAL, "a relay forwards locally copied bytes");
            got += rf_box_numel(&cut, ndim);
        }
        cr_assert_eq(got, need, "relay box of %lld elements covered by %lld written before",
                     (long long)need, (long long)got);
    }
    cr_assert_eq(relays, rf_plan_stats_get(pl)->relay_transfers);
    qsort(feeds, relays, sizeof(*feeds), cmp_u64);
    for (uint64_t a = 0, z; a < relays; a = z) {
        for (z = a + 1; z < relays && feeds[z] == feeds[a]; z++)
            ;
        maxfan = z - a > maxfan ? z - a : maxfan;
    }
    cr_assert(maxfan <= RF_PLAN_RELAY_FANOUT, "a chunk fed to %llu replicas by one holder",
              (unsigned long long)maxfan);
    cr_assert_eq(maxfan, rf_plan_stats_get(pl)->relay_fanout);
    free(first);
    free(by);
    free(feeds);
}

/* The relay trees (rf_plan_chunk) that the end-to-end verification rests on: every relay
 * transfer is in exactly one tree, and so is every origin; a tree's relays all move one box
 * into distinct replicas other than its root, each reading the root or another replica of the
 * tree; its origins are the root's transfers from the sources, and their boxes tile that box
 * (check_plan proved writes into a piece disjoint, so volumes adding up means a tiling). */
static void check_relay_trees(const rf_plan *pl)
{
    const rf_inv *inv = rf_plan_inv(pl);
    uint64_t n = rf_plan_nxfers(pl), relays = 0;
    uint8_t *seen = calloc(n + 1, 1);
    const uint32_t *o, *r;
    uint32_t no, nr;

    cr_assert_not_null(seen);
    for (uint32_t c = 0; c < rf_plan_nchunks(pl); c++) {
        const rf_plan_xfer *x0;
        const rf_box *b;
        int64_t need, got = 0;
        int nd;

        rf_plan_chunk(pl, c, &o, &no, &r, &nr);
        cr_assert(no > 0 && nr > 0, "tree %u has %u origins and %u relays", c, no, nr);
        x0 = rf_plan_xfer_at(pl, r[0]);
        b = rf_plan_box(pl, x0->box);
        nd = rf_inv_tensor(inv, rf_inv_piece_tensor(inv, RF_DST, x0->dst))->ndim;
        need = rf_box_numel(b, nd);
        for (uint32_t k = 0; k < no; k++) {
            const rf_plan_xfer *x = rf_plan_xfer_at(pl, o[k]);
            const rf_plan_xfer *y = rf_plan_xfer_at(pl, o[0]);

            cr_assert(!seen[o[k]], "transfer %u is in two trees", o[k]);
            seen[o[k]] = 1;
            cr_assert_eq(rf_plan_xfer_chunk(pl, o[k]), c);
            cr_assert_eq(rf_plan_msg_at(pl, x->msg)->relay, 0, "an origin is a relay");
            cr_assert_eq(x->dst, y->dst, "the origins of tree %u feed two pieces", c);
            cr_assert(rf_box_contains(b, rf_plan_box(pl, x->box), nd),
                      "an origin of tree %u lies outside its box", c);
            got += rf_box_numel(rf_plan_box(pl, x->box), nd);
        }
        cr_assert_eq(got, need, "tree %u: origins of %lld elements for a box of %lld", c,
                     (long long)got, (long long)need);
        for (uint32_t k = 0; k < nr; k++) {
            const rf_plan_xfer *x = rf_plan_xfer_at(pl, r[k]);
            bool fed = x->src == rf_plan_xfer_at(pl, o[0])->dst;

            cr_assert(!seen[r[k]], "transfer %u is in two trees", r[k]);
            seen[r[k]] = 1;
            relays++;
            cr_assert_eq(rf_plan_xfer_chunk(pl, r[k]), c);
            cr_assert_neq(rf_plan_msg_at(pl, x->msg)->relay, 0, "a relay of tree %u is not", c);
            cr_assert(rf_box_equal(rf_plan_box(pl, x->box), b, nd), "tree %u moves two boxes", c);
            cr_assert_neq(x->dst, rf_plan_xfer_at(pl, o[0])->dst, "a relay into the root");
            for (uint32_t j = 0; j < nr; j++) {
                cr_assert(j == k || rf_plan_xfer_at(pl, r[j])->dst != x->dst,
                          "tree %u feeds one replica twice", c);
                fed |= rf_plan_xfer_at(pl, r[j])->dst == x->src;
            }
            cr_assert(fed, "a relay of tree %u reads a piece outside the tree", c);
        }
    }
    for (uint64_t i = 0; i < n; i++)
        cr_assert(seen[i] || (!rf_plan_msg_at(pl, rf_plan_xfer_at(pl, i)->msg)->relay &&
                              rf_plan_xfer_chunk(pl, i) == RF_PLAN_NO_CHUNK),
                  "transfer %llu is in no tree", (unsigned long long)i);
    cr_assert_eq(relays, rf_plan_stats_get(pl)->relay_transfers);
    rf_plan_chunk(pl, rf_plan_nchunks(pl), &o, &no, &r, &nr);
    cr_assert(o == NULL && r == NULL && no == 0 && nr == 0);
    free(seen);
}

/* max over endpoints of max(bytes sent, bytes received): the busiest link. */
static uint64_t busiest(const rf_plan *pl)
{
    uint64_t mx = 0;

    for (uint32_t e = 0; e < rf_inv_nendpoints(rf_plan_inv(pl)); e++) {
        uint64_t s = rf_plan_sent_bytes(pl, e), r = rf_plan_recv_bytes(pl, e);
        mx = s > mx ? s : mx;
        mx = r > mx ? r : mx;
    }
    return mx;
}

/* FNV-1a over every field a plan had before relays existed, of its messages and transfers. */
static uint64_t moves_digest(const rf_plan *pl)
{
    uint64_t h = 1469598103934665603ull;
#define MIX(v)                                                                                 \
    for (int _i = 0; _i < 8; _i++) {                                                           \
        h ^= ((uint64_t)(v) >> (8 * _i)) & 0xff;                                               \
        h *= 1099511628211ull;                                                                 \
    }
    for (uint32_t i = 0; i < rf_plan_nmsgs(pl); i++) {
        const rf_plan_msg *x = rf_plan_msg_at(pl, i);
        MIX(x->src_ep) MIX(x->dst_ep) MIX(x->round) MIX(x->kind) MIX(x->first) MIX(x->count)
        MIX(x->bytes)
    }
    for (uint64_t i = 0; i < rf_plan_nxfers(pl); i++) {
        const rf_plan_xfer *x = rf_plan_xfer_at(pl, i);
        const rf_box *b = rf_plan_box(pl, x->box);
        MIX(x->src) MIX(x->dst) MIX(x->msg) MIX(x->msg_off) MIX(x->bytes)
        for (int d = 0; d < RF_MAX_DIMS; d++) {
            MIX(b->start[d]) MIX(b->extent[d])
        }
    }
#undef MIX
    return h;
}

/* Relay off (the default, and what a zeroed option says) plans exactly as the planner did
 * before relays existed: these digests of every message and transfer were recorded from the
 * planner at 104387a (the commit before relays; same fields, same inventories). */
Test(plan_relay, off_keeps_the_plans_from_before_relays, .timeout = 60)
{
    static const struct {
        const char *model;
        int shrink;
        const char *src, *dst;
        uint32_t msgs;
        uint64_t xfers, digest;
    } cases[] = {
        {"qwen3-30b-a3b", 64, "tp=2,ep=4,dp=2", "tp=4,dp=4", 4206, 301880, 0x3924110cf456754dull},
        {"qwen3-0.6b", 8, "tp=2,pp=2", "tp=2,dp=2", 1807, 2250, 0x3519eda48d65e16dull},
    };

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        rf_model *m = NULL;
        rf_inv *inv = model_inv(cases[i].model, cases[i].shrink, cases[i].src, cases[i].dst, &m);
        rf_plan_opts o = {.staging_bytes = 1 << 16, .direct_min_bytes = 4096};
        rf_plan *pl = NULL;
        rf_err err;

        cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
        cr_assert_eq(rf_plan_nmsgs(pl), cases[i].msgs);
        cr_assert_eq(rf_plan_nxfers(pl), cases[i].xfers);
        cr_assert_eq(moves_digest(pl), cases[i].digest, "%s: moves changed with relay off",
                     cases[i].model);
        for (uint32_t k = 0; k < rf_plan_nmsgs(pl); k++)
            cr_assert_eq(rf_plan_msg_at(pl, k)->relay, 0);
        cr_assert_eq(rf_plan_stats_get(pl)->relay_bytes, 0);
        cr_assert_eq(rf_plan_nchunks(pl), 0);
        cr_assert_eq(rf_plan_xfer_chunk(pl, 0), RF_PLAN_NO_CHUNK);
        cr_assert_eq(rf_plan_stats_get(pl)->source_bytes, rf_plan_stats_get(pl)->dst_bytes);
        rf_plan_free(pl);
        rf_inv_free(inv);
        rf_model_free(m);
    }
    {
        rf_plan_opts d;
        rf_plan_opts_default(&d);
        cr_assert_eq(d.relay, 0, "relays are off by default");
    }
}

/* Relay on is in the id (off is not: see no_host_plan_id_unchanged), and a plan with relays
 * is deterministic. */
Test(plan_relay, id_covers_relay_and_builds_agree)
{
    cluster c;
    rf_plan_opts o = {.staging_bytes = 8192, .direct_min_bytes = 1024}, on = o;
    uint8_t a[RF_PLAN_ID_BYTES], b[RF_PLAN_ID_BYTES];
    rf_plan *p1 = NULL, *p2 = NULL;
    rf_err err;

    on.relay = 1;
    host_cluster(&c, 2, (const int[]){2, 2}, 3, NULL, NULL);
    rf_plan_digest(c.inv, &o, a);
    rf_plan_digest(c.inv, &on, b);
    cr_assert_neq(memcmp(a, b, sizeof(a)), 0, "relay on must change the plan id");
    cluster_free(&c);

    /* Engine DP 4 of a model: replicas relay; two builds are the same plan. */
    rf_model *m = NULL;
    rf_inv *inv = model_inv("qwen3-30b-a3b", 64, "tp=2,ep=4,dp=2", "tp=4,dp=4", &m);
    on = (rf_plan_opts){.staging_bytes = 1 << 16, .direct_min_bytes = 4096, .relay = 1};
    cr_assert_eq(rf_plan_build(inv, &on, &p1, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_build(inv, &on, &p2, &err), 0, "%s", err.msg);
    cr_assert(rf_plan_stats_get(p1)->relay_transfers > 0);
    check_same(p1, p2);
    rf_plan_free(p1);
    rf_plan_free(p2);
    rf_inv_free(inv);
    rf_model_free(m);
}

Test(plan_relay, bad_option_refused)
{
    cluster c;
    rf_plan_opts o = {.staging_bytes = 8192, .direct_min_bytes = 1024, .relay = 2};
    rf_plan *pl = NULL;
    rf_err err;

    host_cluster(&c, 1, (const int[]){2}, 2, NULL, NULL);
    cr_assert_eq(rf_plan_build(c.inv, &o, &pl, &err), -EINVAL);
    cr_assert_null(pl);
    cr_assert(strstr(err.msg, "relay is 2; give 0 (off) or 1") != NULL, "%s", err.msg);
    cluster_free(&c);
}

/* Random meshes (replicated placements give replicas on several destination endpoints) with
 * relays: exact cover, the ordering rule by boxes, executed round by round byte for byte,
 * deterministic; staging within budget (check_plan). */
Test(plan_relay, random_layouts_execute_in_round_order, .timeout = 120)
{
    static const rf_plan_opts optsets[] = {
        {.staging_bytes = 256ull << 20, .direct_min_bytes = 4ull << 20, .relay = 1},
        {.staging_bytes = 4096, .direct_min_bytes = 64, .relay = 1},
        {.staging_bytes = 8192, .direct_min_bytes = 1, .relay = 1},
    };
    uint64_t relayed = 0;

    for (uint64_t seed = 1; seed <= 150; seed++) {
        const rf_plan_opts *o = &optsets[seed % 3];
        cluster c;
        rf_plan *a = NULL, *b = NULL;
        rf_err err;
        random_cluster(&c, seed);
        cr_assert_eq(rf_plan_build(c.inv, o, &a, &err), 0, "seed %llu: %s",
                     (unsigned long long)seed, err.msg);
        check_plan(a, o);
        check_relay_order(a);
        check_relay_trees(a);
        relay_exec(&c, a);
        /* Every third seed again through the tables for very large inventories (relay links
         * and open relay messages in hash tables, no geometry cache): the same plan. */
        if (seed % 3 == 1)
            rf_plan__set_limits(0, 0);
        cr_assert_eq(rf_plan_build(c.inv, o, &b, &err), 0, "%s", err.msg);
        rf_plan__set_limits(256ull << 20, 1ull << 22);
        check_same(a, b);
        cr_assert_eq(rf_plan_stats_get(a)->max_link_bytes, rf_plan_stats_get(b)->max_link_bytes);
        relayed += rf_plan_stats_get(a)->relay_bytes;
        cr_assert(rf_plan_stats_get(a)->max_staging_bytes <= o->staging_bytes / 2);
        rf_plan_free(a);
        rf_plan_free(b);
        cluster_free(&c);
    }
    cr_assert(relayed > 0, "no random layout relayed anything");
}

/* A dp-replicated engine (qwen3-30b-a3b shrunk, trainers tp=2,ep=4,dp=2, engines tp=4,dp=4):
 * with relays the busiest link carries less, trainers send each byte of the model once (the
 * norms every TP rank holds whole are relayed too), the prediction is within 1.2x the ingress floor, and the plan runs
 * right round by round. */
Test(plan_relay, dp_replicas_busiest_link_reduced, .timeout = 60)
{
    rf_model *m = NULL;
    rf_inv *inv = model_inv("qwen3-30b-a3b", 64, "tp=2,ep=4,dp=2", "tp=4,dp=4", &m);
    rf_plan_opts off = {.staging_bytes = 1 << 16, .direct_min_bytes = 4096}, on = off;
    rf_plan *p0 = NULL, *p1 = NULL;
    rf_plan_time t0, t1;
    cluster c = {.inv = inv};
    rf_err err;

    on.relay = 1;
    cr_assert_eq(rf_plan_build(inv, &off, &p0, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_plan_build(inv, &on, &p1, &err), 0, "%s", err.msg);
    check_plan(p1, &on);
    check_relay_order(p1);
    check_relay_trees(p1);
    cr_assert(busiest(p1) * 3 < busiest(p0), "busiest link %llu with relays, %llu without",
              (unsigned long long)busiest(p1), (unsigned long long)busiest(p0));
    cr_assert_eq(rf_plan_stats_get(p1)->source_bytes, rf_model_bytes(m),
                 "trainers send %llu bytes of a %llu-byte model",
                 (unsigned long long)rf_plan_stats_get(p1)->source_bytes,
                 (unsigned long long)rf_model_bytes(m));
    cr_assert_eq(rf_plan_stats_get(p1)->dst_bytes, rf_plan_stats_get(p0)->dst_bytes);
    rf_plan_predict(p0, 50e9, 400e9, &t0);
    rf_plan_predict(p1, 50e9, 400e9, &t1);
    cr_assert_eq(t0.floor_s, t1.floor_s);
    cr_assert(t0.predicted_s > 3.5 * t0.floor_s, "without relays %.6f s, floor %.6f s",
              t0.predicted_s, t0.floor_s);
    cr_assert(t1.predicted_s <= 1.2 * t1.floor_s, "with relays %.6f s, floor %.6f s",
              t1.predicted_s, t1.floor_s);
    c.nregions = rf_inv_nregions(inv);
    c.bases = calloc(c.nregions, sizeof(*c.bases));
    for (uint32_t r = 0; r < c.nregions; r++)
        c.bases[r] = calloc(rf_inv_region(inv, r)->size + 1, 1);
    relay_exec(&c, p1);
    rf_plan_free(p0);
    rf_plan_free(p1);
    cluster_free(&c);
    rf_model_free(m);
}

/* One trainer, four engine replicas of one 64 x 64 fp32 tensor (16 KiB), half a staging
 * budget of 4 KiB: chunks of 4 KiB, each with its own tree, and a replica forwards a chunk
 * before its own copy is complete (the pipeline). */
Test(plan_relay, chunks_pipeline)
{
    cluster c;
    rf_plan_opts o = {.staging_bytes = 8192, .direct_min_bytes = 1 << 20, .relay = 1};
    int64_t shape[2] = {64, 64};
    uint32_t tid, seps[1], deps[4];
    hpiece *sp = NULL, *dp = NULL;
    size_t ns = 0, nd = 0;
    rf_box full;
    rf_plan *pl = NULL;
    rf_err err;
    uint32_t last_in[4] = {0}, first_out[4];

    memset(&c, 0, sizeof(c));
    c.inv = rf_inv_new();
    cr_assert_eq(rf_inv_add_tensor(c.inv, "w", RF_DT_FP32, 2, shape, &tid, &err), 0);
    cr_assert_eq(rf_inv_add_endpoint(c.inv, RF_SRC, 0, &seps[0], &err), 0);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(rf_inv_add_endpoint(c.inv, RF_DST, 1 + (uint32_t)i, &deps[i], &err), 0);
    rf_box_full(&full, 2, shape);
    add_hpiece(&sp, &ns, tid, 0, 2, &full, 0, 4);
    for (uint32_t i = 0; i < 4; i++)
        add_hpiece(&dp, &nd, tid, i, 2, &full, 0, 4);
    place(&c, sp, ns, seps, 1, RF_SRC);
    place(&c, dp, nd, deps, 4, RF_DST);
    cr_assert_eq(rf_plan_build(c.inv, &o, &pl, &err), 0, "%s", err.msg);
    check_plan(pl, &o);
    check_relay_order(pl);
    check_relay_trees(pl);
    const rf_plan_stats *st = rf_plan_stats_get(pl);
    cr_assert_eq(st->source_bytes, 64 * 64 * 4, "the trainer sends the tensor once");
    cr_assert_eq(st->relay_bytes, 3 * 64 * 64 * 4);
    cr_assert_eq(st->relay_chunk_bytes, 4096);
    cr_assert(st->relay_depth >= 1);
    memset(first_out, 0xff, sizeof(first_out));
    for (uint32_t mi = 0; mi < rf_plan_nmsgs(pl); mi++) {
        const rf_plan_msg *m = rf_plan_msg_at(pl, mi);
        uint32_t d = m->dst_ep - deps[0];
        if (m->round > last_in[d])
            last_in[d] = m->round;
        if (m->relay && m->round < first_out[m->src_ep - deps[0]])
            first_out[m->src_ep - deps[0]] = m->round;
    }
    {
        int pipelined = 0;
        for (int i = 0; i < 4; i++)
            pipelined += first_out[i] != UINT32_MAX && first_out[i] < last_in[i];
        cr_assert(pipelined > 0, "no replica forwards before it has received everything");
    }
    relay_exec(&c, pl);
    rf_plan_free(pl);
    free(sp);
    free(dp);
    cluster_free(&c);
}

/* One trainer, 21 engine replicas of 8 tensors: each chunk goes down a tree of at most
 * RF_PLAN_RELAY_FANOUT children per holder (21 = 1 + 4 + 16: two hops when every holder has
 * room), no endpoint sends more than the most any receives, and the roots rotate so that
 * the trainer sends each tensor about once. */
Test(plan_relay, many_replicas_form_a_tree)
{
    cluster c;
    rf_plan_opts o = {.staging_bytes = 1 << 16, .direct_min_bytes = 512, .relay = 1};
    int64_t shape[2] = {16, 16};
    uint32_t seps[1], deps[21];
    hpiece *sp = NULL, *dp = NULL;
    size_t ns = 0, nd = 0;
    rf_box full;
    rf_plan *pl = NULL;
    rf_err err;
    uint64_t maxrecv = 0;

    memset(&c, 0, sizeof(c));
    c.inv = rf_inv_new();
    cr_assert_eq(rf_inv_add_endpoint(c.inv, RF_SRC, 0, &seps[0], &err), 0);
    for (int i = 0; i < 21; i++)
        cr_assert_eq(rf_inv_add_endpoint(c.inv, RF_DST, 1 + (uint32_t)i, &deps[i], &err), 0);
    rf_box_full(&full, 2, shape);
    for (int t = 0; t < 8; t++) {
        char name[32];
        uint32_t tid;
        snprintf(name, sizeof(name), "model.layers.%d.w", t);
        cr_assert_eq(rf_inv_add_tensor(c.inv, name, RF_DT_FP32, 2, shape, &tid, &err), 0);
        add_hpiece(&sp, &ns, tid, 0, 2, &full, 0, 4);
        for (uint32_t i = 0; i < 21; i++)
            add_hpiece(&dp, &nd, tid, i, 2, &full, 0, 4);
    }
    place(&c, sp, ns, seps, 1, RF_SRC);
    place(&c, dp, nd, deps, 21, RF_DST);
    cr_assert_eq(rf_plan_build(c.inv, &o, &pl, &err), 0, "%s", err.msg);
    check_plan(pl, &o);
    check_relay_order(pl);
    check_relay_trees(pl);
    const rf_plan_stats *st = rf_plan_stats_get(pl);
    cr_assert_eq(st->relay_fanout, RF_PLAN_RELAY_FANOUT);
    cr_assert(st->relay_depth >= 2);
    for (int i = 0; i < 21; i++)
        maxrecv = rf_plan_recv_bytes(pl, deps[i]) > maxrecv ? rf_plan_recv_bytes(pl, deps[i])
                                                            : maxrecv;
    cr_assert_eq(busiest(pl), maxrecv, "an endpoint sends more than the most one receives");
    cr_assert(st->source_bytes <= 2 * 8 * 16 * 16 * 4, "the trainer sends %llu bytes",
              (unsigned long long)st->source_bytes);
    relay_exec(&c, pl);
    rf_plan_free(pl);
    free(sp);
    free(dp);
    cluster_free(&c);
}

/* Same-host copies stay: trainers tp=2 and the first of three engine replicas (tp=2) on
 * host 7, the other replicas on hosts 8 and 9. The first replica copies everything locally
 * and relays nothing (its copies run beside the rounds, which do not order them); the other
 * two are fed over the network, one of them by relays. */
Test(plan_relay, local_copies_stay_and_do_not_relay, .timeout = 60)
{
    rf_model *m = NULL;
    rf_inv *inv = model_inv("qwen3-0.6b", 8, "tp=2", "tp=2,dp=3", &m);
    rf_plan_opts o = {.staging_bytes = 1 << 16, .direct_min_bytes = 4096, .relay = 1};
    static const uint32_t host[8] = {7, 7, 7, 7, 8, 8, 9, 9};
    cluster c = {.inv = inv};
    rf_plan *pl = NULL;
    rf_err err;

    cr_assert_eq(rf_inv_nendpoints(inv), 8);
    for (uint32_t e = 0; e < 8; e++) {
        cr_assert_eq(rf_inv_endpoint(inv, e)->side, e < 2 ? RF_SRC : RF_DST);
        cr_assert_eq(rf_inv_set_endpoint_host(inv, e, host[e], &err), 0);
    }
    cr_assert_eq(rf_plan_build(inv, &o, &pl, &err), 0, "%s", err.msg);
    check_plan(pl, &o);
    check_relay_order(pl);
    check_relay_trees(pl);
    for (uint32_t mi = 0; mi < rf_plan_nmsgs(pl); mi++) {
        const rf_plan_msg *m2 = rf_plan_msg_at(pl, mi);
        if (m2->relay)
            cr_assert_neq(host[m2->src_ep], 7, "an engine on the trainers' host relays");
    }
    const rf_plan_stats *st = rf_plan_stats_get(pl);
    cr_assert_eq(st->local_bytes * 3, st->dst_bytes);
    cr_assert(st->relay_bytes > 0);
    cr_assert_eq(rf_plan_sent_bytes(pl, 2) + rf_plan_sent_bytes(pl, 3), 0);
    c.nregions = rf_inv_nregions(inv);
    c.bases = calloc(c.nregions, sizeof(*c.bases));
    for (uint32_t r = 0; r < c.nregions; r++)
        c.bases[r] = calloc(rf_inv_region(inv, r)->size + 1, 1);
    relay_exec(&c, pl);
    rf_plan_free(pl);
    cluster_free(&c);
    rf_model_free(m);
}

/* refitctl plan --relay: the case, from 4.0x its floor to within 1.2x, with the
 * relay structure in --explain and in --json. */
Test(refitctl, plan_relay_explain_and_json)
{
    static char out[1 << 16];
    json_t *j, *rs;
    json_error_t je;

    cr_assert_eq(run_ctl("plan --model qwen3-30b-a3b --src tp=2,ep=4,dp=2 --dst tp=4,dp=4", out,
                         sizeof(out)), 0, "%s", out);
    cr_assert(strstr(out, "predicted    1.226 s at 400 Gbit/s per GPU") != NULL, "%s", out);
    cr_assert(strstr(out, "floor        0.306 s") != NULL, "%s", out);
    cr_assert(strstr(out, "predicted / floor 4.0") != NULL, "%s", out);
    cr_assert_eq(run_ctl("plan --model qwen3-30b-a3b --src tp=2,ep=4,dp=2 --dst tp=4,dp=4 "
                         "--relay --explain", out, sizeof(out)), 0, "%s", out);
    cr_assert(strstr(out, "relays       trainers send 56.87 GiB") != NULL, "%s", out);
    cr_assert(strstr(out, "\nrelays:\n") != NULL, "%s", out);
    cr_assert(strstr(out, "hops deep, up to ") != NULL, "%s", out);
    cr_assert(strstr(out, "received by hops from a trainer: 0: ") != NULL, "%s", out);
    cr_assert(strstr(out, "predicted / floor 1.0") != NULL, "%s", out);
    cr_assert_eq(run_ctl("plan --model qwen3-30b-a3b --src tp=2,ep=4,dp=2 --dst tp=4,dp=4 "
                         "--relay --explain --json", out, sizeof(out)), 0, "%s", out);
    j = json_loads(out, 0, &je);
    cr_assert_not_null(j, "not JSON: %s (%s)", out, je.text);
    cr_assert(json_is_true(json_object_get(j, "relay")));
    cr_assert(json_number_value(json_object_get(j, "predicted_over_floor")) <= 1.2);
    cr_assert(json_number_value(json_object_get(j, "floor_seconds")) > 0.3);
    cr_assert(json_integer_value(json_object_get(j, "relay_bytes")) > 0);
    rs = json_object_get(j, "relay_structure");
    cr_assert_not_null(rs);
    cr_assert_eq(json_integer_value(json_object_get(rs, "source_bytes")),
                 json_integer_value(json_object_get(j, "source_bytes")));
    cr_assert(json_integer_value(json_object_get(rs, "depth")) >= 1);
    cr_assert(json_integer_value(json_object_get(rs, "fanout")) >= 1);
    cr_assert(json_integer_value(json_object_get(rs, "fanout")) <= RF_PLAN_RELAY_FANOUT);
    cr_assert(json_array_size(json_object_get(rs, "bytes_by_hops")) >= 2);
    json_decref(j);
    /* The first engine replica on the trainers' machine copies locally, the other three
     * are fed by the network and relays, within 1.2x the floor where without relays the
     * trainers' links made it 3x. */
    cr_assert_eq(run_ctl("plan --model qwen3-30b-a3b --src tp=2,ep=4,dp=2 --dst tp=4,dp=4 "
                         "--colocate=4 --relay --json", out, sizeof(out)), 0, "%s", out);
    j = json_loads(out, 0, &je);
    cr_assert_not_null(j, "not JSON: %s (%s)", out, je.text);
    cr_assert_eq(json_integer_value(json_object_get(j, "local_bytes")) * 4,
                 json_integer_value(json_object_get(j, "dst_bytes")));
    cr_assert(json_integer_value(json_object_get(j, "relay_bytes")) > 0);
    cr_assert(json_number_value(json_object_get(j, "predicted_over_floor")) <= 1.2);
    json_decref(j);
    cr_assert_eq(run_ctl("plan --help", out, sizeof(out)), 0);
    cr_assert(strstr(out, "--relay") != NULL, "%s", out);
}

/* Two tp=4 trainer replicas: one with all four ranks on node 0, one with a rank on each of
 * nodes 1-4; two engines (nodes 100, 101), so ten links. Every sender holds a quarter, so
 * balancing the senders alone puts about half the bytes on node 0's two links (3.8 times a
 * link's share here); the replica choice weighs the link's load too, so no link carries more
 * than twice its share (the cells of the largest tensor are the granularity). */
Test(plan, replica_choice_spreads_the_bytes_over_the_links)
{
    static const uint32_t snode[8] = {0, 0, 0, 0, 1, 2, 3, 4};
    const uint32_t nlinks = 5 * 2; /* nodes 0-4 to each engine's node */
    rf_plan_opts o = {.staging_bytes = 8192, .direct_min_bytes = 1024};
    cluster c;
    rf_plan *pl = NULL;
    rf_err err;
    const rf_plan_stats *st;
    uint64_t net, bound;

    node_cluster(&c, 2, (const int[]){4, 4}, snode, 2, NULL, NULL);
    cr_assert_eq(rf_plan_build(c.inv, &o, &pl, &err), 0, "%s", err.msg);
    check_plan(pl, &o);
    st = rf_plan_stats_get(pl);
    net = st->direct_bytes + st->packed_bytes;
    cr_assert_eq(net, st->dst_bytes, "every byte goes over the network here");
    bound = net / nlinks * 2;
    cr_assert(st->max_link_bytes <= bound, "busiest link carries %llu of %llu bytes over %u "
              "links (bound %llu)", (unsigned long long)st->max_link_bytes,
              (unsigned long long)net, nlinks, (unsigned long long)bound);
    execute_check(&c, pl);
    rf_plan_free(pl);
    cluster_free(&c);
}
