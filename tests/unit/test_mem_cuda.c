/* tests/unit/test_mem_cuda.c - CUDA memory import (common/data/mem_cuda) and librefit's export
 * checks (client/lib/refit_cuda.c) inside one process: UUIDs, VMM fds exported and imported
 * back, and every refusal. IPC handles open only in another process: tests/gpu/01-mem-copy.sh
 * checks that path with the real binaries. GPU tests skip without a CUDA device. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "refit.h"

#ifdef RF_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "drv_cuda.h"
#include "mem.h"
#include "mem_cuda.h"

static const rf_cu_api *cu;

static void need_gpu(void)
{
    if (!rf_cuda_available())
        cr_skip_test("no CUDA device");
    cr_assert_eq(rf_cu_load(&cu, NULL), 0);
    cr_assert_eq(cudaSetDevice(0), cudaSuccess);
}

Test(mem_cuda, no_device_is_enodev_with_a_message)
{
    rf_err err = {0};
    uint32_t region;
    int rc = rf_mem_cuda_init(&err);

    if (rf_cuda_available()) {
        cr_assert_eq(rc, 0, "%s", err.msg);
        return;
    }
    cr_assert_eq(rc, -ENODEV);
    cr_assert(strstr(err.msg, "no CUDA"), "%s", err.msg);
    cr_assert_eq(refit_region_cuda(NULL, (void *)0x1000, 16, &region), -ENODEV);
    cr_assert(strstr(refit_last_error(NULL), "cannot register GPU memory"), "%s",
              refit_last_error(NULL));
}

Test(mem_cuda, uuid_maps_to_ordinal, .init = need_gpu)
{
    char u[RF_CUDA_UUID_MAX];
    rf_err err = {0};
    int n = 0, ord = -1;

    cr_assert_eq(cu->cuDeviceGetCount(&n), CUDA_SUCCESS);
    for (int i = 0; i < n; i++) {
        CUdevice d;

        cr_assert_eq(cu->cuDeviceGet(&d, i), CUDA_SUCCESS);
        cr_assert_eq(rf_cu_uuid(cu, d, u, sizeof(u), &err), 0, "%s", err.msg);
        cr_assert_eq(strlen(u), 40, "%s", u);
        cr_assert_eq(rf_cuda_device_of_uuid(u, &ord, &err), 0, "%s", err.msg);
        cr_assert_eq(ord, i);
    }
    cr_assert_eq(rf_cuda_device_of_uuid("host", &ord, &err), -EINVAL);
    cr_assert(strstr(err.msg, "is not a GPU UUID"), "%s", err.msg);
    cr_assert_eq(rf_cuda_device_of_uuid("GPU-00000000-0000-0000-0000-000000000000", &ord,
                                        &err), -ENODEV);
    cr_assert(strstr(err.msg, "no visible GPU has UUID"), "%s", err.msg);
}

static void uuid0(char *u)
{
    CUdevice d;

    cr_assert_eq(cu->cuDeviceGet(&d, 0), CUDA_SUCCESS);
    cr_assert_eq(rf_cu_uuid(cu, d, u, RF_CUDA_UUID_MAX, NULL), 0);
}

/* A VMM allocation of len bytes on GPU 0, with or without a POSIX fd handle type. */
static CUdeviceptr vmm_alloc(size_t *len, bool posix, CUmemGenericAllocationHandle *h)
{
    CUmemAllocationProp prop;
    CUmemAccessDesc acc;
    CUdeviceptr va = 0;
    size_t g = 0;

    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = posix ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                                      : CU_MEM_HANDLE_TYPE_NONE;
    cr_assert_eq(cu->cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                 CUDA_SUCCESS);
    *len = (*len + g - 1) / g * g;
    cr_assert_eq(cu->cuMemCreate(h, *len, &prop, 0), CUDA_SUCCESS);
    cr_assert_eq(cu->cuMemAddressReserve(&va, *len, g, 0, 0), CUDA_SUCCESS);
    cr_assert_eq(cu->cuMemMap(va, *len, 0, *h, 0), CUDA_SUCCESS);
    memset(&acc, 0, sizeof(acc));
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    cr_assert_eq(cu->cuMemSetAccess(va, *len, &acc, 1), CUDA_SUCCESS);
    return va;
}

