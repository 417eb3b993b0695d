/* fork() with a connected client (a data-loader worker, a shell-out).
 * argv[1] == "calls": the child's calls fail with CKPT_E_CLOSED and closing
 * there touches nothing of the parent's; the parent carries on.
 * argv[1] == "orphan": the parent exits at once while the child lives on
 * (until its stdin closes); the sidecar must still see the parent's
 * connection end. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "ckpt.h"

int main(int argc, char **argv) {
    int orphan = argc > 1 && !strcmp(argv[1], "orphan");
    ckpt_client *c = NULL;
    void *mem = NULL;
    if (ckpt_connect(NULL, &c) || ckpt_alloc(c, 4096, &mem)) return 10;
    uint64_t shape[1] = {64};
    ckpt_tensor t = {"w", "U8", shape, 1, mem, 64};
    uint64_t id;
    if (ckpt_save(c, 1, &t, 1, NULL, 0, &id) || ckpt_wait(c, id, CKPT_DURABLE, 10000)) return 11;
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) return 12;
    if (pid == 0) {
        size_t n = 0;
        if (ckpt_list(c, NULL, 0, &n, NULL) != CKPT_E_CLOSED) _exit(20);
        if (!strstr(ckpt_last_error(), "fork")) _exit(21);
        if (ckpt_save(c, 2, &t, 1, NULL, 0, &id) != CKPT_E_CLOSED) _exit(22);
        if (orphan) {
            /* Lives until the test closes the pipe on stdin (after it saw
             * the session end), not for a fixed time. */
            char b;
            while (read(0, &b, 1) > 0) {}
            _exit(0);
        }
        if (ckpt_close(c) != CKPT_OK) _exit(23);
        exit(0); /* atexit handlers run in the child too */
    }
    if (orphan) _exit(0);
    int status = 0;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "child failed: status %d\n", status);
        return 13;
    }
    size_t n = 0;
    if (ckpt_list(c, NULL, 0, &n, NULL) != CKPT_OK || n != 1) return 14;
    if (ckpt_save(c, 2, &t, 1, NULL, 0, &id) || ckpt_wait(c, id, CKPT_DURABLE, 10000)) return 15;
    if (ckpt_close(c) != CKPT_OK) return 16;
    printf("ok\n");
    return 0;
}
