/* The asyncio client's own socket transport on selector loops (equeue/client/rawconn.py:
 * RawTransport, this type's Python subclass). The two calls every send makes, without a
 * Python frame:
 *
 * read_ready(): the loop's reader callback (loop.add_reader(fd, transport.read_ready)).
 *     recv() into the protocol's buffer (ClientConn's `inbuf` read as a C field when the
 *     protocol is equeue/cext/clientconn.c's and its class finds ClientConn's own
 *     get_buffer and buffer_updated, else `protocol.get_buffer(-1)`), then the bytes to
 *     ClientConn's buffer_updated as a C call (else `protocol.buffer_updated(n)`).
 *     The end (0 bytes) goes to `self._eof()`, a read error or an exception of the
 *     protocol (but SystemExit and KeyboardInterrupt, raised through as asyncio does) to
 *     `self._fatal(exc, message)`: the Python subclass, as asyncio's transport does them.
 *
 * write(data): bytes sent at once while nothing is queued; the rest of a partial write
 *     (or all of it after EAGAIN) to `self._write_rest(data, sent)`, which queues it and
 *     watches for writability; while `queued` (or closing, or data not exact bytes) the
 *     whole call is `self._write_slow(data)`. A send error goes to `self._fatal`.
 *
 * A protocol that is no asyncio.BufferedProtocol (`stream` set, by the subclass's
 *     set_protocol) is read by `self._read_data()`: recv() and data_received, in Python,
 *     as asyncio's transport reads one; the client's ClientConn never is.
 *
 * Fields: fd (-1 once closed), closing, queued (set while the C write must not send:
 * bytes queued, or write_eof called) and stream (ints, kept by the subclass), protocol.
 * The syscalls keep the GIL (socket.recv_into and socket.send release it): on a
 * non-blocking socket they never wait, and a recv copies at most the 256 KiB buffer; the
 * release and retake cost ~200 instructions each, a few % of a send. A write past
 * UNLOCKED_FROM bytes (a large batch: a longer copy) releases it. */
#include "speedups.h"
#include <errno.h>
#include <structmember.h>
#include <sys/socket.h>

/* Where the headers lack MSG_NOSIGNAL (some BSDs, older macOS SDKs) the module still
 * builds: CPython ignores SIGPIPE from its start, so a send to a peer that has gone fails
 * with EPIPE there as well. */
#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0
#endif

int clientconn_reads(PyObject *object);       /* clientconn.c */
PyObject *clientconn_inbuf(PyObject *conn);   /* borrowed; NULL with an error */
PyObject *clientconn_read(PyObject *conn, Py_ssize_t nbytes);

#define UNLOCKED_FROM (64 * 1024)

typedef struct {
    PyObject_HEAD
    PyObject *protocol;
    int fd, closing, queued, stream;
} RawSock;

static PyTypeObject RawSockType;
static PyObject *S_GET_BUFFER, *S_BUFFER_UPDATED, *S_EOF, *S_FATAL, *S_WRITE_REST,
    *S_WRITE_SLOW, *S_READ_DATA, *M_READ, *M_PROTOCOL, *M_GET_BUFFER, *M_WRITE, *MINUS_ONE;

/* Whether object is a RawSock or a direct subclass (RawTransport): 1, 0. Not
 * PyObject_TypeCheck: ClientConn.direct asks it of uvloop's transports too, whose MRO
 * walk cost ~85 instructions a send there. */
int rawsock_is(PyObject *object) {
    PyTypeObject *type = Py_TYPE(object);
    return type == &RawSockType || type->tp_base == &RawSockType;
}

/* For readmux.c: the descriptor (-1 once closed), and the reader's call. */
int rawsock_fd(PyObject *object) { return ((RawSock *)object)->fd; }

static PyObject *raw_read_ready(RawSock *self, PyObject *unused);

PyObject *rawsock_read_ready(PyObject *object) { return raw_read_ready((RawSock *)object, NULL); }

