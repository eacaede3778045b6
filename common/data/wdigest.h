/* common/data/wdigest.h - the verification digest of payloads that lie in GPU memory: a keyed,
 * linear digest that any number of pieces of a payload, digested apart in any order (a kernel's
 * thread blocks, strided boxes run by run), add up to. The host implementation here is the
 * reference; wdigest_cuda.h computes the same lanes on the GPU.
 *
 * Definition. The key (rf_wdigest_key_derive) comes from a 32-byte seed: for each lane L in
 * {0, 1}, 256 word keys a[L][j] (uniform 32-bit) and a block-key seed; the block key c[L][b] is a
 * splitmix64-style mix of (that seed, b) reduced into [1, p), p = 2^61 - 1. The payload is a
 * sequence of little-endian 32-bit words v_w (w = payload offset / 4; bytes past the end count
 * as 0), cut into blocks of 256 words (1 KiB). Per block b, inner[L][b] = sum over its words of
 * a[L][w mod 256] * v_w, as an integer; lane[L] = sum over blocks of c[L][b] * inner[L][b], mod p.
 * A byte at payload offset o adds c[L][o / 1024] * a[L][(o / 4) mod 256] * (byte << 8 (o mod 4))
 * to lane[L], so the lanes of a payload are the sum mod p of the lanes of any split of it.
 * A message's term is BLAKE2b-256("refit-wdigest-v1" || seq (4 bytes LE) || bytes (8 LE) ||
 * lane0 || lane1 (8 LE each)), bytes being how many payload bytes were digested.
 *
 * Promise. For a difference between two payloads chosen without knowledge of the seed, the two
 * lanes agree with probability about 2^-64: a nonzero difference d in a block makes its inner
 * sums agree mod p with probability at most 2^-32 per lane (each a[L][j] uniform over 2^32
 * values, d_j invertible mod p), and nonzero block differences cancel in the sum over blocks
 * with probability about 2^-61 per lane. BLAKE2b over the payload (the tcp and host paths)
 * promises 2^-128 and needs no secret. The seed is derived from the cluster key and never
 * leaves the daemons and their in-process installers, so an engine cannot aim at a collision;
 * whoever holds the seed can. */
#ifndef RF_WDIGEST_H
#define RF_WDIGEST_H

#include <stdint.h>

#include "layout.h"

#define RF_WDIGEST_SEED_BYTES 32
#define RF_WDIGEST_TERM_BYTES 32
#define RF_WDIGEST_P ((1ull << 61) - 1)
#define RF_WDIGEST_BLOCK 1024u /* payload bytes per block */
#define RF_WDIGEST_WORDS 256u  /* words per block, and word keys per lane */

typedef struct rf_wdigest_key {
    uint32_t a[2][RF_WDIGEST_WORDS]; /* word keys */
    uint64_t bseed[2];               /* block-key seeds */
} rf_wdigest_key;

/* The two lanes of a payload (or of a part of one), each in [0, p). Zeroed: nothing yet. */
typedef struct rf_wdigest_acc {
    uint64_t lane[2];
} rf_wdigest_acc;

/* A part of a payload that lies in memory as runs: `bytes` payload bytes from payload offset
 * `off` on, taken in row-major order of the walk whose outer dims are ext/str (n of them,
 * outermost first, strides in bytes) around contiguous runs of `run` bytes starting at base:
 * the walk the copy kernels make (rf_copy_pair_flat, one side). bytes may stop short of the
 * walk's end (a sampled digest covers a prefix). n == 0 with run >= bytes is dense memory. */
typedef struct rf_wdigest_seg {
    const uint8_t *base;
    uint64_t off, bytes, run;
    int32_t n;
    uint32_t acc; /* which accumulator the part adds to (wdigest_cuda.h) */
    int64_t ext[RF_MAX_DIMS], str[RF_MAX_DIMS];
} rf_wdigest_seg;

