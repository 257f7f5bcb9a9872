/* The end of a group commit's flush in C, for the common case (equeue/server/
 * groupcommit.py, CrossClientCommit._released).
 *
 * Why: at 64 connections with one durable send in flight each, ~45 sends share an
 * fdatasync, and the Python run at each one's end (CSync._ended, _released, expected,
 * _due) was ~600 opcodes a flush with the adds that arm and start the next: ~1.2 k
 * instructions a send, the largest share of Python left on the broker's loop (issue 23).
 *
 * Released(commit, failed) is the ``done`` the flusher calls with (error, seconds). With
 * no error, a list in fdatasync, no drain waiting on it (_released_one None), no
 * overlap configured (_overlap_per 0) and every slot of the type _released reads, it
 * does what _released does, on the commit's __slots__ at their offsets (as commitadd.c
 * does for add): the counts, the expected sends (expected()), the next flush's start
 * when sends wait (the commit's own _due and _start, called as methods: the policy stays
 * the Python code's), then the batch's release (_release_batch), an Exception from it
 * handed to failed(batch, exception) to log. Anything else, or a commit type whose class
 * says its _released is not the one mirrored here (_c_end false: a subclass overriding
 * it), calls the commit's Python _released before anything is changed. */
#include "speedups.h"
#include <stddef.h>

Py_ssize_t slot_offset(PyTypeObject *type, PyObject *name); /* sendlane.c */
PyObject *plus(PyObject *value, Py_ssize_t delta);          /* sendlane.c */

enum { R_FLUSHING, R_FLUSHING_MESSAGES, R_TOOK, R_WAITING, R_FLUSHES, R_SENDS_FLUSHED,
       R_MAX_WAIT, R_BACK, R_OVERLAP_PER, R_ARRIVED, R_CLOSING, R_RELEASE_BATCH,
       R_RELEASED_ONE, R_COUNT };
static const char *const NAMES[R_COUNT] = {
    "_flushing", "_flushing_messages", "_took", "_waiting", "flushes", "sends_flushed",
    "_max_wait", "_back", "_overlap_per", "_arrived", "_closing", "_release_batch",
    "_released_one",
};
static PyObject *names[R_COUNT], *S_released, *S_due, *S_start, *S_set, *S_c_end;
/* flush ends handled here, in this process (the tests' and the stats' check) */
static unsigned long long ends_in_c;

#define SLOT(object, offset) (*(PyObject **)((char *)(object) + (offset)))

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *commit;       /* held */
    PyObject *failed;       /* failed(batch, exception): logs a release that raised */
    Py_ssize_t at[R_COUNT]; /* the commit's slots; at[0] -1: always its Python _released */
} Released;

/* The sends a flush of batch (a non-empty list) leads the commit to expect next:
 * groupcommit.expected(). */
static Py_ssize_t expected(PyObject *batch) {
    Py_ssize_t n = PyList_GET_SIZE(batch);
    PyObject *first = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(batch, i);
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 3) return -1; /* Python's */
        PyObject *peer = PyTuple_GET_ITEM(e, 0);
        if (first == NULL)
            first = peer;
        else if (peer != first)
            return n;
    }
    return 0;
}

/* A float or int slot's truth where it is exactly one of those: 1 or 0, -1 else. */
static int number_truth(PyObject *v) {
    if (v == NULL) return -1;
    if (PyFloat_CheckExact(v)) return PyFloat_AS_DOUBLE(v) != 0.0;
    if (PyLong_CheckExact(v)) {
        int overflow;
        return PyLong_AsLongLongAndOverflow(v, &overflow) != 0 || overflow;
    }
    return -1;
}

/* 1: released here; 0: the Python _released is needed (nothing changed); -1: an error
 * (before anything changed, or raised by _due, _start, or a BaseException the release
 * raised, as the Python _released lets them out). */
