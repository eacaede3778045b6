/* fuzz/fuzz_cfg.c - the daemons' configuration reader (common/service/daemon_cfg.h over common/service/cfg.h
 * and libinih): any INI text as --config, then any --key=value flags, for both daemons; a
 * refusal must say why.
 * Input: the file's text, then optionally a NUL and NUL-separated command-line arguments
 * (--help, --version, --check-config and --config are left out: they print or name another
 * file). */
#include "daemon_cfg.h"
#include "fuzz.h"

#define MAX_ARGS 32

static bool skipped(const char *a)
{
    return strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0 || strcmp(a, "--version") == 0 ||
           strcmp(a, "-V") == 0 || strcmp(a, "--check-config") == 0 ||
           strncmp(a, "--config", 8) == 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static char path[160];
    char *args = NULL, *argv[MAX_ARGS + 3];
    const uint8_t *nul = memchr(data, 0, size);
    size_t text = nul ? (size_t)(nul - data) : size;
    int argc = 0, role;

    fuzz_quiet();
    if (path[0] == '\0')
        snprintf(path, sizeof(path), "%s/daemon.conf", fuzz_dir());
    fuzz_write_file(path, data, text);
    argv[argc++] = "refit-fuzz";
    argv[argc++] = "--config";
    argv[argc++] = path;
    if (nul != NULL) {
        size_t n = size - text - 1;
        char *p;

        /* A private copy, NUL-terminated, that argv can point into. */
        args = malloc(n + 1);
        if (args == NULL)
            return 0;
        memcpy(args, nul + 1, n);
        args[n] = '\0';
        for (p = args; p < args + n && argc < MAX_ARGS + 3; p += strlen(p) + 1)
            if (!skipped(p))
                argv[argc++] = p;
    }
    for (role = RF_DAEMON_PUBLISHER; role <= RF_DAEMON_RECEIVER; role++) {
        rf_daemon_cfg c;
        rf_cfg_next next;
        rf_err err = {0};

        if (rf_daemon_cfg_load(&c, role, argc, argv, &next, &err) < 0 && err.msg[0] == '\0') {
            fprintf(stderr, "fuzz_cfg: a refused configuration without a message\n");
            abort();
        }
        rf_daemon_cfg_free(&c);
    }
    free(args);
    return 0;
}
