/* SendLane: a broker connection's buffer_updated and get_buffer in C (equeue/server/
 * connection.py). uvloop keeps protocol.buffer_updated and protocol.get_buffer as bound
 * methods and calls them for every read; the Connection puts a SendLane in its instance
 * dict under both names, so a read costs no Python frame unless it is unusual.
 *
 * A read that is exactly one plain send (a producer with one send in flight, issue 23's
 * durable case) is read, appended and answered by plain_send (sendframe.c), then counted
 * and handed to the group commit (commit_add, commitadd.c: its add in C where it decides
 * nothing, else commit.add; --flush sync) or written (--flush async)
 * here, as Connection._plain_sent does. Everything else goes to the Python methods,
 * which decide as before: a connection not in the state the fast path needs
 * (Connection.buffer_updated, the class's function), a read that is not a plain send
 * (Connection._read_general), and a plain send whose tail is not the common one (an
 * error, held pulls to note, answers queued, an answer C did not pack:
 * Connection._plain_sent). The connection's state is read on every call (the Python code
 * changes it) from the __slots__ Connection keeps it in, by their offsets: a dict look-up
 * costs ~100 instructions in C where Python's specialized attribute read costs ~10; the
 * Counters' C integers (counters.c) are added to at their offsets, no int made. A connection type without those slots (not
 * the broker's) goes to Connection.buffer_updated every read. */
#include "speedups.h"
#include "commitadd.h"
#include <structmember.h>

int plain_send_parts(PyObject *const *args, PyObject *out[3]); /* sendframe.c */
Py_ssize_t counter_cell(PyTypeObject *type, PyObject *name);     /* counters.c */
int answer_write(PyObject *transport, int fd, PyObject *data, Py_ssize_t answers); /* answerwrite.c */
int transport_closing(PyObject *transport);                      /* answerwrite.c */
int slot_fd(PyObject *obj, Py_ssize_t offset);                   /* answerwrite.c */

enum { C_BYTES_IN, C_REQUESTS, C_SENDS, C_SEND_REQUESTS, C_BYTES_OUT, C_COUNT };
static const char *const COUNTER_NAMES[C_COUNT] = {"bytes_in", "requests", "sends",
                                                   "send_requests", "bytes_out"};
/* The connection's slots the lane reads (and in_flight, which it writes). */
enum { O_PLAIN, O_HELLO, O_PARTIAL, O_BACKLOG, O_CLOSED, O_IN_FLIGHT, O_STORE, O_OUT,
       O_TRANSPORT, O_COUNT };
static const char *const SLOT_NAMES[O_COUNT] = {"_plain_send", "_hello", "_partial",
                                                "_backlog", "closed", "in_flight",
                                                "_store", "_out", "transport"};
static PyObject *counter_names[C_COUNT], *slot_names[O_COUNT];
static PyObject *S_c_reads, *S_request, *S_send_method;
static PyObject *S_send, *S_count, *S_appended, *S_fd,
    *S_buffer_updated, *S_read_general, *S_plain_sent, *ONE;

/* store.send as last found: the store and its instance dict (held), the type's version
 * tag then (CPython gives a type a new one whenever it or a base changes: 0 for none), and
 * on CPython 3.11 the dict's version (PEP 509: new on every change of the dict) with the
 * object the dict held under "send" (borrowed: the unchanged dict holds it). */
