/* equeue.store.types.SendResult when the accelerator is loaded (types.py binds the name
 * to this type; the NamedTuple there, TupleSendResult, is the pure-Python path's): what
 * send and send_batch return, one object instead of a tuple, a 24-hex-digit id string,
 * three ints and a float.
 *
 * The C send sets the topic and keeps the store's id prefix, the position, queue id and
 * offset and the stored time as C values; the id, the ints and the float are made when
 * first read, and kept (a sender that only checks it was stored pays for none of them).
 * send_batch hands every result the same stored_at float. Every field is atomic (str,
 * int, float), so the type is not known to the garbage collector at all: no GC header,
 * no collection counted per send. (A SendResult built from Python holds what it was
 * given: one holding a container that refers back to it is never collected.)
 *
 * Not a tuple subclass, for the same reasons as message.c's Message; it behaves as the
 * NamedTuple does: the 6 fields in order as attributes, len/indexing/slicing/iteration/
 * unpacking/``in``, _fields, _field_defaults, __match_args__, _make, _asdict, _replace,
 * count, index, ==/!=/ordering and hash as the tuple of its fields (so equal to the
 * NamedTuple's results either way round, and hashing alike), the same repr, and
 * pickling as SendResult(*fields), which the other path's SendResult unpickles. Not
 * kept: subclassing, isinstance(r, tuple), tuple concatenation and repetition; msgpack
 * does not pack it as an array by itself (pack_send_result's list does). */
#include "speedups.h"
#include <stddef.h>
#include <structmember.h>

enum { F_ID, F_TOPIC, F_QID, F_QOFF, F_POS, F_STORED, NFIELDS };

static const char *const NAMES[NFIELDS + 1] = {
    "message_id", "topic", "queue_id", "queue_offset", "position", "stored_at", NULL,
};

typedef struct {
    PyObject_HEAD
    PyObject *f[NFIELDS]; /* NULL: not made yet (results the C send built only) */
    PyObject *id_prefix;  /* for the id of a C-built result; NULL for one built in Python */
    long long ints[NFIELDS]; /* a C-built result's queue id, offset, position, stored ns */
} SendResultObject;

static PyObject *FIELDS_TUPLE; /* _fields */

#define IS_RESULT(o) Py_IS_TYPE((o), &SendResultType)

/* The field, made if not yet (a new reference). */
static PyObject *field(SendResultObject *r, int i) {
    PyObject *v = r->f[i];
    if (v == NULL) {
        if (i == F_ID)
            v = message_id(r->id_prefix, r->ints[F_POS]);
        else if (i == F_STORED)
            v = PyFloat_FromDouble((double)r->ints[F_STORED] / 1e9); /* as the send's was */
        else
            v = PyLong_FromLongLong(r->ints[i]);
        if (v == NULL) return NULL;
        r->f[i] = v; /* (no allocation above runs Python code: nothing else set it) */
    }
    return Py_NewRef(v);
}

static PyObject *as_tuple(SendResultObject *r) {
    PyObject *t = PyTuple_New(NFIELDS);
    if (t == NULL) return NULL;
    for (int i = 0; i < NFIELDS; i++) {
        PyObject *v = field(r, i);
        if (v == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

PyObject *lazy_send_result(PyObject *id_prefix, PyObject *topic, long long queue_id,
                           long long queue_offset, long long position, long long stored_ns,
                           PyObject *stored_at) {
    SendResultObject *r = PyObject_New(SendResultObject, &SendResultType);
    if (r == NULL) return NULL;
    memset(r->f, 0, sizeof r->f);
    r->f[F_TOPIC] = Py_NewRef(topic);
    r->f[F_STORED] = Py_XNewRef(stored_at); /* NULL: made from stored_ns when read */
    r->id_prefix = Py_NewRef(id_prefix);
    r->ints[F_QID] = queue_id;
    r->ints[F_QOFF] = queue_offset;
    r->ints[F_POS] = position;
    r->ints[F_STORED] = stored_ns;
    return (PyObject *)r;
}

/* A result of the given fields (borrowed). */
static PyObject *from_items(PyObject *const *items) {
    SendResultObject *r = PyObject_New(SendResultObject, &SendResultType);
    if (r == NULL) return NULL;
    for (int i = 0; i < NFIELDS; i++) r->f[i] = Py_NewRef(items[i]);
    r->id_prefix = NULL;
    return (PyObject *)r;
}

static PyObject *result_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *v[NFIELDS];
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO:SendResult", (char **)NAMES, &v[0],
                                     &v[1], &v[2], &v[3], &v[4], &v[5]))
        return NULL;
    return from_items(v);
}

/* SendResult(6 values) without an args tuple (the client's unpack_send_columns builds
 * them so); anything else goes through result_new. */
static PyObject *result_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames) {
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n == NFIELDS && (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0))
        return from_items(args);
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
    PyObject *r = nk > 0 && kwargs == NULL ? NULL
                                             : result_new((PyTypeObject *)type, tuple, kwargs);
    Py_DECREF(tuple);
    Py_XDECREF(kwargs);
    return r;
}

