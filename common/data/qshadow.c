/* common/data/qshadow.c - FP8 shadows in host memory, and the dispatch to the GPU's
 * (qshadow_cuda.c) for shadows of pieces in GPU memory. */
#include "qshadow.h"

#include <errno.h>
#include <stdlib.h>

#include "qcopy.h"

int rf_qshadow_alloc(rf_qshadow *sh, const void *near, uint64_t bytes, rf_err *err)
{
    sh->buf = NULL;
    sh->dev = -1;
#ifdef RF_HAVE_CUDA
    if ((sh->dev = rf_qshadow__cuda_dev(near)) >= 0)
        return rf_qshadow__cuda_alloc(sh, bytes, err);
#else
    (void)near;
#endif
    if (!(sh->buf = malloc(bytes ? bytes : 1)))
        return rf_err_set(err, -ENOMEM, "out of memory for a %llu-byte shadow in host memory",
                          (unsigned long long)bytes);
    return 0;
}

void rf_qshadow_free(rf_qshadow *sh)
{
#ifdef RF_HAVE_CUDA
    if (sh->dev >= 0) {
        rf_qshadow__cuda_free(sh);
        return;
    }
#endif
    free(sh->buf);
    sh->buf = NULL;
}

int rf_qshadow_quantize(const rf_qshadow *sh, const rf_xfer_item *src, const rf_xfer_item *dst,
                        uint8_t **tmp, uint64_t *cap, rf_err *err)
{
#ifdef RF_HAVE_CUDA
    if (sh->dev >= 0)
        return rf_qshadow__cuda_quantize(sh, src, dst, err);
#else
    (void)sh;
#endif
    if (dst->bytes > *cap) {
        uint8_t *n = realloc(*tmp, dst->bytes);

        if (!n)
            return rf_err_set(err, -ENOMEM, "out of memory quantizing %llu bytes of FP8 on the "
                              "receiver", (unsigned long long)dst->bytes);
        *tmp = n;
        *cap = dst->bytes;
    }
    rf_qcopy_pack(src, *tmp);
    rf_qcopy_unpack(dst, *tmp);
    return 0;
}
