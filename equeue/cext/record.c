/* What the C Message (message.c) and SendResult (sendresult.c) share: behaving as a
 * NamedTuple of their fields. Everything here goes through the type's as_tuple (its
 * fields, made if not yet, as a new tuple) and from_items (an instance of given fields),
 * so each type keeps only how it stores and makes its fields. */
#include "speedups.h"

/* The type called with anything but its n positional values: through its tp_new, with
 * an args tuple and a kwargs dict as for any call. */
PyObject *record_call(const RecordSpec *spec, PyObject *const *args, size_t nargsf,
                      PyObject *kwnames) {
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    PyObject *tuple = PyTuple_New(n);
    if (tuple == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
    PyObject *kwargs = NULL;
    Py_ssize_t nk = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nk > 0 && (kwargs = PyDict_New()) != NULL) {
        for (Py_ssize_t i = 0; i < nk; i++) {
            if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[n + i]) < 0) {
                Py_CLEAR(kwargs);
                break;
            }
        }
    }
    PyObject *r = nk > 0 && kwargs == NULL ? NULL : spec->type->tp_new(spec->type, tuple, kwargs);
    Py_DECREF(tuple);
    Py_XDECREF(kwargs);
    return r;
}

/* self[key] for a key that is not an index: a slice (a tuple), else the tuple's error. */
PyObject *record_slice(const RecordSpec *spec, PyObject *self, PyObject *key) {
    if (!PySlice_Check(key)) {
        PyErr_Format(PyExc_TypeError, "tuple indices must be integers or slices, not %.200s",
                     Py_TYPE(key)->tp_name);
        return NULL;
    }
    PyObject *t = spec->as_tuple(self);
    if (t == NULL) return NULL;
    PyObject *r = PyObject_GetItem(t, key);
    Py_DECREF(t);
    return r;
}

int record_contains(const RecordSpec *spec, PyObject *self, PyObject *value) {
    PyObject *t = spec->as_tuple(self);
    if (t == NULL) return -1;
    int r = PySequence_Contains(t, value);
    Py_DECREF(t);
    return r;
}

PyObject *record_iter(const RecordSpec *spec, PyObject *self) {
    PyObject *t = spec->as_tuple(self);
    if (t == NULL) return NULL;
    PyObject *it = PyObject_GetIter(t);
    Py_DECREF(t);
    return it;
}

/* As the tuple of the fields: equal to the NamedTuple's instances with equal fields. */
PyObject *record_compare(const RecordSpec *spec, PyObject *a, PyObject *b, int op) {
    int b_same = Py_IS_TYPE(b, spec->type);
    if (!Py_IS_TYPE(a, spec->type) || !(b_same || PyTuple_Check(b))) Py_RETURN_NOTIMPLEMENTED;
    PyObject *ta = spec->as_tuple(a);
    PyObject *tb = ta == NULL ? NULL : b_same ? spec->as_tuple(b) : Py_NewRef(b);
    PyObject *r = tb == NULL ? NULL : PyObject_RichCompare(ta, tb, op);
    Py_XDECREF(ta);
    Py_XDECREF(tb);
    return r;
}

Py_hash_t record_hash(const RecordSpec *spec, PyObject *self) {
    PyObject *t = spec->as_tuple(self);
    if (t == NULL) return -1;
    Py_hash_t h = PyObject_Hash(t); /* the tuple's (a TypeError for an unhashable field) */
    Py_DECREF(t);
    return h;
}

PyObject *record_make(const RecordSpec *spec, PyObject *iterable) {
    PyObject *t = PySequence_Tuple(iterable);
    if (t == NULL) return NULL;
    if (PyTuple_GET_SIZE(t) != spec->n) {
        PyErr_Format(PyExc_TypeError, "Expected %d arguments, got %zd", spec->n,
                     PyTuple_GET_SIZE(t));
        Py_DECREF(t);
        return NULL;
    }
    PyObject *r = spec->from_items(&PyTuple_GET_ITEM(t, 0));
    Py_DECREF(t);
    return r;
}

