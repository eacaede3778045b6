/* common/service/log.c - formatting and writing of log lines; one write(2) per line so that lines
 * from several threads never interleave. */
#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int rf_log__level = RF_LOG_INFO;
static int journal_prefix;
static int out_fd = 2;

static const char *const level_names[] = { "error", "warn", "info", "debug" };
static const char *const level_tags[] = { "ERROR", "WARN ", "INFO ", "DEBUG" };
/* syslog priorities: err, warning, info, debug (notice, 5, is not used). */
static const int level_prio[] = { 3, 4, 6, 7 };

static int clamp_level(int level)
{
    if (level < RF_LOG_ERROR)
        return RF_LOG_ERROR;
    if (level > RF_LOG_DEBUG)
        return RF_LOG_DEBUG;
    return level;
}

/* systemd sets JOURNAL_STREAM=<dev>:<inode> of the stream it connected; a child that inherits
 * the variable but has its stderr redirected elsewhere must not use prefixes. */
static int stderr_is_journal(int fd)
{
    const char *js = getenv("JOURNAL_STREAM");
    unsigned long long dev, ino;
    struct stat st;

    if (js == NULL || sscanf(js, "%llu:%llu", &dev, &ino) != 2)
        return 0;
    if (fstat(fd, &st) != 0)
        return 0;
    return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

void rf_log_init(int level, int use_journal_prefix)
{
    rf_log_set_level(level);
    if (use_journal_prefix == RF_LOG_JOURNAL_AUTO)
        journal_prefix = stderr_is_journal(out_fd);
    else
        journal_prefix = use_journal_prefix != 0;
}

void rf_log_set_level(int level)
{
    __atomic_store_n(&rf_log__level, clamp_level(level), __ATOMIC_RELAXED);
}

int rf_log_get_level(void)
{
    return __atomic_load_n(&rf_log__level, __ATOMIC_RELAXED);
}

void rf_log_set_fd(int fd)
{
    out_fd = fd;
}

int rf_log_level_parse(const char *name, int *level)
{
    for (int i = 0; i < 4; i++) {
        if (strcasecmp(name, level_names[i]) == 0) {
            *level = i;
            return 0;
        }
    }
    return -EINVAL;
}

const char *rf_log_level_name(int level)
{
    return level_names[clamp_level(level)];
}

/* "common/data/xfer_nccl.c" -> "xfer_nccl"; a name without '/' or '.' is used as given. */
static void module_name(const char *module, char *out, size_t outlen)
{
    const char *base = strrchr(module, '/');
    const char *dot;
    size_t n;

    base = base ? base + 1 : module;
    dot = strrchr(base, '.');
    n = dot ? (size_t)(dot - base) : strlen(base);
    if (n >= outlen)
        n = outlen - 1;
    memcpy(out, base, n);
    out[n] = '\0';
}

void rf_log__write(int level, const char *module, const char *fmt, ...)
{
    char line[4096];
    char mod[64];
    size_t len = 0, cap = sizeof(line) - 1; /* one byte kept for the newline */
    va_list ap;
    int n, saved_errno = errno;

    level = clamp_level(level);
    module_name(module, mod, sizeof(mod));
    if (journal_prefix) {
        n = snprintf(line, cap, "<%d>%s: ", level_prio[level], mod);
    } else {
        struct timespec ts;
        struct tm tm;

        clock_gettime(CLOCK_REALTIME, &ts);
        gmtime_r(&ts.tv_sec, &tm);
        n = snprintf(line, cap, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %s %s: ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, level_tags[level], mod);
    }
    len = n > 0 ? (size_t)n : 0;
    if (len > cap)
        len = cap;
    va_start(ap, fmt);
    n = vsnprintf(line + len, cap - len + 1, fmt, ap);
    va_end(ap);
    if (n > 0) {
        size_t start = len;

        len += (size_t)n;
        if (len > cap) {
            len = cap;
            memcpy(line + cap - 3, "...", 3);
        }
        /* One record per line: the journal would split a message at its newlines. */
        for (size_t i = start; i < len; i++)
            if (line[i] == '\n' || line[i] == '\r')
                line[i] = ' ';
    }
    line[len++] = '\n';
    for (size_t off = 0; off < len;) {
        ssize_t w = write(out_fd, line + off, len - off);

        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break;
        off += (size_t)w;
    }
    errno = saved_errno;
}
