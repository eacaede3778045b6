/* common/data/mem.h - importing a client's memory into the daemon: one implementation per kind of
 * handle (memfd now; CUDA IPC and VMM fds plug into the same table), and a cache that maps
 * each shared object once and unmaps it when the last region using it goes away. */
#ifndef RF_MEM_H
#define RF_MEM_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"

typedef enum rf_mem_kind {
    RF_MEM_MEMFD = 1,       /* values match refit.rpc.MemKind */
    RF_MEM_CUDA_IPC = 2,
    RF_MEM_CUDA_VMM_FD = 3,
    RF_MEM__COUNT
} rf_mem_kind;

#define RF_MEM_KEY_MAX 64
/* The most VMM allocations one region may span: 20 GiB of PyTorch's 20 MiB expandable-segment
 * chunks (a larger range is registered as several regions). Each is one fd on the request. */
#define RF_MEM_MAX_CHUNKS 1024

/* One CUDA VMM allocation of a region that spans several mapped back to back. */
typedef struct rf_mem_chunk {
    uint64_t size;          /* bytes of the allocation (mapped whole) */
    int fd;                 /* its POSIX fd from cuMemExportToShareableHandle (not consumed) */
} rf_mem_chunk;

/* What a client says about a region. */
typedef struct rf_mem_desc {
    rf_mem_kind kind;
    const char *device;     /* "host" or a GPU UUID */
    uint64_t size;          /* bytes of the region */
    uint64_t offset;        /* where the region starts in the shared object */
    const uint8_t *handle;  /* cuda_ipc: the IPC handle bytes */
    size_t handle_len;
    int fd;                 /* memfd, cuda_vmm_fd: the received descriptor (not consumed) */
    /* cuda_vmm_fd only, nchunks > 0: the shared object is these allocations mapped back to
     * back (fd and handle unused), so offset and size may run across them. */
    const rf_mem_chunk *chunks;
    size_t nchunks;
    /* cuda_vmm_fd: where the client maps the (first) allocation, and who the client is (a
     * number from rf_mem_owner_new, unique in this process). With both non-zero, regions of
     * the same owner, base and allocations share one mapping: a trainer's thousands of
     * tensors in one VMM allocation map it once, not once each (each mapping reserves the
     * allocation's whole size of address space). The pair is the client's own word: it can
     * only name its own allocations, never reach another client's mapping. Zero: a mapping of
     * its own. */
    uint64_t vmm_base;
    uint64_t owner;
} rf_mem_desc;

/* A number for rf_mem_desc.owner, never 0, never given twice in this process. */
uint64_t rf_mem_owner_new(void);

/* One imported shared object, as an implementation fills it. */
typedef struct rf_mem_map {
    void *base;             /* start of the whole object in this process (host or device) */
    uint64_t len;           /* bytes mapped */
    uint8_t key[RF_MEM_KEY_MAX]; /* identity of the object: equal keys are one mapping */
    size_t key_len;
    void *impl;             /* the implementation's own state */
} rf_mem_map;

/* An implementation: key identifies the object without importing it (so a second region of
 * the same object reuses the mapping; importing one CUDA IPC handle twice fails), import
 * maps it (checking d->offset + d->size against the object), close undoes import. */
typedef struct rf_mem_ops {
    const char *name;
    int (*key)(const rf_mem_desc *d, uint8_t *key, size_t *key_len, rf_err *err);
    int (*import)(const rf_mem_desc *d, rf_mem_map *m, rf_err *err);
    int (*check)(const rf_mem_desc *d, const rf_mem_map *m, rf_err *err); /* a reused map */
    void (*close)(rf_mem_map *m);
} rf_mem_ops;

/* Installs the implementation of a kind (memfd is built in). -EINVAL on a bad kind. */
int rf_mem_set_ops(rf_mem_kind kind, const rf_mem_ops *ops);
/* "memfd", "cuda_ipc", "cuda_vmm_fd", or "?" */
const char *rf_mem_kind_name(rf_mem_kind kind);

typedef struct rf_mem_cache rf_mem_cache;
typedef struct rf_mem_ref rf_mem_ref; /* one region's hold on a mapping */

rf_mem_cache *rf_mem_cache_new(void);
/* Closes every mapping still held; a ref still held must not be used afterwards and is not
 * freed (release refs first: each is its holder's). */
void rf_mem_cache_free(rf_mem_cache *c);
/* Imports d (or reuses the mapping of the same object) and returns a reference to it.
 * Errors say what is wrong with the handle: -ENOTSUP for a kind with no implementation,
 * -EINVAL for an object smaller than offset + size, a memfd not sealed against shrinking,
 * chunks on a kind other than cuda_vmm_fd or more than RF_MEM_MAX_CHUNKS of them. */
int rf_mem_import(rf_mem_cache *c, const rf_mem_desc *d, rf_mem_ref **out, rf_err *err);
/* Drops the reference; the mapping is closed with its last one. */
void rf_mem_release(rf_mem_cache *c, rf_mem_ref *r);
/* The region's first byte (mapping base + offset) and its size. */
void *rf_mem_ref_base(const rf_mem_ref *r);
uint64_t rf_mem_ref_size(const rf_mem_ref *r);
rf_mem_kind rf_mem_ref_kind(const rf_mem_ref *r);
/* Mappings currently open (distinct objects). */
size_t rf_mem_cache_count(const rf_mem_cache *c);

#endif
