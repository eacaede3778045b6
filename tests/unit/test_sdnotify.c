/* tests/unit/test_sdnotify.c - notifications reach a datagram socket the test binds (path and
 * abstract), the no-op and error cases, and watchdog interval parsing. */
#include <criterion/criterion.h>

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "sdnotify.h"

static char dir[64];

static void setup(void)
{
    snprintf(dir, sizeof(dir), "/tmp/rf-sdnotify-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    unsetenv("NOTIFY_SOCKET");
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
}

static void teardown(void)
{
    char p[128];

    snprintf(p, sizeof(p), "%s/notify", dir);
    unlink(p);
    rmdir(dir);
}

TestSuite(sdnotify, .init = setup, .fini = teardown);

/* Binds a datagram socket at name (a path, or "@abstract") and returns it. */
static int bind_dgram(const char *name)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    size_t n = strlen(name);
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);

    cr_assert_geq(fd, 0);
    memcpy(sa.sun_path, name, n);
    if (name[0] == '@')
        sa.sun_path[0] = '\0';
    cr_assert_eq(bind(fd, (struct sockaddr *)&sa,
                      (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n + (name[0] != '@'))),
                 0, "bind %s: %s", name, strerror(errno));
    return fd;
}

static void assert_received(int fd, const char *want)
{
    char buf[4096];
    ssize_t n = recv(fd, buf, sizeof(buf) - 1, MSG_DONTWAIT);

    cr_assert_geq(n, 0, "nothing received: %s", strerror(errno));
    buf[n] = '\0';
    cr_assert_str_eq(buf, want);
}

Test(sdnotify, without_notify_socket_is_a_noop)
{
    cr_assert_eq(rf_sd_notify("READY=1"), 0);
    setenv("NOTIFY_SOCKET", "", 1);
    cr_assert_eq(rf_sd_notify("READY=1"), 0);
}

Test(sdnotify, sends_to_a_path_socket)
{
    char path[128];
    int fd;

    snprintf(path, sizeof(path), "%s/notify", dir);
    fd = bind_dgram(path);
    setenv("NOTIFY_SOCKET", path, 1);
    cr_assert_eq(rf_sd_notify("READY=1\nSTATUS=%s", "serving 3 clients"), 0);
    assert_received(fd, "READY=1\nSTATUS=serving 3 clients");
    cr_assert_eq(rf_sd_notify("WATCHDOG=1"), 0);
    assert_received(fd, "WATCHDOG=1");
    cr_assert_eq(rf_sd_notify("STOPPING=1"), 0);
    assert_received(fd, "STOPPING=1");
    close(fd);
}

Test(sdnotify, sends_to_an_abstract_socket)
{
    char name[96];
    int fd;

    snprintf(name, sizeof(name), "@refit-test-sdnotify-%d-%ld", (int)getpid(), random());
    fd = bind_dgram(name);
    setenv("NOTIFY_SOCKET", name, 1);
    cr_assert_eq(rf_sd_notify("READY=1"), 0);
    assert_received(fd, "READY=1");
    close(fd);
}

Test(sdnotify, bad_sockets_and_messages_are_errors)
{
    char path[200], longp[200];

    setenv("NOTIFY_SOCKET", "relative/notify", 1);
    cr_assert_eq(rf_sd_notify("READY=1"), -EINVAL);

    memset(longp, 'a', sizeof(longp) - 1);
    longp[0] = '/';
    longp[sizeof(longp) - 1] = '\0';
    setenv("NOTIFY_SOCKET", longp, 1);
    cr_assert_eq(rf_sd_notify("READY=1"), -EINVAL);

    snprintf(path, sizeof(path), "%s/nobody-listens", dir);
    setenv("NOTIFY_SOCKET", path, 1);
    cr_assert_eq(rf_sd_notify("READY=1"), -ENOENT);
    cr_assert_eq(rf_sd_notify("%s", ""), -EINVAL);

    {
        static char huge[5000];

        memset(huge, 'x', sizeof(huge) - 1);
        cr_assert_eq(rf_sd_notify("STATUS=%s", huge), -EINVAL);
    }
}

Test(sdnotify, watchdog_interval)
{
    char pid[32];

    cr_assert_eq(rf_sd_watchdog_usec(), 0);
    setenv("WATCHDOG_USEC", "30000000", 1);
    cr_assert_eq(rf_sd_watchdog_usec(), 30000000);
    snprintf(pid, sizeof(pid), "%d", (int)getpid());
    setenv("WATCHDOG_PID", pid, 1);
    cr_assert_eq(rf_sd_watchdog_usec(), 30000000);
    /* Meant for another process (our parent, before exec). */
    snprintf(pid, sizeof(pid), "%d", (int)getpid() + 1);
    setenv("WATCHDOG_PID", pid, 1);
    cr_assert_eq(rf_sd_watchdog_usec(), 0);
    setenv("WATCHDOG_PID", "x", 1);
    cr_assert_eq(rf_sd_watchdog_usec(), 0);
    unsetenv("WATCHDOG_PID");

    setenv("WATCHDOG_USEC", "0", 1);
    cr_assert_eq(rf_sd_watchdog_usec(), 0);
    setenv("WATCHDOG_USEC", "12x", 1);
    cr_assert_eq(rf_sd_watchdog_usec(), 0);
    setenv("WATCHDOG_USEC", "-5", 1);
    cr_assert_eq(rf_sd_watchdog_usec(), 0);
    setenv("WATCHDOG_USEC", "", 1);
    cr_assert_eq(rf_sd_watchdog_usec(), 0);
}
