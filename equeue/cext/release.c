/* The broker's durable answers after a group commit's fdatasync (equeue/server/
 * release.py, release_durable): a flushed batch of (peer, request_id, result) entries
 * whose results are all whole answer frames (the broker's Frame, a bytes subclass made by
 * send_answer) is grouped by peer here, each peer's frames joined in batch order, so the
 * Python loop that writes them runs once per connection instead of once per send. At one
 * send in flight per connection (issue 23's durable case) that loop was the broker's
 * largest share of Python per durable send. */
#include "speedups.h"

/* frame added to peer's group (groups: [peer, frame or [frames], count] lists; where:
 * peer -> its index in groups; *last: the group of the entry before, the commonest match).
 * 0, or -1 with an error. */
static int add_frame(PyObject *groups, PyObject *where, PyObject *peer, PyObject *frame,
                     PyObject **last) {
    PyObject *group = NULL;
    if (*last != NULL && PyList_GET_ITEM(*last, 0) == peer) {
        group = *last;
    } else {
        PyObject *at = PyDict_GetItemWithError(where, peer); /* borrowed */
        if (at != NULL)
            group = PyList_GET_ITEM(groups, PyLong_AsSsize_t(at));
        else if (PyErr_Occurred())
            return -1; /* a peer that cannot be hashed: not the broker's */
    }
    if (group == NULL) {
        PyObject *at = PyLong_FromSsize_t(PyList_GET_SIZE(groups));
        if (at == NULL) return -1;
        int failed = PyDict_SetItem(where, peer, at);
        Py_DECREF(at);
        if (failed) return -1;
        PyObject *one = PyLong_FromLong(1);
        group = one == NULL ? NULL : PyList_New(3);
        if (group == NULL) {
            Py_XDECREF(one);
            return -1;
        }
        Py_INCREF(peer);
        Py_INCREF(frame);
        PyList_SET_ITEM(group, 0, peer);
        PyList_SET_ITEM(group, 1, frame);
        PyList_SET_ITEM(group, 2, one);
        failed = PyList_Append(groups, group);
        Py_DECREF(group); /* groups holds it */
        if (failed) return -1;
    } else {
        PyObject *frames = PyList_GET_ITEM(group, 1);
        if (!PyList_CheckExact(frames)) { /* its second frame: a list from here on */
            PyObject *list = PyList_New(1);
            if (list == NULL) return -1;
            PyList_SET_ITEM(list, 0, frames); /* takes the group's reference */
            PyList_SET_ITEM(group, 1, list);
            frames = list;
        }
        if (PyList_Append(frames, frame) < 0) return -1;
        PyObject *count = PyLong_FromSsize_t(PyList_GET_SIZE(frames));
        if (count == NULL) return -1;
        PyList_SetItem(group, 2, count); /* drops the old count */
    }
    *last = group;
    return 0;
}

/* 1 when every entry of batch is a (peer, request_id, result) tuple whose result is
 * exactly of type kind, else 0. */
static int all_frames(PyObject *batch, PyTypeObject *kind) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(batch); i++) {
        PyObject *e = PyList_GET_ITEM(batch, i);
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 3 ||
            Py_TYPE(PyTuple_GET_ITEM(e, 2)) != kind)
            return 0;
    }
    return 1;
}

/* frames_by_peer(batch, kind): [(peer, data, count), ...] in the order each peer first
 * appears, data the peer's frames joined in batch order (bytes), count how many; None
 * when an entry is not a 3-tuple whose result is exactly of type kind (the caller then
 * answers the batch entry by entry). */
