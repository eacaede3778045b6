/* common/control/wire.h - length-prefixed protobuf frames on the control channel: a 4-byte big-endian
 * length, checked against a maximum before any allocation, then the packed message. */
#ifndef RF_WIRE_H
#define RF_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>
#include <uv.h>

#define RF_WIRE_MAX_DEFAULT (64u << 20)

/* Incremental frame decoder: feed it whatever bytes arrive, in any split. */
typedef struct rf_wire_reader {
    uint8_t hdr[4];
    uint32_t hdr_have;
    uint8_t *body;      /* partial body being collected, owned by the reader */
    uint32_t body_len;  /* length from the last complete header (kept after errors, for messages) */
    uint32_t body_have, max;
} rf_wire_reader;

/* max_frame 0 means RF_WIRE_MAX_DEFAULT. */
void rf_wire_reader_init(rf_wire_reader *r, uint32_t max_frame);
/* Frees a partial body and starts again at a frame boundary (body_len is left as it was). */
void rf_wire_reader_reset(rf_wire_reader *r);
/* Changes the maximum for the headers still to come (0 means RF_WIRE_MAX_DEFAULT), so that a
 * connection can take small frames until it is authenticated and large ones after. Safe to
 * call from on_frame: the next frame of the same feed is checked against the new maximum. */
void rf_wire_reader_set_max(rf_wire_reader *r, uint32_t max_frame);

/* Feeds bytes; for every complete frame calls on_frame(ctx, body, len) (body owned by the
 * reader, valid during the call; never NULL, even for len 0). The length is checked against
 * max BEFORE allocating: -EMSGSIZE. -ENOMEM when a body cannot be allocated. A negative return
 * of on_frame stops and is returned. After any negative return the byte stream is out of step:
 * the caller closes the connection (or calls rf_wire_reader_reset for a fresh stream).
 * on_frame must not reset or reinitialise the reader. Returns 0 otherwise. */
int rf_wire_reader_feed(rf_wire_reader *r, const uint8_t *data, size_t len,
                        int (*on_frame)(void *ctx, const uint8_t *body, uint32_t len), void *ctx);

/* Packs a protobuf-c message behind its 4-byte big-endian length into one malloc'd buffer
 * (the caller owns *out). -EMSGSIZE when it would not fit a 32-bit length, -ENOMEM. */
int rf_wire_pack(const ProtobufCMessage *msg, uint8_t **out, size_t *out_len);
/* The same with tail more bytes inside the frame, after the message: the length prefix
 * counts them and the caller fills (*out)[*out_len - tail ..] before writing, e.g. with a MAC
 * over the message encoded as a protobuf field of its own. */
int rf_wire_pack_tail(const ProtobufCMessage *msg, size_t tail, uint8_t **out, size_t *out_len);

/* Called when a frame written by rf_wire_write* has gone out (status 0) or failed (a libuv
 * code; UV_ECANCELED when the stream was closed first, before its close callback runs). */
typedef void (*rf_wire_write_cb)(void *ctx, int status);

/* Writes buf (malloc'd, len bytes, usually from rf_wire_pack) on stream. Ownership of buf
 * passes to this function in every case: it is freed after the write completes, or at once
 * when the write cannot start. cb may be NULL. Returns 0 or a libuv error code. */
int rf_wire_write_buf(uv_stream_t *stream, uint8_t *buf, size_t len, rf_wire_write_cb cb,
                      void *ctx);
/* Packs msg and writes it on stream; see rf_wire_write_buf. */
int rf_wire_write(uv_stream_t *stream, const ProtobufCMessage *msg, rf_wire_write_cb cb,
                  void *ctx);

/* Read path glue: embed an rf_wire_stream next to the uv_stream_t it reads, then call
 * rf_wire_read_start. Every complete frame goes to on_frame; reading stops and on_error is
 * called once with the reason: UV_EOF, another libuv read error, -EMSGSIZE (frame over max),
 * -ENOMEM, or the negative value on_frame returned. The stream itself is left open: on_error
 * decides whether to close it. rf_wire_read_start takes stream->data for itself, so owners
 * recover their struct with container_of. */
#define RF_WIRE_READ_CHUNK 65536
typedef struct rf_wire_stream {
    rf_wire_reader reader;
    int (*on_frame)(void *ctx, const uint8_t *body, uint32_t len);
    void (*on_error)(void *ctx, int err);
    void *ctx;
    uv_stream_t *stream;
    uint8_t buf[RF_WIRE_READ_CHUNK];
} rf_wire_stream;

/* Initialises ws (its reader with max_frame, 0 = default) and starts reading stream. */
int rf_wire_read_start(rf_wire_stream *ws, uv_stream_t *stream, uint32_t max_frame,
                       int (*on_frame)(void *ctx, const uint8_t *body, uint32_t len),
                       void (*on_error)(void *ctx, int err), void *ctx);
/* Stops reading and frees any partial frame; the stream stays open. Safe to call twice. */
void rf_wire_read_stop(rf_wire_stream *ws);

#endif
