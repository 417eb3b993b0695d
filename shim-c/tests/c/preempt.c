/* Linked with -lckpt, run with CKPT_SIDECAR_PRELOAD=1: the constructor made
 * the default client (argv[1] == "connected") or recorded why not, and
 * installed the SIGTERM handler; one SIGTERM only sets the flag. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include "ckpt.h"

int main(int argc, char **argv) {
    int want_connected = argc > 1 && !strcmp(argv[1], "connected");
    ckpt_client *c = ckpt_default_client();
    printf("default client: %p (%s)\n", (void *)c, c ? "" : ckpt_last_error());
    if (want_connected != (c != NULL)) return 10;
    if (c && ckpt_close(c) != CKPT_E_INVALID) return 11; /* cannot close the default client */
    if (c && ckpt_connected(c) != 1) return 14;
    if (ckpt_preempted() != 0) return 12;
    raise(SIGTERM);
    if (ckpt_preempted() != 1) return 13;
    printf("preempted: %d\n", ckpt_preempted());
    return 0;
}
