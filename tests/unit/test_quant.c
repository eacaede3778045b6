/* tests/unit/test_quant.c - FP8 quantization (quant.h): e4m3 encodings and E8M0 exponents
 * computed by hand, every format's scales and bytes on hand-made blocks (zeros, NaN/Inf,
 * subnormals, edge blocks, strides), random matrices against a naive reference written
 * apart from the module, and every error of the format parser, the box check and the
 * quantizer. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "quant_ref.h"

static uint32_t fbits(float f)
{
    uint32_t u;

    memcpy(&u, &f, 4);
    return u;
}

static float bitsf(uint32_t u)
{
    float f;

    memcpy(&f, &u, 4);
    return f;
}

/* bf16 of a value bf16 holds exactly. */
static uint16_t bf(float f)
{
    uint32_t u = fbits(f);

    cr_assert_eq(u & 0xFFFF, 0, "%a is not a bf16 value", (double)f);
    return (uint16_t)(u >> 16);
}

static rf_quant_fmt fmt(const char *s)
{
    rf_quant_fmt f;
    rf_err err = {0};

    cr_assert_eq(rf_quant_fmt_parse(s, &f, &err), 0, "%s: %s", s, err.msg);
    return f;
}

#define NAN_BITS(sign) bitsf((sign) ? 0xFFC00000u : 0x7FC00000u)

/* ---- e4m3 encoding, by hand ---- */

struct enc_case {
    float v;
    uint8_t q;
};

Test(quant, e4m3_encodings)
{
    /* Each byte worked out from E4M3's layout (s eeee mmm, bias 7, subnormals m * 2^-9). */
    const struct enc_case cs[] = {
        {0.0f, 0x00},
        {-0.0f, 0x80},
        {1.0f, 0x38},                  /* e 7 */
        {-1.0f, 0xB8},
        {0.5f, 0x30},
        {-2.0f, 0xC0},
        {0.1f, 0x1D},                  /* 1.6 * 2^-4: mantissa 4.8 -> 5 */
        {240.0f, 0x77},                /* 1.875 * 2^7 */
        {256.0f, 0x78},
        {416.0f, 0x7D},
        {448.0f, 0x7E},                /* the largest */
        {-448.0f, 0xFE},
        {464.0f, 0x7E},                /* halfway 448..480: ties to the even 0x7E */
        {464.00003f, 0x7F},            /* just above: 0x7F, NaN */
        {465.0f, 0x7F},                /* NaN: the conversion does not saturate */
        {-465.0f, 0xFF},
        {480.0f, 0x7F},
        {1e30f, 0x7F},
        {1.0625f, 0x38},               /* halfway 1..1.125: ties to even */
        {1.0625f + 0x1p-20f, 0x39},
        {1.1875f, 0x3A},               /* halfway 1.125..1.25: ties to even (m 2) */
        {0x1p-6f, 0x08},               /* smallest normal */
        {0x1p-9f, 0x01},               /* smallest subnormal */
        {0x1p-10f, 0x00},              /* halfway 0..2^-9: ties to even 0 */
        {-0x1p-10f, 0x80},
        {0x1p-10f + 0x1p-30f, 0x01},
        {1.25f * 0x1p-9f, 0x01},       /* between subnormals */
        {1.75f * 0x1p-9f, 0x02},
        {3.0f * 0x1p-10f, 0x02},       /* 1.5 units: ties to even 2 */
        {5.0f * 0x1p-10f, 0x02},       /* 2.5 units: ties to even 2 */
        {7.0f * 0x1p-9f, 0x07},        /* largest subnormal */
        {-7.0f * 0x1p-9f, 0x87},
        {15.0f * 0x1p-10f, 0x08},      /* 7.5 units: ties to even 8, the smallest normal */
        {0x1p-6f - 0x1p-30f, 0x08},
        {0x1p-149f, 0x00},             /* fp32 subnormal */
        {-0x1p-149f, 0x80},
    };

    for (size_t i = 0; i < sizeof(cs) / sizeof(cs[0]); i++)
        cr_expect_eq(rf_quant_e4m3_from_float(cs[i].v), cs[i].q, "%a -> 0x%02x, want 0x%02x",
                     (double)cs[i].v, rf_quant_e4m3_from_float(cs[i].v), cs[i].q);
    cr_expect_eq(rf_quant_e4m3_from_float(INFINITY), 0x7F);
    cr_expect_eq(rf_quant_e4m3_from_float(-INFINITY), 0xFF);
    cr_expect_eq(rf_quant_e4m3_from_float(NAN_BITS(0)), 0x7F);
    cr_expect_eq(rf_quant_e4m3_from_float(NAN_BITS(1)), 0xFF);
}

Test(quant, e4m3_decode)
{
    cr_expect_eq(fbits(rf_quant_e4m3_to_float(0x00)), 0);
    cr_expect_eq(fbits(rf_quant_e4m3_to_float(0x80)), 0x80000000u);
    cr_expect_eq(rf_quant_e4m3_to_float(0x01), 0x1p-9f);
    cr_expect_eq(rf_quant_e4m3_to_float(0x07), 7.0f * 0x1p-9f);
    cr_expect_eq(rf_quant_e4m3_to_float(0x08), 0x1p-6f);
    cr_expect_eq(rf_quant_e4m3_to_float(0x38), 1.0f);
    cr_expect_eq(rf_quant_e4m3_to_float(0x1D), 0.1015625f);
    cr_expect_eq(rf_quant_e4m3_to_float(0x7E), 448.0f);
    cr_expect_eq(rf_quant_e4m3_to_float(0xFE), -448.0f);
    cr_expect_eq(rf_quant_e4m3_to_float(0xC0), -2.0f);
    cr_expect(isnan(rf_quant_e4m3_to_float(0x7F)));
    cr_expect(isnan(rf_quant_e4m3_to_float(0xFF)));
    /* 0x00..0x7E increase, and every byte encodes back to itself. */
    for (int b = 1; b < 0x7F; b++)
        cr_expect_lt(rf_quant_e4m3_to_float((uint8_t)(b - 1)), rf_quant_e4m3_to_float((uint8_t)b));
    for (int b = 0; b < 256; b++)
        cr_expect_eq(rf_quant_e4m3_from_float(rf_quant_e4m3_to_float((uint8_t)b)), b, "0x%02x", b);
}

/* ---- a naive reference, written apart from the module ---- */

static double ref_table[128]; /* E4M3 values of 0x00..0x7E, then 480 standing for 0x7F */

static void ref_init(void)
{
    for (int c = 0; c < 127; c++) {
        int e = c >> 3, m = c & 7;
        ref_table[c] = e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10);
    }
    ref_table[127] = 480.0;
}

/* Nearest E4M3 value, ties to the even code; |v| past 464 rounds to 0x7F (NaN). */
static uint8_t ref_e4m3(float v)
{
    uint8_t sign = signbit(v) ? 0x80 : 0;
    double a = fabs((double)v);
    int lo = 0, hi = 127;

    if (isnan(v) || a >= 480.0)
        return 0x7F | sign;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (ref_table[mid] <= a)
            lo = mid;
        else
            hi = mid;
    }
    if (ref_table[lo] == a)
        return (uint8_t)lo | sign;
    double dl = a - ref_table[lo], dh = ref_table[hi] - a;
    int c = dl < dh ? lo : dh < dl ? hi : (lo % 2 == 0 ? lo : hi);
    return (uint8_t)c | sign;
}

