/* client/refitctl/main.c - the operator's CLI: dispatches to one subcommand from a table. */
#include <stdio.h>
#include <string.h>

#include "ctl.h"

typedef struct ctl_cmd {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
} ctl_cmd;

static const ctl_cmd cmds[] = {
    {"plan", rf_ctl_plan, "plan a refit offline on a synthetic model and explain it"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: refitctl COMMAND [OPTIONS]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
        fprintf(f, "  %-10s %s\n", cmds[i].name, cmds[i].help);
    fprintf(f, "\n`refitctl COMMAND --help` describes a command's options.\n");
}

int main(int argc, char **argv)
{
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
