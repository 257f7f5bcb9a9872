/* The broker's answer written to the connection's socket by C (release.c's write_common:
 * a flush's durable answers; sendlane.c's common_tail: a plain send's under --flush
 * async), not through transport.write.
 *
 * Why: at one send in flight per connection a flush writes one ~40-byte answer to each
 * connection; uvloop's transport.write (Cython's call, its buffer list, the queued write
 * run at the end of the loop's iteration, uv_try_write) cost ~1.4 k instructions of the
 * broker loop's ~11.8 k a durable send (issue 23). send(2) on the socket is what that
 * write ends in when nothing is queued.
 *
 * Safety, the order of the checks:
 * - the caller has seen transport.is_closing() false: uvloop and asyncio's selector
 *   transports set it in close() and in every forced close before anything else, and
 *   close the socket only after connection_lost, later; while it is false the fd is this
 *   connection's own, not a reused one;
 * - transport.get_write_buffer_size() is 0: nothing of this connection's is queued in
 *   the transport (uvloop counts its not yet written buffer and libuv's queue), so the
 *   answer cannot overtake an earlier one;
 * - a short write leaves the rest to transport.write, an error (EAGAIN: the client does
 *   not read; EPIPE, ECONNRESET: it is gone) the whole answer: backpressure, connection
 *   loss and the close path stay the transport's, exactly as without this.
 * The fd is read once when the connection is made (equeue/server/direct.py: a plain Unix
 * or TCP transport of uvloop or asyncio's selector loop, never TLS), -1 otherwise. */
#include "speedups.h"
#include <errno.h>
#include <sys/socket.h>

static PyObject *S_get_write_buffer_size, *S_write, *S_is_closing, *S_abort;
static unsigned long long direct_answers; /* answers sent whole here, this process (a
                                           * write of 3 joined answers counts 3) */

/* The transport's is_closing and get_write_buffer_size as its type has them, looked up
 * once per transport type: calling one with the transport as its first argument is what
 * transport.is_closing() does when the type's attribute lookup is the generic one, the
 * instance has no __dict__ to shadow it and the function is a method descriptor (the
 * test _PyObject_GetMethod makes; uvloop's transports pass it), and skips the look-up
 * (~90 instructions a call, twice a durable answer). Else NULL: a method call.
 * An entry holds while its type cannot change (Py_TPFLAGS_IMMUTABLETYPE: uvloop's Cython
 * types, any static type) or keeps the version tag it had at the look-up (a class whose
 * method is replaced gets a new tag, so it is looked up again). Two entries: a broker
 * with a Unix and a TCP listener has two uvloop transport types in one flush. */
enum { M_IS_CLOSING, M_BUFFER_SIZE, M_COUNT, ENTRIES = 2 };
typedef struct {
    PyTypeObject *type; /* held, or NULL */
    unsigned int tag;   /* its tp_version_tag at the look-up (mutable types) */
    PyObject *methods[M_COUNT]; /* held, or NULL */
} MethodEntry;
static MethodEntry entries[ENTRIES];
static int next_entry; /* the one replaced next */

static inline int entry_holds(const MethodEntry *e, PyTypeObject *type) {
    return e->type == type &&
           (PyType_HasFeature(type, Py_TPFLAGS_IMMUTABLETYPE) ||
            (PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG) &&
             type->tp_version_tag == e->tag));
}

static MethodEntry *method_entry(PyTypeObject *type) {
    for (int k = 0; k < ENTRIES; k++)
        if (entry_holds(&entries[k], type)) return &entries[k];
    MethodEntry *e = NULL;
    for (int k = 0; k < ENTRIES && e == NULL; k++)
        if (entries[k].type == type) e = &entries[k]; /* stale: looked up again in place */
    if (e == NULL) {
        e = &entries[next_entry];
        next_entry = (next_entry + 1) % ENTRIES;
    }
    Py_XSETREF(e->type, (PyTypeObject *)Py_NewRef(type));
    PyObject *names[M_COUNT] = {S_is_closing, S_get_write_buffer_size};
    for (int i = 0; i < M_COUNT; i++) {
        PyObject *f = NULL;
        if (type->tp_getattro == PyObject_GenericGetAttr && type->tp_dictoffset == 0) {
            f = _PyType_Lookup(type, names[i]); /* borrowed; gives the type a tag */
            if (f != NULL && !PyType_HasFeature(Py_TYPE(f), Py_TPFLAGS_METHOD_DESCRIPTOR))
                f = NULL;
        }
        Py_XSETREF(e->methods[i], Py_XNewRef(f));
    }
    /* no valid tag (tags ran out): the entry never holds for a mutable type, so its
     * methods are not used; a method call each time */
    e->tag = type->tp_version_tag;
    if (!PyType_HasFeature(type, Py_TPFLAGS_IMMUTABLETYPE) &&
        !PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG))
        for (int i = 0; i < M_COUNT; i++) Py_CLEAR(e->methods[i]);
    return e;
}

static PyObject *call_transport(PyObject *transport, int which) {
    PyObject *f = method_entry(Py_TYPE(transport))->methods[which];
    if (f == NULL)
        return PyObject_CallMethodNoArgs(transport,
                                         which == M_IS_CLOSING ? S_is_closing
                                                               : S_get_write_buffer_size);
    Py_INCREF(f); /* (the call may run code that replaces it) */
    PyObject *r = PyObject_Vectorcall(f, &transport, 1, NULL);
    Py_DECREF(f);
    return r;
}