PyObject *record_asdict(const RecordSpec *spec, PyObject *self) {
    PyObject *t = spec->as_tuple(self);
    PyObject *d = t == NULL ? NULL : PyDict_New();
    for (int i = 0; d != NULL && i < spec->n; i++)
        if (PyDict_SetItem(d, PyTuple_GET_ITEM(spec->fields, i), PyTuple_GET_ITEM(t, i)) < 0)
            Py_CLEAR(d);
    Py_XDECREF(t);
    return d;
}

PyObject *record_replace(const RecordSpec *spec, PyObject *self, PyObject *args,
                         PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "_replace() takes field names as keywords only");
        return NULL;
    }
    PyObject *t = spec->as_tuple(self);
    PyObject *left = t == NULL ? NULL : kwargs == NULL ? PyDict_New() : PyDict_Copy(kwargs);
    PyObject *r = NULL;
    if (left == NULL) goto done;
    for (int i = 0; i < spec->n; i++) {
        PyObject *name = PyTuple_GET_ITEM(spec->fields, i);
        PyObject *v = PyDict_GetItemWithError(left, name);
        if (v == NULL && PyErr_Occurred()) goto done;
        if (v != NULL) {
            PyTuple_SetItem(t, i, Py_NewRef(v)); /* t is not shared yet */
            if (PyDict_DelItem(left, name) < 0) goto done;
        }
    }
    if (PyDict_GET_SIZE(left) != 0) {
        PyObject *names = PySequence_List(left);
        if (names != NULL) PyErr_Format(PyExc_ValueError, "Got unexpected field names: %R", names);
        Py_XDECREF(names);
        goto done;
    }
    r = spec->from_items(&PyTuple_GET_ITEM(t, 0));
done:
    Py_XDECREF(t);
    Py_XDECREF(left);
    return r;
}

/* Pickled as Type(*fields): the other path's NamedTuple of the same name unpickles it. */
PyObject *record_reduce(const RecordSpec *spec, PyObject *self) {
    PyObject *t = spec->as_tuple(self);
    if (t == NULL) return NULL;
    return Py_BuildValue("(ON)", (PyObject *)spec->type, t);
}

/* count and index: the tuple's. */
PyObject *record_tuple_method(const RecordSpec *spec, PyObject *self, const char *name,
                              PyObject *args) {
    PyObject *t = spec->as_tuple(self);
    if (t == NULL) return NULL;
    PyObject *method = PyObject_GetAttrString(t, name);
    PyObject *r = method == NULL ? NULL : PyObject_Call(method, args, NULL);
    Py_XDECREF(method);
    Py_DECREF(t);
    return r;
}

/* PyType_Ready, and the NamedTuple's class attributes: _fields, __match_args__,
 * _field_defaults (none). */
int record_type_ready(RecordSpec *spec, const char *const *names) {
    if (PyType_Ready(spec->type) < 0) return -1;
    spec->fields = PyTuple_New(spec->n);
    if (spec->fields == NULL) return -1;
    for (int i = 0; i < spec->n; i++) {
        PyObject *name = PyUnicode_InternFromString(names[i]);
        if (name == NULL) return -1;
        PyTuple_SET_ITEM(spec->fields, i, name);
    }
    PyObject *defaults = PyDict_New();
    if (defaults == NULL) return -1;
    PyObject *dict = spec->type->tp_dict;
    int bad = PyDict_SetItemString(dict, "_fields", spec->fields) < 0 ||
              PyDict_SetItemString(dict, "__match_args__", spec->fields) < 0 ||
              PyDict_SetItemString(dict, "_field_defaults", defaults) < 0;
    Py_DECREF(defaults);
    if (bad) return -1;
    PyType_Modified(spec->type);
    return 0;
}

/* The NamedTuple's docstring as the type's __doc__ (types.py). */
PyObject *record_doc(const RecordSpec *spec, PyObject *doc) {
    if (!PyUnicode_Check(doc)) {
        PyErr_SetString(PyExc_TypeError, "the docstring is a str");
        return NULL;
    }
    if (PyDict_SetItemString(spec->type->tp_dict, "__doc__", doc) < 0) return NULL;
    PyType_Modified(spec->type);
    Py_RETURN_NONE;
}
