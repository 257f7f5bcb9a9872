/* The asyncio client's connection state where its one-send-in-flight path reads and
 * writes it (equeue/client/aio.py: _Protocol's base, from client_conn_type(); wrapped by
 * equeue/protocol/plainsend.py). Three methods without a Python frame each:
 *
 * get_buffer(sizehint) -> the read buffer (`inbuf`, the same one every read).
 *
 * buffer_updated(nbytes): when `waiting` names the send `direct` wrote and the read is
 *     exactly its OK answer (clientsend_result), the pending entry taken, `heard` and
 *     `free` updated, `release()` called if callers wait for a place, and the future given
 *     the SendResult (unless done: its caller was cancelled), last: wakeup.c's
 *     waiter_finish runs its task at once when no caller waited for a place and that is
 *     safe (wakeup.c says when), else schedules it as a Future; a coalesced group's
 *     answer alone in the read is given to its Answer (group_read, below); anything else
 *     goes to `data_received(inbuf[:nbytes])`, the general read. `read_in_c` counts the
 *     first.
 *
 * direct(topic, body) -> future | None: the plain send of an idle connection heard from
 *     within `recent` seconds: nothing pending, no write scheduled (`flushing`), not
 *     closed, a place free, welcomed, no byte of a frame held by `reader`, no coalesced
 *     group open or sealed (`coalescer`); then the id from `next_id()`, the frame made in
 *     C (within `limit`), the entry (future: wakeup.c's waiter_for(loop), body,
 *     deadline) in `pending`, one place taken and `transport.write(frame)`. None:
 *     nothing done (the id may be used up); also when the running loop is not `loop`
 *     (a caller on another loop: AsyncClient.send then raises WrongLoopError).
 *
 * clientconn_read(conn, nbytes), clientconn_reads, clientconn_inbuf: buffer_updated and the
 *     buffer as rawsock.c's read_ready calls them (a C call, no method lookup); `direct`
 *     writes through rawsock_write when the transport is rawsock.c's.
 *
 * ClientConn.future_of(conn) -> an asyncio.Future of conn's `loop` if it is the running
 *     loop, else None: the coalesced send's (equeue/client/coalesce.py, through
 *     equeue/client/loops.py), its loop checked in the same call.
 *
 * The other fields are the Python subclass's, kept here so these methods read them as C
 * fields; `time.monotonic()` is clock_gettime(CLOCK_MONOTONIC) on Linux, used directly. */
#include "speedups.h"
#include <structmember.h>
#include <time.h>

PyObject *clientsend_frame(unsigned long long id, PyObject *topic, PyObject *body,
                           Py_ssize_t max);
PyObject *clientsend_result(const unsigned char *p, Py_ssize_t nbytes, uint64_t rid,
                            PyObject *topic, Py_ssize_t max);
PyObject *waiter_for(PyObject *loop); /* wakeup.c: the future `direct` gives */
int waiter_is(PyObject *object);
int waiter_finish(PyObject *waiter, PyObject *result, int now);
int waiter_on_loop(PyObject *loop);
PyObject *columns_answer(PyObject *self, PyObject *args); /* answercols.c */
int group_answer_is(PyObject *object);                     /* groupanswer.c */
PyObject *group_answer_futures(PyObject *answer);
int waiter_pending(PyObject *object); /* wakeup.c */
PyObject *waiter_future_on(PyObject *loop);
int rawsock_is(PyObject *object); /* rawsock.c: the client's own transport */
PyObject *rawsock_write(PyObject *object, PyObject *data);
int shmring_is(PyObject *object); /* shmring.c: a connection on shared rings */
PyObject *shmring_write(PyObject *object, PyObject *data);

/* The fields Python code reads and writes often are objects (T_OBJECT_EX: CPython 3.11
 * specializes their attribute access as it does __slots__'; not a T_DOUBLE's or T_BOOL's):
 * free (int), heard (float), closed, flushing and welcomed (bools). */