Test(quant, e4m3_matches_nearest_even_on_every_bf16_and_a_sweep_of_fp32)
{
    ref_init();
    for (uint32_t h = 0; h < 0x10000; h++) {
        float v = bitsf(h << 16);
        if (isnan(v))
            continue;
        cr_assert_eq(rf_quant_e4m3_from_float(v), ref_e4m3(v), "bf16 0x%04x (%a)", h, (double)v);
    }
    /* Every fp32 below 2^-5 and around the top, then a stride over the rest up to 480. */
    for (uint32_t u = 0; u < fbits(0x1p-5f); u += (u < 0x3C000000u ? 4093 : 1)) {
        float v = bitsf(u);
        cr_assert_eq(rf_quant_e4m3_from_float(v), ref_e4m3(v), "fp32 0x%08x", u);
    }
    for (uint32_t u = fbits(440.0f); u <= fbits(481.0f); u++)
        cr_assert_eq(rf_quant_e4m3_from_float(bitsf(u)), ref_e4m3(bitsf(u)), "fp32 0x%08x", u);
    for (uint32_t u = fbits(0x1p-5f); u < fbits(480.0f); u += 97) {
        float v = bitsf(u);
        cr_assert_eq(rf_quant_e4m3_from_float(-v), ref_e4m3(-v), "fp32 0x%08x", u | 0x80000000u);
    }
}

/* ---- scales ---- */

Test(quant, fp32_scales)
{
    cr_expect_eq(rf_quant_scale_of(0.0f), 1.0f);
    cr_expect_eq(rf_quant_scale_of(448.0f), 1.0f);
    cr_expect_eq(rf_quant_scale_of(896.0f), 2.0f);
    cr_expect_eq(rf_quant_scale_of(224.0f), 0.5f);
    /* 1/448 = 1.001001...b * 2^-9, rounded up in its 24th bit. */
    cr_expect_eq(fbits(rf_quant_scale_of(1.0f)), 0x3B124925u);
    /* bf16's smallest normal: 2^-126 / 448 = 18724.57 * 2^-149, rounded to 18725 = 0x4925. */
    cr_expect_eq(fbits(rf_quant_scale_of(0x1p-126f)), 0x4925u);
    /* 2^-140 / 448 = 1.14 * 2^-149: the smallest subnormal; below 448 * 2^-150 it is 0 -> 1. */
    cr_expect_eq(fbits(rf_quant_scale_of(0x1p-140f)), 1u);
    cr_expect_eq(rf_quant_scale_of(0x1p-149f), 1.0f);
    cr_expect_eq(rf_quant_scale_of(200.0f * 0x1p-149f), 1.0f);
}

struct e8_case {
    float amax;
    uint8_t byte;
};

Test(quant, mxfp8_exponents)
{
    /* byte = clamp(floor(log2(amax)) - 8, -127, 127) + 127, worked by hand. */
    const struct e8_case cs[] = {
        {0.0f, 127},                  /* no finite non-zero element: scale 1 */
        {448.0f, 127},                /* floor(log2) 8 */
        {511.0f, 127},
        {512.0f, 128},
        {256.0f, 127},
        {255.0f, 126},
        {1.0f, 119},
        {3.0f, 120},
        {0.75f, 118},
        {0x1.8p127f, 246},            /* huge: floor(log2) 127 */
        {3.4028234663852886e38f, 246}, /* FLT_MAX */
        {0x1p-118f, 1},
        {0x1p-119f, 0},               /* e = -127, not clamped */
        {0x1p-120f, 0},               /* clamped */
        {0x1p-126f, 0},
        {0x1p-130f, 0},               /* fp32 subnormal amax */
        {0x1p-149f, 0},
    };

    for (size_t i = 0; i < sizeof(cs) / sizeof(cs[0]); i++)
        cr_expect_eq(rf_quant_e8m0_of(cs[i].amax), cs[i].byte, "%a -> %u, want %u",
                     (double)cs[i].amax, rf_quant_e8m0_of(cs[i].amax), cs[i].byte);
    cr_expect_eq(rf_quant_e8m0_to_float(127), 1.0f);
    cr_expect_eq(rf_quant_e8m0_to_float(119), 0x1p-8f);
    cr_expect_eq(rf_quant_e8m0_to_float(254), 0x1p127f);
    cr_expect_eq(rf_quant_e8m0_to_float(1), 0x1p-126f);
    cr_expect_eq(fbits(rf_quant_e8m0_to_float(0)), 0x00400000u); /* 2^-127 */
    cr_expect(isnan(rf_quant_e8m0_to_float(255)));
}

/* ---- hand-made blocks ---- */

Test(quant, zero_block_scale_one)
{
    static uint16_t x[128 * 128];
    static uint8_t q[128 * 128];
    float s = -1.0f;
    rf_err err = {0};
    rf_quant_fmt f = fmt("block");

    x[77] = 0x8000; /* -0 */
    memset(q, 0xAA, sizeof(q));
    cr_assert_eq(rf_quant_host(&f, RF_DT_BF16, x, 128, 128, 128, q, 128, &s, 1, &err), 0, "%s",
                 err.msg);
    cr_expect_eq(s, 1.0f);
    for (int i = 0; i < 128 * 128; i++)
        cr_assert_eq(q[i], i == 77 ? 0x80 : 0x00, "element %d: 0x%02x", i, q[i]);
}

Test(quant, nan_and_inf_in_a_block)
{
    /* amax counts only finite elements: 2, scale 2/448; NaN of either sign -> 0x7F,
     * +-Inf -> +-448. */
    const uint16_t x[8] = {bf(1.0f), 0x7FC0, 0x7F80, 0xFF80, 0xFFC0, bf(2.0f), bf(-0.5f), 0};
    const uint8_t want[8] = {0x76, 0x7F, 0x7E, 0xFE, 0x7F, 0x7E, 0xEE, 0x00};
    uint8_t q[8];
    float s;
    rf_err err = {0};
    rf_quant_fmt f = fmt("block");

    cr_assert_eq(rf_quant_host(&f, RF_DT_BF16, x, 4, 2, 4, q, 4, &s, 1, &err), 0, "%s", err.msg);
    cr_expect_eq(fbits(s), 0x3B924925u); /* 2/448 */
    for (int i = 0; i < 8; i++)
        cr_expect_eq(q[i], want[i], "element %d: 0x%02x, want 0x%02x", i, q[i], want[i]);

    /* No finite element at all: amax 0, scale 1. */
    const uint16_t y[3] = {0x7FC0, 0xFF80, 0x7F80};
    cr_assert_eq(rf_quant_host(&f, RF_DT_BF16, y, 3, 1, 3, q, 3, &s, 1, &err), 0);
    cr_expect_eq(s, 1.0f);
    cr_expect_eq(q[0], 0x7F);
    cr_expect_eq(q[1], 0xFE);
    cr_expect_eq(q[2], 0x7E);
}

