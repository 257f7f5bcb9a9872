/* AsyncClient.send with the accelerator (equeue/client/csend.py): a callable
 * (SendMethod, a method descriptor like a function's) that, for the plain call
 * `send(topic, body)` (exact str and bytes, nothing else given), returns a SendCoro: a
 * coroutine in C (am_await, am_send, send, throw, close, __next__; asyncio.iscoroutine and
 * create_task take it) instead of a Python coroutine and its frame. Any other call is the
 * Python `async def` (`py_send`, today's coroutine), called as it is.
 *
 * A SendCoro is lazy, as an `async def` is: nothing is read, framed or written before its
 * first step. Its first step does what py_send's direct case does: the client's
 * `_protocol` live (not None, not `closed`), nothing `pending` on it, then
 * `protocol.direct(topic, body)`; a future from that (wakeup.c's Waiter, or on uvloop an
 * asyncio.Future) is awaited in place, and its answer returned: the SendResult read in C,
 * or a `(status, payload)` tuple given to `answered(client, answer)` (csend.py: the
 * SendResult decoded or the broker's error raised, as py_send does). Anything else (no
 * connection, closed, a request in flight, direct() declining) delegates: py_send(client,
 * topic, body) is made and driven in its place (`yield from`: send, throw and close go to
 * it), which decides again from the start as it does today.
 *
 * throw() while waiting raises the exception from here (the Waiter has no throw: what a
 * Python coroutine awaiting it does), the waiter left as it is: a cancelled task's send
 * stays in flight and its answer is dropped by the read. close() is safe in every state.
 * Every step it passes on runs in state RUNNING: re-entered from the code it runs (send,
 * throw or close) it raises "coroutine already executing" and never touches `inner`.
 * One never started warns as a Python coroutine does (RuntimeWarning "coroutine ... was
 * never awaited"). It has no frame: docs/client.md lists what introspection sees. */
#include "speedups.h"
#include <stddef.h>

enum { CREATED, RUNNING, WAITING, DELEGATED, DONE };

typedef struct {
    PyObject_HEAD
    PyObject *py_send, *answered, *marker; /* marker: asyncio.coroutines._is_coroutine */
    vectorcallfunc vectorcall;
} SendMethod;

typedef struct {
    PyObject_HEAD
    SendMethod *method;
    PyObject *client, *topic, *body; /* until the first step */
    PyObject *inner; /* WAITING: the future's iterator; DELEGATED: py_send's coroutine */
    PyObject *weakrefs;
    int state, decode; /* decode: a direct send's (status, payload) answer is decoded */
} SendCoro;

static PyTypeObject SendMethodType, SendCoroType;
static PyObject *S_PROTOCOL, *S_CLOSED, *S_PENDING, *S_DIRECT, *S_THROW, *S_CLOSE, *S_COALESCER,
    *S_FREE, *S_ADD;

static PyObject *coro_new(SendMethod *m, PyObject *client, PyObject *topic, PyObject *body) {
    SendCoro *c = PyObject_GC_New(SendCoro, &SendCoroType);
    if (c == NULL) return NULL;
    c->method = (SendMethod *)Py_NewRef(m);
    c->client = Py_NewRef(client);
    c->topic = Py_NewRef(topic);
    c->body = Py_NewRef(body);
    c->inner = NULL;
    c->weakrefs = NULL;
    c->state = CREATED;
    c->decode = 0;
    PyObject_GC_Track(c);
    return (PyObject *)c;
}

/* The coroutine's end: its references dropped (the method's kept: the repr's name). */
static void finish(SendCoro *c) {
    c->state = DONE;
    Py_CLEAR(c->client);
    Py_CLEAR(c->topic);
    Py_CLEAR(c->body);
    Py_CLEAR(c->inner);
}

/* A step of the inner iterator, its outcome this coroutine's: NEXT keeps waiting (in state
 * `resume`), RETURN is the answer (a tuple decoded by `answered`), ERROR ends it. Called
 * in state RUNNING, so a send/throw/close re-entering from the code it runs gets "already
 * executing" and never reaches `inner`; `inner` is held besides (a Python coroutine's
 * frame is not freed under it either). */
