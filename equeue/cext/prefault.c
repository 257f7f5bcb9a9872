/* The prefault thread in C (equeue/chunks/prefault.py says what it is for).
 *
 * Why in C: a Python thread needs the GIL to take each request and again after each
 * madvise, so every request costs the writer two GIL hand-offs. With 1 MiB windows a
 * writer of 100-byte records asks about 1,700 times a second (the log and its queue
 * chunk), and the hand-offs cost more than the page faults they save. This thread never
 * touches Python: a request is a mutex, a slot and a signal.
 *
 * Requests are kept per mapping, newest only (a writer that outran the thread has
 * released the older windows behind it; faulting them in would bring them back). A
 * request names addresses, not a Python object: the mapping may be closed before the
 * thread gets to it, and then madvise fails with ENOMEM and nothing happens (a reused
 * address range is faulted in for writing, which changes no bytes). forget() drops the
 * pending request of a mapping that is being closed.
 */
#include "speedups.h"

#include <errno.h>
#include <pthread.h>
#include <sys/mman.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* More mappings written at once than this (each topic's queue has a chunk open) only
 * drops the oldest pending request: a missed prefault costs page faults, nothing else. */
#define PREFAULT_SLOTS 64

typedef struct {
    uintptr_t mapping, address;
    size_t length;
} Request;

static Request pending[PREFAULT_SLOTS];
static int pending_count;
static int started;
static volatile int unsupported; /* the kernel lacks MADV_POPULATE_WRITE (before 5.14) */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;

static void drop(int i) { /* under lock; keeps the others in request order */
    memmove(&pending[i], &pending[i + 1], (size_t)(pending_count - i - 1) * sizeof(Request));
    pending_count--;
}

static int find(uintptr_t mapping) { /* under lock */
    for (int i = 0; i < pending_count; i++)
        if (pending[i].mapping == mapping) return i;
    return -1;
}

static void *run(void *unused) {
    for (;;) {
        pthread_mutex_lock(&lock);
        while (pending_count == 0) pthread_cond_wait(&wake, &lock);
        Request r = pending[0];
        drop(0);
        pthread_mutex_unlock(&lock);
        if (madvise((void *)r.address, r.length, MADV_POPULATE_WRITE) != 0 && errno == EINVAL)
            unsupported = 1;
    }
    return NULL;
}

/* A forked child has no thread and may have forked with the lock held. */
static void after_fork_in_child(void) {
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&wake, NULL);
    pending_count = 0;
    started = 0;
}

/* prefault_request(mapping, address, length) -> bool: False once the kernel has shown
 * it lacks MADV_POPULATE_WRITE (the caller stops asking) or the thread cannot start. */
PyObject *prefault_request(PyObject *self, PyObject *args) {
    unsigned long long mapping, address;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "KKn", &mapping, &address, &length)) return NULL;
    if (unsupported) Py_RETURN_FALSE;
    if (length <= 0) Py_RETURN_TRUE;
    int ok = 1;
    pthread_mutex_lock(&lock);
    int i = find((uintptr_t)mapping);
    if (i >= 0)
        drop(i);
    else if (pending_count == PREFAULT_SLOTS)
        drop(0);
    pending[pending_count++] = (Request){(uintptr_t)mapping, (uintptr_t)address, (size_t)length};
    if (!started) {
        static int registered;
        pthread_t thread;
        pthread_attr_t attr;
        if (!registered) registered = pthread_atfork(NULL, NULL, after_fork_in_child) == 0;
        ok = pthread_attr_init(&attr) == 0;
        if (ok) {
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            pthread_attr_setstacksize(&attr, 64 * 1024); /* it calls madvise, nothing else */
            ok = pthread_create(&thread, &attr, run, NULL) == 0;
            pthread_attr_destroy(&attr);
        }
        started = ok;
        if (!ok) pending_count = 0;
    }
    pthread_cond_signal(&wake);
    pthread_mutex_unlock(&lock);
    if (!ok) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* prefault_forget(mapping): the mapping is being closed; drop its pending request. */
PyObject *prefault_forget(PyObject *self, PyObject *arg) {
    unsigned long long mapping = PyLong_AsUnsignedLongLong(arg);
    if (mapping == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    pthread_mutex_lock(&lock);
    int i = find((uintptr_t)mapping);
    if (i >= 0) drop(i);
    pthread_mutex_unlock(&lock);
    Py_RETURN_NONE;
}
