/* common/data/mem_cuda.c - import of clients' GPU memory into the daemon: legacy CUDA IPC handles
 * (cuIpcOpenMemHandle of the allocation base) and VMM allocations shared as POSIX file
 * descriptors (import, reserve, map, set access), each in its GPU's primary context. */
#include "mem_cuda.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "drv_cuda.h"
#include "mem.h"

#define RF_LOG_MODULE "mem_cuda"
#include "log.h"

typedef struct cuda_map {
    CUdevice dev;
    CUcontext ctx;          /* the device's primary context, retained */
    CUdeviceptr ptr;        /* ipc: the opened base; vmm: the reserved range */
    size_t len;
    int vmm;
    /* vmm: the imported allocations, in address order from ptr; nmapped of them mapped */
    size_t nh, nmapped;
    CUmemGenericAllocationHandle *h;
    size_t *hlen;
} cuda_map;

static const rf_cu_api *cu;

int rf_cuda_device_of_uuid(const char *uuid, int *ordinal, rf_err *err)
{
    char u[RF_CUDA_UUID_MAX], seen[256] = "";
    size_t used = 0;
    int n = 0, rc;

    if (uuid == NULL || strncasecmp(uuid, "GPU-", 4) != 0)
        return rf_err_set(err, -EINVAL, "device \"%s\" is not a GPU UUID: expected "
                          "\"GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx\" as nvidia-smi -L "
                          "prints it", uuid ? uuid : "(null)");
    if ((rc = rf_cu_load(&cu, err)) < 0)
        return rc;
    CU_TRY(err, cu->cuDeviceGetCount(&n));
    for (int i = 0; i < n; i++) {
        CUdevice dev;

        CU_TRY(err, cu->cuDeviceGet(&dev, i));
        if ((rc = rf_cu_uuid(cu, dev, u, sizeof(u), err)) < 0)
            goto out;
        if (strcasecmp(u, uuid) == 0) {
            *ordinal = i;
            return 0;
        }
        if (used < sizeof(seen))
            used += (size_t)snprintf(seen + used, sizeof(seen) - used, "%s%d=%s",
                                     i ? ", " : "", i, u);
    }
    rc = rf_err_set(err, -ENODEV, "no visible GPU has UUID %s (this process sees %d: %s); "
                    "run the daemon where that GPU is visible (check CUDA_VISIBLE_DEVICES)",
                    uuid, n, n ? seen : "none");
out:
    return rc;
}

/* Retains the primary context of the region's GPU and makes it current. */
static int enter(const rf_mem_desc *d, cuda_map *cm, rf_err *err)
{
    int ord = -1, rc;

    if ((rc = rf_cuda_device_of_uuid(d->device, &ord, err)) < 0)
        return rc;
    CU_TRY(err, cu->cuDeviceGet(&cm->dev, ord));
    CU_TRY(err, cu->cuDevicePrimaryCtxRetain(&cm->ctx, cm->dev));
    rc = 0;
    if (cu->cuCtxPushCurrent(cm->ctx) != CUDA_SUCCESS) {
        cu->cuDevicePrimaryCtxRelease(cm->dev);
        cm->ctx = NULL;
        rc = rf_err_set(err, -EIO, "cannot make the primary context of GPU %s current",
                        d->device);
    }
out:
    return rc;
}

static void leave(void)
{
    CUcontext c;

    cu->cuCtxPopCurrent(&c);
}

static int range_check(const char *what, const rf_mem_desc *d, uint64_t len, rf_err *err)
{
    if (d->offset > len || d->size > len - d->offset)
        return rf_err_set(err, -EINVAL, "%s on %s is %" PRIu64 " bytes, smaller than the "
                          "region claimed (offset %" PRIu64 " + size %" PRIu64 "): register "
                          "a range inside the allocation", what, d->device, len, d->offset,
                          d->size);
    return 0;
}

static int ipc_key(const rf_mem_desc *d, uint8_t *key, size_t *key_len, rf_err *err)
{
    if (d->handle == NULL || d->handle_len != sizeof(CUipcMemHandle))
        return rf_err_set(err, -EINVAL, "cuda_ipc region with a handle of %zu bytes: send the "
                          "%zu bytes of cudaIpcGetMemHandle in ipc_handle", d->handle_len,
                          sizeof(CUipcMemHandle));
    _Static_assert(sizeof(CUipcMemHandle) <= RF_MEM_KEY_MAX, "IPC handle fits a key");
    memcpy(key, d->handle, sizeof(CUipcMemHandle));
    *key_len = sizeof(CUipcMemHandle);
    return 0;
}

