/* common/data/qshadow_cuda.c - FP8 shadows on a GPU: cudaMalloc'd on the piece's GPU and
 * quantized there by quant_cuda, synchronously (the receiver quantizes after every transfer
 * of the refit landed, before it reports the refit done). */
#include "qshadow.h"

#include <errno.h>

#include <cuda_runtime.h>

#include "drv_cuda.h"
#include "qcopy.h"
#include "quant_cuda.h"

int rf_qshadow__cuda_dev(const void *p)
{
    struct cudaPointerAttributes a;

    if (!rf_cuda_available())
        return -1;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
}

/* Runs the rest of a function on GPU dev; the caller's device back with restore_dev. */
static int use_dev(int dev, int *prev, rf_err *err)
{
    int rc = 0;

    CUDA_TRY(err, cudaGetDevice(prev));
    CUDA_TRY(err, cudaSetDevice(dev));
out:
    return rc;
}

int rf_qshadow__cuda_alloc(rf_qshadow *sh, uint64_t bytes, rf_err *err)
{
    int prev = 0, rc;
    cudaError_t e;

    if ((rc = use_dev(sh->dev, &prev, err)) < 0)
        return rc;
    e = cudaMalloc((void **)&sh->buf, bytes ? bytes : 1);
    cudaSetDevice(prev);
    if (e != cudaSuccess) {
        cudaGetLastError();
        sh->buf = NULL;
        return rf_err_set(err, -ENOMEM, "cannot allocate a %llu-byte shadow on GPU %d, beside "
                          "its FP8 piece: %s", (unsigned long long)bytes, sh->dev,
                          cudaGetErrorString(e));
    }
    return 0;
}

void rf_qshadow__cuda_free(rf_qshadow *sh)
{
    int prev = 0;
    rf_err err = {0};

    if (sh->buf && use_dev(sh->dev, &prev, &err) == 0) {
        cudaFree(sh->buf);
        cudaSetDevice(prev);
    }
    sh->buf = NULL;
}

int rf_qshadow__cuda_quantize(const rf_qshadow *sh, const rf_xfer_item *src,
                              const rf_xfer_item *dst, rf_err *err)
{
    const rf_xfer_quant *x = &dst->quant;
    rf_quant_fmt f = {x->q.kind, x->q.br, x->q.bc};
    int L = dst->ndim - 2, prev = 0, rc;
    uint64_t nm = rf_qcopy_nmatrices(&dst->box, dst->ndim);

    if ((rc = use_dev(sh->dev, &prev, err)) < 0)
        return rc;
    for (uint64_t l = 0; l < nm && rc == 0; l++) {
        rf_qcopy_matrix m;

        rf_qcopy_matrix_at(src, dst, l, &m);
        rc = rf_quant_cuda_quantize(&f, x->dt, m.src, m.src_row_stride,
                                    (uint64_t)dst->box.extent[L],
                                    (uint64_t)dst->box.extent[L + 1], m.q, m.q_row_stride,
                                    m.scales, m.scale_row_stride, cudaStreamPerThread, err);
    }
    if (rc == 0)
        CUDA_TRY(err, cudaStreamSynchronize(cudaStreamPerThread));
out:
    cudaSetDevice(prev);
    return rc;
}
