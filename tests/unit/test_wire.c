/* tests/unit/test_wire.c - the frame reader at every split, limits, garbage, packing, and the
 * libuv read/write glue over a real TCP connection on 127.0.0.1. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "refit.pb-c.h"
#include "wire.h"

#define MAXF 64

struct got {
    int n;
    uint32_t len[MAXF];
    uint8_t *body[MAXF];
    int stop_at;    /* return -ECANCELED on this frame (1-based); 0 never */
};

static int collect(void *ctx, const uint8_t *body, uint32_t len)
{
    struct got *g = ctx;

    cr_assert_not_null(body);
    cr_assert_lt(g->n, MAXF);
    g->len[g->n] = len;
    g->body[g->n] = malloc(len ? len : 1);
    memcpy(g->body[g->n], body, len);
    g->n++;
    if (g->stop_at && g->n == g->stop_at)
        return -ECANCELED;
    return 0;
}

static void got_free(struct got *g)
{
    for (int i = 0; i < g->n; i++)
        free(g->body[i]);
    memset(g, 0, sizeof(*g));
}

/* Appends one raw frame with the given body to buf at *off. */
static void put_frame(uint8_t *buf, size_t *off, const uint8_t *body, uint32_t len)
{
    uint32_t be = htonl(len);

    memcpy(buf + *off, &be, 4);
    memcpy(buf + *off + 4, body, len);
    *off += 4 + len;
}

/* Three frames: 5 bytes, empty, 300 bytes; their bodies are distinct patterns. */
static size_t sample_stream(uint8_t *buf, uint8_t bodies[3][300], uint32_t lens[3])
{
    size_t off = 0;

    lens[0] = 5;
    lens[1] = 0;
    lens[2] = 300;
    for (int f = 0; f < 3; f++) {
        for (uint32_t i = 0; i < lens[f]; i++)
            bodies[f][i] = (uint8_t)(i * 7 + f * 31 + 1);
        put_frame(buf, &off, bodies[f], lens[f]);
    }
    return off;
}

static void check_sample(struct got *g, uint8_t bodies[3][300], uint32_t lens[3])
{
    cr_assert_eq(g->n, 3);
    for (int f = 0; f < 3; f++) {
        cr_assert_eq(g->len[f], lens[f], "frame %d length", f);
        cr_assert_eq(memcmp(g->body[f], bodies[f], lens[f]), 0, "frame %d body", f);
    }
}

Test(wire, split_at_every_byte_boundary)
{
    uint8_t buf[1024], bodies[3][300];
    uint32_t lens[3];
    size_t total = sample_stream(buf, bodies, lens);

    for (size_t cut = 0; cut <= total; cut++) {
        rf_wire_reader r;
        struct got g = {0};

        rf_wire_reader_init(&r, 1000);
        cr_assert_eq(rf_wire_reader_feed(&r, buf, cut, collect, &g), 0);
        cr_assert_eq(rf_wire_reader_feed(&r, buf + cut, total - cut, collect, &g), 0);
        check_sample(&g, bodies, lens);
        cr_assert_eq(r.hdr_have, 0);
        cr_assert_null(r.body);
        got_free(&g);
        rf_wire_reader_reset(&r);
    }
}

Test(wire, one_byte_at_a_time)
{
    uint8_t buf[1024], bodies[3][300];
    uint32_t lens[3];
    size_t total = sample_stream(buf, bodies, lens);
    rf_wire_reader r;
    struct got g = {0};

    rf_wire_reader_init(&r, 0);
    cr_assert_eq(r.max, RF_WIRE_MAX_DEFAULT);
    for (size_t i = 0; i < total; i++)
        cr_assert_eq(rf_wire_reader_feed(&r, buf + i, 1, collect, &g), 0);
    check_sample(&g, bodies, lens);
    got_free(&g);
    rf_wire_reader_reset(&r);
}

Test(wire, several_frames_in_one_feed_and_zero_length)
{
    uint8_t buf[4096], body[16] = "abcdefghijklmno";
    size_t off = 0;
    rf_wire_reader r;
    struct got g = {0};

    for (int i = 0; i < 10; i++)
        put_frame(buf, &off, body, (uint32_t)(i % 3 == 0 ? 0 : i));
    rf_wire_reader_init(&r, 16);
    cr_assert_eq(rf_wire_reader_feed(&r, buf, off, collect, &g), 0);
    cr_assert_eq(g.n, 10);
    for (int i = 0; i < 10; i++) {
        cr_assert_eq(g.len[i], (uint32_t)(i % 3 == 0 ? 0 : i));
        cr_assert_eq(memcmp(g.body[i], body, g.len[i]), 0);
    }
    got_free(&g);
    rf_wire_reader_reset(&r);
}