static int ipc_check(const rf_mem_desc *d, const rf_mem_map *m, rf_err *err)
{
    return range_check("CUDA IPC allocation", d, m->len, err);
}

static int ipc_import(const rf_mem_desc *d, rf_mem_map *m, rf_err *err)
{
    cuda_map *cm = calloc(1, sizeof(*cm));
    CUipcMemHandle h;
    CUdeviceptr base = 0;
    size_t len = 0;
    CUresult e;
    int rc, entered = 0;

    if (cm == NULL)
        return rf_err_set(err, -ENOMEM, "out of memory importing a CUDA IPC region");
    if ((rc = enter(d, cm, err)) < 0)
        goto out;
    entered = 1;
    memcpy(&h, d->handle, sizeof(h));
    e = cu->cuIpcOpenMemHandle(&cm->ptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (e != CUDA_SUCCESS) {
        rc = rf_cu__fail(err, e, "cuIpcOpenMemHandle", __FILE__, __LINE__);
        rf_err_wrap(err, "cannot open the CUDA IPC handle of a region on %s (the exporting "
                    "process must still hold the allocation, and a handle opens only in "
                    "another process): ", d->device);
        cm->ptr = 0;
        goto out;
    }
    CU_TRY(err, cu->cuMemGetAddressRange(&base, &len, cm->ptr));
    cm->len = len;
    if ((rc = range_check("CUDA IPC allocation", d, len, err)) < 0)
        goto out;
    RF_INFO("opened CUDA IPC allocation of %zu bytes on %s at 0x%llx", len, d->device,
             (unsigned long long)cm->ptr);
    m->base = (void *)(uintptr_t)cm->ptr;
    m->len = len;
    m->impl = cm;
    cm = NULL;
    rc = 0;
out:
    if (cm != NULL && cm->ptr)
        cu->cuIpcCloseMemHandle(cm->ptr);
    if (entered)
        leave();
    if (cm != NULL && cm->ctx)
        cu->cuDevicePrimaryCtxRelease(cm->dev);
    free(cm);
    return rc;
}

/* librefit sends the size of the whole allocation in ipc_handle (8 bytes, little-endian):
 * an imported handle's size cannot be queried, and it can only be mapped whole. */
static int vmm_alloc_size(const rf_mem_desc *d, uint64_t *size, rf_err *err)
{
    if (d->handle == NULL || d->handle_len != sizeof(uint64_t))
        return rf_err_set(err, -EINVAL, "cuda_vmm_fd region on %s without the allocation's "
                          "size (8 bytes in ipc_handle, %zu sent): use librefit's "
                          "refit_region_cuda", d->device, d->handle_len);
    *size = 0;
    for (int i = 7; i >= 0; i--)
        *size = (*size << 8) | d->handle[i];
    return 0;
}

/* The region's allocations as one list: its chunks, or its one allocation and fd. */
static int vmm_chunks(const rf_mem_desc *d, rf_mem_chunk *one, const rf_mem_chunk **ch,
                      size_t *n, uint64_t *total, rf_err *err)
{
    int rc;

    if (d->nchunks > 0) {
        *ch = d->chunks;
        *n = d->nchunks;
    } else {
        if ((rc = vmm_alloc_size(d, &one->size, err)) < 0)
            return rc;
        one->fd = d->fd;
        *ch = one;
        *n = 1;
    }
    *total = 0;
    for (size_t i = 0; i < *n; i++) {
        if ((*ch)[i].fd < 0)
            return rf_err_set(err, -EBADF, "cuda_vmm_fd region registered without the file "
                              "descriptor of allocation %zu of %zu: send the fd of "
                              "cuMemExportToShareableHandle for each, with the request "
                              "(SCM_RIGHTS)", i, *n);
        if ((*ch)[i].size == 0 || (*ch)[i].size > UINT64_MAX - *total)
            return rf_err_set(err, -EINVAL, "cuda_vmm_fd region on %s: allocation %zu of %zu "
                              "has size %" PRIu64 ": send each allocation's real size", d->device,
                              i, *n, (*ch)[i].size);
        *total += (*ch)[i].size;
    }
    return 0;
}

/* The fds of cuMemExportToShareableHandle are anonymous-inode files: every one of them has the
 * same st_dev/st_ino (seen with driver 580: two allocations on two GPUs collided), so nothing in
 * the fd identifies the allocation. A region whose client named its allocation (owner and
 * vmm_base, rf_mem_desc) shares the mapping of that client's other regions of it: the key is
 * the pair and the allocations' count and size. Any other region gets a mapping of its own (a
 * serial), which costs address space only: the allocation's whole size each, so a few thousand
 * regions of one large allocation would run out of it. A region over several allocations is one
 * object by the same rule, all its chunks mapped together. */
static uint64_t vmm_serial;

static int vmm_key(const rf_mem_desc *d, uint8_t *key, size_t *key_len, rf_err *err)
{
    const rf_mem_chunk *ch;
    rf_mem_chunk one;
    struct stat st;
    uint64_t total, serial, w[4];
    size_t n;
    int rc;

    if ((rc = vmm_chunks(d, &one, &ch, &n, &total, err)) < 0)
        return rc;
    for (size_t i = 0; i < n; i++)
        if (fstat(ch[i].fd, &st) < 0)
            return rf_err_set(err, -errno, "fstat of the VMM descriptor of allocation %zu of "
                              "%zu: %s", i, n, strerror(errno));
    if (d->owner != 0 && d->vmm_base != 0) {
        w[0] = d->owner;
        w[1] = d->vmm_base;
        w[2] = (uint64_t)n;
        w[3] = total;
        _Static_assert(1 + sizeof(w) <= RF_MEM_KEY_MAX, "a named allocation's key fits");
        key[0] = 'N';
        memcpy(key + 1, w, sizeof(w));
        *key_len = 1 + sizeof(w);
        return 0;
    }
    serial = __atomic_add_fetch(&vmm_serial, 1, __ATOMIC_RELAXED);
    key[0] = 'S';
    memcpy(key + 1, &serial, sizeof(serial));
    *key_len = 1 + sizeof(serial);
    return 0;
}

static int vmm_check(const rf_mem_desc *d, const rf_mem_map *m, rf_err *err)
{
    return range_check("mapped CUDA VMM allocation", d, m->len, err);
}

static void vmm_undo(cuda_map *cm)
{
    size_t off = 0;

    for (size_t i = 0; i < cm->nmapped; i++) {
        cu->cuMemUnmap(cm->ptr + off, cm->hlen[i]);
        off += cm->hlen[i];
    }
    cm->nmapped = 0;
    if (cm->ptr)
        cu->cuMemAddressFree(cm->ptr, cm->len);
    cm->ptr = 0;
    for (size_t i = 0; i < cm->nh; i++)
        cu->cuMemRelease(cm->h[i]);
    cm->nh = 0;
}

/* Every allocation is mapped whole (the driver maps an imported handle only whole) at its
 * place in one reserved range, so a region over several is contiguous here as in its client;
 * a size larger than the real one makes cuMemMap fail. */
static int vmm_import(const rf_mem_desc *d, rf_mem_map *m, rf_err *err)
{
    cuda_map *cm = calloc(1, sizeof(*cm));
    const rf_mem_chunk *ch = NULL;
    rf_mem_chunk one;
    CUmemAllocationProp prop;
    CUmemAccessDesc acc;
    size_t gran = 0, n = 0, off = 0;
    uint64_t total = 0;
    int rc, entered = 0;
    CUresult e;

    if (cm == NULL)
        return rf_err_set(err, -ENOMEM, "out of memory importing a CUDA VMM region");
    cm->vmm = 1;
    if ((rc = vmm_chunks(d, &one, &ch, &n, &total, err)) < 0 ||
        (rc = range_check(n > 1 ? "CUDA VMM range" : "CUDA VMM allocation", d, total, err)) < 0)
        goto out;
    cm->h = calloc(n, sizeof(*cm->h));
    cm->hlen = calloc(n, sizeof(*cm->hlen));
    if (cm->h == NULL || cm->hlen == NULL) {
        rc = rf_err_set(err, -ENOMEM, "out of memory importing a CUDA VMM region");
        goto out;
    }
    if ((rc = enter(d, cm, err)) < 0)
        goto out;
    entered = 1;
    for (size_t i = 0; i < n; i++) {
        e = cu->cuMemImportFromShareableHandle(&cm->h[i], (void *)(uintptr_t)ch[i].fd,
                                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (e != CUDA_SUCCESS) {
            rc = rf_cu__fail(err, e, "cuMemImportFromShareableHandle", __FILE__, __LINE__);
            rf_err_wrap(err, "the descriptor sent for allocation %zu of %zu of a cuda_vmm_fd "
                        "region on %s is no CUDA allocation handle: ", i, n, d->device);
            goto out;
        }
        cm->hlen[i] = (size_t)ch[i].size;
        cm->nh++;
        memset(&prop, 0, sizeof(prop));
        CU_TRY(err, cu->cuMemGetAllocationPropertiesFromHandle(&prop, cm->h[i]));
        CU_TRY(err, cu->cuMemGetAllocationGranularity(&gran, &prop,
                                                      CU_MEM_ALLOC_GRANULARITY_MINIMUM));
        if (gran == 0)
            gran = 2u << 20;
        if (ch[i].size % gran != 0) {
            rc = rf_err_set(err, -EINVAL, "cuda_vmm_fd allocation %zu of %zu on %s has size "
                            "%" PRIu64 ", not a multiple of its granularity %zu: send the "
                            "allocation's real size", i, n, d->device, ch[i].size, gran);
            goto out;
        }
    }
    cm->len = (size_t)total;
    CU_TRY(err, cu->cuMemAddressReserve(&cm->ptr, cm->len, gran, 0, 0));
    for (size_t i = 0; i < n; i++) {
        e = cu->cuMemMap(cm->ptr + off, cm->hlen[i], 0, cm->h[i], 0);
        if (e != CUDA_SUCCESS) {
            rc = rf_cu__fail(err, e, "cuMemMap", __FILE__, __LINE__);
            rf_err_wrap(err, "cannot map CUDA VMM allocation %zu of %zu (%zu bytes) on %s "
                        "(is that its real size?): ", i, n, cm->hlen[i], d->device);
            goto out;
        }
        cm->nmapped++;
        off += cm->hlen[i];
    }
    memset(&acc, 0, sizeof(acc));
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = cm->dev;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_TRY(err, cu->cuMemSetAccess(cm->ptr, cm->len, &acc, 1));
    RF_INFO("mapped CUDA VMM %s (%zu bytes%s) on %s at 0x%llx",
            n > 1 ? "range" : "allocation", cm->len, n > 1 ? ", several allocations" : "",
            d->device, (unsigned long long)cm->ptr);
    m->base = (void *)(uintptr_t)cm->ptr;
    m->len = cm->len;
    m->impl = cm;
    cm = NULL;
    rc = 0;
out:
    if (cm != NULL && entered)
        vmm_undo(cm);
    if (entered)
        leave();
    if (cm != NULL && cm->ctx)
        cu->cuDevicePrimaryCtxRelease(cm->dev);
    if (cm != NULL) {
        free(cm->h);
        free(cm->hlen);
    }
    free(cm);
    return rc;
}

static void cuda_close(rf_mem_map *m)
{
    cuda_map *cm = m->impl;
    CUcontext c;

    if (cm == NULL)
        return;
    if (cu->cuCtxPushCurrent(cm->ctx) == CUDA_SUCCESS) {
        if (cm->vmm)
            vmm_undo(cm);
        else
            cu->cuIpcCloseMemHandle(cm->ptr);
        cu->cuCtxPopCurrent(&c);
    }
    cu->cuDevicePrimaryCtxRelease(cm->dev);
    free(cm->h);
    free(cm->hlen);
    free(cm);
    m->impl = NULL;
}

static const rf_mem_ops ipc_ops = {
    .name = "cuda_ipc",
    .key = ipc_key,
    .import = ipc_import,
    .check = ipc_check,
    .close = cuda_close,
};

static const rf_mem_ops vmm_ops = {
    .name = "cuda_vmm_fd",
    .key = vmm_key,
    .import = vmm_import,
    .check = vmm_check,
    .close = cuda_close,
};

int rf_mem_cuda_init(rf_err *err)
{
    int rc = rf_cu_load(&cu, err);

    if (rc < 0)
        return rc;
    rf_mem_set_ops(RF_MEM_CUDA_IPC, &ipc_ops);
    rf_mem_set_ops(RF_MEM_CUDA_VMM_FD, &vmm_ops);
    return 0;
}
