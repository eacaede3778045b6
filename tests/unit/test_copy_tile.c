/* tests/unit/test_copy_tile.c - the choice of the GPU's tiled (transposing) copy path on a table
 * of layouts, and the two views it is made on checked against the host copy byte for byte: a
 * gather or scatter descriptor as a pair with staging, and a pair reordered so that dims both
 * sides hold contiguous join the run. Host only: runs without CUDA. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdlib.h>
#include <string.h>

#include "copy.h"
#include "copy_tile.h"
#include "tile_shapes.h"

/* One layout pair: a box of ext held in src_ord / dst_ord order (padded by pad on the source's
 * innermost dim), and what the choice must be. */
typedef struct tile_case {
    char name[48]; /* no pointer: Criterion's workers may not share this process's addresses */
    uint32_t es;
    int ndim;
    int64_t ext[4];
    int src_ord[4], dst_ord[4];
    int64_t pad;
    uint64_t src_off;
    bool tiled;
    int a, b;       /* dims of the reduced walk */
    uint32_t unit;
    uint64_t tiles;
    bool flush;     /* the box fills both pieces (else margins of 1 and 2 elements around it) */
} tile_case;

static const tile_case cases[] = {
    /* A weight the trainer holds transposed, copied into row-major memory. */
    {"2-D transposed source", 2, 2, {67, 131}, {1, 0}, {0, 1}, 0, 0, true, 0, 1, 2, 2 * 3, false},
    {"2-D transposed destination", 4, 2, {64, 64}, {0, 1}, {1, 0}, 0, 0, true, 1, 0, 4, 1, false},
    {"1-byte elements, padded", 1, 2, {130, 70}, {1, 0}, {0, 1}, 5, 0, true, 0, 1, 1, 3 * 2,
     false},
    {"8-byte elements: 32-unit tiles", 8, 2, {40, 33}, {1, 0}, {0, 1}, 0, 0, true, 0, 1, 8,
     2 * 2, false},
    {"16-byte elements", 16, 2, {33, 257}, {1, 0}, {0, 1}, 0, 0, true, 0, 1, 16, 2 * 9, false},
    /* Experts each transposed: the expert dim is walked around the tiles. */
    {"3-D per-expert transposed", 2, 3, {5, 70, 33}, {0, 2, 1}, {0, 1, 2}, 0, 0, true, 1, 2, 2,
     5 * 2 * 1, false},
    {"3-D reversed source", 4, 3, {12, 40, 90}, {2, 1, 0}, {0, 1, 2}, 0, 0, true, 0, 2, 4,
     40 * 1 * 2, false},
    /* Two elements contiguous on both sides: the unit is the pair of them. */
    {"run of a few elements", 2, 3, {50, 60, 2}, {1, 0, 2}, {0, 1, 2}, 0, 0, true, 0, 1, 4, 1,
     true},
    {"dims of extent 1 dropped", 2, 4, {1, 70, 1, 90}, {0, 3, 2, 1}, {0, 1, 2, 3}, 0, 0, true,
     0, 1, 2, 2 * 2, false},
    /* Left to the reordering (one dim contiguous on both sides): no second dim to tile. */
    {"transposed alike on both sides", 2, 2, {65, 129}, {1, 0}, {1, 0}, 0, 0, false, 0, 0, 0, 0,
     false},
    {"row-major on both sides", 2, 2, {50, 70}, {0, 1}, {0, 1}, 0, 0, false, 0, 0, 0, 0, false},
    {"contiguous source dim too short", 2, 2, {4, 1000}, {1, 0}, {0, 1}, 0, 0, false, 0, 0, 0,
     0, false},
    {"contiguous destination dim too short", 2, 2, {1000, 7}, {1, 0}, {0, 1}, 0, 0, false, 0, 0,
     0, 0, false},
    {"3-byte elements", 3, 2, {40, 50}, {1, 0}, {0, 1}, 0, 0, false, 0, 0, 0, 0, false},
    {"32-byte elements", 32, 2, {40, 50}, {1, 0}, {0, 1}, 0, 0, false, 0, 0, 0, 0, false},
    {"source off its element alignment", 2, 2, {67, 131}, {1, 0}, {0, 1}, 0, 1, false, 0, 0, 0,
     0, false},
    /* A row of 2^27 padding elements: a tile's 64 rows span more than 2^32 bytes. */
    {"tile span beyond 32 bits", 2, 2, {64, 64}, {1, 0}, {0, 1}, 1 << 27, 0, false, 0, 0, 0, 0,
     false},
};