Test(quant, amax_448_scale_one)
{
    const uint16_t x[6] = {bf(448.0f), bf(1.0f), bf(-2.0f), 0x3DCD /* 0.10009765625 */,
                           bf(-448.0f), bf(240.0f)};
    const uint8_t want[6] = {0x7E, 0x38, 0xC0, 0x1D, 0xFE, 0x77};
    uint8_t q[6];
    float s;
    rf_quant_fmt f = fmt("block");

    cr_assert_eq(rf_quant_host(&f, RF_DT_BF16, x, 6, 1, 6, q, 6, &s, 1, NULL), 0);
    cr_expect_eq(s, 1.0f);
    for (int i = 0; i < 6; i++)
        cr_expect_eq(q[i], want[i], "element %d", i);
}

Test(quant, subnormal_inputs)
{
    rf_quant_fmt f = fmt("block");
    uint8_t q[4];
    float s;

    /* bf16 subnormals only: amax 2^-126 (bits 0x0080), scale 0x4925 * 2^-149; 2^-126 / s =
     * 447.99 -> 448 and 2^-133 / s = 3.49992 -> 3.5 (0x46). */
    const uint16_t a[3] = {0x0080, 0x0001, 0x8001};
    cr_assert_eq(rf_quant_host(&f, RF_DT_BF16, a, 3, 1, 3, q, 3, &s, 1, NULL), 0);
    cr_expect_eq(fbits(s), 0x4925u);
    cr_expect_eq(q[0], 0x7E);
    cr_expect_eq(q[1], 0x46);
    cr_expect_eq(q[2], 0xC6);

    /* fp16: 2^-15 next to amax 1: 2^-15 * 448 = 0.0136719 = 7 * 2^-9 (0x07); 2^-24 -> 0. */
    const uint16_t b[3] = {0x3C00, 0x0200, 0x0001};
    cr_assert_eq(rf_quant_host(&f, RF_DT_FP16, b, 3, 1, 3, q, 3, &s, 1, NULL), 0);
    cr_expect_eq(fbits(s), 0x3B124925u);
    cr_expect_eq(q[0], 0x7E);
    cr_expect_eq(q[1], 0x07);
    cr_expect_eq(q[2], 0x00);

    /* fp32 amax 2^-140: the scale is the subnormal 2^-149 (no flush to zero), so 2^-140
     * becomes 512 -> 448 and 2^-149 becomes 1. */
    const float c[2] = {0x1p-140f, 0x1p-149f};
    cr_assert_eq(rf_quant_host(&f, RF_DT_FP32, c, 2, 1, 2, q, 2, &s, 1, NULL), 0);
    cr_expect_eq(fbits(s), 1u);
    cr_expect_eq(q[0], 0x7E);
    cr_expect_eq(q[1], 0x38);

    /* fp32 amax 2^-149: amax / 448 underflows to 0, the scale is 1, the element 0. */
    const float d[1] = {-0x1p-149f};
    cr_assert_eq(rf_quant_host(&f, RF_DT_FP32, d, 1, 1, 1, q, 1, &s, 1, NULL), 0);
    cr_expect_eq(s, 1.0f);
    cr_expect_eq(q[0], 0x80);
}

Test(quant, partial_edge_blocks)
{
    /* 130 x 200 in 128 x 128 blocks: scales 2 x 2, the right and bottom blocks partial.
     * Ones everywhere, then amax 448 in block (0,0), 896 in (0,1), 224 in (1,0), and block
     * (1,1) all zeros: scales 1, 2, 0.5, 1. */
    enum { R = 130, C = 200 };
    static uint16_t x[R * C];
    static uint8_t q[R * C];
    float s[4];
    uint64_t sr, sc;
    rf_quant_fmt f = fmt("block:128x128");

    for (int i = 0; i < R * C; i++)
        x[i] = bf(1.0f);
    x[5 * C + 7] = bf(448.0f);
    x[0 * C + 199] = bf(-896.0f);
    x[129 * C + 0] = bf(224.0f);
    for (int r = 128; r < R; r++)
        for (int c = 128; c < C; c++)
            x[r * C + c] = 0;
    cr_assert_eq(rf_quant_scale_shape(&f, R, C, &sr, &sc, NULL), 0);
    cr_assert_eq(sr, 2);
    cr_assert_eq(sc, 2);
    cr_assert_eq(rf_quant_host(&f, RF_DT_BF16, x, C, R, C, q, C, s, 2, NULL), 0);
    cr_expect_eq(s[0], 1.0f);
    cr_expect_eq(s[1], 2.0f);
    cr_expect_eq(s[2], 0.5f);
    cr_expect_eq(s[3], 1.0f);
    for (int r = 0; r < R; r++) {
        for (int c = 0; c < C; c++) {
            uint8_t want = r < 128 ? (c < 128 ? 0x38 : 0x30) : (c < 128 ? 0x40 : 0x00);
            if ((r == 5 && c == 7) || (r == 129 && c == 0))
                want = 0x7E;
            if (r == 0 && c == 199)
                want = 0xFE;
            cr_assert_eq(q[r * C + c], want, "[%d, %d]: 0x%02x, want 0x%02x", r, c,
                         q[r * C + c], want);
        }
    }

    /* A non-square block on a 7 x 11 matrix: 3 x 3 scales. */
    f = fmt("block:3x5");
    cr_assert_eq(rf_quant_scale_shape(&f, 7, 11, &sr, &sc, NULL), 0);
    cr_expect_eq(sr, 3);
    cr_expect_eq(sc, 3);
}

Test(quant, channel_and_tensor)
{
    /* Row 0: amax 4, scale 1/112: 1 -> 112 (0x6E), 2 -> 224 (0x76), -4 -> -448, 0.5 -> 56
     * (0x66). Row 1 zeros: scale 1. Row 2: amax 448 (NaN ignored): scale 1. */
    const uint16_t x[15] = {bf(1.0f), bf(2.0f), bf(-4.0f), 0, bf(0.5f),
                            0, 0, 0, 0, 0,
                            bf(448.0f), 0x7FC0, bf(1.0f), bf(-1.0f), bf(0.5f)};
    const uint8_t want[15] = {0x6E, 0x76, 0xFE, 0x00, 0x66,
                              0, 0, 0, 0, 0,
                              0x7E, 0x7F, 0x38, 0xB8, 0x30};
    uint8_t q[15];
    float s[3];
    uint64_t sr, sc;
    rf_quant_fmt f = fmt("channel");

    cr_assert_eq(rf_quant_scale_shape(&f, 3, 5, &sr, &sc, NULL), 0);
    cr_assert_eq(sr, 3);
    cr_assert_eq(sc, 1);
    cr_assert_eq(rf_quant_host(&f, RF_DT_BF16, x, 5, 3, 5, q, 5, s, 1, NULL), 0);
    cr_expect_eq(fbits(s[0]), 0x3C124925u); /* 4/448 */
    cr_expect_eq(s[1], 1.0f);
    cr_expect_eq(s[2], 1.0f);
    for (int i = 0; i < 15; i++)
        cr_expect_eq(q[i], want[i], "channel element %d: 0x%02x", i, q[i]);

    /* Tensor: one scale over all rows, amax 896 -> scale 2. */
    const uint16_t y[6] = {bf(1.0f), bf(-896.0f), bf(4.0f), bf(0.5f), 0x7F80, bf(100.0f)};
    /* 0.5, -448, 2, 0.25, 448, and 50, halfway 48..52: ties to the even 48 (0x64). */
    const uint8_t wy[6] = {0x30, 0xFE, 0x40, 0x28, 0x7E, 0x64};
    f = fmt("tensor");
    cr_assert_eq(rf_quant_scale_shape(&f, 2, 3, &sr, &sc, NULL), 0);
    cr_assert_eq(sr, 1);
    cr_assert_eq(sc, 1);
    cr_assert_eq(rf_quant_host(&f, RF_DT_BF16, y, 3, 2, 3, q, 3, s, 1, NULL), 0);
    cr_expect_eq(s[0], 2.0f);
    for (int i = 0; i < 6; i++)
        cr_expect_eq(q[i], wy[i], "tensor element %d: 0x%02x", i, q[i]);
}

