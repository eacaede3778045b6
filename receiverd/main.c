/* receiverd/main.c - refit-receiverd: serves the engine workers of one inference node and
 * installs received weights straight into the buffers they exported. */
#include "daemon.h"

int main(int argc, char **argv)
{
    return rf_daemon_main(RF_DAEMON_RECEIVER, argc, argv, NULL);
}
