/* The broker's group-commit flusher in C (equeue/server/groupcommit.py, CSync).
 *
 * Why in C: a Python flusher thread needs the GIL after each fdatasync (its bookkeeping
 * and call_soon_threadsafe), and the event loop's thread holds it through a busy turn
 * (uvloop lets it go only in its poll; CPython hands it to a waiting thread only after
 * sys.getswitchinterval()). So a flush's answers waited for the loop to go idle, and
 * the loop's reading of the next cohort could not overlap the fdatasync of the last.
 * This thread never touches Python: it takes a file descriptor, fdatasyncs it, notes
 * the outcome and writes to an eventfd the loop watches (loop.add_reader); all the
 * bookkeeping (what is now durable, a failure's consequences) is done on the loop.
 *
 * One flush at a time: start() while one is in progress is refused. The descriptor is
 * dup'ed, so a chunk completed and closed by the loop meanwhile cannot hand this thread
 * a reused number. A timerfd (µs resolution, which the loops' own timers lack: uvloop
 * truncates to ms) bounds the group-commit wait.
 *
 * Linux only (eventfd, timerfd, pthread_setname_np): elsewhere Flusher() raises
 * NotImplementedError and the broker uses its Python flusher thread (flushers.py), while
 * the rest of the accelerator still builds.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include "speedups.h"

#ifdef __linux__

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define FLUSHER_THREAD_NAME "equeue-flush" /* at most 15 bytes */

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int running;  /* the thread was started and not yet joined */
    int event_fd; /* readable once a flush ended */
    int timer_fd; /* readable once the armed wait's bound passed */
    /* under lock */
    int job;      /* the dup'ed descriptor to fdatasync; -1: none */
    int busy;     /* a flush was started and its outcome not yet collected */
    int done;     /* ...and it ended */
    int error;    /* its errno; 0: it succeeded */
    double took;  /* its fdatasync's seconds */
    double ended; /* when it ended (CLOCK_MONOTONIC, time.monotonic()'s clock) */
    int stopping;
    pid_t owner; /* the process that started the thread: a forked child has no thread */
} Flusher;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void *run(void *arg) {
    Flusher *self = arg;
    pthread_mutex_lock(&self->lock);
    for (;;) {
        while (self->job < 0 && !self->stopping) pthread_cond_wait(&self->wake, &self->lock);
        if (self->job < 0) break; /* stopping, nothing left to flush */
        int fd = self->job;
        self->job = -1;
        pthread_mutex_unlock(&self->lock);
        double began = now_s();
        /* EINTR is no write failure (Python's os.fdatasync retries it too: PEP 475); on
         * NFS, CIFS or FUSE a signal can interrupt it, though this thread blocks them all */
        int rc;
        do rc = fdatasync(fd);
        while (rc < 0 && errno == EINTR);
        int error = rc == 0 ? 0 : errno;
        double ended = now_s();
        close(fd);
        pthread_mutex_lock(&self->lock);
        self->error = error;
        self->took = ended - began;
        self->ended = ended;
        self->done = 1;
        pthread_mutex_unlock(&self->lock);
        /* Written with the lock let go: the loop, woken by it, takes the lock at once in
         * collect(); held here, it found the lock taken in a quarter of the cycles of a
         * shared client and slept on it (a futex wait, and this thread's wake of it) until
         * this thread reached its cond_wait (docs/benchmarks.md, "durable", round 18). The
         * outcome is in place before the write, and stop() joins this thread before it
         * closes the eventfd. A full counter (2^64 - 2 unread) cannot happen: the loop
         * reads it every flush. */
        uint64_t one = 1;
        if (write(self->event_fd, &one, sizeof one) < 0) { /* nothing else to tell */
        }
        pthread_mutex_lock(&self->lock);
    }
    pthread_mutex_unlock(&self->lock);
    return NULL;
}

static int Flusher_init(Flusher *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist)) return -1;
    if (self->event_fd >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "Flusher initialised twice");
        return -1;
    }
    self->job = -1;
    self->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (self->event_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->timer_fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (self->timer_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    /* Every signal blocked on the thread (it inherits the mask): the process's signals
     * go to the threads that handle them, as before there was this one. */
    sigset_t all, before;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &before);
    int rc = pthread_create(&self->thread, NULL, run, self);
    pthread_sigmask(SIG_SETMASK, &before, NULL);
    if (rc != 0) {
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->running = 1;
    self->owner = getpid();
    /* named here, not by the thread: the name (ps, /proc/PID/task/N/comm) is there as soon
     * as Flusher() returns */
    pthread_setname_np(self->thread, FLUSHER_THREAD_NAME);
    return 0;
}

static PyObject *Flusher_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Flusher *self = (Flusher *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->event_fd = self->timer_fd = self->job = -1;
        pthread_mutex_init(&self->lock, NULL);
        pthread_cond_init(&self->wake, NULL);
    }
    return (PyObject *)self;
}

