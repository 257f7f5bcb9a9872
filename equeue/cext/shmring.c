/* A transport for unix: connections with no system call per message
 * (docs/protocol.md "Shared-memory rings"; opt-in on both sides: equeue serve --shm and
 * equeue.aio.connect(url, shm=True); equeue/server/shm.py, equeue/client/shmconn.py).
 *
 * The broker makes a memfd per connection and passes it with SCM_RIGHTS beside its
 * welcome; it holds two single-producer/single-consumer byte rings, requests (client ->
 * broker) and answers (broker -> client), carrying the socket protocol's bytes as they
 * are. Layout: ring 0's indices at 0, ring 1's at 256, ring 0's data at 4096, ring 1's at
 * 4096 + R (R a power of two). Each ring: head (bytes the producer has published), tail
 * (bytes the consumer has taken), reader_sleeps (the consumer may sleep: the producer
 * wakes it), writer_waits (the producer found it full: the consumer wakes it once it
 * took some). A side keeps its own index privately and only reads the peer's, checked
 * (head - tail within [0, R]) before any byte is used: a hostile peer can break its own
 * connection (ShmBroken), never make this side read or write outside the mapping; the
 * broker seals the region's size (server/shm.py), so neither can it fault the mapping.
 *
 * ShmRing(fd, total, role): one side's view (role 0 client, 1 broker), a transport
 * base: write(data) copies what fits, publishes, and if the reader sleeps notes the
 * peer's ShmWaker; the rest goes to self._queue_rest(data, sent) (Python). read_into
 * copies out: the consumer copies into its own buffer before the protocol parses
 * anything, so the peer cannot change a frame under the parser.
 *
 * ShmWaker(fd, call_soon): this side's end of its group's wake-up socket (a stream
 * socketpair: one end each); note() schedules one fire() (a byte sent) per loop turn
 * however many rings noted it (64 answers to one client process: one send).
 *
 * ShmMux(): the reader of one group's rings: drain(fd) takes the wake-up bytes, then hands
 * each ring's bytes to its protocol (get_buffer / buffer_updated, as a socket read does),
 * calls on_room for a ring whose queued writes may go on, and before returning marks
 * every ring's reader_sleeps and looks once more (a producer that published before the
 * mark is seen here; one after it sees the mark and wakes us). drain_ring(ring) reads one
 * ring alone, with no budget: a connection's end. */
#include "speedups.h"

#ifdef __linux__
#include <errno.h>
#include <stdatomic.h>
#include <structmember.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#define HDR 4096
#define RING_HDR 256

typedef struct {
    _Atomic uint64_t head;
    char pad0[56];
    _Atomic uint64_t tail;
    char pad1[56];
    _Atomic uint32_t reader_sleeps;
    _Atomic uint32_t writer_waits;
} RingIdx;

static PyObject *ShmBroken; /* set from Python: equeue.errors.ShmRingError */

typedef struct {
    PyObject_HEAD
    int efd;
    int pending;
    int at_once;         /* the group has one ring: wake now (see waker_note) */
    PyObject *call_soon; /* loop.call_soon */
    PyObject *fire;      /* self.fire, bound once */
} ShmWaker;

typedef struct {
    PyObject_HEAD
    PyObject *dict;
    char *base;
    Py_ssize_t total;
    uint64_t size;    /* R */
    RingIdx *out, *in;
    char *out_data, *in_data;
    uint64_t out_head; /* ours: bytes published */
    uint64_t in_tail;  /* ours: bytes taken */
    int paused;        /* reading paused (backpressure) */
    int queued;        /* bytes wait in Python: later writes queue behind them */
    int broken;        /* the in ring's index was out of bounds: nothing more is read */
    int out_broken;    /* the out ring's index was: every later write is dropped */
    PyObject *waker;   /* the peer's ShmWaker */
    PyObject *protocol;
} ShmRing;

static PyTypeObject ShmWakerType, ShmRingType, ShmMuxType;

/* --- ShmWaker ------------------------------------------------------------------- */

