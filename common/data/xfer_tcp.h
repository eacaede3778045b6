/* common/data/xfer_tcp.h - the tcp transport's checks on what a peer sends, callable without sockets
 * or a loop, for fuzz/fuzz_xfer_tcp.c; the daemons reach the transport through xfer.h only. */
#ifndef RF_XFER_TCP_H
#define RF_XFER_TCP_H

#include "xfer.h"

/* Sizes of data protocol 3 (xfer_tcp.c describes the wire): the acceptor's nonce, the hello
 * {"RFXH", 3, from, to, the connector's nonce} and its HMAC-SHA256, a frame header {"RFXF",
 * seq, version, bytes} (its tag not included). */
#define RF_XFER_TCP__NONCE_LEN 32
#define RF_XFER_TCP__HELLO_BODY (16 + RF_XFER_TCP__NONCE_LEN)
#define RF_XFER_TCP__HELLO_LEN (RF_XFER_TCP__HELLO_BODY + 32)
#define RF_XFER_TCP__HDR_LEN 24

/* What the acceptor makes of a complete hello answering its nonce, for a daemon that is peer
 * self of npeers and holds key: 0 with *from when it is a protocol-3 hello from a peer of the
 * table to this daemon that proves the key; -EPROTO when it is no data hello of protocol 3,
 * -ENXIO when from or to do not fit this daemon's table, -EACCES when it fails
 * authentication (*from is the claimed peer for the last two). */
int rf_xfer_tcp__hello_check(const uint8_t *key, size_t key_len, uint32_t self,
                             uint32_t npeers, const uint8_t nonce[RF_XFER_TCP__NONCE_LEN],
                             const uint8_t hello[RF_XFER_TCP__HELLO_LEN], uint32_t *from);

/* Applies n frame headers (RF_XFER_TCP__HDR_LEN bytes each, back to back) that peer `peer` sent
 * on its connection through the receiver's header checks for job (which passed
 * rf_xfer_job_check with npeers): magic, version, a seq this daemon expects from that peer,
 * not twice, in an admitted round, of the planned size. Each accepted header's message is
 * taken as received whole (no payload is read), which admits the rounds after it. Returns
 * how many were accepted before the first refusal; res holds the refusal's code and message
 * (code 0 when all were accepted), or -ENOMEM's. */
size_t rf_xfer_tcp__accept_headers(const rf_xfer_job *job, uint32_t npeers, uint32_t peer,
                                   const uint8_t *hdrs, size_t n, rf_xfer_result *res);

#endif
