/* The asyncio client's waiter for the answer to a direct send (clientconn.c's `direct`):
 * a future in asyncio's duck-typed protocol (what a Task does with an object it is given
 * from an `await`: _asyncio_future_blocking, get_loop, add_done_callback(fn, *, context),
 * result; also done, cancelled, exception, cancel(msg), remove_done_callback, set_result,
 * set_exception, __await__/__iter__), bound to the connection's loop. As a Future, it
 * schedules its callbacks with loop.call_soon(fn, self, context=ctx) when finished or
 * cancelled.
 *
 * One difference, in waiter_finish (the answer read by ClientConn.buffer_updated,
 * everything else about the read done): when the only callback is a C Task's wake-up,
 * the loop is one of asyncio's own (a BaseEventLoop: not uvloop's), running on this
 * thread, no task is running on it and it is not in debug mode, the callback is run at once in its context (`context.run(cb, self)`), as
 * Handle._run would run it one loop pass later, without call_soon's Python Handle. An
 * exception it raises is the loop's exception handler's, as in Handle._run; a
 * KeyboardInterrupt or SystemExit propagates (out of buffer_updated, then the loop).
 * The wake-up is given DONE (a finished _asyncio.Future), not the waiter, there: what the
 * task then does is the same (task_wakeup steps it with nothing sent either way), without
 * task_wakeup's call of the waiter's result() by name. */
#include "speedups.h"

enum { PENDING, RESULT, ERROR, CANCELLED };

typedef struct {
    PyObject_HEAD
    PyObject *loop, *value; /* value: the result, the exception, or the cancel message */
    PyObject *cb, *ctx;     /* the first callback and its context */
    PyObject *more;         /* a list of (cb, ctx) after the first, or NULL */
    PyObject *tb;           /* the exception's traceback when it was set (Future's _exception_tb) */
    int state, blocking;
} Waiter;

static PyTypeObject WaiterType;
int waiter_ready(void);
int waiter_on_loop(PyObject *loop);
static PyObject *TASK_TYPE, *BASE_LOOP, *FUTURE, *CANCELLED_ERROR, *INVALID_STATE, *RUNNING_LOOP, *CURRENT_TASK;
/* CPython < 3.12: the dict asyncio.current_task(loop) reads (`_current_tasks.get(loop)`, a
 * Python function there: ~1,250 instructions a call, a send's largest check), the one C
 * Tasks enter themselves in; NULL elsewhere (3.12+: current_task is C) or when
 * asyncio.current_task is not that function (replaced before the first waiter): called. */
static PyObject *CURRENT_TASKS;
/* A finished _asyncio.Future (result None) on no loop of use (a namespace whose
 * get_debug() is bool(), False: the one call Future's init makes on it), given to a C
 * Task's wake-up in waiter_finish; NULL where _asyncio is missing (the waiter is given). */
static PyObject *DONE;
static PyObject *BASE_GET_DEBUG, *S_DEBUG, *S_RUNNING_KEY;
static PyObject *S_CALL_SOON, *S_GET_DEBUG, *S_HANDLER, *S_CONTEXT, *S_MESSAGE, *S_EXCEPTION,
    *KW_CONTEXT;

PyObject *waiter_new(PyObject *loop) {
    Waiter *w = PyObject_GC_New(Waiter, &WaiterType);
    if (w == NULL) return NULL;
    w->loop = Py_NewRef(loop);
    w->value = w->cb = w->ctx = w->more = w->tb = NULL;
    w->state = PENDING;
    w->blocking = 0;
    PyObject_GC_Track(w);
    return (PyObject *)w;
}

