/* The C Sender's state (sender.c), shared with the batch append of plain bodies
 * (batch.c), which writes through the same remembered chunk state. */
#ifndef EQUEUE_CEXT_SENDER_H
#define EQUEUE_CEXT_SENDER_H
#include "sendstate.h"

#include <time.h>

typedef struct {
    PyObject_HEAD
    PyObject *store;       /* MessageStore: _closed, _flush_error, _waiting, _wake() */
    PyObject *lock;        /* the write lock */
    PyObject *writer;      /* the log's ChunkWriter */
    PyObject *queues;      /* the store's dict: topic -> list[Queue] */
    PyObject *topic_bytes; /* the store's dict: topic -> its UTF-8 bytes */
    PyObject *round_robin; /* the store's dict: topic -> next turn */
    PyObject *keys;        /* KeyIndex: add(topic, key, position) */
    PyObject *id_prefix, *result_type, *tag_check, *xxh32;
    PyObject *clock; /* the time module: time_ns is looked up per send, as Python code does */
    PyObject *fallback; /* MessageStore.send (the function): what call() hands a send to */
    PyObject *time_ns; /* the time module's own time_ns (a builtin), or NULL */
    PyObject *acquire, *release, *owned; /* the lock's bound methods (owned: _is_owned) */
    int lock_in_place;                   /* rlock_mirrorable(lock) */
    Py_ssize_t data_offset, max_body, chunk_size;
    /* What the objects held after the last send (sendstate.h): borrowed, each checked
     * against its object's dict before use */
    StoreCache store_seen;
    ClockCache clock_seen;
    WriterCache log_seen;
    WriterCache queue_seen[WRITER_CACHE_SLOTS];
    QueueSlots queue_slots;
} Sender;

/* time.time_ns() as the Python path calls it: 0, or -1 with an exception. */
static inline int sender_clock(Sender *s, long long *now_ns) {
    PyObject *clock = clock_function(s->clock, &s->clock_seen);
    if (clock == NULL) return -1;
    if (s->time_ns != NULL && PyCFunction_Check(clock) &&
        PyCFunction_GET_FUNCTION(clock) == PyCFunction_GET_FUNCTION(s->time_ns)) {
        /* time.time_ns itself: what it would return, without the call */
        Py_DECREF(clock);
        struct timespec ts;
        if (clock_gettime(CLOCK_REALTIME, &ts) != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        *now_ns = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
        return 0;
    }
    /* replaced (a test's fixed clock): called, as Python code calls it */
    PyObject *now_obj = PyObject_CallNoArgs(clock);
    Py_DECREF(clock);
    if (now_obj == NULL) return -1;
    *now_ns = PyLong_AsLongLong(now_obj);
    Py_DECREF(now_obj);
    return *now_ns == -1 && PyErr_Occurred() ? -1 : 0;
}


/* batch.c: Sender.append_bodies and Sender.plain_bodies */
PyObject *Sender_append_bodies(Sender *s, PyObject *const *args, Py_ssize_t nargs);
PyObject *Sender_plain_bodies(Sender *s, PyObject *items);

#endif
