/* common/service/cfg.h - one table of config keys per program: defaults, INI file (libinih), then
 * --key=value flags, every value checked against its type and bounds before start-up. */
#ifndef RF_CFG_H
#define RF_CFG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/types.h>

#include "err.h"

/* Exit status for a daemon whose configuration is invalid at start-up (sysexits EX_CONFIG);
 * the units name it in RestartPreventExitStatus= so a bad file does not restart-loop. */
#define RF_CFG_EXIT_CONFIG 78

typedef enum rf_cfg_type {
    RF_CFG_STRING,   /* char * (malloc'd); max > 0: at most max bytes */
    RF_CFG_INT,      /* int, between min and max; the key name carries the unit (_ms, _mib) */
    RF_CFG_BOOL,     /* bool: true/false, yes/no, on/off, 1/0 */
    RF_CFG_DOUBLE,   /* double, between dmin and dmax */
    RF_CFG_ENUM,     /* int: index into names */
    RF_CFG_HOSTPORT, /* char *: an address as rf_addr_parse takes it to listen on ("host:port",
                        "[v6addr]:port", ":port"), port between min and max; "" only with
                        RF_CFG_EMPTY_OK */
    RF_CFG_UIDS,     /* rf_cfg_uids: comma/space separated uids or user names */
} rf_cfg_type;

/* Flags of a key. */
#define RF_CFG_EMPTY_OK 0x1 /* STRING/HOSTPORT: "" is a valid value */
#define RF_CFG_WORD     0x2 /* STRING: one word of printable ASCII (0x21..0x7e): no spaces,
                               control characters or other bytes, which would change how a
                               log line, a status document or a comparison reads it */

typedef struct rf_cfg_uids {
    size_t n;
    uid_t *v;
} rf_cfg_uids;

typedef struct rf_cfg_key {
    const char *name;          /* lower_snake_case; flag --name or --na-me */
    rf_cfg_type type;
    size_t offset;             /* of the field in the program's config struct */
    const char *def;           /* default, in file syntax; parsed and checked like a value */
    long long min, max;        /* INT bounds; HOSTPORT port bounds; STRING max length */
    double dmin, dmax;         /* DOUBLE bounds */
    const char *const *names;  /* ENUM: NULL-terminated value names */
    unsigned flags;
    const char *help;
} rf_cfg_key;

typedef struct rf_cfg_table {
    const char *program;          /* "refit-publisherd" */
    const char *version;          /* printed by --version */
    const char *default_config;   /* read when --config is not given; may be absent */
    const char *const *sections;  /* NULL-terminated INI sections whose keys we read; keys
                                     before the first section header are read too */
    const rf_cfg_key *keys;
    size_t nkeys;
    /* Checks across keys and fills computed values, after file and flags; 0 or an error. */
    int (*finish)(void *obj, rf_err *err);
    /* Checks what start-up would refuse beyond the keys themselves (files, paths, addresses),
     * without side effects; run by --check-config after finish. May be NULL. The program
     * calls the same function before it starts, so that the two refuse the same things. */
    int (*check)(void *obj, rf_err *err);
} rf_cfg_table;

typedef enum rf_cfg_next {
    RF_CFG_RUN = 0,  /* start the program with the loaded config */
    RF_CFG_EXIT = 1, /* --help, --version or a successful --check-config: exit 0 */
} rf_cfg_next;

/* Loads obj (the program's config struct, zeroed by the caller) from the defaults, the config
 * file (--config PATH or table->default_config; a missing default file is not an error, a
 * missing --config file is), then the flags of argv, then table->finish.
 * --help and --version print to stdout; --check-config also runs table->check and prints
 * "PATH: configuration is valid" once everything checked out. Returns 0 with *next, or a
 * negative errno with err naming the file and line or the flag ("publisherd.conf:12:
 * unknown key 'stagin_mib' (did you mean 'staging_mib'?)"); the caller prints it and exits 1
 * under --check-config (see rf_cfg_check_only) and RF_CFG_EXIT_CONFIG otherwise. obj must be
 * released with rf_cfg_free, also after an error. */
int rf_cfg_load(const rf_cfg_table *t, void *obj, int argc, char **argv, rf_cfg_next *next,
                rf_err *err);

/* Whether argv asks for --check-config (to pick the exit status after an error). */
bool rf_cfg_check_only(int argc, char **argv);

/* Sets one key from text, as a file line would (the name may use dashes). where prefixes
 * error messages ("publisherd.conf:3", "--staging-mib"). 0, -ENOENT (unknown key), -EINVAL. */
int rf_cfg_set(const rf_cfg_table *t, void *obj, const char *name, const char *value,
               const char *where, rf_err *err);

/* Prints usage and every key with type, bounds, default and help. */
void rf_cfg_print_help(const rf_cfg_table *t, FILE *f);

/* Frees the strings and lists the table's keys own inside obj. */
void rf_cfg_free(const rf_cfg_table *t, void *obj);

#endif