/* self._fatal(the raised exception, message): None, or NULL (raised through). */
static PyObject *fatal(RawSock *self, PyObject *message) {
    if (PyErr_ExceptionMatches(PyExc_SystemExit) || PyErr_ExceptionMatches(PyExc_KeyboardInterrupt))
        return NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL) PyException_SetTraceback(value, tb);
    PyObject *r = PyObject_CallMethodObjArgs((PyObject *)self, S_FATAL, value, message, NULL);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return r;
}

static PyObject *errno_error(int err) {
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    return NULL;
}

static PyObject *raw_read_ready(RawSock *self, PyObject *unused) {
    if (self->closing || self->fd < 0 || self->protocol == NULL) Py_RETURN_NONE;
    if (self->stream) return PyObject_CallMethodNoArgs((PyObject *)self, S_READ_DATA);
    PyObject *protocol = Py_NewRef(self->protocol), *buffer, *r = NULL;
    int conn = clientconn_reads(protocol); /* (ClientConn's own two methods: in C) */
    if (conn) {
        buffer = clientconn_inbuf(protocol);
        Py_XINCREF(buffer);
    } else {
        buffer = PyObject_CallMethodOneArg(protocol, S_GET_BUFFER, MINUS_ONE);
    }
    /* ClientConn's memoryview read in place (its buffer held by it, held by protocol;
     * nothing runs Python before the recv ends): ~120 instructions less a read than
     * PyObject_GetBuffer. */
    Py_buffer own, *view = NULL;
    if (conn && buffer != NULL && PyMemoryView_Check(buffer) &&
        !(((PyMemoryViewObject *)buffer)->flags & _Py_MEMORYVIEW_RELEASED) &&
        !PyMemoryView_GET_BUFFER(buffer)->readonly &&
        PyBuffer_IsContiguous(PyMemoryView_GET_BUFFER(buffer), 'C')) {
        view = PyMemoryView_GET_BUFFER(buffer);
    } else if (buffer != NULL && PyObject_GetBuffer(buffer, &own, PyBUF_WRITABLE) == 0) {
        view = &own;
    }
    if (view == NULL) {
        Py_XDECREF(buffer);
        r = fatal(self, M_GET_BUFFER);
        goto out;
    }
    ssize_t n = -1;
    int err = 0;
    if (view->len == 0) {
        PyErr_SetString(PyExc_RuntimeError, "get_buffer() returned an empty buffer");
    } else {
        do { /* (the GIL kept: a non-blocking recv of at most the buffer, 256 KiB) */
            n = recv(self->fd, view->buf, (size_t)view->len, 0);
        } while (n < 0 && errno == EINTR);
        err = errno;
    }
    int empty = view->len == 0;
    if (view == &own) PyBuffer_Release(&own);
    Py_DECREF(buffer);
    if (empty) {
        r = fatal(self, M_GET_BUFFER);
        goto out;
    }
    if (n > 0) {
        if (conn) {
            r = clientconn_read(protocol, (Py_ssize_t)n);
        } else {
            PyObject *count = PyLong_FromSsize_t(n);
            r = count == NULL ? NULL
                              : PyObject_CallMethodOneArg(protocol, S_BUFFER_UPDATED, count);
            Py_XDECREF(count);
        }
        if (r == NULL) r = fatal(self, M_PROTOCOL);
    } else if (n == 0) {
        r = PyObject_CallMethodNoArgs((PyObject *)self, S_EOF);
    } else if (err == EAGAIN || err == EWOULDBLOCK) {
        r = Py_NewRef(Py_None);
    } else {
        errno_error(err);
        r = fatal(self, M_READ);
    }
out:
    Py_DECREF(protocol);
    return r;
}

