/* common/data/mem.c - memory import: the table of implementations by kind, the memfd one, and the
 * per-daemon cache of mappings. */
#include "mem.h"

#include <fcntl.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct mem_entry {
    struct mem_entry *next;
    rf_mem_kind kind;
    rf_mem_map map;
    unsigned refs;
} mem_entry;

struct rf_mem_ref {
    mem_entry *e;
    uint64_t offset, size;
};

struct rf_mem_cache {
    mem_entry *entries;
    size_t count;
};

static int memfd_key(const rf_mem_desc *d, uint8_t *key, size_t *key_len, rf_err *err)
{
    struct stat st;

    if (d->fd < 0)
        return rf_err_set(err, -EBADF, "memfd region registered without a file descriptor: "
                          "send the memfd with the request (SCM_RIGHTS)");
    if (fstat(d->fd, &st) < 0)
        return rf_err_set(err, -errno, "fstat of the region's memfd: %s", strerror(errno));
    if (!S_ISREG(st.st_mode))
        return rf_err_set(err, -EINVAL, "the descriptor sent for a memfd region is not a "
                          "memfd or regular file (mode 0%o)", (unsigned)st.st_mode);
    memcpy(key, &st.st_dev, sizeof(st.st_dev));
    memcpy(key + sizeof(st.st_dev), &st.st_ino, sizeof(st.st_ino));
    *key_len = sizeof(st.st_dev) + sizeof(st.st_ino);
    return 0;
}

static int memfd_check(const rf_mem_desc *d, const rf_mem_map *m, rf_err *err)
{
    if (d->offset > m->len || d->size > m->len - d->offset)
        return rf_err_set(err, -EINVAL, "memfd is %llu bytes, smaller than the region claimed "
                          "(offset %llu + size %llu): register a size that fits",
                          (unsigned long long)m->len, (unsigned long long)d->offset,
                          (unsigned long long)d->size);
    return 0;
}

static int memfd_import(const rf_mem_desc *d, rf_mem_map *m, rf_err *err)
{
    struct stat st;
    void *p;
    int seals, prot, rc;

    if (fstat(d->fd, &st) < 0)
        return rf_err_set(err, -errno, "fstat of the region's memfd: %s", strerror(errno));
    m->len = (uint64_t)st.st_size;
    rc = memfd_check(d, m, err);
    if (rc < 0)
        return rc;
    /* A client that shrank the file under our mapping would kill the daemon with SIGBUS. */
    seals = fcntl(d->fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK))
        return rf_err_set(err, -EINVAL, "memfd is not sealed against shrinking: create it "
                          "with MFD_ALLOW_SEALING and add F_SEAL_SHRINK (librefit does this)");
    if (m->len == 0)
        return rf_err_set(err, -EINVAL, "memfd is empty: size it with ftruncate first");
    /* A memfd handed over read-only (trainer memory for an engine's installer) is read only
     * and can be mapped no other way. */
    prot = (fcntl(d->fd, F_GETFL) & O_ACCMODE) == O_RDONLY ? PROT_READ : PROT_READ | PROT_WRITE;
    p = mmap(NULL, m->len, prot, MAP_SHARED, d->fd, 0);
    if (p == MAP_FAILED)
        return rf_err_set(err, -errno, "cannot map memfd of %llu bytes: %s",
                          (unsigned long long)m->len, strerror(errno));
    m->base = p;
    return 0;
}

static void memfd_close(rf_mem_map *m)
{
    munmap(m->base, m->len);
}

static const rf_mem_ops memfd_ops = {
    .name = "memfd",
    .key = memfd_key,
    .import = memfd_import,
    .check = memfd_check,
    .close = memfd_close,
};

static const rf_mem_ops *mem_ops[RF_MEM__COUNT] = {
    [RF_MEM_MEMFD] = &memfd_ops,
};

int rf_mem_set_ops(rf_mem_kind kind, const rf_mem_ops *ops)
{
    if (kind <= 0 || kind >= RF_MEM__COUNT)
        return -EINVAL;
    mem_ops[kind] = ops;
    return 0;
}

const char *rf_mem_kind_name(rf_mem_kind kind)
{
    switch (kind) {
    case RF_MEM_MEMFD: return "memfd";
    case RF_MEM_CUDA_IPC: return "cuda_ipc";
    case RF_MEM_CUDA_VMM_FD: return "cuda_vmm_fd";
    default: return "?";
    }
}

