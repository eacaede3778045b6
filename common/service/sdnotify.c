/* common/service/sdnotify.c - sd_notify(3) in a few lines: a datagram to the socket systemd names. */
#include "sdnotify.h"

#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static int parse_u64(const char *s, uint64_t *out)
{
    char *end;
    unsigned long long v;

    if (s == NULL || *s < '0' || *s > '9')
        return -EINVAL;
    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0')
        return -EINVAL;
    *out = v;
    return 0;
}

int rf_sd_notify(const char *fmt, ...)
{
    const char *path = getenv("NOTIFY_SOCKET");
    struct sockaddr_un sa;
    socklen_t salen;
    char msg[4096];
    size_t plen;
    va_list ap;
    int n, fd = -1, rc = 0;

    if (path == NULL || *path == '\0')
        return 0;
    plen = strlen(path);
    if ((path[0] != '/' && path[0] != '@') || plen >= sizeof(sa.sun_path))
        return -EINVAL;
    va_start(ap, fmt);
    n = vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (n <= 0 || (size_t)n >= sizeof(msg))
        return -EINVAL;

    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, path, plen);
    if (path[0] == '@')
        sa.sun_path[0] = '\0'; /* abstract namespace: the name is not NUL-terminated */
    salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + plen + (path[0] == '/'));

    fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        rc = -errno;
        goto out;
    }
    if (sendto(fd, msg, (size_t)n, MSG_NOSIGNAL, (struct sockaddr *)&sa, salen) < 0)
        rc = -errno;
out:
    if (fd >= 0)
        close(fd);
    return rc;
}

uint64_t rf_sd_watchdog_usec(void)
{
    const char *pid_s = getenv("WATCHDOG_PID");
    uint64_t usec, pid;

    if (parse_u64(getenv("WATCHDOG_USEC"), &usec) != 0 || usec == 0)
        return 0;
    /* systemd sets WATCHDOG_PID so that children which inherit the environment stay quiet. */
    if (pid_s != NULL && (parse_u64(pid_s, &pid) != 0 || pid != (uint64_t)getpid()))
        return 0;
    return usec;
}