/* loop.call_soon(cb, self, context=ctx): Future's scheduling of one callback. */
static int schedule_one(Waiter *w, PyObject *cb, PyObject *ctx) {
    PyObject *args[4] = {w->loop, cb, (PyObject *)w, ctx};
    PyObject *r = PyObject_VectorcallMethod(S_CALL_SOON, args, 3, KW_CONTEXT);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* Every callback scheduled (Future's order: the first, then the rest), then forgotten. */
static int schedule_all(Waiter *w) {
    PyObject *cb = w->cb, *ctx = w->ctx, *more = w->more;
    w->cb = w->ctx = w->more = NULL;
    int rc = 0;
    if (cb != NULL) rc = schedule_one(w, cb, ctx);
    for (Py_ssize_t i = 0; rc == 0 && more != NULL && i < PyList_GET_SIZE(more); i++) {
        PyObject *pair = PyList_GET_ITEM(more, i);
        rc = schedule_one(w, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1));
    }
    Py_XDECREF(cb);
    Py_XDECREF(ctx);
    Py_XDECREF(more);
    return rc;
}

static PyObject *invalid(const char *what) {
    PyErr_SetString(INVALID_STATE, what);
    return NULL;
}

/* The CancelledError a cancelled waiter raises (Future's: the message if one was given). */
static void raise_cancelled(Waiter *w) {
    PyObject *exc = w->value == NULL || w->value == Py_None
                        ? PyObject_CallNoArgs(CANCELLED_ERROR)
                        : PyObject_CallOneArg(CANCELLED_ERROR, w->value);
    if (exc == NULL) return;
    PyErr_SetObject(CANCELLED_ERROR, exc);
    Py_DECREF(exc);
}

static PyObject *w_result(Waiter *w, PyObject *unused) {
    switch (w->state) {
    case RESULT: return Py_NewRef(w->value);
    case ERROR: /* raised with the traceback it had when set, as Future does: each raise
                 * would otherwise add its frames to the exception (review 34b) */
        if (PyException_SetTraceback(w->value, w->tb != NULL ? w->tb : Py_None) < 0) return NULL;
        PyErr_SetObject((PyObject *)Py_TYPE(w->value), w->value);
        return NULL;
    case CANCELLED: raise_cancelled(w); return NULL;
    default: return invalid("Result is not set.");
    }
}

static PyObject *w_exception(Waiter *w, PyObject *unused) {
    switch (w->state) {
    case RESULT: Py_RETURN_NONE;
    case ERROR: return Py_NewRef(w->value);
    case CANCELLED: raise_cancelled(w); return NULL;
    default: return invalid("Exception is not set.");
    }
}

static PyObject *w_done(Waiter *w, PyObject *unused) { return PyBool_FromLong(w->state != PENDING); }

static PyObject *w_cancelled(Waiter *w, PyObject *unused) {
    return PyBool_FromLong(w->state == CANCELLED);
}

static PyObject *w_get_loop(Waiter *w, PyObject *unused) { return Py_NewRef(w->loop); }

static PyObject *finish(Waiter *w, int state, PyObject *value) {
    if (w->state != PENDING) return invalid("invalid state");
    w->state = state;
    Py_XSETREF(w->value, Py_XNewRef(value));
    if (state == ERROR) Py_XSETREF(w->tb, PyException_GetTraceback(value));
    if (schedule_all(w) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *w_set_result(Waiter *w, PyObject *result) { return finish(w, RESULT, result); }

static PyObject *w_set_exception(Waiter *w, PyObject *exc) {
    PyObject *made = NULL;
    if (PyExceptionClass_Check(exc)) {
        if ((made = PyObject_CallNoArgs(exc)) == NULL) return NULL;
        exc = made;
    }
    PyObject *out = NULL;
    if (!PyExceptionInstance_Check(exc))
        PyErr_SetString(PyExc_TypeError, "invalid exception object");
    else if (PyErr_GivenExceptionMatches(exc, PyExc_StopIteration))
        PyErr_SetString(PyExc_TypeError,
                        "StopIteration interacts badly with generators and cannot be raised "
                        "into a Future");
    else
        out = finish(w, ERROR, exc);
    Py_XDECREF(made);
    return out;
}

static PyObject *w_cancel(Waiter *w, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *msg = Py_None;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs + nkw > 1 || (nkw == 1 && PyUnicode_CompareWithASCIIString(
                                            PyTuple_GET_ITEM(kwnames, 0), "msg") != 0)) {
        PyErr_SetString(PyExc_TypeError, "cancel(msg=None)");
        return NULL;
    }
    if (nargs + nkw == 1) msg = args[0];
    if (w->state != PENDING) Py_RETURN_FALSE;
    PyObject *r = finish(w, CANCELLED, msg);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_RETURN_TRUE;
}

static PyObject *w_add_done_callback(Waiter *w, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames) {
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs != 1 || nkw > 1 ||
        (nkw == 1 &&
         PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "context") != 0)) {
        PyErr_SetString(PyExc_TypeError, "add_done_callback(fn, *, context=None)");
        return NULL;
    }
    PyObject *fn = args[0], *ctx = nkw ? args[1] : Py_None;
    ctx = ctx == Py_None ? PyContext_CopyCurrent() : Py_NewRef(ctx);
    if (ctx == NULL) return NULL;
    int rc = 0;
    if (w->state != PENDING)
        rc = schedule_one(w, fn, ctx);
    else if (w->cb == NULL && w->more == NULL) {
        w->cb = Py_NewRef(fn);
        w->ctx = Py_NewRef(ctx);
    } else {
        PyObject *pair = PyTuple_Pack(2, fn, ctx);
        if (pair == NULL || (w->more == NULL && (w->more = PyList_New(0)) == NULL))
            rc = -1;
        else
            rc = PyList_Append(w->more, pair);
        Py_XDECREF(pair);
    }
    Py_DECREF(ctx);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* Every comparison holds its own references: a callback's __eq__ may run any code, also
 * on this waiter (review 34b: a borrowed entry freed by it was used after). A list that
 * such code changed while it was compared is left as that code made it. */
static PyObject *w_remove_done_callback(Waiter *w, PyObject *fn) {
    Py_ssize_t removed = 0;
    PyObject *cb = Py_XNewRef(w->cb);
    if (cb != NULL) {
        int eq = PyObject_RichCompareBool(cb, fn, Py_EQ);
        if (eq > 0 && w->cb == cb) {
            Py_CLEAR(w->cb);
            Py_CLEAR(w->ctx);
            removed++;
        }
        Py_DECREF(cb);
        if (eq < 0) return NULL;
    }
    PyObject *more = Py_XNewRef(w->more);
    if (more != NULL) {
        Py_ssize_t n = PyList_GET_SIZE(more);
        PyObject *snapshot = PyList_GetSlice(more, 0, n), *kept = PyList_New(0);
        Py_ssize_t gone = 0;
        int failed = snapshot == NULL || kept == NULL;
        for (Py_ssize_t i = 0; !failed && i < n; i++) {
            PyObject *pair = PyList_GET_ITEM(snapshot, i); /* held by the snapshot */
            int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(pair, 0), fn, Py_EQ);
            if (eq < 0 || (!eq && PyList_Append(kept, pair) < 0))
                failed = 1;
            else
                gone += eq;
        }
        if (!failed && w->more == more && PyList_GET_SIZE(more) == n) {
            Py_SETREF(w->more, Py_NewRef(kept));
            removed += gone;
        }
        Py_XDECREF(snapshot);
        Py_XDECREF(kept);
        Py_DECREF(more);
        if (failed) return NULL;
    }
    return PyLong_FromSsize_t(removed);
}