Test(quant, mxfp8_blocks)
{
    /* 2 rows x 70 columns: blocks of 32, 32 and 6 per row. Row 0: block 0 amax 448 (byte
     * 127); block 1 amax 1 (byte 119, scale 2^-8: 1 -> 256, 0.5 -> 128); block 2 amax 500
     * (floor(log2) 8, byte 127: 500 and 480 clamp to 448). Row 1 zeros: bytes 127. */
    enum { C = 70 };
    uint16_t x[2 * C] = {0};
    uint8_t q[2 * C], e[2 * 3];
    uint64_t sr, sc;
    rf_quant_fmt f = fmt("mxfp8");

    for (int c = 0; c < C; c++)
        x[c] = bf(c < 32 ? 1.0f : c < 64 ? 0.5f : 2.0f);
    x[3] = bf(448.0f);
    x[40] = bf(1.0f);
    x[64] = bf(500.0f);
    x[65] = bf(480.0f);
    cr_assert_eq(rf_quant_scale_shape(&f, 2, C, &sr, &sc, NULL), 0);
    cr_assert_eq(sr, 2);
    cr_assert_eq(sc, 3);
    cr_assert_eq(rf_quant_scale_dtype(&f), RF_DT_UINT8);
    cr_assert_eq(rf_quant_host(&f, RF_DT_BF16, x, C, 2, C, q, C, e, 3, NULL), 0);
    cr_expect_eq(e[0], 127);
    cr_expect_eq(e[1], 119);
    cr_expect_eq(e[2], 127);
    cr_expect_eq(e[3], 127);
    cr_expect_eq(e[4], 127);
    cr_expect_eq(e[5], 127);
    for (int c = 0; c < C; c++) {
        uint8_t want = c < 32 ? 0x38 : c < 64 ? 0x70 : 0x40;
        if (c == 3 || c == 64 || c == 65)
            want = 0x7E;
        if (c == 40)
            want = 0x78;
        cr_expect_eq(q[c], want, "[0, %d]: 0x%02x, want 0x%02x", c, q[c], want);
        cr_expect_eq(q[C + c], 0, "[1, %d]", c);
    }

    /* Tiny and huge fp32 blocks: amax 1.875 * 2^-119 -> e = -127 unclamped: 2^-119 -> 256
     * (0x78), 1.5 * 2^-119 -> 384 (0x7C), 1.875 * 2^-119 -> 480 -> 448. amax 2^-140 -> e
     * clamped to -127 (byte 0): 2^-140 -> 2^-13 -> 0. FLT_MAX -> byte 246, scale 2^119:
     * FLT_MAX -> 511.99 -> 448, 2^127 -> 256. */
    const float t[3] = {0x1p-119f, 0x1.8p-119f, 0x1.ep-119f};
    cr_assert_eq(rf_quant_host(&f, RF_DT_FP32, t, 3, 1, 3, q, 3, e, 1, NULL), 0);
    cr_expect_eq(e[0], 0);
    cr_expect_eq(q[0], 0x78);
    cr_expect_eq(q[1], 0x7C);
    cr_expect_eq(q[2], 0x7E);
    const float u[2] = {0x1p-140f, -0x1p-141f};
    cr_assert_eq(rf_quant_host(&f, RF_DT_FP32, u, 2, 1, 2, q, 2, e, 1, NULL), 0);
    cr_expect_eq(e[0], 0);
    cr_expect_eq(q[0], 0x00);
    cr_expect_eq(q[1], 0x80);
    const float h[3] = {3.4028234663852886e38f, 0x1p127f, -INFINITY};
    cr_assert_eq(rf_quant_host(&f, RF_DT_FP32, h, 3, 1, 3, q, 3, e, 1, NULL), 0);
    cr_expect_eq(e[0], 246);
    cr_expect_eq(q[0], 0x7E);
    cr_expect_eq(q[1], 0x78);
    cr_expect_eq(q[2], 0xFE);
}

Test(quant, strided_buffers)
{
    /* 3 x 4 in 2 x 2 blocks from rows 7 apart whose padding holds NaN and 1e30 (never read
     * into amax), into fp8 rows 9 apart and scale rows 3 apart whose gaps must stay. */
    uint16_t x[3 * 7];
    uint8_t q[3 * 9];
    float s[2 * 3];
    rf_quant_fmt f = fmt("block:2x2");
    const float v[3][4] = {{1, 2, 4, 8}, {-1, 0.5f, 448, 0}, {3, 0, 0, 896}};

    ref_init();
    for (int i = 0; i < 3 * 7; i++)
        x[i] = (i % 7 == 5) ? 0x7FC0 : bf(0x1p100f);
    for (int r = 0; r < 3; r++)
        for (int c = 0; c < 4; c++)
            x[r * 7 + c] = bf(v[r][c]);
    memset(q, 0xAA, sizeof(q));
    for (int i = 0; i < 6; i++)
        s[i] = -7.0f;
    cr_assert_eq(rf_quant_host(&f, RF_DT_BF16, x, 7, 3, 4, q, 9, s, 3, NULL), 0);
    cr_expect_eq(s[0], 2.0f / 448);
    cr_expect_eq(s[1], 1.0f);
    cr_expect_eq(s[2], -7.0f);
    cr_expect_eq(s[3], 3.0f / 448);
    cr_expect_eq(s[4], 2.0f);
    cr_expect_eq(s[5], -7.0f);
    for (int r = 0; r < 3; r++) {
        for (int c = 0; c < 9; c++) {
            if (c >= 4) {
                cr_expect_eq(q[r * 9 + c], 0xAA, "padding [%d, %d] written", r, c);
                continue;
            }
            float sc = s[(r / 2) * 3 + c / 2];
            cr_expect_eq(q[r * 9 + c], ref_e4m3(fminf(fmaxf(v[r][c] / sc, -448), 448)),
                         "[%d, %d]", r, c);
        }
    }
    /* By hand for the first block (scale 1/224): 1 -> 224 (0x76), 2 -> 448, -1 -> 0xF6,
     * 0.5 -> 112 (0x6E). */
    cr_expect_eq(q[0], 0x76);
    cr_expect_eq(q[1], 0x7E);
    cr_expect_eq(q[9], 0xF6);
    cr_expect_eq(q[10], 0x6E);
}

/* ---- random matrices against the reference ---- */

static uint64_t rs = 0x9E3779B97F4A7C15u;

static uint64_t rnd(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return rs;
}

static float ref_load(rf_dtype dt, const void *src, int64_t i)
{
    if (dt == RF_DT_FP32)
        return ((const float *)src)[i];
    uint16_t h = ((const uint16_t *)src)[i];
    if (dt == RF_DT_BF16)
        return bitsf((uint32_t)h << 16);
    int e = (h >> 10) & 31, m = h & 1023;
    float v = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? ldexpf((float)m, -24)
                                                      : ldexpf((float)(1024 + m), e - 25);
    return (h & 0x8000) ? -v : v;
}