typedef struct {
    PyObject_HEAD
    PyObject *inbuf, *pending, *queued, *waiting_topic, *transport, *next_id, *reader,
        *coalescer, *free, *heard, *closed, *flushing, *welcomed, *loop;
    unsigned long long waiting;
    double timeout, recent;
    Py_ssize_t limit, read_in_c;
    PyObject *direct_set; /* a `direct` set on this connection (see conn_getset), or NULL */
} Conn;

#define OBJECTS(X)                                                                        \
    X(inbuf) X(pending) X(queued) X(waiting_topic) X(transport) X(next_id) X(reader)      \
    X(coalescer) X(free) X(heard) X(closed) X(flushing) X(welcomed) X(loop)

/* free + delta as the field's new int: 0, -1 (an error set). */
static PyTypeObject ConnType;

static int add_free(Conn *self, long delta) {
    Py_ssize_t now = self->free == NULL ? 0 : PyLong_AsSsize_t(self->free);
    if (now == -1 && PyErr_Occurred()) return -1;
    PyObject *next = PyLong_FromSsize_t(now + delta);
    if (next == NULL) return -1;
    Py_XSETREF(self->free, next);
    return 0;
}

/* Whether a field holds a true value: 1, 0 (also unset), -1. */
static int truth(PyObject *value) {
    return value == NULL ? 0 : value == Py_True ? 1 : value == Py_False ? 0 : PyObject_IsTrue(value);
}

static PyObject *S_WRITE, *S_DONE, *S_SET_RESULT, *S_RELEASE, *S_DATA_RECEIVED, *S_BUFFER,
    *S_GROUPS, *S_SEALED, *S_COLUMNS, *S_ANSWERED;

static double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static PyObject *conn_get_buffer(Conn *self, PyObject *sizehint) {
    if (self->inbuf == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the connection has no read buffer");
        return NULL;
    }
    return Py_NewRef(self->inbuf);
}

/* Whether the caller of `future` still waits for it: 1, 0 (a done() that raises: 1). */
static int future_waits(PyObject *future) {
    if (waiter_is(future)) return waiter_pending(future);
    PyObject *done = PyObject_CallMethodNoArgs(future, S_DONE);
    int is_done = done == NULL ? -1 : PyObject_IsTrue(done);
    Py_XDECREF(done);
    if (is_done < 0) PyErr_Clear();
    return is_done != 1;
}

/* An error between the entry's leaving `pending` (taken under `key`) and the end of its
 * callers' answers (review15 R15-3): the entry put back while a caller of it still waits
 * (a send's future, or a group's Answer's futures, not done), so that the connection's end
 * answers it with ConnectionLostError (fail, which the transport calls for the error the
 * read raises; the watchdog, past its deadline, for a KeyboardInterrupt, which ends no
 * connection). Taken for good, it was in no list fail() reads: its caller waited for ever.
 * fail() skips a future already done: no caller is answered twice. The error is kept: the
 * checks, which may call done(), run with it set aside. */
static void put_back(Conn *self, PyObject *key, PyObject *entry) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *target = PyTuple_GET_ITEM(entry, 0);
    int waits = 1;
    if (group_answer_is(target)) {
        PyObject *futures = group_answer_futures(target);
        if (futures != NULL && PyList_Check(futures)) {
            Py_INCREF(futures); /* (done() may run code) */
            waits = 0;
            for (Py_ssize_t i = 0; !waits && i < PyList_GET_SIZE(futures); i++) {
                PyObject *future = Py_NewRef(PyList_GET_ITEM(futures, i));
                waits = future_waits(future);
                Py_DECREF(future);
            }
            Py_DECREF(futures);
        }
    } else {
        waits = future_waits(target);
    }
    if (waits && self->pending != NULL && PyDict_Check(self->pending) &&
        PyDict_SetItem(self->pending, key, entry) < 0)
        PyErr_WriteUnraisable((PyObject *)self);
    PyErr_Restore(type, value, tb);
}

