/* tests/unit/quant_ref.h - the scalar original of rf_quant_host (tests/unit/quant_ref.c), the
 * reference for test_quant and bench_quant. */
#ifndef RF_QUANT_REF_H
#define RF_QUANT_REF_H

#include <stdint.h>

#include "quant.h"

/* What rf_quant_host writes, by the contract of quant.h taken literally (a checked format and
 * dtype: no checks here). */
void rf_quant_ref(const rf_quant_fmt *f, rf_dtype dt, const void *src, int64_t ss,
                  uint64_t rows, uint64_t cols, uint8_t *q, int64_t qs, void *scales, int64_t scs);

#endif