PyObject *frames_by_peer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_CheckExact(args[0]) || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "frames_by_peer(batch: list, kind: type)");
        return NULL;
    }
    PyObject *batch = args[0];
    PyTypeObject *kind = (PyTypeObject *)args[1];
    if (!all_frames(batch, kind)) Py_RETURN_NONE;
    PyObject *groups = PyList_New(0);
    PyObject *where = PyDict_New();
    PyObject *out = NULL, *last = NULL;
    if (groups == NULL || where == NULL) goto done;
    /* by index, each entry held while it is added: a peer's hash (the dict) may run
     * Python code, which could change batch */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(batch); i++) {
        PyObject *e = PyList_GET_ITEM(batch, i);
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 3 ||
            Py_TYPE(PyTuple_GET_ITEM(e, 2)) != kind) {
            PyErr_SetString(PyExc_RuntimeError, "frames_by_peer: the batch changed");
            goto done;
        }
        Py_INCREF(e);
        int failed = add_frame(groups, where, PyTuple_GET_ITEM(e, 0), PyTuple_GET_ITEM(e, 2),
                               &last);
        Py_DECREF(e);
        if (failed) goto done;
    }
    Py_ssize_t m = PyList_GET_SIZE(groups);
    out = PyList_New(m);
    if (out == NULL) goto done;
    for (Py_ssize_t j = 0; j < m; j++) {
        PyObject *group = PyList_GET_ITEM(groups, j);
        PyObject *frames = PyList_GET_ITEM(group, 1);
        PyObject *data;
        if (PyList_CheckExact(frames)) /* exact bytes either way: uvloop's write takes a
                                          * bytes subclass through a memoryview cast */
            data = _PyBytes_Join(EMPTY_BYTES, frames);
        else
            data = PyBytes_FromStringAndSize(PyBytes_AS_STRING(frames), PyBytes_GET_SIZE(frames));
        PyObject *item = data == NULL ? NULL : PyTuple_New(3);
        if (item == NULL) {
            Py_XDECREF(data);
            Py_CLEAR(out);
            goto done;
        }
        PyObject *peer = PyList_GET_ITEM(group, 0), *count = PyList_GET_ITEM(group, 2);
        Py_INCREF(peer);
        Py_INCREF(count);
        PyTuple_SET_ITEM(item, 0, peer);
        PyTuple_SET_ITEM(item, 1, data);
        PyTuple_SET_ITEM(item, 2, count);
        PyList_SET_ITEM(out, j, item);
    }
done:
    Py_XDECREF(groups);
    Py_XDECREF(where);
    return out;
}

static PyObject *S_bytes_out, *S_fd, *ONE_ANSWER;
int answer_write(PyObject *transport, int fd, PyObject *data, Py_ssize_t answers); /* answerwrite.c */
PyObject *exact_bytes(PyObject *data);                          /* answerwrite.c */
int transport_closing(PyObject *transport);                     /* answerwrite.c */
int slot_fd(PyObject *obj, Py_ssize_t offset);                  /* answerwrite.c */

/* The Connection slots write_common reads (and in_flight, which it writes), by their
 * offsets in the last peer type seen (sendlane.c's slot_offset): a dict look-up costs
 * more in C than Python's specialized attribute read. */
enum { O_OUT, O_ENDED, O_BATCHING, O_CLOSED, O_TRANSPORT, O_IN_FLIGHT, O_COUNT };
static const char *const SLOT_NAMES[O_COUNT] = {"_out",   "_ended",    "_batching",
                                                "closed", "transport", "in_flight"};
static PyObject *slot_names[O_COUNT];
static PyTypeObject *known_type; /* held */
static Py_ssize_t at[O_COUNT];   /* at[0] -1: that type has not these slots */
static Py_ssize_t fd_at = -1;    /* its _fd slot (answerwrite.c), or -1: none */
Py_ssize_t slot_offset(PyTypeObject *type, PyObject *name); /* sendlane.c */
Py_ssize_t counter_cell(PyTypeObject *type, PyObject *name); /* counters.c */
PyObject *plus(PyObject *value, Py_ssize_t delta);          /* sendlane.c */
#define SLOT(object, offset) (*(PyObject **)((char *)(object) + (offset)))

/* 1 when peer's type has the slots (at[] their offsets), else 0. */
static int has_slots(PyObject *peer) {
    if (Py_TYPE(peer) != known_type) {
        Py_XSETREF(known_type, (PyTypeObject *)Py_NewRef(Py_TYPE(peer)));
        int all = 1;
        for (int i = 0; i < O_COUNT; i++)
            all &= (at[i] = slot_offset(known_type, slot_names[i])) >= 0;
        if (!all) at[0] = -1;
        fd_at = slot_offset(known_type, S_fd);
    }
    return at[0] >= 0;
}

