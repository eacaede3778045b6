/* tests/unit/test_wdigest.c - the linear payload digest: known answers (computed by an independent
 * Python rendering of wdigest.h's definition), split invariance over random splits and orders,
 * every single-bit change of a payload caught, the key, seq and length in the term, strided
 * walks equal to their packed bytes; on a GPU, the kernel's lanes equal the host reference's on
 * random segments (dense, strided, two-byte runs, unaligned, many accumulators, ranges). The
 * GPU cases are skipped without a CUDA device. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wdigest.h"

#ifdef RF_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "drv_cuda.h"
#include "wdigest_cuda.h"
#endif

static uint64_t rng_state;

static uint64_t rnd(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void fill(uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)rnd();
}

static void seed_0_31(uint8_t seed[RF_WDIGEST_SEED_BYTES])
{
    for (int i = 0; i < RF_WDIGEST_SEED_BYTES; i++)
        seed[i] = (uint8_t)i;
}

static void hex(const uint8_t *p, size_t n, char *out)
{
    for (size_t i = 0; i < n; i++)
        sprintf(out + 2 * i, "%02x", p[i]);
}

static void term_of(const rf_wdigest_key *k, uint64_t off, const uint8_t *p, uint64_t n,
                    uint32_t seq, uint8_t out[RF_WDIGEST_TERM_BYTES])
{
    rf_wdigest_acc acc = {{0, 0}};

    rf_wdigest_add(k, off, p, n, &acc);
    rf_wdigest_term(&acc, seq, n, out);
}

Test(wdigest, known_answers)
{
    uint8_t seed[RF_WDIGEST_SEED_BYTES], data[3000], t[RF_WDIGEST_TERM_BYTES];
    rf_wdigest_key k;
    rf_wdigest_acc acc = {{0, 0}};
    char h[2 * RF_WDIGEST_TERM_BYTES + 1];

    seed_0_31(seed);
    rf_wdigest_key_derive(seed, &k);
    cr_assert_eq(k.a[0][0], 0xda160e98u);
    cr_assert_eq(k.a[1][255], 0xcef605a8u);
    cr_assert_eq(k.bseed[0], 0x16e604bbe9da088bull);
    cr_assert_eq(k.bseed[1], 0xcf1bc7e25d1acde3ull);
    cr_assert_eq(rf_wdigest_block_key(&k, 0, 0), 31096889034501797ull);
    cr_assert_eq(rf_wdigest_block_key(&k, 1, 12345), 1365629848283536864ull);
    for (int i = 0; i < 3000; i++)
        data[i] = (uint8_t)(i * 7 + 3);
    rf_wdigest_add(&k, 0, data, 3000, &acc);
    cr_assert_eq(acc.lane[0], 1729603757168881106ull);
    cr_assert_eq(acc.lane[1], 1710332194125190447ull);
    rf_wdigest_term(&acc, 5, 3000, t);
    hex(t, sizeof(t), h);
    cr_assert_str_eq(h, "894f5d013468fcfacdeca8b0a424b521da86a70cbb7d717aa8b79495774bce97");
    /* At an offset that is no word's nor block's start, a length that ends inside a word. */
    memset(&acc, 0, sizeof(acc));
    rf_wdigest_add(&k, 4093, data, 2001, &acc);
    cr_assert_eq(acc.lane[0], 1893927424875077135ull);
    cr_assert_eq(acc.lane[1], 833426993702148554ull);
    rf_wdigest_term(&acc, 0xdeadbeefu, 2001, t);
    hex(t, sizeof(t), h);
    cr_assert_str_eq(h, "658cde02cd85e3724c539401047168c79bfb3b9fd3623a57a177b88e9b86fa43");
}

/* Random cuts of a payload digested in random order, each piece alone then merged: the lanes
 * of the whole. */
