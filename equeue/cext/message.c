/* equeue.store.types.Message when the accelerator is loaded (types.py binds the name
 * to this type; the NamedTuple there is the pure-Python path's): a pulled message that
 * costs two objects (itself and its body) instead of a tuple, an id string, five ints
 * and a dict, and that the garbage collector does not track until it must.
 *
 * Not a tuple subclass, by choice: a tuple's items are read in place by C code all over
 * the interpreter (comparisons, unpacking, %-formatting, PyArg_Parse*), so an item
 * cannot be made on demand; and a tuple holding a real dict must be tracked, since a
 * caller may put the message into that dict (a cycle). Here the fields are slots:
 *
 * - made when first read, and kept: the message id (from the store's id prefix and the
 *   position), the five ints, and an empty properties dict;
 * - made by the decoder: topic and tag (shared strs), key, body (bytes, a copy: never a
 *   view of the mapping, which retention or close may unmap), and non-empty properties
 *   (decoded at once, so that undecodable ones still go to the slow path's error).
 *
 * A decoded message starts untracked: its fields are atomic (str, int, bytes, None)
 * but for the properties dict, which only it references until the dict is handed out.
 * Every way out for the dict (the attribute, indexing, iteration, comparison, _asdict,
 * _replace, pickling, repr) goes through field(), which tracks the message first; from
 * then on a cycle through the dict is found and collected as for any tuple.
 * (gc.get_referents on an untracked message also shows the dict: a cycle made through
 * that is not collected, the one way around this.) A message built from Python
 * (Message(...), _make, _replace, unpickling) holds whatever it was given and is
 * tracked from the start.
 *
 * It behaves as the NamedTuple does: the 12 fields in order as attributes, created_at
 * and stored_at, len/indexing/slicing (a slice is a tuple)/iteration/unpacking/``in``,
 * _fields, _field_defaults, __match_args__, _make, _asdict, _replace, count, index,
 * ==/!=/ordering as the tuple of its fields (so equal to the NamedTuple's messages,
 * either way round), hash as that tuple's (a TypeError: the dict), the same repr, and
 * pickling as Message(*fields), which the other path's Message unpickles. Not kept:
 * subclassing, isinstance(m, tuple), tuple concatenation and repetition. */
#include "speedups.h"
#include <stddef.h>
#include <structmember.h>

static const char *const NAMES[MSG_NFIELDS + 1] = {
    "message_id", "topic", "queue_id", "queue_offset", "position", "tag", "key",
    "properties", "code", "body", "created_ns", "stored_ns", NULL,
};

typedef struct {
    PyObject_HEAD
    PyObject *f[MSG_NFIELDS]; /* NULL: not made yet (decoded messages only) */
    PyObject *id_prefix;  /* for the id of a decoded message; NULL for one built in Python */
    long long ints[MSG_NFIELDS]; /* a decoded message's ints, by field index */
} MessageObject;

static PyObject *tuple_of(PyObject *self);
static PyObject *from_items(PyObject *const *items);
static RecordSpec SPEC = {&MessageType, MSG_NFIELDS, NULL, tuple_of, from_items};

#define IS_MESSAGE(o) Py_IS_TYPE((o), &MessageType)

/* The field, made if not yet (a new reference); the message is tracked before its
 * properties dict leaves it. */
static PyObject *field(MessageObject *m, int i) {
    PyObject *v = m->f[i];
    if (v == NULL) {
        if (i == MSG_ID)
            v = message_id(m->id_prefix, m->ints[MSG_POS]);
        else if (i == MSG_PROPS)
            v = PyDict_New();
        else
            v = PyLong_FromLongLong(m->ints[i]);
        if (v == NULL) return NULL;
        if (m->f[i] != NULL) { /* made meanwhile (a finalizer the allocation ran): keep one */
            Py_DECREF(v);
            v = m->f[i];
        } else {
            m->f[i] = v;
        }
    }
    if (i == MSG_PROPS && !PyObject_GC_IsTracked((PyObject *)m)) PyObject_GC_Track(m);
    return Py_NewRef(v);
}

