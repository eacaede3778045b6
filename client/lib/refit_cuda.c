/* client/lib/refit_cuda.c - librefit's export of GPU memory: finds the CUDA allocation behind
 * a pointer and shares it with the daemon as a legacy IPC handle of its base or, for VMM
 * allocations, as a POSIX file descriptor. The driver is opened at run time (drv_cuda). */
#include <inttypes.h>
#include <string.h>
#include <unistd.h>

#include "drv_cuda.h"
#include "refit.pb-c.h"
#include "refit_int.h"
#include "rpc.pb-c.h"

/* Exports the VMM allocation h holding [ptr, ptr + size) (mapped at base) as an fd. */
static int export_vmm(refit_client *c, const rf_cu_api *cu, CUmemGenericAllocationHandle h,
                      const char *uuid, uint64_t asize, uint64_t off, uint64_t size,
                      uint32_t *region)
{
    CUmemAllocationProp prop;
    uint8_t le[8];
    rf_err err = {0};
    int fd = -1, rc = 0;

    memset(&prop, 0, sizeof(prop));
    CU_TRY(&err, cu->cuMemGetAllocationPropertiesFromHandle(&prop, h));
    if (!(prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
        rc = refit__fail(c, -ENOTSUP, "GPU memory on %s is a CUDA VMM allocation created "
                         "without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in "
                         "requestedHandleTypes (it has 0x%x), so it cannot be shared with "
                         "the daemon: create it with that handle type in cuMemCreate (PyTorch's "
                         "expandable segments do; its default caching allocator's blocks are "
                         "shared by CUDA IPC)", uuid,
                         (unsigned)prop.requestedHandleTypes);
        goto done;
    }
    CU_TRY(&err, cu->cuMemExportToShareableHandle(&fd, h,
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    /* The daemon can only map the allocation whole and cannot ask its size: send it. */
    for (int i = 0; i < 8; i++)
        le[i] = (uint8_t)(asize >> (8 * i));
    rc = refit__register_region(c, uuid, REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD, le, sizeof(le),
                                off, size, fd, region);
    goto done;
out:
    rc = refit__fail(c, rc, "exporting a CUDA VMM allocation on %s: %s", uuid, err.msg);
done:
    if (fd >= 0)
        close(fd);
    return rc;
}

int refit_region_cuda(refit_client *c, const void *devptr, uint64_t size, uint32_t *region)
{
    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                   CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                   CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                   CU_POINTER_ATTRIBUTE_CONTEXT};
    unsigned int mtype = 0, managed = 0;
    int ordinal = -1, rc = 0, pushed = 0, primary = 0;
    CUcontext pctx = NULL, popped;
    void *data[] = {&mtype, &managed, &ordinal, &pctx};
    CUdeviceptr ptr = (CUdeviceptr)(uintptr_t)devptr, base = 0;
    CUmemGenericAllocationHandle h;
    CUipcMemHandle ih;
    CUdevice dev = 0;
    const rf_cu_api *cu = NULL;
    char uuid[RF_CUDA_UUID_MAX];
    size_t asize = 0;
    rf_err err = {0};

    /* The pointer is judged before the connection, so its errors come first. */
    if (devptr == NULL || size == 0 || region == NULL)
        return refit__fail(c, -EINVAL, "refit_region_cuda: needs a device pointer, a size > 0 "
                           "and a region pointer");
    if ((rc = rf_cu_load(&cu, &err)) < 0)
        return refit__fail(c, rc, "cannot register GPU memory: %s", err.msg);
    CU_TRY(&err, cu->cuPointerGetAttributes(4, attrs, data, ptr));
    if (managed)
        return refit__fail(c, -EINVAL, "%p is CUDA managed memory (cudaMallocManaged), which "
                           "cannot be shared with another process: allocate the weights with "
                           "cudaMalloc (or PyTorch's caching allocator)", devptr);
    if (mtype != CU_MEMORYTYPE_DEVICE)
        return refit__fail(c, -EINVAL, "%p is host memory, not GPU memory: register host "
                           "memory with refit_alloc_host or refit_region_memfd (a memfd "
                           "shared with the daemon)", devptr);
    CU_TRY(&err, cu->cuDeviceGet(&dev, ordinal));
    if ((rc = rf_cu_uuid(cu, dev, uuid, sizeof(uuid), &err)) < 0)
        goto out;
    /* VMM allocations have no context of their own: use the device's primary one. */
    if (pctx == NULL) {
        CU_TRY(&err, cu->cuDevicePrimaryCtxRetain(&pctx, dev));
        primary = 1;
    }
    CU_TRY(&err, cu->cuCtxPushCurrent(pctx));
    pushed = 1;
    CU_TRY(&err, cu->cuMemGetAddressRange(&base, &asize, ptr));
    if (size > asize - (uint64_t)(ptr - base)) {
        rc = refit__fail(c, -EINVAL, "GPU range %p + %" PRIu64 " bytes runs past the end of "
                         "its CUDA allocation (%zu bytes from 0x%llx on %s): register one "
                         "region per allocation (PyTorch's expandable segments map memory in "
                         "separate chunks of 20 MiB: register each chunk's part, or turn "
                         "expandable segments off)", devptr, size, asize,
                         (unsigned long long)base, uuid);
        goto done;
    }
    if (cu->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)ptr) == CUDA_SUCCESS) {
        rc = export_vmm(c, cu, h, uuid, asize, (uint64_t)(ptr - base), size, region);
        cu->cuMemRelease(h);
        goto done;
    }
    CU_TRY(&err, cu->cuIpcGetMemHandle(&ih, base));
    rc = refit__register_region(c, uuid, REFIT__RPC__MEM_KIND__MEM_CUDA_IPC, ih.reserved,
                                sizeof(ih.reserved), (uint64_t)(ptr - base), size, -1, region);
    goto done;
out:
    rc = refit__fail(c, rc, "cannot export GPU memory at %p: %s", devptr, err.msg);
done:
    if (pushed)
        cu->cuCtxPopCurrent(&popped);
    if (primary)
        cu->cuDevicePrimaryCtxRelease(dev);
    return rc;
}
