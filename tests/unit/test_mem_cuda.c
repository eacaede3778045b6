/* tests/unit/test_mem_cuda.c - CUDA memory import (common/data/mem_cuda) and librefit's export
 * checks (client/lib/refit_cuda.c): UUIDs, VMM fds exported and imported back, a range over
 * several VMM allocations imported in a second process, and every refusal. IPC handles open only in another process: tests/gpu/01-mem-copy.sh
 * checks that path with the real binaries. GPU tests skip without a CUDA device. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
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

/* Fills the allocation at va with a pattern (kept in src) and exports it: its fd, and in le
 * its size as librefit sends it. */
static int vmm_fill_export(CUdeviceptr va, CUmemGenericAllocationHandle h, size_t len,
                           uint8_t *src, unsigned mul, uint8_t le[8])
{
    int fd = -1;

    for (size_t i = 0; i < len; i++)
        src[i] = (uint8_t)(i * mul + 3);
    cr_assert_eq(cudaMemcpy((void *)va, src, len, cudaMemcpyHostToDevice), cudaSuccess);
    cr_assert_eq(cu->cuMemExportToShareableHandle(&fd, h,
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                 CUDA_SUCCESS);
    for (int i = 0; i < 8; i++)
        le[i] = (uint8_t)((uint64_t)len >> (8 * i));
    return fd;
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
    uint8_t le[8];
    fd = vmm_fill_export(va, h, len, src, 7, le);
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

/* Regions of one VMM allocation that their client named (owner, vmm_base) share one mapping:
 * a trainer's thousands of tensors in one pool would otherwise reserve the pool's size of
 * address space each. Another owner, another base or an unnamed region maps its own. */
Test(mem_cuda, vmm_named_allocation_mapped_once, .init = need_gpu)
{
    CUmemGenericAllocationHandle h;
    size_t len = 4u << 20;
    CUdeviceptr va = vmm_alloc(&len, true, &h);
    uint8_t *src = malloc(len), *back = malloc(4096);
    rf_mem_cache *mc = rf_mem_cache_new();
    rf_mem_ref *r[6] = {0};
    uint64_t me = rf_mem_owner_new(), other = rf_mem_owner_new();
    char u[RF_CUDA_UUID_MAX];
    rf_err err = {0};
    uint8_t le[8];
    int fd = -1;

    cr_assert_neq(me, 0);
    cr_assert_neq(me, other);
    cr_assert_eq(rf_mem_cuda_init(&err), 0, "%s", err.msg);
    uuid0(u);
    fd = vmm_fill_export(va, h, len, src, 13, le);
    rf_mem_desc d = {.kind = RF_MEM_CUDA_VMM_FD, .device = u, .size = 4096, .offset = 0,
                     .fd = fd, .handle = le, .handle_len = 8, .vmm_base = (uint64_t)va,
                     .owner = me};
    for (int k = 0; k < 3; k++) {
        d.offset = (uint64_t)k * 65536 + 7;
        cr_assert_eq(rf_mem_import(mc, &d, &r[k], &err), 0, "%s", err.msg);
        cr_assert_eq(cudaMemcpy(back, rf_mem_ref_base(r[k]), 4096, cudaMemcpyDeviceToHost),
                     cudaSuccess);
        cr_assert(memcmp(back, src + d.offset, 4096) == 0, "region %d reads differently", k);
    }
    cr_assert_eq(rf_mem_cache_count(mc), 1, "three regions of one named allocation: %zu maps",
                 rf_mem_cache_count(mc));
    /* The shared mapping still checks each region's range. */
    d.offset = len - 100;
    cr_assert_eq(rf_mem_import(mc, &d, &r[5], &err), -EINVAL);
    cr_assert(strstr(err.msg, "smaller than the region claimed"), "%s", err.msg);
    /* Another client naming the same address, or the same client without a name: their own. */
    d.offset = 0;
    d.owner = other;
    cr_assert_eq(rf_mem_import(mc, &d, &r[3], &err), 0, "%s", err.msg);
    d.owner = me;
    d.vmm_base = 0;
    cr_assert_eq(rf_mem_import(mc, &d, &r[4], &err), 0, "%s", err.msg);
    cr_assert_eq(rf_mem_cache_count(mc), 3);
    /* The mapping lives until its last region goes. */
    rf_mem_release(mc, r[0]);
    rf_mem_release(mc, r[1]);
    cr_assert_eq(rf_mem_cache_count(mc), 3);
    cr_assert_eq(cudaMemcpy(back, rf_mem_ref_base(r[2]), 4096, cudaMemcpyDeviceToHost),
                 cudaSuccess);
    cr_assert(memcmp(back, src + 2 * 65536 + 7, 4096) == 0);
    rf_mem_release(mc, r[2]);
    rf_mem_release(mc, r[3]);
    rf_mem_release(mc, r[4]);
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
    cr_assert(strstr(err.msg, "registered without the file descriptor"), "%s", err.msg);
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

/* n VMM allocations of len bytes each on GPU 0, mapped back to back in one reserved range (as
 * PyTorch's expandable segments map their chunks); posix[i] picks each one's handle type. */
static CUdeviceptr vmm_span(int n, size_t *len, const bool *posix,
                            CUmemGenericAllocationHandle *h)
{
    CUmemAllocationProp prop;
    CUmemAccessDesc acc;
    CUdeviceptr va = 0;
    size_t g = 0;

    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    cr_assert_eq(cu->cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                 CUDA_SUCCESS);
    *len = (*len + g - 1) / g * g;
    /* One allocation more of address space, left unmapped: a range running into it fails. */
    cr_assert_eq(cu->cuMemAddressReserve(&va, (size_t)(n + 1) * *len, g, 0, 0), CUDA_SUCCESS);
    for (int i = 0; i < n; i++) {
        prop.requestedHandleTypes = posix[i] ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                                             : CU_MEM_HANDLE_TYPE_NONE;
        cr_assert_eq(cu->cuMemCreate(&h[i], *len, &prop, 0), CUDA_SUCCESS);
        cr_assert_eq(cu->cuMemMap(va + (size_t)i * *len, *len, 0, h[i], 0), CUDA_SUCCESS);
    }
    memset(&acc, 0, sizeof(acc));
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    cr_assert_eq(cu->cuMemSetAccess(va, (size_t)n * *len, &acc, 1), CUDA_SUCCESS);
    return va;
}

static void vmm_span_free(int n, size_t len, CUdeviceptr va, CUmemGenericAllocationHandle *h)
{
    for (int i = 0; i < n; i++) {
        cu->cuMemUnmap(va + (size_t)i * len, len);
        cu->cuMemRelease(h[i]);
    }
    cu->cuMemAddressFree(va, (size_t)(n + 1) * len);
}

/* What the importing process is told: the chunks' sizes and the region in them. */
typedef struct span_msg {
    uint64_t chunk, offset, size;
    char uuid[RF_CUDA_UUID_MAX];
} span_msg;

#define SPAN_CHUNKS 3

static uint8_t pat_a(uint64_t i) { return (uint8_t)(i * 13 + 5); }
static uint8_t pat_b(uint64_t i) { return (uint8_t)(i * 29 + 11); }

/* The second process (a daemon's part): imports the region from its three chunk fds, checks
 * it reads what the first wrote, then writes its own pattern into it. 0 or a message in msg. */
static int span_importer(int sock, char *msg, size_t len)
{
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int) * SPAN_CHUNKS)];
    } ctl;
    span_msg m;
    struct iovec iov = {&m, sizeof(m)};
    struct msghdr mh = {0};
    struct cmsghdr *cm;
    rf_mem_chunk ch[SPAN_CHUNKS];
    rf_mem_cache *mc = NULL;
    rf_mem_ref *r = NULL;
    uint8_t *buf = NULL;
    rf_err err = {0};
    int rc = -1;

    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.space;
    mh.msg_controllen = sizeof(ctl.space);
    if (recvmsg(sock, &mh, 0) != (ssize_t)sizeof(m) || (cm = CMSG_FIRSTHDR(&mh)) == NULL ||
        cm->cmsg_len != CMSG_LEN(sizeof(int) * SPAN_CHUNKS)) {
        snprintf(msg, len, "the importer did not get the layout and 3 fds");
        return -1;
    }
    for (int i = 0; i < SPAN_CHUNKS; i++) {
        memcpy(&ch[i].fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
        ch[i].size = m.chunk;
    }
    rf_mem_desc d = {.kind = RF_MEM_CUDA_VMM_FD, .device = m.uuid, .size = m.size,
                     .offset = m.offset, .fd = -1, .chunks = ch, .nchunks = SPAN_CHUNKS};
    buf = malloc(m.size);
    mc = rf_mem_cache_new();
    if (buf == NULL || mc == NULL || rf_mem_cuda_init(&err) < 0 ||
        cudaSetDevice(0) != cudaSuccess || rf_mem_import(mc, &d, &r, &err) < 0) {
        snprintf(msg, len, "import in the second process: %s", err.msg);
        goto out;
    }
    /* The fds are the daemon's to close once mapped: the mapping stays. */
    for (int i = 0; i < SPAN_CHUNKS; i++)
        close(ch[i].fd);
    if (cudaMemcpy(buf, rf_mem_ref_base(r), m.size, cudaMemcpyDeviceToHost) != cudaSuccess) {
        snprintf(msg, len, "reading the imported range failed");
        goto out;
    }
    for (uint64_t i = 0; i < m.size; i++)
        if (buf[i] != pat_a(m.offset + i)) {
            snprintf(msg, len, "the imported range reads %u at byte %llu (chunk %llu), "
                     "%u written", buf[i], (unsigned long long)i,
                     (unsigned long long)((m.offset + i) / m.chunk), pat_a(m.offset + i));
            goto out;
        }
    for (uint64_t i = 0; i < m.size; i++)
        buf[i] = pat_b(m.offset + i);
    if (cudaMemcpy(rf_mem_ref_base(r), buf, m.size, cudaMemcpyHostToDevice) != cudaSuccess) {
        snprintf(msg, len, "writing the imported range failed");
        goto out;
    }
    rc = 0;
out:
    if (r != NULL)
        rf_mem_release(mc, r);
    if (mc != NULL && rf_mem_cache_count(mc) != 0 && rc == 0) {
        snprintf(msg, len, "the mapping stayed after its last region");
        rc = -1;
    }
    rf_mem_cache_free(mc);
    free(buf);
    return rc;
}