/* peer's frames written the common way: its in_flight counted down, data written unless
 * its transport is closing (to its socket directly when it can: answerwrite.c); 1 done
 * (*written counts the bytes), 0 when the connection has more to do than that (answers
 * queued, half-closed, closed, in a batch, no transport: nothing done), -1 with an error
 * after in_flight was counted down. */
static int write_common(PyObject *peer, PyObject *data, PyObject *count, Py_ssize_t *written) {
    if (!has_slots(peer)) return 0;
    PyObject *v = SLOT(peer, at[O_OUT]);
    if (v == NULL || !PyList_CheckExact(v) || PyList_GET_SIZE(v) != 0) return 0;
    if (SLOT(peer, at[O_ENDED]) != Py_False || SLOT(peer, at[O_BATCHING]) != Py_False ||
        SLOT(peer, at[O_CLOSED]) != Py_False)
        return 0;
    PyObject *transport = SLOT(peer, at[O_TRANSPORT]);
    PyObject **in_flight = &SLOT(peer, at[O_IN_FLIGHT]);
    if (transport == NULL || transport == Py_None || *in_flight == NULL) return 0;
    Py_ssize_t n = PyLong_AsSsize_t(count);
    PyObject *less = n == -1 ? NULL : plus(*in_flight, -n);
    if (less == NULL) return -1;
    Py_SETREF(*in_flight, less);
    Py_INCREF(transport);
    int is = transport_closing(transport);
    if (is == 0) { /* counted before the write, as _write_out counts */
        *written += PyBytes_GET_SIZE(data);
        is = answer_write(transport, slot_fd(peer, fd_at), data, n);
    }
    Py_DECREF(transport);
    return is < 0 ? -1 : 1;
}

/* The error set, kept in type, value and tb when none is kept yet, else unraisable. */
static void keep(PyObject **type, PyObject **value, PyObject **tb) {
    if (*type != NULL) {
        PyErr_WriteUnraisable(NULL);
        return;
    }
    PyErr_Fetch(type, value, tb);
}

/* v (an exact int) is 1: the small-int singleton, or any other int of that value (the
 * public API: an int's layout is CPython's own and changed in 3.12). */
static inline int is_one(PyObject *v) {
    if (v == ONE_ANSWER) return 1;
    int overflow;
    return PyLong_AsLongLongAndOverflow(v, &overflow) == 1 && !overflow;
}

/* write_common for one peer, other() when it has more to do, failed() when that
 * raised an Exception; -1 with the error kept for any other (KeyboardInterrupt,
 * SystemExit: the Python loop it replaces catches Exception only), else 0. */