typedef struct {
    PyObject *store, *dict, *send;
    unsigned int tp_version;
    uint64_t dict_version;
} StoreSend;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *connection;
    PyObject *view;     /* the read buffer get_buffer returns */
    PyObject *max_frame;
    Py_ssize_t max_in_flight;
    PyObject *kind;     /* the answer's type: bytes, or Frame under --flush sync */
    PyObject *reserved; /* topics under it: the general path */
    PyObject *commit;   /* the group commit (--flush sync), or None */
    CommitSlots commit_at; /* its slots, for its add in C (commitadd.c) */
    PyObject *counters;
    Py_ssize_t cell_at[C_COUNT];    /* a counter's C integer in counters (counters.c), or -1 */
    Py_ssize_t counter_at[C_COUNT]; /* else its object slot, or -1: by attribute */
    Py_ssize_t at[O_COUNT];         /* the connection's slots; at[0] -1: no fast path */
    Py_ssize_t fd_at;               /* its _fd slot (answerwrite.c), or -1: none */
    PyObject *holds_dict;
    PyObject *appended;    /* holds.appended as no_holds found it (borrowed), or NULL */
    uint64_t holds_version; /* ...in the holds' dict at this version (3.11) */
    StoreSend store_send; /* the store's send as last found (store_send) */
    PyObject *plain; /* _plain_send when the lane was made (the C plain_send) */
    unsigned int conn_tag; /* the connection's type's version tag at the last look (0: none) */
    int conn_own;          /* ...which then found Connection's own _request and _send */
} Lane;

#define SLOT(object, offset) (*(PyObject **)((char *)(object) + (offset)))

/* The offset of type's writable object slot name (a __slots__ entry), or -1. */
Py_ssize_t slot_offset(PyTypeObject *type, PyObject *name) {
    PyObject *d = _PyType_Lookup(type, name); /* borrowed */
    if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type)) return -1;
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if (m->type != T_OBJECT_EX || (m->flags & READONLY) || !PyType_IsSubtype(type, PyDescr_TYPE(d)))
        return -1;
    return m->offset;
}

/* value + delta for an int value (the commonest: no overflow, one C long long), NULL
 * with an error. */
PyObject *plus(PyObject *value, Py_ssize_t delta) {
    if (PyLong_CheckExact(value)) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(value, &overflow), sum;
        if (!overflow && !__builtin_add_overflow(v, (long long)delta, &sum))
            return PyLong_FromLongLong(sum);
    }
    PyObject *d = PyLong_FromSsize_t(delta);
    if (d == NULL) return NULL;
    PyObject *sum = PyNumber_Add(value, d);
    Py_DECREF(d);
    return sum;
}

/* counters.<which> += delta: 0, or -1 with an error. */
static int bump(Lane *self, int which, Py_ssize_t delta) {
    if (self->cell_at[which] >= 0) {
        *(long long *)((char *)self->counters + self->cell_at[which]) += delta;
        return 0;
    }
    Py_ssize_t at = self->counter_at[which];
    if (at < 0) {
        PyObject *old = PyObject_GetAttr(self->counters, counter_names[which]);
        if (old == NULL) return -1;
        PyObject *sum = plus(old, delta);
        Py_DECREF(old);
        if (sum == NULL) return -1;
        int failed = PyObject_SetAttr(self->counters, counter_names[which], sum);
        Py_DECREF(sum);
        return failed;
    }
    PyObject **slot = &SLOT(self->counters, at);
    if (*slot == NULL) {
        PyErr_Format(PyExc_AttributeError, "%s", COUNTER_NAMES[which]);
        return -1;
    }
    PyObject *sum = plus(*slot, delta);
    if (sum == NULL) return -1;
    Py_SETREF(*slot, sum);
    return 0;
}

/* v is the int 0: the small-int singleton, or any other int of that value (the public
 * API: an int's layout is CPython's own, Py_SIZE of an int is not its digits from 3.12). */
static inline int is_zero(PyObject *v) {
    if (v == ZERO) return 1;
    if (v == NULL || !PyLong_CheckExact(v)) return 0;
    int overflow;
    return PyLong_AsLongLongAndOverflow(v, &overflow) == 0 && !overflow;
}

/* The connection can take a read the fast way: authenticated, no frame begun, nothing
 * waiting, open, under max_in_flight, and the C readers not switched off. */
/* Whether type finds the _request and _send its _c_reads names (Connection's own): a
 * read taken here goes past both (reviewd F4). */
