/* fuzz/fuzz_xfer_tcp.c - what a tcp data connection's peer controls, without sockets: a hello
 * answering the acceptor's nonce (common/data/xfer_tcp.h rf_xfer_tcp__hello_check) and a run of frame
 * headers against a job (rf_xfer_tcp__accept_headers). Checked against a model written here
 * from the protocol's description: a hello passes exactly when its magic, protocol, from and to
 * are right and its HMAC proves the key; an accepted header names a message this daemon expects
 * from that peer, once, of its planned size, in one of the two rounds that may be open; a
 * header that is right on every count and in the lowest unfinished round is never refused; a
 * refusal names the peer.
 * Input: [flags][self][npeers][nonce 32][hello 80][nrounds][nmsgs][peer][budget 2]
 *        [per message: round, flags, bytes 2][per header: fixes, header 24]...
 * flags bit 0 signs the hello with the key (the fuzzer cannot forge HMACs), bit 1 writes the
 * right magic and protocol; a header's fixes write its right magic (bit 0), version (bit 1), a
 * seq of a receive from the peer (bit 2, message chosen by the seq's low byte) and its size
 * (bit 3), so that inputs reach the later checks. */
#include <errno.h>
#include <sodium.h>

#include "fuzz.h"
#include "xfer_tcp.h"

#define MAX_MSGS 12
#define MAX_BYTES 4096
#define VERSION 7
#define HDR RF_XFER_TCP__HDR_LEN
#define HELLO RF_XFER_TCP__HELLO_LEN

static const uint8_t key[32] = {0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a,
                                0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a,
                                0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a,
                                0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a};

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t le64(const uint8_t *p)
{
    return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32;
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    put32(p, (uint32_t)v);
    put32(p + 4, (uint32_t)(v >> 32));
}

/* The hello's proof as the protocol states it: HMAC-SHA256(key, "refit-data-v3 hello" NUL ||
 * acceptor's nonce || hello body). */
static void hello_mac(const uint8_t *nonce, const uint8_t *hello, uint8_t out[32])
{
    static const char tag[] = "refit-data-v3 hello";
    crypto_auth_hmacsha256_state st;

    crypto_auth_hmacsha256_init(&st, key, sizeof(key));
    crypto_auth_hmacsha256_update(&st, (const uint8_t *)tag, sizeof(tag));
    crypto_auth_hmacsha256_update(&st, nonce, RF_XFER_TCP__NONCE_LEN);
    crypto_auth_hmacsha256_update(&st, hello, RF_XFER_TCP__HELLO_BODY);
    crypto_auth_hmacsha256_final(&st, out);
}

static void fuzz_hello(uint8_t flags, uint32_t self, uint32_t npeers, const uint8_t *nonce,
                       const uint8_t *in)
{
    uint8_t hello[HELLO], mac[32];
    uint32_t from = 0;
    int rc, want;

    memcpy(hello, in, HELLO);
    if (flags & 2) {
        put32(hello, 0x48584652u); /* "RFXH" */
        put32(hello + 4, 3);
    }
    if (flags & 1)
        hello_mac(nonce, hello, hello + RF_XFER_TCP__HELLO_BODY);
    hello_mac(nonce, hello, mac);
    if (le32(hello) != 0x48584652u || le32(hello + 4) != 3)
        want = -EPROTO;
    else if (le32(hello + 8) >= npeers || le32(hello + 12) != self)
        want = -ENXIO;
    else
        want = memcmp(mac, hello + RF_XFER_TCP__HELLO_BODY, 32) == 0 ? 0 : -EACCES;
    rc = rf_xfer_tcp__hello_check(key, sizeof(key), self, npeers, nonce, hello, &from);
    if (getenv("FUZZ_LOG") != NULL)
        fprintf(stderr, "fuzz_xfer_tcp: hello to peer %u of %u: %d\n", self, npeers, rc);
    if (rc != want || (rc != -EPROTO && from != le32(hello + 8))) {
        fprintf(stderr, "hello check said %d (from %u), the protocol says %d\n", rc, from, want);
        abort();
    }
}

typedef struct jobdesc {
    rf_xfer_job job;
    rf_xfer_msg msgs[MAX_MSGS];
    rf_xfer_item items[MAX_MSGS];
} jobdesc;

/* A job of up to MAX_MSGS one-item messages over buf, as the input describes it; false when
 * rf_xfer_job_check refuses it (a transport never runs such a job). */
static bool make_job(jobdesc *d, const uint8_t *in, size_t size, uint32_t npeers, uint8_t *buf,
                     size_t *used)
{
    uint32_t nrounds = 1 + in[0] % 4, nmsgs = in[1] % (MAX_MSGS + 1), r = 0;
    rf_err err;

    memset(d, 0, sizeof(*d));
    *used = 5 + 4 * (size_t)nmsgs;
    if (size < *used)
        return false;
    for (uint32_t i = 0; i < nmsgs; i++) {
        const uint8_t *m = in + 5 + 4 * i;
        uint64_t bytes = 1 + (((uint32_t)m[2] | (uint32_t)m[3] << 8) % MAX_BYTES);
        rf_xfer_item *it = &d->items[i];

        /* Rounds never go down, so that most jobs pass the check. */
        r += m[0] % 2;
        it->base = buf;
        it->ndim = 1;
        it->esize = 1;
        rf_box_full(&it->piece.box, 1, (int64_t[]){MAX_BYTES});
        it->piece.strides[0] = 1;
        it->box.start[0] = 0;
        it->box.extent[0] = (int64_t)bytes;
        it->bytes = bytes;
        d->msgs[i] = (rf_xfer_msg){.seq = 3 * i + (m[1] >> 6), .round = r % nrounds,
                                   .kind = m[1] & 1 ? RF_PLAN_PACKED : RF_PLAN_DIRECT,
                                   .send = (m[1] & 2) != 0, .peer = (m[1] >> 2) % npeers,
                                   .bytes = bytes, .nitems = 1, .items = it};
    }
    d->job = (rf_xfer_job){.version = VERSION, .nrounds = nrounds, .nmsgs = nmsgs,
                           .msgs = d->msgs, .timeout_s = 1,
                           .staging_bytes = (uint64_t)(in[3] | in[4] << 8) * 4};
    return rf_xfer_job_check(&d->job, npeers, &err) == 0;
}

