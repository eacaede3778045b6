/* tests/unit/test_layout.c - dtypes, boxes, the inventory (validation, compact storage, exact
 * destination overlap) and piece geometry (offsets, runs, placements). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"
#include "quant_fmt.h"

static rf_inv *inv;
static void setup(void) { inv = rf_inv_new(); cr_assert_not_null(inv); }
static void teardown(void) { rf_inv_free(inv); }
TestSuite(layout, .init = setup, .fini = teardown);

static uint32_t tensor2(const char *name, rf_dtype dt, int64_t a, int64_t b)
{
    int64_t shape[2] = {a, b};
    uint32_t id;
    rf_err err = {0};

    cr_assert_eq(rf_inv_add_tensor(inv, name, dt, 2, shape, &id, &err), 0, "%s", err.msg);
    return id;
}

static uint32_t region(rf_side side, uint64_t size)
{
    uint32_t ep, r;

    cr_assert_eq(rf_inv_add_endpoint(inv, side, 0, &ep, NULL), 0);
    cr_assert_eq(rf_inv_add_region(inv, ep, size, &r, NULL), 0);
    return r;
}

static rf_piece piece2(uint32_t t, uint32_t reg, uint64_t off, int64_t r0, int64_t nr, int64_t c0,
                       int64_t nc, int64_t s0, int64_t s1)
{
    rf_piece p;

    memset(&p, 0, sizeof(p));
    rf_box_full(&p.box, 0, NULL);
    p.tensor = t;
    p.region = reg;
    p.offset = off;
    p.box.start[0] = r0;
    p.box.extent[0] = nr;
    p.box.start[1] = c0;
    p.box.extent[1] = nc;
    p.strides[0] = s0;
    p.strides[1] = s1;
    return p;
}

Test(layout, dtypes)
{
    rf_dtype dt;

    cr_assert_eq(rf_dtype_size(RF_DT_BF16), 2);
    cr_assert_eq(rf_dtype_size(RF_DT_FP32), 4);
    cr_assert_eq(rf_dtype_size(RF_DT_INT64), 8);
    cr_assert_eq(rf_dtype_size(RF_DT_FP8_E4M3), 1);
    cr_assert_eq(rf_dtype_size((rf_dtype)99), 0);
    cr_assert_str_eq(rf_dtype_name(RF_DT_FP8_E5M2), "fp8_e5m2");
    cr_assert_str_eq(rf_dtype_name((rf_dtype)-1), "?");
    cr_assert_eq(rf_dtype_parse("bfloat16", &dt), 0);
    cr_assert_eq(dt, RF_DT_BF16);
    cr_assert_eq(rf_dtype_parse("torch.float8_e4m3fn", &dt), 0);
    cr_assert_eq(dt, RF_DT_FP8_E4M3);
    cr_assert_eq(rf_dtype_parse("int32", &dt), 0);
    cr_assert_eq(dt, RF_DT_INT32);
    cr_assert_eq(rf_dtype_parse("float", &dt), 0);
    cr_assert_eq(dt, RF_DT_FP32);
    cr_assert_eq(rf_dtype_parse("complex64", &dt), -EINVAL);
    cr_assert_eq(rf_dtype_parse(NULL, &dt), -EINVAL);
}

Test(layout, boxes)
{
    int64_t shape[3] = {8, 6, 4};
    rf_box a, b, c;
    char buf[64];

    rf_box_full(&a, 3, shape);
    cr_assert_eq(rf_box_numel(&a, 3), 192);
    cr_assert_eq(a.extent[5], 1);
    cr_assert_eq(rf_box_numel(&a, RF_MAX_DIMS), 192);
    b = a;
    b.start[0] = 6;
    b.extent[0] = 4; /* 6:10 */
    b.start[1] = 2;
    b.extent[1] = 2;
    cr_assert(rf_box_intersect(&a, &b, 3, &c));
    cr_assert_eq(c.start[0], 6);
    cr_assert_eq(c.extent[0], 2);
    cr_assert_eq(c.extent[1], 2);
    cr_assert(rf_box_contains(&a, &c, 3));
    cr_assert_not(rf_box_contains(&a, &b, 3));
    cr_assert(rf_box_equal(&c, &c, 3));
    cr_assert_not(rf_box_equal(&a, &c, 3));
    rf_box_format(&c, 3, buf, sizeof(buf));
    cr_assert_str_eq(buf, "[6:8, 2:4, 0:4]");
    /* Truncation still reports the full length, like snprintf. */
    cr_assert_eq(rf_box_format(&c, 3, buf, 5), (int)strlen("[6:8, 2:4, 0:4]"));
    b.start[0] = 8;
    b.extent[0] = 1;
    cr_assert_not(rf_box_intersect(&a, &b, 3, &c));
    /* The output may alias an input. */
    b = a;
    b.start[2] = 3;
    b.extent[2] = 1;
    cr_assert(rf_box_intersect(&a, &b, 3, &a));
    cr_assert_eq(a.start[2], 3);
    cr_assert_eq(a.extent[2], 1);
    cr_assert_not(rf_box_empty(&a, 3));
    a.extent[1] = 0;
    cr_assert(rf_box_empty(&a, 3));
    cr_assert_eq(rf_box_numel(&a, 3), 0);
}