Test(wdigest, any_split_in_any_order_gives_the_same_lanes)
{
    enum { N = 20000, MAXP = 64 };
    uint8_t seed[RF_WDIGEST_SEED_BYTES], *data = malloc(N);
    uint64_t cut[MAXP + 1];
    rf_wdigest_key k;

    rng_state = 1;
    fill(seed, sizeof(seed));
    rf_wdigest_key_derive(seed, &k);
    fill(data, N);
    for (int trial = 0; trial < 200; trial++) {
        uint64_t base = rnd() % 5000, n = 1 + rnd() % (N - 1);
        int np = 1 + (int)(rnd() % MAXP), order[MAXP];
        rf_wdigest_acc whole = {{0, 0}}, sum = {{0, 0}};

        rf_wdigest_add(&k, base, data, n, &whole);
        cut[0] = 0;
        cut[np] = n;
        for (int i = 1; i < np; i++)
            cut[i] = rnd() % (n + 1);
        for (int i = 1; i < np; i++) /* sorted: pieces may be empty */
            for (int j = i; j > 1 && cut[j - 1] > cut[j]; j--) {
                uint64_t x = cut[j];

                cut[j] = cut[j - 1];
                cut[j - 1] = x;
            }
        for (int i = 0; i < np; i++)
            order[i] = i;
        for (int i = np - 1; i > 0; i--) {
            int j = (int)(rnd() % (uint64_t)(i + 1)), x = order[i];

            order[i] = order[j];
            order[j] = x;
        }
        for (int i = 0; i < np; i++) {
            int q = order[i];
            rf_wdigest_acc part = {{0, 0}};

            rf_wdigest_add(&k, base + cut[q], data + cut[q], cut[q + 1] - cut[q], &part);
            rf_wdigest_merge(&sum, &part);
        }
        cr_assert(whole.lane[0] < RF_WDIGEST_P && whole.lane[1] < RF_WDIGEST_P);
        cr_assert(sum.lane[0] == whole.lane[0] && sum.lane[1] == whole.lane[1],
                  "trial %d: %d pieces of %llu bytes at %llu disagree with the whole", trial, np,
                  (unsigned long long)n, (unsigned long long)base);
    }
    free(data);
}

/* Every single-bit change of a payload that spans three blocks, at an odd offset, changes the
 * term; so does every byte set to any other value at a few places. */
Test(wdigest, every_single_bit_and_byte_change_changes_the_term)
{
    enum { N = 2600, OFF = 1021 };
    uint8_t seed[RF_WDIGEST_SEED_BYTES], data[N], want[RF_WDIGEST_TERM_BYTES],
        got[RF_WDIGEST_TERM_BYTES];
    rf_wdigest_key k;

    rng_state = 2;
    fill(seed, sizeof(seed));
    rf_wdigest_key_derive(seed, &k);
    fill(data, N);
    term_of(&k, OFF, data, N, 9, want);
    for (int i = 0; i < N; i++) {
        for (int bit = 0; bit < 8; bit++) {
            data[i] ^= (uint8_t)(1u << bit);
            term_of(&k, OFF, data, N, 9, got);
            data[i] ^= (uint8_t)(1u << bit);
            cr_assert_neq(memcmp(want, got, sizeof(want)), 0, "flipping bit %d of byte %d "
                          "left the term unchanged", bit, i);
        }
    }
    for (int at = 0; at < N; at += 433) {
        uint8_t keep = data[at];

        for (int v = 0; v < 256; v++) {
            if (v == keep)
                continue;
            data[at] = (uint8_t)v;
            term_of(&k, OFF, data, N, 9, got);
            cr_assert_neq(memcmp(want, got, sizeof(want)), 0, "byte %d set to %d left the term "
                          "unchanged", at, v);
        }
        data[at] = keep;
    }
    term_of(&k, OFF, data, N, 9, got);
    cr_assert_eq(memcmp(want, got, sizeof(want)), 0, "the payload restored, the term is not");
}

/* The term depends on the seed (every bit of it), the message's seq and the digested length;
 * zero bytes appended change the length, not the lanes. */
