/* CCounters: the broker's counters as C integers (equeue/server/stats.py's Counters
 * subclasses it).
 *
 * Why: the send lane (sendlane.c) and release_frames (release.c) bump four counters a
 * durable send; in Python int slots each bump made a new int and freed the old one
 * (~200 instructions). Here a bump is an add at the member's offset (counter_cell). To
 * Python the counters are ints as before: `counters.sends += 1` reads and writes them
 * (a value outside a signed 64-bit integer is refused with OverflowError and changes
 * nothing: 9.2e18 bytes in or out, not reachable), and the stats request reads them. */
#include "speedups.h"
#include <stddef.h>

#define COUNTERS(X) X(requests) X(sends) X(send_requests) X(pulls) X(bytes_in) X(bytes_out) X(errors)

typedef struct {
    PyObject_HEAD
#define FIELD(name) long long name;
    COUNTERS(FIELD)
#undef FIELD
} CountersObject;

/* The members are getset descriptors, not T_LONGLONG members: CPython's setter of those
 * writes -1 before it refuses an int out of range; here a refused value changes nothing. */
static PyObject *get_counter(PyObject *self, void *offset) {
    return PyLong_FromLongLong(*(long long *)((char *)self + (Py_ssize_t)offset));
}

static int set_counter(PyObject *self, PyObject *value, void *offset) {
    if (value == NULL || !PyLong_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "a broker counter is an int (it cannot be deleted)");
        return -1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow) {
        PyErr_SetString(PyExc_OverflowError, "a broker counter holds a signed 64-bit integer");
        return -1;
    }
    if (v == -1 && PyErr_Occurred()) return -1;
    *(long long *)((char *)self + (Py_ssize_t)offset) = v;
    return 0;
}

static PyGetSetDef counters_getset[] = {
#define GETSET(name) \
    {#name, get_counter, set_counter, NULL, (void *)offsetof(CountersObject, name)},
    COUNTERS(GETSET)
#undef GETSET
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject CountersType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.CCounters",
    .tp_basicsize = sizeof(CountersObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew, /* all 0 */
    .tp_getset = counters_getset,
};

/* The offset in an instance of type of CCounters' counter name (a long long), or -1: not
 * a CCounters, or name is not one of its counters (a subclass's own attribute). */
Py_ssize_t counter_cell(PyTypeObject *type, PyObject *name) {
    if (!PyType_IsSubtype(type, &CountersType)) return -1;
    PyObject *d = _PyType_Lookup(type, name); /* borrowed */
    if (d == NULL || !Py_IS_TYPE(d, &PyGetSetDescr_Type) || PyDescr_TYPE(d) != &CountersType)
        return -1;
    PyGetSetDef *g = ((PyGetSetDescrObject *)d)->d_getset;
    return g->get == get_counter ? (Py_ssize_t)g->closure : -1;
}

int counters_ready(void) { return PyType_Ready(&CountersType); }
