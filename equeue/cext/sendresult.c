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
 * no collection counted per send. A SendResult built from Python (SendResult(...),
 * _make, _replace, unpickling) is held to that too: a str, int or float subclass's
 * instance is kept as its plain value, and anything but a str, int, float, bool or None
 * raises equeue.errors.InvalidTypeError, since a container there could refer back to the
 * result and that cycle would never be collected. (The NamedTuple, a pure process's
 * SendResult, keeps whatever it is given: a tuple is collected.)
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

static PyObject *tuple_of(PyObject *self);
static PyObject *from_items(PyObject *const *items);
static RecordSpec SPEC = {&SendResultType, NFIELDS, NULL, tuple_of, from_items};

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

/* equeue.errors.InvalidTypeError naming the field and its type; NULL. */
static PyObject *refuse(int i, PyObject *v) {
    PyObject *errors = PyImport_ImportModule("equeue.errors");
    PyObject *cls = errors == NULL ? NULL : PyObject_GetAttrString(errors, "InvalidTypeError");
    Py_XDECREF(errors);
    if (cls == NULL) return NULL;
    PyErr_Format(cls,
                 "SendResult field %s is a %.100s: a SendResult holds str, int, float, bool or "
                 "None values only (what a send returns; a container could refer back to it, "
                 "and the garbage collector does not look into a SendResult)",
                 NAMES[i], Py_TYPE(v)->tp_name);
    Py_DECREF(cls);
    return NULL;
}

/* Field i's value as a result holds it (a new reference): an exact str, int, float, bool
 * or None as it is; a subclass's instance of str, int or float (which may carry a
 * __dict__, a way back to the result) as the plain value; else InvalidTypeError. */
static PyObject *atomic(int i, PyObject *v) {
    if (PyUnicode_CheckExact(v) || PyLong_CheckExact(v) || PyFloat_CheckExact(v) ||
        PyBool_Check(v) || v == Py_None)
        return Py_NewRef(v);
    if (PyUnicode_Check(v)) return PyUnicode_FromObject(v);
    if (PyLong_Check(v)) return PyNumber_Index(v); /* (an exact int, __index__ not called) */
    if (PyFloat_Check(v)) return PyFloat_FromDouble(PyFloat_AS_DOUBLE(v));
    return refuse(i, v);
}

/* A result of the given fields (borrowed), each as atomic() takes it (Python's
 * SendResult(...), _make, _replace and unpickling all come here; the client's results,
 * of exact str, int and float values, take the first loop only). */
static PyObject *from_items(PyObject *const *items) {
    SendResultObject *r = PyObject_New(SendResultObject, &SendResultType);
    if (r == NULL) return NULL;
    r->id_prefix = NULL;
    int i = 0;
    for (; i < NFIELDS; i++) {
        PyTypeObject *t = Py_TYPE(items[i]);
        if (t != &PyUnicode_Type && t != &PyLong_Type && t != &PyFloat_Type) break;
        r->f[i] = Py_NewRef(items[i]);
    }
    for (int j = i; j < NFIELDS; j++) r->f[j] = NULL; /* (for the dealloc of a refusal) */
    for (; i < NFIELDS; i++) {
        if ((r->f[i] = atomic(i, items[i])) == NULL) {
            Py_DECREF(r);
            return NULL;
        }
    }
    return (PyObject *)r;
}

static PyObject *result_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *v[NFIELDS];
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO:SendResult", (char **)NAMES, &v[0],
                                     &v[1], &v[2], &v[3], &v[4], &v[5]))
        return NULL;
    return from_items(v);
}

static PyObject *tuple_of(PyObject *self) { return as_tuple((SendResultObject *)self); }

/* SendResult(6 values) without an args tuple (the client's unpack_send_columns builds
 * them so); anything else goes through result_new. */
static PyObject *result_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) == NFIELDS && (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0))
        return from_items(args);
    return record_call(&SPEC, args, nargsf, kwnames);
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
    if (!PyIndex_Check(key)) return record_slice(&SPEC, (PyObject *)r, key);
    Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) return NULL;
    return result_item(r, i < 0 ? i + NFIELDS : i);
}

static int result_contains(PyObject *r, PyObject *v) { return record_contains(&SPEC, r, v); }
static PyObject *result_iter(PyObject *r) { return record_iter(&SPEC, r); }
static Py_hash_t result_hash(PyObject *r) { return record_hash(&SPEC, r); }
static PyObject *result_compare(PyObject *a, PyObject *b, int op) {
    return record_compare(&SPEC, a, b, op);
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
static PyObject *result_make(PyObject *cls, PyObject *it) { return record_make(&SPEC, it); }
static PyObject *result_asdict(PyObject *r, PyObject *unused) { return record_asdict(&SPEC, r); }
static PyObject *result_replace(PyObject *r, PyObject *args, PyObject *kwargs) {
    return record_replace(&SPEC, r, args, kwargs);
}
static PyObject *result_reduce(PyObject *r, PyObject *unused) { return record_reduce(&SPEC, r); }
static PyObject *result_count(PyObject *r, PyObject *args) {
    return record_tuple_method(&SPEC, r, "count", args);
}
static PyObject *result_index(PyObject *r, PyObject *args) {
    return record_tuple_method(&SPEC, r, "index", args);
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
    .sq_contains = result_contains,
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
    .tp_hash = result_hash,
    .tp_richcompare = result_compare,
    .tp_iter = result_iter,
    .tp_as_sequence = &as_sequence,
    .tp_as_mapping = &as_mapping,
    .tp_getset = getset,
    .tp_members = members,
    .tp_methods = methods,
};

int send_result_type_ready(void) { return record_type_ready(&SPEC, NAMES); }

/* send_result_doc(doc): the NamedTuple's docstring, for the C type's __doc__ (types.py). */
PyObject *send_result_doc(PyObject *self, PyObject *doc) { return record_doc(&SPEC, doc); }

/* A SendResult's fields for a packer that reads them in place (sendframe.c's answer_of):
 * 1 with f[i] each field (borrowed) or NULL where a C-built result has not made it yet,
 * whose value is then ints[i] (queue id, offset, position; stored_at: ints[5] ns) and,
 * for the id, *id_prefix (borrowed) and ints[4]; 0 for any other object. */
int send_result_fields(PyObject *obj, PyObject *f[6], PyObject **id_prefix, long long ints[6]) {
    if (!Py_IS_TYPE(obj, &SendResultType)) return 0;
    SendResultObject *r = (SendResultObject *)obj;
    for (int i = 0; i < NFIELDS; i++) {
        f[i] = r->f[i];
        ints[i] = r->ints[i];
    }
    *id_prefix = r->id_prefix;
    return r->id_prefix != NULL || (f[F_ID] && f[F_QID] && f[F_QOFF] && f[F_POS] && f[F_STORED]);
}