/* A random element: mostly values around 2^k for a per-matrix k, some zeros, subnormals,
 * NaN, Inf, and big values. */
static void rand_elem(rf_dtype dt, void *dst, int64_t i, int k)
{
    uint64_t r = rnd();
    uint32_t u;

    switch (r % 64) {
    case 0: u = 0x7FC00000u; break;
    case 1: u = 0xFF800000u; break;
    case 2: u = 0x7F800000u; break;
    case 3: u = 0; break;
    case 4: u = 0x80000000u; break;
    case 5: u = (uint32_t)(r >> 8) & 0x807FFFFFu; break; /* fp32 subnormal (0 in fp16) */
    default: {
        float v = ldexpf((float)((r >> 8) % 100000) / 50000.0f - 1.0f, k + (int)((r >> 40) % 5));
        u = fbits(v);
    }
    }
    if (dt == RF_DT_FP32) {
        ((uint32_t *)dst)[i] = u;
    } else if (dt == RF_DT_BF16) {
        ((uint16_t *)dst)[i] = (uint16_t)(u >> 16);
    } else {
        /* fp16: random bits, with the specials above kept as fp16 specials. */
        uint16_t h = (uint16_t)(r >> 16);
        if (r % 64 == 0)
            h = 0x7E00;
        else if (r % 64 == 1)
            h = 0xFC00;
        ((uint16_t *)dst)[i] = h;
    }
}

static void check_random(const char *fs, rf_dtype dt, uint64_t rows, uint64_t cols, int k)
{
    rf_quant_fmt f = fmt(fs);
    uint64_t sr, sc, br, bc;
    int64_t ss = (int64_t)cols + 3, qs = (int64_t)cols + 1;
    size_t es = rf_dtype_size(dt);
    void *x = malloc(rows * (uint64_t)ss * es);
    uint8_t *q = malloc(rows * (uint64_t)qs);
    void *sca, *deq;
    rf_err err = {0};

    cr_assert_eq(rf_quant_scale_shape(&f, rows, cols, &sr, &sc, NULL), 0);
    sca = malloc(sr * sc * 4);
    deq = malloc(rows * cols * 4);
    for (int64_t i = 0; i < (int64_t)rows * ss; i++)
        rand_elem(dt, x, i, k);
    cr_assert_eq(rf_quant_host(&f, dt, x, ss, rows, cols, q, qs, sca, (int64_t)sc, &err), 0,
                 "%s", err.msg);
    br = f.kind == RF_QUANT_BLOCK ? f.br : f.kind == RF_QUANT_TENSOR ? rows : 1;
    bc = f.kind == RF_QUANT_BLOCK ? f.bc : f.kind == RF_QUANT_MXFP8 ? 32 : cols;
    for (uint64_t bi = 0; bi < sr; bi++) {
        for (uint64_t bj = 0; bj < sc; bj++) {
            float amax = 0, s;
            for (uint64_t r = bi * br; r < rows && r < (bi + 1) * br; r++)
                for (uint64_t c = bj * bc; c < cols && c < (bj + 1) * bc; c++) {
                    float v = ref_load(dt, x, (int64_t)(r * (uint64_t)ss + c));
                    if (isfinite(v) && fabsf(v) > amax)
                        amax = fabsf(v);
                }
            if (f.kind == RF_QUANT_MXFP8) {
                int ex = 0, e;
                frexpf(amax, &ex);
                e = amax == 0 ? 0 : ex - 1 - 8;
                e = e < -127 ? -127 : e;
                s = ldexpf(1.0f, e);
                cr_assert_eq(((uint8_t *)sca)[bi * sc + bj], e + 127, "%s block [%lu, %lu]",
                             fs, (unsigned long)bi, (unsigned long)bj);
            } else {
                s = amax / 448.0f;
                s = s == 0 ? 1.0f : s;
                cr_assert_eq(fbits(((float *)sca)[bi * sc + bj]), fbits(s), "%s block [%lu, %lu]",
                             fs, (unsigned long)bi, (unsigned long)bj);
            }
            for (uint64_t r = bi * br; r < rows && r < (bi + 1) * br; r++)
                for (uint64_t c = bj * bc; c < cols && c < (bj + 1) * bc; c++) {
                    float v = ref_load(dt, x, (int64_t)(r * (uint64_t)ss + c)) / s;
                    uint8_t want = isnan(v) ? 0x7F : ref_e4m3(fminf(fmaxf(v, -448), 448));
                    cr_assert_eq(q[r * (uint64_t)qs + c], want, "%s %s [%lu, %lu]: 0x%02x, want "
                                 "0x%02x", fs, rf_dtype_name(dt), (unsigned long)r,
                                 (unsigned long)c, q[r * (uint64_t)qs + c], want);
                }
        }
    }
    /* Dequantized, every finite element is within half an E4M3 step of x. */
    cr_assert_eq(rf_quant_dequant_host(&f, q, qs, sca, (int64_t)sc, rows, cols, deq,
                                       (int64_t)cols, &err), 0, "%s", err.msg);
    for (uint64_t r = 0; r < rows; r++)
        for (uint64_t c = 0; c < cols; c++) {
            float v = ref_load(dt, x, (int64_t)(r * (uint64_t)ss + c));
            float d = ((float *)deq)[r * cols + c];
            float sb = f.kind == RF_QUANT_MXFP8
                           ? rf_quant_e8m0_to_float(((uint8_t *)sca)[(r / br) * sc + c / bc])
                           : ((float *)sca)[(r / br) * sc + c / bc];
            if (!isfinite(v))
                continue;
            /* |v| / s rounds by at most half a step: 2^-4 of its value, or 2^-10 among the
             * subnormals; the product may round to an fp32 subnormal. Values past 448 * s
             * clamp (MXFP8's [448, 512), or a subnormal scale that rounded down). */
            float tol = fmaxf(fabsf(v) / 16.0f, 0x1p-10f * sb) * 1.001f + 0x1p-149f;
            if (fabsf(v) / sb > 448)
                tol += fabsf(v) - 448 * sb;
            cr_assert_leq(fabsf(d - v), tol, "%s dequant [%lu, %lu]: %a vs %a", fs,
                          (unsigned long)r, (unsigned long)c, (double)d, (double)v);
        }
    free(x);
    free(q);
    free(sca);
    free(deq);
}

Test(quant, random_matrices_match_the_reference)
{
    const char *fs[] = {"block", "block:3x5", "block:1x64", "channel", "tensor", "mxfp8"};
    const rf_dtype dts[] = {RF_DT_BF16, RF_DT_FP16, RF_DT_FP32};
    const uint64_t shapes[][2] = {{300, 260}, {1, 33}, {129, 1}, {7, 64}};

    ref_init();
    for (size_t a = 0; a < sizeof(fs) / sizeof(fs[0]); a++)
        for (size_t b = 0; b < 3; b++)
            for (size_t c = 0; c < sizeof(shapes) / sizeof(shapes[0]); c++)
                check_random(fs[a], dts[b], shapes[c][0], shapes[c][1],
                             (int)(rnd() % 40) - 20);
}

/* ---- formats ---- */

