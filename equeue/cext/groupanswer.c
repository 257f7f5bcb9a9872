/* A coalesced group's answer given to its callers in C (equeue/client/coalesce.py:
 * Answer's base when the accelerator is built).
 *
 * Callgrind, one client shared by 16 tasks under --flush sync (docs/benchmarks.md, "coalc2
 * (round 19)"): the once-per-group Python of the read, data_received -> _answers ->
 * Answer.answered (give_back, the columns' discard, the decode's tuple, woken_together),
 * was ~2.5 k of the client's ~13.5 k instructions a send.
 *
 * AnswerBase: the fields `coalescer`, `topic`, `bodies`, `futures`, `givens`,
 *     `request_id`, set by Answer.__init__; and
 *
 * answered(status, payload): the plain case in C: STATUS_OK, a group of more than one
 *     send, the payload the tuple AnswerReader's columns_answer made (its results, one
 *     per send), the protocol a ClientConn (or a direct subclass) with no caller waiting
 *     for a place. Then, as Answer.answered_slow does it: `free += count - 1`, the
 *     request id discarded from `reader.columns`, and each caller's future given its
 *     result by groupwake.c's group_wake (`now`: no caller waits), inside `flushing` set
 *     (woken_together: their next sends go in one group) unless a write is already
 *     scheduled, then unless closed `protocol._flush()` at once when nothing else waits in
 *     the loop's pass (nothing_else_this_pass), else `protocol.schedule()`. Everything
 *     else (an error, results not read in C, a group of one, a count that differs,
 *     callers waiting for a place, a protocol of another type) goes to
 *     `self.answered_slow(status, payload)`, the Python method, before anything is
 *     changed. */
#include "speedups.h"
#include <structmember.h>

int clientconn_is(PyObject *object); /* clientconn.c */
void clientconn_answer_fields(PyObject *conn, PyObject **queued, PyObject **reader,
                              PyObject **flushing, PyObject **closed);
int clientconn_give_back(PyObject *conn, Py_ssize_t places);
void clientconn_set_flushing(PyObject *conn, PyObject *value);
PyObject *coalescer_protocol(PyObject *object); /* coalesceadd.c */
PyObject *group_wake(PyObject *self, PyObject *const *args, Py_ssize_t nargs); /* groupwake.c */

typedef struct {
    PyObject_HEAD
    PyObject *coalescer, *topic, *bodies, *futures, *givens, *request_id;
} Answer;

PyObject *clientconn_loop(PyObject *conn);

static PyTypeObject AnswerType;
static PyObject *S_ANSWERED_SLOW, *S_COLUMNS, *S_SCHEDULE, *S_FLUSH, *S_READY;

/* Whether nothing else runs in this loop pass before the write `schedule` would make in
 * the next one: the loop one of asyncio's own (its `_ready` an exact deque: uvloop has
 * none) with no callback left in `_ready` (1, else 0; no error). Then the `_flush` that
 * call_soon would run first in the next pass, before that pass's I/O callbacks and due
 * timers, is run here instead, with nothing of the caller's seen differently: the same
 * sends in the same request, one loop pass (asyncio's _run_once, a select(0) and a
 * Handle) sooner and cheaper. A wake-up the Waiter could not run at once was scheduled
 * (its Handle in `_ready`), and its task sends in this pass: then `schedule` as before. */
static int nothing_else_this_pass(PyObject *protocol) {
    PyObject *loop = clientconn_loop(protocol);
    if (loop == NULL) return 0;
    Py_INCREF(loop); /* (held: a `_ready` property may run anything) */
    PyObject *ready = PyObject_GetAttr(loop, S_READY);
    Py_DECREF(loop);
    if (ready == NULL) {
        PyErr_Clear();
        return 0;
    }
    int empty =
        strcmp(Py_TYPE(ready)->tp_name, "collections.deque") == 0 && Py_SIZE(ready) == 0;
    Py_DECREF(ready);
    return empty;
}

/* Whether a field holds a true value: 1, 0 (also unset), -1. */
static int truth(PyObject *value) {
    return value == NULL ? 0 : value == Py_True ? 1 : value == Py_False ? 0 : PyObject_IsTrue(value);
}