Test(layout, chunk_torch_semantics)
{
    int64_t s, l;
    /* torch.chunk(arange(10), 4): sizes 3, 3, 3, 1. */
    static const int64_t want10[4][2] = {{0, 3}, {3, 3}, {6, 3}, {9, 1}};
    for (int i = 0; i < 4; i++) {
        rf_chunk(10, 4, i, &s, &l);
        cr_assert_eq(s, want10[i][0]);
        cr_assert_eq(l, want10[i][1]);
    }
    /* torch.chunk(arange(5), 4): sizes 2, 2, 1 and nothing for the fourth. */
    rf_chunk(5, 4, 2, &s, &l);
    cr_assert_eq(s, 4);
    cr_assert_eq(l, 1);
    rf_chunk(5, 4, 3, &s, &l);
    cr_assert_eq(l, 0);
    rf_chunk(10, 0, 0, &s, &l);
    cr_assert_eq(l, 0);
    rf_chunk(10, 4, -1, &s, &l);
    cr_assert_eq(l, 0);
    rf_chunk(61, 16, 15, &s, &l);
    cr_assert_eq(s, 60);
    cr_assert_eq(l, 1);
}

Test(layout, placement_box)
{
    int64_t shape[2] = {12, 10}, mesh[3] = {2, 3, 2};
    int pl[3] = {0, 0, 1};
    int64_t coord[3] = {1, 2, 1};
    rf_box b;

    /* Mesh dims 0 and 1 both shard tensor dim 0: index 1*3+2 = 5 of 6 parts of 12. */
    cr_assert(rf_placement_box(2, shape, 3, mesh, pl, coord, &b));
    cr_assert_eq(b.start[0], 10);
    cr_assert_eq(b.extent[0], 2);
    cr_assert_eq(b.start[1], 5);
    cr_assert_eq(b.extent[1], 5);
    /* Replicate leaves the dim whole. */
    pl[1] = RF_REPLICATE;
    cr_assert(rf_placement_box(2, shape, 3, mesh, pl, coord, &b));
    cr_assert_eq(b.start[0], 6);
    cr_assert_eq(b.extent[0], 6);
    /* Uneven: 5 rows over 4 ranks leaves the last one empty. */
    {
        int64_t sh[1] = {5}, m1[1] = {4}, c1[1] = {3};
        int p1[1] = {0};

        cr_assert_not(rf_placement_box(1, sh, 1, m1, p1, c1, &b));
        c1[0] = 2;
        cr_assert(rf_placement_box(1, sh, 1, m1, p1, c1, &b));
        cr_assert_eq(b.start[0], 4);
        cr_assert_eq(b.extent[0], 1);
    }
}

