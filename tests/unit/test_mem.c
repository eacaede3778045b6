/* tests/unit/test_mem.c - memory import: memfd mapping and its checks, the mapping cache,
 * and a second implementation plugged into the kind table. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "mem.h"

static int make_memfd(size_t size, bool seal)
{
    int fd = memfd_create("t", MFD_CLOEXEC | (seal ? MFD_ALLOW_SEALING : 0));

    cr_assert(fd >= 0);
    cr_assert(ftruncate(fd, (off_t)size) == 0);
    if (seal)
        cr_assert(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
    return fd;
}

static rf_mem_desc host(int fd, uint64_t size, uint64_t offset)
{
    rf_mem_desc d = {.kind = RF_MEM_MEMFD, .device = "host", .size = size, .offset = offset,
                     .fd = fd};
    return d;
}

Test(mem, memfd_is_shared_and_cached)
{
    rf_mem_cache *c = rf_mem_cache_new();
    int fd = make_memfd(8192, true);
    rf_mem_desc d1 = host(fd, 4096, 0), d2 = host(fd, 4096, 4096);
    rf_mem_ref *a, *b;
    rf_err err = {0};
    uint8_t *mine = mmap(NULL, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);

    cr_assert(mine != MAP_FAILED);
    cr_assert_eq(rf_mem_import(c, &d1, &a, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_mem_import(c, &d2, &b, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_mem_cache_count(c), 1, "one memfd is one mapping");
    cr_assert_eq(rf_mem_ref_size(b), 4096);
    cr_assert_eq(rf_mem_ref_kind(a), RF_MEM_MEMFD);
    memset(rf_mem_ref_base(a), 0xab, 4096);
    memset(rf_mem_ref_base(b), 0xcd, 4096);
    cr_assert_eq(mine[0], 0xab);
    cr_assert_eq(mine[4095], 0xab);
    cr_assert_eq(mine[4096], 0xcd);
    cr_assert_eq(mine[8191], 0xcd);
    rf_mem_release(c, a);
    cr_assert_eq(rf_mem_cache_count(c), 1);
    rf_mem_release(c, b);
    cr_assert_eq(rf_mem_cache_count(c), 0, "closed with its last region");
    munmap(mine, 8192);
    close(fd);
    rf_mem_cache_free(c);
}

Test(mem, memfd_smaller_than_claimed)
{
    rf_mem_cache *c = rf_mem_cache_new();
    int fd = make_memfd(4096, true);
    rf_mem_desc d = host(fd, 4096, 1);
    rf_mem_ref *a = NULL, *b = NULL;
    rf_err err = {0};

    cr_assert_eq(rf_mem_import(c, &d, &a, &err), -EINVAL);
    cr_assert(strstr(err.msg, "memfd is 4096 bytes, smaller than the region claimed"), "%s",
              err.msg);
    cr_assert_null(a);
    /* The same check on a mapping that is reused. */
    d = host(fd, 100, 0);
    cr_assert_eq(rf_mem_import(c, &d, &a, &err), 0, "%s", err.msg);
    d = host(fd, 8192, 0);
    cr_assert_eq(rf_mem_import(c, &d, &b, &err), -EINVAL);
    cr_assert(strstr(err.msg, "smaller than the region claimed"), "%s", err.msg);
    cr_assert_eq(rf_mem_cache_count(c), 1);
    rf_mem_release(c, a);
    close(fd);
    rf_mem_cache_free(c);
}