static PySendResult step_inner(SendCoro *c, PyObject *value, PyObject **result, int resume) {
    PyObject *r, *inner = Py_NewRef(c->inner);
    PySendResult status = PyIter_Send(inner, value, &r);
    Py_DECREF(inner);
    if (status == PYGEN_NEXT) {
        c->state = resume;
        *result = r;
        return PYGEN_NEXT;
    }
    if (status == PYGEN_RETURN && c->decode && PyTuple_CheckExact(r)) {
        /* (status, payload): read the general way, decoded or raised in Python */
        PyObject *args[2] = {c->client, r};
        PyObject *decoded = PyObject_Vectorcall(c->method->answered, args, 2, NULL);
        Py_DECREF(r);
        r = decoded;
        status = r == NULL ? PYGEN_ERROR : PYGEN_RETURN;
    }
    finish(c);
    *result = r;
    return status;
}

/* py_send(client, topic, body) made and stepped in this coroutine's place. */
static PySendResult delegate(SendCoro *c, PyObject **result) {
    PyObject *args[3] = {c->client, c->topic, c->body};
    PyObject *inner = PyObject_Vectorcall(c->method->py_send, args, 3, NULL);
    if (inner == NULL) {
        finish(c);
        *result = NULL;
        return PYGEN_ERROR;
    }
    c->inner = inner;
    return step_inner(c, Py_None, result, DELEGATED);
}

int clientconn_plain(PyObject *conn); /* clientconn.c: its fields and direct read in C */
PyObject *clientconn_closed(PyObject *conn);
PyObject *clientconn_pending(PyObject *conn);
PyObject *clientconn_direct(PyObject *conn, PyObject *topic, PyObject *body);