/* Runs f in a process forked before this one touches CUDA (a forked child cannot use its
 * parent's driver state); its answer comes back on sock's other end. */
static pid_t spawn(int (*f)(int, char *, size_t), int sock, int other)
{
    pid_t pid = fork();

    cr_assert_geq(pid, 0);
    if (pid == 0) {
        char msg[512] = "";
        int rc;

        close(other);
        rc = f(sock, msg, sizeof(msg));
        if (write(sock, msg, strlen(msg) + 1) < 0)
            _exit(3);
        _exit(rc == 0 ? 0 : 1);
    }
    return pid;
}

static int probe_gpu(int sock, char *msg, size_t len)
{
    (void)sock;
    (void)len;
    msg[0] = '\0';
    return rf_cuda_available() ? 0 : 1;
}

/* Whether a GPU is there, asked in a child so this process has not touched CUDA yet. */
static bool gpu_in_child(void)
{
    int sv[2], st = 0;
    char msg[8];
    pid_t pid;

    cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    pid = spawn(probe_gpu, sv[1], sv[0]);
    close(sv[1]);
    cr_assert_gt(read(sv[0], msg, sizeof(msg)), 0);
    close(sv[0]);
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

/* A range over three VMM allocations mapped back to back (PyTorch's expandable segments): a
 * second process imports it from the three fds as one contiguous region, reads across both
 * chunk boundaries what the first wrote, and its writes land in the first's memory. */
Test(mem_cuda, vmm_range_over_three_allocations_imported_in_a_second_process)
{
    const bool posix[SPAN_CHUNKS] = {true, true, true};
    CUmemGenericAllocationHandle h[SPAN_CHUNKS];
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int) * SPAN_CHUNKS)];
    } ctl;
    int fds[SPAN_CHUNKS], sv[2], st = 0;
    size_t len = 2u << 20;
    span_msg m = {0};
    struct iovec iov = {&m, sizeof(m)};
    struct msghdr mh = {0};
    struct cmsghdr *cm;
    char answer[512];
    uint8_t *host;
    CUdeviceptr va;
    pid_t pid;

    if (!gpu_in_child())
        cr_skip_test("no CUDA device");
    cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    pid = spawn(span_importer, sv[1], sv[0]);
    close(sv[1]);
    need_gpu();
    va = vmm_span(SPAN_CHUNKS, &len, posix, h);
    host = malloc(SPAN_CHUNKS * len);
    for (uint64_t i = 0; i < SPAN_CHUNKS * len; i++)
        host[i] = pat_a(i);
    cr_assert_eq(cudaMemcpy((void *)va, host, SPAN_CHUNKS * len, cudaMemcpyHostToDevice),
                 cudaSuccess);
    for (int i = 0; i < SPAN_CHUNKS; i++)
        cr_assert_eq(cu->cuMemExportToShareableHandle(&fds[i], h[i],
                                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                                      0), CUDA_SUCCESS);
    /* From the middle of the first chunk to the middle of the third. */
    m.chunk = len;
    m.offset = len / 2 + 123;
    m.size = 2 * len - 246;
    uuid0(m.uuid);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.space;
    mh.msg_controllen = sizeof(ctl.space);
    cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(fds));
    memcpy(CMSG_DATA(cm), fds, sizeof(fds));
    cr_assert_eq(sendmsg(sv[0], &mh, 0), (ssize_t)sizeof(m));
    cr_assert_gt(read(sv[0], answer, sizeof(answer)), 0);
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "second process: %s", answer);
    cr_assert_eq(cudaMemcpy(host, (void *)va, SPAN_CHUNKS * len, cudaMemcpyDeviceToHost),
                 cudaSuccess);
    for (uint64_t i = 0; i < SPAN_CHUNKS * len; i++) {
        bool in = i >= m.offset && i < m.offset + m.size;
        uint8_t want = in ? pat_b(i) : pat_a(i);

        cr_assert_eq(host[i], want, "byte %llu (chunk %llu) is %u, %u expected",
                     (unsigned long long)i, (unsigned long long)(i / len), host[i], want);
    }
    for (int i = 0; i < SPAN_CHUNKS; i++)
        close(fds[i]);
    close(sv[0]);
    free(host);
    vmm_span_free(SPAN_CHUNKS, len, va, h);
}