uint64_t rf_mem_owner_new(void)
{
    static uint64_t last;

    return __atomic_add_fetch(&last, 1, __ATOMIC_RELAXED);
}

rf_mem_cache *rf_mem_cache_new(void)
{
    return calloc(1, sizeof(rf_mem_cache));
}

static void entry_close(mem_entry *e)
{
    mem_ops[e->kind]->close(&e->map);
    free(e);
}

void rf_mem_cache_free(rf_mem_cache *c)
{
    mem_entry *e, *next;

    if (c == NULL)
        return;
    for (e = c->entries; e != NULL; e = next) {
        next = e->next;
        entry_close(e);
    }
    free(c);
}

int rf_mem_import(rf_mem_cache *c, const rf_mem_desc *d, rf_mem_ref **out, rf_err *err)
{
    uint8_t key[RF_MEM_KEY_MAX];
    size_t key_len = 0;
    const rf_mem_ops *ops;
    mem_entry *e = NULL;
    rf_mem_ref *r = NULL;
    int rc;

    *out = NULL;
    if (d->kind <= 0 || d->kind >= RF_MEM__COUNT)
        return rf_err_set(err, -EINVAL, "unknown memory kind %d (expected memfd, cuda_ipc or "
                          "cuda_vmm_fd)", (int)d->kind);
    /* The chunk list is judged before the kind's implementation, so a daemon without CUDA
     * gives the same answer. */
    if (d->nchunks > 0 && d->kind != RF_MEM_CUDA_VMM_FD)
        return rf_err_set(err, -EINVAL, "a %s region with %zu chunks: only cuda_vmm_fd "
                          "regions are made of several allocations", rf_mem_kind_name(d->kind),
                          d->nchunks);
    if (d->nchunks > RF_MEM_MAX_CHUNKS)
        return rf_err_set(err, -E2BIG, "a cuda_vmm_fd region on %s spans %zu allocations, "
                          "more than the %d one region may: register the range as several "
                          "regions", d->device, d->nchunks, RF_MEM_MAX_CHUNKS);
    ops = mem_ops[d->kind];
    if (ops == NULL)
        return rf_err_set(err, -ENOTSUP, "memory kind %s is not supported by this daemon "
                          "(built without CUDA): register host memory (memfd)",
                          rf_mem_kind_name(d->kind));
    if (d->size == 0)
        return rf_err_set(err, -EINVAL, "region of size 0: register at least one byte");
    rc = ops->key(d, key, &key_len, err);
    if (rc < 0)
        return rc;
    r = calloc(1, sizeof(*r));
    if (r == NULL)
        return rf_err_set(err, -ENOMEM, "out of memory importing a %s region", ops->name);
    for (e = c->entries; e != NULL; e = e->next)
        if (e->kind == d->kind && e->map.key_len == key_len &&
            memcmp(e->map.key, key, key_len) == 0)
            break;
    if (e != NULL) {
        rc = ops->check(d, &e->map, err);
        if (rc < 0)
            goto out;
    } else {
        e = calloc(1, sizeof(*e));
        if (e == NULL) {
            rc = rf_err_set(err, -ENOMEM, "out of memory importing a %s region", ops->name);
            goto out;
        }
        e->kind = d->kind;
        memcpy(e->map.key, key, key_len);
        e->map.key_len = key_len;
        rc = ops->import(d, &e->map, err);
        if (rc < 0) {
            free(e);
            goto out;
        }
        e->next = c->entries;
        c->entries = e;
        c->count++;
    }
    e->refs++;
    r->e = e;
    r->offset = d->offset;
    r->size = d->size;
    *out = r;
    r = NULL;
    rc = 0;
out:
    free(r);
    return rc;
}

void rf_mem_release(rf_mem_cache *c, rf_mem_ref *r)
{
    mem_entry **pp;

    if (r == NULL)
        return;
    if (--r->e->refs == 0) {
        for (pp = &c->entries; *pp != NULL; pp = &(*pp)->next) {
            if (*pp == r->e) {
                *pp = r->e->next;
                break;
            }
        }
        c->count--;
        entry_close(r->e);
    }
    free(r);
}

void *rf_mem_ref_base(const rf_mem_ref *r)
{
    return (uint8_t *)r->e->map.base + r->offset;
}

uint64_t rf_mem_ref_size(const rf_mem_ref *r)
{
    return r->size;
}

rf_mem_kind rf_mem_ref_kind(const rf_mem_ref *r)
{
    return r->e->kind;
}

size_t rf_mem_cache_count(const rf_mem_cache *c)
{
    return c->count;
}
