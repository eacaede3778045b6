/* common/service/log.h - leveled one-line logging to stderr, with journal priority prefixes under systemd. */
#ifndef RF_LOG_H
#define RF_LOG_H

enum rf_log_level {
    RF_LOG_ERROR = 0,
    RF_LOG_WARN = 1,
    RF_LOG_INFO = 2,
    RF_LOG_DEBUG = 3,
};

/* use_journal_prefix for rf_log_init: detect from JOURNAL_STREAM (stderr is the journal). */
#define RF_LOG_JOURNAL_AUTO (-1)

/* Sets the level and the output style: use_journal_prefix 1 writes "<3>".."<7>" priority
 * prefixes and no timestamp (journald adds its own), 0 writes "2024-05-01T12:00:00.123Z WARN
 * module: text", RF_LOG_JOURNAL_AUTO picks 1 when JOURNAL_STREAM names the device and inode
 * of our stderr. May be called again at any time (e.g. after the config is read). */
void rf_log_init(int level, int use_journal_prefix);
void rf_log_set_level(int level);
int rf_log_get_level(void);

/* Redirects output to fd (default 2, stderr); for tests and tools that log elsewhere. */
void rf_log_set_fd(int fd);

/* "error", "warn", "info", "debug" <-> level; parse returns 0 or -EINVAL. */
int rf_log_level_parse(const char *name, int *level);
const char *rf_log_level_name(int level);

/* The module shown in each line: define RF_LOG_MODULE before including this header to
 * choose it, otherwise the base name of the source file without extension is used. */
#ifndef RF_LOG_MODULE
#define RF_LOG_MODULE __FILE__
#endif

extern int rf_log__level;
void rf_log__write(int level, const char *module, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The level is checked before the arguments are evaluated or formatted, so debug lines cost
 * one load and one compare when debug logging is off. */
#define RF_LOG__(lvl, ...)                                                          \
    do {                                                                            \
        if ((lvl) <= __atomic_load_n(&rf_log__level, __ATOMIC_RELAXED))             \
            rf_log__write((lvl), RF_LOG_MODULE, __VA_ARGS__);                       \
    } while (0)

#define RF_ERROR(...) RF_LOG__(RF_LOG_ERROR, __VA_ARGS__)
#define RF_WARN(...)  RF_LOG__(RF_LOG_WARN, __VA_ARGS__)
#define RF_INFO(...)  RF_LOG__(RF_LOG_INFO, __VA_ARGS__)
#define RF_DEBUG(...) RF_LOG__(RF_LOG_DEBUG, __VA_ARGS__)

#endif