Test(wdigest, seed_seq_and_length_change_the_term)
{
    uint8_t seed[RF_WDIGEST_SEED_BYTES], data[700] = {0}, want[RF_WDIGEST_TERM_BYTES],
        got[RF_WDIGEST_TERM_BYTES];
    rf_wdigest_key k;
    rf_wdigest_acc a = {{0, 0}}, b = {{0, 0}};

    rng_state = 3;
    fill(seed, sizeof(seed));
    fill(data, 600);
    rf_wdigest_key_derive(seed, &k);
    term_of(&k, 0, data, 600, 1, want);
    for (int i = 0; i < RF_WDIGEST_SEED_BYTES * 8; i++) {
        rf_wdigest_key k2;

        seed[i / 8] ^= (uint8_t)(1u << (i % 8));
        rf_wdigest_key_derive(seed, &k2);
        seed[i / 8] ^= (uint8_t)(1u << (i % 8));
        term_of(&k2, 0, data, 600, 1, got);
        cr_assert_neq(memcmp(want, got, sizeof(want)), 0, "seed bit %d changed nothing", i);
    }
    term_of(&k, 0, data, 600, 2, got);
    cr_assert_neq(memcmp(want, got, sizeof(want)), 0, "seq changed nothing");
    rf_wdigest_add(&k, 0, data, 600, &a);
    rf_wdigest_add(&k, 0, data, 700, &b);
    cr_assert(a.lane[0] == b.lane[0] && a.lane[1] == b.lane[1]);
    term_of(&k, 0, data, 700, 1, got);
    cr_assert_neq(memcmp(want, got, sizeof(want)), 0, "the length changed nothing");
}

/* The carries of a device accumulator (lo + 2^64 hi) reduce to the lanes of the same sum. */
Test(wdigest, carries_reduce_mod_p)
{
    uint64_t lo[2] = {5, UINT64_MAX}, hi[2] = {3, 0};
    rf_wdigest_acc a;

    rf_wdigest_acc_from128(lo, hi, &a);
    /* 5 + 3 * 2^64 = 5 + 24 mod p; 2^64 - 1 = 7 mod p. */
    cr_assert_eq(a.lane[0], 29);
    cr_assert_eq(a.lane[1], 7);
}

/* A strided box walked run by run (the local copies' segments) digests like its bytes packed
 * row-major; and a prefix of the walk (sampled digests) like the packed prefix. */
Test(wdigest, strided_walk_equals_packed_bytes)
{
    enum { R = 37, C = 300, RS = 517, D0 = 3, D0S = R * RS + 11 };
    uint8_t seed[RF_WDIGEST_SEED_BYTES], *mem = malloc(D0 * D0S), *packed = malloc(D0 * R * C);
    int64_t ext[2] = {D0, R}, str[2] = {D0S, RS};
    rf_wdigest_key k;
    rf_wdigest_seg s;

    rng_state = 4;
    fill(seed, sizeof(seed));
    rf_wdigest_key_derive(seed, &k);
    fill(mem, D0 * D0S);
    for (int a = 0; a < D0; a++)
        for (int r = 0; r < R; r++)
            memcpy(packed + ((size_t)a * R + r) * C, mem + (size_t)a * D0S + (size_t)r * RS, C);
    for (uint64_t bytes = D0 * R * C; bytes > 0; bytes = bytes > 4000 ? bytes / 3 : 0) {
        rf_wdigest_acc x = {{0, 0}}, y = {{0, 0}};

        rf_wdigest_seg_walk(&s, mem, 777, bytes, C, 2, ext, str, 0);
        rf_wdigest_add_seg(&k, &s, &x);
        rf_wdigest_add(&k, 777, packed, bytes, &y);
        cr_assert(x.lane[0] == y.lane[0] && x.lane[1] == y.lane[1], "%llu bytes",
                  (unsigned long long)bytes);
    }
    free(mem);
    free(packed);
}

#ifdef RF_HAVE_CUDA

#define NEED_GPU()                                                                    \
    do {                                                                              \
        if (!rf_cuda_available()) {                                                   \
            printf("skipped: no CUDA device\n");                                      \
            cr_skip_test("no CUDA device");                                           \
        }                                                                             \
    } while (0)

/* A random segment inside a buffer of cap bytes at host h / device d: dense, strided (one or
 * two outer dims, runs of 2 bytes to a few KiB), at any alignment, of odd lengths; its payload
 * offset anywhere. */