static int own_reads(PyTypeObject *type) {
    PyObject *own = _PyType_Lookup(type, S_c_reads); /* (borrowed; tags the type) */
    return own != NULL && PyTuple_CheckExact(own) && PyTuple_GET_SIZE(own) == 2 &&
           _PyType_Lookup(type, S_request) == PyTuple_GET_ITEM(own, 0) &&
           _PyType_Lookup(type, S_send_method) == PyTuple_GET_ITEM(own, 1);
}

static int ready(Lane *self) {
    PyObject *c = self->connection, *v;
    if (self->at[0] < 0) return 0;
    /* _request or _send replaced on the class since the last read: a new version tag */
    PyTypeObject *type = Py_TYPE(c);
    if (type->tp_version_tag != self->conn_tag || self->conn_tag == 0) {
        self->conn_own = own_reads(type);
        self->conn_tag = PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)
                             ? type->tp_version_tag : 0;
    }
    if (!self->conn_own) return 0;
    /* The lane calls plain_send_parts itself: a _plain_send replaced since (None, a spy)
     * is the Python path's to call. */
    if (SLOT(c, self->at[O_PLAIN]) != self->plain) return 0;
    if (SLOT(c, self->at[O_HELLO]) != Py_None) return 0;
    if (!is_zero(SLOT(c, self->at[O_PARTIAL]))) return 0;
    v = SLOT(c, self->at[O_BACKLOG]);
    if (v == NULL || !PyList_CheckExact(v) || PyList_GET_SIZE(v) != 0) return 0;
    if (SLOT(c, self->at[O_CLOSED]) != Py_False) return 0;
    v = SLOT(c, self->at[O_IN_FLIGHT]);
    if (v == NULL || !PyLong_CheckExact(v)) return 0;
    int overflow;
    long long in_flight = PyLong_AsLongLongAndOverflow(v, &overflow);
    return !overflow && in_flight < self->max_in_flight;
}

/* Connection.<name>(connection, *args) looked up on the class: the instance's dict holds
 * this lane under buffer_updated. */
static PyObject *call_class(Lane *self, PyObject *name, PyObject *arg1, PyObject *arg2) {
    PyObject *function = _PyType_Lookup(Py_TYPE(self->connection), name); /* borrowed */
    if (function == NULL) {
        PyErr_Format(PyExc_AttributeError, "the connection has no %U", name);
        return NULL;
    }
    Py_INCREF(function);
    PyObject *args[3] = {self->connection, arg1, arg2};
    PyObject *out = PyObject_Vectorcall(function, args, arg2 == NULL ? 2 : 3, NULL);
    Py_DECREF(function);
    return out;
}

#if PY_VERSION_HEX < 0x030C0000
#define DICT_VERSIONS 1
static inline uint64_t version_of(PyObject *d) { return ((PyDictObject *)d)->ma_version_tag; }
#else /* deprecated from 3.12: the dict is read every time */
#define DICT_VERSIONS 0
static inline uint64_t version_of(PyObject *d) { (void)d; return 0; }
#endif

/* No pull is held (holds.count 0) and no append is to be noted for one (holds.appended
 * an empty dict), read in the holds' dict; on 3.11 while that dict's version is the one
 * seen then (count, an int, changes only by assignment), only appended's size is read
 * (appended borrowed: the unchanged dict holds it). */
static int no_holds(Lane *self) {
    PyObject *h = self->holds_dict;
    if (h == NULL) return 0;
    if (!DICT_VERSIONS || self->appended == NULL || version_of(h) != self->holds_version) {
        self->appended = NULL;
        if (!is_zero(PyDict_GetItemWithError(h, S_count))) return 0;
        PyObject *v = PyDict_GetItemWithError(h, S_appended);
        if (v == NULL || !PyDict_CheckExact(v)) return 0;
        self->appended = v;
        self->holds_version = version_of(h);
    }
    return PyDict_GET_SIZE(self->appended) == 0;
}

