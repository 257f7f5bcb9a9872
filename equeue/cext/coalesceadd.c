/* The asyncio client's coalesced plain send, the per-send part in C (equeue/client/
 * coalesce.py: Coalescer's base when the accelerator is built).
 *
 * Callgrind, one client shared by 16 tasks under --flush sync (docs/benchmarks.md, "coalc
 * (round 19)"): Coalescer.add in Python was ~3.7 k of the client's ~17.4 k instructions a
 * send; most of it the frame, the attribute look-ups on the protocol and the `free -= 1`.
 *
 * CoalescerBase: the fields `_protocol`, `groups` (topic -> Group, the turn's open ones),
 *     `sealed` (a list of (topic, Group), full ones still to be written), `budget`,
 *     `most`, `part` (ints), set by Coalescer.__init__; and
 *
 * add(topic, body) -> future | None: the two cases of every send but a turn's first:
 *     - the topic's open group has room (its bodies' size + this one's within `budget`,
 *       fewer than `most` sends): the send joins it;
 *     - the topic has no open group and a write is due this turn (another group open or
 *       sealed, a request pending or a write scheduled: `flushing`): a group is begun,
 *       and the turn's write scheduled (`protocol.schedule()`) unless one is;
 *     either way its future (wakeup.c's waiter_for on the protocol's loop, as groupwake.c's
 *     group_future makes it), one place taken (`protocol.free -= 1`), and, when a send
 *     joining a group makes it `part` sends, `self.emit()` and `protocol.write_out()`. Everything else
 *     (the lone send of an idle connection, a full group sealed, a caller on another loop,
 *     a protocol that is not a ClientConn, a body not exactly bytes, a topic not exactly
 *     str) goes to `self.add_slow(topic, body)`, the Python method, before anything is
 *     changed: its behaviour and its errors are the Python code's.
 *
 * Group(body, future): a topic's sends of the turn: `bodies` and `futures` (lists, in
 *     order), `size` (the bodies' bytes and BODY_OVERHEAD each). */
#include "speedups.h"
#include <structmember.h>

#define BODY_OVERHEAD 5 /* a bin's header at most: coalesce.py's BODY_OVERHEAD */

int clientconn_is(PyObject *object); /* clientconn.c */
int clientconn_fields(PyObject *conn, PyObject **loop, PyObject **pending, PyObject **flushing);
int clientconn_take_place(PyObject *conn);
int waiter_on_loop(PyObject *loop); /* wakeup.c */
PyObject *waiter_for(PyObject *loop);

typedef struct {
    PyObject_HEAD
    PyObject *bodies, *futures;
    Py_ssize_t size;
} Group;

typedef struct {
    PyObject_HEAD
    PyObject *protocol, *groups, *sealed;
    Py_ssize_t budget, most, part;
} Coalescer;

static PyTypeObject GroupType, CoalescerType;
static PyObject *S_ADD_SLOW, *S_EMIT, *S_WRITE_OUT, *S_SCHEDULE;

static PyObject *group_of(PyObject *body, PyObject *future) {
    Group *g = PyObject_GC_New(Group, &GroupType);
    if (g == NULL) return NULL;
    g->bodies = PyList_New(1);
    g->futures = PyList_New(1);
    if (g->bodies == NULL || g->futures == NULL) {
        Py_XDECREF(g->bodies);
        Py_XDECREF(g->futures);
        g->bodies = g->futures = NULL;
        Py_DECREF(g);
        return NULL;
    }
    PyList_SET_ITEM(g->bodies, 0, Py_NewRef(body));
    PyList_SET_ITEM(g->futures, 0, Py_NewRef(future));
    g->size = PyObject_Length(body) + BODY_OVERHEAD;
    PyObject_GC_Track(g);
    if (g->size < BODY_OVERHEAD) { /* (len() failed: a body without one) */
        Py_DECREF(g);
        return NULL;
    }
    return (PyObject *)g;
}

static PyObject *group_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *body, *future;
    if (type != &GroupType) {
        PyErr_SetString(PyExc_TypeError, "Group is not subclassed");
        return NULL;
    }
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs)) ||
        !PyArg_UnpackTuple(args, "Group", 2, 2, &body, &future))
        return NULL;
    return group_of(body, future);
}

static int group_traverse(Group *g, visitproc visit, void *arg) {
    Py_VISIT(g->bodies);
    Py_VISIT(g->futures);
    return 0;
}

