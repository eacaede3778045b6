/* client/lib/refit_cuda.c - librefit's export of GPU memory: finds the CUDA allocation behind
 * a pointer and shares it with the daemon as a legacy IPC handle of its base or, for VMM
 * allocations, as POSIX file descriptors: one, or one per allocation when the range runs over
 * several mapped back to back (PyTorch's expandable segments). The driver is opened at run
 * time (drv_cuda). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "drv_cuda.h"
#include "mem.h"
#include "refit.pb-c.h"
#include "refit_int.h"
#include "rpc.pb-c.h"

/* Why a VMM allocation has no fd to give, for the messages below. PyTorch's expandable
 * segments (c10/cuda/CUDACachingAllocator.cpp, ExpandableSegment::map) request
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR on every chunk they cuMemCreate, except where the
 * driver grants CU_MEM_HANDLE_TYPE_FABRIC, which they try first and then use alone
 * (IMEX / multi-node NVLink systems), and in Meta-internal FBCODE builds, which request none. */
#define VMM_FD_HINT "create it with that handle type in cuMemCreate (PyTorch's expandable " \
    "segments do, unless the driver granted them CU_MEM_HANDLE_TYPE_FABRIC, which they try " \
    "first and then use instead; its default caching allocator's blocks are shared by CUDA IPC)"

/* Exports the VMM allocation h holding [ptr, ptr + size) (mapped at base) as an fd. */
static int export_vmm(refit_client *c, const rf_cu_api *cu, CUmemGenericAllocationHandle h,
                      const char *uuid, CUdeviceptr base, uint64_t asize, uint64_t off,
                      uint64_t size, uint32_t *region)
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
                         "the daemon: " VMM_FD_HINT, uuid, (unsigned)prop.requestedHandleTypes);
        goto done;
    }
    CU_TRY(&err, cu->cuMemExportToShareableHandle(&fd, h,
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    /* The daemon can only map the allocation whole and cannot ask its size: send it. */
    for (int i = 0; i < 8; i++)
        le[i] = (uint8_t)(asize >> (8 * i));
    /* base names the allocation to the daemon: every region of it shares one mapping. */
    rc = refit__register_region(c, uuid, REFIT__RPC__MEM_KIND__MEM_CUDA_VMM_FD, le, sizeof(le),
                                off, size, fd, (uint64_t)base, region);
    goto done;
out:
    rc = refit__fail(c, rc, "exporting a CUDA VMM allocation on %s: %s", uuid, err.msg);
done:
    if (fd >= 0)
        close(fd);
    return rc;
}

/* Exports the VMM allocations mapped back to back over [ptr, ptr + size), the first mapped
 * at base, one fd each, as one region. Every byte of the range must be mapped. */
static int export_vmm_span(refit_client *c, const rf_cu_api *cu, CUdeviceptr ptr,
                           uint64_t size, CUdeviceptr base, int ordinal, const char *uuid,
                           uint32_t *region)
{
    CUdeviceptr at = base, end = ptr + size, b = 0;
    CUmemGenericAllocationHandle h;
    CUmemAllocationProp prop;
    uint64_t *sizes = NULL;
    int *fds = NULL;
    size_t n = 0, cap = 0, len = 0;
    rf_err err = {0};
    int rc = 0, have_h = 0;

    while (at < end) {
        if (n == RF_MEM_MAX_CHUNKS) {
            rc = refit__fail(c, -E2BIG, "GPU range %p + %" PRIu64 " bytes on %s spans more "
                             "than %d CUDA VMM allocations (the most one region may): "
                             "register it as several regions", (void *)(uintptr_t)ptr, size,
                             uuid, RF_MEM_MAX_CHUNKS);
            goto done;
        }
        if (n == cap) {
            size_t ncap = cap ? cap * 2 : 8;
            uint64_t *ns = realloc(sizes, ncap * sizeof(*ns));
            int *nf;

            if (ns != NULL)
                sizes = ns;
            nf = ns ? realloc(fds, ncap * sizeof(*nf)) : NULL;
            if (nf == NULL) {
                rc = refit__fail(c, -ENOMEM, "out of memory");
                goto done;
            }
            fds = nf;
            cap = ncap;
        }
        CU_TRY(&err, cu->cuMemGetAddressRange(&b, &len, at));
        if (b != at) {
            rc = refit__fail(c, -EINVAL, "GPU range %p + %" PRIu64 " bytes on %s: the CUDA "
                             "mapping at 0x%llx starts at 0x%llx, inside the previous one; "
                             "register one region per mapping", (void *)(uintptr_t)ptr, size,
                             uuid, (unsigned long long)at, (unsigned long long)b);
            goto done;
        }
        if (cu->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)at) != CUDA_SUCCESS) {
            rc = refit__fail(c, -EINVAL, "GPU range %p + %" PRIu64 " bytes on %s runs from a "
                             "CUDA VMM allocation into memory at 0x%llx that is not one "
                             "(cudaMalloc memory): register one region per allocation",
                             (void *)(uintptr_t)ptr, size, uuid, (unsigned long long)at);
            goto done;
        }
        have_h = 1;
        memset(&prop, 0, sizeof(prop));
        CU_TRY(&err, cu->cuMemGetAllocationPropertiesFromHandle(&prop, h));
        if (!(prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
            rc = refit__fail(c, -ENOTSUP, "GPU range %p + %" PRIu64 " bytes on %s runs over "
                             "CUDA VMM allocation %zu (at 0x%llx), created without "
                             "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in requestedHandleTypes "
                             "(it has 0x%x), so it cannot be shared with the daemon: "
                             VMM_FD_HINT, (void *)(uintptr_t)ptr, size, uuid, n,
                             (unsigned long long)at, (unsigned)prop.requestedHandleTypes);
            goto done;
        }
        if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != ordinal) {
            rc = refit__fail(c, -EINVAL, "GPU range %p + %" PRIu64 " bytes on %s runs over "
                             "CUDA VMM allocation %zu (at 0x%llx) that lives on another "
                             "device (location %d:%d): register one region per GPU",
                             (void *)(uintptr_t)ptr, size, uuid, n, (unsigned long long)at,
                             (int)prop.location.type, prop.location.id);
            goto done;
        }
        CU_TRY(&err, cu->cuMemExportToShareableHandle(&fds[n], h,
                                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                                      0));
        cu->cuMemRelease(h);
        have_h = 0;
        sizes[n++] = len;
        at = b + len;
    }
    rc = refit__register_vmm_chunks(c, uuid, (uint64_t)(ptr - base), size, sizes, fds, n,
                                    (uint64_t)base, region);
    goto done;
