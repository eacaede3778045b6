/* tests/unit/test_srcmap.c - a receiverd's map of the trainers' memory on its host, against a real
 * refit-publisherd with a real simulated trainer (processes of this build, host memory): one
 * fetch per publisher generation however often a plan asks, another generation refused as stale,
 * the wrong key or no socket refused with a message, prune releasing what no plan names. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <netinet/in.h>
#include <sys/socket.h>

#include "export.h"
#include "srcmap.h"

extern char **environ;

static char dir[] = "/tmp/refit-srcmap.XXXXXX";
static char sock[PATH_MAX], keyfile[PATH_MAX];
static uint8_t key[64]; /* the key file's bytes: 64 hex digits, as daemons read it */
static pid_t pub = -1, trainer = -1;
static int trainer_out = -1; /* the trainer's stdout */

static void bin_path(const char *name, char *out, size_t len)
{
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);

    cr_assert_gt(n, 0);
    self[n] = '\0';
    *strrchr(self, '/') = '\0'; /* build/tests */
    *strrchr(self, '/') = '\0'; /* build */
    snprintf(out, len, "%s/%s", self, name);
}

/* Starts argv with stderr (and stdout unless out) appended to log; with out, *out reads its
 * stdout. */
static pid_t spawn(char *const argv[], const char *log, int *out)
{
    posix_spawn_file_actions_t fa;
    int p[2] = {-1, -1};
    pid_t pid;

    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, log, O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (out) {
        cr_assert_eq(pipe2(p, O_CLOEXEC), 0);
        posix_spawn_file_actions_adddup2(&fa, p[1], 1);
    } else {
        posix_spawn_file_actions_adddup2(&fa, 2, 1);
    }
    cr_assert_eq(posix_spawn(&pid, argv[0], &fa, NULL, argv, environ), 0, "%s", argv[0]);
    posix_spawn_file_actions_destroy(&fa);
    if (out) {
        close(p[1]);
        *out = p[0];
    }
    return pid;
}

/* The publisherd's export once its trainer sealed: the trainer says "registered" on its stdout
 * after its Seal was answered (waited for by reading, at most 60 s). */
static rf_export *export_when_sealed(void)
{
    char buf[4096];
    size_t len = 0;
    rf_export *e = NULL;
    rf_err err = {0};

    while (!memmem(buf, len, " registered ", 12)) {
        struct pollfd pfd = {.fd = trainer_out, .events = POLLIN};
        ssize_t n;

        cr_assert_eq(poll(&pfd, 1, 60000), 1, "the trainer did not register within 60 s");
        n = read(trainer_out, buf + len, sizeof(buf) - len);
        cr_assert_gt(n, 0, "the trainer exited before it registered (see %s/trainer.log)", dir);
        len += (size_t)n;
        cr_assert_lt(len, sizeof(buf));
    }
    cr_assert_eq(rf_export_fetch(sock, key, sizeof(key), NULL, 0, 5.0, &e, &err), 0, "%s",
                 err.msg);
    return e;
}

/* A port free on loopback now, for the coordinator the publisherd's own node connects to. */
static int free_port(void)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(a);
    int fd = socket(AF_INET, SOCK_STREAM, 0), port;

    cr_assert_geq(fd, 0);
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    port = ntohs(a.sin_port);
    close(fd);
    return port;
}

static void setup(void)
{
    char pubbin[PATH_MAX], trbin[PATH_MAX], log[PATH_MAX + 16], hex[65], coord[32];
    FILE *f;

    cr_assert_not_null(mkdtemp(dir));
    snprintf(sock, sizeof(sock), "%s/pub.sock", dir);
    snprintf(keyfile, sizeof(keyfile), "%s/cluster.key", dir);
    for (size_t i = 0; i < 32; i++)
        snprintf(hex + 2 * i, 3, "%02x", (unsigned)(0x30 + i));
    memcpy(key, hex, sizeof(key));
    f = fopen(keyfile, "w");
    cr_assert_not_null(f);
    fputs(hex, f);
    fclose(f);
    chmod(keyfile, 0600);
    bin_path("refit-publisherd", pubbin, sizeof(pubbin));
    bin_path("refit-sim-trainer", trbin, sizeof(trbin));
    snprintf(log, sizeof(log), "%s/pub.log", dir);
    snprintf(coord, sizeof(coord), "127.0.0.1:%d", free_port());
    pub = spawn((char *[]){pubbin, "--coordinator", "--coordinator-addr", coord,
                           "--cluster-key-file", keyfile, "--socket", sock, "--status-listen", "",
                           "--clients", "1", NULL}, log, NULL);
    snprintf(log, sizeof(log), "%s/trainer.log", dir);
    trainer = spawn((char *[]){trbin, "--socket", sock, "--model", "qwen3-0.6b", "--shrink", "16",
                               "--layout", "tp=1", "--hold", "1", NULL}, log, &trainer_out);
}

