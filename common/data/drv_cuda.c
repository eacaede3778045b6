/* common/data/drv_cuda.c - the CUDA driver API opened with dlopen once per process, and the
 * translation of CUDA errors into negative errnos with a message for a person. */
#include "drv_cuda.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define RF_LOG_MODULE "cuda"
#include "log.h"

typedef CUresult (*get_proc_fn)(const char *symbol, void **pfn, int cuda_version,
                                cuuint64_t flags, CUdriverProcAddressQueryResult *status);

static rf_cu_api cu_api;
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static int cu_rc;
static char cu_msg[sizeof(((rf_err *)0)->msg)];

#define ENTRY(name) {#name, (void **)&cu_api.name}

static void cu_open(void)
{
    const struct { const char *name; void **slot; } table[] = {
        ENTRY(cuInit), ENTRY(cuGetErrorString), ENTRY(cuDeviceGetCount), ENTRY(cuDeviceGet),
        ENTRY(cuDeviceGetUuid), ENTRY(cuDevicePrimaryCtxRetain),
        ENTRY(cuDevicePrimaryCtxRelease), ENTRY(cuCtxPushCurrent), ENTRY(cuCtxPopCurrent),
        ENTRY(cuPointerGetAttributes), ENTRY(cuMemGetAddressRange), ENTRY(cuIpcGetMemHandle),
        ENTRY(cuIpcOpenMemHandle), ENTRY(cuIpcCloseMemHandle),
        ENTRY(cuMemRetainAllocationHandle), ENTRY(cuMemRelease),
        ENTRY(cuMemGetAllocationPropertiesFromHandle), ENTRY(cuMemGetAllocationGranularity),
        ENTRY(cuMemExportToShareableHandle), ENTRY(cuMemImportFromShareableHandle),
        ENTRY(cuMemAddressReserve), ENTRY(cuMemAddressFree), ENTRY(cuMemMap), ENTRY(cuMemUnmap),
        ENTRY(cuMemSetAccess), ENTRY(cuMemCreate),
    };
    CUdriverProcAddressQueryResult qs;
    get_proc_fn get_proc;
    void *lib;
    int n = 0;
    CUresult e;

    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(cu_msg, sizeof(cu_msg), "no CUDA driver: cannot open libcuda.so.1 (%s); "
                 "GPU memory is not available, host memory still is", dlerror());
        cu_rc = -ENODEV;
        return;
    }
    get_proc = (get_proc_fn)dlsym(lib, "cuGetProcAddress_v2");
    if (get_proc == NULL) {
        snprintf(cu_msg, sizeof(cu_msg), "the CUDA driver is too old (no cuGetProcAddress_v2): "
                 "install a driver for CUDA 12 or later");
        cu_rc = -ENODEV;
        return;
    }
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        e = get_proc(table[i].name, table[i].slot, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &qs);
        if (e != CUDA_SUCCESS || *table[i].slot == NULL) {
            snprintf(cu_msg, sizeof(cu_msg), "the CUDA driver lacks %s (error %d): install a "
                     "driver for CUDA 12 or later", table[i].name, (int)e);
            cu_rc = -ENODEV;
            return;
        }
    }
    e = cu_api.cuInit(0);
    if (e == CUDA_SUCCESS)
        e = cu_api.cuDeviceGetCount(&n);
    if (e != CUDA_SUCCESS || n == 0) {
        const char *s = NULL;

        if (e != CUDA_SUCCESS)
            cu_api.cuGetErrorString(e, &s);
        snprintf(cu_msg, sizeof(cu_msg), "no CUDA device: %s; GPU memory is not available, "
                 "host memory still is", e != CUDA_SUCCESS ? (s ? s : "cuInit failed")
                                                           : "the driver reports 0 devices");
        cu_rc = -ENODEV;
        return;
    }
    /* The library stays open for the life of the process: entry points point into it. */
    cu_rc = 0;
}

int rf_cu_load(const rf_cu_api **out, rf_err *err)
{
    pthread_once(&cu_once, cu_open);
    if (cu_rc < 0) {
        if (out)
            *out = NULL;
        return rf_err_set(err, cu_rc, "%s", cu_msg);
    }
    if (out)
        *out = &cu_api;
    return 0;
}

int rf_cuda_available(void)
{
    return rf_cu_load(NULL, NULL) == 0;
}

int rf_cu_uuid(const rf_cu_api *cu, CUdevice dev, char *buf, size_t len, rf_err *err)
{
    CUuuid u;
    const unsigned char *b = (const unsigned char *)u.bytes;
    int rc = 0;

    CU_TRY(err, cu->cuDeviceGetUuid(&u, dev));
    snprintf(buf, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
             "%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8],
             b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
out:
    return rc;
}

static int errno_of_cuda(cudaError_t e)
{
    switch (e) {
    case cudaErrorMemoryAllocation: return -ENOMEM;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice: return -ENODEV;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle: return -EINVAL;
    case cudaErrorNotSupported: return -ENOTSUP;
    default: return -EIO;
    }
}

static int errno_of_cu(CUresult e)
{
    switch (e) {
    case CUDA_ERROR_OUT_OF_MEMORY: return -ENOMEM;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED: return -ENODEV;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_INVALID_CONTEXT:
    case CUDA_ERROR_NOT_FOUND: return -EINVAL;
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NOT_PERMITTED: return -ENOTSUP;
    case CUDA_ERROR_ALREADY_MAPPED: return -EEXIST;
    default: return -EIO;
    }
}

int rf_cuda__fail(rf_err *err, cudaError_t e, const char *call, const char *file, int line)
{
    int code = errno_of_cuda(e);

    RF_DEBUG("%s:%d: %s: %s", file, line, call, cudaGetErrorString(e));
    return rf_err_set(err, code, "%s failed at %s:%d: %s (%s)", call, file, line,
                      cudaGetErrorString(e), cudaGetErrorName(e));
}

int rf_cu__fail(rf_err *err, CUresult e, const char *call, const char *file, int line)
{
    const char *s = NULL;
    int code = errno_of_cu(e);

    if (cu_api.cuGetErrorString)
        cu_api.cuGetErrorString(e, &s);
    RF_DEBUG("%s:%d: %s: %s", file, line, call, s ? s : "?");
    return rf_err_set(err, code, "%s failed at %s:%d: %s (CUresult %d)", call, file, line,
                      s ? s : "unknown driver error", (int)e);
}
