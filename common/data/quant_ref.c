/* common/data/quant_ref.c - rf_quant_host as first written, one element at a time with c10's
 * branchy e4m3 conversion: the scalar reference test_quant, bench_quant and the simulated
 * engine's verification hold the fast paths and the installed bytes to. */
#include "quant_ref.h"

#include <string.h>

static float ref_bf16(uint16_t h)
{
    return rf_quant_u2f((uint32_t)h << 16);
}

static float ref_fp16(uint16_t h)
{
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    uint32_t normal = s | ((e + 127 - 15) << 23) | (m << 13);
    uint32_t special = s | UINT32_C(0x7F800000) | (m << 13);
    uint32_t sub = s | rf_quant_f2u((float)m * 0x1p-24f);

    return rf_quant_u2f(e == 0x1F ? special : e == 0 ? sub : normal);
}

static float ref_load(rf_dtype dt, const void *p, uint64_t i)
{
    if (dt == RF_DT_BF16)
        return ref_bf16(((const uint16_t *)p)[i]);
    if (dt == RF_DT_FP16)
        return ref_fp16(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* c10's fp8e4m3fn_from_fp32_value, as quant.c first wrote it. */
static uint8_t ref_e4m3(float f)
{
    uint32_t bits = rf_quant_f2u(f), sign = bits & UINT32_C(0x80000000), r;

    bits ^= sign;
    if (bits >= UINT32_C(1087) << 20)
        r = 0x7F;
    else if (bits < UINT32_C(121) << 23)
        r = rf_quant_f2u(rf_quant_u2f(bits) + rf_quant_u2f(UINT32_C(141) << 23)) - (UINT32_C(141) << 23);
    else
        r = (bits + ((uint32_t)(7 - 127) << 23) + 0x7FFFF + ((bits >> 20) & 1)) >> 20;
    return (uint8_t)(r | (sign >> 24));
}

static uint8_t ref_quant_one(float x, float s)
{
    uint32_t b = rf_quant_f2u(x / s), sign = b & UINT32_C(0x80000000), a = b ^ sign;

    if (a > UINT32_C(0x7F800000))
        return 0x7F;
    a = a > UINT32_C(0x43E00000) ? UINT32_C(0x43E00000) : a;
    return ref_e4m3(rf_quant_u2f(a | sign));
}

void rf_quant_ref(const rf_quant_fmt *f, rf_dtype dt, const void *src, int64_t ss,
                  uint64_t rows, uint64_t cols, uint8_t *q, int64_t qs, void *scales, int64_t scs)
{
    uint64_t br = f->kind == RF_QUANT_BLOCK ? f->br : f->kind == RF_QUANT_TENSOR ? rows : 1;
    uint64_t bc = f->kind == RF_QUANT_BLOCK ? f->bc : f->kind == RF_QUANT_MXFP8 ? 32 : cols;
    size_t es = rf_dtype_size(dt);

    for (uint64_t r0 = 0, i = 0; r0 < rows; r0 += br, i++) {
        for (uint64_t c0 = 0, j = 0; c0 < cols; c0 += bc, j++) {
            uint64_t r1 = r0 + br < rows ? r0 + br : rows, c1 = c0 + bc < cols ? c0 + bc : cols;
            float amax = 0.0f, s;

            for (uint64_t r = r0; r < r1; r++)
                for (uint64_t c = c0; c < c1; c++) {
                    float v = ref_load(dt, (const char *)src + r * (uint64_t)ss * es, c);
                    uint32_t a = rf_quant_f2u(v) & UINT32_C(0x7FFFFFFF);

                    if (a < UINT32_C(0x7F800000) && rf_quant_u2f(a) > amax)
                        amax = rf_quant_u2f(a);
                }
            if (f->kind == RF_QUANT_MXFP8) {
                uint8_t e = rf_quant_e8m0_of(amax);

                ((uint8_t *)scales)[(int64_t)i * scs + (int64_t)j] = e;
                s = rf_quant_e8m0_to_float(e);
            } else {
                s = rf_quant_scale_of(amax);
                ((float *)scales)[(int64_t)i * scs + (int64_t)j] = s;
            }
            for (uint64_t r = r0; r < r1; r++)
                for (uint64_t c = c0; c < c1; c++)
                    q[r * (uint64_t)qs + c] =
                        ref_quant_one(ref_load(dt, (const char *)src + r * (uint64_t)ss * es, c),
                                      s);
        }
    }
}