Test(mem, refuses_bad_handles)
{
    rf_mem_cache *c = rf_mem_cache_new();
    int unsealed = make_memfd(4096, false), empty = make_memfd(0, true), p[2];
    rf_mem_desc d;
    rf_mem_ref *a = NULL;
    rf_err err = {0};

    d = host(unsealed, 4096, 0);
    cr_assert_eq(rf_mem_import(c, &d, &a, &err), -EINVAL);
    cr_assert(strstr(err.msg, "not sealed against shrinking"), "%s", err.msg);
    d = host(empty, 1, 0);
    cr_assert_eq(rf_mem_import(c, &d, &a, &err), -EINVAL);
    cr_assert(strstr(err.msg, "smaller"), "%s", err.msg);
    d = host(-1, 4096, 0);
    cr_assert_eq(rf_mem_import(c, &d, &a, &err), -EBADF);
    cr_assert(strstr(err.msg, "without a file descriptor"), "%s", err.msg);
    cr_assert(pipe(p) == 0);
    d = host(p[0], 4096, 0);
    cr_assert_eq(rf_mem_import(c, &d, &a, &err), -EINVAL);
    cr_assert(strstr(err.msg, "not a memfd"), "%s", err.msg);
    d = host(unsealed, 0, 0);
    cr_assert_eq(rf_mem_import(c, &d, &a, &err), -EINVAL);
    cr_assert(strstr(err.msg, "size 0"), "%s", err.msg);
    d.kind = RF_MEM_CUDA_IPC;
    d.size = 10;
    cr_assert_eq(rf_mem_import(c, &d, &a, &err), -ENOTSUP);
    cr_assert(strstr(err.msg, "cuda_ipc is not supported"), "%s", err.msg);
    d.kind = (rf_mem_kind)9;
    cr_assert_eq(rf_mem_import(c, &d, &a, &err), -EINVAL);
    cr_assert(strstr(err.msg, "unknown memory kind 9"), "%s", err.msg);
    cr_assert_eq(rf_mem_set_ops((rf_mem_kind)0, NULL), -EINVAL);
    cr_assert_null(a);
    cr_assert_eq(rf_mem_cache_count(c), 0);
    close(unsealed);
    close(empty);
    close(p[0]);
    close(p[1]);
    rf_mem_cache_free(c);
}

/* A second implementation through the table, the way CUDA IPC plugs in: keyed by handle
 * bytes, imported once per handle, closed once. */
static int fake_imports, fake_closes;
static uint8_t fake_store[2][4096];

static int fake_key(const rf_mem_desc *d, uint8_t *key, size_t *len, rf_err *err)
{
    if (d->handle_len != 1)
        return rf_err_set(err, -EINVAL, "fake handle must be 1 byte");
    key[0] = d->handle[0];
    *len = 1;
    return 0;
}

static int fake_check(const rf_mem_desc *d, const rf_mem_map *m, rf_err *err)
{
    if (d->offset + d->size > m->len)
        return rf_err_set(err, -EINVAL, "fake allocation too small");
    return 0;
}

static int fake_import(const rf_mem_desc *d, rf_mem_map *m, rf_err *err)
{
    m->len = sizeof(fake_store[0]);
    if (fake_check(d, m, err) < 0)
        return -EINVAL;
    m->base = fake_store[d->handle[0] & 1];
    fake_imports++;
    return 0;
}

static void fake_close(rf_mem_map *m)
{
    (void)m;
    fake_closes++;
}

Test(mem, pluggable_kind)
{
    static const rf_mem_ops ops = {"fake", fake_key, fake_import, fake_check, fake_close};
    rf_mem_cache *c = rf_mem_cache_new();
    uint8_t h0 = 0, h1 = 1;
    rf_mem_desc d = {.kind = RF_MEM_CUDA_IPC, .device = "GPU-x", .size = 16, .fd = -1,
                     .handle = &h0, .handle_len = 1};
    rf_mem_ref *a, *b, *x, *bad = NULL;
    rf_err err = {0};

    cr_assert_eq(rf_mem_set_ops(RF_MEM_CUDA_IPC, &ops), 0);
    cr_assert_eq(rf_mem_import(c, &d, &a, &err), 0, "%s", err.msg);
    d.offset = 32;
    cr_assert_eq(rf_mem_import(c, &d, &b, &err), 0, "%s", err.msg);
    cr_assert_eq(fake_imports, 1, "same handle imported once");
    cr_assert_eq((uint8_t *)rf_mem_ref_base(b), fake_store[0] + 32);
    d.size = 8192;
    cr_assert_eq(rf_mem_import(c, &d, &bad, &err), -EINVAL);
    d.handle = &h1;
    d.size = 16;
    d.offset = 0;
    cr_assert_eq(rf_mem_import(c, &d, &x, &err), 0, "%s", err.msg);
    cr_assert_eq(fake_imports, 2);
    cr_assert_eq(rf_mem_cache_count(c), 2);
    rf_mem_release(c, a);
    rf_mem_release(c, b);
    cr_assert_eq(fake_closes, 1);
    /* Refs are their holder's: x is released before the cache goes (ASan saw it leak). */
    rf_mem_release(c, x);
    cr_assert_eq(fake_closes, 2);
    rf_mem_cache_free(c);
    rf_mem_set_ops(RF_MEM_CUDA_IPC, NULL);
}
