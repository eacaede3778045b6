/* client/refitctl/ctl.h - the subcommands of refitctl. Each takes the arguments after
 * "refitctl" (argv[0] is the subcommand's name) and returns the process exit status:
 * 0 success, 1 the operation failed, 2 bad usage or input. */
#ifndef RF_CTL_H
#define RF_CTL_H

#define RF_CTL_SOCKET_PUB "/run/refit/publisherd.sock"
#define RF_CTL_SOCKET_RECV "/run/refit/receiverd.sock"
/* Exit status when no daemon answers on the socket. */
#define RF_CTL_EXIT_NODAEMON 3

int rf_ctl_plan(int argc, char **argv);
int rf_ctl_status(int argc, char **argv);
int rf_ctl_refit(int argc, char **argv);
int rf_ctl_wait(int argc, char **argv);
int rf_ctl_watch(int argc, char **argv);

#endif
