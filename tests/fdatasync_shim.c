/* LD_PRELOAD shim for tests/test_groupcommit_trace.py: wraps fdatasync.
 * FDS_TRACE=FILE: appends "thread-name<TAB>begin-ns<TAB>end-ns<TAB>rc<TAB>target" per call
 * (CLOCK_MONOTONIC, time.monotonic_ns()'s clock; the target is /proc/self/fd/N's link).
 * FDS_EINTR_ONCE=1: the first call on the thread named "equeue-flush" returns -1/EINTR. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int interrupted;

static long long ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    char name[16] = "", link[64], target[512] = "";
    pthread_getname_np(pthread_self(), name, sizeof name);
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n > 0) target[n] = 0;
    long long begin = ns();
    int rc, saved;
    const char *once = getenv("FDS_EINTR_ONCE");
    pthread_mutex_lock(&mu);
    int interrupt = once && !interrupted && strcmp(name, "equeue-flush") == 0;
    if (interrupt) interrupted = 1;
    pthread_mutex_unlock(&mu);
    if (interrupt) {
        rc = -1;
        saved = EINTR;
    } else {
        rc = real(fd);
        saved = errno;
    }
    long long end = ns();
    const char *out = getenv("FDS_TRACE");
    if (out) {
        pthread_mutex_lock(&mu);
        FILE *f = fopen(out, "a");
        if (f) {
            fprintf(f, "%s\t%lld\t%lld\t%d\t%s\n", name, begin, end, rc == 0 ? 0 : saved, target);
            fclose(f);
        }
        pthread_mutex_unlock(&mu);
    }
    errno = saved;
    return rc;
}