static void teardown(void)
{
    if (trainer > 0)
        kill(trainer, SIGKILL), waitpid(trainer, NULL, 0);
    if (pub > 0)
        kill(pub, SIGTERM), waitpid(pub, NULL, 0);
    if (trainer_out >= 0)
        close(trainer_out);
    for (const char *const *n = (const char *const[]){"pub.log", "trainer.log", "cluster.key",
                                                       "pub.sock", NULL}; *n; n++) {
        char p[PATH_MAX + 32];

        snprintf(p, sizeof(p), "%s/%s", dir, *n);
        unlink(p);
    }
    rmdir(dir);
}

TestSuite(srcmap, .init = setup, .fini = teardown, .timeout = 120);

Test(srcmap, one_fetch_per_generation_stale_and_refusals)
{
    rf_export *e = export_when_sealed();
    uint64_t gen = e->generation;
    rf_srcmap *m = NULL, *bad = NULL;
    rf_slice_src a = {0}, b = {0};
    rf_slice_job keep;
    rf_err err = {0};
    uint32_t p0[1] = {0}, p[2];
    rf_piece first, other;
    uint32_t np, i;

    cr_assert_gt(e->nregions, 1, "the trainer holds several regions");
    /* A piece in another region than piece 0's. */
    np = rf_inv_npieces(e->inv, RF_SRC);
    rf_inv_piece(e->inv, RF_SRC, 0, &first);
    for (i = 1; i < np; i++) {
        rf_inv_piece(e->inv, RF_SRC, i, &other);
        if (other.region != first.region)
            break;
    }
    cr_assert_lt(i, np, "no piece outside piece 0's region");
    rf_export_free(e);
    cr_assert_eq(rf_srcmap_new(key, 0, 5.0, &m, &err), -EINVAL);
    cr_assert_eq(rf_srcmap_new(key, sizeof(key), 5.0, &m, &err), 0, "%s", err.msg);

    /* Mapped once, the region of the piece asked for and no other; the same piece again is
     * the same mapping, without a fetch. */
    cr_assert_eq(rf_srcmap_get(m, 42, gen, sock, p0, 1, &a, &err), 0, "%s", err.msg);
    p0[0] = 0;
    cr_assert_eq(rf_srcmap_get(m, 42, gen, sock, p0, 1, &b, &err), 0, "%s", err.msg);
    cr_assert_eq(a.inv, b.inv);
    cr_assert_eq(a.bases, b.bases);
    cr_assert_eq(rf_srcmap_fetches(m), 1);
    cr_assert_eq(rf_srcmap_count(m), 1);
    cr_assert_gt(rf_inv_npieces(a.inv, RF_SRC), 0);
    cr_assert_not_null(a.bases[first.region]);
    cr_assert_null(a.bases[other.region], "a region no asked piece lies in was mapped");
    /* A later frame that reads more asks for what is missing only, once. */
    p[0] = i;
    p[1] = 0;
    cr_assert_eq(rf_srcmap_get(m, 42, gen, sock, p, 2, &b, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_srcmap_fetches(m), 2);
    cr_assert_eq(b.bases, a.bases);
    cr_assert_not_null(a.bases[other.region]);
    p[0] = i;
    p[1] = 0;
    cr_assert_eq(rf_srcmap_get(m, 42, gen, sock, p, 2, &b, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_srcmap_fetches(m), 2);

    /* A plan built on another generation of the trainers: stale, nothing kept. */
    cr_assert_eq(rf_srcmap_get(m, 42, gen + 1, sock, p0, 1, &b, &err), -ESTALE);
    cr_assert(strstr(err.msg, "its trainers changed"), "%s", err.msg);
    cr_assert_eq(rf_srcmap_count(m), 1);
    cr_assert_eq(rf_srcmap_fetches(m), 3);

    /* No socket announced, nobody listening, the wrong key. */
    cr_assert_eq(rf_srcmap_get(m, 43, gen, "", p0, 1, &b, &err), -EPROTO);
    cr_assert(strstr(err.msg, "announced no socket"), "%s", err.msg);
    cr_assert_lt(rf_srcmap_get(m, 43, gen, "/nonexistent/pub.sock", p0, 1, &b, &err), 0);
    cr_assert(strstr(err.msg, "/nonexistent/pub.sock"), "%s", err.msg);
    cr_assert_eq(rf_srcmap_new((const uint8_t *)"another key of at least 32 bytes!", 33, 5.0, &bad,
                               &err), 0);
    cr_assert_eq(rf_srcmap_get(bad, 42, gen, sock, p0, 1, &b, &err), -EACCES, "%s", err.msg);
    rf_srcmap_free(bad);

    /* A plan that names the publisher at that generation keeps it; one that does not, not. */
    rf_slice_job_init(&keep);
    keep.npeers = 1;
    keep.peers = &(rf_slice_peer){.daemon_id = 42, .generation = gen};
    rf_srcmap_prune(m, &keep);
    cr_assert_eq(rf_srcmap_count(m), 1);
    keep.peers = &(rf_slice_peer){.daemon_id = 42, .generation = gen + 1};
    rf_srcmap_prune(m, &keep);
    cr_assert_eq(rf_srcmap_count(m), 0);
    cr_assert_eq(rf_srcmap_get(m, 42, gen, sock, p0, 1, &a, &err), 0, "%s", err.msg);
    cr_assert_eq(rf_srcmap_fetches(m), 4);
    rf_srcmap_free(m);
}