/* The answer read in C: 1 (the future given it), 0 (not it: read the general way), -1. */
static int answered(Conn *self, Py_ssize_t nbytes) {
    unsigned long long rid = self->waiting;
    self->waiting = 0;
    if (self->waiting_topic == NULL || self->pending == NULL || !PyDict_Check(self->pending))
        return 0;
    Py_buffer view;
    if (PyObject_GetBuffer(self->inbuf, &view, PyBUF_SIMPLE) < 0) return -1;
    PyObject *result = nbytes > view.len ? Py_NewRef(Py_None)
                                         : clientsend_result((const unsigned char *)view.buf,
                                                             nbytes, rid, self->waiting_topic,
                                                             self->limit);
    PyBuffer_Release(&view);
    if (result == NULL) return -1;
    if (result == Py_None) {
        Py_DECREF(result);
        return 0;
    }
    int found = 0, taken = 0;
    PyObject *key = PyLong_FromUnsignedLongLong(rid), *entry = NULL;
    if (key == NULL) goto out;
    entry = PyDict_GetItemWithError(self->pending, key);
    if (entry == NULL) {
        found = PyErr_Occurred() ? -1 : 0; /* (no longer in flight: the general read says so) */
        goto out;
    }
    Py_INCREF(entry);
    if (PyDict_DelItem(self->pending, key) < 0 || !PyTuple_Check(entry) ||
        PyTuple_GET_SIZE(entry) < 1) {
        found = PyErr_Occurred() ? -1 : 0;
        goto out;
    }
    found = -1;
    taken = 1; /* (from here an error puts the entry back: put_back) */
    PyObject *heard = PyFloat_FromDouble(monotonic());
    if (heard == NULL) goto out;
    Py_XSETREF(self->heard, heard);
    if (add_free(self, 1) < 0) goto out;
    self->read_in_c += 1;
    int waiters = 0;
    if (self->queued != NULL) {
        waiters = PyObject_IsTrue(self->queued);
        if (waiters < 0) goto out;
        if (waiters) {
            PyObject *r = PyObject_CallMethodNoArgs((PyObject *)self, S_RELEASE);
            if (r == NULL) goto out;
            Py_DECREF(r);
        }
    }
    PyObject *future = PyTuple_GET_ITEM(entry, 0);
    if (waiter_is(future)) {
        /* Last: the woken task may send again at once. Not with callers waiting for a
         * place: the one just released comes first, as it would through call_soon. */
        if (waiter_finish(future, result, !waiters) < 0) goto out;
        found = 1;
        goto out;
    }
    PyObject *done = PyObject_CallMethodNoArgs(future, S_DONE);
    if (done == NULL) goto out;
    int is_done = PyObject_IsTrue(done);
    Py_DECREF(done);
    if (is_done < 0) goto out;
    if (!is_done) { /* (done: its caller was cancelled) */
        PyObject *r = PyObject_CallMethodOneArg(future, S_SET_RESULT, result);
        if (r == NULL) goto out;
        Py_DECREF(r);
    }
    found = 1;
out:
    if (found < 0 && taken) put_back(self, key, entry);
    Py_XDECREF(key);
    Py_XDECREF(entry);
    Py_DECREF(result);
    return found;
}

/* A coalesced group's answer alone in the read, taken as data_received -> AnswerReader.feed
 * -> _answers would take it, without their Python frames (groupanswer.c's round, coalc2):
 * welcomed, no caller waiting for a place, no byte of a frame held by `reader`, the read
 * exactly one frame within `limit` that columns_answer reads (an id in `reader.columns`)
 * and whose id is a group's Answer in `pending`. Then `heard`, the entry taken, `free +=
 * 1` and `answer.answered(status, results)`: 1. 0: nothing changed (the general read
 * takes it), -1: an error. */
