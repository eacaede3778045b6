/* common/data/quant.h - FP8 (float8_e4m3fn) quantization of bf16/fp16/fp32 matrices: the one
 * definition of the arithmetic (issue 15), its host implementation, and the shard checks the
 * planner makes. A CUDA version must give the same bytes; what it must match is written here.
 *
 * THE CONTRACT (every implementation, host or GPU, and the torch reference follow it)
 *
 * Input. Elements are bf16, fp16 or fp32, upcast exactly to fp32 (bf16: bits << 16; fp16:
 * the exact IEEE widening, subnormals included). All arithmetic below is IEEE fp32 with
 * round-to-nearest-even and no flush-to-zero: a CUDA kernel is built without --use_fast_math
 * or -ftz=true, and its divisions are IEEE ones (`/` under the default -prec-div=true, or
 * __fdiv_rn); x / scale is a division, never a multiplication by a reciprocal.
 *
 * Blocks. The block grid starts at the matrix's origin [0, 0]; a 2-D matrix is rows x cols,
 * row-major (the weight's [out_features, in_features]).
 *   RF_QUANT_BLOCK   br x bc blocks (default 128 x 128: DeepSeek-V3's and Qwen3-FP8's
 *                    `weight_scale_inv`). Scales are fp32, laid out
 *                    [ceil(rows / br), ceil(cols / bc)]; blocks at the bottom and right edges
 *                    are partial and cover only the elements that exist.
 *   RF_QUANT_CHANNEL one fp32 scale per row (output channel) over the whole row; scales
 *                    [rows, 1].
 *   RF_QUANT_TENSOR  one fp32 scale for the whole matrix; scales [1, 1].
 *   RF_QUANT_MXFP8   OCP MX v1.0 MXFP8 (E4M3 elements): 1 x 32 blocks along the last dim
 *                    (the last block of a row is partial when cols % 32 != 0); one E8M0
 *                    scale byte per block, laid out [rows, ceil(cols / 32)].
 *
 * amax. amax = max |x| over the FINITE elements of the block, in fp32; NaN and +-Inf do not
 * count. A block with no finite element (or only zeros) has amax = 0.
 *
 * fp32 scales (block, channel, tensor).
 *   scale = amax / 448.0f                          (fp32 division; 448 = E4M3's largest value)
 *   if (scale == 0.0f) scale = 1.0f
 * The second line covers amax == 0 (all zeros, or no finite element), and also an fp32 source
 * whose amax is below 448 * 2^-150 (~6.3e-43), where amax / 448 underflows to 0; bf16 and
 * fp16 sources never underflow here (their smallest magnitudes are 2^-133 and 2^-24). The
 * scale is what is stored (DeepSeek's `weight_scale_inv`): dequantized x = e4m3(q) * scale.
 *
 * MXFP8 scales. With amax > 0, e = floor(log2(amax)) - 8 (8 = emax of E4M3), computed exactly
 * from amax's fp32 bits: for a normal amax its unbiased exponent, for a subnormal one
 * -149 + the index of its highest set mantissa bit (no libm log2). e is clamped to
 * [-127, 127] (only -127 can bind: floor(log2) of an fp32 lies in [-149, 127]). The scale is
 * 2^e, its E8M0 byte e + 127 (0..246; byte 255, E8M0's NaN, is never produced). amax == 0
 * gives byte 127 (scale 1.0). As in OCP MX v1.0, amax / 2^e lies in [256, 512) (unclamped e): the
 * elements of a block above 448 * 2^e are clamped to 448 (that is the spec's choice, kept).
 *
 * Elements. For each x of a block with scale s (fp32 scale, or 2^e as an fp32 value, which
 * for e = -127 is the subnormal 2^-127):
 *   v = x / s                                       (fp32 division)
 *   v = v < -448 ? -448 : v > 448 ? 448 : v         (NaN stays NaN, +-Inf becomes +-448)
 *   q = isnan(v) ? 0x7F : rf_quant_e4m3_from_float(v)
 * So a finite x and +-Inf give a finite q (+-Inf gives 0x7E / 0xFE), -0 gives 0x80, and every
 * NaN gives 0x7F whatever its sign: the sign of a NaN does not survive a division on every
 * device (CUDA returns the canonical NaN 0x7FFFFFFF), so the contract does not keep it.
 */