PyObject *rawsock_write(PyObject *object, PyObject *data) {
    RawSock *self = (RawSock *)object;
    if (self->queued || self->closing || self->fd < 0 || !PyBytes_CheckExact(data))
        return PyObject_CallMethodOneArg(object, S_WRITE_SLOW, data);
    Py_ssize_t len = PyBytes_GET_SIZE(data);
    if (len == 0) Py_RETURN_NONE;
    const char *buf = PyBytes_AS_STRING(data);
    ssize_t n;
    int err, fd = self->fd;
    if (len <= UNLOCKED_FROM) {
        do {
            n = send(fd, buf, (size_t)len, MSG_NOSIGNAL);
        } while (n < 0 && errno == EINTR);
        err = errno;
    } else {
        Py_BEGIN_ALLOW_THREADS
        do {
            n = send(fd, buf, (size_t)len, MSG_NOSIGNAL);
        } while (n < 0 && errno == EINTR);
        err = errno;
        Py_END_ALLOW_THREADS
    }
    if (n == len) Py_RETURN_NONE;
    if (n < 0) {
        if (err != EAGAIN && err != EWOULDBLOCK) {
            errno_error(err);
            return fatal(self, M_WRITE);
        }
        n = 0;
    }
    PyObject *sent = PyLong_FromSsize_t(n);
    if (sent == NULL) return NULL;
    PyObject *r = PyObject_CallMethodObjArgs(object, S_WRITE_REST, data, sent, NULL);
    Py_DECREF(sent);
    return r;
}

static int raw_traverse(RawSock *self, visitproc visit, void *arg) {
    Py_VISIT(self->protocol);
    return 0;
}

static int raw_clear(RawSock *self) {
    Py_CLEAR(self->protocol);
    return 0;
}

static void raw_dealloc(RawSock *self) {
    PyObject_GC_UnTrack(self);
    raw_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *raw_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    RawSock *self = (RawSock *)type->tp_alloc(type, 0);
    if (self != NULL) self->fd = -1;
    return (PyObject *)self;
}

static PyMethodDef raw_methods[] = {
    {"read_ready", (PyCFunction)raw_read_ready, METH_NOARGS, NULL},
    {"write", (PyCFunction)rawsock_write, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef raw_members[] = {
    {"protocol", T_OBJECT, offsetof(RawSock, protocol), 0, NULL},
    {"fd", T_INT, offsetof(RawSock, fd), 0, NULL},
    {"closing", T_INT, offsetof(RawSock, closing), 0, NULL},
    {"queued", T_INT, offsetof(RawSock, queued), 0, NULL},
    {"stream", T_INT, offsetof(RawSock, stream), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject RawSockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.RawSock",
    .tp_basicsize = sizeof(RawSock),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = raw_new,
    .tp_dealloc = (destructor)raw_dealloc,
    .tp_traverse = (traverseproc)raw_traverse,
    .tp_clear = (inquiry)raw_clear,
    .tp_methods = raw_methods,
    .tp_members = raw_members,
};

/* client_raw_sock_type() -> the type (made ready on the first call). */
PyObject *client_raw_sock_type(PyObject *self, PyObject *unused) {
    if (S_EOF == NULL) {
        if ((S_GET_BUFFER = PyUnicode_InternFromString("get_buffer")) == NULL ||
            (S_BUFFER_UPDATED = PyUnicode_InternFromString("buffer_updated")) == NULL ||
            (S_FATAL = PyUnicode_InternFromString("_fatal")) == NULL ||
            (S_WRITE_REST = PyUnicode_InternFromString("_write_rest")) == NULL ||
            (S_WRITE_SLOW = PyUnicode_InternFromString("_write_slow")) == NULL ||
            (S_READ_DATA = PyUnicode_InternFromString("_read_data")) == NULL ||
            (M_READ = PyUnicode_InternFromString("Fatal read error on socket transport")) ==
                NULL ||
            (M_WRITE = PyUnicode_InternFromString("Fatal write error on socket transport")) ==
                NULL ||
            (M_PROTOCOL = PyUnicode_InternFromString(
                 "Fatal error: protocol.buffer_updated() call failed.")) == NULL ||
            (M_GET_BUFFER = PyUnicode_InternFromString(
                 "Fatal error: protocol.get_buffer() call failed.")) == NULL ||
            (MINUS_ONE = PyLong_FromLong(-1)) == NULL || PyType_Ready(&RawSockType) < 0)
            return NULL;
        if ((S_EOF = PyUnicode_InternFromString("_eof")) == NULL) return NULL; /* last */
    }
    return Py_NewRef((PyObject *)&RawSockType);
}
