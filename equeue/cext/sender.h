/* The C Sender's state (sender.c), shared with the batch append of plain bodies
 * (batch.c), which writes through the same remembered chunk state. */
#ifndef EQUEUE_CEXT_SENDER_H
#define EQUEUE_CEXT_SENDER_H
#include "sendstate.h"

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
int sender_clock(Sender *s, long long *now_ns);

/* batch.c: Sender.append_bodies and Sender.plain_bodies */
PyObject *Sender_append_bodies(Sender *s, PyObject *const *args, Py_ssize_t nargs);
PyObject *Sender_plain_bodies(Sender *s, PyObject *items);

#endif