static void result_dealloc(SendResultObject *r) {
    for (int i = 0; i < NFIELDS; i++) Py_XDECREF(r->f[i]);
    Py_XDECREF(r->id_prefix);
    PyObject_Free(r);
}

static PyObject *get_field(SendResultObject *r, void *closure) {
    return field(r, (int)(intptr_t)closure);
}

/* The topic is always there: a member, read in place by the specialised attribute load. */
static PyMemberDef members[] = {
    {"topic", T_OBJECT_EX, offsetof(SendResultObject, f) + F_TOPIC * sizeof(PyObject *),
     READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

#define FIELD_GET(name, i) {name, (getter)get_field, NULL, NULL, (void *)(intptr_t)(i)}
static PyGetSetDef getset[] = {
    FIELD_GET("message_id", F_ID),  FIELD_GET("queue_id", F_QID),
    FIELD_GET("queue_offset", F_QOFF), FIELD_GET("position", F_POS),
    FIELD_GET("stored_at", F_STORED), {NULL, NULL, NULL, NULL, NULL},
};

static Py_ssize_t result_length(PyObject *self) { return NFIELDS; }

static PyObject *result_item(SendResultObject *r, Py_ssize_t i) {
    if (i < 0 || i >= NFIELDS) {
        PyErr_SetString(PyExc_IndexError, "tuple index out of range");
        return NULL;
    }
    return field(r, (int)i);
}

static PyObject *result_subscript(SendResultObject *r, PyObject *key) {
    if (PyIndex_Check(key)) {
        Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred()) return NULL;
        return result_item(r, i < 0 ? i + NFIELDS : i);
    }
    if (!PySlice_Check(key)) {
        PyErr_Format(PyExc_TypeError, "tuple indices must be integers or slices, not %.200s",
                     Py_TYPE(key)->tp_name);
        return NULL;
    }
    PyObject *t = as_tuple(r);
    if (t == NULL) return NULL;
    PyObject *v = PyObject_GetItem(t, key);
    Py_DECREF(t);
    return v;
}

static int result_contains(SendResultObject *r, PyObject *value) {
    PyObject *t = as_tuple(r);
    if (t == NULL) return -1;
    int found = PySequence_Contains(t, value);
    Py_DECREF(t);
    return found;
}

static PyObject *result_iter(SendResultObject *r) {
    PyObject *t = as_tuple(r);
    if (t == NULL) return NULL;
    PyObject *it = PyObject_GetIter(t);
    Py_DECREF(t);
    return it;
}

/* As the tuple of the fields: equal to a NamedTuple SendResult with equal fields. */
static PyObject *result_richcompare(PyObject *a, PyObject *b, int op) {
    if (!IS_RESULT(a) || !(IS_RESULT(b) || PyTuple_Check(b))) Py_RETURN_NOTIMPLEMENTED;
    PyObject *ta = as_tuple((SendResultObject *)a);
    PyObject *tb = ta == NULL ? NULL
                   : IS_RESULT(b) ? as_tuple((SendResultObject *)b)
                                  : Py_NewRef(b);
    PyObject *r = tb == NULL ? NULL : PyObject_RichCompare(ta, tb, op);
    Py_XDECREF(ta);
    Py_XDECREF(tb);
    return r;
}

static Py_hash_t result_hash(SendResultObject *r) {
    PyObject *t = as_tuple(r);
    if (t == NULL) return -1;
    Py_hash_t h = PyObject_Hash(t); /* the NamedTuple's: equal results hash alike */
    Py_DECREF(t);
    return h;
}

static PyObject *result_repr(SendResultObject *r) {
    PyObject *t = as_tuple(r);
    if (t == NULL) return NULL;
    PyObject *const *v = &PyTuple_GET_ITEM(t, 0);
    PyObject *s = PyUnicode_FromFormat(
        "SendResult(message_id=%R, topic=%R, queue_id=%R, queue_offset=%R, position=%R, "
        "stored_at=%R)",
        v[0], v[1], v[2], v[3], v[4], v[5]);
    Py_DECREF(t);
    return s;
}

static PyObject *result_make(PyObject *cls, PyObject *iterable) {
    PyObject *t = PySequence_Tuple(iterable);
    if (t == NULL) return NULL;
    if (PyTuple_GET_SIZE(t) != NFIELDS) {
        PyErr_Format(PyExc_TypeError, "Expected %d arguments, got %zd", NFIELDS,
                     PyTuple_GET_SIZE(t));
        Py_DECREF(t);
        return NULL;
    }
    PyObject *r = from_items(&PyTuple_GET_ITEM(t, 0));
    Py_DECREF(t);
    return r;
}

static PyObject *result_asdict(SendResultObject *r, PyObject *unused) {
    PyObject *d = PyDict_New();
    for (int i = 0; d != NULL && i < NFIELDS; i++) {
        PyObject *v = field(r, i);
        if (v == NULL || PyDict_SetItem(d, PyTuple_GET_ITEM(FIELDS_TUPLE, i), v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}

static PyObject *result_replace(SendResultObject *r, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "_replace() takes field names as keywords only");
        return NULL;
    }
    PyObject *t = as_tuple(r);
    PyObject *left = t == NULL ? NULL : kwargs == NULL ? PyDict_New() : PyDict_Copy(kwargs);
    PyObject *out = NULL;
    if (left == NULL) goto done;
    for (int i = 0; i < NFIELDS; i++) {
        PyObject *name = PyTuple_GET_ITEM(FIELDS_TUPLE, i);
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
    out = from_items(&PyTuple_GET_ITEM(t, 0));
done:
    Py_XDECREF(t);
    Py_XDECREF(left);
    return out;
}

static PyObject *result_reduce(SendResultObject *r, PyObject *unused) {
    PyObject *t = as_tuple(r);
    if (t == NULL) return NULL;
    return Py_BuildValue("(ON)", (PyObject *)&SendResultType, t);
}

/* count and index: the tuple's. */
static PyObject *tuple_method(SendResultObject *r, const char *name, PyObject *args) {
    PyObject *t = as_tuple(r);
    if (t == NULL) return NULL;
    PyObject *method = PyObject_GetAttrString(t, name);
    PyObject *out = method == NULL ? NULL : PyObject_Call(method, args, NULL);
    Py_XDECREF(method);
    Py_DECREF(t);
    return out;
}

static PyObject *result_count(SendResultObject *r, PyObject *args) {
    return tuple_method(r, "count", args);
}

static PyObject *result_index(SendResultObject *r, PyObject *args) {
    return tuple_method(r, "index", args);
}

static PyMethodDef methods[] = {
    {"_make", (PyCFunction)result_make, METH_O | METH_CLASS,
     "A SendResult of an iterable's 6 values."},
    {"_asdict", (PyCFunction)result_asdict, METH_NOARGS, "The fields as a dict."},
    {"_replace", (PyCFunction)(void (*)(void))result_replace, METH_VARARGS | METH_KEYWORDS,
     "A new SendResult with the named fields replaced."},
    {"__reduce__", (PyCFunction)result_reduce, METH_NOARGS, NULL},
    {"count", (PyCFunction)result_count, METH_VARARGS, NULL},
    {"index", (PyCFunction)result_index, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods as_sequence = {
    .sq_length = result_length,
    .sq_item = (ssizeargfunc)result_item,
    .sq_contains = (objobjproc)result_contains,
};

static PyMappingMethods as_mapping = {
    .mp_length = result_length,
    .mp_subscript = (binaryfunc)result_subscript,
};

PyTypeObject SendResultType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "equeue.store.types.SendResult",
    .tp_basicsize = sizeof(SendResultObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_SEQUENCE,
    .tp_new = result_new,
    .tp_vectorcall = result_vectorcall,
    .tp_dealloc = (destructor)result_dealloc,
    .tp_repr = (reprfunc)result_repr,
    .tp_hash = (hashfunc)result_hash,
    .tp_richcompare = result_richcompare,
    .tp_iter = (getiterfunc)result_iter,
    .tp_as_sequence = &as_sequence,
    .tp_as_mapping = &as_mapping,
    .tp_getset = getset,
    .tp_members = members,
    .tp_methods = methods,
};

int send_result_type_ready(void) {
    if (PyType_Ready(&SendResultType) < 0) return -1;
    FIELDS_TUPLE = PyTuple_New(NFIELDS);
    if (FIELDS_TUPLE == NULL) return -1;
    for (int i = 0; i < NFIELDS; i++) {
        PyObject *name = PyUnicode_InternFromString(NAMES[i]);
        if (name == NULL) return -1;
        PyTuple_SET_ITEM(FIELDS_TUPLE, i, name);
    }
    PyObject *defaults = PyDict_New();
    if (defaults == NULL) return -1;
    PyObject *dict = SendResultType.tp_dict;
    int bad = PyDict_SetItemString(dict, "_fields", FIELDS_TUPLE) < 0 ||
              PyDict_SetItemString(dict, "__match_args__", FIELDS_TUPLE) < 0 ||
              PyDict_SetItemString(dict, "_field_defaults", defaults) < 0;
    Py_DECREF(defaults);
    if (bad) return -1;
    PyType_Modified(&SendResultType);
    return 0;
}

/* send_result_doc(doc): the NamedTuple's docstring, for the C type's __doc__ (types.py). */
PyObject *send_result_doc(PyObject *self, PyObject *doc) {
    if (!PyUnicode_Check(doc)) {
        PyErr_SetString(PyExc_TypeError, "the docstring is a str");
        return NULL;
    }
    if (PyDict_SetItemString(SendResultType.tp_dict, "__doc__", doc) < 0) return NULL;
    PyType_Modified(&SendResultType);
    Py_RETURN_NONE;
}
