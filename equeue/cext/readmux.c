/* One reader on an asyncio loop for many of the client's own transports (rawsock.c's
 * RawSock; equeue/client/rawconn.py decides when): an epoll set of their sockets, whose
 * descriptor is the loop's one reader (loop.add_reader(mux.fileno(), mux.ready)).
 *
 * Why: asyncio runs Python for every ready descriptor of a loop turn (the selector's
 * select builds a (key, events) pair through _key_from_fd, _process_events and
 * _add_callback queue the reader's Handle, _run_once pops it and Handle._run calls it
 * through its context): ~2-3 k instructions an answer with a connection per task. Here
 * the loop sees one ready descriptor a turn, and ready() calls each ready transport's
 * read_ready in C, for one epoll_wait more a turn.
 *
 * ready(): epoll_wait(timeout 0) for up to MAX_EVENTS sockets (level-triggered: one left
 * over stays ready and is read in the next turn, as asyncio would), the transports
 * looked up by descriptor and held, then each read in turn if it is still the one
 * registered for its descriptor (a read runs the woken task, which may close another
 * connection, or open one on a descriptor just freed). An exception a read raises
 * (SystemExit or KeyboardInterrupt, or one raised by the transport's _fatal) ends
 * ready() with it: asyncio's Handle._run passes it to the loop's exception handler (the
 * two kinds through), as it does for a reader of its own; the sockets not read yet stay
 * ready for the next turn.
 *
 * add(transport), remove(transport) (only if it is the one registered for its
 * descriptor: a transport's socket is closed after its removal, never before), len(),
 * fileno(), close() (the epoll descriptor; dealloc closes it too). Linux only (epoll):
 * elsewhere client_read_mux_type() is None and every transport is a reader of its own. */
#include "speedups.h"

#ifdef __linux__
#include <errno.h>
#include <sys/epoll.h>
#include <unistd.h>

int rawsock_is(PyObject *object);           /* rawsock.c */
int rawsock_fd(PyObject *object);           /* its descriptor, -1 once closed */
PyObject *rawsock_read_ready(PyObject *object); /* its loop reader's call */

#define MAX_EVENTS 256

typedef struct {
    PyObject_HEAD
    int epfd;
    PyObject *members; /* {fd: transport} */
} ReadMux;

static PyTypeObject ReadMuxType;

static PyObject *closed_error(void) {
    PyErr_SetString(PyExc_ValueError, "I/O operation on a closed ReadMux");
    return NULL;
}