static PyObject *w_get_blocking(Waiter *w, void *unused) { return PyBool_FromLong(w->blocking); }

static int w_set_blocking(Waiter *w, PyObject *value, void *unused) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete attribute");
        return -1;
    }
    int truth = PyObject_IsTrue(value);
    if (truth < 0) return -1;
    w->blocking = truth;
    return 0;
}

/* await: yields itself while pending (a Task then waits on it), then returns the result
 * or raises (asyncio's FutureIter, the waiter its own iterator: awaited once). */
static PyObject *w_iternext(Waiter *w) {
    if (w->state == PENDING) {
        if (!w->blocking) {
            w->blocking = 1;
            return Py_NewRef(w);
        }
        PyErr_SetString(PyExc_RuntimeError, "await wasn't used with future");
        return NULL;
    }
    PyObject *r = w_result(w, NULL);
    if (r == NULL) return NULL;
    if (PyTuple_Check(r) || PyExceptionInstance_Check(r)) { /* (not taken as args) */
        PyObject *stop = PyObject_CallOneArg(PyExc_StopIteration, r);
        Py_DECREF(r);
        if (stop == NULL) return NULL;
        PyErr_SetObject(PyExc_StopIteration, stop);
        Py_DECREF(stop);
    } else {
        PyErr_SetObject(PyExc_StopIteration, r);
        Py_DECREF(r);
    }
    return NULL;
}