/* librefit walks a range over several allocations to its end (as far as the connection here)
 * and refuses one with an allocation it cannot share, or running into unmapped space. */
Test(mem_cuda, export_walks_allocations_mapped_back_to_back, .init = need_gpu)
{
    const bool posix[SPAN_CHUNKS] = {true, true, true}, middle[SPAN_CHUNKS] = {true, false, true};
    CUmemGenericAllocationHandle h[SPAN_CHUNKS];
    size_t len = 2u << 20;
    CUdeviceptr va = vmm_span(SPAN_CHUNKS, &len, posix, h);
    uint32_t region;

    cr_assert_eq(refit_region_cuda(NULL, (void *)(va + 100), 3 * len - 200, &region), -EINVAL);
    cr_assert(strstr(refit_last_error(NULL), "no client"), "%s", refit_last_error(NULL));
    /* Into the unmapped address space after the third allocation. */
    cr_assert_lt(refit_region_cuda(NULL, (void *)(va + 100), 3 * len, &region), 0);
    cr_assert(strstr(refit_last_error(NULL), "GPU range"), "%s", refit_last_error(NULL));
    cr_assert_null(strstr(refit_last_error(NULL), "no client"), "%s", refit_last_error(NULL));
    vmm_span_free(SPAN_CHUNKS, len, va, h);
    va = vmm_span(SPAN_CHUNKS, &len, middle, h);
    cr_assert_eq(refit_region_cuda(NULL, (void *)(va + 100), 2 * len, &region), -ENOTSUP);
    cr_assert(strstr(refit_last_error(NULL), "runs over CUDA VMM allocation 1"), "%s",
              refit_last_error(NULL));
    cr_assert(strstr(refit_last_error(NULL), "CU_MEM_HANDLE_TYPE_FABRIC"), "%s",
              refit_last_error(NULL));
    /* Within the first allocation the range stays a region of one allocation. */
    cr_assert_eq(refit_region_cuda(NULL, (void *)(va + 100), len - 100, &region), -EINVAL);
    cr_assert(strstr(refit_last_error(NULL), "no client"), "%s", refit_last_error(NULL));
    vmm_span_free(SPAN_CHUNKS, len, va, h);
}