static PyObject *mux_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "ReadMux() takes no arguments");
        return NULL;
    }
    ReadMux *self = (ReadMux *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->epfd = -1;
    if ((self->members = PyDict_New()) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (self->epfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyObject *mux_add(ReadMux *self, PyObject *transport) {
    if (self->epfd < 0 || self->members == NULL) return closed_error();
    if (!rawsock_is(transport)) {
        PyErr_SetString(PyExc_TypeError, "ReadMux.add() takes a RawSock");
        return NULL;
    }
    int fd = rawsock_fd(transport);
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "ReadMux.add(): the transport is closed");
        return NULL;
    }
    PyObject *key = PyLong_FromLong(fd);
    if (key == NULL) return NULL;
    int present = PyDict_Contains(self->members, key);
    if (present != 0) {
        if (present > 0)
            PyErr_Format(PyExc_ValueError, "ReadMux.add(): descriptor %d is registered", fd);
        Py_DECREF(key);
        return NULL;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
    if (epoll_ctl(self->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(key);
        return NULL;
    }
    int rc = PyDict_SetItem(self->members, key, transport);
    Py_DECREF(key);
    if (rc < 0) {
        epoll_ctl(self->epfd, EPOLL_CTL_DEL, fd, &ev);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *mux_remove(ReadMux *self, PyObject *transport) {
    if (!rawsock_is(transport)) {
        PyErr_SetString(PyExc_TypeError, "ReadMux.remove() takes a RawSock");
        return NULL;
    }
    int fd = rawsock_fd(transport);
    if (fd < 0 || self->members == NULL) Py_RETURN_FALSE;
    PyObject *key = PyLong_FromLong(fd);
    if (key == NULL) return NULL;
    PyObject *held = PyDict_GetItemWithError(self->members, key);
    if (held != transport) {
        Py_DECREF(key);
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_FALSE;
    }
    if (self->epfd >= 0) {
        struct epoll_event ev = {0};
        /* (ENOENT, EBADF: not in the set any more; nothing to undo either way) */
        (void)epoll_ctl(self->epfd, EPOLL_CTL_DEL, fd, &ev);
    }
    int rc = PyDict_DelItem(self->members, key);
    Py_DECREF(key);
    if (rc < 0) return NULL;
    Py_RETURN_TRUE;
}

static PyObject *mux_ready(ReadMux *self, PyObject *unused) {
    if (self->epfd < 0 || self->members == NULL) Py_RETURN_NONE; /* (closed while its handle was queued) */
    struct epoll_event events[MAX_EVENTS];
    int n;
    do {
        n = epoll_wait(self->epfd, events, MAX_EVENTS, 0);
    } while (n < 0 && errno == EINTR);
    if (n < 0) return PyErr_SetFromErrno(PyExc_OSError);
    PyObject *held[MAX_EVENTS];
    int count = 0;
    for (int i = 0; i < n; i++) {
        PyObject *key = PyLong_FromLong(events[i].data.fd);
        if (key == NULL) goto fail;
        PyObject *t = PyDict_GetItemWithError(self->members, key);
        Py_DECREF(key);
        if (t != NULL) {
            held[count++] = Py_NewRef(t);
        } else if (PyErr_Occurred()) {
            goto fail;
        }
    }
    int failed = 0;
    for (int i = 0; i < count; i++) {
        PyObject *t = held[i];
        int fd = failed ? -1 : rawsock_fd(t);
        if (fd >= 0) {
            PyObject *key = PyLong_FromLong(fd), *now = NULL;
            if (key != NULL) {
                now = PyDict_GetItemWithError(self->members, key);
                Py_DECREF(key);
            }
            if (now == t) {
                PyObject *r = rawsock_read_ready(t);
                if (r == NULL) failed = 1;
                Py_XDECREF(r);
            } else if (now == NULL && PyErr_Occurred()) {
                failed = 1;
            }
        }
        Py_DECREF(t);
    }
    if (failed) return NULL;
    Py_RETURN_NONE;
fail:
    for (int i = 0; i < count; i++) Py_DECREF(held[i]);
    return NULL;
}

static PyObject *mux_fileno(ReadMux *self, PyObject *unused) {
    if (self->epfd < 0) return closed_error();
    return PyLong_FromLong(self->epfd);
}

static PyObject *mux_close(ReadMux *self, PyObject *unused) {
    if (self->epfd >= 0) {
        close(self->epfd);
        self->epfd = -1;
    }
    if (self->members != NULL) PyDict_Clear(self->members);
    Py_RETURN_NONE;
}

static Py_ssize_t mux_len(ReadMux *self) {
    return self->members == NULL ? 0 : PyDict_GET_SIZE(self->members);
}

static int mux_traverse(ReadMux *self, visitproc visit, void *arg) {
    Py_VISIT(self->members);
    return 0;
}

static int mux_clear(ReadMux *self) {
    Py_CLEAR(self->members);
    return 0;
}

static void mux_dealloc(ReadMux *self) {
    PyObject_GC_UnTrack(self);
    if (self->epfd >= 0) close(self->epfd);
    mux_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef mux_methods[] = {
    {"add", (PyCFunction)mux_add, METH_O, NULL},
    {"remove", (PyCFunction)mux_remove, METH_O, NULL},
    {"ready", (PyCFunction)mux_ready, METH_NOARGS, NULL},
    {"fileno", (PyCFunction)mux_fileno, METH_NOARGS, NULL},
    {"close", (PyCFunction)mux_close, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods mux_sequence = {.sq_length = (lenfunc)mux_len};

static PyTypeObject ReadMuxType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.ReadMux",
    .tp_basicsize = sizeof(ReadMux),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = mux_new,
    .tp_dealloc = (destructor)mux_dealloc,
    .tp_traverse = (traverseproc)mux_traverse,
    .tp_clear = (inquiry)mux_clear,
    .tp_methods = mux_methods,
    .tp_as_sequence = &mux_sequence,
};

/* client_read_mux_type() -> the type, or None where there is no epoll. */
PyObject *client_read_mux_type(PyObject *self, PyObject *unused) {
    if (PyType_Ready(&ReadMuxType) < 0) return NULL;
    return Py_NewRef((PyObject *)&ReadMuxType);
}

#else

PyObject *client_read_mux_type(PyObject *self, PyObject *unused) { Py_RETURN_NONE; }

#endif
