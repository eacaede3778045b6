/* sim/sim_cuda.cu - the simulated clients' GPU side: rank allocations (cudaMalloc or a
 * shareable VMM allocation) and the kernels that write and check the weight pattern. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "drv_cuda.h"
#include "sim_cuda.h"
#include "sim_pattern.h"

#define THREADS 256

#define SIM_CUDA(call)                                                                   \
    do {                                                                                 \
        cudaError_t e_ = (call);                                                         \
        if (e_ != cudaSuccess) {                                                         \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                \
                    cudaGetErrorString(e_));                                             \
            return -EIO;                                                                 \
        }                                                                                \
    } while (0)

/* A rank's VMM memory: n allocations of chunk bytes mapped back to back from the first. */
typedef struct vmm_state {
    CUmemGenericAllocationHandle *h;
    size_t n, mapped, chunk, len;
} vmm_state;

/* Address and global index of element i of the piece. */
__device__ __forceinline__ uint8_t *locate(const sim_gpu_piece &p, uint64_t i, uint64_t *gidx)
{
    uint64_t off = 0, g = 0, gs = 1;

    for (int d = p.ndim - 1; d >= 0; d--) {
        uint64_t e = (uint64_t)p.extent[d];
        uint64_t c = i % e;

        i /= e;
        off += c * (uint64_t)p.strides[d];
        g += ((uint64_t)p.start[d] + c) * gs;
        gs *= (uint64_t)p.shape[d];
    }
    *gidx = g;
    return p.addr + off * p.esize;
}

__global__ void fill_kernel(sim_gpu_piece p, uint64_t version)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < p.numel;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t g;
        uint8_t *a = locate(p, i, &g);
        uint64_t v = sim_pattern(p.salt, version, g);

        if (((uintptr_t)a & (p.esize - 1)) == 0) {
            switch (p.esize) {
            case 8: *(uint64_t *)a = v; continue;
            case 4: *(uint32_t *)a = (uint32_t)v; continue;
            case 2: *(uint16_t *)a = (uint16_t)v; continue;
            default: break;
            }
        }
        for (uint32_t b = 0; b < p.esize; b++)
            a[b] = (uint8_t)(v >> (8 * b));
    }
}

__global__ void verify_kernel(sim_gpu_piece p, uint64_t version, unsigned long long *wrong,
                              unsigned long long *first)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < p.numel;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t g, got = 0;
        uint8_t *a = locate(p, i, &g);
        uint64_t want = sim_pattern(p.salt, version, g);
        uint64_t mask = p.esize >= 8 ? ~0ULL : (1ULL << (8 * p.esize)) - 1;

        for (uint32_t b = 0; b < p.esize; b++)
            got |= (uint64_t)a[b] << (8 * b);
        if (got != (want & mask)) {
            atomicAdd(wrong, 1ULL);
            atomicMin(first, (unsigned long long)i);
        }
    }
}

static unsigned grid_of(uint64_t numel)
{
    uint64_t g = (numel + THREADS - 1) / THREADS;

    return g > 4096 ? 4096 : (unsigned)(g ? g : 1);
}

