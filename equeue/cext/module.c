/* equeue._speedups: the store's hot loops in C. One file per concern: write.c (checking
 * and framing sends), sender.c and sendstate.c (a whole single send, and what it keeps
 * between sends), batch.c (a batch of plain bodies), read.c (pulls), trim.c (a pull's
 * byte budget), pullcols.c (a pull's answer in columns), message.c, sendresult.c and
 * record.c (the Message and SendResult types), recover.c (open after a crash),
 * arrowcols.c (the Spark source's Arrow columns), prefault.c (the thread faulting pages
 * in ahead of the writer), sendframe.c (the broker's plain send), bodyspans.c (the
 * broker's send_bodies read from its frame), release.c (the broker's durable answers
 * after their fdatasync; answerwrite.c sends each to its socket), answercols.c (the
 * clients' send_bodies request and answer), clientsend.c (the asyncio client's plain
 * send), rawsock.c (its own socket transport on selector loops), readmux.c (one epoll
 * reader for a loop's connections from the second on), sendcoro.c
 * (AsyncClient.send's plain case as a coroutine in C), xxh3.h (the record checksum,
 * inlined where used), msgpack_min.h and hex16.h (the msgpack and hex pieces several
 * use);
 * speedups.h is what they share.
 *
 * Optional: equeue/speedups.py imports this module when it was built and
 * falls back to the pure-Python paths otherwise (or when EQUEUE_PURE_PYTHON is
 * set). Every layout written or read here is the one in equeue/format/ (chunk.py:
 * the record frame; message.py: the 56-byte message head and the 12-byte queue
 * record); the sizes come from Python through configure(), and
 * tests/test_speedups.py checks both paths byte for byte against those modules.
 *
 * Anything unusual (a wrong type, a limit exceeded, properties, a bad frame) is
 * handed back to the Python code, which raises the precise error: C only ever
 * takes the common, valid case.
 *
 * Memory: buffers are taken with PyObject_GetBuffer and released before
 * returning. While a buffer is exported, mmap.close() refuses (BufferError) and
 * the mapping stays valid, whatever other threads do when the GIL is released
 * (explicitly in scan_frames and last_nonzero, or by Python code the functions
 * call). Integers are written little-endian (the module refuses to load on a
 * big-endian machine).
 */
#include "speedups.h"

PyObject *trim_run(PyObject *self, PyObject *args); /* trim.c: a pull's byte budget */
/* sendcoro.c: AsyncClient.send's plain case as a coroutine in C (not in the list above:
 * the other parts of round 10 rewrite it) */