Test(layout, tensors)
{
    int64_t shape[2] = {8, 4}, other[2] = {8, 5}, bad[2] = {8, 0};
    rf_err err = {0};
    uint32_t a, b;
    char longname[300];

    cr_assert_eq(rf_inv_add_tensor(inv, "model.x.weight", RF_DT_BF16, 2, shape, &a, &err), 0);
    cr_assert_eq(rf_inv_add_tensor(inv, "model.y.weight", RF_DT_FP32, 1, shape, &b, &err), 0);
    cr_assert_eq(a, 0);
    cr_assert_eq(b, 1);
    cr_assert_eq(rf_inv_add_tensor(inv, "model.x.weight", RF_DT_BF16, 2, shape, &b, &err), 0);
    cr_assert_eq(b, 0);
    cr_assert_eq(rf_inv_ntensors(inv), 2);
    cr_assert_eq(rf_inv_add_tensor(inv, "model.x.weight", RF_DT_BF16, 2, other, &b, &err),
                 -EINVAL);
    cr_assert(strstr(err.msg, "model.x.weight registered as bf16 [8, 4] and again as bf16 [8, 5]"),
              "%s", err.msg);
    cr_assert_eq(rf_inv_add_tensor(inv, "model.x.weight", RF_DT_FP16, 2, shape, &b, &err), -EINVAL);
    cr_assert_eq(rf_inv_add_tensor(inv, "model.z.weight", RF_DT_BF16, 2, bad, &b, &err), -EINVAL);
    cr_assert(strstr(err.msg, "shape [8, 0]"), "%s", err.msg);
    cr_assert_eq(rf_inv_add_tensor(inv, "model.z.weight", RF_DT_BF16, 0, shape, &b, &err), -EINVAL);
    cr_assert_eq(rf_inv_add_tensor(inv, "model.z.weight", RF_DT_BF16, 9, shape, &b, &err), -EINVAL);
    cr_assert_eq(rf_inv_add_tensor(inv, "model.z.weight", (rf_dtype)77, 2, shape, &b, &err),
                 -EINVAL);
    cr_assert_eq(rf_inv_add_tensor(inv, "", RF_DT_BF16, 2, shape, &b, &err), -EINVAL);
    memset(longname, 'a', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = '\0';
    cr_assert_eq(rf_inv_add_tensor(inv, longname, RF_DT_BF16, 2, shape, &b, &err), -EINVAL);
    cr_assert_eq(rf_inv_ntensors(inv), 2);
    cr_assert_eq(rf_inv_find_tensor(inv, "model.y.weight", &b), 0);
    cr_assert_eq(b, 1);
    cr_assert_eq(rf_inv_find_tensor(inv, "model.q.weight", &b), -ENOENT);
    cr_assert_str_eq(rf_inv_tensor(inv, 1)->name, "model.y.weight");
    cr_assert_eq(rf_inv_tensor(inv, 1)->ndim, 1);
}

/* Tensor names: what passes, and what is refused with the problem, its byte and the name
 * escaped (never raw: the message goes to logs). */
typedef struct name_case {
    const char *name;
    const char *problem; /* NULL: accepted */
    const char *shown;   /* the escaped name in the message */
    int byte;
} name_case;

static const name_case name_cases[] = {
    {"model.layers.0.mlp.up_proj.weight", NULL, NULL, 0},
    {"model.embed_tokens.weight", NULL, NULL, 0},
    {"experts.w13_weight:0/shard-1", NULL, NULL, 0},
    {"\xe6\xa8\xa1\xe5\x9e\x8b.\xe6\x9d\x83\xe9\x87\x8d", NULL, NULL, 0}, /* 模型.权重 */
    {"\xf0\x9f\xa6\x99.weight", NULL, NULL, 0},                                   /* U+1F999 */
    {"model.layers.0\n.weight", "a control character", "\"model.layers.0\\n.weight\"", 14},
    {"a\tb", "a control character", "\"a\\tb\"", 1},
    {"a\rb", "a control character", "\"a\\rb\"", 1},
    {"a\x1b[31mred", "a control character", "\"a\\x1b[31mred\"", 1},
    {"a\x7f", "a control character", "\"a\\x7f\"", 1},
    {"a\xc2\x85" "b", "a control character", "\"a\\xc2\\x85b\"", 1},               /* NEL, C1 */
    {"a\"b", "a quote", "\"a\\\"b\"", 1},
    {"a'b", "a quote", "\"a'b\"", 1},
    {"a\\b", "a backslash", "\"a\\\\b\"", 1},
    {"a b", "a space", "\"a b\"", 1},
    {"ab\xff", "not valid UTF-8", "\"ab\\xff\"", 2},
    {"a\xc0\xaf", "not valid UTF-8", "\"a\\xc0\\xaf\"", 1},                    /* overlong / */
    {"a\xed\xa0\x80", "not valid UTF-8", "\"a\\xed\\xa0\\x80\"", 1},           /* surrogate */
    {"a\xf4\x90\x80\x80", "not valid UTF-8", "\"a\\xf4\\x90\\x80\\x80\"", 1}, /* > U+10FFFF */
    {"a\xe6\xa8", "not valid UTF-8", "\"a\\xe6\\xa8\"", 1},                      /* truncated */
    {"\x80" "a", "not valid UTF-8", "\"\\x80a\"", 0},                                 /* stray */
    {"a\xe2\x80\xa8" "b", "a line or paragraph separator", "\"a\\xe2\\x80\\xa8b\"", 1},
    {"abc\xe2\x80\xae" "txt.exe", "a bidirectional control", "\"abc\\xe2\\x80\\xaetxt.exe\"", 3},
};

Test(layout, tensor_names)
{
    int64_t shape[1] = {4};
    uint32_t id, n = 0;
    char msg[64];

    for (size_t i = 0; i < sizeof(name_cases) / sizeof(name_cases[0]); i++) {
        const name_case *c = &name_cases[i];
        rf_err err = {0};
        int rc = rf_inv_add_tensor(inv, c->name, RF_DT_FP32, 1, shape, &id, &err);

        if (c->problem == NULL) {
            cr_assert_eq(rc, 0, "case %zu refused: %s", i, err.msg);
            cr_assert_eq(rf_tensor_name_check(c->name, &err), 0);
            n++;
            continue;
        }
        cr_assert_eq(rc, -EINVAL, "case %zu (%s) accepted", i, c->shown);
        cr_assert(strstr(err.msg, c->problem), "case %zu: %s", i, err.msg);
        cr_assert(strstr(err.msg, c->shown), "case %zu: no %s in: %s", i, c->shown, err.msg);
        snprintf(msg, sizeof(msg), "(byte %d, 0x", c->byte);
        cr_assert(strstr(err.msg, msg), "case %zu: not at byte %d: %s", i, c->byte, err.msg);
        for (const char *p = err.msg; *p; p++)
            cr_assert((unsigned char)*p >= 0x20 && *p != 0x7f, "case %zu: raw byte in %s", i,
                      err.msg);
        cr_assert_eq(rf_tensor_name_check(c->name, &err), -EINVAL);
    }
    cr_assert_eq(rf_inv_ntensors(inv), n, "a refused name was added");
}

Test(layout, tensor_name_length_and_escape_cut)
{
    int64_t shape[1] = {4};
    char name[300], out[32];
    rf_err err = {0};
    uint32_t id;

    memset(name, 'a', sizeof(name));
    name[RF_NAME_MAX - 1] = '\0'; /* 255 bytes: the longest name */
    cr_assert_eq(rf_inv_add_tensor(inv, name, RF_DT_FP32, 1, shape, &id, &err), 0, "%s",
                 err.msg);
    name[RF_NAME_MAX - 1] = '\n';
    name[RF_NAME_MAX] = '\0';
    cr_assert_eq(rf_inv_add_tensor(inv, name, RF_DT_FP32, 1, shape, &id, &err), -EINVAL);
    cr_assert(strstr(err.msg, "is 256 bytes long; the limit is 255"), "%s", err.msg);
    cr_assert(strstr(err.msg, "aaa...\""), "the name is not shown cut: %s", err.msg);
    cr_assert_null(strchr(err.msg, '\n'));

    /* Cut on whole escapes and characters, closed with a quote, never past the buffer. */
    cr_assert_str_eq(rf_name_escape("abc", out, sizeof(out)), "\"abc\"");
    cr_assert_str_eq(rf_name_escape("\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n", out, 16),
                     "\"\\n\\n\\n\\n\\n...\"");
    cr_assert_str_eq(rf_name_escape("0123456789", out, 12), "\"012345...\"");
    cr_assert_eq(strlen(rf_name_escape("0123456789abcdef", out, 12)), 11, "%s", out);
    cr_assert_str_eq(rf_name_escape("\xe6\xa8\xa1\xe6\xa8\xa1\xe6\xa8\xa1", out, 10),
                     "\"\xe6\xa8\xa1...\"");
    cr_assert_str_eq(rf_name_escape("abc", out, 4), "");
}

Test(layout, many_tensors_hash)
{
    char name[64];
    int64_t shape[1] = {3};
    uint32_t id;

    rf_inv_free(inv);
    inv = rf_inv_new();
    for (int i = 0; i < 50000; i++) {
        snprintf(name, sizeof(name), "model.layers.%d.mlp.experts.%d.up_proj.weight", i / 256,
                 i % 256);
        cr_assert_eq(rf_inv_add_tensor(inv, name, RF_DT_BF16, 1, shape, &id, NULL), 0);
        cr_assert_eq(id, (uint32_t)i);
    }
    for (int i = 0; i < 50000; i += 7) {
        snprintf(name, sizeof(name), "model.layers.%d.mlp.experts.%d.up_proj.weight", i / 256,
                 i % 256);
        cr_assert_eq(rf_inv_find_tensor(inv, name, &id), 0);
        cr_assert_eq(id, (uint32_t)i);
        /* Names stay valid while the pool grows. */
        cr_assert_str_eq(rf_inv_tensor(inv, id)->name, name);
    }
}

Test(layout, endpoints_regions)
{
    rf_err err = {0};
    uint32_t ep, r;

    cr_assert_eq(rf_inv_add_endpoint(inv, (rf_side)5, 0, &ep, &err), -EINVAL);
    cr_assert_eq(rf_inv_add_endpoint(inv, RF_DST, 7, &ep, &err), 0);
    cr_assert_eq(rf_inv_endpoint(inv, ep)->node, 7);
    cr_assert_eq(rf_inv_endpoint(inv, ep)->side, RF_DST);
    cr_assert_eq(rf_inv_add_region(inv, 3, 100, &r, &err), -EINVAL);
    cr_assert(strstr(err.msg, "endpoint 3"), "%s", err.msg);
    cr_assert_eq(rf_inv_add_region(inv, ep, 0, &r, &err), -EINVAL);
    cr_assert_eq(rf_inv_add_region(inv, ep, 100, &r, &err), 0);
    cr_assert_eq(rf_inv_region(inv, r)->size, 100);
    cr_assert_eq(rf_inv_nregions(inv), 1);
    cr_assert_eq(rf_inv_nendpoints(inv), 1);
}

Test(layout, piece_validation)
{
    uint32_t up = tensor2("model.layers.3.mlp.up_proj.weight", RF_DT_BF16, 4096, 2048);
    uint32_t x = tensor2("model.x.weight", RF_DT_FP32, 8, 4);
    uint32_t r = region(RF_DST, 8388608), rx = region(RF_SRC, 128);
    rf_err err = {0};
    rf_piece p;
    uint32_t id;

    p = piece2(up, r, 0, 0, 4096, 0, 2048, 2048, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), -EINVAL);
    cr_assert(strstr(err.msg, "piece model.layers.3.mlp.up_proj.weight [0:4096, 0:2048] lies "
                              "outside its registered region (size 8388608)"), "%s", err.msg);
    p = piece2(x, rx, 0, 0, 10, 0, 4, 4, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), -EINVAL);
    cr_assert(strstr(err.msg, "box [0:10, 0:4] of model.x.weight lies outside its shape [8, 4]"),
              "%s", err.msg);
    p = piece2(x, rx, 0, -1, 2, 0, 4, 4, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), -EINVAL);
    p = piece2(x, rx, 0, 0, 0, 0, 4, 4, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), -EINVAL);
    cr_assert(strstr(err.msg, "is empty"), "%s", err.msg);
    p = piece2(x, rx, 0, 0, 8, 0, 4, -4, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), -EINVAL);
    cr_assert(strstr(err.msg, "negative stride"), "%s", err.msg);
    p = piece2(x, rx, 0, 0, 8, 0, 4, 0, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), -EINVAL);
    cr_assert(strstr(err.msg, "stride 0 on dim 0"), "%s", err.msg);
    p = piece2(x + 5, rx, 0, 0, 8, 0, 4, 4, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), -EINVAL);
    p = piece2(x, rx + 5, 0, 0, 8, 0, 4, 4, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), -EINVAL);
    cr_assert(strstr(err.msg, "region"), "%s", err.msg);
    /* The last byte must lie inside: 8x4 fp32 = 128 bytes fits at offset 0, not at 1. */
    p = piece2(x, rx, 1, 0, 8, 0, 4, 4, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), -EINVAL);
    cr_assert(strstr(err.msg, "bytes 1 to 128"), "%s", err.msg);
    /* Offsets and strides that overflow 64 bits are caught, not wrapped. */
    p = piece2(x, rx, UINT64_MAX - 1, 0, 1, 0, 1, 4, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), -EINVAL);
    cr_assert(strstr(err.msg, "overflows"), "%s", err.msg);
    p = piece2(x, rx, 0, 0, 8, 0, 4, INT64_MAX / 2, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), -EINVAL);
    cr_assert(strstr(err.msg, "overflow"), "%s", err.msg);
    cr_assert_eq(rf_inv_npieces(inv, RF_SRC) + rf_inv_npieces(inv, RF_DST), 0);
    /* A stride of 0 is fine on a dim of extent 1. */
    p = piece2(x, rx, 112, 7, 1, 0, 4, 0, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), 0, "%s", err.msg);
    p = piece2(x, rx, 0, 0, 8, 0, 4, 4, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, &err), 0, "%s", err.msg);
    cr_assert_eq(id, 1);
    cr_assert_eq(rf_inv_npieces(inv, RF_SRC), 2);
    cr_assert_eq(rf_inv_npieces(inv, RF_DST), 0);
}

