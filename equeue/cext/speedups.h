/* What the C accelerator's files share (equeue/cext/): the record sizes Python hands
 * to configure(), byte access, the record checksum, the checked form of a send, and
 * the functions module.c lists. See module.c for what the accelerator is and how it
 * stays in step with the Python paths. */
#ifndef EQUEUE_CEXT_SPEEDUPS_H
#define EQUEUE_CEXT_SPEEDUPS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* From equeue.format via configure() (module.c). */
extern Py_ssize_t HEAD_SIZE;      /* MESSAGE_HEAD_SIZE */
extern Py_ssize_t FRAME_OVERHEAD; /* prefix + checksum + suffix */
extern Py_ssize_t QUEUE_RECORD;   /* QUEUE_RECORD_SIZE */
extern long MAX_NAME;             /* MAX_NAME_BYTES: topic, tag, key */
#define FLAG_HAS_KEY 1

extern PyObject *EMPTY_BYTES; /* b"" */
extern PyObject *ZERO;        /* 0 */

/* 0 with RuntimeError until configure() ran. */
int configured(void);

static inline void put_u32(char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put_i32(char *p, int32_t v) { memcpy(p, &v, 4); }
static inline void put_i64(char *p, int64_t v) { memcpy(p, &v, 8); }

/* A record frame's length and the first fields of its head (position, created and stored
 * time, queue offset, queue id): frame_raw's and append_bodies' frame_plain's start.
 * Returns the head. */
static inline char *put_record_start(char *p, Py_ssize_t length, int64_t position,
                                     int64_t now_ns, int64_t offset, int32_t q) {
    put_u32(p, (uint32_t)length);
    char *h = p + 4;
    put_i64(h + 0, position);
    put_i64(h + 8, now_ns);
    put_i64(h + 16, now_ns);
    put_i64(h + 24, offset);
    put_i32(h + 32, q);
    return h;
}
static inline uint32_t get_u32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline int32_t get_i32(const char *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline int64_t get_i64(const char *p) { int64_t v; memcpy(&v, p, 8); return v; }

/* checksum(): the record checksum, the low 32 bits of XXH3-64 with seed 0. */
#include "xxh3.h"

/* buf's bytes in view, with 0 <= start <= stop <= their length: 0, or -1 with an error
 * set and nothing held. */
static inline int get_range(PyObject *buf, Py_buffer *view, Py_ssize_t start,
                            Py_ssize_t stop) {
    if (PyObject_GetBuffer(buf, view, PyBUF_SIMPLE) < 0) return -1;
    if (start < 0 || start > stop || stop > view->len) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "range outside the buffer");
        return -1;
    }
    return 0;
}

/* A frame limit given as a Python int (max_frame_bytes) in *limit: 0, or -1 with
 * TypeError for a non-int. Past Py_ssize_t's range is no limit (PY_SSIZE_T_MAX: the
 * 4-byte length field still caps a frame), below 0 allows nothing (0); never an
 * OverflowError, which would reach the client's caller as a builtin. */
static inline int get_limit(PyObject *value, Py_ssize_t *limit) {
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    /* (a value past Py_ssize_t, as 2**32-1 is on a 32-bit build, is no limit too) */
    *limit = overflow > 0 || v > (long long)PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX
             : (overflow < 0 || v < 0)                     ? 0
                                                           : (Py_ssize_t)v;
    return 0;
}

/* The payload length of the frame at data + offset if it is whole before end, its
 * length is non-zero and at most max_length, and its suffix and checksum match (the
 * frame of format/chunk.py: length, payload, checksum, length); else 0. */
static inline uint32_t valid_frame(const char *data, Py_ssize_t offset, Py_ssize_t end,
                                   Py_ssize_t max_length) {
    if (offset + 4 + 1 + 8 > end) return 0;
    uint32_t n = get_u32(data + offset);
    if (n == 0 || (Py_ssize_t)n > max_length || offset + 12 + (Py_ssize_t)n > end) return 0;
    const char *payload = data + offset + 4;
    if (get_u32(payload + n + 4) != n || get_u32(payload + n) != checksum(payload, n)) return 0;
    return n;
}

/* "<8 hex digits of the store id><16 hex digits of the position>" */
static inline PyObject *message_id(PyObject *prefix, int64_t position) {
    static const char hex[] = "0123456789abcdef";
    Py_ssize_t plen = PyUnicode_GET_LENGTH(prefix);
    PyObject *id = PyUnicode_New(plen + 16, 127);
    if (id == NULL) return NULL;
    Py_UCS1 *out = PyUnicode_1BYTE_DATA(id);
    memcpy(out, PyUnicode_1BYTE_DATA(prefix), (size_t)plen);
    uint64_t v = (uint64_t)position;
    for (int i = 15; i >= 0; i--) {
        out[plen + i] = (Py_UCS1)hex[v & 15];
        v >>= 4;
    }
    return id;
}