static PyObject *slow(Answer *self, PyObject *const *args) {
    PyObject *call[3] = {(PyObject *)self, args[0], args[1]};
    return PyObject_VectorcallMethod(S_ANSWERED_SLOW, call, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                     NULL);
}

/* The error `_flush()` raised where the write-now path called it, given to the loop's
 * exception handler as Handle._run gives a callback's (where `schedule` would have run
 * it): the read goes on, its answer is not put back in `pending` (its callers have their
 * results). None, NULL (the handler raised). */
static PyObject *reported(PyObject *protocol) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *loop = clientconn_loop(protocol);
    if (loop == NULL || value == NULL) {
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    if (tb != NULL) PyException_SetTraceback(value, tb);
    PyObject *context = Py_BuildValue("{s:s,s:O,s:O}", "message",
                                      "Exception in the write of a woken group's sends (_flush)",
                                      "exception", value, "protocol", protocol);
    Py_INCREF(loop);
    PyObject *r = context == NULL ? NULL
                                  : PyObject_CallMethod(loop, "call_exception_handler", "O",
                                                        context);
    Py_DECREF(loop);
    Py_XDECREF(context);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return r;
}

/* The wake-ups inside `flushing` (woken_together), then the turn's write scheduled unless
 * closed, also when a wake-up raised (its `finally`): None, NULL. */
static PyObject *woken_together(PyObject *protocol, PyObject *const *wake_args) {
    clientconn_set_flushing(protocol, Py_True);
    PyObject *woken = group_wake(NULL, wake_args, 3);
    clientconn_set_flushing(protocol, Py_False);
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    if (woken == NULL) PyErr_Fetch(&type, &value, &tb);
    PyObject *queued, *reader, *flushing, *closed;
    clientconn_answer_fields(protocol, &queued, &reader, &flushing, &closed);
    int is_closed = truth(closed);
    PyObject *scheduled;
    if (is_closed != 0)
        scheduled = is_closed < 0 ? NULL : Py_NewRef(Py_None);
    else if (woken != NULL && nothing_else_this_pass(protocol)) {
        scheduled = PyObject_CallMethodNoArgs(protocol, S_FLUSH);
        if (scheduled == NULL && PyErr_ExceptionMatches(PyExc_Exception))
            scheduled = reported(protocol);
    } else
        scheduled = PyObject_CallMethodNoArgs(protocol, S_SCHEDULE);
    if (scheduled == NULL) { /* (raised in the finally: that error, the first its context) */
        if (type != NULL) {
            PyObject *later_type, *later, *later_tb;
            PyErr_Fetch(&later_type, &later, &later_tb);
            PyErr_NormalizeException(&later_type, &later, &later_tb);
            PyErr_NormalizeException(&type, &value, &tb);
            if (tb != NULL) PyException_SetTraceback(value, tb);
            if (later != NULL && value != NULL) PyException_SetContext(later, Py_NewRef(value));
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            PyErr_Restore(later_type, later, later_tb);
        }
        Py_XDECREF(woken);
        return NULL;
    }
    Py_DECREF(scheduled);
    if (type != NULL) {
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    return woken;
}

static PyObject *an_answered(Answer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "answered(status, payload): 2 arguments, not %zd", nargs);
        return NULL;
    }
    PyObject *status = args[0], *payload = args[1], *futures = self->futures;
    if (!PyLong_CheckExact(status) || futures == NULL || !PyList_CheckExact(futures) ||
        !PyTuple_CheckExact(payload) || PyTuple_GET_SIZE(payload) < 1 || self->request_id == NULL)
        return slow(self, args);
    Py_ssize_t count = PyList_GET_SIZE(futures);
    PyObject *results = PyTuple_GET_ITEM(payload, 0);
    int overflow = 0;
    if (PyLong_AsLongAndOverflow(status, &overflow) != 0 || overflow || count < 2 ||
        !PyList_CheckExact(results) || PyList_GET_SIZE(results) != count)
        return slow(self, args);
    PyObject *protocol = self->coalescer == NULL ? NULL : coalescer_protocol(self->coalescer);
    if (protocol == NULL || !clientconn_is(protocol)) return slow(self, args);
    PyObject *queued, *reader, *flushing, *closed;
    clientconn_answer_fields(protocol, &queued, &reader, &flushing, &closed);
    if (queued == NULL || reader == NULL || flushing == NULL) return slow(self, args);
    Py_ssize_t waiting = PyObject_Length(queued);
    if (waiting < 0) return NULL;
    PyObject *columns = waiting ? NULL : PyObject_GetAttr(reader, S_COLUMNS);
    if (columns == NULL) return PyErr_Occurred() ? NULL : slow(self, args);
    if (!PySet_CheckExact(columns)) {
        Py_DECREF(columns);
        return slow(self, args);
    }
    int scheduled = truth(flushing);
    if (scheduled < 0 || clientconn_give_back(protocol, count - 1) < 0) {
        Py_DECREF(columns);
        return NULL;
    }
    int discarded = PySet_Discard(columns, self->request_id);
    Py_DECREF(columns);
    if (discarded < 0) return NULL;
    /* (the protocol and the lists held: a task run at once may drop this answer) */
    Py_INCREF(protocol);
    Py_INCREF(futures);
    Py_INCREF(results);
    PyObject *wake_args[3] = {futures, results, Py_True};
    PyObject *r = scheduled ? group_wake(NULL, wake_args, 3) : woken_together(protocol, wake_args);
    Py_DECREF(results);
    Py_DECREF(futures);
    Py_DECREF(protocol);
    return r;
}