/* Whether `v` is true: 1, 0, -1 (held meanwhile: its __bool__ may run any code). */
static int truth(PyObject *v) {
    if (v == Py_True) return 1;
    if (v == Py_False || v == Py_None) return 0;
    Py_INCREF(v);
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* Whether attribute `name` of `owner` is true: 1, 0, -1; `field` its value read in C
 * (a clientconn_plain connection's), or NULL: asked by name (also an unset field, whose
 * AttributeError the name raises). */
static int attr_true(PyObject *owner, PyObject *name, PyObject *field) {
    if (field != NULL) return truth(field);
    PyObject *v = PyObject_GetAttr(owner, name);
    if (v == NULL) return -1;
    int t = truth(v);
    Py_DECREF(v);
    return t;
}

/* `future` (a new reference) awaited in place: the first step of its iterator. */
static PySendResult await_future(SendCoro *c, PyObject *future, int decode, PyObject **result) {
    unaryfunc await = Py_TYPE(future)->tp_as_async ? Py_TYPE(future)->tp_as_async->am_await : NULL;
    PyObject *inner = await != NULL ? await(future) : NULL;
    if (await == NULL) PyErr_Format(PyExc_TypeError, "%R is not a future", future);
    Py_DECREF(future);
    if (inner == NULL) {
        finish(c);
        *result = NULL;
        return PYGEN_ERROR;
    }
    Py_CLEAR(c->topic);
    Py_CLEAR(c->body);
    c->inner = inner;
    c->decode = decode;
    return step_inner(c, Py_None, result, WAITING);
}

/* The first step: py_send's plain cases in C, its order and checks: a live connection;
 * nothing in flight: direct(); else (or direct() declining) the coalescer's group when a
 * place is free. Anything else (no connection, closed, no coalescer, no place,
 * add() declining) is delegated: py_send decides again from the start. */
static PySendResult first(SendCoro *c, PyObject **result) {
    c->state = RUNNING;
    PyObject *protocol = PyObject_GetAttr(c->client, S_PROTOCOL), *future = NULL;
    if (protocol == NULL) goto error;
    if (protocol == Py_None) {
        Py_DECREF(protocol);
        return delegate(c, result);
    }
    int plain = clientconn_plain(protocol); /* (fields read and `direct` called in C) */
    int busy = attr_true(protocol, S_CLOSED, plain ? clientconn_closed(protocol) : NULL);
    if (busy < 0) goto error_protocol;
    if (busy) goto delegated;
    busy = attr_true(protocol, S_PENDING, plain ? clientconn_pending(protocol) : NULL);
    if (busy < 0) goto error_protocol;
    PyObject *args[3] = {protocol, c->topic, c->body};
    if (!busy) { /* alone on its connection: written at once, its answer read in C */
        future = plain ? clientconn_direct(protocol, c->topic, c->body)
                       : PyObject_VectorcallMethod(S_DIRECT, args,
                                                   3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (future == NULL) goto error_protocol;
        if (future != Py_None) {
            Py_DECREF(protocol);
            return await_future(c, future, 1, result);
        }
        Py_CLEAR(future);
    }
    PyObject *coalescer = PyObject_GetAttr(protocol, S_COALESCER);
    if (coalescer == NULL) goto error_protocol;
    if (coalescer == Py_None) {
        Py_DECREF(coalescer);
        goto delegated;
    }
    PyObject *free = PyObject_GetAttr(protocol, S_FREE);
    Py_ssize_t places = free == NULL ? -1 : PyLong_Check(free) ? PyLong_AsSsize_t(free) : 0;
    Py_XDECREF(free);
    if (places == -1 && PyErr_Occurred()) {
        Py_DECREF(coalescer);
        goto error_protocol;
    }
    if (places <= 0) { /* (py_send waits for a place) */
        Py_DECREF(coalescer);
        goto delegated;
    }
    args[0] = coalescer; /* the loop turn's group: add(topic, body) */
    future = PyObject_VectorcallMethod(S_ADD, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(coalescer);
    if (future == NULL) goto error_protocol;
    Py_DECREF(protocol);
    if (future != Py_None) return await_future(c, future, 0, result);
    Py_DECREF(future); /* (an idle connection not heard from recently: py_send's _call) */
    return delegate(c, result);
delegated:
    Py_DECREF(protocol);
    return delegate(c, result);
error_protocol:
    Py_DECREF(protocol);
error:
    finish(c);
    *result = NULL;
    return PYGEN_ERROR;
}

static PySendResult coro_am_send(SendCoro *c, PyObject *value, PyObject **result) {
    switch (c->state) {
    case CREATED:
        if (value != Py_None) {
            PyErr_SetString(PyExc_TypeError,
                            "can't send non-None value to a just-started coroutine");
            *result = NULL;
            return PYGEN_ERROR;
        }
        return first(c, result);
    case WAITING:
    case DELEGATED: {
        int resume = c->state;
        c->state = RUNNING;
        return step_inner(c, value, result, resume);
    }
    case RUNNING: PyErr_SetString(PyExc_ValueError, "coroutine already executing"); break;
    default: PyErr_SetString(PyExc_RuntimeError, "cannot reuse already awaited coroutine");
    }
    *result = NULL;
    return PYGEN_ERROR;
}

/* A returned value as a generator's send() gives it: StopIteration(value). */
static PyObject *stop_with(PyObject *r) {
    if (r == Py_None) {
        Py_DECREF(r);
        PyErr_SetNone(PyExc_StopIteration);
        return NULL;
    }
    PyObject *stop = PyObject_CallOneArg(PyExc_StopIteration, r);
    Py_DECREF(r);
    if (stop == NULL) return NULL;
    PyErr_SetObject(PyExc_StopIteration, stop);
    Py_DECREF(stop);
    return NULL;
}

static PyObject *coro_send(SendCoro *c, PyObject *value) {
    PyObject *r;
    PySendResult status = coro_am_send(c, value, &r);
    return status == PYGEN_RETURN ? stop_with(r) : r;
}

static PyObject *coro_iternext(SendCoro *c) { return coro_send(c, Py_None); }

/* The exception throw(typ[, val[, tb]]) names, raised (as a generator raises it where it
 * stands): NULL. */
static PyObject *raise_thrown(PyObject *const *args, Py_ssize_t nargs) {
    PyObject *typ = args[0], *val = nargs > 1 ? args[1] : Py_None;
    PyObject *tb = nargs > 2 ? args[2] : Py_None;
    if (tb != Py_None && !PyTraceBack_Check(tb)) {
        PyErr_SetString(PyExc_TypeError, "throw() third argument must be a traceback object");
        return NULL;
    }
    if (PyExceptionInstance_Check(typ)) {
        if (val != Py_None) {
            PyErr_SetString(PyExc_TypeError, "instance exception may not have a separate value");
            return NULL;
        }
        if (tb != Py_None && PyException_SetTraceback(typ, tb) < 0) return NULL;
        PyErr_SetObject((PyObject *)Py_TYPE(typ), typ);
        return NULL;
    }
    if (!PyExceptionClass_Check(typ)) {
        PyErr_Format(PyExc_TypeError,
                     "exceptions must be classes or instances deriving from BaseException, "
                     "not %s", Py_TYPE(typ)->tp_name);
        return NULL;
    }
    PyObject *exc = val == Py_None ? PyObject_CallNoArgs(typ)
                    : PyExceptionInstance_Check(val) && PyObject_TypeCheck(val, (PyTypeObject *)typ)
                        ? Py_NewRef(val)
                        : PyObject_CallOneArg(typ, val);
    if (exc == NULL) return NULL;
    if (tb != Py_None && PyException_SetTraceback(exc, tb) < 0) {
        Py_DECREF(exc);
        return NULL;
    }
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

/* Calls method `name` of the inner iterator if it has one: 1 (*out its result, NULL with an
 * error), 0 (it has none). */
static int call_inner(SendCoro *c, PyObject *name, PyObject *const *args, Py_ssize_t nargs,
                      PyObject **out) {
    PyObject *meth, *inner = Py_NewRef(c->inner); /* (held while it runs, as step_inner) */
#if PY_VERSION_HEX >= 0x030D0000
    int found = PyObject_GetOptionalAttr(inner, name, &meth);
#else
    int found = _PyObject_LookupAttr(inner, name, &meth);
#endif
    if (found <= 0) {
        Py_DECREF(inner);
        *out = NULL;
        return found < 0;
    }
    *out = PyObject_Vectorcall(meth, args, nargs, NULL);
    Py_DECREF(meth);
    Py_DECREF(inner);
    return 1;
}

static PyObject *coro_throw(SendCoro *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "throw expected 1 to 3 arguments");
        return NULL;
    }
    if (c->state == RUNNING) {
        PyErr_SetString(PyExc_ValueError, "coroutine already executing");
        return NULL;
    }
    if (c->state == DELEGATED || c->state == WAITING) {
        PyObject *r;
        int state = c->state;
        c->state = RUNNING;
        int had = call_inner(c, S_THROW, args, nargs, &r);
        c->state = state;
        if (had && r != NULL) return r; /* it yields again (py_send caught it) */
        if (had && PyErr_ExceptionMatches(PyExc_StopIteration) && state == DELEGATED) {
            finish(c); /* (its return value goes up in the StopIteration) */
            return NULL;
        }
        if (had) {
            finish(c);
            return NULL;
        }
        /* (a Waiter: no throw; the exception raised here, where the await stands) */
    }
    finish(c);
    return raise_thrown(args, nargs);
}

static PyObject *coro_close(SendCoro *c, PyObject *unused) {
    if (c->state == RUNNING) {
        PyErr_SetString(PyExc_ValueError, "coroutine already executing");
        return NULL;
    }
    PyObject *r = NULL;
    int had = 0;
    if (c->state == DELEGATED || c->state == WAITING) {
        c->state = RUNNING;
        had = call_inner(c, S_CLOSE, NULL, 0, &r);
    }
    finish(c);
    if (had && r == NULL) return NULL;
    Py_XDECREF(r);
    Py_RETURN_NONE;
}

static PyObject *coro_await(SendCoro *c) { return Py_NewRef(c); }

/* The warning a Python coroutine gives when it is dropped never awaited. */
static void coro_finalize(SendCoro *c) {
    if (c->state != CREATED) return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                         "coroutine 'AsyncClient.send' was never awaited") < 0)
        PyErr_WriteUnraisable((PyObject *)c);
    PyErr_Restore(type, value, tb);
}