static int group_read(Conn *self, Py_ssize_t nbytes) {
    if (nbytes <= 4 || self->reader == NULL || self->pending == NULL ||
        !PyDict_CheckExact(self->pending) || self->queued == NULL || truth(self->welcomed) != 1)
        return PyErr_Occurred() ? -1 : 0;
    Py_ssize_t waiters = PyObject_Length(self->queued);
    if (waiters != 0) return waiters < 0 ? -1 : 0;
    PyObject *held = PyObject_GetAttr(self->reader, S_BUFFER);
    if (held == NULL) return -1;
    Py_ssize_t held_bytes = PyByteArray_CheckExact(held) ? PyByteArray_GET_SIZE(held) : -1;
    Py_DECREF(held);
    if (held_bytes != 0) return 0;
    PyObject *columns = PyObject_GetAttr(self->reader, S_COLUMNS);
    if (columns == NULL) return -1;
    if (!PySet_CheckExact(columns) || PySet_GET_SIZE(columns) == 0) {
        Py_DECREF(columns);
        return 0;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(self->inbuf, &view, PyBUF_SIMPLE) < 0) {
        Py_DECREF(columns);
        return -1;
    }
    const unsigned char *p = view.buf;
    Py_ssize_t length = nbytes > view.len ? -1
                        : (Py_ssize_t)((uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 |
                                       (uint32_t)p[2] << 8 | p[3]);
    PyObject *body = NULL;
    if (length > 0 && length == nbytes - 4 && length <= self->limit) {
        PyObject *frame = PyMemoryView_FromMemory((char *)p + 4, length, PyBUF_READ);
        PyObject *args = frame == NULL ? NULL : PyTuple_Pack(2, frame, columns);
        body = args == NULL ? NULL : columns_answer(NULL, args);
        Py_XDECREF(args);
        if (frame != NULL) { /* (nothing may keep the buffer's bytes past this read) */
            /* memoryview.release is a call: made with columns_answer's error (a
             * MemoryError) still set, CPython's call check turned its None into a
             * SystemError (review15 R15-2), so the error is put aside meanwhile */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyObject *r = PyObject_CallMethodNoArgs(frame, S_RELEASE);
            Py_XDECREF(r);
            Py_DECREF(frame);
            if (r == NULL) Py_CLEAR(body);
            if (type != NULL) {
                if (r == NULL) PyErr_Clear(); /* (the first error is the one raised) */
                PyErr_Restore(type, value, tb);
            }
        }
    } else {
        body = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&view);
    Py_DECREF(columns);
    if (body == NULL) return -1;
    int found = 0, taken = 0;
    PyObject *entry = NULL;
    if (!PyList_CheckExact(body) || PyList_GET_SIZE(body) != 3) goto out; /* (None: not one) */
    PyObject *rid = PyList_GET_ITEM(body, 0);
    entry = PyDict_GetItemWithError(self->pending, rid);
    if (entry == NULL) { /* (not in flight: the general read says so) */
        found = PyErr_Occurred() ? -1 : 0;
        goto out;
    }
    Py_INCREF(entry);
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) < 1 ||
        !group_answer_is(PyTuple_GET_ITEM(entry, 0)))
        goto out;
    found = -1;
    PyObject *heard = PyFloat_FromDouble(monotonic());
    if (heard == NULL) goto out;
    Py_XSETREF(self->heard, heard);
    if (PyDict_DelItem(self->pending, rid) < 0) goto out;
    taken = 1; /* (from here an error puts the entry back: put_back) */
    if (add_free(self, 1) < 0) goto out;
    PyObject *call[3] = {PyTuple_GET_ITEM(entry, 0), PyList_GET_ITEM(body, 1),
                         PyList_GET_ITEM(body, 2)};
    PyObject *r = PyObject_VectorcallMethod(S_ANSWERED, call, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                            NULL);
    if (r == NULL) goto out;
    Py_DECREF(r);
    found = 1;
out:
    if (found < 0 && taken) put_back(self, rid, entry);
    Py_XDECREF(entry);
    Py_DECREF(body);
    return found;
}

/* buffer_updated(nbytes), also called by rawsock.c's read_ready without a method call. */
PyObject *clientconn_read(PyObject *conn, Py_ssize_t nbytes) {
    Conn *self = (Conn *)conn;
    if (self->inbuf == NULL) return conn_get_buffer(self, NULL); /* (the error) */
    if (self->waiting) {
        int got = answered(self, nbytes);
        if (got < 0) return NULL;
        if (got) Py_RETURN_NONE;
    } else if (self->coalescer != NULL && self->coalescer != Py_None) {
        int got = group_read(self, nbytes);
        if (got < 0) return NULL;
        if (got) Py_RETURN_NONE;
    }
    PyObject *data = PySequence_GetSlice(self->inbuf, 0, nbytes);
    if (data == NULL) return NULL;
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, S_DATA_RECEIVED, data);
    Py_DECREF(data);
    return r;
}