Test(wire, frame_of_exactly_max_is_accepted)
{
    uint8_t buf[64], body[16] = {0};
    size_t off = 0;
    rf_wire_reader r;
    struct got g = {0};

    put_frame(buf, &off, body, 16);
    rf_wire_reader_init(&r, 16);
    cr_assert_eq(rf_wire_reader_feed(&r, buf, off, collect, &g), 0);
    cr_assert_eq(g.n, 1);
    got_free(&g);
}

/* The header alone must be enough to refuse: no body bytes follow, and nothing is allocated. */
Test(wire, oversized_length_rejected_before_allocation)
{
    static const uint8_t huge[4] = {0xff, 0xff, 0xff, 0xf0};
    static const uint8_t one_over[4] = {0, 0, 0x04, 0x01};
    rf_wire_reader r;
    struct got g = {0};

    rf_wire_reader_init(&r, 0);
    cr_assert_eq(rf_wire_reader_feed(&r, huge, 4, collect, &g), -EMSGSIZE);
    cr_assert_null(r.body);
    cr_assert_eq(g.n, 0);

    rf_wire_reader_init(&r, 1024);
    cr_assert_eq(rf_wire_reader_feed(&r, one_over, 2, collect, &g), 0);
    cr_assert_eq(rf_wire_reader_feed(&r, one_over + 2, 2, collect, &g), -EMSGSIZE);
    cr_assert_null(r.body);
    cr_assert_eq(g.n, 0);
}

