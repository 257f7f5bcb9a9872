/* The prefault thread in C (equeue/chunks/prefault.py says what it is for).
 *
 * Why in C: a Python thread needs the GIL to take each request and again after each
 * madvise, so every request costs the writer two GIL hand-offs. With 1 MiB windows a
 * writer of 100-byte records asks about 1,700 times a second (the log and its queue
 * chunk). This thread never touches Python: a request is a mutex, a slot and a signal.
 *
 * Requests are kept per mapping, newest only (a writer that outran the thread has
 * released the older windows behind it; faulting them in would bring them back). A
 * request names addresses, not a Python object, so a mapping must not be unmapped while
 * its request is pending or being served: forget() drops the pending one and waits
 * for one in progress, and Chunk calls it before it lets its mapping go. (Served after
 * an unmap, the range could belong to another mapping by then: MADV_POPULATE_WRITE
 * changes no bytes, but it would dirty that mapping's pages or allocate its holes.)
 *
 * Whether the kernel has MADV_POPULATE_WRITE (Linux 5.14+) is decided once, by a probe
 * on a private page: a request that fails later (ENOMEM, EFAULT) just faults nothing in.
 */
#include "speedups.h"

#include <errno.h>
#ifdef __GLIBC__
#endif
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

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

/* All under lock. */
static Request pending[PREFAULT_SLOTS];
static int pending_count;
static uintptr_t serving; /* the mapping whose request the thread is in madvise for; 0 */
static int started;
static int supported = -1; /* -1 until probed */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;   /* a request arrived */
static pthread_cond_t served = PTHREAD_COND_INITIALIZER; /* serving went back to 0 */

/* Per mapping, the end of the range populated last (the newest PREFAULT_SLOTS mappings;
 * one forgotten or pushed out is populated in full again, as before there was this).
 * Windows overlap by half (Chunk asks for the window past the writer every half window),
 * and a page already populated whose writeback a flush cleaned since is dirtied again by
 * MADV_POPULATE_WRITE (a write fault: page_mkwrite): under --flush sync each zero page was
 * written back twice, each time with a TLB-shootdown IPI to the writer's CPU (folio_mkclean).
 * Pages before the writer are never released (Chunk._release zaps a window behind it), so
 * what was populated stays faulted in, or stays written, until the writer passes it. */
typedef struct {
    uintptr_t mapping, end;
} Populated;
static Populated populated[PREFAULT_SLOTS]; /* under lock */
static int populated_count;

static int find_populated(uintptr_t mapping) {
    for (int i = 0; i < populated_count; i++)
        if (populated[i].mapping == mapping) return i;
    return -1;
}

static void forget_populated(uintptr_t mapping) {
    int i = find_populated(mapping);
    if (i < 0) return;
    memmove(&populated[i], &populated[i + 1],
            (size_t)(populated_count - i - 1) * sizeof(Populated));
    populated_count--;
}

static void note_populated(uintptr_t mapping, uintptr_t end) {
    forget_populated(mapping);
    if (populated_count == PREFAULT_SLOTS) { /* the oldest goes */
        memmove(&populated[0], &populated[1], (size_t)(PREFAULT_SLOTS - 1) * sizeof(Populated));
        populated_count--;
    }
    populated[populated_count++] = (Populated){mapping, end};
}

static void drop(int i) { /* keeps the others in request order */
    memmove(&pending[i], &pending[i + 1], (size_t)(pending_count - i - 1) * sizeof(Request));
    pending_count--;
}

static int find(uintptr_t mapping) {
    for (int i = 0; i < pending_count; i++)
        if (pending[i].mapping == mapping) return i;
    return -1;
}

static void *run(void *unused) {
    pthread_mutex_lock(&lock);
    for (;;) {
        while (pending_count == 0) pthread_cond_wait(&wake, &lock);
        Request r = pending[0];
        drop(0);
        serving = r.mapping;
        uintptr_t start = r.address, stop = r.address + r.length;
        int known = find_populated(r.mapping);
        if (known >= 0 && populated[known].end > start && populated[known].end <= stop)
            start = populated[known].end; /* the part populated last time is left as it is */
        pthread_mutex_unlock(&lock);
        /* The window into the page cache first, by one readahead of exactly that range
         * (zero pages from allocated, unwritten blocks: no I/O), then mapped writable.
         * The unwritten tail of a chunk is MADV_RANDOM (Chunk.open_for_write: no
         * read-around past the data), under which MADV_POPULATE_WRITE alone takes a
         * one-page major fault per page: 3.7-4.0 µs a page, 3.0-3.1 µs with the
         * readahead first (ext4, 512 KiB windows). At 1 KiB records the writer outran
         * this thread less (its own major faults 0.054-0.074 a message, not 0.082-0.099;
         * its system time 0.53-0.70 µs a message, not 0.73-0.87). */
        int ok = start >= stop;
        if (!ok) {
            (void)madvise((void *)start, stop - start, MADV_WILLNEED);
            ok = madvise((void *)start, stop - start, MADV_POPULATE_WRITE) == 0;
        }
        pthread_mutex_lock(&lock);
        if (ok) /* a failure (ENOMEM, EFAULT) leaves the next request the whole range */
            note_populated(r.mapping, stop);
        serving = 0;
        pthread_cond_broadcast(&served);
    }
    return NULL;
}

