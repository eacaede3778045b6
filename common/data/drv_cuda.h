/* common/data/drv_cuda.h - the CUDA driver API, opened at run time (libcuda is never linked, so
 * binaries start where no driver is installed), and the one place CUDA errors become ours:
 * CUDA_TRY for the runtime API, CU_TRY for the driver API. */
#ifndef RF_DRV_CUDA_H
#define RF_DRV_CUDA_H

#include <stddef.h>

#include <cuda.h>
#include <cuda_runtime_api.h>


#ifdef __cplusplus
extern "C" {
#endif

#include "err.h"

#define RF_CUDA_UUID_MAX 48 /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" and its NUL */

/* The driver entry points refit uses, resolved by name for the ABI of CUDA 12.0. */
typedef struct rf_cu_api {
#define RF_CU_FN(name) __typeof__(name) *name
    RF_CU_FN(cuInit);
    RF_CU_FN(cuGetErrorString);
    RF_CU_FN(cuDeviceGetCount);
    RF_CU_FN(cuDeviceGet);
    RF_CU_FN(cuDeviceGetUuid);
    RF_CU_FN(cuDevicePrimaryCtxRetain);
    RF_CU_FN(cuDevicePrimaryCtxRelease);
    RF_CU_FN(cuCtxPushCurrent);
    RF_CU_FN(cuCtxPopCurrent);
    RF_CU_FN(cuPointerGetAttributes);
    RF_CU_FN(cuMemGetAddressRange);
    RF_CU_FN(cuIpcGetMemHandle);
    RF_CU_FN(cuIpcOpenMemHandle);
    RF_CU_FN(cuIpcCloseMemHandle);
    RF_CU_FN(cuMemRetainAllocationHandle);
    RF_CU_FN(cuMemRelease);
    RF_CU_FN(cuMemGetAllocationPropertiesFromHandle);
    RF_CU_FN(cuMemGetAllocationGranularity);
    RF_CU_FN(cuMemExportToShareableHandle);
    RF_CU_FN(cuMemImportFromShareableHandle);
    RF_CU_FN(cuMemAddressReserve);
    RF_CU_FN(cuMemAddressFree);
    RF_CU_FN(cuMemMap);
    RF_CU_FN(cuMemUnmap);
    RF_CU_FN(cuMemSetAccess);
    RF_CU_FN(cuMemCreate);
#undef RF_CU_FN
} rf_cu_api;

/* Opens libcuda.so.1 and initialises the driver, once per process; later calls return the
 * first answer. -ENODEV (err says why) when there is no driver or no CUDA device, so callers
 * can carry on with host memory. */
int rf_cu_load(const rf_cu_api **out, rf_err *err);
/* True when a CUDA device is usable here (for tests that skip without one). */
int rf_cuda_available(void);
/* The UUID of device ordinal dev as nvidia-smi prints it ("GPU-8f6c..."). */
int rf_cu_uuid(const rf_cu_api *cu, CUdevice dev, char *buf, size_t len, rf_err *err);

/* Fill err from a failed call (what failed, where, the library's own message) and map the
 * error to a negative errno. Used through the macros below. */
int rf_cuda__fail(rf_err *err, cudaError_t e, const char *call, const char *file, int line);
int rf_cu__fail(rf_err *err, CUresult e, const char *call, const char *file, int line);

/* Both set rc and jump to the function's `out:` label on failure. */
#define CUDA_TRY(err, call)                                                           \
    do {                                                                              \
        cudaError_t e_ = (call);                                                      \
        if (e_ != cudaSuccess) {                                                      \
            rc = rf_cuda__fail((err), e_, #call, __FILE__, __LINE__);                 \
            goto out;                                                                 \
        }                                                                             \
    } while (0)

#define CU_TRY(err, call)                                                             \
    do {                                                                              \
        CUresult e_ = (call);                                                         \
        if (e_ != CUDA_SUCCESS) {                                                     \
            rc = rf_cu__fail((err), e_, #call, __FILE__, __LINE__);                   \
            goto out;                                                                 \
        }                                                                             \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif
