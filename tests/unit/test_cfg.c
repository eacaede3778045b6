/* tests/unit/test_cfg.c - config loading for both daemons: defaults, INI files with sections,
 * flags over the file, --help/--version/--check-config, and every error message with its
 * file line or flag. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cfg.h"
#include "daemon_cfg.h"
#include "log.h"

static char dir[64];
static char conf[128];
static rf_daemon_cfg c;
static rf_err err;

static void setup(void)
{
    snprintf(dir, sizeof(dir), "/tmp/rf-cfg-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    snprintf(conf, sizeof(conf), "%s/publisherd.conf", dir);
    memset(&c, 0, sizeof(c));
    rf_err_clear(&err);
}

static void teardown(void)
{
    rf_daemon_cfg_free(&c);
    unlink(conf);
    rmdir(dir);
}

TestSuite(cfg, .init = setup, .fini = teardown);

static void write_conf(const char *text)
{
    FILE *f = fopen(conf, "w");

    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

/* Loads the publisherd config from conf plus extra flags (NULL-terminated). */
static int load_role(int role, rf_cfg_next *next, ...)
{
    char *argv[32] = { "refit-test", "--config", conf };
    int argc = 3;
    va_list ap;
    char *a;

    va_start(ap, next);
    while ((a = va_arg(ap, char *)) != NULL)
        argv[argc++] = a;
    va_end(ap);
    rf_daemon_cfg_free(&c);
    return rf_daemon_cfg_load(&c, role, argc, argv, next, &err);
}

#define LOAD(...) load_role(RF_DAEMON_PUBLISHER, &next, __VA_ARGS__, (char *)NULL)
#define LOAD_RECV(...) load_role(RF_DAEMON_RECEIVER, &next, __VA_ARGS__, (char *)NULL)

Test(cfg, defaults_of_publisherd)
{
    rf_cfg_next next;
    char host[256];

    write_conf("");
    cr_assert_eq(load_role(RF_DAEMON_PUBLISHER, &next, (char *)NULL), 0, "%s", err.msg);
    cr_assert_eq(next, RF_CFG_RUN);
    gethostname(host, sizeof(host));
    cr_assert_str_eq(c.node, host);
    cr_assert_eq(c.role, RF_DAEMON_PUBLISHER);
    cr_assert_eq(c.coordinator, false);
    cr_assert_str_eq(c.coordinator_addr, "127.0.0.1:7470");
    cr_assert_eq(c.publishers, 1);
    cr_assert_eq(c.receivers, 1);
    cr_assert_eq(c.clients, 1);
    cr_assert_eq(c.index, 0);
    cr_assert_str_eq(c.socket, "/run/refit/publisherd.sock");
    cr_assert_eq(c.socket_uids.n, 0);
    cr_assert_str_eq(c.data_listen, "127.0.0.1:0");
    cr_assert_str_eq(c.status_listen, "127.0.0.1:9464");
    cr_assert_str_eq(c.cluster_key_file, "/etc/refit/cluster.key");
    cr_assert_eq(c.transport, RF_TRANSPORT_TCP);
    cr_assert_eq(c.staging_mib, 256);
    cr_assert_eq(c.direct_min_kib, 1024);
    cr_assert_eq(c.verify, RF_VERIFY_SAMPLE);
    cr_assert_eq(c.relay, RF_RELAY_OFF);
    cr_assert_eq(c.heartbeat_ms, 1000);
    cr_assert_eq(c.peer_timeout_ms, 10000);
    cr_assert_eq(c.refit_timeout_s, 600);
    cr_assert_eq(c.log_level, RF_LOG_INFO);
    cr_assert_eq(c.max_frame_mib, 64);
    cr_assert_str_eq(c.config_path, conf);
    cr_assert_str_eq(rf_transport_name(c.transport), "tcp");
    cr_assert_str_eq(rf_verify_name(c.verify), "sample");
}

Test(cfg, defaults_of_receiverd)
{
    rf_cfg_next next;

    write_conf("");
    cr_assert_eq(load_role(RF_DAEMON_RECEIVER, &next, (char *)NULL), 0, "%s", err.msg);
    cr_assert_eq(c.role, RF_DAEMON_RECEIVER);
    cr_assert_str_eq(c.socket, "/run/refit/receiverd.sock");
    cr_assert_str_eq(c.status_listen, "127.0.0.1:9465");
}

Test(cfg, file_with_sections_comments_quotes_and_indentation)
{
    rf_cfg_next next;

    write_conf("; refit publisher\n"
               "node = trainer-0\n"
               "\n"
               "[common]\n"
               "# the whole cluster\n"
               "publishers = 4\n"
               "  receivers = 8   ; indented, inline comment\n"
               "transport = NCCL\n"
               "socket_uids = 0, root 4242\n"
               "[publisherd]\n"
               "\tcoordinator = yes\n"
               "coordinator_addr = [::1]:7470\n"
               "index = 3\n"
               "status_listen = \"\"\n"
               "verify = full\n"
               "relay = on\n"
               "log_level = debug\n"
               "staging_mib = 1024\n");
    cr_assert_eq(LOAD("--log-level=debug"), 0, "%s", err.msg);
    cr_assert_eq(next, RF_CFG_RUN);
    cr_assert_str_eq(c.node, "trainer-0");
    cr_assert_eq(c.publishers, 4);
    cr_assert_eq(c.receivers, 8);
    cr_assert_eq(c.transport, RF_TRANSPORT_NCCL);
    cr_assert_eq(c.socket_uids.n, 3);
    cr_assert_eq(c.socket_uids.v[0], 0);
    cr_assert_eq(c.socket_uids.v[1], 0);
    cr_assert_eq(c.socket_uids.v[2], 4242);
    cr_assert_eq(c.coordinator, true);
    cr_assert_str_eq(c.coordinator_addr, "[::1]:7470");
    cr_assert_eq(c.index, 3);
    cr_assert_str_eq(c.status_listen, "");
    cr_assert_eq(c.verify, RF_VERIFY_FULL);
    cr_assert_eq(c.relay, RF_RELAY_ON);
    cr_assert_eq(c.log_level, RF_LOG_DEBUG);
    cr_assert_eq(c.staging_mib, 1024);
}

Test(cfg, flags_override_the_file)
{
    rf_cfg_next next;

    write_conf("staging_mib = 128\ncoordinator = true\nverify = off\nnode = a\n");
    cr_assert_eq(LOAD("--staging-mib=512", "--coordinator=false", "--verify", "full",
                      "--node", "b", "--heartbeat_ms=50", "--status-listen="),
                 0, "%s", err.msg);
    cr_assert_eq(next, RF_CFG_RUN);
    cr_assert_eq(c.staging_mib, 512);
    cr_assert_eq(c.coordinator, false);
    cr_assert_eq(c.verify, RF_VERIFY_FULL);
    cr_assert_str_eq(c.node, "b");
    cr_assert_eq(c.heartbeat_ms, 50);
    cr_assert_str_eq(c.status_listen, "");

    /* A bare boolean flag turns it on. */
    cr_assert_eq(LOAD("--coordinator", "--staging-mib", "64"), 0, "%s", err.msg);
    cr_assert_eq(c.coordinator, true);
    cr_assert_eq(c.staging_mib, 64);
    cr_assert_eq(LOAD("--config=/dev/null", "--publishers=2", "--index=1"), 0, "%s", err.msg);
    cr_assert_eq(c.staging_mib, 256); /* the file named last was read: /dev/null */
    cr_assert_eq(c.index, 1);
}

/* A file line or a flag, and the exact message it must produce ("@" stands for the path of
 * the config file). */
struct bad_case {
    int role;
    const char *file;
    const char *flag;
    int code;
    const char *msg;
};

static struct bad_case bad_cases[] = {
    { 0, "node = x\n\n[publisherd]\nstagin_mib = 5\n", NULL, -ENOENT,
      "@:4: unknown key 'stagin_mib' (did you mean 'staging_mib'?)" },
    { 0, "staging_mib = 0\n", NULL, -EINVAL,
      "@:1: 'staging_mib' must be between 1 and 65536, got 0" },
    { 0, "staging_mib = 65537\n", NULL, -EINVAL,
      "@:1: 'staging_mib' must be between 1 and 65536, got 65537" },
    { 0, "staging_mib = 99999999999999999999\n", NULL, -EINVAL,
      "@:1: 'staging_mib' must be between 1 and 65536, got 99999999999999999999" },
    { 0, "staging_mib = lots\n", NULL, -EINVAL,
      "@:1: 'staging_mib' must be an integer between 1 and 65536, got 'lots'" },
    { 0, "staging_mib = 12MiB\n", NULL, -EINVAL,
      "@:1: 'staging_mib' must be an integer between 1 and 65536, got '12MiB'" },
    { 0, "verify = ful\n", NULL, -EINVAL,
      "@:1: 'verify' must be one of off, sample, full; got 'ful'" },
    { 0, "relay = yes\n", NULL, -EINVAL, "@:1: 'relay' must be one of off, on; got 'yes'" },
    { 1, "", "--relay=1", -EINVAL, "--relay: 'relay' must be one of off, on; got '1'" },
    { 0, "coordinator = maybe\n", NULL, -EINVAL,
      "@:1: 'coordinator' must be true or false (yes/no, on/off, 1/0), got 'maybe'" },
    { 0, "data_listen = 10.0.0.1\n", NULL, -EINVAL,
      "@:1: 'data_listen': address '10.0.0.1' has no port; write 10.0.0.1:PORT" },
    { 0, "data_listen = ::1:80\n", NULL, -EINVAL,
      "@:1: 'data_listen': address '::1:80' has an IPv6 address without brackets; write "
      "[::1]:80" },
    { 0, "data_listen = h:70000\n", NULL, -EINVAL,
      "@:1: 'data_listen': address 'h:70000': port '70000' is not a number in 0..65535" },
    { 0, "", "--status-listen=[::1]", -EINVAL,
      "--status-listen: 'status_listen': address '[::1]' has no port; write [::1]:PORT" },
    { 1, "coordinator_addr = :7470\n", NULL, -EINVAL,
      "@: 'coordinator_addr': address ':7470' names no host, and a connection needs one; "
      "write host:port, as 127.0.0.1:7470" },
    { 0, "", "--coordinator-addr=*:7470", -EINVAL,
      "@: 'coordinator_addr' (connected to, as coordinator = false): address '*:7470' names "
      "no host, and a connection needs one; write host:port, as 127.0.0.1:7470" },
    { 0, "data_listen = \"\"\n", NULL, -EINVAL, "@:1: 'data_listen' must not be empty" },
    { 0, "socket =\n", NULL, -EINVAL, "@:1: 'socket' must not be empty" },
    { 1, "coordinator_addr = 10.0.0.1:0\n", NULL, -EINVAL,
      "@:1: 'coordinator_addr' port must be between 1 and 65535, got 0" },
    { 1, "coordinator = true\n", NULL, -ENOENT,
      "@:1: unknown key 'coordinator' (refit-receiverd --help lists the keys)" },
    { 0, "[receiverd]\nnode = x\n", NULL, -EINVAL,
      "@:2: section [receiverd] is not read by refit-publisherd (its keys go in [common], "
      "[publisherd])" },
    { 0, "node = a\n[common]\nnode = b\n", NULL, -EINVAL, "@:3: 'node' is already set on line 1" },
    { 0, "staging-mib = 3\n", NULL, -ENOENT,
      "@:1: unknown key 'staging-mib' (did you mean 'staging_mib'?)" },
    { 0, "node = a\njust some words\n", NULL, -EINVAL,
      "@:2: cannot parse the line: expected 'key = value', '[section]' or a comment starting "
      "with ';' or '#'" },
    { 0, "[common\n", NULL, -EINVAL,
      "@:1: cannot parse the line: expected 'key = value', '[section]' or a comment starting "
      "with ';' or '#'" },
    { 0, "socket_uids = root, nosuchuser_rf\n", NULL, -EINVAL,
      "@:1: 'socket_uids' names user 'nosuchuser_rf', who does not exist on this host (give a "
      "user name from /etc/passwd or a numeric uid)" },
    { 0, "socket_uids = 12x\n", NULL, -EINVAL,
      "@:1: 'socket_uids' must list uids or user names, got '12x'" },
    { 0, "", "--stagin-mib=5", -ENOENT,
      "unknown option '--stagin-mib' (did you mean '--staging-mib'?)" },
    { 0, "", "--frobnicate", -ENOENT,
      "unknown option '--frobnicate' (refit-publisherd --help lists them)" },
    { 0, "", "--staging-mib=0", -EINVAL,
      "--staging-mib: 'staging_mib' must be between 1 and 65536, got 0" },
    { 0, "", "--staging-mib", -EINVAL, "option '--staging-mib' needs a value" },
    { 0, "", "stray", -EINVAL,
      "unexpected argument 'stray' (options are --key=value; see refit-publisherd --help)" },
    { 0, "", "--", -EINVAL,
      "unexpected argument '--' (options are --key=value; see refit-publisherd --help)" },
    { 0, "", "--index=1", -EINVAL, "@: 'index' is 1 but there are 1 publishers (index counts "
      "from 0)" },
    { 1, "receivers = 2\nindex = 2\n", NULL, -EINVAL,
      "@: 'index' is 2 but there are 2 receivers (index counts from 0)" },
    { 0, "heartbeat_ms = 1000\npeer_timeout_ms = 1000\n", NULL, -EINVAL,
      "@: 'peer_timeout_ms' (1000) must be larger than 'heartbeat_ms' (1000), or every peer is "
      "declared dead between two heartbeats" },
    { 0, "host_id = rack 7\n", NULL, -EINVAL,
      "@:1: 'host_id' holds a space, 0x20 at byte 4; it must be one word of printable ASCII "
      "(no spaces or control characters)" },
    { 0, "host_id = a\001b\n", NULL, -EINVAL,
      "@:1: 'host_id' holds the control character 0x01 at byte 1; it must be one word of "
      "printable ASCII (no spaces or control characters)" },
    { 0, "host_id = h\xc3\xa9te\n", NULL, -EINVAL,
      "@:1: 'host_id' holds the non-ASCII byte 0xc3 at byte 1; it must be one word of "
      "printable ASCII (no spaces or control characters)" },
    { 1, "", "--host-id=node-1\nnode-2", -EINVAL,
      "--host-id: 'host_id' holds the control character 0x0a at byte 6; it must be one word of "
      "printable ASCII (no spaces or control characters)" },
    { 0, "", "--host-id=tab\there", -EINVAL,
      "--host-id: 'host_id' holds the control character 0x09 at byte 3; it must be one word of "
      "printable ASCII (no spaces or control characters)" },
    { 0, "coordinator_addr = 10.0.0.1:0\n", NULL, -EINVAL,
      "@: 'coordinator_addr' (connected to, as coordinator = false): address '10.0.0.1:0' has "
      "port 0, which only a listener may use (the system then picks a free port); give the "
      "port the other side listens on" },
};