Test(quant, fmt_parse_and_format)
{
    rf_quant_fmt f;
    char buf[64];
    const char *names[] = {"block:128x128", "block:64x32", "block:1x2147483648", "channel",
                           "tensor", "mxfp8"};

    f = fmt("block");
    cr_expect_eq(f.kind, RF_QUANT_BLOCK);
    cr_expect_eq(f.br, 128);
    cr_expect_eq(f.bc, 128);
    f = fmt("block:64x32");
    cr_expect_eq(f.br, 64);
    cr_expect_eq(f.bc, 32);
    f = fmt("mxfp8");
    cr_expect_eq(f.kind, RF_QUANT_MXFP8);
    cr_expect_eq(f.br, 1);
    cr_expect_eq(f.bc, 32);
    cr_expect_eq(fmt("channel").kind, RF_QUANT_CHANNEL);
    cr_expect_eq(fmt("tensor").kind, RF_QUANT_TENSOR);
    cr_expect_eq(rf_quant_scale_dtype(&f), RF_DT_UINT8);
    f = fmt("block");
    cr_expect_eq(rf_quant_scale_dtype(&f), RF_DT_FP32);
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        f = fmt(names[i]);
        rf_quant_fmt_format(&f, buf, sizeof(buf));
        cr_expect_str_eq(buf, names[i]);
    }
    f = (rf_quant_fmt){0, 0, 0};
    rf_quant_fmt_format(&f, buf, sizeof(buf));
    cr_expect_str_eq(buf, "?");
    /* The other kinds ignore br x bc. */
    f = (rf_quant_fmt){RF_QUANT_MXFP8, 0, 0};
    rf_quant_fmt_format(&f, buf, sizeof(buf));
    cr_expect_str_eq(buf, "mxfp8");
}

struct bad_fmt {
    const char *in;
    const char *msg;
};

Test(quant, fmt_parse_errors)
{
    const char *unknown = "expected block, block:<rows>x<cols>, channel, tensor or mxfp8";
    const char *dims = "the block must be <rows>x<cols>, each a number 1..2147483648";
    const struct bad_fmt cs[] = {
        {"blokc", unknown}, {"", unknown}, {"Block", unknown}, {"mxfp4", unknown},
        {"block128x128", unknown}, {"channel:1", unknown},
        {"block:", dims}, {"block:0x128", dims}, {"block:128", dims}, {"block:128x", dims},
        {"block:128x0", dims}, {"block:x128", dims}, {"block:128x128x", dims},
        {"block:2147483649x1", dims}, {"block:99999999999999999999x1", dims},
        {"block:-1x128", dims}, {"block:12 8x128", dims},
    };
    rf_quant_fmt f;
    rf_err err;
    char quoted[64];

    for (size_t i = 0; i < sizeof(cs) / sizeof(cs[0]); i++) {
        rf_err_clear(&err);
        cr_expect_eq(rf_quant_fmt_parse(cs[i].in, &f, &err), -EINVAL, "'%s'", cs[i].in);
        cr_expect_eq(err.code, -EINVAL);
        snprintf(quoted, sizeof(quoted), "\"%s\"", cs[i].in);
        cr_expect_not_null(strstr(err.msg, quoted), "'%s': %s", cs[i].in, err.msg);
        cr_expect_not_null(strstr(err.msg, cs[i].msg), "'%s': %s", cs[i].in, err.msg);
    }
    rf_err_clear(&err);
    cr_expect_eq(rf_quant_fmt_parse(NULL, &f, &err), -EINVAL);
    cr_expect_str_eq(err.msg, "unknown quantization format \"\": expected block, "
                     "block:<rows>x<cols>, channel, tensor or mxfp8");
}

Test(quant, malformed_fmt_refused)
{
    const rf_quant_fmt bad[] = {{0, 128, 128},           {RF_QUANT_MXFP8 + 1, 1, 32},
                                {RF_QUANT_BLOCK, 0, 128}, {RF_QUANT_BLOCK, 128, 0},
                                {RF_QUANT_BLOCK, 0x80000001u, 1}};
    uint64_t sr, sc;
    uint16_t x = 0;
    uint8_t q;
    float s, o;
    rf_err err;

    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        rf_err_clear(&err);
        cr_expect_eq(rf_quant_scale_shape(&bad[i], 4, 4, &sr, &sc, &err), -EINVAL);
        cr_expect_not_null(strstr(err.msg, "malformed quantization format (kind "), "%s", err.msg);
        rf_err_clear(&err);
        cr_expect_eq(rf_quant_host(&bad[i], RF_DT_BF16, &x, 1, 1, 1, &q, 1, &s, 1, &err), -EINVAL);
        cr_expect_not_null(strstr(err.msg, "malformed"), "%s", err.msg);
        rf_err_clear(&err);
        cr_expect_eq(rf_quant_dequant_host(&bad[i], &q, 1, &s, 1, 1, 1, &o, 1, &err), -EINVAL);
        cr_expect_not_null(strstr(err.msg, "malformed"), "%s", err.msg);
        rf_err_clear(&err);
        cr_expect_eq(rf_quant_box_ok(&bad[i], 4, 4, 0, 0, 4, 4, &err), -EINVAL);
        cr_expect_not_null(strstr(err.msg, "malformed"), "%s", err.msg);
    }
    rf_err_clear(&err);
    cr_expect_eq(rf_quant_scale_shape(&bad[2], 1, 1, &sr, &sc, &err), -EINVAL);
    cr_expect_str_eq(err.msg, "malformed quantization format (kind 1, block 0x128): build it "
                     "with rf_quant_fmt_parse");
    rf_err_clear(&err);
    cr_expect_eq(rf_quant_host(NULL, RF_DT_BF16, &x, 1, 1, 1, &q, 1, &s, 1, &err), -EINVAL);
    cr_expect_str_eq(err.msg, "quantization format is missing (NULL)");
}

/* ---- quantizer argument errors ---- */