static int released_fast(Released *r, PyObject *took) {
    const Py_ssize_t *at = r->at;
    PyObject *c = r->commit;
    if (at[0] < 0 || !PyFloat_CheckExact(took)) return 0;
    PyObject *batch = SLOT(c, at[R_FLUSHING]), *waiting = SLOT(c, at[R_WAITING]);
    if (batch == NULL || !PyList_CheckExact(batch) || PyList_GET_SIZE(batch) == 0 ||
        waiting == NULL || !PyList_CheckExact(waiting))
        return 0;
    if (SLOT(c, at[R_RELEASED_ONE]) != Py_None) return 0; /* draining: Python's */
    PyObject *closing = SLOT(c, at[R_CLOSING]);
    if (closing != Py_True && closing != Py_False) return 0;
    if (number_truth(SLOT(c, at[R_OVERLAP_PER])) != 0) return 0; /* _overlap: Python's */
    int max_wait = number_truth(SLOT(c, at[R_MAX_WAIT]));
    PyObject *messages = SLOT(c, at[R_FLUSHING_MESSAGES]), *flushes = SLOT(c, at[R_FLUSHES]);
    PyObject *sent = SLOT(c, at[R_SENDS_FLUSHED]), *back = SLOT(c, at[R_BACK]);
    PyObject *release = SLOT(c, at[R_RELEASE_BATCH]);
    if (max_wait < 0 || messages == NULL || !PyLong_CheckExact(messages) || flushes == NULL ||
        sent == NULL || back == NULL || release == NULL)
        return 0;
    Py_ssize_t more = max_wait ? expected(batch) : 0;
    if (more < 0) return 0; /* not a batch of entries: Python's (it raises) */
    /* Every new value first: a failure leaves the commit as it was. */
    PyObject *new_flushes = plus(flushes, 1);
    PyObject *new_sent = PyNumber_Add(sent, messages);
    PyObject *new_back = more ? plus(back, more) : Py_NewRef(back);
    if (new_flushes == NULL || new_sent == NULL || new_back == NULL) {
        Py_XDECREF(new_flushes);
        Py_XDECREF(new_sent);
        Py_XDECREF(new_back);
        return -1;
    }
    batch = Py_NewRef(batch);
    Py_SETREF(SLOT(c, at[R_FLUSHING]), Py_NewRef(Py_None));
    Py_SETREF(SLOT(c, at[R_TOOK]), Py_NewRef(took));
    Py_SETREF(SLOT(c, at[R_FLUSHES]), new_flushes);
    Py_SETREF(SLOT(c, at[R_SENDS_FLUSHED]), new_sent);
    Py_SETREF(SLOT(c, at[R_BACK]), new_back);
    Py_SETREF(SLOT(c, at[R_ARRIVED]), Py_NewRef(ZERO));
    ends_in_c++;
    /* _due's first test in place (nothing waiting, or closing: no flush, nothing done);
     * else the commit's _due, which may arm the wait's bound, and _start. */
    waiting = SLOT(c, at[R_WAITING]);
    if (waiting != NULL && PyList_CheckExact(waiting) && PyList_GET_SIZE(waiting) == 0)
        ; /* (the commonest: every connection waits for this batch's answers) */
    else if (SLOT(c, at[R_CLOSING]) != Py_True) {
        PyObject *due = PyObject_CallMethodNoArgs(c, S_due);
        int start = due == NULL ? -1 : PyObject_IsTrue(due);
        Py_XDECREF(due);
        PyObject *started = start > 0 ? PyObject_CallMethodNoArgs(c, S_start) : NULL;
        Py_XDECREF(started);
        if (start < 0 || (start > 0 && started == NULL)) {
            Py_DECREF(batch);
            return -1;
        }
    }
    PyObject *call[2] = {batch, Py_None};
    PyObject *done = PyObject_Vectorcall(release, call, 2, NULL);
    if (done == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            Py_DECREF(batch);
            return -1;
        }
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
        PyObject *args[2] = {batch, value != NULL ? value : Py_None};
        done = PyObject_Vectorcall(r->failed, args, 2, NULL);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        if (done == NULL) PyErr_WriteUnraisable(r->failed);
    }
    Py_XDECREF(done);
    Py_DECREF(batch);
    PyObject *one = SLOT(c, at[R_RELEASED_ONE]);
    if (one != NULL && one != Py_None) { /* (set meanwhile: cannot be, but as Python does) */
        PyObject *set = PyObject_CallMethodNoArgs(one, S_set);
        if (set == NULL) return -1;
        Py_DECREF(set);
    }
    return 1;
}