/* Criterion runs each parameter in a fresh process of the (position-independent) test binary,
 * so parameters and the strings they point to must live in its shared arena. */
static char *shared_str(const char *s)
{
    char *p;

    if (s == NULL)
        return NULL;
    p = cr_malloc(strlen(s) + 1);
    strcpy(p, s);
    return p;
}

static void free_bad_cases(struct criterion_test_params *ctp)
{
    struct bad_case *bc = ctp->params;

    for (size_t i = 0; i < ctp->length; i++) {
        cr_free((void *)bc[i].file);
        cr_free((void *)bc[i].flag);
        cr_free((void *)bc[i].msg);
    }
    cr_free(ctp->params);
}

ParameterizedTestParameters(cfg, bad_input)
{
    size_t n = sizeof(bad_cases) / sizeof(bad_cases[0]);
    struct bad_case *p = cr_malloc(sizeof(bad_cases));

    for (size_t i = 0; i < n; i++) {
        p[i] = bad_cases[i];
        p[i].file = shared_str(bad_cases[i].file);
        p[i].flag = shared_str(bad_cases[i].flag);
        p[i].msg = shared_str(bad_cases[i].msg);
    }
    return cr_make_param_array(struct bad_case, p, n, free_bad_cases);
}

ParameterizedTest(struct bad_case *bc, cfg, bad_input)
{
    rf_cfg_next next;
    char want[1024];
    const char *at = strchr(bc->msg, '@');
    int rc;

    write_conf(bc->file);
    if (at)
        snprintf(want, sizeof(want), "%.*s%s%s", (int)(at - bc->msg), bc->msg, conf, at + 1);
    else
        snprintf(want, sizeof(want), "%s", bc->msg);
    rc = load_role(bc->role, &next, bc->flag, (char *)NULL);
    cr_assert_eq(rc, bc->code, "rc %d: %s", rc, err.msg);
    cr_assert_str_eq(err.msg, want);
}

Test(cfg, coordinator_may_listen_on_port_0)
{
    rf_cfg_next next;

    write_conf("coordinator = on\ncoordinator_addr = 127.0.0.1:0\n");
    cr_assert_eq(LOAD("--transport=nccl"), 0, "%s", err.msg);
    cr_assert_eq(c.transport, RF_TRANSPORT_NCCL);
}

