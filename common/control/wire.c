/* common/control/wire.c - length-prefixed protobuf framing: the incremental reader, packing, and the
 * libuv read/write glue used by every control connection. */
#include "wire.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

void rf_wire_reader_init(rf_wire_reader *r, uint32_t max_frame)
{
    memset(r, 0, sizeof(*r));
    r->max = max_frame ? max_frame : RF_WIRE_MAX_DEFAULT;
}

void rf_wire_reader_reset(rf_wire_reader *r)
{
    free(r->body);
    r->body = NULL;
    r->hdr_have = 0;
    r->body_have = 0;
}

void rf_wire_reader_set_max(rf_wire_reader *r, uint32_t max_frame)
{
    r->max = max_frame ? max_frame : RF_WIRE_MAX_DEFAULT;
}

int rf_wire_reader_feed(rf_wire_reader *r, const uint8_t *data, size_t len,
                        int (*on_frame)(void *ctx, const uint8_t *body, uint32_t len), void *ctx)
{
    int rc;

    while (len > 0) {
        if (r->hdr_have < 4) {
            size_t n = 4 - r->hdr_have;

            if (n > len)
                n = len;
            memcpy(r->hdr + r->hdr_have, data, n);
            r->hdr_have += (uint32_t)n;
            data += n;
            len -= n;
            if (r->hdr_have < 4)
                break;
            r->body_len = (uint32_t)r->hdr[0] << 24 | (uint32_t)r->hdr[1] << 16 |
                          (uint32_t)r->hdr[2] << 8 | (uint32_t)r->hdr[3];
            r->body_have = 0;
            if (r->body_len > r->max)
                return -EMSGSIZE;
            if (r->body_len == 0) {
                r->hdr_have = 0;
                rc = on_frame(ctx, r->hdr, 0);
                if (rc < 0)
                    return rc;
                continue;
            }
            /* The whole body is already here: hand it over without copying. */
            if (len >= r->body_len) {
                uint32_t blen = r->body_len;

                r->hdr_have = 0;
                rc = on_frame(ctx, data, blen);
                if (rc < 0)
                    return rc;
                data += blen;
                len -= blen;
                continue;
            }
            r->body = malloc(r->body_len);
            if (r->body == NULL)
                return -ENOMEM;
            continue;
        }

        size_t n = r->body_len - r->body_have;

        if (n > len)
            n = len;
        memcpy(r->body + r->body_have, data, n);
        r->body_have += (uint32_t)n;
        data += n;
        len -= n;
        if (r->body_have == r->body_len) {
            uint8_t *body = r->body;

            r->body = NULL;
            r->hdr_have = 0;
            rc = on_frame(ctx, body, r->body_len);
            free(body);
            if (rc < 0)
                return rc;
        }
    }
    return 0;
}

int rf_wire_pack_tail(const ProtobufCMessage *msg, size_t tail, uint8_t **out, size_t *out_len)
{
    size_t size = protobuf_c_message_get_packed_size(msg);
    size_t flen = size + tail;
    uint8_t *buf;

    *out = NULL;
    *out_len = 0;
    if (size > UINT32_MAX || tail > UINT32_MAX - size)
        return -EMSGSIZE;
    buf = malloc(4 + flen);
    if (buf == NULL)
        return -ENOMEM;
    buf[0] = (uint8_t)(flen >> 24);
    buf[1] = (uint8_t)(flen >> 16);
    buf[2] = (uint8_t)(flen >> 8);
    buf[3] = (uint8_t)flen;
    protobuf_c_message_pack(msg, buf + 4);
    *out = buf;
    *out_len = 4 + flen;
    return 0;
}

int rf_wire_pack(const ProtobufCMessage *msg, uint8_t **out, size_t *out_len)
{
    return rf_wire_pack_tail(msg, 0, out, out_len);
}

/* One write in flight: the request and the buffer it owns, freed in write_done. */
struct wire_wreq {
    uv_write_t req;
    uint8_t *buf;
    rf_wire_write_cb cb;
    void *ctx;
};

static void write_done(uv_write_t *req, int status)
{
    struct wire_wreq *w = (struct wire_wreq *)req;

    if (w->cb)
        w->cb(w->ctx, status);
    free(w->buf);
    free(w);
}

int rf_wire_write_buf(uv_stream_t *stream, uint8_t *buf, size_t len, rf_wire_write_cb cb,
                      void *ctx)
{
    struct wire_wreq *w = NULL;
    uv_buf_t b;
    int rc;

    if (len > UINT32_MAX) {
        rc = UV_EINVAL;
        goto fail;
    }
    w = malloc(sizeof(*w));
    if (w == NULL) {
        rc = UV_ENOMEM;
        goto fail;
    }
    w->buf = buf;
    w->cb = cb;
    w->ctx = ctx;
    b = uv_buf_init((char *)buf, (unsigned int)len);
    rc = uv_write(&w->req, stream, &b, 1, write_done);
    if (rc < 0)
        goto fail;
    return 0;
fail:
    free(w);
    free(buf);
    return rc;
}

int rf_wire_write(uv_stream_t *stream, const ProtobufCMessage *msg, rf_wire_write_cb cb,
                  void *ctx)
{
    uint8_t *buf;
    size_t len;
    int rc;

    rc = rf_wire_pack(msg, &buf, &len);
    if (rc < 0)
        return rc;
    return rf_wire_write_buf(stream, buf, len, cb, ctx);
}

static void wire_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    rf_wire_stream *ws = h->data;

    (void)suggested;
    /* libuv has at most one read outstanding per stream, so one buffer per stream is enough. */
    *buf = uv_buf_init((char *)ws->buf, sizeof(ws->buf));
}

static void wire_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    rf_wire_stream *ws = s->data;
    int rc;

    (void)buf;
    if (nread == 0)
        return;
    if (nread < 0) {
        rc = (int)nread;
    } else {
        rc = rf_wire_reader_feed(&ws->reader, ws->buf, (size_t)nread, ws->on_frame, ws->ctx);
        if (rc >= 0)
            return;
    }
    rf_wire_read_stop(ws);
    ws->on_error(ws->ctx, rc);
}

int rf_wire_read_start(rf_wire_stream *ws, uv_stream_t *stream, uint32_t max_frame,
                       int (*on_frame)(void *ctx, const uint8_t *body, uint32_t len),
                       void (*on_error)(void *ctx, int err), void *ctx)
{
    rf_wire_reader_init(&ws->reader, max_frame);
    ws->on_frame = on_frame;
    ws->on_error = on_error;
    ws->ctx = ctx;
    ws->stream = stream;
    stream->data = ws;
    return uv_read_start(stream, wire_alloc, wire_read);
}

void rf_wire_read_stop(rf_wire_stream *ws)
{
    if (ws->stream && !uv_is_closing((uv_handle_t *)ws->stream))
        uv_read_stop(ws->stream);
    rf_wire_reader_reset(&ws->reader);
}