static void rand_seg(rf_wdigest_seg *hs, rf_wdigest_seg *ds, uint8_t *h, uint8_t *d, uint64_t cap,
                     uint32_t acc)
{
    int kind = (int)(rnd() % 4), n = 0;
    int64_t ext[2] = {1, 1}, str[2] = {0, 0};
    uint64_t run, span, at, off = rnd() % (3u << 20), bytes;

    if (kind == 0) { /* dense, up to 3 MiB */
        run = 1 + rnd() % (3u << 20);
        span = run;
    } else {
        static const uint64_t runs[] = {2, 4, 6, 16, 48, 1024, 1040, 4096, 3000, 8192, 9728};
        /* Half the strided ones 16-byte aligned throughout, with whole blocks in their runs:
         * the kernel's path that loads several blocks at once. */
        int al = (int)(rnd() % 2);

        run = runs[rnd() % (sizeof(runs) / sizeof(runs[0]))];
        n = kind == 3 ? 2 : 1;
        ext[n - 1] = 2 + (int64_t)(rnd() % (kind == 1 && run <= 16 ? 4000 : 300));
        str[n - 1] = (int64_t)(run + (al ? 16 * (rnd() % 4) : rnd() % 64));
        if (n == 2) {
            ext[0] = 2 + (int64_t)(rnd() % 4);
            str[0] = ext[1] * str[1] + (int64_t)(al ? 16 * (rnd() % 4) : rnd() % 100);
        }
        if (al)
            off &= ~(uint64_t)(RF_WDIGEST_BLOCK - 1);
        span = (uint64_t)((ext[0] - 1) * str[0] + (ext[1] - 1) * str[1]) + run;
        if (n == 1)
            span = (uint64_t)((ext[0] - 1) * str[0]) + run;
    }
    cr_assert_leq(span, cap);
    at = rnd() % (cap - span + 1);
    if (rnd() % 2) /* the memory and the payload agree mod 16: the vector path */
        off = (off & ~15ull) + (at & 15);
    if (n > 0 && off % RF_WDIGEST_BLOCK == 0 && rnd() % 2)
        at &= ~15ull;
    bytes = n == 0 ? run : run * (uint64_t)ext[0] * (uint64_t)ext[1];
    if (rnd() % 3 == 0)
        bytes = 1 + rnd() % bytes; /* a prefix, as a sampled digest takes */
    rf_wdigest_seg_walk(hs, h + at, off, bytes, run, n, ext, str, acc);
    *ds = *hs;
    ds->base = d + at;
}

/* Many random segments into several accumulators, digested by the kernel in ranges, each
 * accumulator equal to the host reference of its segments. */