Test(cfg, overlong_line_is_an_error)
{
    rf_cfg_next next;
    char text[512];

    snprintf(text, sizeof(text), "node = a\nnode_x = %0300d\n", 0);
    write_conf(text);
    cr_assert_eq(LOAD("--check-config"), -EINVAL);
    cr_assert_not_null(strstr(err.msg, ":2: line is longer than"), "%s", err.msg);
    cr_assert(rf_cfg_check_only(5, (char *[]){ "p", "--config", conf, "--check-config", NULL }));
    cr_assert_not(rf_cfg_check_only(2, (char *[]){ "p", "--help", NULL }));
}

Test(cfg, missing_files)
{
    rf_cfg_next next;

    /* An explicit --config must exist. */
    cr_assert_eq(LOAD("--config", "/nonexistent/refit.conf"), -ENOENT);
    cr_assert_str_eq(err.msg, "cannot open config file /nonexistent/refit.conf: No such file "
                              "or directory");
    cr_assert_eq(LOAD("--config"), -EINVAL);
    cr_assert_str_eq(err.msg, "option '--config' needs a path");
}

/* Runs fn with stdout captured into a file; returns what was printed. */
static char *capture_stdout(int (*fn)(void *), void *arg, int *rc)
{
    static char out[65536];
    char path[128];
    int saved = dup(1), fd;
    ssize_t n;

    snprintf(path, sizeof(path), "%s/stdout", dir);
    fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    cr_assert_geq(fd, 0);
    fflush(stdout);
    dup2(fd, 1);
    *rc = fn(arg);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    n = pread(fd, out, sizeof(out) - 1, 0);
    cr_assert_geq(n, 0);
    out[n] = '\0';
    close(fd);
    unlink(path);
    return out;
}

/* A table whose default file does not exist, with a double key. */
typedef struct small {
    double ratio;
    char *name;
} small;

static const rf_cfg_key small_keys[] = {
    { "ratio", RF_CFG_DOUBLE, offsetof(small, ratio), "0.5", 0, 0, 0.0, 1.0, NULL, 0,
      "A fraction." },
    { "name", RF_CFG_STRING, offsetof(small, name), "x", 0, 0, 0, 0, NULL, 0, "A name." },
};

static const rf_cfg_table small_table = {
    .program = "small",
    .version = "9",
    .default_config = "/nonexistent/small.conf",
    .sections = NULL,
    .keys = small_keys,
    .nkeys = 2,
};

static char **run_argv;
static int run_argc;

static small small_obj;

static int run_small(void *arg)
{
    return rf_cfg_load(&small_table, &small_obj, run_argc, run_argv, arg, &err);
}

static int run_daemon(void *arg)
{
    rf_cfg_next *next = arg;

    rf_daemon_cfg_free(&c);
    return rf_daemon_cfg_load(&c, RF_DAEMON_PUBLISHER, run_argc, run_argv, next, &err);
}

Test(cfg, help_lists_every_key_with_type_and_default)
{
    rf_cfg_next next;
    char *out;
    int rc;

    run_argv = (char *[]){ "refit-publisherd", "--staging-mib=3", "--help", NULL };
    run_argc = 3;
    out = capture_stdout(run_daemon, &next, &rc);
    cr_assert_eq(rc, 0);
    cr_assert_eq(next, RF_CFG_EXIT);
    cr_assert_not_null(strstr(out, "Usage: refit-publisherd [--config PATH]"), "%s", out);
    cr_assert_not_null(strstr(out, "(default /etc/refit/publisherd.conf)"), "%s", out);
    cr_assert_not_null(strstr(out, "  staging_mib = INT 1..65536  (default: 256)\n"
                                   "      Staging budget per GPU and round, MiB:"), "%s", out);
    cr_assert_not_null(strstr(out, "  verify = off|sample|full  (default: sample)\n"), "%s", out);
    cr_assert_not_null(strstr(out, "  relay = off|on  (default: off)\n"
                                   "      Relays (read by the coordinator)"), "%s", out);
    cr_assert_not_null(strstr(out, "  status_listen = HOST:PORT or \"\"  (default: "
                                   "127.0.0.1:9464)\n"), "%s", out);
    cr_assert_not_null(strstr(out, "  node = STRING  (default: \"\")\n"), "%s", out);
    cr_assert_not_null(strstr(out, "  host_id = WORD of at most 255 bytes  (default: \"\")\n"),
                       "%s", out);
    for (size_t i = 0; i < rf_daemon_cfg_publisherd.nkeys; i++) {
        char line[128];

        snprintf(line, sizeof(line), "\n  %s = ", rf_daemon_cfg_publisherd.keys[i].name);
        cr_assert_not_null(strstr(out, line), "%s missing from help", line);
    }
    /* Help lines are wrapped to fit a terminal. */
    for (char *p = out, *nl; (nl = strchr(p, '\n')) != NULL; p = nl + 1)
        cr_assert_leq(nl - p, 80, "%.*s", (int)(nl - p), p);
}