static PyObject *as_tuple(MessageObject *m) {
    PyObject *t = PyTuple_New(MSG_NFIELDS);
    if (t == NULL) return NULL;
    for (int i = 0; i < MSG_NFIELDS; i++) {
        PyObject *v = field(m, i);
        if (v == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

static PyObject *tuple_of(PyObject *self) { return as_tuple((MessageObject *)self); }

PyObject *lazy_message(PyObject *id_prefix, PyObject *topic, PyObject *tag, PyObject *key,
                       PyObject *props, PyObject *body, long long position, long long queue_id,
                       long long queue_offset, long long code, long long created_ns,
                       long long stored_ns) {
    if (topic == NULL || tag == NULL || key == NULL || body == NULL) goto fail;
    MessageObject *m = PyObject_GC_New(MessageObject, &MessageType);
    if (m == NULL) goto fail;
    memset(m->f, 0, sizeof m->f);
    m->f[MSG_TOPIC] = topic;
    m->f[MSG_TAG] = tag;
    m->f[MSG_KEY] = key;
    m->f[MSG_PROPS] = props; /* NULL: empty, made when read */
    m->f[MSG_BODY] = body;
    m->id_prefix = Py_NewRef(id_prefix);
    m->ints[MSG_POS] = position;
    m->ints[MSG_QID] = queue_id;
    m->ints[MSG_QOFF] = queue_offset;
    m->ints[MSG_CODE] = code;
    m->ints[MSG_CREATED] = created_ns;
    m->ints[MSG_STORED] = stored_ns;
    return (PyObject *)m; /* untracked: see the top */
fail:
    Py_XDECREF(topic);
    Py_XDECREF(tag);
    Py_XDECREF(key);
    Py_XDECREF(props);
    Py_XDECREF(body);
    return NULL;
}

/* A message of the given fields (borrowed), tracked. */
static PyObject *from_items(PyObject *const *items) {
    MessageObject *m = PyObject_GC_New(MessageObject, &MessageType);
    if (m == NULL) return NULL;
    for (int i = 0; i < MSG_NFIELDS; i++) m->f[i] = Py_NewRef(items[i]);
    m->id_prefix = NULL;
    PyObject_GC_Track(m);
    return (PyObject *)m;
}

int message_check_fields(PyObject *obj, PyObject **topic, long long *queue_id,
                         long long *queue_offset) {
    PyObject *qid, *qoff;
    if (IS_MESSAGE(obj)) {
        MessageObject *m = (MessageObject *)obj;
        *topic = m->f[MSG_TOPIC];
        qid = m->f[MSG_QID];
        qoff = m->f[MSG_QOFF];
        if (qid == NULL) *queue_id = m->ints[MSG_QID];
        if (qoff == NULL) *queue_offset = m->ints[MSG_QOFF];
    } else if (PyTuple_Check(obj) && PyTuple_GET_SIZE(obj) >= 4) {
        *topic = PyTuple_GET_ITEM(obj, 1);
        qid = PyTuple_GET_ITEM(obj, 2);
        qoff = PyTuple_GET_ITEM(obj, 3);
    } else {
        PyErr_SetString(PyExc_TypeError, "messages are Message objects");
        return -1;
    }
    if (qid != NULL && (*queue_id = PyLong_AsLongLong(qid)) == -1 && PyErr_Occurred()) return -1;
    if (qoff != NULL && (*queue_offset = PyLong_AsLongLong(qoff)) == -1 && PyErr_Occurred())
        return -1;
    return 0;
}

/* A C Message's 12 field slots (borrowed; NULL: not made yet, its value then in ints[]
 * or, for the id, from *id_prefix and the position; NULL props: empty): 1, or 0 for
 * another object (pullcols.c packs a pull's answer from these without making them). */
int message_slots(PyObject *obj, PyObject *fields[MSG_NFIELDS], long long ints[MSG_NFIELDS],
                  PyObject **id_prefix) {
    if (!IS_MESSAGE(obj)) return 0;
    MessageObject *m = (MessageObject *)obj;
    memcpy(fields, m->f, sizeof m->f);
    memcpy(ints, m->ints, sizeof m->ints);
    *id_prefix = m->id_prefix;
    return 1;
}

static PyObject *message_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *v[MSG_NFIELDS];
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOOOOOO:Message", (char **)NAMES,
                                     &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7],
                                     &v[8], &v[9], &v[10], &v[11]))
        return NULL;
    return from_items(v);
}

