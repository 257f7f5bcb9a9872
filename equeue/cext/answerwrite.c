/* The broker's durable answer written to the connection's socket by C (release.c's
 * write_common), not through transport.write.
 *
 * Why: at one send in flight per connection a flush writes one ~40-byte answer to each
 * connection; uvloop's transport.write (Cython's call, its buffer list, the queued write
 * run at the end of the loop's iteration, uv_try_write) cost ~1.4 k instructions of the
 * broker loop's ~11.8 k a durable send (issue 23). send(2) on the socket is what that
 * write ends in when nothing is queued.
 *
 * Safety, the order of the checks:
 * - the caller has seen transport.is_closing() false: uvloop and asyncio's selector
 *   transports set it in close() and in every forced close before anything else, and
 *   close the socket only after connection_lost, later; while it is false the fd is this
 *   connection's own, not a reused one;
 * - transport.get_write_buffer_size() is 0: nothing of this connection's is queued in
 *   the transport (uvloop counts its not yet written buffer and libuv's queue), so the
 *   answer cannot overtake an earlier one;
 * - a short write leaves the rest to transport.write, an error (EAGAIN: the client does
 *   not read; EPIPE, ECONNRESET: it is gone) the whole answer: backpressure, connection
 *   loss and the close path stay the transport's, exactly as without this.
 * The fd is read once when the connection is made (equeue/server/direct.py: a plain Unix
 * or TCP transport of uvloop or asyncio's selector loop, never TLS), -1 otherwise. */
#include "speedups.h"
#include <errno.h>
#include <sys/socket.h>

static PyObject *S_get_write_buffer_size, *S_write;
static unsigned long long direct_answers; /* whole answers sent here, this process */

/* data itself if exact bytes, else (a Frame: a bytes subclass) a copy that is: uvloop's
 * write takes a bytes subclass through a memoryview cast. New reference, or NULL with an
 * error (no memory). */
PyObject *exact_bytes(PyObject *data) {
    if (PyBytes_CheckExact(data)) return Py_NewRef(data);
    return PyBytes_FromStringAndSize(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data));
}

/* data (bytes, or a subclass) to the peer behind transport (not closing: the caller checked), by
 * send(2) on fd when fd >= 0 and the transport has nothing queued, else (or the part
 * send did not take) by transport.write. 0, or -1 with the error a call raised. */
int answer_write(PyObject *transport, int fd, PyObject *data) {
    Py_ssize_t size = PyBytes_GET_SIZE(data), sent = 0;
    if (fd >= 0 && size > 0) {
        PyObject *queued = PyObject_CallMethodNoArgs(transport, S_get_write_buffer_size);
        if (queued == NULL) return -1;
        int empty = queued == ZERO || (PyLong_Check(queued) && PyLong_AsSsize_t(queued) == 0);
        Py_DECREF(queued);
        if (PyErr_Occurred()) return -1;
        if (empty) {
            ssize_t n;
            do
                n = send(fd, PyBytes_AS_STRING(data), (size_t)size, MSG_DONTWAIT | MSG_NOSIGNAL);
            while (n < 0 && errno == EINTR);
            if (n == size) {
                direct_answers++;
                return 0;
            }
            if (n > 0) sent = n;
        }
    }
    PyObject *rest = sent == 0 ? exact_bytes(data)
                               : PyBytes_FromStringAndSize(PyBytes_AS_STRING(data) + sent,
                                                           size - sent);
    if (rest == NULL) return -1;
    PyObject *r = PyObject_CallMethodOneArg(transport, S_write, rest);
    Py_DECREF(rest);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

PyObject *answers_written_directly(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(direct_answers);
}

int answer_write_ready(void) {
    if ((S_get_write_buffer_size = PyUnicode_InternFromString("get_write_buffer_size")) == NULL ||
        (S_write = PyUnicode_InternFromString("write")) == NULL)
        return -1;
    return 0;
}