Test(layout, piece_roundtrip_and_compact)
{
    uint32_t t3, r;
    int64_t shape[3] = {16, 6, 10};
    rf_piece p, q;
    size_t before;

    cr_assert_eq(rf_inv_add_tensor(inv, "model.t3", RF_DT_FP16, 3, shape, &t3, NULL), 0);
    r = region(RF_DST, 1 << 20);
    memset(&p, 0, sizeof(p));
    rf_box_full(&p.box, 3, shape);
    p.tensor = t3;
    p.region = r;
    p.box.start[0] = 4;
    p.box.extent[0] = 3;
    p.strides[0] = 60;
    p.strides[1] = 10;
    p.strides[2] = 1;
    /* Garbage past ndim must not matter. */
    p.box.start[5] = 99;
    p.strides[6] = 42;
    p.offset = 6;
    cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, NULL), 0);
    rf_inv_piece(inv, RF_DST, 0, &q);
    cr_assert(rf_box_equal(&p.box, &q.box, 3));
    cr_assert_eq(q.box.start[5], 0);
    cr_assert_eq(q.box.extent[5], 1);
    cr_assert_eq(q.strides[6], 0);
    cr_assert_eq(q.strides[1], 10);
    cr_assert_eq(q.offset, 6);
    cr_assert_eq(rf_inv_piece_tensor(inv, RF_DST, 0), t3);
    cr_assert_eq(rf_inv_piece_region(inv, RF_DST, 0), r);
    cr_assert_eq(rf_inv_piece_endpoint(inv, RF_DST, 0), rf_inv_region(inv, r)->endpoint);
    /* 200k pieces of a few geometries cost about 24 bytes each. */
    p.box.start[5] = 0;
    p.strides[6] = 0;
    before = rf_inv_memory(inv);
    for (int i = 0; i < 200000; i++) {
        p.offset = (uint64_t)(i % 1000) * 8;
        p.box.start[0] = i % 3;
        cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, NULL), 0);
    }
    cr_assert_lt(rf_inv_memory(inv) - before, (size_t)200000 * 48);
    rf_inv_piece(inv, RF_DST, 200000, &q);
    cr_assert_eq(q.box.start[0], 200000 % 3 - 1 < 0 ? 2 : 200000 % 3 - 1);
    cr_assert_eq(q.offset, (uint64_t)(199999 % 1000) * 8);
}