static char key[160];

/* host_id is compared between daemons and printed in logs and status: at most 255 bytes of
 * one printable word. --check-config refuses a longer one (10 KB, 256 bytes) without printing
 * "valid"; 255 bytes and every printable character pass. */
Test(cfg, host_id_is_one_bounded_printable_word)
{
    rf_cfg_next next;
    char text[512], *flag, *out;
    int rc;

    flag = malloc(10 + 10240 + 1);
    cr_assert_not_null(flag);
    memcpy(flag, "--host-id=", 10);
    memset(flag + 10, 'h', 10240);
    flag[10 + 10240] = '\0';
    write_conf("");
    run_argv = (char *[]){ "refit-publisherd", "--check-config", "--config", conf, flag, NULL };
    run_argc = 5;
    out = capture_stdout(run_daemon, &next, &rc);
    cr_assert_eq(rc, -EINVAL, "%s", err.msg);
    cr_assert_str_eq(err.msg, "--host-id: 'host_id' is 10240 bytes long; the limit is 255");
    cr_assert_null(strstr(out, "valid"), "%s", out);
    free(flag);

    /* (A file line holds at most 197 characters: the bound is reached from flags.) */
    snprintf(text, sizeof(text), "--host-id=%0256d", 0);
    cr_assert_eq(LOAD("--check-config", text), -EINVAL);
    cr_assert_str_eq(err.msg, "--host-id: 'host_id' is 256 bytes long; the limit is 255");
    snprintf(text, sizeof(text), "--host-id=%0255d", 7);
    cr_assert_eq(LOAD(text), 0, "%s", err.msg);
    cr_assert_eq(strlen(c.host_id), 255);
    {
        char all[0x7f - 0x21 + 1];

        for (int ch = 0x21; ch < 0x7f; ch++)
            all[ch - 0x21] = (char)ch;
        all[sizeof(all) - 1] = '\0';
        snprintf(text, sizeof(text), "--host-id=%s", all);
        cr_assert_eq(LOAD(text), 0, "%s", err.msg);
        cr_assert_str_eq(c.host_id, all);
    }
    write_conf("host_id = \"\"\n");
    cr_assert_eq(LOAD("--staging-mib=1"), 0, "%s", err.msg);
    cr_assert_str_eq(c.host_id, "");
}

/* A 32-byte cluster key in dir with the given mode. */
static void write_key(mode_t mode)
{
    int fd;

    snprintf(key, sizeof(key), "%s/cluster.key", dir);
    fd = open(key, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, "0123456789abcdef0123456789abcdef", 32), 32);
    close(fd);
    cr_assert_eq(chmod(key, mode), 0);
}

Test(cfg, version_and_check_config_print_and_exit)
{
    rf_cfg_next next;
    char text[512], *out;
    int rc;

    run_argv = (char *[]){ "refit-publisherd", "--version", NULL };
    run_argc = 2;
    out = capture_stdout(run_daemon, &next, &rc);
    cr_assert_eq(rc, 0);
    cr_assert_eq(next, RF_CFG_EXIT);
    cr_assert_str_eq(out, "refit-publisherd " RF_VERSION "\n");

    /* --check-config also checks what start-up needs: a key file, a socket path, addresses
     * of this machine. */
    write_key(0600);
    snprintf(text, sizeof(text), "staging_mib = 8\ncluster_key_file = %s\nsocket = %s/p.sock\n"
             "status_listen = 127.0.0.1:0\n", key, dir);
    write_conf(text);
    run_argv = (char *[]){ "refit-publisherd", "--check-config", "--config", conf, NULL };
    run_argc = 4;
    out = capture_stdout(run_daemon, &next, &rc);
    cr_assert_eq(rc, 0, "%s", err.msg);
    cr_assert_eq(next, RF_CFG_EXIT);
    cr_assert_not_null(strstr(out, "refit-publisherd: "), "%s", out);
    cr_assert_not_null(strstr(out, "publisherd.conf: configuration is valid\n"), "%s", out);
    cr_assert_eq(c.staging_mib, 8);
    unlink(key);
}

/* The check --check-config adds is the one start-up runs (rf_daemon_cfg_check): what it
 * refuses, --check-config refuses, without printing "valid"; without --check-config loading
 * does not run it (start-up does, once, and keeps the key). */