/* An instance of a NamedTuple class, filled with the given (stolen) references. */
static inline PyObject *new_record(PyTypeObject *type, Py_ssize_t n, PyObject **items) {
    PyObject *obj = PyType_IsSubtype(type, &PyTuple_Type) ? type->tp_alloc(type, n) : NULL;
    if (obj == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "records are built as tuple subclasses");
    if (obj == NULL) {
        for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(items[i]);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i] == NULL) { /* a failed allocation among the fields */
            for (Py_ssize_t j = i + 1; j < n; j++) Py_XDECREF(items[j]);
            Py_DECREF(obj);
            return NULL;
        }
        PyTuple_SET_ITEM(obj, i, items[i]);
    }
    return obj;
}

/* One message's fields once checked: body, key, properties and queue id borrowed, and
 * tag_bytes, hashed_obj and key_bytes owned when filled by check_fields (release with
 * release_checked), borrowed when unpack_checked read them from a checked tuple. */
typedef struct {
    PyObject *body, *tag_bytes, *hashed_obj, *key_bytes, *key, *props, *code_obj, *queue_id;
    uint32_t hashed;
    long code;
    Py_ssize_t length; /* of the record, without the topic */
} Checked;

/* pick_queue's choice for a keyed message: xxh32 of the key (by the xxhash package,
 * as the Python path) modulo the queue count; -1 with an exception if the call fails. */