/* start(fd): fdatasync fd on the thread; the eventfd tells when it ended. */
static PyObject *Flusher_start(Flusher *self, PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    if (fd < 0 || fd > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "no file descriptor: %ld", fd);
        return NULL;
    }
    if (!self->running) {
        PyErr_SetString(PyExc_RuntimeError, "the flusher is closed");
        return NULL;
    }
    if (self->owner != getpid()) {
        PyErr_SetString(PyExc_RuntimeError,
                        "the flusher was started in the parent of this forked process, its "
                        "thread does not run here");
        return NULL;
    }
    pthread_mutex_lock(&self->lock);
    int busy = self->busy;
    pthread_mutex_unlock(&self->lock);
    if (busy) {
        PyErr_SetString(PyExc_RuntimeError, "a flush is in progress already");
        return NULL;
    }
    int copy = fcntl((int)fd, F_DUPFD_CLOEXEC, 0);
    if (copy < 0) return PyErr_SetFromErrno(PyExc_OSError);
    pthread_mutex_lock(&self->lock);
    self->job = copy;
    self->busy = 1;
    self->done = 0;
    pthread_cond_signal(&self->wake);
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

/* collect() -> (errno, seconds, when it ended) of the flush that ended, or None. */
static PyObject *Flusher_collect(Flusher *self, PyObject *unused) {
    uint64_t count;
    if (self->event_fd >= 0 && read(self->event_fd, &count, sizeof count) < 0 &&
        errno != EAGAIN) /* nothing to read: the loop's reader ran for an older write */
        return PyErr_SetFromErrno(PyExc_OSError);
    pthread_mutex_lock(&self->lock);
    int done = self->done, error = self->error;
    double took = self->took, ended = self->ended;
    if (done) self->busy = self->done = 0;
    pthread_mutex_unlock(&self->lock);
    if (!done) Py_RETURN_NONE;
    return Py_BuildValue("(idd)", error, took, ended);
}

/* arm(us): the timer fd becomes readable in us µs (0: disarm). An expiry not yet read is
 * dropped: timerfd_settime zeroes the count (Linux's timerfd_setup), so no read first. */
static PyObject *Flusher_arm(Flusher *self, PyObject *arg) {
    long long us = PyLong_AsLongLong(arg);
    if (us == -1 && PyErr_Occurred()) return NULL;
    if (us < 0) us = 0;
    struct itimerspec spec = {{0, 0}, {(time_t)(us / 1000000), (long)(us % 1000000) * 1000}};
    if (self->timer_fd < 0) {
        PyErr_SetString(PyExc_RuntimeError, "the flusher is closed");
        return NULL;
    }
    if (timerfd_settime(self->timer_fd, 0, &spec, NULL) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* expired() -> whether the armed bound passed (reads the timer fd). */
static PyObject *Flusher_expired(Flusher *self, PyObject *unused) {
    uint64_t count = 0;
    if (self->timer_fd < 0 || read(self->timer_fd, &count, sizeof count) < 0) count = 0;
    return PyBool_FromLong(count > 0);
}

static void stop(Flusher *self) {
    if (self->running && self->owner != getpid()) {
        /* A forked child's copy: the thread (and whoever held the lock at the fork) is the
         * parent's; joining it would block forever. Only this process's descriptors go. */
        self->running = 0;
        if (self->job >= 0) close(self->job);
        self->job = -1;
        pthread_mutex_init(&self->lock, NULL);
        pthread_cond_init(&self->wake, NULL);
    }
    if (self->running) {
        pthread_mutex_lock(&self->lock);
        self->stopping = 1;
        pthread_cond_signal(&self->wake);
        pthread_mutex_unlock(&self->lock);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(self->thread, NULL); /* after a flush in progress ends */
        Py_END_ALLOW_THREADS
        self->running = 0;
    }
    if (self->event_fd >= 0) close(self->event_fd);
    if (self->timer_fd >= 0) close(self->timer_fd);
    self->event_fd = self->timer_fd = -1;
}

/* close(): once a flush in progress ended; its outcome is not collected. */
static PyObject *Flusher_close(Flusher *self, PyObject *unused) {
    stop(self);
    Py_RETURN_NONE;
}

static void Flusher_dealloc(Flusher *self) {
    stop(self);
    pthread_mutex_destroy(&self->lock);
    pthread_cond_destroy(&self->wake);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Flusher_event_fd(Flusher *self, void *unused) {
    return PyLong_FromLong(self->event_fd);
}

static PyObject *Flusher_timer_fd(Flusher *self, void *unused) {
    return PyLong_FromLong(self->timer_fd);
}

static PyMethodDef Flusher_methods[] = {
    {"start", (PyCFunction)Flusher_start, METH_O, NULL},
    {"collect", (PyCFunction)Flusher_collect, METH_NOARGS, NULL},
    {"arm", (PyCFunction)Flusher_arm, METH_O, NULL},
    {"expired", (PyCFunction)Flusher_expired, METH_NOARGS, NULL},
    {"close", (PyCFunction)Flusher_close, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Flusher_getset[] = {
    {"event_fd", (getter)Flusher_event_fd, NULL, NULL, NULL},
    {"timer_fd", (getter)Flusher_timer_fd, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject FlusherType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.Flusher",
    .tp_basicsize = sizeof(Flusher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Flusher_new,
    .tp_init = (initproc)Flusher_init,
    .tp_dealloc = (destructor)Flusher_dealloc,
    .tp_methods = Flusher_methods,
    .tp_getset = Flusher_getset,
};

#else /* not Linux: the type exists, and says it is unsupported */

typedef struct {
    PyObject_HEAD
} Flusher;

static int Flusher_init(Flusher *self, PyObject *args, PyObject *kwds) {
    PyErr_SetString(PyExc_NotImplementedError,
                    "the C group-commit flusher needs Linux (eventfd, timerfd)");
    return -1;
}

PyTypeObject FlusherType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.Flusher",
    .tp_basicsize = sizeof(Flusher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Flusher_init,
};

#endif