Test(quant, host_argument_errors)
{
    rf_quant_fmt f = fmt("block:2x2");
    uint16_t x[16] = {0};
    uint8_t q[16];
    float s[4], o[16];
    rf_err err;

    rf_err_clear(&err);
    cr_expect_eq(rf_quant_host(&f, RF_DT_FP64, x, 4, 4, 4, q, 4, s, 2, &err), -EINVAL);
    cr_expect_str_eq(err.msg, "quantize: source dtype fp64 cannot be quantized; it must be "
                     "bf16, fp16 or fp32");
    rf_err_clear(&err);
    cr_expect_eq(rf_quant_host(&f, RF_DT_FP8_E4M3, x, 4, 4, 4, q, 4, s, 2, &err), -EINVAL);
    cr_expect_not_null(strstr(err.msg, "source dtype fp8"), "%s", err.msg);

    rf_err_clear(&err);
    cr_expect_eq(rf_quant_host(&f, RF_DT_BF16, x, 4, 4, 4, NULL, 4, s, 2, &err), -EINVAL);
    cr_expect_not_null(strstr(err.msg, "quantize: a buffer of the 4x4 matrix is NULL"), "%s",
                       err.msg);
    rf_err_clear(&err);
    cr_expect_eq(rf_quant_host(&f, RF_DT_BF16, NULL, 4, 4, 4, q, 4, s, 2, &err), -EINVAL);
    rf_err_clear(&err);
    cr_expect_eq(rf_quant_host(&f, RF_DT_BF16, x, 4, 4, 4, q, 4, NULL, 2, &err), -EINVAL);

    rf_err_clear(&err);
    cr_expect_eq(rf_quant_host(&f, RF_DT_BF16, x, 3, 4, 4, q, 4, s, 2, &err), -EINVAL);
    cr_expect_str_eq(err.msg, "quantize: row strides 3 (input) and 4 (output) of the 4x4 matrix "
                     "must be at least its 4 columns");
    rf_err_clear(&err);
    cr_expect_eq(rf_quant_host(&f, RF_DT_BF16, x, 4, 4, 4, q, 2, s, 2, &err), -EINVAL);
    cr_expect_not_null(strstr(err.msg, "and 2 (output)"), "%s", err.msg);
    rf_err_clear(&err);
    cr_expect_eq(rf_quant_host(&f, RF_DT_BF16, x, -4, 4, 4, q, 4, s, 2, &err), -EINVAL);
    rf_err_clear(&err);
    cr_expect_eq(rf_quant_host(&f, RF_DT_BF16, x, 4, 4, 4, q, -4, s, 2, &err), -EINVAL);
    rf_err_clear(&err);
    cr_expect_eq(rf_quant_host(&f, RF_DT_BF16, x, 4, 4, 4, q, 4, s, 1, &err), -EINVAL);
    cr_expect_str_eq(err.msg, "quantize: the scales' row stride 1 must be at least their 2 "
                     "columns (2x2 scales)");
    rf_err_clear(&err);
    cr_expect_eq(rf_quant_host(&f, RF_DT_BF16, x, 4, 4, 4, q, 4, s, -2, &err), -EINVAL);

    /* One row needs no row stride, one row of scales no scale stride. */
    cr_expect_eq(rf_quant_host(&f, RF_DT_BF16, x, 0, 1, 4, q, 0, s, 0, NULL), 0);
    /* An empty matrix does nothing, buffers or not. */
    cr_expect_eq(rf_quant_host(&f, RF_DT_BF16, NULL, 0, 0, 4, NULL, 0, NULL, 0, NULL), 0);
    cr_expect_eq(rf_quant_host(&f, RF_DT_BF16, NULL, 0, 4, 0, NULL, 0, NULL, 0, NULL), 0);
    cr_expect_eq(rf_quant_dequant_host(&f, NULL, 0, NULL, 0, 0, 0, NULL, 0, NULL), 0);

    rf_err_clear(&err);
    cr_expect_eq(rf_quant_dequant_host(&f, q, 4, s, 2, 4, 4, NULL, 4, &err), -EINVAL);
    cr_expect_not_null(strstr(err.msg, "dequantize: a buffer of the 4x4 matrix is NULL"), "%s",
                       err.msg);
    rf_err_clear(&err);
    cr_expect_eq(rf_quant_dequant_host(&f, q, 4, s, 2, 4, 4, o, 3, &err), -EINVAL);
    cr_expect_str_eq(err.msg, "dequantize: row strides 4 (input) and 3 (output) of the 4x4 "
                     "matrix must be at least its 4 columns");
}

/* ---- box checks ---- */

struct box_case {
    const char *fmt;
    uint64_t grows, gcols, row0, col0, rows, cols;
    const char *msg; /* NULL: accepted */
};

Test(quant, box_ok)
{
    const struct box_case cs[] = {
        {"block", 1024, 2048, 0, 0, 1024, 2048, NULL},
        {"block", 1024, 2048, 0, 0, 128, 2048, NULL},
        {"block", 1024, 2048, 128, 1024, 128, 1024, NULL},
        {"block", 1000, 2000, 896, 1920, 104, 80, NULL},  /* partial blocks at the end */
        {"block", 1000, 2000, 0, 0, 1000, 2000, NULL},
        {"block:3x5", 7, 11, 6, 10, 1, 1, NULL},
        {"channel", 100, 300, 3, 0, 4, 300, NULL},
        {"tensor", 100, 300, 0, 0, 100, 300, NULL},
        {"mxfp8", 10, 70, 5, 32, 1, 32, NULL},
        {"mxfp8", 10, 70, 0, 64, 10, 6, NULL},
        {"mxfp8", 10, 70, 3, 0, 7, 70, NULL},

        {"block", 1024, 2048, 0, 0, 100, 128,
         "quantization box [0:100, 0:128] of the 1024x2048 matrix cuts the 128x128 blocks of "
         "format block:128x128: its row edges must fall on multiples of 128 or on the matrix's "
         "end (1024)"},
        {"block", 1024, 2048, 64, 0, 64, 128, "its row edges must fall on multiples of 128"},
        {"block", 1024, 2048, 0, 100, 128, 128,
         "quantization box [0:128, 100:228] of the 1024x2048 matrix cuts the 128x128 blocks of "
         "format block:128x128: its column edges must fall on multiples of 128 or on the "
         "matrix's end (2048)"},
        {"block", 1000, 2000, 896, 1920, 100, 80, "row edges"},
        {"block", 1000, 2000, 896, 1920, 104, 70, "column edges"},
        {"block", 1024, 2048, 0, 0, 1025, 128,
         "quantization box [0:1025, 0:128] is empty or outside the 1024x2048 matrix"},
        {"block", 1024, 2048, 0, 2048, 128, 1, "is empty or outside the 1024x2048 matrix"},
        {"block", 1024, 2048, 0, 0, 0, 128, "is empty or outside"},
        {"block", 1024, 2048, 0, 0, 128, 0, "is empty or outside"},
        {"block", 1024, 2048, UINT64_MAX, 0, 2, 128, "is empty or outside"},
        {"block", 1024, 2048, 0, 1, 128, UINT64_MAX, "is empty or outside"},
        {"channel", 100, 300, 0, 0, 100, 150,
         "quantization box [0:100, 0:150] of the 100x300 matrix splits its rows; format channel "
         "has one scale per row: the box must span all 300 columns"},
        {"channel", 100, 300, 0, 150, 100, 150, "the box must span all 300 columns"},
        {"tensor", 100, 300, 0, 0, 50, 300,
         "quantization box [0:50, 0:300] is part of the 100x300 matrix, whose format tensor has "
         "one scale for the whole matrix: only the whole matrix can be quantized"},
        {"tensor", 100, 300, 0, 0, 100, 299, "only the whole matrix"},
        {"mxfp8", 10, 70, 0, 16, 1, 32,
         "quantization box [0:1, 16:48] of the 10x70 matrix cuts the 1x32 blocks of format "
         "mxfp8: its column edges must fall on multiples of 32 or on the matrix's end (70)"},
        {"mxfp8", 10, 70, 0, 0, 1, 40, "column edges must fall on multiples of 32"},
    };
    rf_err err;

    for (size_t i = 0; i < sizeof(cs) / sizeof(cs[0]); i++) {
        rf_quant_fmt f = fmt(cs[i].fmt);
        int rc;

        rf_err_clear(&err);
        rc = rf_quant_box_ok(&f, cs[i].grows, cs[i].gcols, cs[i].row0, cs[i].col0, cs[i].rows,
                             cs[i].cols, &err);
        if (cs[i].msg == NULL) {
            cr_expect_eq(rc, 0, "case %zu: %s", i, err.msg);
        } else {
            cr_expect_eq(rc, -EINVAL, "case %zu accepted", i);
            cr_expect_not_null(strstr(err.msg, cs[i].msg), "case %zu: %s", i, err.msg);
        }
    }
}