static int coro_traverse(SendCoro *c, visitproc visit, void *arg) {
    Py_VISIT(c->method);
    Py_VISIT(c->client);
    Py_VISIT(c->topic);
    Py_VISIT(c->body);
    Py_VISIT(c->inner);
    return 0;
}

static int coro_clear(SendCoro *c) {
    Py_CLEAR(c->method);
    Py_CLEAR(c->client);
    Py_CLEAR(c->topic);
    Py_CLEAR(c->body);
    Py_CLEAR(c->inner);
    return 0;
}

static void coro_dealloc(SendCoro *c) {
    if (c->state == CREATED && PyObject_CallFinalizerFromDealloc((PyObject *)c) < 0)
        return; /* (resurrected) */
    PyObject_GC_UnTrack(c);
    if (c->weakrefs != NULL) PyObject_ClearWeakRefs((PyObject *)c);
    coro_clear(c);
    PyObject_GC_Del(c);
}

static PyObject *coro_repr(SendCoro *c) {
    static const char *names[] = {"created", "running", "waiting", "delegated", "done"};
    return PyUnicode_FromFormat("<equeue AsyncClient.send coroutine %s>", names[c->state]);
}

static PyObject *coro_get_await(SendCoro *c, void *unused) {
    return Py_NewRef(c->inner != NULL ? c->inner : Py_None);
}
static PyObject *coro_get_running(SendCoro *c, void *unused) {
    return PyBool_FromLong(c->state == RUNNING);
}
/* (inspect.getcoroutinestate: running, then suspended, then a frame: with no frame a
 * created one reads CLOSED, as a created one is also not started: docs/client.md) */