/* A plain send's tail when it is the common one (the answer packed, no held pulls, and
 * under --flush async no answers queued): 1 done, 0 for Connection._plain_sent, -1 with
 * an error. */
static int common_tail(Lane *self, Py_ssize_t nbytes, PyObject *got[3]) {
    PyObject *rid = got[0], *sent = got[1], *frame = got[2], *c = self->connection;
    if (sent == Py_None || frame == Py_None) return 0;
    PyObject *v;
    if (!no_holds(self)) return 0;
    PyObject *transport = NULL;
    if (self->commit == Py_None) { /* answers queued before this one: they go first (Python) */
        v = SLOT(c, self->at[O_OUT]);
        if (v == NULL || !PyList_CheckExact(v) || PyList_GET_SIZE(v) != 0) return 0;
        transport = SLOT(c, self->at[O_TRANSPORT]);
        if (transport == NULL) return 0;
    }
    if (bump(self, C_BYTES_IN, nbytes) < 0 || bump(self, C_REQUESTS, 1) < 0 ||
        bump(self, C_SENDS, 1) < 0 || bump(self, C_SEND_REQUESTS, 1) < 0)
        return -1;
    if (self->commit != Py_None) { /* answered after the fdatasync covering it */
        if (commit_add(self->commit, &self->commit_at, c, rid, frame, ONE) < 0) return -1;
        PyObject **slot = &SLOT(c, self->at[O_IN_FLIGHT]);
        if (*slot == NULL) {
            PyErr_SetString(PyExc_AttributeError, "in_flight");
            return -1;
        }
        PyObject *more = plus(*slot, 1);
        if (more == NULL) return -1;
        Py_SETREF(*slot, more);
        return 1;
    }
    if (transport == Py_None) return 1;
    Py_INCREF(transport);
    int is = transport_closing(transport);
    if (is == 0) {
        is = bump(self, C_BYTES_OUT, PyBytes_GET_SIZE(frame));
        if (is == 0) /* to the socket when the transport has nothing queued */
            is = answer_write(transport, slot_fd(c, self->fd_at), frame, 1);
    }
    Py_DECREF(transport);
    return is < 0 ? -1 : 1;
}

/* store.send (a new reference), as PyObject_GetAttr finds it, without its generic look-up
 * per read (type look-up, instance dict, ~290 instructions a send): MessageStore puts its C
 * sender's call in the instance dict under "send", which wins over the class's function (no
 * data descriptor). While the store, its type (version tag) and its dict object are the
 * ones seen last, the dict alone is read, or on 3.11 not even that while its version is
 * unchanged. Anything else (a store whose type defines send as a data descriptor or its
 * own __getattribute__, a send set on the class) is PyObject_GetAttr's. */
static PyObject *store_send(StoreSend *ss, PyObject *store) {
    PyTypeObject *type = Py_TYPE(store);
    if (store != ss->store || ss->tp_version == 0 || type->tp_version_tag != ss->tp_version) {
        Py_CLEAR(ss->store);
        Py_CLEAR(ss->dict);
        ss->send = NULL;
        ss->tp_version = 0;
        if (type->tp_getattro != PyObject_GenericGetAttr) return PyObject_GetAttr(store, S_send);
        PyObject *on_type = _PyType_Lookup(type, S_send); /* borrowed; tags the type */
        if (on_type != NULL && Py_TYPE(on_type)->tp_descr_set != NULL)
            return PyObject_GetAttr(store, S_send);
        if (!(type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) || type->tp_version_tag == 0)
            return PyObject_GetAttr(store, S_send);
        PyObject **dict = _PyObject_GetDictPtr(store);
        if (dict == NULL || *dict == NULL || !PyDict_CheckExact(*dict))
            return PyObject_GetAttr(store, S_send);
        ss->store = Py_NewRef(store);
        ss->dict = Py_NewRef(*dict);
        ss->tp_version = type->tp_version_tag;
    }
    PyObject **dict = _PyObject_GetDictPtr(store);
    if (dict == NULL || *dict != ss->dict) { /* __dict__ replaced: found again next time */
        ss->tp_version = 0;
        return PyObject_GetAttr(store, S_send);
    }
    if (DICT_VERSIONS && ss->send != NULL && version_of(ss->dict) == ss->dict_version)
        return Py_NewRef(ss->send);
    PyObject *send = PyDict_GetItemWithError(ss->dict, S_send); /* borrowed */
    if (send == NULL) {
        ss->send = NULL;
        return PyErr_Occurred() ? NULL : PyObject_GetAttr(store, S_send); /* the class's */
    }
    ss->send = send;
    ss->dict_version = version_of(ss->dict);
    return Py_NewRef(send);
}