static PyObject *conn_buffer_updated(Conn *self, PyObject *arg) {
    Py_ssize_t nbytes = PyLong_AsSsize_t(arg);
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    return clientconn_read((PyObject *)self, nbytes);
}

/* For rawsock.c: whether object is a ClientConn or a direct subclass (1, 0: else
 * rawsock.c calls its methods), and its read buffer (borrowed;
 * NULL with an error when unset). */
int clientconn_is(PyObject *object) { /* (a direct subclass: aio.py's _Protocol) */
    PyTypeObject *type = Py_TYPE(object);
    return type == &ConnType || type->tp_base == &ConnType;
}

static int own_name(PyTypeObject *type, PyObject *name);
static PyObject *S_GET_BUFFER, *S_BUFFER_UPDATED;
static PyTypeObject *reads_type;
static unsigned int reads_tag;

/* For rawsock.c's read: 1 when object is clientconn_is and its class still finds
 * ClientConn's own get_buffer and buffer_updated (a subclass's, or one set on the class
 * later, is called by name instead); remembered with the type's version tag as
 * clientconn_plain does. One set on the instance is not looked for (its dict's look-up
 * would cost ~240 instructions a read; uvloop binds the two once per connection too). */
int clientconn_reads(PyObject *object) {
    PyTypeObject *type = Py_TYPE(object);
    if (type == reads_type && type->tp_version_tag == reads_tag &&
        PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG))
        return 1;
    if (S_GET_BUFFER == NULL || !clientconn_is(object) || !own_name(type, S_GET_BUFFER) ||
        !own_name(type, S_BUFFER_UPDATED)) {
        PyErr_Clear(); /* (a failed look-up: called by name, which raises it again) */
        return 0;
    }
    if (PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) { /* (set by the look-ups) */
        reads_type = type;
        reads_tag = type->tp_version_tag;
    }
    return 1;
}

PyObject *clientconn_inbuf(PyObject *conn) {
    PyObject *inbuf = ((Conn *)conn)->inbuf;
    if (inbuf == NULL) PyErr_SetString(PyExc_RuntimeError, "the connection has no read buffer");
    return inbuf;
}