PyObject *client_send_method(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *client_send_coro_type(PyObject *self, PyObject *unused);

/* From equeue.format via configure(). */
Py_ssize_t HEAD_SIZE = -1;
Py_ssize_t FRAME_OVERHEAD = -1;
Py_ssize_t QUEUE_RECORD = -1;
long MAX_NAME = -1;
PyObject *EMPTY_BYTES;
PyObject *ZERO;

int configured(void) {
    if (HEAD_SIZE < 0) {
        PyErr_SetString(PyExc_RuntimeError, "equeue._speedups.configure() was not called");
        return 0;
    }
    return 1;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    Py_ssize_t head, overhead, queue_record;
    long max_name;
    if (!PyArg_ParseTuple(args, "nnnl", &head, &overhead, &queue_record, &max_name)) return NULL;
    /* The field offsets and u8 length fields below are those of the documented layout. */
    if (head != 56 || overhead != 12 || queue_record != 12 || max_name < 0 || max_name > 255) {
        PyErr_SetString(PyExc_ValueError, "equeue._speedups was built for another record layout");
        return NULL;
    }
    FRAME_OVERHEAD = overhead;
    QUEUE_RECORD = queue_record;
    MAX_NAME = max_name;
    HEAD_SIZE = head; /* last: configured() looks at it */
    Py_RETURN_NONE;
}

/* xxh3_64(data) -> int, for the tests that hold it to the xxhash package. */
static PyObject *py_xxh3_64(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t h = xxh3_64((const uint8_t *)view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

/* clientsend.c: the asyncio client's plain send, one in flight */
PyObject *client_send_frame(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
int send_lane_ready(void); /* sendlane.c: a connection's reads */
int release_ready(void);   /* release.c */
PyObject *release_frames(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
int answer_write_ready(void); /* answerwrite.c: a durable answer sent by C */
PyObject *answers_written_directly(PyObject *self, PyObject *unused);
extern PyTypeObject SendLaneType;
int commit_add_ready(void); /* commitadd.c: the group commit's add */
int counters_ready(void);   /* counters.c: the broker's counters as C integers */
extern PyTypeObject CountersType;
PyObject *py_commit_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *commit_adds_in_c(PyObject *self, PyObject *unused);
PyObject *client_send_result(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *client_conn_type(PyObject *self, PyObject *unused); /* clientconn.c */
PyObject *client_waiter_type(PyObject *self, PyObject *unused); /* wakeup.c */
PyObject *group_future(PyObject *self, PyObject *protocol); /* groupwake.c */
PyObject *group_wake(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *client_coalescer_types(PyObject *self, PyObject *unused); /* coalesceadd.c */
PyObject *client_answer_type(PyObject *self, PyObject *unused); /* groupanswer.c */
PyObject *client_raw_sock_type(PyObject *self, PyObject *unused); /* rawsock.c */
PyObject *client_read_mux_type(PyObject *self, PyObject *unused); /* readmux.c */
PyObject *shm_types(PyObject *self, PyObject *error);              /* shmring.c */

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, NULL},
    {"xxh3_64", py_xxh3_64, METH_O, NULL},
    {"check_batch", check_batch, METH_VARARGS, NULL},
    {"write_run", write_run, METH_VARARGS, NULL},
    {"pack_columns", pack_columns, METH_O, NULL},
    {"send_frame", (PyCFunction)(void (*)(void))send_frame, METH_FASTCALL, NULL},
    {"send_body", send_body, METH_O, NULL},
    {"send_answer", (PyCFunction)(void (*)(void))send_answer, METH_FASTCALL, NULL},
    {"plain_send", (PyCFunction)(void (*)(void))plain_send, METH_FASTCALL, NULL},
    {"frames_by_peer", (PyCFunction)(void (*)(void))frames_by_peer, METH_FASTCALL, NULL},
    {"release_frames", (PyCFunction)(void (*)(void))release_frames, METH_FASTCALL, NULL},
    {"answers_written_directly", answers_written_directly, METH_NOARGS, NULL},
    {"commit_add", (PyCFunction)(void (*)(void))py_commit_add, METH_FASTCALL, NULL},
    {"commit_adds_in_c", commit_adds_in_c, METH_NOARGS, NULL},
    {"results_of_columns", results_of_columns, METH_VARARGS, NULL},
    {"all_bytes", all_bytes, METH_O, NULL},
    {"columns_answer", columns_answer, METH_VARARGS, NULL},
    {"pull_answer", pull_answer, METH_VARARGS, NULL},
    {"bodies_request", bodies_request, METH_VARARGS, NULL},
    {"bodies_body", (PyCFunction)(void (*)(void))bodies_body, METH_FASTCALL, NULL},
    {"bodies_read", (PyCFunction)(void (*)(void))bodies_read, METH_FASTCALL, NULL},
    {"answer_around", (PyCFunction)(void (*)(void))answer_around, METH_FASTCALL, NULL},
    {"packed_answer", (PyCFunction)(void (*)(void))packed_answer, METH_FASTCALL, NULL},
    {"client_send_frame", (PyCFunction)(void (*)(void))client_send_frame, METH_FASTCALL, NULL},
    {"client_send_result", (PyCFunction)(void (*)(void))client_send_result, METH_FASTCALL,
     NULL},
    {"client_conn_type", client_conn_type, METH_NOARGS, NULL},
    {"client_waiter_type", client_waiter_type, METH_NOARGS, NULL},
    {"group_future", group_future, METH_O, NULL},
    {"group_wake", (PyCFunction)(void (*)(void))group_wake, METH_FASTCALL, NULL},
    {"client_coalescer_types", client_coalescer_types, METH_NOARGS, NULL},
    {"client_answer_type", client_answer_type, METH_NOARGS, NULL},
    {"client_raw_sock_type", client_raw_sock_type, METH_NOARGS, NULL},
    {"decode_run", decode_run, METH_VARARGS, NULL},
    {"collect", collect, METH_VARARGS, NULL},
    {"pull_chunk", pull_chunk, METH_VARARGS, NULL},
    {"message_doc", message_doc, METH_O, NULL},
    {"send_result_doc", send_result_doc, METH_O, NULL},
    {"scan_frames", scan_frames, METH_VARARGS, NULL},
    {"frame_offsets", frame_offsets, METH_VARARGS, NULL},
    {"record_columns", record_columns, METH_VARARGS, NULL},
    {"record_bodies", record_bodies, METH_VARARGS, NULL},
    {"match_run", match_run, METH_VARARGS, NULL},
    {"last_nonzero", last_nonzero, METH_VARARGS, NULL},
    {"pack_pull_columns", pack_pull_columns, METH_VARARGS, NULL},
    {"unpack_pull_columns", unpack_pull_columns, METH_VARARGS, NULL},
    {"prefault_request", prefault_request, METH_VARARGS, NULL},
    {"prefault_forget", prefault_forget, METH_O, NULL},
    {"prefault_supported", prefault_supported, METH_NOARGS, NULL},
    {"prefault_pending", prefault_pending, METH_NOARGS, NULL},
    {"trim_run", trim_run, METH_VARARGS, NULL},
    {"client_send_method", (PyCFunction)(void (*)(void))client_send_method, METH_FASTCALL, NULL},
    {"client_send_coro_type", client_send_coro_type, METH_NOARGS, NULL},
    {"client_read_mux_type", client_read_mux_type, METH_NOARGS, NULL},
    {"shm_types", shm_types, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "equeue._speedups", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) {
        PyErr_SetString(PyExc_ImportError, "equeue._speedups writes little-endian only");
        return NULL;
    }
    EMPTY_BYTES = PyBytes_FromStringAndSize("", 0);
    ZERO = PyLong_FromLong(0);
    if (EMPTY_BYTES == NULL || ZERO == NULL || intern_names() < 0) return NULL;
    if (PyType_Ready(&SenderType) < 0 || message_type_ready() < 0 ||
        send_result_type_ready() < 0 || body_spans_ready() < 0 || send_lane_ready() < 0 || commit_add_ready() < 0 ||
        release_ready() < 0 || answer_write_ready() < 0 || PyType_Ready(&FlusherType) < 0 ||
        counters_ready() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Sender", (PyObject *)&SenderType) < 0 ||
        PyModule_AddObjectRef(m, "Message", (PyObject *)&MessageType) < 0 ||
        PyModule_AddObjectRef(m, "SendResult", (PyObject *)&SendResultType) < 0 ||
        PyModule_AddObjectRef(m, "SendLane", (PyObject *)&SendLaneType) < 0 ||
        PyModule_AddObjectRef(m, "Flusher", (PyObject *)&FlusherType) < 0 ||
        PyModule_AddObjectRef(m, "CCounters", (PyObject *)&CountersType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
