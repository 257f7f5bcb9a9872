/* The asyncio client's coalesced sends (equeue/client/coalesce.py) woken as a direct
 * send is (wakeup.c), without a Python Handle per caller.
 *
 * A coalesced group's answer gave each caller's asyncio.Future its SendResult with
 * Future.set_result, which hands the task's wake-up to loop.call_soon: on asyncio's own
 * loops a Python method making a Python Handle, which the loop runs one pass later
 * (Handle._run). Callgrind, 64 tasks sharing one client, --flush sync: ~5.3 k of the
 * client's ~20.5 k instructions a send were that call_soon, and as many again the
 * loop's pass over the Handle.
 *
 * group_future(protocol) -> the future of a coalesced send: on asyncio's own loops a
 * Waiter (wakeup.c), elsewhere (uvloop) an asyncio.Future, as for a direct send
 * (waiter_for); None when protocol.loop is not the running loop (the caller is refused
 * before anything is written, as future_of refuses it).
 *
 * group_wake(futures, results, now) -> None: each future still pending its result, in
 * order. A Waiter's task is run at once, inside the read, when `now` (no caller waits
 * for a place) and the checks of waiter_finish hold (the one callback a C Task's
 * wake-up, the loop asyncio's own, running here, no task running, no debug mode); else
 * scheduled as Future.set_result schedules it. A future already done (its caller was
 * cancelled) is left as it is. If a wake-up raises what Handle._run would not catch
 * (KeyboardInterrupt, SystemExit) or an error occurs, the remaining futures are still
 * given their results (scheduled, not run at once) and the first error is raised. */
#include "speedups.h"

int waiter_ready(void);
int waiter_on_loop(PyObject *loop);
int waiter_is(PyObject *object);
PyObject *waiter_for(PyObject *loop);
int waiter_finish(PyObject *waiter, PyObject *result, int now);

static PyObject *S_LOOP, *S_DONE, *S_SET_RESULT;

static int names_ready(void) {
    if (S_LOOP != NULL) return 0;
    if ((S_DONE = PyUnicode_InternFromString("done")) == NULL ||
        (S_SET_RESULT = PyUnicode_InternFromString("set_result")) == NULL ||
        (S_LOOP = PyUnicode_InternFromString("loop")) == NULL)
        return -1;
    return 0;
}

PyObject *group_future(PyObject *self, PyObject *protocol) {
    if (names_ready() < 0) return NULL;
    PyObject *loop = PyObject_GetAttr(protocol, S_LOOP);
    if (loop == NULL) return NULL;
    int own = waiter_on_loop(loop);
    PyObject *future = own < 0 ? NULL : own == 0 ? Py_NewRef(Py_None) : waiter_for(loop);
    Py_DECREF(loop);
    return future;
}

/* An asyncio.Future (or any other future) given `result` unless done: 0, -1. */
static int set_unless_done(PyObject *future, PyObject *result) {
    PyObject *done = PyObject_CallMethodNoArgs(future, S_DONE);
    if (done == NULL) return -1;
    int is_done = PyObject_IsTrue(done);
    Py_DECREF(done);
    if (is_done != 0) return is_done < 0 ? -1 : 0;
    PyObject *r = PyObject_CallMethodOneArg(future, S_SET_RESULT, result);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

PyObject *group_wake(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1]) ||
        PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1])) {
        PyErr_SetString(PyExc_TypeError, "group_wake(futures, results, now): two lists of a length");
        return NULL;
    }
    if (names_ready() < 0 || waiter_ready() < 0) return NULL;
    int now = PyObject_IsTrue(args[2]);
    if (now < 0) return NULL;
    /* (copies: a task run at once may do anything, the lists included) */
    PyObject *futures = PyList_GetSlice(args[0], 0, PyList_GET_SIZE(args[0]));
    PyObject *results = futures == NULL ? NULL : PyList_GetSlice(args[1], 0, PyList_GET_SIZE(args[1]));
    if (results == NULL) {
        Py_XDECREF(futures);
        return NULL;
    }
    PyObject *type = NULL, *value = NULL, *tb = NULL; /* the first error */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(futures); i++) {
        PyObject *future = PyList_GET_ITEM(futures, i), *result = PyList_GET_ITEM(results, i);
        int rc = waiter_is(future) ? waiter_finish(future, result, now && type == NULL)
                                   : set_unless_done(future, result);
        if (rc < 0) {
            if (type == NULL)
                PyErr_Fetch(&type, &value, &tb);
            else
                PyErr_Clear();
        }
    }
    Py_DECREF(futures);
    Py_DECREF(results);
    if (type != NULL) {
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    Py_RETURN_NONE;
}
