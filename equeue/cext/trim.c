/* A pull's byte budget (max_bytes; the broker passes its frame limit on every pull):
 * trim_run(messages, counted, budget, offset) counts the bodies of messages[counted:]
 * against budget and cuts the list before the first that does not fit (never the
 * pull's first message), as equeue/store/reads.py's _trim does in Python, whose result
 * it returns: (the bytes left, <= 0 when the pull is full; the messages counted; the
 * offset to go on from: the first cut message's queue offset, or ``offset``).
 * A loop without an object per message: a C Message's body is its slot; another
 * object's, its ``body`` attribute. The caller keeps budget within +-TRIM_BUDGET_LIMIT
 * (reads.py), so budget - sizes cannot overflow. */
#include "speedups.h"

static int body_size(PyObject *message, Py_ssize_t *size) {
    PyObject *fields[MSG_NFIELDS];
    long long ints[MSG_NFIELDS];
    PyObject *prefix, *body;
    if (message_slots(message, fields, ints, &prefix) && fields[MSG_BODY] != NULL) {
        body = fields[MSG_BODY];
        if (PyBytes_CheckExact(body)) {
            *size = PyBytes_GET_SIZE(body);
            return 0;
        }
        Py_INCREF(body);
    } else {
        body = PyObject_GetAttrString(message, "body");
        if (body == NULL) return -1;
    }
    *size = PyObject_Size(body);
    Py_DECREF(body);
    return *size < 0 ? -1 : 0;
}

static PyObject *queue_offset(PyObject *message) {
    PyObject *fields[MSG_NFIELDS];
    long long ints[MSG_NFIELDS];
    PyObject *prefix;
    if (message_slots(message, fields, ints, &prefix)) {
        if (fields[MSG_QOFF] != NULL) return Py_NewRef(fields[MSG_QOFF]);
        return PyLong_FromLongLong(ints[MSG_QOFF]);
    }
    return PyObject_GetAttrString(message, "queue_offset");
}

PyObject *trim_run(PyObject *self, PyObject *args) {
    PyObject *messages, *offset;
    Py_ssize_t counted;
    long long budget;
    if (!PyArg_ParseTuple(args, "O!nLO:trim_run", &PyList_Type, &messages, &counted, &budget,
                          &offset))
        return NULL;
    if (counted < 0) {
        PyErr_SetString(PyExc_ValueError, "trim_run: counted < 0");
        return NULL;
    }
    for (Py_ssize_t i = counted; i < PyList_GET_SIZE(messages); i++) {
        Py_ssize_t size;
        /* (a body's __len__ may run Python code: the list is read again each turn) */
        PyObject *message = Py_NewRef(PyList_GET_ITEM(messages, i));
        int failed = body_size(message, &size);
        if (failed) {
            Py_DECREF(message);
            return NULL;
        }
        if (size > budget && i > 0) {
            PyObject *cut = queue_offset(message);
            Py_DECREF(message);
            if (cut == NULL) return NULL;
            if (PyList_SetSlice(messages, i, PyList_GET_SIZE(messages), NULL) < 0) {
                Py_DECREF(cut);
                return NULL;
            }
            PyObject *result = Py_BuildValue("(inN)", 0, i, cut);
            return result;
        }
        Py_DECREF(message);
        budget -= size;
    }
    return Py_BuildValue("(LnO)", budget, PyList_GET_SIZE(messages), offset);
}