Test(wire, garbage_text_is_an_oversized_frame)
{
    static const char junk[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    rf_wire_reader r;
    struct got g = {0};

    rf_wire_reader_init(&r, 0);
    cr_assert_eq(rf_wire_reader_feed(&r, (const uint8_t *)junk, sizeof(junk) - 1, collect, &g),
                 -EMSGSIZE);
    cr_assert_eq(g.n, 0);
}

/* Random bytes either frame into bodies within max (which then fail or pass unpacking, never
 * crash) or stop with -EMSGSIZE; a partial body is released by reset. */
Test(wire, random_garbage_never_exceeds_max)
{
    uint8_t junk[4096];
    unsigned seed = 12345;
    int decoded = 0, refused = 0;

    for (int round = 0; round < 200; round++) {
        rf_wire_reader r;
        struct got g = {0};
        int rc;

        for (size_t i = 0; i < sizeof(junk); i++)
            junk[i] = (uint8_t)(rand_r(&seed) >> 7);
        /* Small first bytes make some lengths fit, so frames really get decoded. */
        junk[0] = 0;
        junk[1] = 0;
        rf_wire_reader_init(&r, 2048);
        rc = rf_wire_reader_feed(&r, junk, sizeof(junk), collect, &g);
        cr_assert(rc == 0 || rc == -EMSGSIZE, "rc %d", rc);
        decoded += g.n;
        refused += rc == -EMSGSIZE;
        for (int i = 0; i < g.n; i++) {
            Refit__Envelope *e;

            cr_assert_leq(g.len[i], 2048);
            e = refit__envelope__unpack(NULL, g.len[i], g.body[i]);
            if (e)
                refit__envelope__free_unpacked(e, NULL);
        }
        got_free(&g);
        rf_wire_reader_reset(&r);
        cr_assert_null(r.body);
    }
    /* Both outcomes were exercised. */
    cr_assert_gt(decoded, 0);
    cr_assert_gt(refused, 0);
}

Test(wire, negative_from_callback_stops_and_is_returned)
{
    uint8_t buf[1024], bodies[3][300];
    uint32_t lens[3];
    size_t total = sample_stream(buf, bodies, lens);
    rf_wire_reader r;
    struct got g = {0};

    /* Once with the third frame split (collected in the reader's own buffer), once whole. */
    g.stop_at = 3;
    rf_wire_reader_init(&r, 1000);
    cr_assert_eq(rf_wire_reader_feed(&r, buf, total - 10, collect, &g), 0);
    cr_assert_eq(rf_wire_reader_feed(&r, buf + total - 10, 10, collect, &g), -ECANCELED);
    cr_assert_null(r.body);
    got_free(&g);

    g.stop_at = 1;
    rf_wire_reader_init(&r, 1000);
    cr_assert_eq(rf_wire_reader_feed(&r, buf, total, collect, &g), -ECANCELED);
    cr_assert_eq(g.n, 1);
    got_free(&g);
}

Test(wire, reset_frees_partial_body)
{
    uint8_t buf[1024], bodies[3][300];
    uint32_t lens[3];
    size_t total = sample_stream(buf, bodies, lens);
    rf_wire_reader r;
    struct got g = {0};

    rf_wire_reader_init(&r, 1000);
    cr_assert_eq(rf_wire_reader_feed(&r, buf, total - 1, collect, &g), 0);
    cr_assert_not_null(r.body);
    rf_wire_reader_reset(&r);
    cr_assert_null(r.body);
    cr_assert_eq(r.hdr_have, 0);
    got_free(&g);
    /* A fresh stream works after reset. */
    cr_assert_eq(rf_wire_reader_feed(&r, buf, total, collect, &g), 0);
    check_sample(&g, bodies, lens);
    got_free(&g);
}

/* The limit can change between frames, from on_frame itself: a connection takes small frames
 * until it is authenticated and large ones after, in the same stream and even the same feed. */
struct grow {
    struct got g;
    rf_wire_reader *r;
    uint32_t new_max;
};

static int collect_then_set_max(void *ctx, const uint8_t *body, uint32_t len)
{
    struct grow *gr = ctx;
    int rc = collect(&gr->g, body, len);

    if (gr->g.n == 1)
        rf_wire_reader_set_max(gr->r, gr->new_max);
    return rc;
}

Test(wire, set_max_from_on_frame_applies_to_the_next_frame)
{
    uint8_t buf[1024], small[8] = {1, 2, 3, 4, 5, 6, 7, 8}, large[500];
    size_t off = 0;
    rf_wire_reader r;
    struct grow gr = {.r = &r, .new_max = 512};

    memset(large, 0x5a, sizeof(large));
    put_frame(buf, &off, small, sizeof(small));
    put_frame(buf, &off, large, sizeof(large));
    /* Raised after the first frame: the second, over the old limit, passes. */
    rf_wire_reader_init(&r, 16);
    cr_assert_eq(rf_wire_reader_feed(&r, buf, off, collect_then_set_max, &gr), 0);
    cr_assert_eq(gr.g.n, 2);
    cr_assert_eq(gr.g.len[1], 500);
    cr_assert_eq(memcmp(gr.g.body[1], large, 500), 0);
    got_free(&gr.g);
    /* Without the change the same stream stops at the second header, nothing allocated. */
    rf_wire_reader_init(&r, 16);
    cr_assert_eq(rf_wire_reader_feed(&r, buf, off, collect, &gr.g), -EMSGSIZE);
    cr_assert_eq(gr.g.n, 1);
    cr_assert_eq(r.body_len, 500);
    cr_assert_null(r.body);
    got_free(&gr.g);
    /* Lowered after the first frame, fed one byte at a time: refused at the header. */
    rf_wire_reader_init(&r, 1024);
    gr.new_max = 100;
    for (size_t i = 0; i < off; i++) {
        int rc = rf_wire_reader_feed(&r, buf + i, 1, collect_then_set_max, &gr);

        if (rc < 0) {
            cr_assert_eq(rc, -EMSGSIZE);
            cr_assert_eq(i, sizeof(small) + 4 + 3, "refused at byte %zu, not at the header", i);
            break;
        }
    }
    cr_assert_eq(gr.g.n, 1);
    cr_assert_null(r.body);
    got_free(&gr.g);
    /* 0 means the default. */
    rf_wire_reader_set_max(&r, 0);
    cr_assert_eq(r.max, RF_WIRE_MAX_DEFAULT);
}

/* rf_wire_pack_tail: the length counts the tail, the message comes first; a tail holding a
 * protobuf field (here Envelope.mac, as peer.c appends it) decodes with the message. */
Test(wire, pack_tail_reserves_bytes_inside_the_frame)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Commit c = REFIT__COMMIT__INIT;
    Refit__Envelope *back;
    uint8_t *buf;
    size_t len, n;

    c.version = 41;
    env.body_case = REFIT__ENVELOPE__BODY_COMMIT;
    env.commit = &c;
    env.seq = 3;
    n = refit__envelope__get_packed_size(&env);
    cr_assert_eq(rf_wire_pack_tail(&env.base, 34, &buf, &len), 0);
    cr_assert_eq(len, 4 + n + 34);
    cr_assert_eq(((uint32_t)buf[0] << 24 | buf[1] << 16 | buf[2] << 8 | buf[3]), n + 34);
    buf[4 + n] = 0x7a;
    buf[4 + n + 1] = 32;
    memset(buf + 4 + n + 2, 0xab, 32);
    back = refit__envelope__unpack(NULL, len - 4, buf + 4);
    cr_assert_not_null(back);
    cr_assert_eq(back->body_case, REFIT__ENVELOPE__BODY_COMMIT);
    cr_assert_eq(back->commit->version, 41);
    cr_assert_eq(back->seq, 3);
    cr_assert_eq(back->mac.len, 32);
    cr_assert_eq(back->mac.data[31], 0xab);
    refit__envelope__free_unpacked(back, NULL);
    free(buf);
    /* A tail that cannot fit a 32-bit length is refused, nothing allocated. */
    cr_assert_eq(rf_wire_pack_tail(&env.base, UINT32_MAX, &buf, &len), -EMSGSIZE);
    cr_assert_null(buf);
    cr_assert_eq(len, 0);
}