Test(cfg, check_config_runs_the_start_up_check)
{
    rf_cfg_next next;
    rf_peer_key k;
    char text[512], *out;
    int rc;

    write_key(0644);
    snprintf(text, sizeof(text), "cluster_key_file = %s\nsocket = %s/p.sock\n", key, dir);
    write_conf(text);
    cr_assert_eq(LOAD("--status-listen", "127.0.0.1:0"), 0, "%s", err.msg);
    cr_assert_eq(next, RF_CFG_RUN);
    cr_assert_eq(rf_daemon_cfg_check(&c, &k, &err), -EPERM);
    cr_assert(strstr(err.msg, "has mode 0644"), "%s", err.msg);

    run_argv = (char *[]){ "refit-publisherd", "--check-config", "--config", conf, NULL };
    run_argc = 4;
    out = capture_stdout(run_daemon, &next, &rc);
    cr_assert_eq(rc, -EPERM, "%s", err.msg);
    cr_assert(strstr(err.msg, "has mode 0644"), "%s", err.msg);
    cr_assert_null(strstr(out, "valid"), "%s", out);

    chmod(key, 0600);
    cr_assert_eq(rf_daemon_cfg_check(&c, &k, &err), 0, "%s", err.msg);
    cr_assert_eq(k.len, 32);
    unlink(key);
}

/* Every listen form passes the start-up check, which binds it for real: all interfaces
 * (":0", "*:0"), a name, IPv6 in brackets when the machine has ::1. A receiver connects to
 * coordinator_addr, so a name and a port are enough there (nothing is bound). */
Test(cfg, start_up_check_takes_every_listen_form)
{
    static const char *const forms[] = { ":0", "*:0", "127.0.0.1:0", "localhost:0" };
    rf_cfg_next next;
    rf_peer_key k;
    char text[512];

    write_key(0600);
    snprintf(text, sizeof(text), "cluster_key_file = %s\nsocket = %s/p.sock\n", key, dir);
    write_conf(text);
    for (size_t i = 0; i < sizeof(forms) / sizeof(forms[0]); i++) {
        cr_assert_eq(LOAD("--data-listen", forms[i], "--status-listen", forms[i],
                          "--coordinator", "--coordinator-addr", forms[i]), 0, "%s", err.msg);
        cr_assert_eq(rf_daemon_cfg_check(&c, &k, &err), 0, "%s: %s", forms[i], err.msg);
    }
    cr_assert_eq(LOAD("--data-listen", "[::1]:0"), 0, "%s", err.msg);
    if (rf_daemon_cfg_check(&c, &k, &err) != 0)
        cr_assert_eq(err.code, -EADDRNOTAVAIL, "%s", err.msg); /* no IPv6 loopback here */
    cr_assert_eq(load_role(RF_DAEMON_RECEIVER, &next, "--coordinator-addr", "[::1]:7470",
                           (char *)NULL), 0, "%s", err.msg);
    cr_assert_eq(rf_daemon_cfg_check(&c, &k, &err), 0, "%s", err.msg);
    /* A host that does not resolve is the start-up check's to refuse, not the syntax's. */
    cr_assert_eq(LOAD("--data-listen", "nosuch.invalid:0"), 0, "%s", err.msg);
    cr_assert_eq(rf_daemon_cfg_check(&c, &k, &err), -EADDRNOTAVAIL);
    cr_assert(strstr(err.msg, "'data_listen' nosuch.invalid:0: cannot resolve 'nosuch.invalid': ")
              == err.msg, "%s", err.msg);
    cr_assert(strstr(err.msg, "; use an address of this machine that the other nodes can reach"),
              "%s", err.msg);
    unlink(key);
}