static PyObject *lane_call(PyObject *op, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames) {
    Lane *self = (Lane *)op;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "buffer_updated(nbytes)");
        return NULL;
    }
    if (self->connection == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the SendLane was cleared");
        return NULL;
    }
    PyObject *nbytes = args[0];
    if (!PyLong_CheckExact(nbytes) || !ready(self))
        return call_class(self, S_buffer_updated, nbytes, NULL);
    Py_ssize_t n = PyLong_AsSsize_t(nbytes);
    PyObject *store = SLOT(self->connection, self->at[O_STORE]);
    if (n < 0 || store == NULL) {
        PyErr_Clear();
        return call_class(self, S_buffer_updated, nbytes, NULL);
    }
    PyObject *send = store_send(&self->store_send, store);
    if (send == NULL) return NULL;
    PyObject *call[6] = {self->view, nbytes, self->max_frame, send, self->kind, self->reserved};
    PyObject *got[3], *out = NULL;
    int read = plain_send_parts(call, got);
    Py_DECREF(send);
    if (read == 0) /* not one plain send: the frame reader */
        return call_class(self, S_read_general, nbytes, NULL);
    if (read < 0) return NULL;
    int done = common_tail(self, n, got);
    if (done == 0) { /* Connection._plain_sent(nbytes, (request_id, result, frame)) */
        PyObject *tuple = PyTuple_Pack(3, got[0], got[1], got[2]);
        if (tuple != NULL) out = call_class(self, S_plain_sent, nbytes, tuple);
        Py_XDECREF(tuple);
    } else if (done > 0) {
        out = Py_NewRef(Py_None);
    }
    Py_DECREF(got[0]);
    Py_DECREF(got[1]);
    Py_DECREF(got[2]);
    return out;
}

static PyObject *lane_get_buffer(PyObject *op, PyObject *sizehint) {
    Lane *self = (Lane *)op;
    if (self->view == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the SendLane was cleared");
        return NULL;
    }
    return Py_NewRef(self->view);
}

/* SendLane(connection, view, max_frame_bytes, max_in_flight, kind, reserved, commit,
 * counters, holds) */
