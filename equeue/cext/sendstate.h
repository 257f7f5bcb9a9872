/* What the C Sender remembers between sends (sendstate.c): the write state of the log
 * chunk, of each queue's chunk and of the store, as the Python objects held it after
 * the last send, so that a send reads none of it back through attribute lookups.
 *
 * The Python objects stay the truth: a send still writes every counter a reader looks
 * at (Chunk.data_end and record_count, Queue.next_offset) into them, as before. What
 * it no longer does is read them back (Queue keeps its fields in __slots__: those are
 * read and set in place, nothing remembered). A remembered value is used only while the
 * object's instance dict is the same dict at the same version (CPython bumps a dict's
 * version on every change of a value, whoever makes it: Python code, the Python path of
 * a send, a rollover, a close, an eviction) and its type is unchanged; otherwise the
 * send reads the attributes as before and remembers them again (a chunk's dict changed
 * by a flush or a read, not in the fields a send uses, is rechecked field by field
 * instead: chunk_recheck). Pointers here are
 * borrowed: each is dereferenced only once the dict that holds it was found unchanged,
 * starting from an object the send holds (the Sender's writer, the queue in the topic's
 * list), so a freed object is never touched. */
#ifndef EQUEUE_CEXT_SENDSTATE_H
#define EQUEUE_CEXT_SENDSTATE_H
#include "speedups.h"

/* An object's instance dict at one version. */
typedef struct {
    PyObject *dict; /* borrowed: compared, dereferenced only once found the object's */
    uint64_t version;
    PyTypeObject *type;
    unsigned int tp_version;
#ifdef EQUEUE_SENDSTATE_STATS
    PyObject *snap; /* the dict's keys and values when remembered (diagnosis only) */
#endif
} Seen;

/* A chunk open for writing, as one send uses it (new references, for the send). */
typedef struct {
    PyObject *chunk, *mm;
    Py_ssize_t end, size, count; /* data_end, writable_end, record_count */
    long long base, mark;        /* base (the log's only), _prefault_mark */
} ChunkView;

/* What a ChunkWriter (writer._chunk) and its chunk held after the last send. */
typedef struct {
    int valid;
    const void *owner; /* the writer this entry is for: an address, compared, never followed */
    Seen writer, chunk;
    PyObject *chunk_obj, *mm; /* borrowed, held by the two dicts above */
    PyObject *end_obj, *count_obj; /* the chunk dict's data_end and record_count ints */
    Py_ssize_t end, size, count;
    long long base, mark;
} WriterCache;

/* Queue writers, by address: an entry is looked for in WRITER_CACHE_PROBE slots from the
 * address's own, so that two writers whose addresses hash alike do not take turns in
 * one slot (each send to either re-read all its attributes: half the sends of a broker
 * with 4 queues, about 2,500 instructions each). Past that, a collision costs a re-read. */
#define WRITER_CACHE_SLOTS 128
#define WRITER_CACHE_PROBE 8

/* A slot (__slots__: Queue._writer, next_offset) of one type, read and set in place. */
typedef struct {
    PyTypeObject *type; /* NULL: not found (generic attribute access instead) */
    unsigned int tp_version;
    Py_ssize_t offset;
} SlotAt;

typedef struct {
    SlotAt writer, next_offset;
} QueueSlots;

/* The store's _closed, _flush_error (is it None) and _waiting, as truth values. */
typedef struct {
    int valid;
    Seen seen;
    int closed, failed, waiting;
} StoreCache;

/* The clock module's time_ns, and whether it is the builtin. */
typedef struct {
    int valid;
    Seen seen;
    PyObject *time_ns; /* borrowed, held by the module's dict */
} ClockCache;

int sendstate_names(void);

/* Generic attribute access through the instance dict when the type defines nothing of
 * that name (what PyObject_GetAttr would do, with less work per send). */
PyObject *get_attr(PyObject *obj, PyObject *name);
int set_attr(PyObject *obj, PyObject *name, PyObject *value);
Py_ssize_t ssize_attr(PyObject *obj, PyObject *name);

int store_state(PyObject *store, StoreCache *sc);
/* The clock function (new reference), or NULL with an exception. */
PyObject *clock_function(PyObject *clock, ClockCache *cc);

/* writer._chunk and its state: 1 (view filled, references held), 0 (no chunk open for
 * writing: the Python path), -1 with an exception. want_base: read Chunk.base too. */
int writer_view(PyObject *writer, WriterCache *wc, int want_base, ChunkView *out);
void view_clear(ChunkView *v);
/* Views read through attribute lookups, not remembered ones, by this process: the log's
 * and the queues' (Sender.rereads, for tests that a state stays remembered). */
extern Py_ssize_t sendstate_rereads[2];
/* Chunk.publish(end, 1) of v's chunk, remembered in wc; 0, or -1 with an exception. */
int view_publish(WriterCache *wc, ChunkView *v, Py_ssize_t end);
/* Chunk.publish(end, n) */
int view_publish_n(WriterCache *wc, ChunkView *v, Py_ssize_t end, Py_ssize_t n);

WriterCache *writer_cache(WriterCache *table, PyObject *writer);
/* queue._writer (new reference; None: the Python path) and queue.next_offset: 0, or -1
 * with an exception. */
int queue_state(QueueSlots *qs, PyObject *queue, PyObject **writer, Py_ssize_t *next_offset);
int queue_advance(QueueSlots *qs, PyObject *queue, Py_ssize_t next_offset);

/* The write lock, when rlock_mirrorable(lock): held by this thread (rlock_owned), taken
 * if free (rlock_try: 1, else 0 and nothing done), released (rlock_release: 0 when this
 * thread does not hold it: the release() method raises the error). */
int rlock_mirrorable(PyObject *lock);
int rlock_owned(PyObject *lock);
int rlock_try(PyObject *lock);
int rlock_release(PyObject *lock);

/* A dict's version (0 where versions are not used: never equal to assume unchanged). */
uint64_t dict_state(PyObject *dict);

#endif
