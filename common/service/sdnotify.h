/* common/service/sdnotify.h - the systemd notification protocol over $NOTIFY_SOCKET, without libsystemd. */
#ifndef RF_SDNOTIFY_H
#define RF_SDNOTIFY_H

#include <stdint.h>

/* Sends one datagram ("READY=1", "STATUS=serving 3 clients", "WATCHDOG=1", "STOPPING=1",
 * several assignments separated by '\n') to $NOTIFY_SOCKET, a path or an abstract name
 * written "@name". Returns 0 when sent or when NOTIFY_SOCKET is unset (not under systemd),
 * -EINVAL for an unusable NOTIFY_SOCKET or an empty message, or the negative errno of the
 * failed socket call. */
int rf_sd_notify(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The watchdog interval systemd expects WATCHDOG=1 within, in microseconds, from
 * WATCHDOG_USEC; 0 when there is no watchdog, when the value is malformed, or when
 * WATCHDOG_PID names another process. Send WATCHDOG=1 every half of it. */
uint64_t rf_sd_watchdog_usec(void);

#endif