/* The key of seed (BLAKE2b-512 keyed with the seed, in counter mode). */
void rf_wdigest_key_derive(const uint8_t seed[RF_WDIGEST_SEED_BYTES], rf_wdigest_key *k);
/* c[lane][b]: the block key of block b, in [1, p). */
uint64_t rf_wdigest_block_key(const rf_wdigest_key *k, int lane, uint64_t b);
/* Adds the terms of the n bytes at p, which are the payload's bytes from offset payload_off on,
 * to acc. */
void rf_wdigest_add(const rf_wdigest_key *k, uint64_t payload_off, const uint8_t *p, uint64_t n,
                    rf_wdigest_acc *acc);
/* Adds the terms of segment s's bytes (in host memory) to acc. */
void rf_wdigest_add_seg(const rf_wdigest_key *k, const rf_wdigest_seg *s, rf_wdigest_acc *acc);
/* acc += part, lane by lane mod p. */
void rf_wdigest_merge(rf_wdigest_acc *acc, const rf_wdigest_acc *part);
/* The lanes of a 128-bit sum of lane values (lo + 2^64 hi per lane), reduced mod p. */
void rf_wdigest_acc_from128(const uint64_t lo[2], const uint64_t hi[2], rf_wdigest_acc *out);
/* The term of message seq whose first `bytes` payload bytes gave acc. */
void rf_wdigest_term(const rf_wdigest_acc *acc, uint32_t seq, uint64_t bytes,
                     uint8_t out[RF_WDIGEST_TERM_BYTES]);
/* A segment of one side of a flattened pair walk (copy.h's rf_copy_pair_flat, passed as its
 * fields so that this layer needs no copy.h): base is that side's first byte. Dims this side
 * holds back to back are merged, into the run where they can be. */
void rf_wdigest_seg_walk(rf_wdigest_seg *s, const uint8_t *base, uint64_t off, uint64_t bytes,
                         uint64_t run, int n, const int64_t *ext, const int64_t *str,
                         uint32_t acc);

/* The modular arithmetic both implementations share (wdigest_cuda.cu includes these too). */
#if defined(__CUDACC__)
#define RF_WD_FN static __host__ __device__ __forceinline__
#else
#define RF_WD_FN static inline
#endif

/* x mod p for any 64-bit x, not canonical: < 2^61 + 7. */
RF_WD_FN uint64_t rf_wd_fold(uint64_t x)
{
    return (x & RF_WDIGEST_P) + (x >> 61);
}

/* Canonical: [0, p), for x < 2p. */
RF_WD_FN uint64_t rf_wd_canon(uint64_t x)
{
    x = rf_wd_fold(x);
    return x >= RF_WDIGEST_P ? x - RF_WDIGEST_P : x;
}

/* (a + b) mod p, not canonical, for a, b < 2^62. */
RF_WD_FN uint64_t rf_wd_add(uint64_t a, uint64_t b)
{
    return rf_wd_fold(a + b);
}

/* The 128-bit lo + 2^64 hi, mod p, not canonical (2^64 = 8 mod p); hi < 2^58. */
RF_WD_FN uint64_t rf_wd_fold128(uint64_t lo, uint64_t hi)
{
    return rf_wd_fold(rf_wd_fold(lo) + (hi << 3));
}

/* (a * b) mod p, not canonical, for a, b < 2^62. */
RF_WD_FN uint64_t rf_wd_mul(uint64_t a, uint64_t b)
{
#if defined(__CUDA_ARCH__)
    uint64_t lo = a * b, hi = __umul64hi(a, b);
#else
    unsigned __int128 x = (unsigned __int128)a * b;
    uint64_t lo = (uint64_t)x, hi = (uint64_t)(x >> 64);
#endif
    /* hi < 2^60: hi * 8 < 2^63, and the sum stays inside 64 bits. */
    return rf_wd_fold(rf_wd_fold(lo) + (hi << 3));
}

/* The splitmix64 finaliser of (seed, b): the block key's source. */
RF_WD_FN uint64_t rf_wd_mix(uint64_t seed, uint64_t b)
{
    uint64_t z = seed + (b + 1) * 0x9e3779b97f4a7c15ull;

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    z &= RF_WDIGEST_P;
    return z == 0 || z == RF_WDIGEST_P ? 1 : z;
}

#endif
