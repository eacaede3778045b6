/* client/refit.h - librefit: the blocking C API trainers, engines and refitctl use to talk to
 * their local refit daemon over its Unix socket. Every call returns 0 or a negative errno;
 * refit_last_error says what was wrong. One client is used by one thread at a time. */
#ifndef REFIT_H
#define REFIT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* librefit is built with hidden visibility: only what is marked REFIT_API is exported, so a
 * program or binding sees the API below and none of the library's internals. */
#if defined(__GNUC__) && __GNUC__ >= 4
#define REFIT_API __attribute__((visibility("default")))
#else
#define REFIT_API
#endif

#define REFIT_SOCKET_PUBLISHER "/run/refit/publisherd.sock"
#define REFIT_SOCKET_RECEIVER "/run/refit/receiverd.sock"

/* Client kinds */
enum { REFIT_TRAINER = 1, REFIT_ENGINE = 2, REFIT_CTL = 3 };

/* Events pushed to engines */
enum { REFIT_EVENT_INSTALLING = 1, REFIT_EVENT_COMMITTED = 2, REFIT_EVENT_ABORTED = 3 };

/* dtypes (the values of rf_dtype) */
enum {
    REFIT_BF16 = 0, REFIT_FP16, REFIT_FP32, REFIT_FP64, REFIT_FP8_E4M3, REFIT_FP8_E5M2,
    REFIT_INT8, REFIT_UINT8, REFIT_INT16, REFIT_INT32, REFIT_INT64, REFIT_BOOL
};

typedef struct refit_client refit_client;

/* Connects and says Hello. socket_path NULL: $REFIT_SOCKET, else the publisher's socket for
 * trainers and refitctl, the receiver's for engines. name may be NULL. On failure *out is NULL
 * and refit_last_error(NULL) holds the message. */
REFIT_API int refit_connect(const char *socket_path, const char *name, int rank, int kind,
                            refit_client **out);
/* The message of this client's last failed call; with NULL, of the last failed call of this
 * thread (refit_connect). Never NULL. */
REFIT_API const char *refit_last_error(const refit_client *c);

/* Registers host memory: size bytes of the memfd fd from its start (librefit seals it against
 * shrinking; fd stays the caller's). *region is the id pieces name. */
REFIT_API int refit_region_memfd(refit_client *c, int fd, uint64_t size, uint32_t *region);
/* A region that is part of a larger memfd: [offset, offset + size) of it. One memfd may hold
 * many regions (a trainer's one allocation holding every parameter); the daemon maps it once. */
REFIT_API int refit_region_memfd_at(refit_client *c, int fd, uint64_t offset, uint64_t size,
                                    uint32_t *region);
/* Allocates size bytes of shared host memory (memfd + mmap), registers it and returns the
 * mapping; it stays mapped until refit_close. */
REFIT_API int refit_alloc_host(refit_client *c, uint64_t size, void **ptr, uint32_t *region);
/* Registers GPU memory: size bytes at devptr, a pointer into a CUDA allocation of this
 * process (cudaMalloc, a caching allocator's block, or a VMM allocation made shareable as a
 * POSIX file descriptor). librefit finds the allocation, exports it (a CUDA IPC handle of its
 * base, or the VMM handle's fd) and names the GPU by UUID; the allocation must stay alive
 * while registered. Host or managed memory, a range past its allocation, or a VMM allocation
 * without a POSIX fd handle type fail with a message saying what to change. libcuda is opened
 * at run time: without a GPU only this call fails. */
REFIT_API int refit_region_cuda(refit_client *c, const void *devptr, uint64_t size,
                                uint32_t *region);
/* Registers memory the daemon cannot map (plain malloc'd host memory, a CUDA VMM allocation
 * made without a shareable handle type, as sleep-mode allocators make them): librefit then
 * installs into it itself, from a thread of its own that refit_seal starts, copying straight
 * from the trainers' memory on this host (only same-host copies can reach such memory; a plan
 * that would send it bytes over the network is refused, naming the engine). The memory must
 * stay valid until refit_close. Engines only. refit_region_cuda falls back to this by itself
 * for a VMM allocation without a POSIX fd handle type. */
