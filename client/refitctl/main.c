/* client/refitctl/main.c - the operator's CLI: dispatches to one subcommand from a table. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"

typedef struct ctl_cmd {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
} ctl_cmd;

static const ctl_cmd cmds[] = {
    {"status", rf_ctl_status, "show a daemon's role, peers, clients, plan and last refit"},
    {"refit", rf_ctl_refit, "trigger a refit of a version from the operator side"},
    {"wait", rf_ctl_wait, "wait until a version is committed (or its refit aborted)"},
    {"watch", rf_ctl_watch, "show a refit's progress live (bytes, rate, stage)"},
    {"plan", rf_ctl_plan, "plan a refit offline on a synthetic model and explain it"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: refitctl [--socket PATH] COMMAND [OPTIONS]\n\n"
               "--socket PATH picks the daemon (default $REFIT_SOCKET, else %s, else %s).\n"
               "Exit status: 0 success, 1 the operation failed, 2 bad usage, 3 no daemon.\n"
               "\ncommands:\n", RF_CTL_SOCKET_PUB, RF_CTL_SOCKET_RECV);
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
        fprintf(f, "  %-10s %s\n", cmds[i].name, cmds[i].help);
    fprintf(f, "\n`refitctl COMMAND --help` describes a command's options.\n");
}

int main(int argc, char **argv)
{
    /* A global --socket before the command reaches every command through the environment. */
    while (argc >= 3 && strcmp(argv[1], "--socket") == 0) {
        setenv("REFIT_SOCKET", argv[2], 1);
        argv[2] = argv[0];
        argv += 2;
        argc -= 2;
    }
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
        if (strcmp(argv[1], cmds[i].name) == 0)
            return cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "refitctl: unknown command '%s'; `refitctl --help` lists them\n", argv[1]);
    return 2;
}
