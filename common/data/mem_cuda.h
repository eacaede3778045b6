/* common/data/mem_cuda.h - the daemon side of GPU memory: importing CUDA IPC handles and VMM file
 * descriptors that clients register (rf_mem_ops for RF_MEM_CUDA_IPC and RF_MEM_CUDA_VMM_FD). */
#ifndef RF_MEM_CUDA_H
#define RF_MEM_CUDA_H

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Installs the CUDA implementations into the memory table (common/data/mem.h). -ENODEV with a
 * message when there is no CUDA driver or device: the daemon then keeps serving host memory
 * and GPU regions are refused as unsupported. Imports happen in the primary context of the
 * GPU the region's device string (its UUID) names. */
int rf_mem_cuda_init(rf_err *err);

/* The ordinal, in this process's numbering, of the GPU with this UUID ("GPU-8f6c..." as
 * nvidia-smi prints it). -ENODEV when no visible GPU has it, -EINVAL for "host" or a string
 * that is no GPU UUID. */
int rf_cuda_device_of_uuid(const char *uuid, int *ordinal, rf_err *err);

#ifdef __cplusplus
}
#endif

#endif