REFIT_API int refit_region_inproc(refit_client *c, void *ptr, uint64_t size, uint32_t *region);
/* How region is written: REFIT_INSTALL_DAEMON (the daemon mapped it) or REFIT_INSTALL_INPROC
 * (this process installs); *why (may be NULL) says why, valid until refit_close. */
enum { REFIT_INSTALL_DAEMON = 0, REFIT_INSTALL_INPROC = 1 };
REFIT_API int refit_region_mode(refit_client *c, uint32_t region, const char **why);
/* Registers one piece: the box (start, extent) of tensor (dtype, global shape of ndim dims)
 * that lies at offset bytes in region, with element strides per dim. */
REFIT_API int refit_add_piece(refit_client *c, const char *tensor, int dtype, int ndim,
                              const int64_t *shape, uint32_t region, uint64_t offset,
                              const int64_t *start, const int64_t *extent, const int64_t *strides);
/* Engines serving FP8 (issue 15): registers a piece that holds the box of tensor (dtype: the
 * tensor's as trainers register it, bf16, fp16 or fp32) as float8_e4m3fn, quantized during each
 * refit in format: "block" (128x128 blocks, fp32 scales: DeepSeek-V3's and Qwen3-FP8's
 * weight_scale_inv), "block:<rows>x<cols>", "channel" (one fp32 scale per row), "tensor" (one
 * for the whole tensor) or "mxfp8" (1x32 blocks, E8M0 scale bytes); the arithmetic is
 * common/data/quant.h's. The FP8 elements lie at offset bytes in region, strides elements apart
 * (NULL: row-major over the box; the last dim's stride must be 1); the scales of the box's
 * blocks lie at scale_offset bytes in scale_region (a region of this client on the same GPU),
 * scale_strides elements apart per dim of the box's block grid (NULL: row-major over it). The
 * tensor needs at least 2 dims: its last two are the matrix, leading dims (experts) each a
 * matrix of their own. The box must lie on the format's grid (block edges, whole rows for
 * channel, the whole tensor for tensor); the message names an edge that does not.
 * Trainers that hold a weight in FP8 register it the same way: its bytes and scales are then
 * copied as they are into engine FP8 pieces of the same format (host path: host memory, tcp or
 * local copies); an engine piece in another format or dtype is refused when the plan is
 * built. */
REFIT_API int refit_add_piece_fp8(refit_client *c, const char *tensor, int dtype, int ndim,
                                  const int64_t *shape, uint32_t region, uint64_t offset,
                                  const int64_t *start, const int64_t *extent,
                                  const int64_t *strides, const char *format,
                                  uint32_t scale_region, uint64_t scale_offset,
                                  const int64_t *scale_strides);
/* The shape of the scales of an FP8 piece of box extent `extent` starting at `start` of a
 * tensor of `shape` in format (the block grid of the box: leading dims as extent's), into
 * scale_shape (ndim entries); their element size is 4 (fp32), 1 for mxfp8. 0, or -EINVAL
 * for an unknown format. */
REFIT_API int refit_fp8_scale_shape(const char *format, int ndim, const int64_t *shape,
                                    const int64_t *start, const int64_t *extent,
                                    int64_t *scale_shape, size_t *scale_esize);
/* Ends registration: the daemon checks the pieces as a whole. */
REFIT_API int refit_seal(refit_client *c);

/* Trainers: the weights of version are final. */
REFIT_API int refit_publish(refit_client *c, uint64_t version);
/* Trainers: blocks until version is committed everywhere (the weights may be overwritten).
 * timeout_ms < 0 waits forever; -ETIMEDOUT after it; -ECANCELED when the refit aborted;
 * -EAGAIN at once when the cluster cannot refit it now, with the coordinator's reason as the
 * message (a plan that fails: trainers and engines disagree on a tensor's dtype or shape, an
 * engine piece no trainer holds; a daemon refused for its configuration). -EAGAIN means "not
 * now, because ...", not final: the publish stands, and the same wait after the cause is gone
 * (the engine registered again correctly) waits as usual. */
