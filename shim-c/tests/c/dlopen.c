/* dlopen()s libckpt.so (path in argv[1]) and calls into it by dlsym, as a
 * Python ctypes or a plugin loader would. Exit 0 when everything held. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef const char *(*str_fn)(void);
typedef int (*connect_fn)(const char *, void **);

int main(int argc, char **argv) {
    if (argc < 2) return 10;
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 11; }
    str_fn version = (str_fn)dlsym(h, "ckpt_version");
    str_fn last_error = (str_fn)dlsym(h, "ckpt_last_error");
    connect_fn connect = (connect_fn)dlsym(h, "ckpt_connect");
    if (!version || !last_error || !connect) { fprintf(stderr, "dlsym failed\n"); return 12; }
    printf("version: %s\n", version());
    if (strncmp(version(), "libckpt ", 8) != 0) return 13;
    if (strcmp(last_error(), "") != 0) return 14;
    void *c = NULL;
    int rc = connect("/nonexistent/ckpt.sock", &c);
    printf("connect: %d %s\n", rc, last_error());
    if (rc != -2 || c != NULL) return 15;
    if (!strstr(last_error(), "/nonexistent/ckpt.sock")) return 16;
    rc = connect(NULL, NULL); /* NULL out-pointer: an error, not a crash */
    if (rc != -1 || !strstr(last_error(), "NULL")) return 17;
    dlclose(h);
    printf("ok\n");
    return 0;
}