/* The lowest round with a message not done, nrounds when none. */
static uint32_t lowest_open(const rf_xfer_job *job, const bool *done)
{
    uint32_t lo = job->nrounds;

    for (uint32_t i = 0; i < job->nmsgs; i++)
        if (!done[i] && job->msgs[i].round < lo)
            lo = job->msgs[i].round;
    return lo;
}

static void fuzz_headers(jobdesc *d, uint32_t npeers, uint32_t peer, const uint8_t *in,
                         size_t size)
{
    static uint8_t hdrs[64 * HDR];
    const rf_xfer_job *job = &d->job;
    size_t n = 0, accepted;
    bool done[MAX_MSGS] = {false};
    int recv_idx[MAX_MSGS], nrecv = 0;
    rf_xfer_result res;
    char what[32];

    for (uint32_t i = 0; i < job->nmsgs; i++)
        if (!job->msgs[i].send && job->msgs[i].peer == peer)
            recv_idx[nrecv++] = (int)i;
    for (; size >= 1 + HDR && n < 64; in += 1 + HDR, size -= 1 + HDR, n++) {
        uint8_t *h = hdrs + n * HDR, fix = in[0];

        memcpy(h, in + 1, HDR);
        if (fix & 1)
            put32(h, 0x46584652u); /* "RFXF" */
        if (fix & 2)
            put64(h + 8, VERSION);
        if ((fix & 4) && nrecv > 0)
            put32(h + 4, job->msgs[recv_idx[h[4] % nrecv]].seq);
        if (fix & 8) {
            for (int k = 0; k < nrecv; k++)
                if (job->msgs[recv_idx[k]].seq == le32(h + 4))
                    put64(h + 16, job->msgs[recv_idx[k]].bytes);
        }
    }
    accepted = rf_xfer_tcp__accept_headers(job, npeers, peer, hdrs, n, &res);
    if (getenv("FUZZ_LOG") != NULL)
        fprintf(stderr, "fuzz_xfer_tcp: %zu of %zu headers from peer %u accepted%s%s\n",
                accepted, n, peer, res.code < 0 ? ": " : "", res.code < 0 ? res.error : "");
    if (accepted > n || (accepted < n) != (res.code < 0)) {
        fprintf(stderr, "%zu of %zu headers accepted, code %d\n", accepted, n, res.code);
        abort();
    }
    snprintf(what, sizeof(what), "peer %u", peer);
    if (res.code < 0 && strstr(res.error, what) == NULL) {
        fprintf(stderr, "a refusal that does not name %s: %s\n", what, res.error);
        abort();
    }
    /* Replays the model over the accepted headers, then the refused one. */
    for (size_t k = 0; k <= accepted && k < n; k++) {
        const uint8_t *h = hdrs + k * HDR;
        uint32_t seq = le32(h + 4), lo = lowest_open(job, done);
        int i = -1;
        bool ok;

        for (int r = 0; r < nrecv; r++)
            if (job->msgs[recv_idx[r]].seq == seq)
                i = recv_idx[r];
        ok = le32(h) == 0x46584652u && le64(h + 8) == VERSION && i >= 0 && !done[i] &&
             le64(h + 16) == job->msgs[i].bytes;
        if (k < accepted) {
            if (!ok || job->msgs[i].round >= lo + 2) {
                fprintf(stderr, "header %zu (seq %u) accepted against the protocol\n", k, seq);
                abort();
            }
            done[i] = true;
        } else if (ok && job->msgs[i].round == lo) {
            fprintf(stderr, "header %zu (seq %u, round %u, the lowest open) refused: %s\n", k,
                    seq, lo, res.error);
            abort();
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static uint8_t buf[MAX_BYTES];
    uint32_t npeers, self, peer;
    size_t used;
    jobdesc d;

    fuzz_quiet();
    if (sodium_init() < 0)
        abort();
    if (size < 3 + RF_XFER_TCP__NONCE_LEN + HELLO + 5)
        return 0;
    npeers = 1 + data[2] % 4;
    self = data[1] % npeers;
    fuzz_hello(data[0], self, npeers, data + 3, data + 3 + RF_XFER_TCP__NONCE_LEN);
    data += 3 + RF_XFER_TCP__NONCE_LEN + HELLO;
    size -= 3 + RF_XFER_TCP__NONCE_LEN + HELLO;
    peer = data[2] % npeers;
    if (!make_job(&d, data, size, npeers, buf, &used))
        return 0;
    fuzz_headers(&d, npeers, peer, data + used, size - used);
    return 0;
}
