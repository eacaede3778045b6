/* common/data/quant_ref.h - the scalar reference of the FP8 arithmetic (quant.h): rf_quant_host's
 * original, one element at a time, which test_quant, bench_quant and the simulated engine's
 * verification (sim/) hold the fast paths and the daemons' installed bytes to. */
#ifndef RF_QUANT_REF_H
#define RF_QUANT_REF_H

#include <stdint.h>

#include "quant.h"

/* What rf_quant_host writes, by the contract of quant.h taken literally (a checked format and
 * dtype: no checks here). */
void rf_quant_ref(const rf_quant_fmt *f, rf_dtype dt, const void *src, int64_t ss,
                  uint64_t rows, uint64_t cols, uint8_t *q, int64_t qs, void *scales, int64_t scs);

#endif