static inline Py_ssize_t queue_for_key(PyObject *xxh32, PyObject *key_bytes, Py_ssize_t count) {
    PyObject *h = PyObject_CallOneArg(xxh32, key_bytes);
    if (h == NULL) return -1;
    unsigned long long hv = PyLong_AsUnsignedLongLongMask(h);
    Py_DECREF(h);
    if (hv == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    return (Py_ssize_t)(hv % (unsigned long long)count);
}

/* write.c: checking a send and framing its record. */
void release_checked(Checked *c);
int check_fields(PyObject *body, PyObject *tag, PyObject *key, PyObject *props,
                 PyObject *code, PyObject *queue_id, PyObject *tag_check, Py_ssize_t max_body,
                 Py_ssize_t chunk_size, Py_ssize_t queue_count, Checked *out);
int unpack_checked(PyObject *c, Checked *out);
/* The checked 8-tuple validate.check_message returns, for the common valid case; NULL
 * with no exception set when the Python checks must decide. */
PyObject *checked_tuple(PyObject *body, PyObject *tag, PyObject *key, PyObject *props,
                        PyObject *code, PyObject *queue_id, PyObject *tag_check,
                        Py_ssize_t max_body, Py_ssize_t chunk_size, Py_ssize_t queue_count);
int frame_message(char *p, Py_ssize_t length, int64_t position, int64_t now_ns, int64_t offset,
                  int32_t q, int32_t code, uint32_t hashed, int has_key, PyObject *topic_bytes,
                  PyObject *tag_bytes, PyObject *key_bytes, PyObject *props, PyObject *body);
/* frame_message with the body as bytes at body (a request frame's, bodyspans.c) */
int frame_raw(char *p, Py_ssize_t length, int64_t position, int64_t now_ns, int64_t offset,
              int32_t q, int32_t code, uint32_t hashed, int has_key, PyObject *topic_bytes,
              PyObject *tag_bytes, PyObject *key_bytes, PyObject *props, const char *body,
              Py_ssize_t bl);

/* flusher.c: the broker's group-commit fdatasync thread */
extern PyTypeObject FlusherType;

/* sender.c */
extern PyTypeObject SenderType;
int intern_names(void);

/* message.c: the C Message (equeue.store.types.Message when the accelerator is loaded). */
extern PyTypeObject MessageType;
int message_type_ready(void);
/* A decoded message, untracked, of the given (stolen) fields; props NULL for none. NULL
 * with an exception (and the fields released) if any field is NULL or it fails. */
PyObject *lazy_message(PyObject *id_prefix, PyObject *topic, PyObject *tag, PyObject *key,
                       PyObject *props, PyObject *body, long long position, long long queue_id,
                       long long queue_offset, long long code, long long created_ns,
                       long long stored_ns);
/* A message's (C or tuple) topic (borrowed), queue id and queue offset: 0, or -1 with
 * an exception. */
int message_check_fields(PyObject *message, PyObject **topic, long long *queue_id,
                         long long *queue_offset);

/* The C Message's fields in order (equeue/store/types.py's Message._fields): message.c
 * keeps its slots and ints by these, pullcols.c reads them through message_slots. The
 * one list of them: a field added or moved here is so for both. */
enum {
    MSG_ID, MSG_TOPIC, MSG_QID, MSG_QOFF, MSG_POS, MSG_TAG, MSG_KEY, MSG_PROPS, MSG_CODE,
    MSG_BODY, MSG_CREATED, MSG_STORED, MSG_NFIELDS
};
/* A C Message's field slots and ints (message.c), copied into the caller's arrays of
 * MSG_NFIELDS: 1, or 0 for another object. */
int message_slots(PyObject *obj, PyObject *fields[MSG_NFIELDS], long long ints[MSG_NFIELDS],
                  PyObject **id_prefix);
/* pullcols.c: a pull's answer in columns (protocol version 3). */
PyObject *pack_pull_columns(PyObject *self, PyObject *args);
PyObject *unpack_pull_columns(PyObject *self, PyObject *args);

/* The module's functions (module.c lists them). */
PyObject *check_batch(PyObject *self, PyObject *args);
PyObject *write_run(PyObject *self, PyObject *args);
PyObject *decode_run(PyObject *self, PyObject *args);
PyObject *collect(PyObject *self, PyObject *args);
PyObject *pull_chunk(PyObject *self, PyObject *args);
PyObject *message_doc(PyObject *self, PyObject *doc);
/* batch.c: a batch of bodies' answer in columns, packed and read back */
PyObject *pack_columns(PyObject *self, PyObject *columns);
PyObject *send_frame(PyObject *self, PyObject *const *args, Py_ssize_t nargs);  /* sendframe.c: the plain send */
PyObject *send_body(PyObject *self, PyObject *body);
PyObject *send_answer(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *plain_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *frames_by_peer(PyObject *self, PyObject *const *args, Py_ssize_t nargs);  /* release.c */
PyObject *results_of_columns(PyObject *self, PyObject *args);
PyObject *all_bytes(PyObject *self, PyObject *items);
PyObject *columns_answer(PyObject *self, PyObject *args);
PyObject *pull_answer(PyObject *self, PyObject *args);
PyObject *bodies_request(PyObject *self, PyObject *args);
/* bodyspans.c: a send_bodies request's bodies where they lie in its frame (the broker) */
typedef struct {
    PyObject_HEAD
    PyObject *frame;  /* what holds the bytes: the frame body (bytes), or the read buffer */
    const char *base; /* where the offsets count from (in frame's bytes) */
    Py_ssize_t n;
    Py_ssize_t *at;   /* per body, its offset from base and its length */
} BodySpans;
extern PyTypeObject BodySpansType;
int body_spans_ready(void);
PyObject *bodies_body(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *bodies_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *answer_around(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *packed_answer(PyObject *self, PyObject *const *args, Py_ssize_t nargs); /* batch.c */

/* record.c: behaving as a NamedTuple of n fields, for Message and SendResult */
typedef struct {
    PyTypeObject *type;
    int n;
    PyObject *fields; /* _fields, made by record_type_ready */
    PyObject *(*as_tuple)(PyObject *self); /* the fields, made if not yet */
    PyObject *(*from_items)(PyObject *const *items); /* an instance of n (borrowed) values */
} RecordSpec;
PyObject *record_call(const RecordSpec *spec, PyObject *const *args, size_t nargsf,
                      PyObject *kwnames);
PyObject *record_slice(const RecordSpec *spec, PyObject *self, PyObject *key);
int record_contains(const RecordSpec *spec, PyObject *self, PyObject *value);
PyObject *record_iter(const RecordSpec *spec, PyObject *self);
PyObject *record_compare(const RecordSpec *spec, PyObject *a, PyObject *b, int op);
Py_hash_t record_hash(const RecordSpec *spec, PyObject *self);
PyObject *record_make(const RecordSpec *spec, PyObject *iterable);
PyObject *record_asdict(const RecordSpec *spec, PyObject *self);
PyObject *record_replace(const RecordSpec *spec, PyObject *self, PyObject *args,
                         PyObject *kwargs);
PyObject *record_reduce(const RecordSpec *spec, PyObject *self);
PyObject *record_tuple_method(const RecordSpec *spec, PyObject *self, const char *name,
                              PyObject *args);
int record_type_ready(RecordSpec *spec, const char *const *names);
PyObject *record_doc(const RecordSpec *spec, PyObject *doc);

/* sendresult.c: equeue.store.types.SendResult with the accelerator */
extern PyTypeObject SendResultType;
int send_result_type_ready(void);
/* A result of a send: the id, the ints and (stored_at NULL) the float made when read. */
PyObject *lazy_send_result(PyObject *id_prefix, PyObject *topic, long long queue_id,
                           long long queue_offset, long long position, long long stored_ns,
                           PyObject *stored_at);
PyObject *send_result_doc(PyObject *self, PyObject *doc);
PyObject *frame_offsets(PyObject *self, PyObject *args);
PyObject *record_columns(PyObject *self, PyObject *args);
PyObject *record_bodies(PyObject *self, PyObject *args);
PyObject *scan_frames(PyObject *self, PyObject *args);
PyObject *match_run(PyObject *self, PyObject *args);
PyObject *last_nonzero(PyObject *self, PyObject *args);
PyObject *prefault_request(PyObject *self, PyObject *args);
PyObject *prefault_forget(PyObject *self, PyObject *arg);
PyObject *prefault_supported(PyObject *self, PyObject *unused);
PyObject *prefault_pending(PyObject *self, PyObject *unused);

#endif
