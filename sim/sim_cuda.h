/* sim/sim_cuda.h - the simulated clients' GPU memory: one allocation per rank (cudaMalloc, or
 * a VMM allocation shareable as a POSIX fd), and the weight pattern written and checked by
 * kernels. */
#ifndef RF_SIM_CUDA_H
#define RF_SIM_CUDA_H

#include <stdint.h>

#include "layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One piece as the kernels see it: element i of the box (row-major over extent) lies at
 * addr + sum(i[d] * strides[d]) * esize and has global index sum((start[d] + i[d]) * gstride[d]). */
typedef struct sim_gpu_piece {
    uint8_t *addr;     /* device address of the piece's origin */
    uint64_t salt;
    uint64_t numel;
    uint32_t esize;
    int ndim;
    int64_t start[RF_MAX_DIMS];
    int64_t extent[RF_MAX_DIMS];
    int64_t strides[RF_MAX_DIMS];
    int64_t shape[RF_MAX_DIMS];
} sim_gpu_piece;

/* The first wrong element a verification found. */
typedef struct sim_gpu_bad {
    uint64_t gidx, got, want;
    uint32_t piece;
} sim_gpu_bad;

int sim_cuda_device_count(void);
/* size bytes on GPU gpu; vmm: cuMemCreate with a POSIX fd handle type, else cudaMalloc;
 * vmm_chunk > 0: as VMM allocations of that many bytes (rounded up to the granularity) mapped
 * back to back. Prints the reason and returns a negative errno on failure. */
#define SIM_VMM_PRIVATE 2 /* vmm: VMM allocations without a shareable handle type */
int sim_cuda_alloc(int gpu, uint64_t size, int vmm, uint64_t vmm_chunk, void **ptr,
                   void **state);
void sim_cuda_free(int gpu, void *ptr, void *state);
int sim_cuda_memset(int gpu, void *ptr, int byte, uint64_t size);
/* size bytes of GPU memory copied to the host, or from it; bit 0 of the byte at p flipped. */
int sim_cuda_read(int gpu, void *dst, const void *src, uint64_t size);
int sim_cuda_write(int gpu, void *dst, const void *src, uint64_t size);
int sim_cuda_flip(int gpu, uint8_t *p);
int sim_cuda_fill(int gpu, const sim_gpu_piece *p, uint32_t n, uint64_t version);
/* Number of wrong elements over the n pieces (UINT64_MAX on a CUDA failure); *bad the first. */
uint64_t sim_cuda_verify(int gpu, const sim_gpu_piece *p, uint32_t n, uint64_t version,
                         sim_gpu_bad *bad);

#ifdef __cplusplus
}
#endif

#endif