/* Message(12 values) without an args tuple or keyword parsing (get, read, query_by_key
 * and the client build theirs so); anything else goes through message_new. */
static PyObject *message_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf,
                                    PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) == MSG_NFIELDS &&
        (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0))
        return from_items(args);
    return record_call(&SPEC, args, nargsf, kwnames);
}

static int message_traverse(MessageObject *m, visitproc visit, void *arg) {
    for (int i = 0; i < MSG_NFIELDS; i++) Py_VISIT(m->f[i]);
    Py_VISIT(m->id_prefix);
    return 0;
}

static int message_clear(MessageObject *m) {
    for (int i = 0; i < MSG_NFIELDS; i++) Py_CLEAR(m->f[i]);
    Py_CLEAR(m->id_prefix);
    return 0;
}

/* (No trashcan: a chain of messages runs through their properties dicts, whose own
 * dealloc bounds the recursion.) */
static void message_dealloc(MessageObject *m) {
    PyObject_GC_UnTrack(m);
    message_clear(m);
    PyObject_GC_Del(m);
}

static PyObject *get_field(MessageObject *m, void *closure) {
    if (!IS_MESSAGE(m)) return NULL;
    return field(m, (int)(intptr_t)closure);
}

static PyObject *seconds(MessageObject *m, int i) {
    PyObject *ns = field(m, i);
    if (ns == NULL) return NULL;
    PyObject *scale = PyFloat_FromDouble(1e9);
    PyObject *s = scale == NULL ? NULL : PyNumber_TrueDivide(ns, scale); /* as ns / 1e9 */
    Py_XDECREF(scale);
    Py_DECREF(ns);
    return s;
}

static PyObject *get_created_at(MessageObject *m, void *closure) {
    return seconds(m, MSG_CREATED);
}

static PyObject *get_stored_at(MessageObject *m, void *closure) {
    return seconds(m, MSG_STORED);
}

/* The fields every message holds from the start are members (T_OBJECT_EX): the
 * interpreter's specialised attribute load reads them in place; the rest are made on
 * first read, through get_field. */
#define FIELD_MEMBER(name, i) \
    {name, T_OBJECT_EX, offsetof(MessageObject, f) + (i) * sizeof(PyObject *), READONLY, NULL}
static PyMemberDef members[] = {
    FIELD_MEMBER("topic", MSG_TOPIC), FIELD_MEMBER("tag", MSG_TAG), FIELD_MEMBER("key", MSG_KEY),
    FIELD_MEMBER("body", MSG_BODY),   {NULL, 0, 0, 0, NULL},
};