/* The same as am_send (PyIter_Send, the `await` of a coroutine and sendcoro.c's step):
 * the result returned, no StopIteration made for it. */
static PySendResult w_am_send(Waiter *w, PyObject *arg, PyObject **result) {
    if (w->state == PENDING) {
        if (!w->blocking) {
            w->blocking = 1;
            *result = Py_NewRef(w);
            return PYGEN_NEXT;
        }
        PyErr_SetString(PyExc_RuntimeError, "await wasn't used with future");
        *result = NULL;
        return PYGEN_ERROR;
    }
    *result = w_result(w, NULL);
    return *result == NULL ? PYGEN_ERROR : PYGEN_RETURN;
}

static PyObject *w_repr(Waiter *w) {
    static const char *names[] = {"pending", "finished", "finished", "cancelled"};
    return PyUnicode_FromFormat("<equeue send waiter %s>", names[w->state]);
}

/* loop.get_debug(): BaseEventLoop's returns `self._debug`, read here directly when the
 * loop's type has that method (not overridden: a subclass's get_debug is called), without
 * its Python frame (~600 instructions a send, csend round 10); 1, 0, -1. (A get_debug set
 * on a loop instance is not looked for.) */
static int loop_debug(PyObject *loop) {
    PyObject *debug;
    if (BASE_GET_DEBUG != NULL && _PyType_Lookup(Py_TYPE(loop), S_GET_DEBUG) == BASE_GET_DEBUG)
        debug = PyObject_GetAttr(loop, S_DEBUG);
    else
        debug = PyObject_CallMethodNoArgs(loop, S_GET_DEBUG);
    if (debug == NULL) return -1;
    int on = PyObject_IsTrue(debug);
    Py_DECREF(debug);
    return on;
}

/* 1: the callback may run now (see the top), 0: not, -1: an error. */
static int may_run_now(Waiter *w) {
    PyObject *cb = w->cb;
    if (cb == NULL || w->more != NULL || !PyContext_CheckExact(w->ctx) || !PyCFunction_Check(cb))
        return 0;
    /* asyncio's own loops only: uvloop's call_soon is C already, and there the task run
     * inside the read measured more instructions a send, not fewer (19.1 k against 17.0 k) */
    if (!PyType_Check(BASE_LOOP) || !PyType_IsSubtype(Py_TYPE(w->loop), (PyTypeObject *)BASE_LOOP))
        return 0;
    PyObject *task = PyCFunction_GET_SELF(cb);
    PyMethodDef *def = ((PyCFunctionObject *)cb)->m_ml;
    if (task == NULL || (PyObject *)Py_TYPE(task) != TASK_TYPE || def == NULL ||
        strcmp(def->ml_name, "task_wakeup") != 0)
        return 0;
    int own = waiter_on_loop(w->loop);
    if (own <= 0) return own;
    if (CURRENT_TASKS != NULL) {
        PyObject *current = PyDict_GetItemWithError(CURRENT_TASKS, w->loop); /* (borrowed) */
        if (current != NULL) return 0;
        if (PyErr_Occurred()) return -1;
    } else {
        PyObject *current = PyObject_CallOneArg(CURRENT_TASK, w->loop);
        if (current == NULL) return -1;
        Py_DECREF(current);
        if (current != Py_None) return 0;
    }
    int on = loop_debug(w->loop);
    return on < 0 ? -1 : !on;
}