Test(mem_cuda, vmm_fd_export_import_reads_back, .init = need_gpu)
{
    CUmemGenericAllocationHandle h;
    size_t len = 4u << 20;
    CUdeviceptr va = vmm_alloc(&len, true, &h);
    uint8_t *src = malloc(len), *back = malloc(8192);
    rf_mem_cache *mc = rf_mem_cache_new();
    rf_mem_ref *r1 = NULL, *r2 = NULL, *r3 = NULL;
    char u[RF_CUDA_UUID_MAX];
    rf_err err = {0};
    int fd = -1;

    cr_assert_eq(rf_mem_cuda_init(&err), 0, "%s", err.msg);
    uuid0(u);
    for (size_t i = 0; i < len; i++)
        src[i] = (uint8_t)(i * 7 + 3);
    cr_assert_eq(cudaMemcpy((void *)va, src, len, cudaMemcpyHostToDevice), cudaSuccess);
    cr_assert_eq(cu->cuMemExportToShareableHandle(&fd, h,
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                 CUDA_SUCCESS);
    uint8_t le[8];
    for (int i = 0; i < 8; i++)
        le[i] = (uint8_t)((uint64_t)len >> (8 * i));
    rf_mem_desc d = {.kind = RF_MEM_CUDA_VMM_FD, .device = u, .size = 8192, .offset = 12345,
                     .fd = fd, .handle = le, .handle_len = 8};
    cr_assert_eq(rf_mem_import(mc, &d, &r1, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_mem_ref_kind(r1), RF_MEM_CUDA_VMM_FD);
    cr_assert_eq(cudaMemcpy(back, rf_mem_ref_base(r1), 8192, cudaMemcpyDeviceToHost),
                 cudaSuccess);
    cr_assert(memcmp(back, src + 12345, 8192) == 0, "imported VMM memory reads differently");
    /* The same descriptor again: VMM fds cannot tell allocations apart (anonymous inodes),
     * so every region maps its own view. */
    d.offset = 0;
    d.size = 100;
    cr_assert_eq(rf_mem_import(mc, &d, &r2, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_mem_cache_count(mc), 2);
    cr_assert_eq(cudaMemcpy(back, rf_mem_ref_base(r2), 100, cudaMemcpyDeviceToHost),
                 cudaSuccess);
    cr_assert(memcmp(back, src, 100) == 0, "second view reads differently");
    /* A reuse past the allocation is refused. */
    d.offset = len - 10;
    d.size = 20;
    cr_assert_eq(rf_mem_import(mc, &d, &r3, &err), -EINVAL);
    cr_assert(strstr(err.msg, "smaller than the region claimed"), "%s", err.msg);
    rf_mem_release(mc, r1);
    rf_mem_release(mc, r2);
    cr_assert_eq(rf_mem_cache_count(mc), 0);
    /* Past the end of the allocation on a fresh import. */
    d.offset = len;
    d.size = 4096;
    cr_assert_eq(rf_mem_import(mc, &d, &r3, &err), -EINVAL);
    cr_assert(strstr(err.msg, "smaller than the region claimed"), "%s", err.msg);
    /* An allocation size that is a lie: the driver refuses the mapping. */
    d.offset = 0;
    for (int i = 0; i < 8; i++)
        le[i] = (uint8_t)((uint64_t)(2 * len) >> (8 * i));
    cr_assert_lt(rf_mem_import(mc, &d, &r3, &err), 0);
    cr_assert(strstr(err.msg, "is that its real size?"), "%s", err.msg);
    /* No size at all. */
    d.handle_len = 0;
    cr_assert_eq(rf_mem_import(mc, &d, &r3, &err), -EINVAL);
    cr_assert(strstr(err.msg, "without the allocation's size"), "%s", err.msg);
    cr_assert_eq(rf_mem_cache_count(mc), 0);
    rf_mem_cache_free(mc);
    close(fd);
    cu->cuMemUnmap(va, len);
    cu->cuMemAddressFree(va, len);
    cu->cuMemRelease(h);
    free(src);
    free(back);
}

Test(mem_cuda, import_refusals, .init = need_gpu)
{
    rf_mem_cache *mc = rf_mem_cache_new();
    rf_mem_ref *r = NULL;
    uint8_t junk[64];
    char u[RF_CUDA_UUID_MAX];
    rf_err err = {0};
    int mfd = memfd_create("x", 0);

    cr_assert_eq(rf_mem_cuda_init(&err), 0, "%s", err.msg);
    uuid0(u);
    memset(junk, 0x5a, sizeof(junk));
    rf_mem_desc d = {.kind = RF_MEM_CUDA_IPC, .device = u, .size = 16, .handle = junk,
                     .handle_len = 10, .fd = -1};
    cr_assert_eq(rf_mem_import(mc, &d, &r, &err), -EINVAL);
    cr_assert(strstr(err.msg, "handle of 10 bytes"), "%s", err.msg);
    d.handle_len = 64;
    cr_assert_lt(rf_mem_import(mc, &d, &r, &err), 0);
    cr_assert(strstr(err.msg, "cannot open the CUDA IPC handle"), "%s", err.msg);
    d.device = "GPU-00000000-0000-0000-0000-000000000000";
    cr_assert_eq(rf_mem_import(mc, &d, &r, &err), -ENODEV);
    d.kind = RF_MEM_CUDA_VMM_FD;
    d.device = u;
    d.handle_len = 8;
    memset(junk, 0, sizeof(junk));
    junk[2] = 0x20; /* 2 MiB */
    cr_assert_eq(rf_mem_import(mc, &d, &r, &err), -EBADF);
    cr_assert(strstr(err.msg, "without a file descriptor"), "%s", err.msg);
    cr_assert(mfd >= 0);
    cr_assert_eq(ftruncate(mfd, 4096), 0);
    d.fd = mfd;
    cr_assert_lt(rf_mem_import(mc, &d, &r, &err), 0);
    cr_assert(strstr(err.msg, "is no CUDA allocation handle"), "%s", err.msg);
    cr_assert_eq(rf_mem_cache_count(mc), 0);
    rf_mem_cache_free(mc);
    close(mfd);
}

Test(mem_cuda, export_refusals, .init = need_gpu)
{
    CUmemGenericAllocationHandle h;
    size_t len = 2u << 20;
    CUdeviceptr va = vmm_alloc(&len, false, &h);
    void *dev = NULL, *managed = NULL;
    char host[64];
    uint32_t region;

    cr_assert_eq(refit_region_cuda(NULL, host, sizeof(host), &region), -EINVAL);
    cr_assert(strstr(refit_last_error(NULL), "is host memory"), "%s", refit_last_error(NULL));
    cr_assert_eq(cudaMallocManaged(&managed, 4096, cudaMemAttachGlobal), cudaSuccess);
    cr_assert_eq(refit_region_cuda(NULL, managed, 4096, &region), -EINVAL);
    cr_assert(strstr(refit_last_error(NULL), "managed memory"), "%s", refit_last_error(NULL));
    cr_assert_eq(refit_region_cuda(NULL, (void *)va, 4096, &region), -ENOTSUP);
    cr_assert(strstr(refit_last_error(NULL), "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"), "%s",
              refit_last_error(NULL));
    cr_assert_eq(cudaMalloc(&dev, 1 << 20), cudaSuccess);
    cr_assert_eq(refit_region_cuda(NULL, (uint8_t *)dev + 4096, 1 << 20, &region), -EINVAL);
    cr_assert(strstr(refit_last_error(NULL), "runs past the end of its CUDA allocation"), "%s",
              refit_last_error(NULL));
    /* A good pointer gets as far as the connection. */
    cr_assert_eq(refit_region_cuda(NULL, (uint8_t *)dev + 4096, 4096, &region), -EINVAL);
    cr_assert(strstr(refit_last_error(NULL), "no client"), "%s", refit_last_error(NULL));
    cr_assert_eq(refit_region_cuda(NULL, NULL, 4096, &region), -EINVAL);
    cudaFree(dev);
    cudaFree(managed);
    cu->cuMemUnmap(va, len);
    cu->cuMemAddressFree(va, len);
    cu->cuMemRelease(h);
}

#else

Test(mem_cuda, without_cuda_gpu_memory_is_refused)
{
    uint32_t region;

    cr_assert_eq(refit_region_cuda(NULL, (void *)0x1000, 16, &region), -ENOTSUP);
    cr_assert(strstr(refit_last_error(NULL), "built without CUDA"), "%s",
              refit_last_error(NULL));
}

#endif