out:
    rc = refit__fail(c, rc, "exporting the CUDA VMM allocations of GPU range %p + %" PRIu64
                     " bytes on %s (at 0x%llx): %s", (void *)(uintptr_t)ptr, size, uuid,
                     (unsigned long long)at, err.msg);
done:
    if (have_h)
        cu->cuMemRelease(h);
    for (size_t i = 0; i < n; i++)
        close(fds[i]);
    free(fds);
    free(sizes);
    return rc;
}

/* A VMM allocation the daemon cannot map (export_vmm's -ENOTSUP): installed in this process
 * instead, the refusal kept as the reason (refit_region_mode). */
static int inproc_fallback(refit_client *c, const char *uuid, const void *devptr,
                           uint64_t size, uint32_t *region)
{
    char why[384];

    /* A trainer's memory must be shareable: its refusal stands. */
    if (refit__kind(c) != REFIT_ENGINE)
        return -ENOTSUP;
    snprintf(why, sizeof(why), "installed in this process: %s", refit_last_error(c));
    return refit__register_inproc(c, uuid, (void *)devptr, size, why, region);
}

int refit_region_inproc(refit_client *c, void *ptr, uint64_t size, uint32_t *region)
{
    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                   CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
    unsigned int mtype = 0;
    int ordinal = -1, rc;
    void *data[] = {&mtype, &ordinal};
    const rf_cu_api *cu = NULL;
    char uuid[RF_CUDA_UUID_MAX];
    CUdevice dev = 0;
    rf_err err = {0};

    /* Without a driver, or for memory CUDA does not know, it is host memory. */
    if (ptr == NULL || rf_cu_load(&cu, &err) < 0 ||
        cu->cuPointerGetAttributes(2, attrs, data, (CUdeviceptr)(uintptr_t)ptr) != CUDA_SUCCESS ||
        mtype != CU_MEMORYTYPE_DEVICE)
        return refit__register_inproc(c, "host", ptr, size, "registered as in-process host "
                                      "memory (refit_region_inproc)", region);
    if ((rc = cu->cuDeviceGet(&dev, ordinal)) != CUDA_SUCCESS)
        return refit__fail(c, -EIO, "refit_region_inproc: cuDeviceGet(%d) failed (%d)", ordinal,
                           rc);
    if ((rc = rf_cu_uuid(cu, dev, uuid, sizeof(uuid), &err)) < 0)
        return refit__fail(c, rc, "refit_region_inproc: %s", err.msg);
    return refit__register_inproc(c, uuid, ptr, size, "registered as in-process GPU memory "
                                  "(refit_region_inproc)", region);
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
    if (size > asize - (uint64_t)(ptr - base) || ptr + size < ptr) {
        /* A VMM range may go on into the next allocation mapped after this one (PyTorch's
         * expandable segments); cudaMalloc memory ends where its allocation does. */
        if (ptr + size >= ptr &&
            cu->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)ptr) == CUDA_SUCCESS) {
            cu->cuMemRelease(h);
            rc = export_vmm_span(c, cu, ptr, size, base, ordinal, uuid, region);
            if (rc == -ENOTSUP)
                rc = inproc_fallback(c, uuid, devptr, size, region);
            goto done;
        }
        rc = refit__fail(c, -EINVAL, "GPU range %p + %" PRIu64 " bytes runs past the end of "
                         "its CUDA allocation (%zu bytes from 0x%llx on %s): register one "
                         "region per allocation", devptr, size, asize,
                         (unsigned long long)base, uuid);
        goto done;
    }
    if (cu->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)ptr) == CUDA_SUCCESS) {
        rc = export_vmm(c, cu, h, uuid, base, asize, (uint64_t)(ptr - base), size, region);
        cu->cuMemRelease(h);
        if (rc == -ENOTSUP)
            rc = inproc_fallback(c, uuid, devptr, size, region);
        goto done;
    }
    CU_TRY(&err, cu->cuIpcGetMemHandle(&ih, base));
    rc = refit__register_region(c, uuid, REFIT__RPC__MEM_KIND__MEM_CUDA_IPC, ih.reserved,
                                sizeof(ih.reserved), (uint64_t)(ptr - base), size, -1, 0,
                                region);
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
