/* client/refitctl/ctl.h - the subcommands of refitctl. Each takes the arguments after
 * "refitctl" (argv[0] is the subcommand's name) and returns the process exit status:
 * 0 success, 1 the operation failed, 2 bad usage or input. */
#ifndef RF_CTL_H
#define RF_CTL_H

int rf_ctl_plan(int argc, char **argv);

#endif