static int group_clear(Group *g) {
    Py_CLEAR(g->bodies);
    Py_CLEAR(g->futures);
    return 0;
}

static void group_dealloc(Group *g) {
    PyObject_GC_UnTrack(g);
    group_clear(g);
    PyObject_GC_Del(g);
}

static PyMemberDef group_members[] = {
    {"bodies", T_OBJECT_EX, offsetof(Group, bodies), 0, NULL},
    {"futures", T_OBJECT_EX, offsetof(Group, futures), 0, NULL},
    {"size", T_PYSSIZET, offsetof(Group, size), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject GroupType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.Group",
    .tp_basicsize = sizeof(Group),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = group_new,
    .tp_dealloc = (destructor)group_dealloc,
    .tp_traverse = (traverseproc)group_traverse,
    .tp_clear = (inquiry)group_clear,
    .tp_members = group_members,
};

/* add_slow(topic, body): the Python code's case (co_add checked there are two). */
static PyObject *slow(Coalescer *self, PyObject *const *args) {
    PyObject *call[3] = {(PyObject *)self, args[0], args[1]};
    return PyObject_VectorcallMethod(S_ADD_SLOW, call, 3, NULL);
}

/* Whether a field holds a true value: 1, 0 (also unset), -1. */
static int truth(PyObject *value) {
    if (value == NULL || value == Py_False || value == Py_None) return 0;
    if (value == Py_True) return 1;
    if (PyDict_CheckExact(value)) return PyDict_GET_SIZE(value) > 0;
    return PyObject_IsTrue(value);
}

/* The send's future, a place taken, and the group written at once when it now holds
 * `count` == `part` sends: the future, NULL. */
static PyObject *taken(Coalescer *self, PyObject *future, Py_ssize_t count) {
    if (clientconn_take_place(self->protocol) < 0) {
        Py_DECREF(future);
        return NULL;
    }
    if (count == self->part) { /* (every group of the turn so far, in the order begun) */
        PyObject *r = PyObject_CallMethodNoArgs((PyObject *)self, S_EMIT);
        if (r != NULL) {
            Py_DECREF(r);
            r = PyObject_CallMethodNoArgs(self->protocol, S_WRITE_OUT);
        }
        if (r == NULL) {
            Py_DECREF(future);
            return NULL;
        }
        Py_DECREF(r);
    }
    return future;
}

/* A send joining its topic's open group (held by the caller); the Python add_slow's
 * when it is full or the caller is on another loop. */
static PyObject *join(Coalescer *self, Group *group, PyObject *const *args, PyObject *loop) {
    PyObject *body = args[1];
    if (group->bodies == NULL || !PyList_CheckExact(group->bodies) ||
        group->futures == NULL || !PyList_CheckExact(group->futures))
        return slow(self, args);
    Py_ssize_t size = group->size + PyBytes_GET_SIZE(body) + BODY_OVERHEAD;
    Py_ssize_t count = PyList_GET_SIZE(group->futures);
    if (size > self->budget || count >= self->most) return slow(self, args); /* full */
    int own = waiter_on_loop(loop);
    if (own <= 0) return own < 0 ? NULL : slow(self, args); /* (another loop) */
    PyObject *future = waiter_for(loop);
    if (future == NULL) return NULL;
    if (PyList_Append(group->bodies, body) < 0) {
        Py_DECREF(future);
        return NULL;
    }
    if (PyList_Append(group->futures, future) < 0) {
        /* (the body taken back: the group as it was) */
        PyList_SetSlice(group->bodies, PyList_GET_SIZE(group->bodies) - 1,
                        PyList_GET_SIZE(group->bodies), NULL);
        Py_DECREF(future);
        return NULL;
    }
    group->size = size;
    return taken(self, future, count + 1);
}

static PyObject *co_add(Coalescer *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *protocol = self->protocol, *loop, *pending, *flushing;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "add(topic, body) takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!PyUnicode_CheckExact(args[0]) || !PyBytes_CheckExact(args[1]) ||
        protocol == NULL || !clientconn_is(protocol) || self->groups == NULL ||
        !PyDict_CheckExact(self->groups) || self->sealed == NULL ||
        !PyList_CheckExact(self->sealed) ||
        clientconn_fields(protocol, &loop, &pending, &flushing) < 0)
        return slow(self, args);
    PyObject *topic = args[0], *body = args[1];
    PyObject *found = PyDict_GetItemWithError(self->groups, topic); /* (borrowed) */
    if (found == NULL && PyErr_Occurred()) return NULL;
    if (found != NULL) {
        if (Py_TYPE(found) != &GroupType) return slow(self, args);
        /* held from here: waiter_for allocates, and a GC pass it runs may run finalizers
         * that replace the groups (review14 F2) */
        Py_INCREF(found);
        PyObject *joined = join(self, (Group *)found, args, loop);
        Py_DECREF(found);
        return joined;
    }
    /* no group of this topic: begun only when a write is due this turn (else the lone
     * send's case, add_slow's) */
    int due = PyDict_GET_SIZE(self->groups) > 0 || PyList_GET_SIZE(self->sealed) > 0;
    int scheduled = truth(flushing);
    if (scheduled < 0) return NULL;
    if (!due && !scheduled) {
        due = truth(pending);
        if (due <= 0) return due < 0 ? NULL : slow(self, args);
    }
    int own = waiter_on_loop(loop);
    if (own <= 0) return own < 0 ? NULL : slow(self, args);
    PyObject *future = waiter_for(loop);
    if (future == NULL) return NULL;
    PyObject *group = group_of(body, future);
    if (group == NULL || PyDict_SetItem(self->groups, topic, group) < 0) {
        Py_XDECREF(group);
        Py_DECREF(future);
        return NULL;
    }
    Py_DECREF(group);
    future = taken(self, future, -1); /* (a group begun is not a part yet: add_slow's way) */
    if (future == NULL || scheduled) return future;
    PyObject *r = PyObject_CallMethodNoArgs(protocol, S_SCHEDULE);
    if (r == NULL) {
        Py_DECREF(future);
        return NULL;
    }
    Py_DECREF(r);
    return future;
}