static PyObject *Released_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames) {
    Released *r = (Released *)self;
    if (PyVectorcall_NARGS(nargsf) != 2 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "Released(error, took)");
        return NULL;
    }
    if (args[0] == Py_None) {
        int done = released_fast(r, args[1]);
        if (done < 0) return NULL;
        if (done > 0) Py_RETURN_NONE;
    }
    PyObject *call[3] = {r->commit, args[0], args[1]};
    return PyObject_VectorcallMethod(S_released, call, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                     NULL);
}

static int Released_init(Released *r, PyObject *args, PyObject *kwargs) {
    PyObject *commit, *failed;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "Released(commit, failed)");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OO:Released", &commit, &failed)) return -1;
    Py_XSETREF(r->commit, Py_NewRef(commit));
    Py_XSETREF(r->failed, Py_NewRef(failed));
    PyTypeObject *type = Py_TYPE(commit);
    r->at[0] = -1;
    if (_PyType_Lookup(type, S_c_end) != Py_True) return 0; /* (borrowed) */
    Py_ssize_t at[R_COUNT];
    for (int i = 0; i < R_COUNT; i++)
        if ((at[i] = slot_offset(type, names[i])) < 0) return 0;
    memcpy(r->at, at, sizeof at);
    return 0;
}

static PyObject *Released_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Released *r = (Released *)type->tp_alloc(type, 0);
    if (r != NULL) {
        r->vectorcall = Released_vectorcall;
        r->at[0] = -1;
    }
    return (PyObject *)r;
}

static int Released_traverse(Released *r, visitproc visit, void *arg) {
    Py_VISIT(r->commit);
    Py_VISIT(r->failed);
    return 0;
}

static int Released_clear(Released *r) {
    r->at[0] = -1;
    Py_CLEAR(r->commit);
    Py_CLEAR(r->failed);
    return 0;
}

static void Released_dealloc(Released *r) {
    PyObject_GC_UnTrack(r);
    Released_clear(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *Released_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "Released(error, took)");
        return NULL;
    }
    return Released_vectorcall(self, &PyTuple_GET_ITEM(args, 0),
                               (size_t)PyTuple_GET_SIZE(args), NULL);
}

static PyObject *Released_in_c(Released *r, void *unused) {
    return PyBool_FromLong(r->at[0] >= 0);
}

static PyGetSetDef Released_getset[] = {
    {"in_c", (getter)Released_in_c, NULL,
     "whether the common case is released here (else always by the commit's _released)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject ReleasedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.Released",
    .tp_basicsize = sizeof(Released),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Released, vectorcall),
    .tp_call = Released_call,
    .tp_new = Released_new,
    .tp_init = (initproc)Released_init,
    .tp_dealloc = (destructor)Released_dealloc,
    .tp_traverse = (traverseproc)Released_traverse,
    .tp_clear = (inquiry)Released_clear,
    .tp_getset = Released_getset,
};

/* flush_ends_in_c() -> how many flush ends Released handled in C in this process. */
PyObject *flush_ends_in_c(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(ends_in_c);
}

int flush_end_ready(void) {
    for (int i = 0; i < R_COUNT; i++)
        if ((names[i] = PyUnicode_InternFromString(NAMES[i])) == NULL) return -1;
#define NAME(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    NAME(S_released, "_released") NAME(S_due, "_due") NAME(S_start, "_start")
    NAME(S_set, "set") NAME(S_c_end, "_c_end")
#undef NAME
    return PyType_Ready(&ReleasedType);
}