Test(wire, pack_round_trip)
{
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Hello hello = REFIT__HELLO__INIT;
    Refit__Envelope *back;
    rf_wire_reader r;
    struct got g = {0};
    uint8_t *buf;
    size_t len;

    hello.protocol_version = 7;
    hello.role = REFIT__ROLE__ROLE_RECEIVER;
    hello.node = "node-a";
    hello.daemon_id = 0x1122334455667788ull;
    hello.data_addr = "10.0.0.1:7001";
    hello.index = 3;
    env.body_case = REFIT__ENVELOPE__BODY_HELLO;
    env.hello = &hello;
    cr_assert_eq(rf_wire_pack(&env.base, &buf, &len), 0);
    cr_assert_eq(len, 4 + refit__envelope__get_packed_size(&env));
    cr_assert_eq(((uint32_t)buf[0] << 24 | buf[1] << 16 | buf[2] << 8 | buf[3]), len - 4);

    rf_wire_reader_init(&r, 0);
    cr_assert_eq(rf_wire_reader_feed(&r, buf, len, collect, &g), 0);
    free(buf);
    cr_assert_eq(g.n, 1);
    back = refit__envelope__unpack(NULL, g.len[0], g.body[0]);
    cr_assert_not_null(back);
    cr_assert_eq(back->body_case, REFIT__ENVELOPE__BODY_HELLO);
    cr_assert_eq(back->hello->protocol_version, 7);
    cr_assert_eq(back->hello->role, REFIT__ROLE__ROLE_RECEIVER);
    cr_assert_str_eq(back->hello->node, "node-a");
    cr_assert_eq(back->hello->daemon_id, 0x1122334455667788ull);
    cr_assert_str_eq(back->hello->data_addr, "10.0.0.1:7001");
    cr_assert_eq(back->hello->index, 3);
    refit__envelope__free_unpacked(back, NULL);
    got_free(&g);
}

/* ---- libuv glue over real TCP ---- */

struct uvtest {
    uv_loop_t loop;
    uv_tcp_t server, client, accepted;
    uv_connect_t conn;
    rf_wire_stream ws;
    int frames;
    uint64_t seq_sum;
    int read_err;
    int writes_done, write_status;
    int nsend;
    uint32_t max;
    size_t big;    /* when set, the client writes one frame of this many bytes */
};

static int tcp_frame(void *ctx, const uint8_t *body, uint32_t len)
{
    struct uvtest *t = ctx;
    Refit__Envelope *e = refit__envelope__unpack(NULL, len, body);

    cr_assert_not_null(e);
    cr_assert_eq(e->body_case, REFIT__ENVELOPE__BODY_HEARTBEAT);
    cr_assert_eq(e->heartbeat->seq, (uint64_t)t->frames + 1, "frames arrive in order");
    t->seq_sum += e->heartbeat->seq;
    t->frames++;
    refit__envelope__free_unpacked(e, NULL);
    return 0;
}

static void tcp_read_error(void *ctx, int err)
{
    struct uvtest *t = ctx;

    t->read_err = err;
    uv_close((uv_handle_t *)&t->accepted, NULL);
    uv_close((uv_handle_t *)&t->server, NULL);
}

static void on_write(void *ctx, int status)
{
    struct uvtest *t = ctx;

    t->writes_done++;
    if (status < 0)
        t->write_status = status;
    if (t->writes_done == t->nsend)
        uv_close((uv_handle_t *)&t->client, NULL);
}