static int co_traverse(Coalescer *self, visitproc visit, void *arg) {
    Py_VISIT(self->protocol);
    Py_VISIT(self->groups);
    Py_VISIT(self->sealed);
    return 0;
}

static int co_clear(Coalescer *self) {
    Py_CLEAR(self->protocol);
    Py_CLEAR(self->groups);
    Py_CLEAR(self->sealed);
    return 0;
}

static void co_dealloc(Coalescer *self) {
    PyObject_GC_UnTrack(self);
    co_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef co_methods[] = {
    {"add", (PyCFunction)(void (*)(void))co_add, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef co_members[] = {
    {"_protocol", T_OBJECT_EX, offsetof(Coalescer, protocol), 0, NULL},
    {"groups", T_OBJECT_EX, offsetof(Coalescer, groups), 0, NULL},
    {"sealed", T_OBJECT_EX, offsetof(Coalescer, sealed), 0, NULL},
    {"budget", T_PYSSIZET, offsetof(Coalescer, budget), 0, NULL},
    {"most", T_PYSSIZET, offsetof(Coalescer, most), 0, NULL},
    {"part", T_PYSSIZET, offsetof(Coalescer, part), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CoalescerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.CoalescerBase",
    .tp_basicsize = sizeof(Coalescer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)co_dealloc,
    .tp_traverse = (traverseproc)co_traverse,
    .tp_clear = (inquiry)co_clear,
    .tp_methods = co_methods,
    .tp_members = co_members,
};

/* For groupanswer.c: a CoalescerBase's (or its subclass's) protocol, borrowed; NULL (no
 * error) for another object or while unset. */
PyObject *coalescer_protocol(PyObject *object) {
    if (!PyObject_TypeCheck(object, &CoalescerType)) return NULL;
    return ((Coalescer *)object)->protocol;
}

/* client_coalescer_types() -> (CoalescerBase, Group), made ready on the first call. */
PyObject *client_coalescer_types(PyObject *unused, PyObject *unused2) {
    if (S_ADD_SLOW == NULL) {
        if ((S_EMIT = PyUnicode_InternFromString("emit")) == NULL ||
            (S_WRITE_OUT = PyUnicode_InternFromString("write_out")) == NULL ||
            (S_SCHEDULE = PyUnicode_InternFromString("schedule")) == NULL ||
            PyType_Ready(&GroupType) < 0 || PyType_Ready(&CoalescerType) < 0)
            return NULL;
        if ((S_ADD_SLOW = PyUnicode_InternFromString("add_slow")) == NULL) return NULL;
    }
    return PyTuple_Pack(2, (PyObject *)&CoalescerType, (PyObject *)&GroupType);
}