/* Whether attribute `name` of `owner` holds anything (len > 0): 1, 0, -1. */
static int holds(PyObject *owner, PyObject *name) {
    PyObject *value = PyObject_GetAttr(owner, name);
    if (value == NULL) return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

static PyObject *conn_direct(Conn *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "direct(topic, body)");
        return NULL;
    }
    PyObject *topic = args[0], *body = args[1];
    if (!PyUnicode_CheckExact(topic) || !PyBytes_CheckExact(body) || self->pending == NULL ||
        !PyDict_CheckExact(self->pending) || PyDict_GET_SIZE(self->pending) ||
        self->transport == NULL || self->next_id == NULL || self->reader == NULL ||
        self->free == NULL || self->heard == NULL)
        Py_RETURN_NONE;
    int busy = truth(self->flushing);
    if (busy == 0) busy = truth(self->closed);
    if (busy == 0) {
        int welcomed = truth(self->welcomed);
        busy = welcomed < 0 ? -1 : !welcomed;
    }
    if (busy == 0) {
        Py_ssize_t free = PyLong_AsSsize_t(self->free);
        busy = free == -1 && PyErr_Occurred() ? -1 : free <= 0;
    }
    if (busy == 0) busy = holds(self->reader, S_BUFFER); /* (a byte unread: no answer alone) */
    if (busy == 0 && self->coalescer != NULL && self->coalescer != Py_None) {
        busy = holds(self->coalescer, S_GROUPS);
        if (busy == 0) busy = holds(self->coalescer, S_SEALED);
    }
    if (busy) return busy < 0 ? NULL : Py_NewRef(Py_None);
    double now = monotonic(), heard = PyFloat_AsDouble(self->heard);
    if (heard == -1.0 && PyErr_Occurred()) return NULL;
    if (heard < now - self->recent) Py_RETURN_NONE; /* (AsyncClient._call asks first) */
    /* A caller on another loop: nothing written (AsyncClient.send refuses it). */
    int own = self->loop == NULL ? 0 : waiter_on_loop(self->loop);
    if (own <= 0) return own < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *rid = PyObject_CallNoArgs(self->next_id);
    if (rid == NULL) return NULL;
    unsigned long long id = PyLong_Check(rid) ? PyLong_AsUnsignedLongLong(rid) : 0;
    if (id == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        id = 0;
    }
    PyObject *frame = id ? clientsend_frame(id, topic, body, self->limit) : Py_NewRef(Py_None);
    PyObject *future = NULL, *entry = NULL, *deadline = NULL, *out = NULL;
    if (frame == NULL) goto done;
    if (!PyBytes_CheckExact(frame)) { /* over the limit, or not for C: the general path */
        out = Py_NewRef(Py_None);
        goto done;
    }
    if (self->loop == NULL) { /* (no loop: the general path) */
        out = Py_NewRef(Py_None);
        goto done;
    }
    if ((future = waiter_for(self->loop)) == NULL ||
        (deadline = PyFloat_FromDouble(now + self->timeout)) == NULL ||
        (entry = PyTuple_Pack(3, future, body, deadline)) == NULL ||
        PyDict_SetItem(self->pending, rid, entry) < 0 || add_free(self, -1) < 0)
        goto done;
    self->waiting = id;
    Py_INCREF(topic);
    Py_XSETREF(self->waiting_topic, topic);
    PyObject *r = rawsock_is(self->transport)   ? rawsock_write(self->transport, frame)
                  : shmring_is(self->transport) ? shmring_write(self->transport, frame)
                                                : PyObject_CallMethodOneArg(self->transport,
                                                                            S_WRITE, frame);
    if (r == NULL) goto done;
    Py_DECREF(r);
    out = Py_NewRef(future);
done:
    Py_DECREF(rid);
    Py_XDECREF(frame);
    Py_XDECREF(future);
    Py_XDECREF(entry);
    Py_XDECREF(deadline);
    return out;
}

/* For sendcoro.c's first step, which asks a connection `closed`, `pending` and `direct`
 * by name (three attribute reads and a method call: ~1,000 instructions a send): 1 when
 * conn's type is ClientConn or a direct subclass in which the three names still find
 * ClientConn's own descriptors, and no `direct` was set on conn itself (direct_set), so
 * reading the fields and calling clientconn_direct gives what the names give; 0: ask by
 * name. A type found so is remembered with its version tag, which any change to the type
 * or its bases drops. */
static PyObject *S_CLOSED, *S_PENDING, *S_DIRECT;
static PyTypeObject *plain_type;
static unsigned int plain_tag;

static int own_name(PyTypeObject *type, PyObject *name) {
    PyObject *found = _PyType_Lookup(type, name);
    return found != NULL && found == PyDict_GetItemWithError(ConnType.tp_dict, name);
}

int clientconn_plain(PyObject *conn) {
    PyTypeObject *type = Py_TYPE(conn);
    if (type == plain_type && type->tp_version_tag == plain_tag &&
        PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG))
        return ((Conn *)conn)->direct_set == NULL;
    if (S_CLOSED == NULL || !clientconn_is(conn) || !own_name(type, S_CLOSED) ||
        !own_name(type, S_PENDING) || !own_name(type, S_DIRECT)) {
        PyErr_Clear(); /* (a failed look-up: asked by name, which raises it again) */
        return 0;
    }
    if (PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) { /* (set by the look-ups) */
        plain_type = type;
        plain_tag = type->tp_version_tag;
    }
    return ((Conn *)conn)->direct_set == NULL;
}