Test(layout, offsets_runs)
{
    rf_piece p = piece2(0, 0, 100, 8, 4, 16, 8, 64, 1); /* rows 8:12, cols 16:24 of a [*, 64] */
    rf_box sub = p.box;
    int64_t idx[2] = {9, 18};
    uint64_t off, rb;

    cr_assert_eq(rf_piece_byte_offset(&p, 2, 2, idx), 100 + (64 + 2) * 2);
    /* Whole rows of a row-major buffer merge into one run... */
    p.strides[0] = 8;
    cr_assert(rf_piece_contiguous(&p, 2, 2, &sub, &off));
    cr_assert_eq(off, 100);
    cr_assert_eq(rf_piece_runs(&p, 2, 2, &sub, &rb), 1);
    cr_assert_eq(rb, 64);
    /* ...a column slice does not. */
    sub.start[1] = 18;
    sub.extent[1] = 3;
    cr_assert_not(rf_piece_contiguous(&p, 2, 2, &sub, &off));
    cr_assert_eq(rf_piece_runs(&p, 2, 2, &sub, &rb), 4);
    cr_assert_eq(rb, 6);
    /* A single row of it is contiguous (extent-1 dims are ignored). */
    sub.start[0] = 10;
    sub.extent[0] = 1;
    cr_assert(rf_piece_contiguous(&p, 2, 2, &sub, &off));
    cr_assert_eq(off, 100 + (2 * 8 + 2) * 2);
    /* A transposed store: every element is its own run in row-major element order. */
    p.strides[0] = 1;
    p.strides[1] = 4;
    sub = p.box;
    cr_assert_eq(rf_piece_runs(&p, 2, 4, &sub, &rb), 32);
    cr_assert_eq(rb, 4);
    cr_assert_not(rf_piece_contiguous(&p, 2, 4, &sub, NULL));
    /* 3-D: [E, 2I, H] with the full inner two dims merges, a partial middle dim leaves one run
     * per outer index. */
    {
        rf_piece w;
        rf_box s3;

        memset(&w, 0, sizeof(w));
        rf_box_full(&w.box, 0, NULL);
        w.box.extent[0] = 4;
        w.box.extent[1] = 6;
        w.box.extent[2] = 5;
        w.strides[0] = 30;
        w.strides[1] = 5;
        w.strides[2] = 1;
        s3 = w.box;
        cr_assert_eq(rf_piece_runs(&w, 3, 2, &s3, &rb), 1);
        cr_assert_eq(rb, 240);
        s3.extent[1] = 3;
        cr_assert_eq(rf_piece_runs(&w, 3, 2, &s3, &rb), 4);
        cr_assert_eq(rb, 30);
    }
}

