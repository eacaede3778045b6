/* fuzz/fuzz.h - what the libFuzzer targets share: quiet logs, input cursors, and the scratch
 * directory for targets whose entry point reads a file. */
#ifndef RF_FUZZ_H
#define RF_FUZZ_H

#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Logs go to /dev/null (a target reaches every error message many times a second, and the
 * message is built either way, which is what we want fuzzed); FUZZ_LOG=1 keeps them. */
static inline void fuzz_quiet(void)
{
    static int done;
    int fd;

    if (done++)
        return;
    if (getenv("FUZZ_LOG") != NULL) {
        rf_log_init(RF_LOG_DEBUG, 0);
        return;
    }
    rf_log_init(RF_LOG_DEBUG, 0);
    fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (fd >= 0)
        rf_log_set_fd(fd);
}

static inline uint32_t fuzz_be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* A private directory for the process, made once (removed by nobody: it is under /tmp and
 * holds a few small files that each input rewrites). */
static inline const char *fuzz_dir(void)
{
    static char dir[64];

    if (dir[0] == '\0') {
        snprintf(dir, sizeof(dir), "/tmp/refit-fuzz.XXXXXX");
        if (mkdtemp(dir) == NULL) {
            perror("fuzz: mkdtemp /tmp/refit-fuzz.XXXXXX");
            abort();
        }
    }
    return dir;
}

/* Writes data to fuzz_dir()/name and returns the path (static buffer per call site name). */
static inline void fuzz_write_file(const char *path, const uint8_t *data, size_t size)
{
    FILE *f = fopen(path, "wb");

    if (f == NULL || (size > 0 && fwrite(data, 1, size, f) != size) || fclose(f) != 0) {
        perror(path);
        abort();
    }
}

#endif