/* transport.is_closing(): 1, 0, or -1 with an error. */
int transport_closing(PyObject *transport) {
    PyObject *r = call_transport(transport, M_IS_CLOSING);
    int is = r == NULL ? -1 : PyObject_IsTrue(r);
    Py_XDECREF(r);
    return is;
}

/* The fd in the int at offset of obj (a Connection's _fd slot), or -1: none there, not
 * an int, or not a descriptor. */
int slot_fd(PyObject *obj, Py_ssize_t offset) {
    PyObject *v = offset >= 0 ? *(PyObject **)((char *)obj + offset) : NULL;
    if (v == NULL || !PyLong_CheckExact(v)) return -1;
    int overflow;
    long fd = PyLong_AsLongAndOverflow(v, &overflow);
    return overflow || fd < 0 || fd > INT_MAX ? -1 : (int)fd;
}

/* data itself if exact bytes, else (a Frame: a bytes subclass) a copy that is: uvloop's
 * write takes a bytes subclass through a memoryview cast. New reference, or NULL with an
 * error (no memory). */
PyObject *exact_bytes(PyObject *data) {
    if (PyBytes_CheckExact(data)) return Py_NewRef(data);
    return PyBytes_FromStringAndSize(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data));
}

/* Without MSG_NOSIGNAL (some BSDs, older macOS SDKs) a send to a peer that has gone
 * would raise SIGPIPE in the broker: there the answers go through the transport (whose
 * socket code handles it), and the module still builds. */
#ifdef MSG_NOSIGNAL
#define DIRECT_SEND 1
#else
#define DIRECT_SEND 0
#define MSG_NOSIGNAL 0
#endif

/* The error set, with the transport aborted: part of a frame is on the wire and the rest
 * nowhere, so the peer would wait on a cut frame (and read a later answer as its rest). */
static void abort_keeping_error(PyObject *transport) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallMethodNoArgs(transport, S_abort);
    if (r == NULL) PyErr_WriteUnraisable(transport);
    Py_XDECREF(r);
    PyErr_Restore(type, value, tb);
}

/* 1 when transport.get_write_buffer_size() is 0, else 0: something queued, or an odd
 * answer or an Exception from it (cleared: the answer then goes through transport.write,
 * as it would without the direct send); -1 for any other error (KeyboardInterrupt). */
static int nothing_queued(PyObject *transport) {
    PyObject *queued = call_transport(transport, M_BUFFER_SIZE);
    if (queued == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
        PyErr_Clear();
        return 0;
    }
    int empty = queued == ZERO;
    if (!empty && PyLong_Check(queued)) {
        int overflow;
        empty = PyLong_AsLongLongAndOverflow(queued, &overflow) == 0 && !overflow;
        PyErr_Clear(); /* (an int subclass whose conversion failed) */
    }
    Py_DECREF(queued);
    return empty;
}

/* data (bytes, or a subclass: answers answers, joined) to the peer behind transport (not
 * closing: the caller checked), by send(2) on fd when fd >= 0 and the transport has
 * nothing queued, else (or the part send did not take) by transport.write. 0, or -1 with
 * the error a call raised. */
int answer_write(PyObject *transport, int fd, PyObject *data, Py_ssize_t answers) {
    Py_ssize_t size = PyBytes_GET_SIZE(data), sent = 0;
    if (DIRECT_SEND && fd >= 0 && size > 0) {
        int empty = nothing_queued(transport);
        if (empty < 0) return -1;
        if (empty) {
            ssize_t n;
            do
                n = send(fd, PyBytes_AS_STRING(data), (size_t)size, MSG_DONTWAIT | MSG_NOSIGNAL);
            while (n < 0 && errno == EINTR);
            if (n == size) {
                direct_answers += (unsigned long long)answers;
                return 0;
            }
            if (n > 0) sent = n;
        }
    }
    PyObject *rest = sent == 0 ? exact_bytes(data)
                               : PyBytes_FromStringAndSize(PyBytes_AS_STRING(data) + sent,
                                                           size - sent);
    if (rest == NULL && sent == 0) { /* (no memory) the Frame itself, as before */
        PyErr_Clear();
        rest = Py_NewRef(data);
    }
    if (rest == NULL) { /* (no memory) */
        abort_keeping_error(transport);
        return -1;
    }
    PyObject *r = PyObject_CallMethodOneArg(transport, S_write, rest);
    Py_DECREF(rest);
    if (r == NULL) {
        if (sent > 0) abort_keeping_error(transport);
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

PyObject *answers_written_directly(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(direct_answers);
}

int answer_write_ready(void) {
    if ((S_get_write_buffer_size = PyUnicode_InternFromString("get_write_buffer_size")) == NULL ||
        (S_write = PyUnicode_InternFromString("write")) == NULL ||
        (S_is_closing = PyUnicode_InternFromString("is_closing")) == NULL ||
        (S_abort = PyUnicode_InternFromString("abort")) == NULL)
        return -1;
    return 0;
}