static int probe(void) {
    long page = sysconf(_SC_PAGESIZE);
    void *p = mmap(NULL, (size_t)page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return 0;
    int ok = madvise(p, (size_t)page, MADV_POPULATE_WRITE) == 0;
    munmap(p, (size_t)page);
    return ok;
}

/* A forked child has no thread and may have forked with the lock held. */
static void after_fork_in_child(void) {
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&wake, NULL);
    pthread_cond_init(&served, NULL);
    pending_count = 0;
    populated_count = 0;
    serving = 0;
    started = 0;
}

/* prefault_supported() -> bool: the kernel has MADV_POPULATE_WRITE. */
PyObject *prefault_supported(PyObject *self, PyObject *unused) {
    pthread_mutex_lock(&lock);
    if (supported < 0) supported = probe();
    int ok = supported;
    pthread_mutex_unlock(&lock);
    return PyBool_FromLong(ok);
}

static int as_address(PyObject *obj, void *out) { /* "O&": no silent wrap of a negative */
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    *(uintptr_t *)out = (uintptr_t)value;
    return 1;
}

/* prefault_request(mapping, address, length) -> bool: False when nothing will be done,
 * for good (no MADV_POPULATE_WRITE, or no thread could be started). */
PyObject *prefault_request(PyObject *self, PyObject *args) {
    uintptr_t mapping, address;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "O&O&n", as_address, &mapping, as_address, &address, &length))
        return NULL;
    long page = sysconf(_SC_PAGESIZE);
    if (mapping == 0 || address % (uintptr_t)page || length < 0 ||
        address + (size_t)length < address) {
        PyErr_Format(PyExc_ValueError,
                     "prefault_request: mapping %p, address %p and length %zd must be a "
                     "non-zero mapping, a page-aligned address and a range that does not wrap",
                     (void *)mapping, (void *)address, length);
        return NULL;
    }
    int ok = 1;
    pthread_mutex_lock(&lock);
    if (supported < 0) supported = probe();
    if (!supported) {
        ok = 0;
    } else if (length > 0) {
        int i = find(mapping);
        if (i >= 0)
            drop(i);
        else if (pending_count == PREFAULT_SLOTS)
            drop(0);
        pending[pending_count++] = (Request){mapping, address, (size_t)length};
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
    }
    pthread_mutex_unlock(&lock);
    return PyBool_FromLong(ok);
}

/* prefault_forget(mapping): the mapping is about to be unmapped. Drops its pending
 * request and waits (without the GIL) for the one being served, if it is this one's. */
PyObject *prefault_forget(PyObject *self, PyObject *arg) {
    uintptr_t mapping;
    if (!as_address(arg, &mapping)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&lock);
    int i = find(mapping);
    if (i >= 0) drop(i);
    while (serving == mapping && mapping != 0) pthread_cond_wait(&served, &lock);
    forget_populated(mapping); /* after the one served: a new mapping at this address
                                * starts with nothing populated */
    pthread_mutex_unlock(&lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* prefault_pending() -> [mapping, ...] of the requests not yet served: for the tests. */
PyObject *prefault_pending(PyObject *self, PyObject *unused) {
    uintptr_t copy[PREFAULT_SLOTS];
    pthread_mutex_lock(&lock);
    int n = pending_count;
    for (int i = 0; i < n; i++) copy[i] = pending[i].mapping;
    pthread_mutex_unlock(&lock);
    PyObject *list = PyList_New(n);
    for (int i = 0; list != NULL && i < n; i++) {
        PyObject *item = PyLong_FromUnsignedLongLong((unsigned long long)copy[i]);
        if (item == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, item);
    }
    return list;
}