Test(wdigest_cuda, kernel_equals_host_reference_on_random_segments)
{
    enum { NSEG = 400, NACC = 37 };
    const uint64_t cap = 48ull << 20;
    uint8_t seed[RF_WDIGEST_SEED_BYTES], *h = malloc(cap), *d = NULL;
    rf_wdigest_seg *hs = calloc(NSEG, sizeof(*hs)), *ds = calloc(NSEG, sizeof(*ds));
    rf_wdigest_acc want[NACC];
    rf_wdigest_cuda_plan *pl = NULL;
    rf_wdigest_key k;
    cudaStream_t s;
    rf_err err = {0};
    uint64_t total = 0;

    NEED_GPU();
    rng_state = 5;
    fill(seed, sizeof(seed));
    rf_wdigest_key_derive(seed, &k);
    fill(h, cap);
    cr_assert_eq(cudaMalloc((void **)&d, cap), cudaSuccess);
    cr_assert_eq(cudaMemcpy(d, h, cap, cudaMemcpyHostToDevice), cudaSuccess);
    cr_assert_eq(cudaStreamCreate(&s), cudaSuccess);
    memset(want, 0, sizeof(want));
    /* Accumulators in runs of segments (as messages are), some segments empty. */
    for (uint32_t i = 0; i < NSEG; i++) {
        rand_seg(&hs[i], &ds[i], h, d, cap, i * NACC / NSEG);
        if (i % 50 == 7)
            hs[i].bytes = ds[i].bytes = 0;
        rf_wdigest_add_seg(&k, &hs[i], &want[hs[i].acc]);
        total += hs[i].bytes;
    }
    cr_assert_eq(rf_wdigest_cuda_plan_new(&k, ds, NSEG, NACC, &pl, &err), 0, "%s", err.msg);
    /* Twice: the whole in one launch, then in three ranges on accumulator boundaries. */
    for (int pass = 0; pass < 2; pass++) {
        static const uint32_t cuts[4] = {0, 100, 300, NSEG};

        cr_assert_eq(rf_wdigest_cuda_zero(pl, 0, NACC, s, &err), 0, "%s", err.msg);
        for (int c = 0; c < (pass ? 3 : 1); c++) {
            uint32_t a = pass ? cuts[c] : 0, b = pass ? cuts[c + 1] : NSEG;

            cr_assert_eq(rf_wdigest_cuda_run(pl, a, b - a, s, &err), 0, "%s", err.msg);
        }
        cr_assert_eq(rf_wdigest_cuda_fetch(pl, 0, NACC, s, &err), 0, "%s", err.msg);
        cr_assert_eq(cudaStreamSynchronize(s), cudaSuccess);
        for (uint32_t a = 0; a < NACC; a++) {
            rf_wdigest_acc got;

            rf_wdigest_cuda_result(pl, a, &got);
            cr_assert(got.lane[0] == want[a].lane[0] && got.lane[1] == want[a].lane[1],
                      "pass %d accumulator %u: kernel %llu %llu, host %llu %llu", pass, a,
                      (unsigned long long)got.lane[0], (unsigned long long)got.lane[1],
                      (unsigned long long)want[a].lane[0], (unsigned long long)want[a].lane[1]);
        }
    }
    printf("kernel = host on %d segments, %llu bytes, %d accumulators\n", NSEG,
           (unsigned long long)total, NACC);
    /* A malformed segment is refused, naming it. */
    ds[3].run = 0;
    cr_assert_eq(rf_wdigest_cuda_plan_new(&k, ds, NSEG, NACC, &(rf_wdigest_cuda_plan *){0},
                                          &err), -EINVAL);
    cr_assert(strstr(err.msg, "segment 3") != NULL, "%s", err.msg);
    rf_wdigest_cuda_plan_free(pl);
    cudaStreamDestroy(s);
    cudaFree(d);
    free(h);
    free(hs);
    free(ds);
}

/* One byte changed in device memory changes the kernel's lanes of the segment over it. */
Test(wdigest_cuda, a_changed_byte_changes_the_lanes)
{
    const uint64_t n = 5u << 20;
    uint8_t seed[RF_WDIGEST_SEED_BYTES] = {7}, *d = NULL, x;
    rf_wdigest_cuda_plan *pl = NULL;
    rf_wdigest_key k;
    rf_wdigest_seg sg;
    rf_wdigest_acc a, b;
    rf_err err = {0};

    NEED_GPU();
    rf_wdigest_key_derive(seed, &k);
    cr_assert_eq(cudaMalloc((void **)&d, n), cudaSuccess);
    cr_assert_eq(cudaMemset(d, 0x5a, n), cudaSuccess);
    rf_wdigest_seg_walk(&sg, d, 0, n, n, 0, NULL, NULL, 0);
    cr_assert_eq(rf_wdigest_cuda_plan_new(&k, &sg, 1, 1, &pl, &err), 0, "%s", err.msg);
    for (int v = 0; v < 2; v++) {
        cr_assert_eq(rf_wdigest_cuda_zero(pl, 0, 1, 0, &err), 0, "%s", err.msg);
        cr_assert_eq(rf_wdigest_cuda_run(pl, 0, 1, 0, &err), 0, "%s", err.msg);
        cr_assert_eq(rf_wdigest_cuda_fetch(pl, 0, 1, 0, &err), 0, "%s", err.msg);
        cr_assert_eq(cudaStreamSynchronize(0), cudaSuccess);
        rf_wdigest_cuda_result(pl, 0, v ? &b : &a);
        x = 0x5b;
        cr_assert_eq(cudaMemcpy(d + 3333333, &x, 1, cudaMemcpyHostToDevice), cudaSuccess);
    }
    cr_assert(a.lane[0] != b.lane[0] && a.lane[1] != b.lane[1]);
    rf_wdigest_cuda_plan_free(pl);
    cudaFree(d);
}

#else

Test(wdigest_cuda, built_without_cuda)
{
    printf("skipped: no CUDA device\n");
    cr_skip_test("no CUDA device (built without CUDA)");
}

#endif