Test(cfg, missing_default_file_means_defaults_and_doubles_parse)
{
    rf_cfg_next next;
    small s = { 0 };
    char *argv[] = { "small", "--ratio=0.25", "--check-config", NULL };
    char *out;
    int rc;

    cr_assert_eq(rf_cfg_load(&small_table, &s, 2, argv, &next, &err), 0, "%s", err.msg);
    cr_assert_eq(next, RF_CFG_RUN);
    cr_assert_float_eq(s.ratio, 0.25, 1e-12);
    cr_assert_str_eq(s.name, "x");

    cr_assert_eq(rf_cfg_load(&small_table, &s, 2, (char *[]){ "small", "--ratio=1.5", NULL },
                             &next, &err), -EINVAL);
    cr_assert_str_eq(err.msg, "--ratio: 'ratio' must be between 0 and 1, got 1.5");
    cr_assert_eq(rf_cfg_load(&small_table, &s, 2, (char *[]){ "small", "--ratio=nan", NULL },
                             &next, &err), -EINVAL);
    cr_assert_str_eq(err.msg, "--ratio: 'ratio' must be a number between 0 and 1, got 'nan'");
    cr_assert_eq(rf_cfg_set(&small_table, &s, "nme", "y", "here", &err), -ENOENT);
    cr_assert_str_eq(err.msg, "here: unknown key 'nme' (did you mean 'name'?)");

    /* --check-config without a file still checks flags and says which file was missing. */
    run_argv = argv;
    run_argc = 3;
    out = capture_stdout(run_small, &next, &rc);
    cr_assert_eq(rc, 0, "%s", err.msg);
    cr_assert_eq(next, RF_CFG_EXIT);
    cr_assert_str_eq(out, "small: /nonexistent/small.conf (not found, defaults and flags): "
                          "configuration is valid\n");
    cr_assert_float_eq(small_obj.ratio, 0.25, 1e-12);
    rf_cfg_free(&small_table, &small_obj);
    rf_cfg_free(&small_table, &s);
    cr_assert_null(s.name);
}

Test(cfg, unreadable_file_bad_default_and_overlong_quoted_value)
{
    static const rf_cfg_key bad_keys[] = {
        { "n", RF_CFG_INT, 0, "0", 1, 9, 0, 0, NULL, 0, "A number." },
    };
    static const rf_cfg_table bad_table = {
        .program = "bad", .version = "1", .default_config = "/nonexistent/bad.conf",
        .keys = bad_keys, .nkeys = 1,
    };
    rf_cfg_next next;
    int obj = 0;
    char *big = malloc(1300);

    cr_assert_eq(LOAD("--config", dir), -EIO);
    cr_assert_str_eq(err.msg + strlen(err.msg) - strlen(dir), dir);

    cr_assert_eq(rf_cfg_load(&bad_table, &obj, 1, (char *[]){ "bad", NULL }, &next, &err),
                 -EINVAL);
    cr_assert_str_eq(err.msg, "built-in default of n: 'n' must be between 1 and 9, got 0");

    memset(big, 'x', 1299);
    big[0] = '"';
    big[1298] = '"';
    big[1299] = '\0';
    write_conf("");
    cr_assert_eq(LOAD("--node", big), -EINVAL);
    cr_assert_str_eq(err.msg, "--node: value of 'node' is too long");
    free(big);
}

/* The example configs list every key of their table once, commented out with its default:
 * uncommented they must load and give the defaults. Run from the repository root (make unit). */
static void check_example(int role, const char *example, const rf_cfg_table *t)
{
    FILE *in = fopen(example, "r"), *out;
    char line[512];
    int *count = calloc(t->nkeys, sizeof(int));
    rf_cfg_next next;

    cr_assert_not_null(in, "%s: %s (run the tests from the repository root)", example,
                       strerror(errno));
    out = fopen(conf, "w");
    cr_assert_not_null(out);
    while (fgets(line, sizeof(line), in)) {
        size_t n = strspn(line + 1, "abcdefghijklmnopqrstuvwxyz_");

        if (line[0] == '#' && n > 0 && strncmp(line + 1 + n, " =", 2) == 0) {
            for (size_t i = 0; i < t->nkeys; i++)
                if (strlen(t->keys[i].name) == n && strncmp(line + 1, t->keys[i].name, n) == 0)
                    count[i]++;
            fputs(line + 1, out);
        } else {
            fputs(line, out);
        }
    }
    fclose(in);
    fclose(out);
    for (size_t i = 0; i < t->nkeys; i++)
        cr_assert_eq(count[i], 1, "%s lists '%s' %d times", example, t->keys[i].name, count[i]);
    free(count);
    cr_assert_eq(load_role(role, &next, (char *)NULL), 0, "%s", err.msg);
    cr_assert_eq(c.staging_mib, 256);
    cr_assert_eq(c.verify, RF_VERIFY_SAMPLE);
}

Test(cfg, example_configs_list_every_key_with_its_default)
{
    check_example(RF_DAEMON_PUBLISHER, "systemd/publisherd.conf.example",
                  &rf_daemon_cfg_publisherd);
    check_example(RF_DAEMON_RECEIVER, "systemd/receiverd.conf.example", &rf_daemon_cfg_receiverd);
}