Test(layout, dst_overlap_fused_ok)
{
    /* vLLM-style qkv_proj: q rows then k rows then v rows in one region. */
    uint32_t q = tensor2("q", RF_DT_BF16, 64, 16), k = tensor2("k", RF_DT_BF16, 16, 16);
    uint32_t v = tensor2("v", RF_DT_BF16, 16, 16);
    uint32_t r = region(RF_DST, (32 + 8 + 8) * 16 * 2);
    rf_err err = {0};
    rf_piece p;

    p = piece2(q, r, 0, 32, 32, 0, 16, 16, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
    p = piece2(v, r, 40 * 16 * 2, 8, 8, 0, 16, 16, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
    p = piece2(k, r, 32 * 16 * 2, 8, 8, 0, 16, 16, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_inv_check_dst_overlap(inv, &err), 0, "%s", err.msg);
    /* Interleaved column halves: spans overlap, bytes do not. */
    {
        uint32_t a = tensor2("a", RF_DT_FP32, 4, 2), b = tensor2("b", RF_DT_FP32, 4, 2);
        uint32_t r2 = region(RF_DST, 4 * 4 * 4);

        p = piece2(a, r2, 0, 0, 4, 0, 2, 4, 1);
        cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
        p = piece2(b, r2, 8, 0, 4, 0, 2, 4, 1);
        cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
        cr_assert_eq(rf_inv_check_dst_overlap(inv, &err), 0, "%s", err.msg);
        /* Sources may share bytes (that is what replicas do). */
        {
            uint32_t rs = region(RF_SRC, 64);

            p = piece2(a, rs, 0, 0, 4, 0, 2, 2, 1);
            cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
            cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
            cr_assert_eq(rf_inv_check_dst_overlap(inv, &err), 0, "%s", err.msg);
        }
        /* One column more for b and they collide at row 0, column 1 of b's start: byte 12. */
        p = piece2(b, r2, 4, 0, 1, 0, 1, 4, 1);
        cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0, "%s", err.msg);
        cr_assert_eq(rf_inv_check_dst_overlap(inv, &err), -EINVAL);
        cr_assert(strstr(err.msg, "a [0:4, 0:2]") && strstr(err.msg, "b [0:1, 0:1]") &&
                  strstr(err.msg, "byte 4"), "%s", err.msg);
    }
}

Test(layout, dst_overlap_same_bytes)
{
    uint32_t g = tensor2("model.layers.0.mlp.experts.0.gate_proj.weight", RF_DT_BF16, 8, 4);
    uint32_t u = tensor2("model.layers.0.mlp.experts.0.up_proj.weight", RF_DT_BF16, 8, 4);
    uint32_t r = region(RF_DST, 256);
    rf_err err = {0};
    rf_piece p;

    p = piece2(g, r, 0, 0, 8, 0, 4, 4, 1);
    cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0);
    p = piece2(u, r, 62, 0, 8, 0, 4, 4, 1); /* starts on g's last element */
    cr_assert_eq(rf_inv_add_piece(inv, &p, NULL, &err), 0);
    cr_assert_eq(rf_inv_check_dst_overlap(inv, &err), -EINVAL);
    cr_assert(strstr(err.msg, "experts.0.gate_proj.weight [0:8, 0:4]") &&
              strstr(err.msg, "experts.0.up_proj.weight [0:8, 0:4]") && strstr(err.msg, "62"),
              "%s", err.msg);
}