static void on_accept(uv_stream_t *server, int status)
{
    struct uvtest *t = (struct uvtest *)((char *)server - offsetof(struct uvtest, server));

    cr_assert_eq(status, 0);
    cr_assert_eq(uv_tcp_init(&t->loop, &t->accepted), 0);
    cr_assert_eq(uv_accept(server, (uv_stream_t *)&t->accepted), 0);
    cr_assert_eq(rf_wire_read_start(&t->ws, (uv_stream_t *)&t->accepted, t->max, tcp_frame,
                                    tcp_read_error, t), 0);
}

static void on_connect(uv_connect_t *req, int status)
{
    struct uvtest *t = (struct uvtest *)((char *)req - offsetof(struct uvtest, conn));

    cr_assert_eq(status, 0);
    if (t->big) {
        uint8_t *buf = calloc(1, t->big + 4);
        uint32_t be = htonl((uint32_t)t->big);

        memcpy(buf, &be, 4);
        t->nsend = 1;
        cr_assert_eq(rf_wire_write_buf((uv_stream_t *)&t->client, buf, t->big + 4, on_write, t),
                     0);
        return;
    }
    for (int i = 1; i <= t->nsend; i++) {
        Refit__Envelope env = REFIT__ENVELOPE__INIT;
        Refit__Heartbeat hb = REFIT__HEARTBEAT__INIT;

        hb.seq = (uint64_t)i;
        env.body_case = REFIT__ENVELOPE__BODY_HEARTBEAT;
        env.heartbeat = &hb;
        cr_assert_eq(rf_wire_write((uv_stream_t *)&t->client, &env.base, on_write, t), 0);
    }
}

static void run_pair(struct uvtest *t)
{
    struct sockaddr_in addr;
    struct sockaddr_storage bound;
    int blen = sizeof(bound);

    cr_assert_eq(uv_loop_init(&t->loop), 0);
    cr_assert_eq(uv_tcp_init(&t->loop, &t->server), 0);
    cr_assert_eq(uv_ip4_addr("127.0.0.1", 0, &addr), 0);
    cr_assert_eq(uv_tcp_bind(&t->server, (struct sockaddr *)&addr, 0), 0);
    cr_assert_eq(uv_listen((uv_stream_t *)&t->server, 8, on_accept), 0);
    cr_assert_eq(uv_tcp_getsockname(&t->server, (struct sockaddr *)&bound, &blen), 0);
    cr_assert_eq(uv_tcp_init(&t->loop, &t->client), 0);
    cr_assert_eq(uv_tcp_connect(&t->conn, &t->client, (struct sockaddr *)&bound, on_connect), 0);
    cr_assert_eq(uv_run(&t->loop, UV_RUN_DEFAULT), 0);
    cr_assert_eq(uv_loop_close(&t->loop), 0);
}

Test(wire, uv_frames_over_tcp_then_eof)
{
    struct uvtest *t = calloc(1, sizeof(*t));

    t->nsend = 500;
    run_pair(t);
    cr_assert_eq(t->writes_done, 500);
    cr_assert_eq(t->write_status, 0);
    cr_assert_eq(t->frames, 500);
    cr_assert_eq(t->seq_sum, 500ull * 501 / 2);
    cr_assert_eq(t->read_err, UV_EOF);
    free(t);
}

Test(wire, uv_large_frame_spans_many_reads)
{
    struct uvtest *t = calloc(1, sizeof(*t));

    /* One byte over the reader's max: the read glue reports -EMSGSIZE and delivers nothing. */
    t->big = 1 << 20;
    t->max = (1 << 20) - 1;
    run_pair(t);
    cr_assert_eq(t->frames, 0);
    cr_assert_eq(t->read_err, -EMSGSIZE);
    free(t);
}

Test(wire, uv_write_on_unconnected_stream_fails_and_frees)
{
    uv_loop_t loop;
    uv_tcp_t tcp;
    Refit__Envelope env = REFIT__ENVELOPE__INIT;
    Refit__Heartbeat hb = REFIT__HEARTBEAT__INIT;

    env.body_case = REFIT__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    cr_assert_eq(uv_loop_init(&loop), 0);
    cr_assert_eq(uv_tcp_init(&loop, &tcp), 0);
    cr_assert_lt(rf_wire_write((uv_stream_t *)&tcp, &env.base, NULL, NULL), 0);
    uv_close((uv_handle_t *)&tcp, NULL);
    cr_assert_eq(uv_run(&loop, UV_RUN_DEFAULT), 0);
    cr_assert_eq(uv_loop_close(&loop), 0);
}