/* The loop's exception handler told of an exception the callback raised (Handle._run). */
static int report(Waiter *w, PyObject *cb) {
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (tb != NULL) PyException_SetTraceback(exc, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    PyObject *context = PyDict_New(), *msg = NULL, *r = NULL;
    if (context != NULL &&
        (msg = PyUnicode_FromFormat("Exception in callback %R(%R)", cb, (PyObject *)w)) != NULL &&
        PyDict_SetItem(context, S_MESSAGE, msg) == 0 &&
        PyDict_SetItem(context, S_EXCEPTION, exc) == 0)
        r = PyObject_CallMethodOneArg(w->loop, S_HANDLER, context);
    Py_XDECREF(context);
    Py_XDECREF(msg);
    Py_DECREF(exc);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

int waiter_is(PyObject *object) { return Py_IS_TYPE(object, &WaiterType); }

/* For clientconn.c: whether a Waiter is still pending (no result, error or cancel). */
int waiter_pending(PyObject *object) { return ((Waiter *)object)->state == PENDING; }

/* An asyncio.Future of the running loop when that is `loop`; None (a new reference)
 * when another loop (or none) runs: NULL with an error. */
PyObject *waiter_future_on(PyObject *loop) {
    int own = waiter_on_loop(loop);
    if (own <= 0) return own < 0 ? NULL : Py_NewRef(Py_None);
    return PyObject_CallNoArgs(FUTURE); /* (the running loop, found in C again) */
}

#if PY_VERSION_HEX < 0x030C0000
/* _asyncio's holder of a thread's running loop (CPython 3.7-3.11: PyRunningLoopHolder,
 * its loop first, then the pid it was set in). */
typedef struct {
    PyObject_HEAD
    PyObject *rl_loop;
} RunningLoopHolder;

/* Whether `loop` is this thread's running loop as _asyncio keeps it (the thread state's
 * dict, under the key _set_running_loop writes), without asyncio._get_running_loop:
 * CPython 3.11's calls getpid() each time, to tell a forked child, a system call twice a
 * direct send (perfshm, round 15: 2.0 getpid a send, half of the client's system calls).
 * (In a forked child this says the parent's loop still runs; the clients close themselves
 * there, equeue/client/forks.py.) The thread's own running loop, so a loop run nested
 * inside another (nest_asyncio's `_set_running_loop(None)`, then the other's
 * run_until_complete) is told apart (review6 R6-5: the loop's `_thread_id` alone said the
 * outer loop ran, and a send from the nested one was written). 1, 0, or -1: not known
 * (no such holder), asyncio is asked. */
static int running_loop_is(PyObject *loop) {
    PyObject *dict = PyThreadState_GetDict(); /* (borrowed) */
    if (dict == NULL) return -1;
    PyObject *holder = PyDict_GetItemWithError(dict, S_RUNNING_KEY); /* (borrowed) */
    if (holder == NULL) {
        if (!PyErr_Occurred()) return 0; /* never set on this thread: no loop runs */
        PyErr_Clear();
        return -1;
    }
    if (strcmp(Py_TYPE(holder)->tp_name, "_RunningLoopHolder") != 0) return -1;
    return ((RunningLoopHolder *)holder)->rl_loop == loop;
}
#else
static int running_loop_is(PyObject *loop) { return -1; } /* (3.12: no getpid there) */
#endif

/* Whether `loop` is the running loop of this thread: 1, 0, -1. */
int waiter_on_loop(PyObject *loop) {
    if (waiter_ready() < 0) return -1;
    int here = running_loop_is(loop);
    if (here >= 0) return here;
    PyObject *running = PyObject_CallNoArgs(RUNNING_LOOP);
    if (running == NULL) return -1;
    Py_DECREF(running); /* (only its identity) */
    return running == loop;
}

/* The future of a direct send on `loop`'s connection: a Waiter on asyncio's own loops;
 * elsewhere (uvloop) an asyncio.Future, as before: there a Task takes a C Future by its
 * fast path, and the Waiter, which may not run its task at once there, measured ~1.8 k
 * instructions a send more (18.8-19.1 k against 17.0 k, 64 x 1). */
PyObject *waiter_for(PyObject *loop) {
    if (waiter_ready() < 0) return NULL;
    if (PyType_Check(BASE_LOOP) && PyType_IsSubtype(Py_TYPE(loop), (PyTypeObject *)BASE_LOOP))
        return waiter_new(loop);
    return PyObject_CallNoArgs(FUTURE); /* (the running loop, found in C) */
}

/* The waiter finished with `result` (if still pending: a cancelled one keeps its state)
 * and its task woken now if `now` and that is safe (see the top), else as Future would:
 * 0, -1. */
int waiter_finish(PyObject *waiter, PyObject *result, int now) {
    Waiter *w = (Waiter *)waiter;
    if (w->state != PENDING) return 0;
    w->state = RESULT;
    Py_XSETREF(w->value, Py_NewRef(result));
    if (now) now = may_run_now(w);
    if (now < 0) { /* the check raised (an interrupt in get_debug): the task is still woken,
                    * as a Future would, and the error goes on (review 34b: it hung) */
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        int scheduled = schedule_all(w);
        if (scheduled < 0) {
            Py_XDECREF(type);
            Py_XDECREF(exc);
            Py_XDECREF(tb);
        } else
            PyErr_Restore(type, exc, tb);
        return -1;
    }
    if (now == 0) return schedule_all(w);
    PyObject *cb = w->cb, *ctx = w->ctx;
    w->cb = w->ctx = NULL;
    int rc = 0;
    if (PyContext_Enter(ctx) < 0) { /* (entered already elsewhere: the loop's way) */
        PyErr_Clear();
        rc = schedule_one(w, cb, ctx);
    } else {
        /* The wake-up is given DONE, not the waiter: C task_wakeup asks a waiter for its
         * result() by name (PyObject_CallMethod: the name made a str, the bound method
         * made, ~900 instructions a send) only to see it does not raise, then steps the
         * task with nothing sent; an exact finished Future with a result takes its C
         * check. The coroutine reads the waiter's result from the waiter itself. */
        PyObject *r = PyObject_CallOneArg(cb, DONE != NULL ? DONE : waiter);
        if (r == NULL && !PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) &&
            !PyErr_ExceptionMatches(PyExc_SystemExit) && PyErr_ExceptionMatches(PyExc_BaseException))
            rc = report(w, cb) < 0 ? -1 : 0;
        else if (r == NULL)
            rc = -1;
        Py_XDECREF(r);
        if (PyContext_Exit(ctx) < 0) rc = -1;
    }
    Py_DECREF(cb);
    Py_DECREF(ctx);
    return rc;
}

static int w_traverse(Waiter *w, visitproc visit, void *arg) {
    Py_VISIT(w->loop);
    Py_VISIT(w->value);
    Py_VISIT(w->cb);
    Py_VISIT(w->ctx);
    Py_VISIT(w->more);
    Py_VISIT(w->tb);
    return 0;
}

static int w_clear(Waiter *w) {
    Py_CLEAR(w->loop);
    Py_CLEAR(w->value);
    Py_CLEAR(w->cb);
    Py_CLEAR(w->ctx);
    Py_CLEAR(w->more);
    Py_CLEAR(w->tb);
    return 0;
}

static void w_dealloc(Waiter *w) {
    PyObject_GC_UnTrack(w);
    w_clear(w);
    PyObject_GC_Del(w);
}

static PyObject *w_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *loop;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "Waiter(loop)");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "Waiter", 1, 1, &loop)) return NULL;
    return waiter_new(loop);
}

