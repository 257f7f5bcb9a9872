/* The group commit's add in C, for the common case (equeue/server/groupcommit.py).
 *
 * CrossClientCommit.add appends (peer, request id, result) to _waiting and counts
 * _messages, _arrived and _back; then, with no flush in progress, _due decides whether to
 * start one or arm the wait's bound. At one send in flight per connection (issue 23's
 * durable case) nearly every add finds a flush in progress or the bound already armed
 * with more sends still expected than the slack: _due then decides nothing and changes
 * nothing. commit_add does exactly that add on CrossClientCommit's __slots__ at their
 * offsets (as sendlane.c reads the Connection's) with no Python frame; every other case
 * (a flush might be due: no flush in progress and the bound not armed, or the count
 * reached, or hurrying) goes to the Python add before anything is changed, so the policy
 * stays the Python code's alone. A commit type without the slots, or whose add or _due
 * is not the function CrossClientCommit._c_policy holds (a subclass overriding either, or
 * either replaced on the class or a base at any time: the type's version tag, compared
 * each add, says when to look again), always goes to its Python add. */
#include "speedups.h"
#include "commitadd.h"

enum { K_WAITING, K_MESSAGES, K_ARRIVED, K_BACK, K_SLACK, K_FLUSHING, K_CLOSING, K_HURRY,
       K_WAITED };
static const char *const NAMES[COMMIT_SLOTS] = {"_waiting", "_messages", "_arrived",
                                                "_back",    "_slack",    "_flushing",
                                                "_closing", "_hurry",    "_waited"};
static PyObject *names[COMMIT_SLOTS], *S_add, *S_due, *S_c_policy;
/* adds made here, in this process (the broker's stats: group_commit_adds_in_c) */
static unsigned long long adds_in_c;

#define SLOT(object, offset) (*(PyObject **)((char *)(object) + (offset)))

Py_ssize_t slot_offset(PyTypeObject *type, PyObject *name); /* sendlane.c */
PyObject *plus(PyObject *value, Py_ssize_t delta);

/* Whether type's add and _due are the ones its _c_policy names (all borrowed). */
static int mirrored(PyTypeObject *type) {
    PyObject *policy = _PyType_Lookup(type, S_c_policy);
    return policy != NULL && PyTuple_CheckExact(policy) && PyTuple_GET_SIZE(policy) == 2 &&
           _PyType_Lookup(type, S_add) == PyTuple_GET_ITEM(policy, 0) &&
           _PyType_Lookup(type, S_due) == PyTuple_GET_ITEM(policy, 1);
}

void commit_slots(PyObject *commit, CommitSlots *out) {
    out->type = NULL;
    out->tag = 0;
    out->fast = 0;
    if (commit == NULL || commit == Py_None) return;
    PyTypeObject *type = Py_TYPE(commit);
    out->type = type;
    int fast = mirrored(type); /* (the look-ups give the type a version tag) */
    if (PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) out->tag = type->tp_version_tag;
    if (!fast) return;
    for (int i = 0; i < COMMIT_SLOTS; i++)
        if ((out->at[i] = slot_offset(type, names[i])) < 0) return;
    out->fast = 1;
}

/* A C long long of an exact int slot, or 0 with *ok cleared. */
static long long int_of(PyObject *v, int *ok) {
    if (v == NULL || !PyLong_CheckExact(v)) {
        *ok = 0;
        return 0;
    }
    int overflow;
    long long n = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || n > (1LL << 62) || n < -(1LL << 62)) *ok = 0;
    return n;
}

/* 1: added (nothing more was due), 0: the Python add is needed (nothing changed),
 * -1: an error (nothing changed). */