static PyObject *lane_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *connection, *view, *max_frame, *kind, *reserved, *commit, *counters, *holds;
    Py_ssize_t max_in_flight;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "SendLane takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOOnOUOOO:SendLane", &connection, &view, &max_frame,
                          &max_in_flight, &kind, &reserved, &commit, &counters, &holds))
        return NULL;
    if (!PyLong_Check(max_frame) || !PyType_Check(kind)) {
        PyErr_SetString(PyExc_TypeError, "SendLane: max_frame_bytes an int, kind a type");
        return NULL;
    }
    PyObject *holds_dict = PyObject_GenericGetDict(holds, NULL);
    if (holds_dict == NULL) return NULL;
    Lane *self = PyObject_GC_New(Lane, type);
    if (self == NULL) {
        Py_DECREF(holds_dict);
        return NULL;
    }
    self->vectorcall = lane_call;
    self->connection = Py_NewRef(connection);
    self->view = Py_NewRef(view);
    self->max_frame = Py_NewRef(max_frame);
    self->max_in_flight = max_in_flight;
    self->kind = Py_NewRef(kind);
    self->reserved = Py_NewRef(reserved);
    self->commit = Py_NewRef(commit);
    commit_slots(commit, &self->commit_at);
    self->counters = Py_NewRef(counters);
    self->holds_dict = holds_dict;
    self->appended = NULL;
    self->holds_version = 0;
    self->store_send = (StoreSend){NULL, NULL, NULL, 0, 0};
    for (int i = 0; i < C_COUNT; i++) {
        self->cell_at[i] = counter_cell(Py_TYPE(counters), counter_names[i]);
        self->counter_at[i] = slot_offset(Py_TYPE(counters), counter_names[i]);
    }
    self->fd_at = slot_offset(Py_TYPE(connection), S_fd);
    int all = 1;
    for (int i = 0; i < O_COUNT; i++)
        all &= (self->at[i] = slot_offset(Py_TYPE(connection), slot_names[i])) >= 0;
    if (!all) self->at[0] = -1;
    PyObject *plain = all ? SLOT(connection, self->at[O_PLAIN]) : NULL;
    if (plain == NULL || plain == Py_None) self->at[0] = -1;
    self->plain = Py_XNewRef(plain);
    self->conn_tag = 0; /* (looked at on the first read) */
    self->conn_own = 0;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static int lane_traverse(PyObject *op, visitproc visit, void *arg) {
    Lane *self = (Lane *)op;
    Py_VISIT(self->connection);
    Py_VISIT(self->view);
    Py_VISIT(self->max_frame);
    Py_VISIT(self->kind);
    Py_VISIT(self->reserved);
    Py_VISIT(self->commit);
    Py_VISIT(self->counters);
    Py_VISIT(self->holds_dict);
    Py_VISIT(self->store_send.store);
    Py_VISIT(self->store_send.dict);
    Py_VISIT(self->plain);
    return 0;
}

static int lane_clear(PyObject *op) {
    Lane *self = (Lane *)op;
    Py_CLEAR(self->connection);
    Py_CLEAR(self->view);
    Py_CLEAR(self->max_frame);
    Py_CLEAR(self->kind);
    Py_CLEAR(self->reserved);
    Py_CLEAR(self->commit);
    Py_CLEAR(self->counters);
    Py_CLEAR(self->holds_dict);
    self->appended = NULL;
    Py_CLEAR(self->store_send.store);
    Py_CLEAR(self->store_send.dict);
    self->store_send.send = NULL;
    Py_CLEAR(self->plain);
    return 0;
}

static void lane_dealloc(PyObject *op) {
    PyObject_GC_UnTrack(op);
    lane_clear(op);
    PyObject_GC_Del(op);
}

static PyMethodDef lane_methods[] = {
    {"get_buffer", lane_get_buffer, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

PyTypeObject SendLaneType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.SendLane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Lane, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = lane_new,
    .tp_traverse = lane_traverse,
    .tp_clear = lane_clear,
    .tp_dealloc = lane_dealloc,
    .tp_methods = lane_methods,
};

int send_lane_ready(void) {
#define NAME(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    NAME(S_send, "send") NAME(S_count, "count") NAME(S_appended, "appended")
    NAME(S_fd, "_fd")
    NAME(S_buffer_updated, "buffer_updated") NAME(S_read_general, "_read_general")
    NAME(S_plain_sent, "_plain_sent")
    NAME(S_c_reads, "_c_reads") NAME(S_request, "_request") NAME(S_send_method, "_send")
#undef NAME
    for (int i = 0; i < C_COUNT; i++)
        if ((counter_names[i] = PyUnicode_InternFromString(COUNTER_NAMES[i])) == NULL) return -1;
    for (int i = 0; i < O_COUNT; i++)
        if ((slot_names[i] = PyUnicode_InternFromString(SLOT_NAMES[i])) == NULL) return -1;
    if ((ONE = PyLong_FromLong(1)) == NULL) return -1;
    return PyType_Ready(&SendLaneType);
}
