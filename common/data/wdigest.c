/* common/data/wdigest.c - the reference implementation of the linear payload digest (wdigest.h):
 * key derivation, lanes of bytes in host memory, and the message term. */
#include "wdigest.h"

#include <assert.h>
#include <string.h>

#include <sodium.h>

static void put_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

void rf_wdigest_key_derive(const uint8_t seed[RF_WDIGEST_SEED_BYTES], rf_wdigest_key *k)
{
    static const char label[] = "refit-wdigest-v1 keys";
    /* Per lane 1024 bytes of word keys and 8 of block-key seed, in 64-byte outputs. */
    uint8_t stream[33 * 64], msg[sizeof(label) - 1 + 4];
    const uint8_t *p = stream;

    memcpy(msg, label, sizeof(label) - 1);
    for (uint32_t i = 0; i < 33; i++) {
        for (int b = 0; b < 4; b++)
            msg[sizeof(label) - 1 + b] = (uint8_t)(i >> (8 * b));
        crypto_generichash(stream + 64 * i, 64, msg, sizeof(msg), seed, RF_WDIGEST_SEED_BYTES);
    }
    for (int L = 0; L < 2; L++) {
        for (uint32_t j = 0; j < RF_WDIGEST_WORDS; j++, p += 4)
            k->a[L][j] = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                         (uint32_t)p[3] << 24;
        k->bseed[L] = 0;
        for (int b = 0; b < 8; b++)
            k->bseed[L] |= (uint64_t)p[b] << (8 * b);
        p += 8;
    }
    sodium_memzero(stream, sizeof(stream));
}

uint64_t rf_wdigest_block_key(const rf_wdigest_key *k, int lane, uint64_t b)
{
    return rf_wd_mix(k->bseed[lane], b);
}

void rf_wdigest_add(const rf_wdigest_key *k, uint64_t payload_off, const uint8_t *p, uint64_t n,
                    rf_wdigest_acc *acc)
{
    uint64_t o = payload_off, end = payload_off + n;

    while (o < end) {
        uint64_t b = o / RF_WDIGEST_BLOCK;
        uint64_t bend = (b + 1) * RF_WDIGEST_BLOCK < end ? (b + 1) * RF_WDIGEST_BLOCK : end;
        unsigned __int128 in[2] = {0, 0};

        /* Word by word: the bytes of [o, bend) that a word holds, the others 0. */
        while (o < bend) {
            uint64_t w = o / 4, wend = (w + 1) * 4 < bend ? (w + 1) * 4 : bend;
            uint32_t v = 0, j = (uint32_t)(w % RF_WDIGEST_WORDS);

            for (; o < wend; o++)
                v |= (uint32_t)p[o - payload_off] << (8 * (o % 4));
            in[0] += (uint64_t)k->a[0][j] * v;
            in[1] += (uint64_t)k->a[1][j] * v;
        }
        for (int L = 0; L < 2; L++) {
            uint64_t x = rf_wd_fold128((uint64_t)in[L], (uint64_t)(in[L] >> 64));

            acc->lane[L] = rf_wd_canon(rf_wd_add(acc->lane[L],
                                                 rf_wd_mul(rf_wd_canon(x),
                                                           rf_wdigest_block_key(k, L, b))));
        }
    }
}

/* The segment's walk from run index r on: where that run starts. */
static const uint8_t *run_at(const rf_wdigest_seg *s, uint64_t r)
{
    const uint8_t *q = s->base;

    for (int d = s->n - 1; d >= 0; d--) {
        q += (int64_t)(r % (uint64_t)s->ext[d]) * s->str[d];
        r /= (uint64_t)s->ext[d];
    }
    return q;
}

void rf_wdigest_add_seg(const rf_wdigest_key *k, const rf_wdigest_seg *s, rf_wdigest_acc *acc)
{
    for (uint64_t r = 0, done = 0; done < s->bytes; r++) {
        uint64_t n = s->bytes - done < s->run ? s->bytes - done : s->run;

        rf_wdigest_add(k, s->off + done, run_at(s, r), n, acc);
        done += n;
    }
}

void rf_wdigest_merge(rf_wdigest_acc *acc, const rf_wdigest_acc *part)
{
    for (int L = 0; L < 2; L++)
        acc->lane[L] = rf_wd_canon(rf_wd_add(acc->lane[L], part->lane[L]));
}

void rf_wdigest_acc_from128(const uint64_t lo[2], const uint64_t hi[2], rf_wdigest_acc *out)
{
    for (int L = 0; L < 2; L++) {
        /* hi counts carries: 2^64 hi = 8 hi mod p, with hi taken mod p first. */
        uint64_t h = rf_wd_mul(rf_wd_canon(rf_wd_fold(hi[L])), 8);

        out->lane[L] = rf_wd_canon(rf_wd_add(rf_wd_canon(lo[L]), h));
    }
}

void rf_wdigest_term(const rf_wdigest_acc *acc, uint32_t seq, uint64_t bytes,
                     uint8_t out[RF_WDIGEST_TERM_BYTES])
{
    static const char label[] = "refit-wdigest-v1";
    uint8_t buf[sizeof(label) - 1 + 4 + 8 + 16], *p = buf + sizeof(label) - 1;

    memcpy(buf, label, sizeof(label) - 1);
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(seq >> (8 * i));
    put_le64(p + 4, bytes);
    put_le64(p + 12, acc->lane[0]);
    put_le64(p + 20, acc->lane[1]);
    crypto_generichash(out, RF_WDIGEST_TERM_BYTES, buf, sizeof(buf), NULL, 0);
}

void rf_wdigest_seg_walk(rf_wdigest_seg *s, const uint8_t *base, uint64_t off, uint64_t bytes,
                         uint64_t run, int n, const int64_t *ext, const int64_t *str,
                         uint32_t acc)
{
    assert(n >= 0 && n <= RF_MAX_DIMS && run > 0);
    memset(s, 0, sizeof(*s));
    s->base = base;
    s->off = off;
    s->bytes = bytes;
    s->run = run;
    s->acc = acc;
    /* This side's own contiguity (a pair's walk merges only what both sides hold back to
     * back): dims of extent 1 dropped, a dim joined to the one inside it, and the innermost
     * ones to the run, where this memory holds them back to back. Row-major order, and so the
     * payload order, stays. */
    for (int d = 0; d < n; d++) {
        if (ext[d] == 1)
            continue;
        if (s->n > 0 && s->str[s->n - 1] == str[d] * ext[d]) {
            s->ext[s->n - 1] *= ext[d];
            s->str[s->n - 1] = str[d];
            continue;
        }
        s->ext[s->n] = ext[d];
        s->str[s->n] = str[d];
        s->n++;
    }
    while (s->n > 0 && s->str[s->n - 1] == (int64_t)s->run) {
        s->run *= (uint64_t)s->ext[s->n - 1];
        s->n--;
    }
}