static PyObject *waker_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    int fd;
    PyObject *call_soon;
    if (!PyArg_ParseTuple(args, "iO", &fd, &call_soon)) return NULL;
    ShmWaker *self = (ShmWaker *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->efd = fd;
    self->call_soon = Py_NewRef(call_soon);
    self->fire = PyObject_GetAttrString((PyObject *)self, "fire");
    if (self->fire == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int waker_traverse(ShmWaker *self, visitproc visit, void *arg) {
    Py_VISIT(self->call_soon);
    Py_VISIT(self->fire);
    return 0;
}

static int waker_clear(ShmWaker *self) {
    Py_CLEAR(self->call_soon);
    Py_CLEAR(self->fire);
    return 0;
}

static void waker_dealloc(ShmWaker *self) {
    PyObject_GC_UnTrack(self);
    waker_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static void wake_send(int fd);

/* A wake-up of the peer's reader, whose ring's reader_sleeps this side just took (0).
 * Sleeping flags are per ring: a reader that sleeps marks each of its group's rings, so
 * 64 answers to 64 rings of one client find 64 flags set, and one send a loop turn
 * (call_soon) wakes it once (1 x 64: 0.28-0.30 broker system calls a send deferred,
 * 1.29-1.32 sent at once). A group of one ring has one flag: the exchange already
 * dedups, and a send now saves the loop turn the deferral costs (reviewshm F10, 1 x 1:
 * client system calls a send 3.11 / 3.08 at once, 4.08 / 4.78 deferred, the extra
 * turn's epoll_wait; its CPU figures were within the host's noise: docs/benchmarks.md
 * "The wake-up a loop turn"). */
static int waker_note(ShmWaker *w) {
    if (w->at_once) {
        if (w->efd >= 0) wake_send(w->efd);
        return 0;
    }
    if (w->pending) return 0;
    w->pending = 1;
    PyObject *r = PyObject_CallOneArg(w->call_soon, w->fire);
    if (r == NULL) {
        w->pending = 0;
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

/* A wake-up noted after an index moved: the bytes are the peer's already, so a note
 * that fails (call_soon of a closed loop, at shutdown) is reported, not raised into a
 * write or read that did happen (reviewshm F9). */
static void waker_note_moved(PyObject *waker) {
    if (waker == NULL || !Py_IS_TYPE(waker, &ShmWakerType)) return;
    if (waker_note((ShmWaker *)waker) < 0) PyErr_WriteUnraisable(waker);
}

/* A wake-up: one byte on the group's socket (each side holds its own end, its own file
 * description: MSG_DONTWAIT whatever the peer does to its end's flags, reviewshm F11,
 * where a shared eventfd made blocking by the client blocked the broker's loop).
 * EAGAIN: wake-ups the peer has not read yet wait there, it is woken anyway; EPIPE,
 * EBADF: gone (MSG_NOSIGNAL: no SIGPIPE). */
static void wake_send(int fd) {
    char one = 1;
    ssize_t n;
    do
        n = send(fd, &one, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
}

static PyObject *waker_fire(ShmWaker *self, PyObject *unused) {
    self->pending = 0;
    if (self->efd >= 0) wake_send(self->efd);
    Py_RETURN_NONE;
}

static PyObject *waker_py_note(ShmWaker *self, PyObject *unused) {
    if (waker_note(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *waker_close(ShmWaker *self, PyObject *unused) {
    self->efd = -1; /* (the descriptor is its owner's to close) */
    Py_RETURN_NONE;
}

static PyMemberDef waker_members[] = {
    {"at_once", T_INT, offsetof(ShmWaker, at_once), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef waker_methods[] = {
    {"fire", (PyCFunction)waker_fire, METH_NOARGS, NULL},
    {"note", (PyCFunction)waker_py_note, METH_NOARGS, NULL},
    {"close", (PyCFunction)waker_close, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ShmWakerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.ShmWaker",
    .tp_basicsize = sizeof(ShmWaker),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = waker_new,
    .tp_dealloc = (destructor)waker_dealloc,
    .tp_traverse = (traverseproc)waker_traverse,
    .tp_clear = (inquiry)waker_clear,
    .tp_methods = waker_methods,
    .tp_members = waker_members,
};

/* --- ShmRing -------------------------------------------------------------------- */

static PyObject *ring_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    int fd, role;
    Py_ssize_t total;
    if (!PyArg_ParseTuple(args, "ini", &fd, &total, &role)) return NULL;
    Py_ssize_t ring = (total - HDR) / 2;
    if (total <= HDR || ring < 4096 || (ring & (ring - 1)) != 0 || HDR + 2 * ring != total) {
        PyErr_Format(ShmBroken != NULL ? ShmBroken : PyExc_ValueError, "a shared ring region of %zd bytes is not 4096 + 2 x a "
                     "power of two >= 4096", total);
        return NULL;
    }
    ShmRing *self = (ShmRing *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    void *p = mmap(NULL, (size_t)total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    self->base = p;
    self->total = total;
    self->size = (uint64_t)ring;
    RingIdx *r0 = (RingIdx *)self->base, *r1 = (RingIdx *)(self->base + RING_HDR);
    char *d0 = self->base + HDR, *d1 = self->base + HDR + ring;
    if (role == 0) { /* client: writes requests (ring 0), reads answers (ring 1) */
        self->out = r0, self->out_data = d0, self->in = r1, self->in_data = d1;
    } else {
        self->out = r1, self->out_data = d1, self->in = r0, self->in_data = d0;
    }
    /* A region is made for one connection and zero-filled by the broker: both sides
     * start at 0, not at whatever the peer may have written there meanwhile */
    self->out_head = 0;
    self->in_tail = 0;
    return (PyObject *)self;
}

static int ring_traverse(ShmRing *self, visitproc visit, void *arg) {
    Py_VISIT(self->dict);
    Py_VISIT(self->waker);
    Py_VISIT(self->protocol);
    return 0;
}

static int ring_clear(ShmRing *self) {
    Py_CLEAR(self->dict);
    Py_CLEAR(self->waker);
    Py_CLEAR(self->protocol);
    return 0;
}

static void ring_unmap(ShmRing *self) {
    if (self->base != NULL) {
        munmap(self->base, (size_t)self->total);
        self->base = NULL;
    }
}

static void ring_dealloc(ShmRing *self) {
    PyObject_GC_UnTrack(self);
    ring_clear(self);
    ring_unmap(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int broken(ShmRing *self, int *flag, const char *what, uint64_t a, uint64_t b) {
    *flag = 1;
    PyErr_Format(ShmBroken != NULL ? ShmBroken : PyExc_RuntimeError,
                 "the shared ring's %s index is out of bounds (%llu against %llu, ring of "
                 "%llu bytes): the peer wrote it",
                 what, (unsigned long long)a, (unsigned long long)b,
                 (unsigned long long)self->size);
    return -1;
}

/* Bytes the out ring has room for, or -1 with ShmBroken. */
static int64_t out_room(ShmRing *self) {
    uint64_t tail = atomic_load_explicit(&self->out->tail, memory_order_acquire);
    uint64_t used = self->out_head - tail;
    if (used > self->size) return broken(self, &self->out_broken, "tail", tail, self->out_head);
    return (int64_t)(self->size - used);
}

/* Bytes waiting in the in ring, or -1 with ShmBroken. */
static int64_t in_avail(ShmRing *self) {
    uint64_t head = atomic_load_explicit(&self->in->head, memory_order_acquire);
    uint64_t avail = head - self->in_tail;
    if (avail > self->size) return broken(self, &self->broken, "head", head, self->in_tail);
    return (int64_t)avail;
}

static void copy_in(ShmRing *self, const char *src, uint64_t n) {
    uint64_t at = self->out_head & (self->size - 1), first = self->size - at;
    if (first > n) first = n;
    memcpy(self->out_data + at, src, first);
    if (n > first) memcpy(self->out_data, src + first, n - first);
    self->out_head += n;
}

/* Publish what copy_in wrote; note the peer's waker if its reader sleeps. */
static int publish(ShmRing *self) {
    atomic_store_explicit(&self->out->head, self->out_head, memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&self->out->reader_sleeps, memory_order_relaxed) &&
        atomic_exchange(&self->out->reader_sleeps, 0))
        waker_note_moved(self->waker);
    return 0;
}

/* Up to n bytes of src into the out ring: how many, or -1 with an error. */
static Py_ssize_t ring_put(ShmRing *self, const char *src, Py_ssize_t n) {
    /* (broken: the in ring's index; the out ring's is checked here, by out_room) */
    if (self->base == NULL) return 0;
    if (self->out_broken) return n; /* (dropped: the connection is closing) */
    int64_t room = out_room(self);
    if (room < 0) return -1;
    if (room < n) { /* full: ask the reader to wake us once it took some, then look again */
        atomic_store(&self->out->writer_waits, 1);
        atomic_thread_fence(memory_order_seq_cst);
        if ((room = out_room(self)) < 0) return -1;
    }
    uint64_t take = (uint64_t)(room < n ? room : n);
    if (take == 0) return 0;
    copy_in(self, src, take);
    if (publish(self) < 0) return -1;
    return (Py_ssize_t)take;
}

static PyObject *S_queue_rest, *S_write_broke;

/* ring_put of view's bytes, with the out ring's index found out of bounds handed to the
 * transport's _write_broke(error) (it closes the connection later, not under the writer:
 * a write from the broker's release of many connections' answers raises nothing) and the
 * bytes counted as written. The view is released first, whatever happens: _write_broke
 * drops the transport's rest, which may be the very bytearray viewed (on_room's
 * put(self.rest)), and a bytearray with a view cannot be resized (reviewshm2 N1: a
 * BufferError replaced the ShmRingError). */
static Py_ssize_t put_or_drop(ShmRing *self, Py_buffer *view) {
    Py_ssize_t n = view->len;
    Py_ssize_t sent = ring_put(self, view->buf, n);
    PyBuffer_Release(view);
    if (sent >= 0 || !self->out_broken || ShmBroken == NULL || !PyErr_ExceptionMatches(ShmBroken))
        return sent;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, S_write_broke,
                                            value != NULL ? value : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return n;
}

/* write(data): what fits now, the rest to self._queue_rest(data, sent) (also all of it
 * while earlier bytes wait there). */
static PyObject *ring_write(ShmRing *self, PyObject *data) {
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t sent = 0, len = view.len;
    if (!self->queued && len > 0)
        sent = put_or_drop(self, &view); /* (releases the view) */
    else
        PyBuffer_Release(&view);
    if (sent < 0) return NULL;
    if (sent == len) Py_RETURN_NONE;
    PyObject *at = PyLong_FromSsize_t(sent);
    if (at == NULL) return NULL;
    PyObject *r = PyObject_CallMethodObjArgs((PyObject *)self, S_queue_rest, data, at, NULL);
    Py_DECREF(at);
    return r;
}

/* put(data) -> bytes taken (no queueing: the Python side's own queue calls this). */
static PyObject *ring_py_put(ShmRing *self, PyObject *data) {
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t sent = put_or_drop(self, &view); /* (releases the view) */
    return sent < 0 ? NULL : PyLong_FromSsize_t(sent);
}

/* Up to n bytes of the in ring into dst: how many, or -1 with ShmBroken. Copied before
 * anything reads them; the peer's writer woken if it waited for room. */
static Py_ssize_t ring_take(ShmRing *self, char *dst, Py_ssize_t n) {
    if (self->base == NULL || self->broken) return 0;
    int64_t avail = in_avail(self);
    if (avail < 0) return -1;
    uint64_t take = (uint64_t)(avail < n ? avail : n);
    if (take == 0) return 0;
    uint64_t at = self->in_tail & (self->size - 1), first = self->size - at;
    if (first > take) first = take;
    memcpy(dst, self->in_data + at, first);
    if (take > first) memcpy(dst + first, self->in_data, take - first);
    self->in_tail += take;
    atomic_store_explicit(&self->in->tail, self->in_tail, memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&self->in->writer_waits, memory_order_relaxed) &&
        atomic_exchange(&self->in->writer_waits, 0))
        waker_note_moved(self->waker);
    return (Py_ssize_t)take;
}

/* For clientconn.c: ClientConn's direct send writes through this when its transport is
 * a ring (its write not overridden: ShmClientTransport's is the ring's), not by name. */
int shmring_is(PyObject *object) {
    PyTypeObject *type = Py_TYPE(object);
    return type == &ShmRingType || type->tp_base == &ShmRingType;
}

PyObject *shmring_write(PyObject *object, PyObject *data) {
    return ring_write((ShmRing *)object, data);
}

static PyObject *ring_read_into(ShmRing *self, PyObject *buffer) {
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE) < 0) return NULL;
    Py_ssize_t n = ring_take(self, view.buf, view.len);
    PyBuffer_Release(&view);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

static PyObject *ring_room(ShmRing *self, PyObject *unused) {
    if (self->base == NULL) return PyLong_FromLong(0);
    int64_t room = out_room(self);
    return room < 0 ? NULL : PyLong_FromLongLong(room);
}

static PyObject *ring_unmap_py(ShmRing *self, PyObject *unused) {
    ring_unmap(self);
    Py_RETURN_NONE;
}

/* raw(offset, data): bytes written anywhere in the region, no index moved (tests: a
 * hostile or killed peer). */
static PyObject *ring_raw(ShmRing *self, PyObject *args) {
    Py_ssize_t offset;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "ny*", &offset, &view)) return NULL;
    if (self->base == NULL || offset < 0 || offset > self->total - view.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "outside the shared region");
        return NULL;
    }
    memcpy(self->base + offset, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *ring_set_sleeps(ShmRing *self, PyObject *flag) {
    /* (a flag whose truth raises: that error, not None with it still set, which
     * CPython's call check turns into a SystemError) */
    int sleeps = PyObject_IsTrue(flag);
    if (sleeps < 0) return NULL;
    if (self->base != NULL) atomic_store(&self->in->reader_sleeps, sleeps ? 1u : 0u);
    Py_RETURN_NONE;
}

static PyMethodDef ring_methods[] = {
    {"write", (PyCFunction)ring_write, METH_O, NULL},
    {"put", (PyCFunction)ring_py_put, METH_O, NULL},
    {"read_into", (PyCFunction)ring_read_into, METH_O, NULL},
    {"room", (PyCFunction)ring_room, METH_NOARGS, NULL},
    {"unmap", (PyCFunction)ring_unmap_py, METH_NOARGS, NULL},
    {"raw", (PyCFunction)ring_raw, METH_VARARGS, NULL},
    {"set_reader_sleeps", (PyCFunction)ring_set_sleeps, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef ring_members[] = {
    {"paused", T_INT, offsetof(ShmRing, paused), 0, NULL},
    {"queued", T_INT, offsetof(ShmRing, queued), 0, NULL},
    {"broken", T_INT, offsetof(ShmRing, broken), 0, NULL},
    {"out_broken", T_INT, offsetof(ShmRing, out_broken), READONLY, NULL},
    {"waker", T_OBJECT, offsetof(ShmRing, waker), 0, NULL},
    {"protocol", T_OBJECT, offsetof(ShmRing, protocol), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ShmRingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.ShmRing",
    .tp_basicsize = sizeof(ShmRing),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = ring_new,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_traverse = (traverseproc)ring_traverse,
    .tp_clear = (inquiry)ring_clear,
    .tp_methods = ring_methods,
    .tp_members = ring_members,
    .tp_dictoffset = offsetof(ShmRing, dict),
};

/* --- ShmMux --------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *rings; /* list of ShmRing (transports) */
    PyObject *again; /* loop.call_soon: a drain cut short comes back through it */
    PyObject *eof;   /* called once the peer's end of the wake-up socket is closed */
    unsigned long long drains; /* (tests, stats: how often it ran) */
    unsigned long long cut;    /* drains that stopped at their byte budget (tests) */
    unsigned long long ring_drains; /* drain_ring calls: a connection's end (tests) */
    int again_pending;         /* a drain(AGAIN) is scheduled: the group's one reader a
                                * turn (each cut drain scheduling one more, and the
                                * wake-up's reader beside them, made 5 drains a turn) */
    Py_ssize_t start;          /* the ring a drain serves first: the one after the last
                                * drain's budget ran out (else ring 0's flood starves the
                                * group's others) */
} ShmMux;

/* What one drain takes from its group's rings before the loop's other descriptors are
 * polled: a socket connection's one read a turn (the protocol's 256 KiB buffer). Without
 * it a drain read a ring until empty, up to 64 reads of 256 KiB: a producer refilling its
 * ring from its own core held the broker's loop 100-116 ms a drain, every other client's
 * request waiting that long (reviewshm2 N10). */
#define DRAIN_BUDGET_BYTES (256 * 1024)

static PyObject *S_get_buffer, *S_buffer_updated, *S_on_room, *S_on_broken, *MINUS_ONE, *AGAIN;
#define AGAIN_FD (-2) /* drain(AGAIN_FD): the one mux_again scheduled (else as -1) */

int clientconn_reads(PyObject *object);     /* clientconn.c */
PyObject *clientconn_inbuf(PyObject *conn); /* borrowed; NULL with an error */
PyObject *clientconn_read(PyObject *conn, Py_ssize_t nbytes);

static PyObject *mux_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    ShmMux *self = (ShmMux *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    if ((self->rings = PyList_New(0)) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int mux_traverse(ShmMux *self, visitproc visit, void *arg) {
    Py_VISIT(self->rings);
    Py_VISIT(self->again);
    Py_VISIT(self->eof);
    return 0;
}

static int mux_clear(ShmMux *self) {
    Py_CLEAR(self->rings);
    Py_CLEAR(self->again);
    Py_CLEAR(self->eof);
    return 0;
}

static void mux_dealloc(ShmMux *self) {
    PyObject_GC_UnTrack(self);
    mux_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The error set while serving `ring` is that connection's alone (a broken index, its
 * protocol's exception): the ring stops being read and its on_broken closes it. 0, or -1
 * for SystemExit / KeyboardInterrupt, which stop the drain. An on_broken that raises is
 * reported as unraisable: a drain never stops for one ring, or the other rings, whose
 * reader_sleeps it cleared, would wait for a wake-up no producer sends. */
static int ring_failed(ShmRing *ring) {
    if (PyErr_ExceptionMatches(PyExc_SystemExit) || PyErr_ExceptionMatches(PyExc_KeyboardInterrupt))
        return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    ring->broken = 1;
    PyObject *out = PyObject_CallMethodOneArg((PyObject *)ring, S_on_broken,
                                              value != NULL ? value : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (out == NULL) {
        if (PyErr_ExceptionMatches(PyExc_SystemExit) ||
            PyErr_ExceptionMatches(PyExc_KeyboardInterrupt))
            return -1;
        PyErr_WriteUnraisable((PyObject *)ring);
        return 0;
    }
    Py_DECREF(out);
    return 0;
}

/* The ring's protocol given what waits (one read's worth at a time, at most 16 reads,
 * while *budget, the drain's bytes left, lasts; up to *until, when not NULL: drain_ring's
 * end): 1 when it read anything, 0 when nothing, -1 with an error its on_broken did not
 * take. */
static int deliver(ShmRing *ring, Py_ssize_t *budget, const uint64_t *until) {
    int any = 0;
    for (int reads = 0; reads < 16 && *budget > 0 && !ring->paused && !ring->broken && ring->base;
         reads++) {
        PyObject *protocol = ring->protocol;
        if (protocol == NULL || protocol == Py_None) return any;
        /* nothing waiting: no call (most of a group's rings, most of the time) */
        uint64_t head = atomic_load_explicit(&ring->in->head, memory_order_relaxed);
        if (head == ring->in_tail) return any;
        if (until != NULL && (int64_t)(*until - ring->in_tail) <= 0) return any;
        Py_INCREF(protocol);
        /* ClientConn's own two methods in C, as rawsock.c reads for it (callgrind: the
         * look-ups by name were ~300 of the client's instructions a send) */
        int conn = clientconn_reads(protocol);
        PyObject *buf = conn ? Py_XNewRef(clientconn_inbuf(protocol))
                             : PyObject_CallMethodOneArg(protocol, S_get_buffer, MINUS_ONE);
        Py_ssize_t n = -1;
        if (buf != NULL) {
            Py_buffer view;
            if (PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE) == 0) {
                Py_ssize_t want = view.len;
                if (until != NULL && (uint64_t)want > *until - ring->in_tail)
                    want = (Py_ssize_t)(*until - ring->in_tail);
                n = ring_take(ring, view.buf, want);
                PyBuffer_Release(&view);
            }
            Py_DECREF(buf);
        }
        PyObject *r = NULL;
        if (n > 0) *budget -= n;
        if (n > 0 && conn) {
            r = clientconn_read(protocol, n);
        } else if (n > 0) {
            PyObject *count = PyLong_FromSsize_t(n);
            if (count != NULL) {
                r = PyObject_CallMethodOneArg(protocol, S_buffer_updated, count);
                Py_DECREF(count);
            }
        }
        Py_DECREF(protocol);
        if (n == 0) return any;
        if (n > 0 && r != NULL) {
            Py_DECREF(r);
            any = 1;
            continue;
        }
        /* an error: this connection's alone */
        return ring_failed(ring) < 0 ? -1 : 1;
    }
    return any;
}

/* self.again(self.drain, -1): the group's reader runs again on a later loop turn (-1: no
 * wake-up byte read then: a producer that published during this drain saw its reader
 * awake and sent none, reviewshm F4). 0, or -1 with an error. */
static int mux_again(ShmMux *self) {
    if (self->again == NULL || self->again == Py_None || self->again_pending) return 0;
    PyObject *drain = PyObject_GetAttrString((PyObject *)self, "drain");
    PyObject *r = drain == NULL ? NULL
                                : PyObject_CallFunctionObjArgs(self->again, drain, AGAIN, NULL);
    Py_XDECREF(drain);
    if (r == NULL) return -1;
    Py_DECREF(r);
    self->again_pending = 1;
    return 0;
}

/* drain(fd): the loop's reader callback of the group's wake-up socket (-1: none to
 * read). What wake-up bytes wait, up to 64 KiB in at most 4 recvs (more: the loop calls
 * again): a peer's one 64 KiB send costs this reader one drain, not 256 of 256 bytes each
 * (reviewshm2 N2: a client's byte flood, 2.4 M drains in 3 s, a broker core ~70 % busy). */
static PyObject *mux_drain(ShmMux *self, PyObject *arg) {
    int efd = PyLong_AsLong(arg);
    if (efd == -1 && PyErr_Occurred()) return NULL;
    /* every group drain takes its budget, drain(-1) in place too: the reads at a
     * connection's end that must not stop at a budget are drain_ring's, that ring's alone
     * (review9 R9-2: a half-close's unbudgeted drain(-1) read every flooding ring of the
     * group, the N10 stall back at each half-close) */
    Py_ssize_t budget = DRAIN_BUDGET_BYTES;
    if (efd == AGAIN_FD) {
        self->again_pending = 0;
        efd = -1;
    }
    self->drains++;
    if (efd >= 0) {
        char sink[16384];
        ssize_t got;
        int recvs = 0;
        do {
            do
                got = recv(efd, sink, sizeof sink, MSG_DONTWAIT);
            while (got < 0 && errno == EINTR);
        } while (got == (ssize_t)sizeof sink && ++recvs < 4);
        /* the peer closed its end: readable for ever, so the loop would call this every
         * turn (a client that closed its end kept the broker's loop spinning); eof()
         * stops watching it, and the rings are read once more */
        if (got == 0 && self->eof != NULL && self->eof != Py_None) {
            PyObject *r = PyObject_CallNoArgs(self->eof);
            if (r == NULL) return NULL;
            Py_DECREF(r);
        }
        /* the drain scheduled already reads the rings this turn (N10: a budget a turn) */
        if (self->again_pending) Py_RETURN_NONE;
    }
    PyObject *rings = PyList_GetSlice(self->rings, 0, PY_SSIZE_T_MAX); /* held: reads run tasks */
    if (rings == NULL) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(rings);
    for (Py_ssize_t i = 0; i < n; i++) {
        ShmRing *ring = (ShmRing *)PyList_GET_ITEM(rings, i);
        if (ring->base) atomic_store_explicit(&ring->in->reader_sleeps, 0, memory_order_relaxed);
    }
    PyObject *result = NULL;
    Py_ssize_t first = n > 0 ? self->start % n : 0;
    for (int pass = 0;; pass++) {
        int any = 0;
        for (Py_ssize_t k = 0; k < n; k++) {
            Py_ssize_t i = (first + k) % n;
            ShmRing *ring = (ShmRing *)PyList_GET_ITEM(rings, i);
            int got = deliver(ring, &budget, NULL);
            if (got < 0) goto done;
            any |= got;
            if (ring->queued && !ring->broken && ring->base) {
                PyObject *r = PyObject_CallMethodNoArgs((PyObject *)ring, S_on_room);
                if (r == NULL && ring_failed(ring) < 0) goto done;
                Py_XDECREF(r);
            }
            if (budget <= 0) {
                self->start = i + 1;
                break;
            }
        }
        if (budget <= 0) { /* the loop's other descriptors first, then this group again */
            self->cut++;
            if (mux_again(self) < 0) goto done;
            break;
        }
        if (any && pass < 3) continue;
        /* going to sleep: say so, then look once more */
        int waiting = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            ShmRing *ring = (ShmRing *)PyList_GET_ITEM(rings, i);
            if (ring->base && !ring->broken && !ring->paused)
                atomic_store(&ring->in->reader_sleeps, 1);
        }
        atomic_thread_fence(memory_order_seq_cst);
        for (Py_ssize_t i = 0; i < n && !waiting; i++) {
            ShmRing *ring = (ShmRing *)PyList_GET_ITEM(rings, i);
            if (ring->base && !ring->broken && !ring->paused) {
                uint64_t head = atomic_load_explicit(&ring->in->head, memory_order_acquire);
                waiting = head != ring->in_tail;
            }
        }
        if (!waiting) break;
        if (pass >= 3) { /* more keeps coming: the loop's other work first, then again */
            if (mux_again(self) < 0) goto done;
            break;
        }
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(rings);
    return result;
}

/* drain_ring(ring): that ring's bytes read now, with no budget, up to the head its peer
 * had published when the drain began: a connection's end (a half-close, the broker's
 * socket end at the client) reads everything its peer published before the end
 * (reviewshm F6: a budget there dropped requests), however big the ring (review10 F5: a
 * bound of 4 passes of 16 reads stopped at 16 MiB of 256 KiB reads; a ring may be 1 GiB),
 * and nothing published after it began (a peer refilling its ring as fast as it is read
 * would hold the loop for ever). It stops early at a paused ring (the caller reads the
 * rest once reading resumes: server/shm.py take_end) or a broken one. Nothing of the
 * group's other rings is read: their reader_sleeps and wake-ups stay as the group's
 * drains left them, read by the group's budgeted drain, woken or scheduled as before
 * (review9 R9-2). */
static PyObject *mux_drain_ring(ShmMux *self, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &ShmRingType)) {
        PyErr_SetString(PyExc_TypeError, "ShmMux.drain_ring() takes a ShmRing");
        return NULL;
    }
    ShmRing *ring = (ShmRing *)Py_NewRef(arg); /* held: its reads run tasks */
    PyObject *result = NULL;
    Py_ssize_t budget = PY_SSIZE_T_MAX;
    self->ring_drains++;
    uint64_t end = ring->base ? atomic_load_explicit(&ring->in->head, memory_order_acquire)
                              : ring->in_tail;
    /* The bound is checked as every read's head is (in_avail): more than a ring past
     * in_tail (or behind it: wraps huge) no peer can have published, so the ring breaks
     * here. Unchecked, a head out of bounds at this load and valid at each read after
     * it kept this loop reading as long as the peer refilled (review11 R11-5: 256 rings
     * of 1 MiB in one call, on the broker's loop); checked, a drain reads at most one
     * ring's size. (Not clamped to a ring: that would read on past an index known to be
     * garbage, which in_avail refuses everywhere else.) */
    if (ring->base && !ring->broken && end - ring->in_tail > ring->size) {
        broken(ring, &ring->broken, "head", end, ring->in_tail);
        if (ring_failed(ring) == 0) result = Py_NewRef(Py_None);
        goto done;
    }
    /* each deliver moves in_tail on by a read or more, or returns 0 (or breaks the ring):
     * at most end - in_tail bytes' worth of reads */
    while (ring->base && (int64_t)(end - ring->in_tail) > 0) {
        int got = deliver(ring, &budget, &end);
        if (got < 0) goto done;
        if (ring->queued && !ring->broken && ring->base) {
            PyObject *r = PyObject_CallMethodNoArgs((PyObject *)ring, S_on_room);
            if (r == NULL && ring_failed(ring) < 0) goto done;
            Py_XDECREF(r);
        }
        if (!got) break;
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(ring);
    return result;
}

/* schedule(): the group's rings read on a later loop turn (a connection's reading
 * resumed), once however many ask before it runs. */
static PyObject *mux_schedule(ShmMux *self, PyObject *unused) {
    return mux_again(self) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *mux_add(ShmMux *self, PyObject *ring) {
    if (!PyObject_TypeCheck(ring, &ShmRingType)) {
        PyErr_SetString(PyExc_TypeError, "ShmMux.add() takes a ShmRing");
        return NULL;
    }
    if (PyList_Append(self->rings, ring) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *mux_remove(ShmMux *self, PyObject *ring) {
    Py_ssize_t n = PyList_GET_SIZE(self->rings);
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyList_GET_ITEM(self->rings, i) == ring)
            return PySequence_DelItem(self->rings, i) < 0 ? NULL : Py_NewRef(Py_None);
    Py_RETURN_NONE;
}

static Py_ssize_t mux_len(ShmMux *self) { return PyList_GET_SIZE(self->rings); }

static PyMethodDef mux_methods[] = {
    {"drain", (PyCFunction)mux_drain, METH_O, NULL},
    {"add", (PyCFunction)mux_add, METH_O, NULL},
    {"schedule", (PyCFunction)mux_schedule, METH_NOARGS, NULL},
    {"drain_ring", (PyCFunction)mux_drain_ring, METH_O, NULL},
    {"remove", (PyCFunction)mux_remove, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods mux_seq = {.sq_length = (lenfunc)mux_len};

static PyMemberDef mux_members[] = {
    {"again", T_OBJECT, offsetof(ShmMux, again), 0, NULL},
    {"eof", T_OBJECT, offsetof(ShmMux, eof), 0, NULL},
    {"drains", T_ULONGLONG, offsetof(ShmMux, drains), READONLY, NULL},
    {"cut", T_ULONGLONG, offsetof(ShmMux, cut), READONLY, NULL},
    {"ring_drains", T_ULONGLONG, offsetof(ShmMux, ring_drains), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ShmMuxType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.ShmMux",
    .tp_basicsize = sizeof(ShmMux),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = mux_new,
    .tp_dealloc = (destructor)mux_dealloc,
    .tp_traverse = (traverseproc)mux_traverse,
    .tp_clear = (inquiry)mux_clear,
    .tp_methods = mux_methods,
    .tp_members = mux_members,
    .tp_as_sequence = &mux_seq,
};

/* shm_types(broken_error): (ShmRing, ShmWaker, ShmMux), or None off Linux. */
PyObject *shm_types(PyObject *self, PyObject *error) {
    static int ready = 0;
    if (!ready) {
        if (PyType_Ready(&ShmWakerType) < 0 || PyType_Ready(&ShmRingType) < 0 ||
            PyType_Ready(&ShmMuxType) < 0)
            return NULL;
        if ((S_queue_rest = PyUnicode_InternFromString("_queue_rest")) == NULL ||
            (S_get_buffer = PyUnicode_InternFromString("get_buffer")) == NULL ||
            (S_buffer_updated = PyUnicode_InternFromString("buffer_updated")) == NULL ||
            (S_on_room = PyUnicode_InternFromString("on_room")) == NULL ||
            (S_on_broken = PyUnicode_InternFromString("on_broken")) == NULL ||
            (S_write_broke = PyUnicode_InternFromString("_write_broke")) == NULL ||
            (MINUS_ONE = PyLong_FromLong(-1)) == NULL || (AGAIN = PyLong_FromLong(AGAIN_FD)) == NULL)
            return NULL;
        ready = 1;
    }
    Py_XSETREF(ShmBroken, Py_NewRef(error));
    return PyTuple_Pack(3, &ShmRingType, &ShmWakerType, &ShmMuxType);
}
#else
PyObject *shm_types(PyObject *self, PyObject *error) { Py_RETURN_NONE; }
#endif
