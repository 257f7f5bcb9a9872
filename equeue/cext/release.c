/* The broker's durable answers after a group commit's fdatasync (equeue/server/
 * connection.py, release_durable): a flushed batch of (peer, request_id, result) entries
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

/* frames_by_peer(batch, kind): [(peer, data, count), ...] in the order each peer first
 * appears, data the peer's frames joined in batch order (bytes), count how many; None when an entry is not a 3-tuple whose result is exactly of
 * type kind (the caller then answers the batch entry by entry). */
PyObject *frames_by_peer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_CheckExact(args[0]) || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "frames_by_peer(batch: list, kind: type)");
        return NULL;
    }
    PyObject *batch = args[0];
    PyTypeObject *kind = (PyTypeObject *)args[1];
    Py_ssize_t n = PyList_GET_SIZE(batch);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(batch, i);
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 3 ||
            Py_TYPE(PyTuple_GET_ITEM(e, 2)) != kind)
            Py_RETURN_NONE;
    }
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