static PyObject *coro_get_suspended(SendCoro *c, void *unused) {
    return PyBool_FromLong(c->state == WAITING || c->state == DELEGATED);
}
static PyObject *coro_get_none(SendCoro *c, void *unused) { Py_RETURN_NONE; }
static PyObject *coro_get_name(SendCoro *c, void *unused) {
    return PyUnicode_FromString("send");
}
static PyObject *coro_get_qualname(SendCoro *c, void *unused) {
    return PyUnicode_FromString("AsyncClient.send");
}

static PyMethodDef coro_methods[] = {
    {"send", (PyCFunction)coro_send, METH_O, NULL},
    {"throw", (PyCFunction)(void (*)(void))coro_throw, METH_FASTCALL, NULL},
    {"close", (PyCFunction)coro_close, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef coro_getset[] = {
    {"cr_await", (getter)coro_get_await, NULL, NULL, NULL},
    {"cr_running", (getter)coro_get_running, NULL, NULL, NULL},
    {"cr_suspended", (getter)coro_get_suspended, NULL, NULL, NULL},
    {"cr_origin", (getter)coro_get_none, NULL, NULL, NULL},
    {"cr_frame", (getter)coro_get_none, NULL, NULL, NULL},
    {"cr_code", (getter)coro_get_none, NULL, NULL, NULL},
    {"__name__", (getter)coro_get_name, NULL, NULL, NULL},
    {"__qualname__", (getter)coro_get_qualname, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyAsyncMethods coro_async = {
    .am_await = (unaryfunc)coro_await,
    .am_send = (sendfunc)coro_am_send,
};

static PyTypeObject SendCoroType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.SendCoro",
    .tp_basicsize = sizeof(SendCoro),
    .tp_weaklistoffset = offsetof(SendCoro, weakrefs),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)coro_dealloc,
    .tp_finalize = (destructor)coro_finalize,
    .tp_traverse = (traverseproc)coro_traverse,
    .tp_clear = (inquiry)coro_clear,
    .tp_repr = (reprfunc)coro_repr,
    .tp_as_async = &coro_async,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)coro_iternext,
    .tp_methods = coro_methods,
    .tp_getset = coro_getset,
};

/* The call: (client, topic, body), exact str and bytes and no keywords: a SendCoro; any
 * other: py_send's coroutine (or its TypeError), as before. */
static PyObject *method_vectorcall(SendMethod *m, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames == NULL && nargs == 3 && PyUnicode_CheckExact(args[1]) &&
        PyBytes_CheckExact(args[2]))
        return coro_new(m, args[0], args[1], args[2]);
    return PyObject_Vectorcall(m->py_send, args, nargsf, kwnames);
}

/* client.send: a bound method (a SendMethod is a method descriptor: `client.send(...)`
 * calls it with the client first and no bound method made). */
static PyObject *method_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