extern "C" int sim_cuda_device_count(void)
{
    int n = 0;

    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

static void vmm_undo(const rf_cu_api *cu, CUdeviceptr va, vmm_state *st)
{
    for (size_t i = 0; i < st->mapped; i++)
        cu->cuMemUnmap(va + i * st->chunk, st->chunk);
    if (va)
        cu->cuMemAddressFree(va, st->len);
    for (size_t i = 0; i < st->n; i++)
        cu->cuMemRelease(st->h[i]);
    free(st->h);
    free(st);
}

/* size bytes as one VMM allocation or, with chunk > 0, as allocations of chunk bytes (rounded
 * up to the granularity) mapped back to back, the way PyTorch's expandable segments map
 * theirs: tensors then span allocations. */
static int vmm_alloc(int gpu, uint64_t size, uint64_t chunk, bool shareable, void **ptr,
                     void **state)
{
    const rf_cu_api *cu = NULL;
    CUmemAllocationProp prop;
    CUmemAccessDesc acc;
    CUdeviceptr va = 0;
    vmm_state *st = NULL;
    size_t gran = 0, n;
    rf_err err = {0};
    int rc = 0;

    if ((rc = rf_cu_load(&cu, &err)) < 0)
        goto out;
    st = (vmm_state *)calloc(1, sizeof(*st));
    if (st == NULL) {
        rc = rf_err_set(&err, -ENOMEM, "out of memory");
        goto out;
    }
    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = gpu;
    /* Without a handle type (as sleep-mode allocators make them) nothing can export it. */
    prop.requestedHandleTypes = shareable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                                          : CU_MEM_HANDLE_TYPE_NONE;
    CU_TRY(&err, cu->cuMemGetAllocationGranularity(&gran, &prop,
                                                   CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    st->len = (size + gran - 1) / gran * gran;
    st->chunk = chunk ? (chunk + gran - 1) / gran * gran : st->len;
    n = (st->len + st->chunk - 1) / st->chunk;
    st->len = n * st->chunk;
    st->h = (CUmemGenericAllocationHandle *)calloc(n, sizeof(*st->h));
    if (st->h == NULL) {
        rc = rf_err_set(&err, -ENOMEM, "out of memory");
        goto out;
    }
    CU_TRY(&err, cu->cuMemAddressReserve(&va, st->len, gran, 0, 0));
    for (size_t i = 0; i < n; i++) {
        CU_TRY(&err, cu->cuMemCreate(&st->h[i], st->chunk, &prop, 0));
        st->n++;
        CU_TRY(&err, cu->cuMemMap(va + i * st->chunk, st->chunk, 0, st->h[i], 0));
        st->mapped++;
    }
    memset(&acc, 0, sizeof(acc));
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_TRY(&err, cu->cuMemSetAccess(va, st->len, &acc, 1));
    *ptr = (void *)(uintptr_t)va;
    *state = st;
    return 0;
out:
    if (st != NULL)
        vmm_undo(cu, va, st);
    fprintf(stderr, "GPU %d: cannot make a VMM allocation of %llu bytes%s: %s\n", gpu,
            (unsigned long long)size, chunk ? " in chunks" : "", err.msg);
    return rc;
}

extern "C" int sim_cuda_alloc(int gpu, uint64_t size, int vmm, uint64_t vmm_chunk, void **ptr,
                              void **state)
{
    *ptr = NULL;
    *state = NULL;
    SIM_CUDA(cudaSetDevice(gpu));
    if (vmm)
        return vmm_alloc(gpu, size ? size : 1, vmm_chunk, vmm != SIM_VMM_PRIVATE, ptr, state);
    SIM_CUDA(cudaMalloc(ptr, size ? size : 1));
    return 0;
}

extern "C" void sim_cuda_free(int gpu, void *ptr, void *state)
{
    const rf_cu_api *cu = NULL;
    vmm_state *st = (vmm_state *)state;

    if (ptr == NULL)
        return;
    cudaSetDevice(gpu);
    cudaDeviceSynchronize();
    if (st == NULL) {
        cudaFree(ptr);
        return;
    }
    if (rf_cu_load(&cu, NULL) == 0) {
        vmm_undo(cu, (CUdeviceptr)(uintptr_t)ptr, st);
        return;
    }
    free(st->h);
    free(st);
}

extern "C" int sim_cuda_memset(int gpu, void *ptr, int byte, uint64_t size)
{
    SIM_CUDA(cudaSetDevice(gpu));
    SIM_CUDA(cudaMemset(ptr, byte, size));
    SIM_CUDA(cudaDeviceSynchronize());
    return 0;
}

extern "C" int sim_cuda_read(int gpu, void *dst, const void *src, uint64_t size)
{
    SIM_CUDA(cudaSetDevice(gpu));
    SIM_CUDA(cudaMemcpy(dst, src, size, cudaMemcpyDeviceToHost));
    return 0;
}

extern "C" int sim_cuda_write(int gpu, void *dst, const void *src, uint64_t size)
{
    SIM_CUDA(cudaSetDevice(gpu));
    SIM_CUDA(cudaMemcpy(dst, src, size, cudaMemcpyHostToDevice));
    return 0;
}

extern "C" int sim_cuda_flip(int gpu, uint8_t *p)
{
    uint8_t b;

    SIM_CUDA(cudaSetDevice(gpu));
    SIM_CUDA(cudaMemcpy(&b, p, 1, cudaMemcpyDeviceToHost));
    b ^= 1;
    SIM_CUDA(cudaMemcpy(p, &b, 1, cudaMemcpyHostToDevice));
    return 0;
}

extern "C" int sim_cuda_fill(int gpu, const sim_gpu_piece *p, uint32_t n, uint64_t version)
{
    SIM_CUDA(cudaSetDevice(gpu));
    for (uint32_t k = 0; k < n; k++)
        if (p[k].numel)
            fill_kernel<<<grid_of(p[k].numel), THREADS>>>(p[k], version);
    SIM_CUDA(cudaGetLastError());
    SIM_CUDA(cudaDeviceSynchronize());
    return 0;
}

extern "C" uint64_t sim_cuda_verify(int gpu, const sim_gpu_piece *p, uint32_t n,
                                    uint64_t version, sim_gpu_bad *bad)
{
    unsigned long long *dev = NULL, host[2];
    uint64_t total = 0;
    bool found = false;

    if (cudaSetDevice(gpu) != cudaSuccess || cudaMalloc((void **)&dev, 2 * sizeof(*dev)) !=
        cudaSuccess)
        return UINT64_MAX;
    for (uint32_t k = 0; k < n; k++) {
        host[0] = 0;
        host[1] = ~0ULL;
        if (p[k].numel == 0)
            continue;
        if (cudaMemcpy(dev, host, sizeof(host), cudaMemcpyHostToDevice) != cudaSuccess)
            goto fail;
        verify_kernel<<<grid_of(p[k].numel), THREADS>>>(p[k], version, &dev[0], &dev[1]);
        if (cudaMemcpy(host, dev, sizeof(host), cudaMemcpyDeviceToHost) != cudaSuccess)
            goto fail;
        if (host[0] && !found) {
            /* Recompute where the first wrong element lies, and read it. */
            const sim_gpu_piece *q = &p[k];
            uint64_t i = host[1], off = 0, g = 0, gs = 1, got = 0;

            for (int d = q->ndim - 1; d >= 0; d--) {
                uint64_t c = i % (uint64_t)q->extent[d];

                i /= (uint64_t)q->extent[d];
                off += c * (uint64_t)q->strides[d];
                g += ((uint64_t)q->start[d] + c) * gs;
                gs *= (uint64_t)q->shape[d];
            }
            if (cudaMemcpy(&got, q->addr + off * q->esize, q->esize, cudaMemcpyDeviceToHost) !=
                cudaSuccess)
                goto fail;
            bad->gidx = g;
            bad->got = got;
            bad->want = sim_pattern(q->salt, version, g);
            if (q->esize < 8)
                bad->want &= (1ULL << (8 * q->esize)) - 1;
            bad->piece = k;
            found = true;
        }
        total += host[0];
    }
    cudaFree(dev);
    return total;
fail:
    fprintf(stderr, "GPU %d: verification failed: %s\n", gpu,
            cudaGetErrorString(cudaGetLastError()));
    cudaFree(dev);
    return UINT64_MAX;
}