static int an_traverse(Answer *self, visitproc visit, void *arg) {
    Py_VISIT(self->coalescer);
    Py_VISIT(self->topic);
    Py_VISIT(self->bodies);
    Py_VISIT(self->futures);
    Py_VISIT(self->givens);
    Py_VISIT(self->request_id);
    return 0;
}

static int an_clear(Answer *self) {
    Py_CLEAR(self->coalescer);
    Py_CLEAR(self->topic);
    Py_CLEAR(self->bodies);
    Py_CLEAR(self->futures);
    Py_CLEAR(self->givens);
    Py_CLEAR(self->request_id);
    return 0;
}

static void an_dealloc(Answer *self) {
    PyObject_GC_UnTrack(self);
    an_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef an_methods[] = {
    {"answered", (PyCFunction)(void (*)(void))an_answered, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef an_members[] = {
    {"coalescer", T_OBJECT_EX, offsetof(Answer, coalescer), 0, NULL},
    {"topic", T_OBJECT_EX, offsetof(Answer, topic), 0, NULL},
    {"bodies", T_OBJECT_EX, offsetof(Answer, bodies), 0, NULL},
    {"futures", T_OBJECT_EX, offsetof(Answer, futures), 0, NULL},
    {"givens", T_OBJECT_EX, offsetof(Answer, givens), 0, NULL},
    {"request_id", T_OBJECT_EX, offsetof(Answer, request_id), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject AnswerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.AnswerBase",
    .tp_basicsize = sizeof(Answer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)an_dealloc,
    .tp_traverse = (traverseproc)an_traverse,
    .tp_clear = (inquiry)an_clear,
    .tp_methods = an_methods,
    .tp_members = an_members,
};

/* For clientconn.c: whether object is an AnswerBase (a coalesced group's request). */
int group_answer_is(PyObject *object) { return PyObject_TypeCheck(object, &AnswerType); }

/* For clientconn.c: the group's callers' futures (borrowed; NULL while unset). */
PyObject *group_answer_futures(PyObject *answer) { return ((Answer *)answer)->futures; }

/* client_answer_type() -> AnswerBase, made ready on the first call. */
PyObject *client_answer_type(PyObject *unused, PyObject *unused2) {
    if (S_ANSWERED_SLOW == NULL) {
        if ((S_COLUMNS = PyUnicode_InternFromString("columns")) == NULL ||
            (S_SCHEDULE = PyUnicode_InternFromString("schedule")) == NULL ||
            (S_FLUSH = PyUnicode_InternFromString("_flush")) == NULL ||
            (S_READY = PyUnicode_InternFromString("_ready")) == NULL ||
            PyType_Ready(&AnswerType) < 0)
            return NULL;
        if ((S_ANSWERED_SLOW = PyUnicode_InternFromString("answered_slow")) == NULL) return NULL;
    }
    return Py_NewRef((PyObject *)&AnswerType);
}