/* Anything else (__name__, __qualname__, __doc__, __module__, __annotations__,
 * __defaults__...) is py_send's; __wrapped__ is py_send (inspect.signature follows it),
 * _is_coroutine asyncio's marker (asyncio.iscoroutinefunction). */
static PyObject *method_getattro(SendMethod *m, PyObject *name) {
    if (PyUnicode_CompareWithASCIIString(name, "__doc__") == 0 ||
        PyUnicode_CompareWithASCIIString(name, "__module__") == 0) /* (the type has its own) */
        return PyObject_GetAttr(m->py_send, name);
    PyObject *found = PyObject_GenericGetAttr((PyObject *)m, name);
    if (found != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) return found;
    PyErr_Clear();
    if (PyUnicode_CompareWithASCIIString(name, "__wrapped__") == 0) return Py_NewRef(m->py_send);
    if (PyUnicode_CompareWithASCIIString(name, "_is_coroutine") == 0)
        return Py_NewRef(m->marker);
    return PyObject_GetAttr(m->py_send, name);
}

static int method_traverse(SendMethod *m, visitproc visit, void *arg) {
    Py_VISIT(m->py_send);
    Py_VISIT(m->answered);
    Py_VISIT(m->marker);
    return 0;
}

static int method_clear(SendMethod *m) {
    Py_CLEAR(m->py_send);
    Py_CLEAR(m->answered);
    Py_CLEAR(m->marker);
    return 0;
}

static void method_dealloc(SendMethod *m) {
    PyObject_GC_UnTrack(m);
    method_clear(m);
    PyObject_GC_Del(m);
}

static PyObject *method_repr(SendMethod *m) {
    return PyUnicode_FromFormat("<equeue AsyncClient.send (C) of %R>", m->py_send);
}

static PyTypeObject SendMethodType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.SendMethod",
    .tp_basicsize = sizeof(SendMethod),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_METHOD_DESCRIPTOR |
                Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(SendMethod, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = method_get,
    .tp_getattro = (getattrofunc)method_getattro,
    .tp_dealloc = (destructor)method_dealloc,
    .tp_traverse = (traverseproc)method_traverse,
    .tp_clear = (inquiry)method_clear,
    .tp_repr = (reprfunc)method_repr,
};

/* client_send_method(py_send, answered, marker) -> the SendMethod of py_send. */
PyObject *client_send_method(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyCallable_Check(args[0]) || !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "client_send_method(py_send, answered, marker)");
        return NULL;
    }
    if (S_PROTOCOL == NULL) {
        if ((S_PROTOCOL = PyUnicode_InternFromString("_protocol")) == NULL ||
            (S_CLOSED = PyUnicode_InternFromString("closed")) == NULL ||
            (S_PENDING = PyUnicode_InternFromString("pending")) == NULL ||
            (S_DIRECT = PyUnicode_InternFromString("direct")) == NULL ||
            (S_THROW = PyUnicode_InternFromString("throw")) == NULL ||
            (S_CLOSE = PyUnicode_InternFromString("close")) == NULL ||
            (S_COALESCER = PyUnicode_InternFromString("coalescer")) == NULL ||
            (S_FREE = PyUnicode_InternFromString("free")) == NULL ||
            (S_ADD = PyUnicode_InternFromString("add")) == NULL ||
            PyType_Ready(&SendCoroType) < 0 || PyType_Ready(&SendMethodType) < 0) {
            Py_CLEAR(S_PROTOCOL);
            return NULL;
        }
    }
    SendMethod *m = PyObject_GC_New(SendMethod, &SendMethodType);
    if (m == NULL) return NULL;
    m->py_send = Py_NewRef(args[0]);
    m->answered = Py_NewRef(args[1]);
    m->marker = Py_NewRef(args[2]);
    m->vectorcall = (vectorcallfunc)method_vectorcall;
    PyObject_GC_Track(m);
    return (PyObject *)m;
}

/* client_send_coro_type() -> SendCoro (csend.py registers it as a Coroutine). */
PyObject *client_send_coro_type(PyObject *self, PyObject *unused) {
    if (PyType_Ready(&SendCoroType) < 0) return NULL;
    return Py_NewRef((PyObject *)&SendCoroType);
}
