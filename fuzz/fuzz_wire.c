/* fuzz/fuzz_wire.c - the control channel's frame reader (common/control/wire.h rf_wire_reader) on any
 * byte stream, fed in pieces of varying size: frames must come out the same whatever the
 * split, never longer than the maximum, and every complete frame is decoded as both kinds of
 * message the daemons read (refit.Envelope, refit.rpc.Request).
 * Input: [max selector][split seed] then the stream. */
#include <errno.h>

#include "fuzz.h"
#include "refit.pb-c.h"
#include "rpc.pb-c.h"
#include "wire.h"

#define MAX_FRAMES 4096

typedef struct frames {
    uint32_t max;
    uint32_t n;
    uint32_t len[MAX_FRAMES];
    uint64_t sum[MAX_FRAMES]; /* a cheap digest of each body, to compare the two passes */
} frames;

static int on_frame(void *ctx, const uint8_t *body, uint32_t len)
{
    frames *f = ctx;
    Refit__Envelope *env;
    Refit__Rpc__Request *req;
    uint64_t s = 1469598103934665603ull;
    uint32_t i;

    if (body == NULL || len > f->max)
        abort(); /* the reader promised neither */
    for (i = 0; i < len; i++)
        s = (s ^ body[i]) * 1099511628211ull;
    if (f->n < MAX_FRAMES) {
        f->len[f->n] = len;
        f->sum[f->n] = s;
    }
    f->n++;
    env = refit__envelope__unpack(NULL, len, body);
    if (env != NULL)
        refit__envelope__free_unpacked(env, NULL);
    req = refit__rpc__request__unpack(NULL, len, body);
    if (req != NULL)
        refit__rpc__request__free_unpacked(req, NULL);
    return 0;
}

/* Feeds the stream to a fresh reader in pieces whose sizes follow seed (0: all at once). */
static int run(const uint8_t *data, size_t size, uint32_t max, uint8_t seed, frames *f)
{
    rf_wire_reader r;
    size_t off = 0;
    uint32_t step = seed;
    int rc = 0;

    memset(f, 0, sizeof(*f));
    rf_wire_reader_init(&r, max);
    f->max = r.max;
    while (off < size && rc == 0) {
        size_t n = size - off;

        if (seed != 0) {
            step = step * 1103515245u + 12345u;
            n = 1 + (step >> 16) % 7;
            if (step & 0x8000)
                n = 1 + (step >> 8) % 300;
            if (n > size - off)
                n = size - off;
        }
        rc = rf_wire_reader_feed(&r, data + off, n, on_frame, f);
        off += n;
    }
    rf_wire_reader_reset(&r);
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static frames a, b;
    uint32_t max;
    int ra, rb;
    uint32_t i;

    if (size < 2)
        return 0;
    /* Small maxima reach the size check; 0 is the daemons' default (64 MiB). */
    max = data[0] == 0 ? 0 : (uint32_t)data[0] * 8;
    ra = run(data + 2, size - 2, max, 0, &a);
    rb = run(data + 2, size - 2, max, data[1] | 1, &b);
    if (ra != rb || a.n != b.n) {
        fprintf(stderr, "fuzz_wire: whole stream gave %d and %u frames, pieces gave %d and %u\n",
                ra, a.n, rb, b.n);
        abort();
    }
    for (i = 0; i < a.n && i < MAX_FRAMES; i++)
        if (a.len[i] != b.len[i] || a.sum[i] != b.sum[i]) {
            fprintf(stderr, "fuzz_wire: frame %u differs between the two splits\n", i);
            abort();
        }
    if (ra != 0 && ra != -EMSGSIZE) {
        fprintf(stderr, "fuzz_wire: feed returned %d\n", ra);
        abort();
    }
    return 0;
}