/* The fields of a clientconn_plain connection (borrowed; NULL while unset: ask by name). */
PyObject *clientconn_closed(PyObject *conn) { return ((Conn *)conn)->closed; }
PyObject *clientconn_pending(PyObject *conn) { return ((Conn *)conn)->pending; }

/* For coalesceadd.c: a clientconn_is connection's loop (set: 0; unset: -1, no error:
 * asked by name instead), pending and flushing (borrowed; NULL while unset); and
 * `free -= 1` as the Python statement does it (0, -1). */
int clientconn_fields(PyObject *conn, PyObject **loop, PyObject **pending, PyObject **flushing) {
    Conn *self = (Conn *)conn;
    *loop = self->loop;
    *pending = self->pending;
    *flushing = self->flushing;
    return self->loop == NULL || self->free == NULL ? -1 : 0;
}

int clientconn_take_place(PyObject *conn) { return add_free((Conn *)conn, -1); }

/* For groupanswer.c: a clientconn_is connection's loop (borrowed; NULL while unset). */
PyObject *clientconn_loop(PyObject *conn) { return ((Conn *)conn)->loop; }

/* For groupanswer.c: a clientconn_is connection's queued, reader, flushing and closed
 * (borrowed; NULL while unset), `free += places` and `flushing = value` as the Python
 * statements do them (0, -1). */
void clientconn_answer_fields(PyObject *conn, PyObject **queued, PyObject **reader,
                              PyObject **flushing, PyObject **closed) {
    Conn *self = (Conn *)conn;
    *queued = self->queued;
    *reader = self->reader;
    *flushing = self->flushing;
    *closed = self->closed;
}

int clientconn_give_back(PyObject *conn, Py_ssize_t places) {
    return add_free((Conn *)conn, (long)places);
}

void clientconn_set_flushing(PyObject *conn, PyObject *value) {
    Py_XSETREF(((Conn *)conn)->flushing, Py_NewRef(value));
}

PyObject *clientconn_direct(PyObject *conn, PyObject *topic, PyObject *body) {
    PyObject *args[2] = {topic, body};
    return conn_direct((Conn *)conn, args, 2);
}

/* ClientConn.future_of(conn) -> an asyncio.Future of conn's `loop` when it is the
 * running loop, else None (a caller on another loop: the coalescer refuses it before
 * anything is written). A function in the type's dict, not a method: called as a builtin
 * of one argument, ~170 instructions less a call than a method of the Python subclass. */
static PyObject *conn_future_of(PyObject *unused, PyObject *conn) {
    if (!PyObject_TypeCheck(conn, &ConnType)) {
        PyErr_SetString(PyExc_TypeError, "future_of(conn): a ClientConn");
        return NULL;
    }
    PyObject *loop = ((Conn *)conn)->loop;
    if (loop == NULL) Py_RETURN_NONE;
    return waiter_future_on(loop);
}

static PyMethodDef future_of_def = {"future_of", conn_future_of, METH_O, NULL};

/* `direct` is a data descriptor (a getset), not a method: a `direct` set on a connection
 * (`protocol.direct = f`, `unittest.mock.patch.object(protocol, "direct", f)`) is kept in
 * direct_set, where clientconn_plain sees it with one load, rather than in the instance
 * dict (whose look-up, a miss in the shared keys of ~30 attributes, cost ~240
 * instructions a send). Read by name it gives direct_set, else conn_direct bound to the
 * connection, as a method would; deleted, the method comes back. A `direct` put in the
 * instance dict itself (`vars(protocol)["direct"] = f`) is not seen, by name either. */
static PyMethodDef direct_def = {"direct", (PyCFunction)(void (*)(void))conn_direct,
                                 METH_FASTCALL, NULL};

static PyObject *conn_get_direct(Conn *self, void *unused) {
    if (self->direct_set != NULL) return Py_NewRef(self->direct_set);
    return PyCFunction_NewEx(&direct_def, (PyObject *)self, NULL);
}

