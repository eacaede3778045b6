/* common/service/httpd.h - the daemons' status HTTP server (libmicrohttpd, on its own thread):
 * GET /metrics (Prometheus text) and GET /status (JSON). */
#ifndef RF_HTTPD_H
#define RF_HTTPD_H

#include "err.h"
#include "metrics.h"

typedef struct rf_httpd rf_httpd;

/* Returns a malloc'd NUL-terminated JSON document, or NULL on failure (the client then gets
 * 500). Runs on the HTTP thread, not on the event loop: it must only read state that is safe
 * to read from there (a snapshot under a lock, atomics). */
typedef char *(*rf_httpd_status_fn)(void *arg);

/* Listens on listen_addr ("127.0.0.1:9464", "[::1]:0", ":9464" for every address; port 0
 * picks a free port) and serves metrics (may be NULL: /metrics is then 404) and status (may
 * be NULL: /status is 404). Returns 0 and *out, or a negative errno with err saying which
 * address failed and why. */
int rf_httpd_start(rf_httpd **out, const char *listen_addr, rf_metrics *metrics,
                   rf_httpd_status_fn status, void *status_arg, rf_err *err);

/* The port actually bound (useful with port 0). */
int rf_httpd_port(const rf_httpd *h);

/* Stops serving, waits for the HTTP thread, closes the socket and frees h. NULL is a no-op. */
void rf_httpd_stop(rf_httpd *h);

#endif