#define FIELD_GET(name, i) {name, (getter)get_field, NULL, NULL, (void *)(intptr_t)(i)}
static PyGetSetDef getset[] = {
    FIELD_GET("message_id", MSG_ID), FIELD_GET("queue_id", MSG_QID),
    FIELD_GET("queue_offset", MSG_QOFF), FIELD_GET("position", MSG_POS),
    FIELD_GET("properties", MSG_PROPS), FIELD_GET("code", MSG_CODE),
    FIELD_GET("created_ns", MSG_CREATED), FIELD_GET("stored_ns", MSG_STORED),
    {"created_at", (getter)get_created_at, NULL, "created_ns in float seconds", NULL},
    {"stored_at", (getter)get_stored_at, NULL, "stored_ns in float seconds", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static Py_ssize_t message_length(PyObject *self) { return MSG_NFIELDS; }

static PyObject *message_item(MessageObject *m, Py_ssize_t i) {
    if (i < 0 || i >= MSG_NFIELDS) {
        PyErr_SetString(PyExc_IndexError, "tuple index out of range");
        return NULL;
    }
    return field(m, (int)i);
}

static PyObject *message_subscript(MessageObject *m, PyObject *key) {
    if (!PyIndex_Check(key)) return record_slice(&SPEC, (PyObject *)m, key);
    Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) return NULL;
    return message_item(m, i < 0 ? i + MSG_NFIELDS : i);
}

static int message_contains(PyObject *m, PyObject *v) { return record_contains(&SPEC, m, v); }
static PyObject *message_iter(PyObject *m) { return record_iter(&SPEC, m); }
static Py_hash_t message_hash(PyObject *m) { return record_hash(&SPEC, m); } /* a TypeError: the dict */
/* As the tuple of the fields: equal to a NamedTuple Message with equal fields. */
static PyObject *message_richcompare(PyObject *a, PyObject *b, int op) {
    return record_compare(&SPEC, a, b, op);
}

static PyObject *message_repr(MessageObject *m) {
    PyObject *t = as_tuple(m);
    if (t == NULL) return NULL;
    PyObject *const *v = &PyTuple_GET_ITEM(t, 0);
    PyObject *r = PyUnicode_FromFormat(
        "Message(message_id=%R, topic=%R, queue_id=%R, queue_offset=%R, position=%R, "
        "tag=%R, key=%R, properties=%R, code=%R, body=%R, created_ns=%R, stored_ns=%R)",
        v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11]);
    Py_DECREF(t);
    return r;
}

static PyObject *message_make(PyObject *cls, PyObject *it) { return record_make(&SPEC, it); }
static PyObject *message_asdict(PyObject *m, PyObject *unused) { return record_asdict(&SPEC, m); }
static PyObject *message_replace(PyObject *m, PyObject *args, PyObject *kwargs) {
    return record_replace(&SPEC, m, args, kwargs);
}
static PyObject *message_reduce(PyObject *m, PyObject *unused) { return record_reduce(&SPEC, m); }
static PyObject *message_count(PyObject *m, PyObject *args) {
    return record_tuple_method(&SPEC, m, "count", args);
}
static PyObject *message_index(PyObject *m, PyObject *args) {
    return record_tuple_method(&SPEC, m, "index", args);
}

static PyMethodDef methods[] = {
    {"_make", (PyCFunction)message_make, METH_O | METH_CLASS, "A Message of an iterable's 12 values."},
    {"_asdict", (PyCFunction)message_asdict, METH_NOARGS, "The fields as a dict."},
    {"_replace", (PyCFunction)(void (*)(void))message_replace, METH_VARARGS | METH_KEYWORDS,
     "A new Message with the named fields replaced."},
    {"__reduce__", (PyCFunction)message_reduce, METH_NOARGS, NULL},
    {"count", (PyCFunction)message_count, METH_VARARGS, NULL},
    {"index", (PyCFunction)message_index, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods as_sequence = {
    .sq_length = message_length,
    .sq_item = (ssizeargfunc)message_item,
    .sq_contains = message_contains,
};

static PyMappingMethods as_mapping = {
    .mp_length = message_length,
    .mp_subscript = (binaryfunc)message_subscript,
};

PyTypeObject MessageType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "equeue.store.types.Message",
    .tp_basicsize = sizeof(MessageObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_SEQUENCE,
    .tp_new = message_new,
    .tp_vectorcall = message_vectorcall,
    .tp_dealloc = (destructor)message_dealloc,
    .tp_traverse = (traverseproc)message_traverse,
    .tp_clear = (inquiry)message_clear,
    .tp_repr = (reprfunc)message_repr,
    .tp_hash = message_hash,
    .tp_richcompare = message_richcompare,
    .tp_iter = message_iter,
    .tp_as_sequence = &as_sequence,
    .tp_as_mapping = &as_mapping,
    .tp_getset = getset,
    .tp_members = members,
    .tp_methods = methods,
};

int message_type_ready(void) { return record_type_ready(&SPEC, NAMES); }

/* message_doc(doc): the NamedTuple's docstring, for the C type's __doc__ (types.py). */
PyObject *message_doc(PyObject *self, PyObject *doc) { return record_doc(&SPEC, doc); }
