/* tests/unit/test_log.c - log line format with and without journal prefixes, level filtering
 * before argument evaluation, JOURNAL_STREAM detection, truncation and one-line output. */
#include <criterion/criterion.h>

#include <errno.h>
#include <fcntl.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"

static int pipefd[2];

static void setup(void)
{
    cr_assert_eq(pipe2(pipefd, O_NONBLOCK | O_CLOEXEC), 0);
    rf_log_set_fd(pipefd[1]);
}

static void teardown(void)
{
    rf_log_set_fd(2);
    close(pipefd[0]);
    close(pipefd[1]);
}

TestSuite(log, .init = setup, .fini = teardown);

/* Everything written so far, NUL-terminated; "" when nothing was written. */
static char *drain(void)
{
    static char buf[16384];
    ssize_t n = read(pipefd[0], buf, sizeof(buf) - 1);

    if (n < 0) {
        cr_assert_eq(errno, EAGAIN);
        n = 0;
    }
    buf[n] = '\0';
    return buf;
}

static void assert_matches(const char *s, const char *pattern)
{
    regex_t re;

    cr_assert_eq(regcomp(&re, pattern, REG_EXTENDED | REG_NOSUB), 0);
    cr_assert_eq(regexec(&re, s, 0, NULL, 0), 0, "'%s' does not match /%s/", s, pattern);
    regfree(&re);
}

Test(log, plain_line_has_timestamp_level_and_module)
{
    rf_log_init(RF_LOG_INFO, 0);
    RF_INFO("imported %d pieces from %s", 42, "trainer-3");
    assert_matches(drain(), "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z "
                            "INFO  test_log: imported 42 pieces from trainer-3\n$");
    RF_ERROR("boom");
    assert_matches(drain(), "Z ERROR test_log: boom\n$");
    RF_WARN("careful");
    assert_matches(drain(), "Z WARN  test_log: careful\n$");
}

Test(log, journal_prefixes_carry_syslog_priorities)
{
    rf_log_init(RF_LOG_DEBUG, 1);
    RF_ERROR("e");
    RF_WARN("w");
    RF_INFO("i");
    RF_DEBUG("d %s", "x");
    cr_assert_str_eq(drain(), "<3>test_log: e\n<4>test_log: w\n<6>test_log: i\n<7>test_log: d x\n");
}

static int evaluated;

static int side_effect(void)
{
    evaluated++;
    return 7;
}

Test(log, filtered_levels_neither_evaluate_nor_write)
{
    rf_log_init(RF_LOG_WARN, 1);
    RF_INFO("%d", side_effect());
    RF_DEBUG("%d", side_effect());
    cr_assert_eq(evaluated, 0);
    cr_assert_str_eq(drain(), "");
    RF_WARN("%d", side_effect());
    cr_assert_eq(evaluated, 1);
    cr_assert_str_eq(drain(), "<4>test_log: 7\n");

    rf_log_set_level(RF_LOG_ERROR);
    RF_WARN("no");
    cr_assert_str_eq(drain(), "");
    cr_assert_eq(rf_log_get_level(), RF_LOG_ERROR);
    /* Out-of-range levels clamp instead of disabling or overflowing the tables. */
    rf_log_set_level(99);
    cr_assert_eq(rf_log_get_level(), RF_LOG_DEBUG);
    rf_log_set_level(-4);
    cr_assert_eq(rf_log_get_level(), RF_LOG_ERROR);
}

Test(log, journal_stream_detection_matches_our_stderr)
{
    struct stat st;
    char js[64];

    cr_assert_eq(fstat(pipefd[1], &st), 0);
    snprintf(js, sizeof(js), "%llu:%llu", (unsigned long long)st.st_dev,
             (unsigned long long)st.st_ino);

    setenv("JOURNAL_STREAM", js, 1);
    rf_log_init(RF_LOG_INFO, RF_LOG_JOURNAL_AUTO);
    RF_INFO("a");
    cr_assert_str_eq(drain(), "<6>test_log: a\n");

    /* Inherited by a process whose stderr goes elsewhere: no prefixes. */
    snprintf(js, sizeof(js), "%llu:%llu", (unsigned long long)st.st_dev,
             (unsigned long long)st.st_ino + 1);
    setenv("JOURNAL_STREAM", js, 1);
    rf_log_init(RF_LOG_INFO, RF_LOG_JOURNAL_AUTO);
    RF_INFO("b");
    assert_matches(drain(), "^[0-9-]+T.*INFO  test_log: b\n$");

    setenv("JOURNAL_STREAM", "garbage", 1);
    rf_log_init(RF_LOG_INFO, RF_LOG_JOURNAL_AUTO);
    RF_INFO("c");
    assert_matches(drain(), "^[0-9-]+T.*INFO  test_log: c\n$");

    unsetenv("JOURNAL_STREAM");
    rf_log_init(RF_LOG_INFO, RF_LOG_JOURNAL_AUTO);
    RF_INFO("d");
    assert_matches(drain(), "^[0-9-]+T.*INFO  test_log: d\n$");
}

Test(log, one_line_per_message_and_long_lines_truncated)
{
    char big[10000];

    rf_log_init(RF_LOG_INFO, 1);
    RF_INFO("first\nsecond\r\nthird");
    cr_assert_str_eq(drain(), "<6>test_log: first second  third\n");

    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    RF_INFO("%s", big);
    {
        char *out = drain();
        size_t n = strlen(out);

        cr_assert_eq(n, 4096);
        cr_assert_eq(out[n - 1], '\n');
        cr_assert_eq(strncmp(out + n - 4, "...", 3), 0);
        cr_assert_eq(strchr(out, '\n'), out + n - 1);
    }
}

Test(log, module_can_be_named_and_errno_is_kept)
{
#undef RF_LOG_MODULE
#define RF_LOG_MODULE "coordinator"
    rf_log_init(RF_LOG_INFO, 1);
    errno = EPIPE;
    RF_INFO("x");
    cr_assert_eq(errno, EPIPE);
    cr_assert_str_eq(drain(), "<6>coordinator: x\n");
#undef RF_LOG_MODULE
#define RF_LOG_MODULE __FILE__
}

Test(log, level_names)
{
    int lvl = -1;

    cr_assert_eq(rf_log_level_parse("debug", &lvl), 0);
    cr_assert_eq(lvl, RF_LOG_DEBUG);
    cr_assert_eq(rf_log_level_parse("WARN", &lvl), 0);
    cr_assert_eq(lvl, RF_LOG_WARN);
    cr_assert_eq(rf_log_level_parse("warning", &lvl), -EINVAL);
    cr_assert_eq(rf_log_level_parse("", &lvl), -EINVAL);
    cr_assert_str_eq(rf_log_level_name(RF_LOG_ERROR), "error");
    cr_assert_str_eq(rf_log_level_name(RF_LOG_INFO), "info");
}