static int release_one(PyObject *const *args, PyObject *peer, PyObject *data, PyObject *count,
                       Py_ssize_t *written) {
    int done = write_common(peer, data, count, written);
    if (done > 0) return 0;
    PyObject *r = NULL;
    if (done == 0) {
        PyObject *exact = exact_bytes(data);
        if (exact == NULL) { /* (no memory) the Frame itself */
            PyErr_Clear();
            exact = Py_NewRef(data);
        }
        PyObject *call[3] = {peer, exact, count};
        r = PyObject_Vectorcall(args[3], call, 3, NULL);
        Py_DECREF(exact);
    }
    if (r == NULL && !PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    if (r == NULL) { /* other() raised, or the write did */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
        PyObject *call[2] = {peer, value != NULL ? value : Py_None};
        r = PyObject_Vectorcall(args[4], call, 2, NULL);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        if (r == NULL) PyErr_WriteUnraisable(args[4]);
    }
    Py_XDECREF(r);
    return 0;
}

/* release_frames(batch, kind, counters, other, failed): release_durable's common case
 * whole in C. A batch of kind frames alone is answered by connection: a connection with
 * this one answer in flight (in_flight 1: a client with one send at a time, the commonest)
 * gets its frame as it is, the others their frames joined in batch order
 * (frames_by_peer); each connection's in one transport.write with its in_flight counted
 * down, counters.bytes_out counted once; other(connection, data, count) for a connection
 * with more to do (release.py's _release_one), failed(connection, exception) for a
 * connection whose write raised an Exception (logged there; the others are answered all
 * the same). False, nothing done, when the batch is not frames alone; an error before
 * anything was answered or counted (the grouping), or, once every connection was
 * answered and bytes_out counted, the first KeyboardInterrupt/SystemExit (not an
 * Exception) a write raised: re-raised, as the Python loop let it through. */
PyObject *release_frames(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_CheckExact(args[0]) || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "release_frames(batch: list, kind: type, counters, other, failed)");
        return NULL;
    }
    PyObject *batch = args[0];
    Py_ssize_t n = PyList_GET_SIZE(batch);
    if (!all_frames(batch, (PyTypeObject *)args[1])) Py_RETURN_FALSE;
    /* The lone answers apart (only reads: nothing may run Python code before the
     * grouping, which may fail), the rest grouped. */
    PyObject *singles = PyList_New(0), *rest = PyList_New(0), *grouped = NULL;
    if (singles == NULL || rest == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(batch, i), *peer = PyTuple_GET_ITEM(e, 0), *v;
        int lone = has_slots(peer) && (v = SLOT(peer, at[O_IN_FLIGHT])) != NULL &&
                   PyLong_CheckExact(v) && is_one(v);
        if (PyList_Append(lone ? singles : rest, e) < 0) goto fail;
    }
    if (PyList_GET_SIZE(rest) != 0) {
        PyObject *call[2] = {rest, args[1]};
        grouped = frames_by_peer(self, call, 2);
        if (grouped == NULL) goto fail;
        if (grouped == Py_None) { /* (cannot be: checked above) */
            Py_CLEAR(grouped);
            PyErr_SetString(PyExc_RuntimeError, "release_frames: the batch changed");
            goto fail;
        }
    }
    /* From here on every connection is answered: nothing raises out but a BaseException
     * a write raised, kept until the end (the first; a later one is unraisable). */
    Py_ssize_t written = 0;
    PyObject *kept_type = NULL, *kept = NULL, *kept_tb = NULL;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(singles); j++) {
        PyObject *e = PyList_GET_ITEM(singles, j); /* the Frame as it is: sent directly,
                                                     * or copied to exact bytes before a
                                                     * write (answer_write, release_one) */
        if (release_one(args, PyTuple_GET_ITEM(e, 0), PyTuple_GET_ITEM(e, 2), ONE_ANSWER,
                        &written) < 0)
            keep(&kept_type, &kept, &kept_tb);
    }
    for (Py_ssize_t j = 0; grouped != NULL && j < PyList_GET_SIZE(grouped); j++) {
        PyObject *item = PyList_GET_ITEM(grouped, j);
        if (release_one(args, PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1),
                        PyTuple_GET_ITEM(item, 2), &written) < 0)
            keep(&kept_type, &kept, &kept_tb);
    }
    Py_DECREF(singles);
    Py_DECREF(rest);
    Py_XDECREF(grouped);
    Py_ssize_t cell = written ? counter_cell(Py_TYPE(args[2]), S_bytes_out) : -1;
    if (cell >= 0) /* a CCounters (counters.c): no int made */
        *(long long *)((char *)args[2] + cell) += written;
    else if (written) {
        PyObject *old = PyObject_GetAttr(args[2], S_bytes_out), *sum = NULL;
        if (old != NULL && (sum = plus(old, written)) != NULL)
            PyObject_SetAttr(args[2], S_bytes_out, sum);
        Py_XDECREF(old);
        Py_XDECREF(sum);
        if (PyErr_Occurred()) PyErr_WriteUnraisable(args[2]);
    }
    if (kept_type != NULL) {
        PyErr_Restore(kept_type, kept, kept_tb);
        return NULL;
    }
    Py_RETURN_TRUE;
fail:
    Py_XDECREF(singles);
    Py_XDECREF(rest);
    return NULL;
}

int release_ready(void) {
#define NAME(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    NAME(S_bytes_out, "bytes_out") NAME(S_fd, "_fd")
#undef NAME
    if ((ONE_ANSWER = PyLong_FromLong(1)) == NULL) return -1;
    for (int i = 0; i < O_COUNT; i++)
        if ((slot_names[i] = PyUnicode_InternFromString(SLOT_NAMES[i])) == NULL) return -1;
    return 0;
}