/* An FP8 piece's scales are bytes its install writes: they may not lie in its own elements,
 * nor in another piece's elements or scales. w is 128 x 64 in 64 x 64 blocks: 8192 bytes of
 * FP8 and two fp32 scales (8 bytes). */
static uint32_t fp8_piece(uint32_t t, uint32_t reg, uint64_t off, int64_t r0, uint32_t sreg,
                          uint64_t soff, rf_err *err)
{
    rf_quant_decl qd = {.kind = RF_QUANT_BLOCK, .br = 64, .bc = 64, .scale_region = sreg,
                        .scale_offset = soff, .scale_strides = {1, 1}};
    rf_piece p = piece2(t, reg, off, r0, 64, 0, 64, 64, 1);
    uint32_t id;

    cr_assert_eq(rf_inv_add_quant(inv, &qd, &p.quant, err), 0, "%s", err->msg);
    cr_assert_eq(rf_inv_add_piece(inv, &p, &id, err), 0, "%s", err->msg);
    return id;
}

Test(layout, dst_overlap_fp8_scales_in_own_elements)
{
    uint32_t w = tensor2("w", RF_DT_BF16, 64, 64), r = region(RF_DST, 64 * 64 + 8);
    rf_err err = {0};

    fp8_piece(w, r, 0, 0, r, 64 * 64, &err); /* scales right after the elements */
    cr_assert_eq(rf_inv_check_dst_overlap(inv, &err), 0, "%s", err.msg);
    rf_inv_free(inv);
    inv = rf_inv_new();
    w = tensor2("w", RF_DT_BF16, 64, 64);
    r = region(RF_DST, 64 * 64 + 8);
    fp8_piece(w, r, 0, 0, r, 64 * 64 - 2, &err); /* the scale's first two bytes on elements */
    cr_assert_eq(rf_inv_check_dst_overlap(inv, &err), -EINVAL);
    cr_assert(strstr(err.msg, "the FP8 scales of w [0:64, 0:64]") &&
              strstr(err.msg, "both write byte 4094 of region 0") &&
              strstr(err.msg, "FP8 scales included"), "%s", err.msg);
}

Test(layout, dst_overlap_fp8_scales_across_pieces)
{
    uint32_t w = tensor2("w", RF_DT_BF16, 128, 64), r = region(RF_DST, 2 * 64 * 64);
    uint32_t rs = rf_inv_nregions(inv), ep = rf_inv_region(inv, r)->endpoint, tmp;
    rf_err err = {0};

    cr_assert_eq(rf_inv_add_region(inv, ep, 64, &tmp, &err), 0, "%s", err.msg);
    fp8_piece(w, r, 0, 0, rs, 0, &err);
    fp8_piece(w, r, 64 * 64, 64, rs, 4, &err); /* the next scale: no byte shared */
    cr_assert_eq(rf_inv_check_dst_overlap(inv, &err), 0, "%s", err.msg);
    /* A third piece (another tensor) whose scale lands on the second piece's. */
    {
        uint32_t v = tensor2("v", RF_DT_BF16, 64, 64), rv;

        cr_assert_eq(rf_inv_add_region(inv, ep, 64 * 64, &rv, &err), 0, "%s", err.msg);
        fp8_piece(v, rv, 0, 0, rs, 6, &err);
        cr_assert_eq(rf_inv_check_dst_overlap(inv, &err), -EINVAL);
        cr_assert(strstr(err.msg, "the FP8 scales of w [64:128, 0:64]") &&
                  strstr(err.msg, "the FP8 scales of v [0:64, 0:64]") &&
                  strstr(err.msg, "byte 6 of region 1"), "%s", err.msg);
    }
}

Test(layout, dst_overlap_fp8_scales_in_other_elements)
{
    uint32_t w = tensor2("w", RF_DT_BF16, 64, 64), v = tensor2("v", RF_DT_BF16, 64, 64);
    uint32_t r = region(RF_DST, 3 * 64 * 64), ep = rf_inv_region(inv, r)->endpoint, rs;
    rf_err err = {0};

    cr_assert_eq(rf_inv_add_region(inv, ep, 64, &rs, &err), 0, "%s", err.msg);
    fp8_piece(w, r, 0, 0, rs, 0, &err);
    /* v's scales in the middle of w's elements, in w's region. */
    fp8_piece(v, r, 64 * 64, 0, r, 100, &err);
    cr_assert_eq(rf_inv_check_dst_overlap(inv, &err), -EINVAL);
    cr_assert(strstr(err.msg, "w [0:64, 0:64] and the FP8 scales of v [0:64, 0:64] both write "
                     "byte 100"), "%s", err.msg);
}

/* Random FP8 pieces whose elements and scales share one small region: the exact check agrees
 * with a byte map that marks both. */