/* A box box_ok accepts, quantized by itself, gives the global bytes and its part of the
 * global scales. */
Test(quant, accepted_box_quantizes_alone)
{
    enum { R = 300, C = 260 };
    static uint16_t x[R * C];
    static uint8_t q[R * C], qb[R * C];
    float s[3 * 3], sb[3 * 3];
    rf_quant_fmt f = fmt("block");
    const uint64_t r0 = 128, c0 = 256, nr = 172, nc = 4;

    for (int i = 0; i < R * C; i++)
        x[i] = (uint16_t)(rnd() & 0xFF7F); /* finite bf16 of both signs */
    cr_assert_eq(rf_quant_box_ok(&f, R, C, r0, c0, nr, nc, NULL), 0);
    cr_assert_eq(rf_quant_host(&f, RF_DT_BF16, x, C, R, C, q, C, s, 3, NULL), 0);
    cr_assert_eq(rf_quant_host(&f, RF_DT_BF16, x + r0 * C + c0, C, nr, nc, qb, nc, sb, 1, NULL), 0);
    for (uint64_t r = 0; r < nr; r++)
        for (uint64_t c = 0; c < nc; c++)
            cr_assert_eq(qb[r * nc + c], q[(r0 + r) * C + c0 + c]);
    cr_expect_eq(fbits(sb[0]), fbits(s[1 * 3 + 2]));
    cr_expect_eq(fbits(sb[1]), fbits(s[2 * 3 + 2]));
}

/* ---- the vectorized paths against the scalar original ---- */


/* Every compilation this CPU runs against rf_quant_ref on one matrix: every byte and scale, and
 * nothing written in the strides' padding. */
static void check_isas(const char *fs, rf_dtype dt, uint64_t rows, uint64_t cols, int64_t ss,
                       int64_t qs, int64_t extra_scs, const void *x)
{
    rf_quant_fmt f = fmt(fs);
    uint64_t sr, sc;
    size_t se;
    uint8_t *q, *qr, *s, *sref;
    int64_t scs;
    int ran = 0;

    cr_assert_eq(rf_quant_scale_shape(&f, rows, cols, &sr, &sc, NULL), 0);
    se = f.kind == RF_QUANT_MXFP8 ? 1 : 4;
    scs = (int64_t)sc + extra_scs;
    q = malloc(rows * (uint64_t)qs);
    qr = malloc(rows * (uint64_t)qs);
    s = malloc(sr * (uint64_t)scs * se);
    sref = malloc(sr * (uint64_t)scs * se);
    cr_assert(q && qr && s && sref);
    memset(qr, 0xA5, rows * (uint64_t)qs);
    memset(sref, 0xA5, sr * (uint64_t)scs * se);
    rf_quant_ref(&f, dt, x, ss, rows, cols, qr, qs, sref, scs);
    for (int isa = 0; isa < 3; isa++) {
        rf_err err = {0};
        int rc;

        memset(q, 0xA5, rows * (uint64_t)qs);
        memset(s, 0xA5, sr * (uint64_t)scs * se);
        rc = rf_quant__host_isa(isa, &f, dt, x, ss, rows, cols, q, qs, s, scs, &err);
        if (rc == -ENOTSUP)
            break;
        cr_assert_eq(rc, 0, "%s", err.msg);
        ran++;
        for (uint64_t i = 0; i < rows * (uint64_t)qs; i++)
            cr_assert_eq(q[i], qr[i], "isa %d, %s %s %lux%lu (strides %ld, %ld): byte [%lu, %lu] "
                         "0x%02x, want 0x%02x", isa, fs, rf_dtype_name(dt), (unsigned long)rows,
                         (unsigned long)cols, (long)ss, (long)qs, (unsigned long)(i / (uint64_t)qs),
                         (unsigned long)(i % (uint64_t)qs), q[i], qr[i]);
        cr_assert_eq(memcmp(s, sref, sr * (uint64_t)scs * se), 0, "isa %d, %s %s %lux%lu: scales",
                     isa, fs, rf_dtype_name(dt), (unsigned long)rows, (unsigned long)cols);
    }
    cr_assert_geq(ran, 1);
    free(q);
    free(qr);
    free(s);
    free(sref);
}

Test(quant, vector_paths_match_the_original_on_random_matrices)
{
    const char *fs[] = {"block", "block:3x5", "block:1x64", "block:2x48", "block:7x16",
                        "block:1x32", "block:4x1", "channel", "tensor", "mxfp8"};
    const rf_dtype dts[] = {RF_DT_BF16, RF_DT_FP16, RF_DT_FP32};
    /* Odd shapes: single elements, one row, one column, widths around the 16/32/64-element
     * steps and the 2 KB panels, and a tensor block past the prefetch's 256 KB. */
    const uint64_t shapes[][2] = {{1, 1},   {1, 17},  {3, 15},   {2, 31},   {5, 33},
                                  {129, 1}, {7, 64},  {9, 65},   {4, 1000}, {130, 257},
                                  {3, 1025}, {2, 4097}, {300, 520}};
    const int64_t pads[][2] = {{0, 0}, {3, 1}, {1, 16}};

    for (size_t a = 0; a < sizeof(fs) / sizeof(fs[0]); a++)
        for (size_t b = 0; b < 3; b++)
            for (size_t c = 0; c < sizeof(shapes) / sizeof(shapes[0]); c++) {
                uint64_t rows = shapes[c][0], cols = shapes[c][1];
                const int64_t *pd = pads[(a + b + c) % 3];
                int64_t ss = (int64_t)cols + pd[0], qs = (int64_t)cols + pd[1];
                size_t es = rf_dtype_size(dts[b]);
                void *x = malloc(rows * (uint64_t)ss * es);
                int k = (int)(rnd() % 40) - 20;

                cr_assert(x);
                for (int64_t i = 0; i < (int64_t)rows * ss; i++)
                    rand_elem(dts[b], x, i, k);
                check_isas(fs[a], dts[b], rows, cols, ss, qs, (int64_t)(c % 2), x);
                free(x);
            }
}

/* Every 16-bit pattern as bf16 and fp16 (and the fp32 of each bf16), in rows that mix
 * magnitudes, through every format. */
Test(quant, vector_paths_match_the_original_on_every_16_bit_pattern)
{
    const char *fs[] = {"block", "block:1x128", "block:2x48", "channel", "tensor", "mxfp8"};
    static uint16_t h[65536];
    static uint32_t w[65536];

    for (uint32_t i = 0; i < 65536; i++) {
        /* A bit permutation, so that each block holds patterns of many exponents. */
        uint16_t v = (uint16_t)((i * 40503u) & 0xFFFF);
        h[i] = v;
        w[i] = (uint32_t)v << 16 | (i & 0xFFFF);
    }
    for (size_t a = 0; a < sizeof(fs) / sizeof(fs[0]); a++) {
        check_isas(fs[a], RF_DT_BF16, 256, 256, 256, 256, 0, h);
        check_isas(fs[a], RF_DT_FP16, 256, 256, 256, 256, 0, h);
        check_isas(fs[a], RF_DT_FP32, 256, 256, 256, 256, 0, w);
        check_isas(fs[a], RF_DT_BF16, 1, 65536, 65536, 65536, 0, h);
    }
}