/* Chunks are for cuda_vmm_fd regions only, at most RF_MEM_MAX_CHUNKS; refused before
 * anything is imported. */
Test(mem_cuda, chunk_lists_checked_before_import, .init = need_gpu)
{
    rf_mem_cache *mc = rf_mem_cache_new();
    rf_mem_chunk ch[2] = {{2u << 20, -1}, {2u << 20, -1}};
    rf_mem_ref *r = NULL;
    char u[RF_CUDA_UUID_MAX];
    rf_err err = {0};

    cr_assert_eq(rf_mem_cuda_init(&err), 0, "%s", err.msg);
    uuid0(u);
    rf_mem_desc d = {.kind = RF_MEM_CUDA_IPC, .device = u, .size = 16, .fd = -1,
                     .chunks = ch, .nchunks = 2};
    cr_assert_eq(rf_mem_import(mc, &d, &r, &err), -EINVAL);
    cr_assert(strstr(err.msg, "only cuda_vmm_fd regions"), "%s", err.msg);
    d.kind = RF_MEM_CUDA_VMM_FD;
    cr_assert_eq(rf_mem_import(mc, &d, &r, &err), -EBADF);
    cr_assert(strstr(err.msg, "allocation 0 of 2"), "%s", err.msg);
    d.nchunks = RF_MEM_MAX_CHUNKS + 1;
    cr_assert_eq(rf_mem_import(mc, &d, &r, &err), -E2BIG);
    cr_assert_eq(rf_mem_cache_count(mc), 0);
    rf_mem_cache_free(mc);
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