static int add_fast(PyObject *commit, const CommitSlots *slots, PyObject *peer,
                    PyObject *request_id, PyObject *result, Py_ssize_t messages) {
    if (!slots->fast) return 0;
    const Py_ssize_t *at = slots->at;
    PyObject *waiting = SLOT(commit, at[K_WAITING]);
    if (waiting == NULL || !PyList_CheckExact(waiting)) return 0;
    int ok = 1;
    long long back = int_of(SLOT(commit, at[K_BACK]), &ok);
    int_of(SLOT(commit, at[K_MESSAGES]), &ok);
    int_of(SLOT(commit, at[K_ARRIVED]), &ok);
    if (!ok) return 0;
    PyObject *flushing = SLOT(commit, at[K_FLUSHING]);
    if (flushing == NULL) return 0;
    if (back != 0) back -= 1; /* what add does before asking _due ("if self._back") */
    if (flushing == Py_None) {
        /* _due with something waiting: closing -> nothing; hurry or the count reached ->
         * start; the bound not armed -> arm it (or start); else nothing. Only "nothing"
         * is done here. */
        PyObject *closing = SLOT(commit, at[K_CLOSING]);
        if (closing != Py_False) return 0; /* (closing: rare, Python's) */
        if (SLOT(commit, at[K_HURRY]) != Py_False) return 0;
        if (SLOT(commit, at[K_WAITED]) != Py_True) return 0;
        long long slack = int_of(SLOT(commit, at[K_SLACK]), &ok);
        if (!ok || back <= slack) return 0;
    }
    /* Every new value first: a failure leaves the commit as it was. */
    PyObject *entry = PyTuple_Pack(3, peer, request_id, result);
    if (entry == NULL) return -1;
    PyObject *new_messages = plus(SLOT(commit, at[K_MESSAGES]), messages);
    PyObject *new_arrived = plus(SLOT(commit, at[K_ARRIVED]), 1);
    PyObject *new_back = PyLong_FromLongLong(back);
    if (new_messages == NULL || new_arrived == NULL || new_back == NULL ||
        PyList_Append(waiting, entry) < 0) {
        Py_DECREF(entry);
        Py_XDECREF(new_messages);
        Py_XDECREF(new_arrived);
        Py_XDECREF(new_back);
        return -1;
    }
    Py_DECREF(entry);
    Py_SETREF(SLOT(commit, at[K_MESSAGES]), new_messages);
    Py_SETREF(SLOT(commit, at[K_ARRIVED]), new_arrived);
    Py_SETREF(SLOT(commit, at[K_BACK]), new_back);
    adds_in_c++;
    return 1;
}

int commit_add(PyObject *commit, CommitSlots *slots, PyObject *peer,
               PyObject *request_id, PyObject *result, PyObject *messages) {
    /* A replaced add or _due, or new slots, show as a new version tag (CPython gives the
     * type and its subclasses one on any change), never reused: 0 is no tag. */
    PyTypeObject *type = Py_TYPE(commit);
    if (type != slots->type || type->tp_version_tag != slots->tag || slots->tag == 0)
        commit_slots(commit, slots);
    Py_ssize_t m = PyLong_CheckExact(messages) ? PyLong_AsSsize_t(messages) : -1;
    if (m < 0) PyErr_Clear();
    int done = m < 0 ? 0 : add_fast(commit, slots, peer, request_id, result, m);
    if (done != 0) return done;
    PyObject *args[5] = {commit, peer, request_id, result, messages};
    PyObject *r = PyObject_VectorcallMethod(S_add, args, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                            NULL);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* commit_add(commit, peer, request_id, result, messages) -> whether C added it (else the
 * Python add did): commit.add(...) as the send lane does it, for the tests that hold it
 * to the Python add. */
PyObject *py_commit_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "commit_add(commit, peer, request_id, result, messages)");
        return NULL;
    }
    CommitSlots slots;
    commit_slots(args[0], &slots);
    int done = commit_add(args[0], &slots, args[1], args[2], args[3], args[4]);
    if (done < 0) return NULL;
    return PyBool_FromLong(done);
}

PyObject *commit_adds_in_c(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(adds_in_c);
}

int commit_add_ready(void) {
    for (int i = 0; i < COMMIT_SLOTS; i++)
        if ((names[i] = PyUnicode_InternFromString(NAMES[i])) == NULL) return -1;
    if ((S_add = PyUnicode_InternFromString("add")) == NULL) return -1;
    if ((S_due = PyUnicode_InternFromString("_due")) == NULL) return -1;
    if ((S_c_policy = PyUnicode_InternFromString("_c_policy")) == NULL) return -1;
    return 0;
}