REFIT_API int refit_wait_released(refit_client *c, uint64_t version, int timeout_ms);
/* Engines: blocks until version (or a later one) is committed; -ECANCELED on its abort;
 * -EAGAIN at once, with the cluster's reason, while the cluster cannot refit it (not final:
 * see refit_wait_released). */
REFIT_API int refit_wait_version(refit_client *c, uint64_t version, int timeout_ms);
/* The same, and *reached (may be NULL) is the version the daemon has committed, which may be
 * later than version (a refit triggered by an operator, an engine that fell behind): the
 * engine's memory holds *reached, not version. */
REFIT_API int refit_wait_version_reached(refit_client *c, uint64_t version, int timeout_ms,
                                         uint64_t *reached);
/* Engines: the next pushed event (REFIT_EVENT_*) and its version; -ETIMEDOUT when none came. */
REFIT_API int refit_next_event(refit_client *c, int timeout_ms, int *event, uint64_t *version);

/* refitctl: the daemon's status document (malloc'd; the caller frees it). */
REFIT_API int refit_status_json(refit_client *c, char **json);
/* refitctl: trigger a refit to version. */
REFIT_API int refit_trigger(refit_client *c, uint64_t version);
/* refitctl: wait until version is committed (-ECANCELED when it aborted; -EAGAIN with the
 * cluster's reason while it cannot refit it, as refit_wait_released). */
REFIT_API int refit_wait(refit_client *c, uint64_t version, int timeout_ms);

/* Engines: make installs wait for this client. Call once, before refit_seal; then, after
 * reading committed version N (a synchronous refit, a verification), call
 * refit_consumed(c, N): the next version is installed only once every gated engine of the
 * cluster has consumed the last one. Ungated engines take installs whenever they come. */
REFIT_API int refit_gate(refit_client *c);
REFIT_API int refit_consumed(refit_client *c, uint64_t version);
/* Closes the connection (the daemon drops this client's registration) and frees c. */
REFIT_API int refit_close(refit_client *c);

/* Layouts: how a framework's ranks hold a built-in model (bindings such as refit.torch map a
 * module's named parameters onto them). model: a builtin or a JSON spec path, its large dims
 * divided by shrink when > 1; convention "hf" (every HF tensor whole, one rank: parallel empty,
 * rank 0), "megatron" (trainer rank of Megatron-Core, parallel such as "tp=2,pp=2,ep=4"),
 * "vllm" (engine rank of vLLM, "tp=2,ep=2") or "sglang" (engine rank as SGLang names them;
 * "tp=8,dp=8,attn=dp" for --enable-dp-attention). The layout lists the rank's parameters as the
 * framework names them, each with its dtype (REFIT_*), its local shape (row-major) and the
 * pieces of HF tensors it holds. Errors are in refit_last_error(NULL). */
typedef struct refit_layout refit_layout;
REFIT_API int refit_layout_open(const char *model, int shrink, const char *convention,
                                const char *parallel, int rank, refit_layout **out);
REFIT_API uint32_t refit_layout_nparams(const refit_layout *l);
/* Parameter i: name (valid until refit_layout_free), dtype, ndim and shape (8 values), and how
 * many pieces it holds. */
REFIT_API int refit_layout_param(const refit_layout *l, uint32_t i, const char **name,
                                 int *dtype, int *ndim, int64_t *shape, uint32_t *npieces);
/* Piece j of parameter i: the HF tensor (name, ndim, global shape), the box (start, extent),
 * and where it lies in the parameter: offset and strides in elements of the parameter's
 * row-major storage. Arrays hold 8 values. */
REFIT_API int refit_layout_piece(const refit_layout *l, uint32_t i, uint32_t j,
                                 const char **tensor, int *ndim, int64_t *shape, int64_t *start,
                                 int64_t *extent, int64_t *strides, uint64_t *offset);
REFIT_API void refit_layout_free(refit_layout *l);

#ifdef __cplusplus
}
#endif

#endif