static int conn_set_direct(Conn *self, PyObject *value, void *unused) {
    if (value == NULL && self->direct_set == NULL) {
        PyErr_SetString(PyExc_AttributeError, "direct: only a direct set on the connection "
                                              "can be deleted");
        return -1;
    }
    Py_XSETREF(self->direct_set, Py_XNewRef(value));
    return 0;
}

static PyGetSetDef conn_getset[] = {
    {"direct", (getter)conn_get_direct, (setter)conn_set_direct, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static int conn_traverse(Conn *self, visitproc visit, void *arg) {
#define VISIT(name) Py_VISIT(self->name);
    OBJECTS(VISIT)
#undef VISIT
    Py_VISIT(self->direct_set);
    return 0;
}

static int conn_clear(Conn *self) {
#define CLEAR(name) Py_CLEAR(self->name);
    OBJECTS(CLEAR)
#undef CLEAR
    Py_CLEAR(self->direct_set);
    return 0;
}

static void conn_dealloc(Conn *self) {
    PyObject_GC_UnTrack(self);
    conn_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef conn_methods[] = {
    {"get_buffer", (PyCFunction)conn_get_buffer, METH_O, NULL},
    {"buffer_updated", (PyCFunction)conn_buffer_updated, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

#define M(name, type) {#name, type, offsetof(Conn, name), 0, NULL},
#define OBJECT_MEMBER(name) M(name, T_OBJECT_EX)
static PyMemberDef conn_members[] = {
    OBJECTS(OBJECT_MEMBER) M(waiting, T_ULONGLONG) M(timeout, T_DOUBLE) M(recent, T_DOUBLE)
    M(limit, T_PYSSIZET) M(read_in_c, T_PYSSIZET) {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ConnType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.ClientConn",
    .tp_basicsize = sizeof(Conn),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)conn_dealloc,
    .tp_traverse = (traverseproc)conn_traverse,
    .tp_clear = (inquiry)conn_clear,
    .tp_methods = conn_methods,
    .tp_members = conn_members,
    .tp_getset = conn_getset,
};

/* client_conn_type() -> the type (made ready on the first call). */
PyObject *client_conn_type(PyObject *self, PyObject *unused) {
    if (S_WRITE == NULL) {
        if ((S_WRITE = PyUnicode_InternFromString("write")) == NULL ||
            (S_DONE = PyUnicode_InternFromString("done")) == NULL ||
            (S_SET_RESULT = PyUnicode_InternFromString("set_result")) == NULL ||
            (S_RELEASE = PyUnicode_InternFromString("release")) == NULL ||
            (S_DATA_RECEIVED = PyUnicode_InternFromString("data_received")) == NULL ||
            (S_BUFFER = PyUnicode_InternFromString("_buffer")) == NULL ||
            (S_GROUPS = PyUnicode_InternFromString("groups")) == NULL ||
            (S_SEALED = PyUnicode_InternFromString("sealed")) == NULL ||
            (S_CLOSED = PyUnicode_InternFromString("closed")) == NULL ||
            (S_PENDING = PyUnicode_InternFromString("pending")) == NULL ||
            (S_DIRECT = PyUnicode_InternFromString("direct")) == NULL ||
            (S_GET_BUFFER = PyUnicode_InternFromString("get_buffer")) == NULL ||
            (S_BUFFER_UPDATED = PyUnicode_InternFromString("buffer_updated")) == NULL ||
            (S_COLUMNS = PyUnicode_InternFromString("columns")) == NULL ||
            (S_ANSWERED = PyUnicode_InternFromString("answered")) == NULL) {
            Py_CLEAR(S_WRITE);
            return NULL;
        }
        if (PyType_Ready(&ConnType) < 0) {
            Py_CLEAR(S_WRITE);
            return NULL;
        }
        PyObject *future_of = PyCFunction_New(&future_of_def, NULL);
        int rc = future_of == NULL ? -1 : PyDict_SetItemString(ConnType.tp_dict, "future_of", future_of);
        Py_XDECREF(future_of);
        if (rc < 0) {
            Py_CLEAR(S_WRITE);
            return NULL;
        }
        PyType_Modified(&ConnType);
    }
    return Py_NewRef((PyObject *)&ConnType);
}