enum { RESULT_METHOD = 0, GET_LOOP = 4, ADD_DONE = 8 }; /* (w_getattro's: their places below) */

static PyMethodDef w_methods[] = {
    {"result", (PyCFunction)w_result, METH_NOARGS, NULL},
    {"exception", (PyCFunction)w_exception, METH_NOARGS, NULL},
    {"done", (PyCFunction)w_done, METH_NOARGS, NULL},
    {"cancelled", (PyCFunction)w_cancelled, METH_NOARGS, NULL},
    {"get_loop", (PyCFunction)w_get_loop, METH_NOARGS, NULL},
    {"set_result", (PyCFunction)w_set_result, METH_O, NULL},
    {"set_exception", (PyCFunction)w_set_exception, METH_O, NULL},
    {"cancel", (PyCFunction)(void (*)(void))w_cancel, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"add_done_callback", (PyCFunction)(void (*)(void))w_add_done_callback,
     METH_FASTCALL | METH_KEYWORDS, NULL},
    {"remove_done_callback", (PyCFunction)w_remove_done_callback, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef w_getset[] = {
    {"_asyncio_future_blocking", (getter)w_get_blocking, (setter)w_set_blocking, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* What a C Task asks of the future it was given, every step (3.11's task_step_impl, for
 * a future that is not asyncio's own): `_asyncio_future_blocking` read then set False,
 * `get_loop` looked up and called, `add_done_callback` looked up and called. Its names
 * are the interpreter's interned strings, so they are answered here by identity, before
 * the generic lookup through the type's dict and descriptors; anything else (and these
 * names given as other string objects) takes the generic way, with the same results.
 * One more by its characters: the wake-up (task_wakeup) calls `result` as
 * PyObject_CallMethod(o, "result", NULL), a new string each time, not interned, so the
 * type's method cache never holds it and the generic way walks the MRO's dicts, hashing
 * it (~700 instructions a send). */
static PyObject *S_BLOCKING, *S_GET_LOOP, *S_ADD_DONE_CALLBACK;

static int is_result(PyObject *name) {
    return PyUnicode_CheckExact(name) && PyUnicode_GET_LENGTH(name) == 6 &&
           PyUnicode_KIND(name) == PyUnicode_1BYTE_KIND &&
           memcmp(PyUnicode_1BYTE_DATA(name), "result", 6) == 0;
}

static PyObject *w_getattro(Waiter *w, PyObject *name) {
    if (name == S_BLOCKING) return PyBool_FromLong(w->blocking);
    if (name == S_GET_LOOP) return PyCFunction_New(&w_methods[GET_LOOP], (PyObject *)w);
    if (name == S_ADD_DONE_CALLBACK) return PyCFunction_New(&w_methods[ADD_DONE], (PyObject *)w);
    if (is_result(name)) return PyCFunction_New(&w_methods[RESULT_METHOD], (PyObject *)w);
    return PyObject_GenericGetAttr((PyObject *)w, name);
}

static int w_setattro(Waiter *w, PyObject *name, PyObject *value) {
    if (name == S_BLOCKING && value != NULL) return w_set_blocking(w, value, NULL);
    return PyObject_GenericSetAttr((PyObject *)w, name, value);
}

static PyAsyncMethods w_async = {.am_await = PyObject_SelfIter, .am_send = (sendfunc)w_am_send};

static PyTypeObject WaiterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.Waiter",
    .tp_basicsize = sizeof(Waiter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = w_new,
    .tp_dealloc = (destructor)w_dealloc,
    .tp_traverse = (traverseproc)w_traverse,
    .tp_clear = (inquiry)w_clear,
    .tp_repr = (reprfunc)w_repr,
    .tp_as_async = &w_async,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)w_iternext,
    .tp_methods = w_methods,
    .tp_getset = w_getset,
    .tp_getattro = (getattrofunc)w_getattro,
    .tp_setattro = (setattrofunc)w_setattro,
};

static PyObject *attr(const char *module, const char *name) {
    PyObject *m = PyImport_ImportModule(module);
    if (m == NULL) return NULL;
    PyObject *v = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    return v;
}

/* DONE made, or left NULL (no _asyncio.Future or types.SimpleNamespace, or making it
 * failed: no error is left). */
static void make_done(void) {
    PyObject *future = attr("_asyncio", "Future");
    PyObject *namespace = future == NULL ? NULL : attr("types", "SimpleNamespace");
    if (namespace == NULL) {
        Py_XDECREF(future);
        PyErr_Clear();
        return;
    }
    PyObject *kw = PyDict_New(), *empty = PyTuple_New(0), *loop = NULL, *done = NULL, *r = NULL;
    if (kw != NULL && empty != NULL &&
        PyDict_SetItemString(kw, "get_debug", (PyObject *)&PyBool_Type) == 0 &&
        (loop = PyObject_Call(namespace, empty, kw)) != NULL &&
        PyDict_SetItemString(kw, "loop", loop) == 0 && PyDict_DelItemString(kw, "get_debug") == 0 &&
        (done = PyObject_Call(future, empty, kw)) != NULL)
        r = PyObject_CallMethod(done, "set_result", "O", Py_None);
    Py_XDECREF(kw);
    Py_XDECREF(empty);
    Py_XDECREF(loop);
    Py_DECREF(namespace);
    Py_DECREF(future);
    if (r == NULL) { /* (DONE only saves a call: without it the waiter is given) */
        Py_XDECREF(done);
        PyErr_Clear();
        return;
    }
    Py_DECREF(r);
    DONE = done;
}

/* The type made ready and asyncio's names found: 0, -1. */
int waiter_ready(void) {
    if (S_CALL_SOON != NULL) return 0;
    if ((TASK_TYPE = attr("asyncio", "Task")) == NULL ||
        (BASE_LOOP = attr("asyncio", "BaseEventLoop")) == NULL ||
        (FUTURE = attr("asyncio", "Future")) == NULL ||
        (CANCELLED_ERROR = attr("asyncio", "CancelledError")) == NULL ||
        (INVALID_STATE = attr("asyncio", "InvalidStateError")) == NULL ||
        (RUNNING_LOOP = attr("asyncio", "_get_running_loop")) == NULL ||
        (CURRENT_TASK = attr("asyncio", "current_task")) == NULL ||
        (S_GET_DEBUG = PyUnicode_InternFromString("get_debug")) == NULL ||
        (S_DEBUG = PyUnicode_InternFromString("_debug")) == NULL ||
        (S_RUNNING_KEY = PyUnicode_InternFromString("__asyncio_running_event_loop__")) == NULL ||
        (BASE_GET_DEBUG = PyObject_GetAttr(BASE_LOOP, S_GET_DEBUG)) == NULL ||
        (S_HANDLER = PyUnicode_InternFromString("call_exception_handler")) == NULL ||
        (S_CONTEXT = PyUnicode_InternFromString("context")) == NULL ||
        (S_MESSAGE = PyUnicode_InternFromString("message")) == NULL ||
        (S_EXCEPTION = PyUnicode_InternFromString("exception")) == NULL ||
        (KW_CONTEXT = PyTuple_Pack(1, S_CONTEXT)) == NULL ||
        (S_BLOCKING = PyUnicode_InternFromString("_asyncio_future_blocking")) == NULL ||
        (S_GET_LOOP = PyUnicode_InternFromString("get_loop")) == NULL ||
        (S_ADD_DONE_CALLBACK = PyUnicode_InternFromString("add_done_callback")) == NULL ||
        PyType_Ready(&WaiterType) < 0)
        return -1;
    if (strcmp(w_methods[RESULT_METHOD].ml_name, "result") != 0 ||
        strcmp(w_methods[GET_LOOP].ml_name, "get_loop") != 0 ||
        strcmp(w_methods[ADD_DONE].ml_name, "add_done_callback") != 0) {
        PyErr_SetString(PyExc_SystemError, "wakeup.c: w_methods out of step with w_getattro");
        return -1;
    }
#if PY_VERSION_HEX < 0x030C0000
    PyObject *python_current = attr("asyncio.tasks", "current_task");
    if (python_current == NULL) return -1;
    if (python_current == CURRENT_TASK) {
        CURRENT_TASKS = attr("_asyncio", "_current_tasks");
        if (CURRENT_TASKS == NULL || !PyDict_CheckExact(CURRENT_TASKS)) {
            PyErr_Clear(); /* (not there, or not a dict: the function is called) */
            Py_CLEAR(CURRENT_TASKS);
        }
    }
    Py_DECREF(python_current);
#endif
    make_done();
    if ((S_CALL_SOON = PyUnicode_InternFromString("call_soon")) == NULL) return -1;
    return 0;
}

/* client_waiter_type() -> the type (for the tests: Waiter(loop)). */
PyObject *client_waiter_type(PyObject *self, PyObject *unused) {
    if (waiter_ready() < 0) return NULL;
    return Py_NewRef((PyObject *)&WaiterType);
}