ParameterizedTestParameters(copy_tile, choice)
{
    return cr_make_param_array(tile_case, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(const tile_case *tc, copy_tile, choice)
{
    rf_copy_pair p;
    rf_copy_pair_flat f;
    rf_copy_tile t = {0};
    rf_err err = {0};
    bool got;

    /* Never dereferenced: the choice looks at addresses only. */
    tile_side(&p.src, (uint8_t *)(uintptr_t)0x10000, tc->src_off, tc->es, tc->ndim, tc->ext,
              tc->src_ord, tc->flush ? 0 : 1, tc->pad);
    tile_side(&p.dst, (uint8_t *)(uintptr_t)0x100000, 0, tc->es, tc->ndim, tc->ext, tc->dst_ord,
              tc->flush ? 0 : 2, 0);
    cr_assert_eq(rf_copy_pair_check(&p, 0, &err), 0, "%s: %s", tc->name, err.msg);
    rf_copy_pair_flatten(&p, &f);
    got = rf_copy_tile_choose(&f, &t);
    cr_assert_eq(got, tc->tiled, "%s: tiled %d, expected %d", tc->name, got, tc->tiled);
    if (!got)
        return;
    cr_expect_eq(t.a, tc->a, "%s: dim a %d, expected %d", tc->name, t.a, tc->a);
    cr_expect_eq(t.b, tc->b, "%s: dim b %d, expected %d", tc->name, t.b, tc->b);
    cr_expect_eq(t.unit, tc->unit, "%s: unit %u, expected %u", tc->name, t.unit, tc->unit);
    cr_expect_eq(t.tiles, tc->tiles, "%s: %llu tiles, expected %llu", tc->name,
                 (unsigned long long)t.tiles, (unsigned long long)tc->tiles);
}

static uint64_t rs = 977;

static uint64_t rnd(uint64_t n)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return rs % n;
}

/* A random dim order of ndim dims. */
static void random_order(int ndim, int *ord)
{
    for (int k = 0; k < ndim; k++)
        ord[k] = k;
    for (int k = ndim - 1; k > 0; k--) {
        int j = (int)rnd((uint64_t)k + 1), x = ord[k];

        ord[k] = ord[j];
        ord[j] = x;
    }
}

/* Descriptors in random dim orders, as pairs with staging (what the tile kernel walks), copied
 * by the host pair copy, equal the host gather and scatter; enough of them are tiled for the
 * view to matter. */
Test(copy_tile, descriptor_as_a_pair_with_staging)
{
    enum { REG = 1 << 20 };
    uint8_t *reg = malloc(REG), *a = malloc(REG), *b = malloc(REG);
    int tiled = 0;

    cr_assert(reg && a && b);
    for (int it = 0; it < 300; it++) {
        static const uint32_t sizes[] = {1, 2, 4, 8, 16, 3};
        int ndim = 1 + (int)rnd(4), ord[4];
        int64_t ext[4];
        uint32_t es = sizes[rnd(6)];
        uint64_t foot, soff = rnd(3) == 0 ? rnd(64) : 16 * rnd(4);
        rf_copy_desc d;
        rf_copy_flat fl;
        rf_copy_pair_flat pf;
        rf_copy_tile t;
        rf_err err = {0};

        for (int k = 0; k < ndim; k++)
            ext[k] = 1 + (int64_t)rnd(ndim <= 2 ? 80 : 12);
        random_order(ndim, ord);
        foot = tile_side(&d, reg, rnd(3) == 0 ? rnd(32) : 0, es, ndim, ext, ord,
                         (int64_t)rnd(3), (int64_t)rnd(3));
        cr_assert_leq(foot + d.offset, (uint64_t)REG);
        d.staging_off = soff;
        for (size_t i = 0; i < REG; i++)
            reg[i] = (uint8_t)rnd(256);
        rf_copy_flatten(&d, &fl);
        /* Gather: the view's copy into b, the host gather into a. */
        memset(a, 0, REG);
        memset(b, 0, REG);
        cr_assert_eq(rf_copy_gather(&d, 1, a, &err), 0, "%s", err.msg);
        rf_copy_tile_desc_flat(&d, &fl, b, true, &pf);
        tiled += rf_copy_tile_choose(&pf, &t);
        rf_copy_pair_range(&pf, 0, pf.bytes);
        cr_assert(memcmp(a, b, REG) == 0, "gather view differs (case %d)", it);
        /* Scatter from that staging: a copy of reg each way. */
        memcpy(a, reg, REG);
        memcpy(b, reg, REG);
        d.base = a;
        cr_assert_eq(rf_copy_scatter(&d, 1, reg + 4096, &err), 0, "%s", err.msg);
        d.base = b;
        rf_copy_tile_desc_flat(&d, &fl, reg + 4096, false, &pf);
        rf_copy_pair_range(&pf, 0, pf.bytes);
        cr_assert(memcmp(a, b, REG) == 0, "scatter view differs (case %d)", it);
        d.base = reg;
    }
    cr_assert_geq(tiled, 30, "only %d of 300 random descriptors tiled", tiled);
    free(reg);
    free(a);
    free(b);
}

/* Pairs both sides of which hold the box in one random dim order (padded differently): the
 * reordered walk copies what the host pair copy does, and both-side-contiguous dims have joined
 * the run. */
Test(copy_tile, reorder_keeps_the_copy)
{
    enum { REG = 1 << 20 };
    uint8_t *src = malloc(REG), *a = malloc(REG), *b = malloc(REG);
    int longer = 0;

    cr_assert(src && a && b);
    for (size_t i = 0; i < REG; i++)
        src[i] = (uint8_t)rnd(256);
    for (int it = 0; it < 200; it++) {
        int ndim = 1 + (int)rnd(4), ord[4], ord2[4];
        int64_t ext[4];
        uint32_t es = 1 + (uint32_t)rnd(4);
        rf_copy_pair p;
        rf_copy_pair_flat f, g;
        rf_err err = {0};

        for (int k = 0; k < ndim; k++)
            ext[k] = 1 + (int64_t)rnd(ndim <= 2 ? 60 : 10);
        random_order(ndim, ord);
        /* Mostly the same order on both sides, sometimes another. */
        memcpy(ord2, ord, sizeof(ord));
        if (rnd(4) == 0)
            random_order(ndim, ord2);
        tile_side(&p.src, src, 0, es, ndim, ext, ord, (int64_t)rnd(2), (int64_t)rnd(2));
        tile_side(&p.dst, b, 0, es, ndim, ext, ord2, (int64_t)rnd(3), (int64_t)rnd(3));
        for (size_t i = 0; i < REG; i++)
            a[i] = b[i] = (uint8_t)i;
        p.dst.base = a;
        cr_assert_eq(rf_copy_pairs(&p, 1, &err), 0, "%s", err.msg);
        p.dst.base = b;
        rf_copy_pair_flatten(&p, &f);
        g = f;
        rf_copy_tile_reorder(&g);
        cr_assert_eq(g.bytes, f.bytes);
        cr_assert_geq(g.run, f.run);
        for (int k = 0; k < g.n; k++)
            cr_assert(!((uint64_t)g.sstr[k] == g.run && (uint64_t)g.dstr[k] == g.run),
                      "dim %d of the reordered walk is contiguous on both sides", k);
        longer += g.run > f.run;
        rf_copy_pair_range(&g, 0, g.bytes);
        cr_assert(memcmp(a, b, REG) == 0, "reordered pair copy differs (case %d)", it);
    }
    cr_assert_geq(longer, 20, "only %d of 200 pairs had a longer run after reordering", longer);
    free(src);
    free(a);
    free(b);
}