Test(layout, dst_overlap_fp8_random_vs_bytemap)
{
    unsigned seed = 777;
    int disagreements = 0, overlaps = 0;

    for (int trial = 0; trial < 400; trial++) {
        rf_inv *v = rf_inv_new();
        uint8_t map[1024];
        bool collide = false;
        uint32_t ep, reg, t;
        int64_t shape[2] = {16, 16};
        rf_err err = {0};
        int npieces = 1 + rand_r(&seed) % 3;

        memset(map, 0, sizeof(map));
        rf_inv_add_endpoint(v, RF_DST, 0, &ep, NULL);
        rf_inv_add_region(v, ep, sizeof(map), &reg, NULL);
        rf_inv_add_tensor(v, "t", RF_DT_BF16, 2, shape, &t, NULL);
        for (int i = 0; i < npieces; i++) {
            int64_t nr = 4 * (1 + rand_r(&seed) % 2), nc = 4 * (1 + rand_r(&seed) % 2);
            int64_t s0 = nc + rand_r(&seed) % 6, ss0 = nc / 4 + rand_r(&seed) % 2;
            uint64_t off = (uint64_t)(rand_r(&seed) % 600), soff = (uint64_t)(rand_r(&seed) % 900);
            rf_quant_decl qd = {.kind = RF_QUANT_BLOCK, .br = 4, .bc = 4, .scale_region = reg,
                                .scale_offset = soff, .scale_strides = {ss0, 1}};
            rf_piece p = piece2(t, reg, off, 0, nr, 0, nc, s0, 1);

            cr_assert_eq(rf_inv_add_quant(v, &qd, &p.quant, &err), 0, "%s", err.msg);
            if (rf_inv_add_piece(v, &p, NULL, &err) != 0)
                continue;
            for (int64_t a = 0; a < nr; a++)
                for (int64_t b = 0; b < nc; b++) {
                    uint64_t o = off + (uint64_t)(a * s0 + b);

                    collide |= map[o] != 0;
                    map[o] = (uint8_t)(2 * i + 1);
                }
            for (int64_t a = 0; a < nr / 4; a++)
                for (int64_t b = 0; b < nc / 4; b++)
                    for (int k = 0; k < 4; k++) {
                        uint64_t o = soff + (uint64_t)(a * ss0 + b) * 4 + (uint64_t)k;

                        collide |= map[o] != 0;
                        map[o] = (uint8_t)(2 * i + 2);
                    }
        }
        overlaps += collide;
        if ((rf_inv_check_dst_overlap(v, &err) != 0) != collide)
            disagreements++;
        rf_inv_free(v);
    }
    cr_assert_eq(disagreements, 0);
    cr_assert_gt(overlaps, 20);
    cr_assert_lt(overlaps, 380);
}

/* Random strided pieces in small regions: the exact check agrees with a byte map. */
Test(layout, dst_overlap_random_vs_bytemap)
{
    unsigned seed = 12345;
    int disagreements = 0, overlaps = 0;

    for (int trial = 0; trial < 400; trial++) {
        rf_inv *v = rf_inv_new();
        uint8_t map[512];
        bool collide = false;
        uint32_t ep, reg, t;
        int64_t shape[2] = {16, 16};
        rf_err err = {0};
        int npieces = 2 + rand_r(&seed) % 4;

        memset(map, 0, sizeof(map));
        rf_inv_add_endpoint(v, RF_DST, 0, &ep, NULL);
        rf_inv_add_region(v, ep, sizeof(map), &reg, NULL);
        rf_inv_add_tensor(v, "t", RF_DT_FP16, 2, shape, &t, NULL);
        for (int i = 0; i < npieces; i++) {
            int64_t nr = 1 + rand_r(&seed) % 4, nc = 1 + rand_r(&seed) % 4;
            int64_t s1 = 1 + rand_r(&seed) % 3, s0 = nc * s1 + rand_r(&seed) % 8;
            uint64_t off = (uint64_t)(rand_r(&seed) % 200) * 2;
            rf_piece p = piece2(t, reg, off, 0, nr, 0, nc, s0, s1);

            if (rand_r(&seed) % 4 == 0) { /* a transposed store */
                p.strides[0] = 1;
                p.strides[1] = nr + rand_r(&seed) % 3;
            }
            if (rf_inv_add_piece(v, &p, NULL, &err) != 0)
                continue;
            for (int64_t a = 0; a < nr; a++)
                for (int64_t b = 0; b < nc; b++) {
                    uint64_t o = off + (uint64_t)(a * p.strides[0] + b * p.strides[1]) * 2;

                    for (int k = 0; k < 2; k++) {
                        if (map[o + k] && map[o + k] != i + 1)
                            collide = true;
                        map[o + k] = (uint8_t)(i + 1);
                    }
                }
        }
        overlaps += collide;
        if ((rf_inv_check_dst_overlap(v, &err) != 0) != collide)
            disagreements++;
        rf_inv_free(v);
    }
    cr_assert_eq(disagreements, 0);
    cr_assert_gt(overlaps, 20);
    cr_assert_lt(overlaps, 380);
}