#ifndef RF_QUANT_H
#define RF_QUANT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "err.h"
#include "layout.h"
#include "quant_fmt.h"

/* An fp32's bits and back (exact; for the host implementations and their references). */
static inline uint32_t rf_quant_f2u(float f)
{
    uint32_t u;

    memcpy(&u, &f, sizeof(u));
    return u;
}

static inline float rf_quant_u2f(uint32_t u)
{
    float f;

    memcpy(&f, &u, sizeof(f));
    return f;
}

/* fp32 -> float8_e4m3fn, round to nearest even. It is the same algorithm, bit for bit, as
 * PyTorch's c10::detail::fp8e4m3fn_from_fp32_value (c10/util/Float8_e4m3fn.h): |v| >= 480
 * (and Inf, NaN) gives 0x7F (NaN), |v| < 2^-6 goes through the denormal path (an fp32
 * addition of 2^14), the sign bit is ORed in. No saturation: 465 gives NaN; quantization
 * clamps before calling it. */
uint8_t rf_quant_e4m3_from_float(float v);
/* float8_e4m3fn -> fp32, exact; 0x7F and 0xFF decode to NaN (of that sign). */
float rf_quant_e4m3_to_float(uint8_t q);
/* The fp32 scale of a block with this amax (see the contract). */
float rf_quant_scale_of(float amax);
/* The E8M0 byte of an MXFP8 block with this amax (finite, >= 0), and its value 2^(byte-127). */
uint8_t rf_quant_e8m0_of(float amax);
float rf_quant_e8m0_to_float(uint8_t e);

/* Quantizes the rows x cols matrix at src (elements of src_dt: RF_DT_BF16, RF_DT_FP16 or
 * RF_DT_FP32; row r starts src_row_stride elements after row r - 1) into q (row stride
 * q_row_stride bytes) and its scales (the shape of rf_quant_scale_shape, row stride
 * scale_row_stride scale elements: fp32, or bytes for MXFP8), the block grid starting at
 * the matrix's origin. Each stride must be at least its row's length (where there is more
 * than one row). An empty matrix does nothing. 0, or -EINVAL (nothing written) for a
 * malformed format, another dtype, a short stride or a NULL buffer; err says which. */
int rf_quant_host(const rf_quant_fmt *f, rf_dtype src_dt, const void *src, int64_t src_row_stride,
                  uint64_t rows, uint64_t cols, uint8_t *q, int64_t q_row_stride, void *scales,
                  int64_t scale_row_stride, rf_err *err);
/* rf_quant_host with the compilation of its loops chosen: 0 plain C, 1 AVX2, 2 AVX-512, -1 the
 * best this CPU runs (what rf_quant_host uses); -ENOTSUP for one this CPU lacks. For the test
 * and the bench, which run each path against the scalar original. */
int rf_quant__host_isa(int isa, const rf_quant_fmt *f, rf_dtype src_dt, const void *src,
                       int64_t src_row_stride, uint64_t rows, uint64_t cols, uint8_t *q,
                       int64_t q_row_stride, void *scales, int64_t scale_row_stride, rf_err *err);

/* The inverse for tests and verification: out[r, c] = e4m3(q[r, c]) * scale of its block, in
 * fp32 (out's row stride in floats). Same checks and errors as rf_quant_host. */
int rf_quant_dequant_host(const rf_quant_fmt *f, const uint8_t *q, int64_t q_row_stride,
                          const void *scales, int64_t scale_row_stride, uint64_t rows,
                          uint64_t cols, float *out, int64_t out_row_stride, rf_err *err);

#endif
