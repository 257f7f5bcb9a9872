/* The store's hot loops in C: checking a batch of sends, framing message records
 * into the log chunk's mapping, and decoding a run of records for a pull.
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
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* From equeue.format via configure(). */
static Py_ssize_t HEAD_SIZE = -1;      /* MESSAGE_HEAD_SIZE */
static Py_ssize_t FRAME_OVERHEAD = -1; /* prefix + checksum + suffix */
static Py_ssize_t QUEUE_RECORD = -1;   /* QUEUE_RECORD_SIZE */
static long MAX_NAME = -1;             /* MAX_NAME_BYTES: topic, tag, key */
#define FLAG_HAS_KEY 1

static PyObject *EMPTY_BYTES; /* b"" */
static PyObject *ZERO;        /* 0 */

static inline void put_u32(char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put_i32(char *p, int32_t v) { memcpy(p, &v, 4); }
static inline void put_i64(char *p, int64_t v) { memcpy(p, &v, 8); }
static inline uint32_t get_u32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline int32_t get_i32(const char *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline int64_t get_i64(const char *p) { int64_t v; memcpy(&v, p, 8); return v; }

static int configured(void) {
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

/* --- XXH3-64 with seed 0 --------------------------------------------------------
 *
 * The record checksum is the low 32 bits of XXH3_64bits(payload) (format/chunk.py),
 * which Python computes with the xxhash package. This is the same function written
 * out from its specification (the XXH3 algorithm and its default 192-byte secret),
 * seed 0 only; tests/test_speedups.py checks it against the package for every
 * length up to 2 KiB and random contents. */

static const uint8_t SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
#define P32_1 0x9E3779B1u
#define P32_2 0x85EBCA77u
#define P32_3 0xC2B2AE3Du
#define P64_1 0x9E3779B185EBCA87ull
#define P64_2 0xC2B2AE3D27D4EB4Full
#define P64_3 0x165667B19E3779F9ull
#define P64_4 0x85EBCA77C2B2AE63ull
#define P64_5 0x27D4EB2F165667C5ull
#define MX1 0x165667919E3779F9ull
#define MX2 0x9FB21C651E98DF25ull

static inline uint64_t r64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t r32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t fold_mul(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static inline uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    return h ^ (h >> 32);
}

static inline uint64_t xxh3_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= MX1;
    return h ^ (h >> 32);
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *secret) {
    return fold_mul(r64(in) ^ r64(secret), r64(in + 8) ^ r64(secret + 8));
}

static uint64_t xxh3_short(const uint8_t *in, size_t len) { /* 0..16 bytes */
    if (len > 8) {
        uint64_t lo = (r64(SECRET + 24) ^ r64(SECRET + 32)) ^ r64(in);
        uint64_t hi = (r64(SECRET + 40) ^ r64(SECRET + 48)) ^ r64(in + len - 8);
        return xxh3_avalanche(len + __builtin_bswap64(lo) + hi + fold_mul(lo, hi));
    }
    if (len >= 4) {
        uint64_t both = (uint64_t)r32(in + len - 4) | ((uint64_t)r32(in) << 32);
        uint64_t acc = (r64(SECRET + 8) ^ r64(SECRET + 16)) ^ both;
        acc ^= rotl(acc, 49) ^ rotl(acc, 24);
        acc *= MX2;
        acc ^= (acc >> 35) + len;
        acc *= MX2;
        return acc ^ (acc >> 28);
    }
    if (len > 0) {
        uint32_t combined = ((uint32_t)in[0] << 16) | ((uint32_t)in[len >> 1] << 24) |
                            (uint32_t)in[len - 1] | ((uint32_t)len << 8);
        return xxh64_avalanche((uint64_t)combined ^ (uint64_t)(r32(SECRET) ^ r32(SECRET + 4)));
    }
    return xxh64_avalanche(r64(SECRET + 56) ^ r64(SECRET + 64));
}

static uint64_t xxh3_long(const uint8_t *in, size_t len) { /* more than 240 bytes */
    const size_t stripes_per_block = (sizeof SECRET - 64) / 8, block = 64 * stripes_per_block;
    uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    size_t blocks = (len - 1) / block;
    for (size_t b = 0; b <= blocks; b++) {
        const uint8_t *base = in + b * block;
        size_t stripes = b < blocks ? stripes_per_block : (len - 1 - block * blocks) / 64;
        for (size_t s = 0; s < stripes; s++) {
            const uint8_t *stripe = base + 64 * s, *key = SECRET + 8 * s;
            for (int i = 0; i < 8; i++) {
                uint64_t value = r64(stripe + 8 * i), keyed = value ^ r64(key + 8 * i);
                acc[i ^ 1] += value;
                acc[i] += (uint64_t)(uint32_t)keyed * (keyed >> 32);
            }
        }
        if (b < blocks) /* scramble after each full block */
            for (int i = 0; i < 8; i++) {
                acc[i] ^= acc[i] >> 47;
                acc[i] ^= r64(SECRET + sizeof SECRET - 64 + 8 * i);
                acc[i] *= P32_1;
            }
    }
    const uint8_t *last = in + len - 64, *key = SECRET + sizeof SECRET - 64 - 7;
    for (int i = 0; i < 8; i++) {
        uint64_t value = r64(last + 8 * i), keyed = value ^ r64(key + 8 * i);
        acc[i ^ 1] += value;
        acc[i] += (uint64_t)(uint32_t)keyed * (keyed >> 32);
    }
    uint64_t result = (uint64_t)len * P64_1;
    for (int i = 0; i < 4; i++)
        result += fold_mul(acc[2 * i] ^ r64(SECRET + 11 + 16 * i),
                           acc[2 * i + 1] ^ r64(SECRET + 11 + 16 * i + 8));
    return xxh3_avalanche(result);
}

static uint64_t xxh3_64(const uint8_t *in, size_t len) {
    if (len <= 16) return xxh3_short(in, len);
    if (len <= 128) {
        uint64_t acc = len * P64_1, end = 0;
        size_t rounds = (len - 1) / 32; /* pairs of 16-byte mixes from each end, 0..3 more */
        for (size_t i = 0; i <= rounds; i++) {
            acc += mix16(in + 16 * i, SECRET + 32 * i);
            end += mix16(in + len - 16 * (i + 1), SECRET + 32 * i + 16);
        }
        return xxh3_avalanche(acc + end);
    }
    if (len <= 240) {
        uint64_t acc = len * P64_1;
        for (size_t i = 0; i < 8; i++) acc += mix16(in + 16 * i, SECRET + 16 * i);
        acc = xxh3_avalanche(acc);
        for (size_t i = 8; i < len / 16; i++) acc += mix16(in + 16 * i, SECRET + 16 * (i - 8) + 3);
        acc += mix16(in + len - 16, SECRET + 136 - 17);
        return xxh3_avalanche(acc);
    }
    return xxh3_long(in, len);
}

/* The record checksum of format/chunk.py: the low 32 bits of xxh3_64(payload). */
static inline uint32_t checksum(const char *data, Py_ssize_t n) {
    return (uint32_t)xxh3_64((const uint8_t *)data, (size_t)n);
}

/* xxh3_64(data) -> int, for the tests that hold it to the xxhash package. */
static PyObject *py_xxh3_64(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t h = xxh3_64((const uint8_t *)view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

/* "<8 hex digits of the store id><16 hex digits of the position>" */
static PyObject *message_id(PyObject *prefix, int64_t position) {
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
static PyObject *new_record(PyTypeObject *type, Py_ssize_t n, PyObject **items) {
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

/* --- check_batch ---------------------------------------------------------------- */

/* The checked form of one OutgoingMessage, or NULL with no exception set when the
 * message needs the Python checks (which then raise or handle it). */
static PyObject *check_fast(PyObject *msg, PyObject *tag_check, Py_ssize_t max_body,
                            Py_ssize_t chunk_size, Py_ssize_t queue_count) {
    PyObject *body = PyTuple_GET_ITEM(msg, 0), *tag = PyTuple_GET_ITEM(msg, 1);
    PyObject *key = PyTuple_GET_ITEM(msg, 2), *props = PyTuple_GET_ITEM(msg, 3);
    PyObject *code = PyTuple_GET_ITEM(msg, 4), *queue_id = PyTuple_GET_ITEM(msg, 5);
    if (!PyBytes_CheckExact(body) || PyBytes_GET_SIZE(body) > max_body) return NULL;
    if (!PyUnicode_CheckExact(tag) || props != Py_None || !PyLong_CheckExact(code)) return NULL;
    int overflow = 0;
    long long code_value = PyLong_AsLongLongAndOverflow(code, &overflow);
    if (overflow || code_value < INT32_MIN || code_value > INT32_MAX) return NULL;
    if (queue_id != Py_None) {
        if (!PyLong_CheckExact(queue_id)) return NULL;
        long long q = PyLong_AsLongLongAndOverflow(queue_id, &overflow);
        if (overflow || q < 0 || q >= queue_count) return NULL;
    }
    PyObject *tag_bytes, *hashed;
    if (PyUnicode_GET_LENGTH(tag) == 0) {
        tag_bytes = Py_NewRef(EMPTY_BYTES);
        hashed = Py_NewRef(ZERO);
    } else { /* validate.check_tag: cached, and it raises the precise error */
        PyObject *pair = PyObject_CallOneArg(tag_check, tag);
        if (pair == NULL) return NULL;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            Py_DECREF(pair);
            PyErr_SetString(PyExc_TypeError, "check_tag must return (bytes, int)");
            return NULL;
        }
        tag_bytes = Py_NewRef(PyTuple_GET_ITEM(pair, 0));
        hashed = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
        Py_DECREF(pair);
    }
    PyObject *key_bytes;
    if (key == Py_None) {
        key_bytes = Py_NewRef(EMPTY_BYTES);
    } else if (PyUnicode_CheckExact(key)) {
        Py_ssize_t klen;
        const char *k = PyUnicode_AsUTF8AndSize(key, &klen);
        if (k == NULL || klen > MAX_NAME) { /* not UTF-8 encodable, or too long */
            PyErr_Clear();
            Py_DECREF(tag_bytes);
            Py_DECREF(hashed);
            return NULL;
        }
        key_bytes = PyBytes_FromStringAndSize(k, klen);
    } else {
        Py_DECREF(tag_bytes);
        Py_DECREF(hashed);
        return NULL;
    }
    if (key_bytes == NULL) {
        Py_DECREF(tag_bytes);
        Py_DECREF(hashed);
        return NULL;
    }
    /* As StoreMessage._check: the head, the strings and 255 bytes of topic at most. */
    Py_ssize_t size = HEAD_SIZE + PyBytes_GET_SIZE(tag_bytes) + PyBytes_GET_SIZE(key_bytes) +
                      PyBytes_GET_SIZE(body) + 255;
    if (size + FRAME_OVERHEAD > chunk_size) {
        Py_DECREF(tag_bytes);
        Py_DECREF(hashed);
        Py_DECREF(key_bytes);
        return NULL;
    }
    PyObject *items[8] = {Py_NewRef(body), tag_bytes, hashed, key_bytes, Py_NewRef(key),
                          Py_NewRef(EMPTY_BYTES), Py_NewRef(code), Py_NewRef(queue_id)};
    return new_record(&PyTuple_Type, 8, items);
}

/* check_batch(items, outgoing_type, slow, tag_check, max_body, chunk_size, queue_count)
 * -> list of checked tuples. An item that is neither bytes nor a plain OutgoingMessage
 * of the common kind goes through slow(item), which checks it in Python. */
static PyObject *check_batch(PyObject *self, PyObject *args) {
    PyObject *items, *outgoing_type, *slow, *tag_check;
    Py_ssize_t max_body, chunk_size, queue_count;
    if (!PyArg_ParseTuple(args, "O!OOOnnn", &PyList_Type, &items, &outgoing_type, &slow,
                          &tag_check, &max_body, &chunk_size, &queue_count))
        return NULL;
    if (!configured()) return NULL;
    /* slow() and tag_check() run Python code, which may change the list: its length is
     * read at every step, each item is held while in use, and the result list is built
     * by appending, so it never holds an empty slot. */
    PyObject *result = PyList_New(0);
    if (result == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *item = Py_NewRef(PyList_GET_ITEM(items, i)), *checked = NULL;
        if (PyBytes_CheckExact(item) && PyBytes_GET_SIZE(item) <= max_body &&
            HEAD_SIZE + PyBytes_GET_SIZE(item) + 255 + FRAME_OVERHEAD <= chunk_size) {
            PyObject *fields[8] = {Py_NewRef(item),        Py_NewRef(EMPTY_BYTES),
                                   Py_NewRef(ZERO),        Py_NewRef(EMPTY_BYTES),
                                   Py_NewRef(Py_None),     Py_NewRef(EMPTY_BYTES),
                                   Py_NewRef(ZERO),        Py_NewRef(Py_None)};
            checked = new_record(&PyTuple_Type, 8, fields);
        } else if ((PyObject *)Py_TYPE(item) == outgoing_type && PyTuple_GET_SIZE(item) == 6) {
            checked = check_fast(item, tag_check, max_body, chunk_size, queue_count);
        }
        if (checked == NULL && !PyErr_Occurred()) checked = PyObject_CallOneArg(slow, item);
        Py_DECREF(item);
        if (checked == NULL) goto fail;
        int appended = PyList_Append(result, checked);
        Py_DECREF(checked);
        if (appended < 0) goto fail;
    }
    return result;
fail:
    Py_DECREF(result);
    return NULL;
}

/* check_one((body, tag, key, properties, code, queue_id), tag_check, max_body, chunk_size,
 *           queue_count) -> checked tuple, or None when the Python checks must decide. */
static PyObject *check_one(PyObject *self, PyObject *args) {
    PyObject *fields, *tag_check;
    Py_ssize_t max_body, chunk_size, queue_count;
    if (!PyArg_ParseTuple(args, "O!Onnn", &PyTuple_Type, &fields, &tag_check, &max_body,
                          &chunk_size, &queue_count))
        return NULL;
    if (!configured()) return NULL;
    if (PyTuple_GET_SIZE(fields) != 6) {
        PyErr_SetString(PyExc_TypeError, "check_one takes the six fields of a send");
        return NULL;
    }
    PyObject *checked = check_fast(fields, tag_check, max_body, chunk_size, queue_count);
    if (checked == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return checked;
}

/* Writes the frame of one message record at p: length, the 56-byte head, topic, tag,
 * key, properties, body, checksum, length again (equeue.format.message/chunk). */
static int frame_message(char *p, Py_ssize_t length, int64_t position, int64_t now_ns,
                         int64_t offset, int32_t q, int32_t code, uint32_t hashed, int has_key,
                         PyObject *topic_bytes, PyObject *tag_bytes, PyObject *key_bytes,
                         PyObject *props, PyObject *body) {
    Py_ssize_t topic_len = PyBytes_GET_SIZE(topic_bytes), tl = PyBytes_GET_SIZE(tag_bytes);
    Py_ssize_t kl = PyBytes_GET_SIZE(key_bytes), pl = PyBytes_GET_SIZE(props);
    Py_ssize_t bl = PyBytes_GET_SIZE(body);
    put_u32(p, (uint32_t)length);
    char *h = p + 4;
    put_i64(h + 0, position);
    put_i64(h + 8, now_ns);
    put_i64(h + 16, now_ns);
    put_i64(h + 24, offset);
    put_i32(h + 32, q);
    put_i32(h + 36, code);
    put_u32(h + 40, hashed);
    h[44] = (char)(has_key ? FLAG_HAS_KEY : 0);
    h[45] = (char)topic_len;
    h[46] = (char)tl;
    h[47] = (char)kl;
    put_u32(h + 48, (uint32_t)pl);
    put_u32(h + 52, (uint32_t)bl);
    char *w = h + HEAD_SIZE;
    memcpy(w, PyBytes_AS_STRING(topic_bytes), (size_t)topic_len);
    w += topic_len;
    memcpy(w, PyBytes_AS_STRING(tag_bytes), (size_t)tl);
    w += tl;
    memcpy(w, PyBytes_AS_STRING(key_bytes), (size_t)kl);
    w += kl;
    memcpy(w, PyBytes_AS_STRING(props), (size_t)pl);
    w += pl;
    memcpy(w, PyBytes_AS_STRING(body), (size_t)bl);
    w += bl;
    put_u32(w, checksum(h, length));
    put_u32(w + 4, (uint32_t)length);
    return 0;
}

/* The fields of a checked 8-tuple (borrowed), or -1 with TypeError. */
typedef struct {
    PyObject *body, *tag_bytes, *key_bytes, *key, *props, *queue_id;
    uint32_t hashed;
    long code;
    Py_ssize_t length; /* of the record, without the topic */
} Checked;

static int unpack_checked(PyObject *c, Checked *out) {
    if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) != 8) {
        PyErr_SetString(PyExc_TypeError, "checked messages are 8-tuples");
        return -1;
    }
    out->body = PyTuple_GET_ITEM(c, 0);
    out->tag_bytes = PyTuple_GET_ITEM(c, 1);
    out->key_bytes = PyTuple_GET_ITEM(c, 3);
    out->key = PyTuple_GET_ITEM(c, 4);
    out->props = PyTuple_GET_ITEM(c, 5);
    out->queue_id = PyTuple_GET_ITEM(c, 7);
    if (!PyBytes_Check(out->body) || !PyBytes_Check(out->tag_bytes) ||
        !PyBytes_Check(out->key_bytes) || !PyBytes_Check(out->props)) {
        PyErr_SetString(PyExc_TypeError, "checked messages carry bytes");
        return -1;
    }
    out->hashed = (uint32_t)PyLong_AsUnsignedLongMask(PyTuple_GET_ITEM(c, 2));
    out->code = PyLong_AsLong(PyTuple_GET_ITEM(c, 6));
    if (PyErr_Occurred()) return -1;
    out->length = HEAD_SIZE + PyBytes_GET_SIZE(out->tag_bytes) +
                  PyBytes_GET_SIZE(out->key_bytes) + PyBytes_GET_SIZE(out->props) +
                  PyBytes_GET_SIZE(out->body);
    return 0;
}

/* write_one(mm, data_offset, start, room, base, now_ns, topic, topic_bytes, checked,
 *           queue_id, queue_offset, queue_map, queue_end, queue_size, id_prefix,
 *           result_type, stored_at) -> (SendResult, end) or None
 *
 * A single send whose queue the caller picked: its frame at data offset start, then
 * its queue entry at queue_end. None (nothing written) if either does not fit. */
static PyObject *write_one(PyObject *self, PyObject *args) {
    PyObject *mm, *topic, *topic_bytes, *checked, *qmap, *id_prefix, *result_type, *stored_at;
    Py_ssize_t data_offset, start, room, q, qend, qsize;
    long long base, now_ns, offset;
    if (!PyArg_ParseTuple(args, "OnnnLLOO!OnLOnnUO!O!", &mm, &data_offset, &start, &room,
                          &base, &now_ns, &topic, &PyBytes_Type, &topic_bytes, &checked, &q,
                          &offset, &qmap, &qend, &qsize, &id_prefix, &PyType_Type,
                          &result_type, &PyFloat_Type, &stored_at))
        return NULL;
    if (!configured()) return NULL;
    if (!PyUnicode_IS_COMPACT_ASCII(id_prefix)) {
        PyErr_SetString(PyExc_ValueError, "id_prefix must be ASCII");
        return NULL;
    }
    if (data_offset < 0 || start < 0 || room < 0 || base < 0 || q < 0 || qend < 0 || qsize < 0) {
        PyErr_SetString(PyExc_ValueError, "write_one: negative offset or queue id");
        return NULL;
    }
    Checked c;
    if (unpack_checked(checked, &c) < 0) return NULL;
    Py_ssize_t length = c.length + PyBytes_GET_SIZE(topic_bytes);
    if (start + length + FRAME_OVERHEAD > room || qend + QUEUE_RECORD > qsize) Py_RETURN_NONE;
    Py_buffer log, qbuf;
    if (PyObject_GetBuffer(mm, &log, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(qmap, &qbuf, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&log);
        return NULL;
    }
    PyObject *out = NULL;
    int64_t position = base + start;
    if (data_offset + room > log.len || data_offset + qsize > qbuf.len) {
        PyErr_SetString(PyExc_ValueError, "a data area lies outside its mapping");
    } else if (frame_message((char *)log.buf + data_offset + start, length, position, now_ns,
                             offset, (int32_t)q, (int32_t)c.code, c.hashed, c.key != Py_None,
                             topic_bytes, c.tag_bytes, c.key_bytes, c.props, c.body) == 0) {
        PyObject *fields[6] = {message_id(id_prefix, position), Py_NewRef(topic),
                               PyLong_FromSsize_t(q), PyLong_FromLongLong(offset),
                               PyLong_FromLongLong(position), Py_NewRef(stored_at)};
        PyObject *result = new_record((PyTypeObject *)result_type, 6, fields);
        if (result != NULL) out = Py_BuildValue("(Nn)", result, start + length + FRAME_OVERHEAD);
        if (out != NULL) { /* the entry last, after its frame, once nothing can fail */
            char *slot = (char *)qbuf.buf + data_offset + qend;
            put_i64(slot, position + 1);
            put_u32(slot + 8, c.hashed);
        }
    }
    PyBuffer_Release(&qbuf);
    PyBuffer_Release(&log);
    return out;
}

/* --- write_run ------------------------------------------------------------------ */

typedef struct {
    int q;
    int64_t position;
    uint32_t hashed;
} Entry;

/* write_run(mm, data_offset, start, room, base, now_ns, topic, topic_bytes, checked, i,
 *           turn, queue_maps, queue_ends, queue_sizes, next_offsets, id_prefix,
 *           result_type, stored_at, xxh32, results)
 * -> (i, end, turn, taken, keyed)
 *
 * Frames the run of checked messages from checked[i] that fit the log chunk (data
 * offsets start..room) and their queues' current chunks, appending a SendResult per
 * message to results; then writes their queue entries, after every frame. Nothing is
 * published: the caller raises data_end of each chunk it wrote. taken[q] is the
 * number of entries written to queue q, keyed the (key, position) of keyed messages.
 * queue_maps[q] is None when queue q has no chunk (it then takes nothing). */
static PyObject *write_run(PyObject *self, PyObject *args) {
    PyObject *mm, *topic, *topic_bytes, *checked, *queue_maps, *queue_ends, *queue_sizes;
    PyObject *next_offsets, *id_prefix, *result_type, *stored_at, *xxh32, *results;
    Py_ssize_t data_offset, start, room, i, turn;
    long long base, now_ns;
    if (!PyArg_ParseTuple(args, "OnnnLLOO!O!nnO!O!O!O!UO!O!OO!", &mm, &data_offset, &start,
                          &room, &base, &now_ns, &topic, &PyBytes_Type, &topic_bytes,
                          &PyList_Type, &checked, &i, &turn, &PyList_Type, &queue_maps,
                          &PyList_Type, &queue_ends, &PyList_Type, &queue_sizes, &PyList_Type,
                          &next_offsets, &id_prefix, &PyType_Type, &result_type, &PyFloat_Type,
                          &stored_at, &xxh32, &PyList_Type, &results))
        return NULL;
    if (!configured()) return NULL;
    if (!PyUnicode_IS_COMPACT_ASCII(id_prefix)) {
        PyErr_SetString(PyExc_ValueError, "id_prefix must be ASCII");
        return NULL;
    }
    if (data_offset < 0 || start < 0 || room < 0 || base < 0 || i < 0 || turn < 0) {
        PyErr_SetString(PyExc_ValueError, "write_run: negative offset, index or turn");
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(queue_maps);
    if (count < 1 || PyList_GET_SIZE(queue_ends) != count ||
        PyList_GET_SIZE(queue_sizes) != count || PyList_GET_SIZE(next_offsets) != count) {
        PyErr_SetString(PyExc_ValueError, "one map, end, size and next offset per queue");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(checked);
    Py_ssize_t first = i, end = start;
    Py_buffer log = {0};
    Py_buffer *qbufs = NULL;
    Py_ssize_t *free_slots = NULL, *taken = NULL, *qend = NULL;
    int64_t *qnext = NULL;
    Entry *entries = NULL;
    PyObject *keyed = NULL, *out = NULL;
    int ok = 0;

    if (PyObject_GetBuffer(mm, &log, PyBUF_WRITABLE) < 0) return NULL;
    if (data_offset + room > log.len || start > room) {
        PyErr_SetString(PyExc_ValueError, "the data area lies outside the mapping");
        goto done;
    }
    qbufs = PyMem_Calloc((size_t)count, sizeof(Py_buffer));
    free_slots = PyMem_Calloc((size_t)count, sizeof(Py_ssize_t));
    taken = PyMem_Calloc((size_t)count, sizeof(Py_ssize_t));
    qend = PyMem_Calloc((size_t)count, sizeof(Py_ssize_t));
    qnext = PyMem_Calloc((size_t)count, sizeof(int64_t));
    entries = PyMem_Calloc((size_t)(n - i > 0 ? n - i : 1), sizeof(Entry));
    keyed = PyList_New(0);
    if (!qbufs || !free_slots || !taken || !qend || !qnext || !entries || !keyed) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t q = 0; q < count; q++) {
        PyObject *qmap = PyList_GET_ITEM(queue_maps, q);
        qnext[q] = PyLong_AsLongLong(PyList_GET_ITEM(next_offsets, q));
        if (qnext[q] == -1 && PyErr_Occurred()) goto done;
        if (qmap == Py_None) continue;
        if (PyObject_GetBuffer(qmap, &qbufs[q], PyBUF_WRITABLE) < 0) goto done;
        qend[q] = PyLong_AsSsize_t(PyList_GET_ITEM(queue_ends, q));
        Py_ssize_t size = PyLong_AsSsize_t(PyList_GET_ITEM(queue_sizes, q));
        if (PyErr_Occurred()) goto done;
        if (size < 0 || qend[q] < 0 || data_offset + size > qbufs[q].len || qend[q] > size) {
            PyErr_SetString(PyExc_ValueError, "a queue chunk's data area lies outside its mapping");
            goto done;
        }
        free_slots[q] = (size - qend[q]) / QUEUE_RECORD;
    }

    Py_ssize_t topic_len = PyBytes_GET_SIZE(topic_bytes);
    char *data = (char *)log.buf + data_offset;
    Py_ssize_t done_count = 0;
    for (; i < n; i++) {
        Checked c;
        if (unpack_checked(PyList_GET_ITEM(checked, i), &c) < 0) goto done;
        PyObject *body = c.body, *tag_bytes = c.tag_bytes, *key_bytes = c.key_bytes;
        PyObject *key = c.key, *props = c.props, *queue_id = c.queue_id;
        uint32_t hashed = c.hashed;
        long code = c.code;
        Py_ssize_t length = c.length + topic_len;
        if (end + length + FRAME_OVERHEAD > room) break;

        Py_ssize_t q;
        int by_turn = 0;
        if (queue_id != Py_None) {
            q = PyLong_AsSsize_t(queue_id);
            if (q == -1 && PyErr_Occurred()) goto done;
            if (q < 0 || q >= count) {
                PyErr_SetString(PyExc_ValueError, "queue id out of range");
                goto done;
            }
        } else if (key != Py_None) { /* pick_queue: xxh32 of the key, by the xxhash package */
            PyObject *h = PyObject_CallOneArg(xxh32, key_bytes);
            if (h == NULL) goto done;
            unsigned long long hv = PyLong_AsUnsignedLongLongMask(h);
            Py_DECREF(h);
            if (PyErr_Occurred()) goto done;
            q = (Py_ssize_t)(hv % (unsigned long long)count);
        } else {
            q = turn % count;
            by_turn = 1;
        }
        if (taken[q] >= free_slots[q]) break; /* append() creates the queue's next chunk */
        if (by_turn) turn = q + 1;
        int64_t offset = qnext[q] + taken[q];
        int64_t position = base + end;

        if (frame_message(data + end, length, position, now_ns, offset, (int32_t)q,
                          (int32_t)code, hashed, key != Py_None, topic_bytes, tag_bytes,
                          key_bytes, props, body) < 0)
            goto done;

        entries[done_count].q = (int)q;
        entries[done_count].position = position;
        entries[done_count].hashed = hashed;
        done_count++;
        taken[q]++;
        end += length + FRAME_OVERHEAD;

        if (key != Py_None) {
            PyObject *pair = Py_BuildValue("(OL)", key, (long long)position);
            if (pair == NULL || PyList_Append(keyed, pair) < 0) {
                Py_XDECREF(pair);
                goto done;
            }
            Py_DECREF(pair);
        }
        PyObject *fields[6] = {message_id(id_prefix, position), Py_NewRef(topic),
                               PyLong_FromSsize_t(q), PyLong_FromLongLong(offset),
                               PyLong_FromLongLong(position), Py_NewRef(stored_at)};
        PyObject *result = new_record((PyTypeObject *)result_type, 6, fields);
        if (result == NULL || PyList_Append(results, result) < 0) {
            Py_XDECREF(result);
            goto done;
        }
        Py_DECREF(result);
    }
    {
        PyObject *taken_list = PyList_New(count);
        if (taken_list == NULL) goto done;
        for (Py_ssize_t q = 0; q < count; q++) {
            PyObject *v = PyLong_FromSsize_t(taken[q]);
            if (v == NULL) {
                Py_DECREF(taken_list);
                goto done;
            }
            PyList_SET_ITEM(taken_list, q, v);
        }
        out = Py_BuildValue("(nnnNO)", i, end, turn, taken_list, keyed);
        if (out == NULL) goto done;
    }
    /* Queue entries last, after every frame they point to, and once nothing can fail:
     * a failure above leaves no non-zero slot behind for recovery to count. */
    for (Py_ssize_t k = 0; k < done_count; k++) {
        Entry *e = &entries[k];
        char *slot = (char *)qbufs[e->q].buf + data_offset + qend[e->q];
        put_i64(slot, e->position + 1);
        put_u32(slot + 8, e->hashed);
        qend[e->q] += QUEUE_RECORD;
    }
    ok = 1;
done:
    (void)first;
    if (qbufs != NULL)
        for (Py_ssize_t q = 0; q < count; q++)
            if (qbufs[q].obj != NULL) PyBuffer_Release(&qbufs[q]);
    PyBuffer_Release(&log);
    PyMem_Free(qbufs);
    PyMem_Free(free_slots);
    PyMem_Free(taken);
    PyMem_Free(qend);
    PyMem_Free(qnext);
    PyMem_Free(entries);
    Py_XDECREF(keyed);
    if (!ok) {
        Py_XDECREF(out);
        return NULL;
    }
    return out;
}

/* --- decode_run ----------------------------------------------------------------- */

/* A str for bytes that often repeat (topics, tags): the last one is reused. */
typedef struct {
    PyObject *str;
    const char *bytes;
    Py_ssize_t len;
} Last;

static PyObject *decode_cached(Last *last, const char *s, Py_ssize_t len) {
    if (last->str != NULL && last->len == len && memcmp(last->bytes, s, (size_t)len) == 0)
        return Py_NewRef(last->str);
    PyObject *str = PyUnicode_DecodeUTF8(s, len, "strict");
    if (str == NULL) return NULL;
    Py_XSETREF(last->str, Py_NewRef(str));
    last->bytes = s;
    last->len = len;
    return str;
}

/* decode_run(mm, data_offset, data_end, base, positions, message_type, id_prefix,
 *            decode_properties) -> list of (Message, stored tag hash) or None
 *
 * For each position of a chunk that is not compacted: the frame at that data offset
 * checked (length, suffix, checksum, the head's own position) and decoded. None where
 * anything is off; the caller reads that one again the slow way, which raises the
 * precise error. */
static PyObject *decode_run(PyObject *self, PyObject *args) {
    PyObject *mm, *positions, *message_type, *id_prefix, *decode_props;
    Py_ssize_t data_offset, data_end;
    long long base;
    if (!PyArg_ParseTuple(args, "OnnLO!O!UO", &mm, &data_offset, &data_end, &base,
                          &PyList_Type, &positions, &PyType_Type, &message_type, &id_prefix,
                          &decode_props))
        return NULL;
    if (!configured()) return NULL;
    if (!PyUnicode_IS_COMPACT_ASCII(id_prefix)) {
        PyErr_SetString(PyExc_ValueError, "id_prefix must be ASCII");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(mm, &view, PyBUF_SIMPLE) < 0) return NULL;
    /* The positions come from queue entries, which a damaged file can set to anything:
     * every comparison below is arranged so that no value can overflow. */
    Py_ssize_t n = PyList_GET_SIZE(positions);
    PyObject *out = PyList_New(n);
    Last topic_cache = {0}, tag_cache = {0};
    if (out == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) PyList_SET_ITEM(out, i, Py_NewRef(Py_None));
    if (data_offset < 0 || data_end < 0 || base < 0 || data_offset + data_end > view.len) {
        PyErr_SetString(PyExc_ValueError, "the data area lies outside the mapping");
        goto fail;
    }
    const char *data = (const char *)view.buf + data_offset;
    for (Py_ssize_t i = 0; i < n && i < PyList_GET_SIZE(positions); i++) {
        int overflow = 0;
        long long position =
            PyLong_AsLongLongAndOverflow(PyList_GET_ITEM(positions, i), &overflow);
        if (position == -1 && PyErr_Occurred()) goto fail;
        if (overflow || position < base ||
            position - base > (long long)(data_end - FRAME_OVERHEAD - HEAD_SIZE))
            continue; /* not a record here: the Python path names the problem */
        long long local = position - base;
        const char *p = data + local;
        uint32_t length = get_u32(p);
        if (length < (uint32_t)HEAD_SIZE ||
            (long long)length > (long long)data_end - local - FRAME_OVERHEAD)
            continue;
        const char *h = p + 4;
        if (get_u32(h + length + 4) != length) continue;
        if (get_i64(h) != position) continue;
        uint32_t tl = (uint8_t)h[45], gl = (uint8_t)h[46], kl = (uint8_t)h[47];
        uint32_t pl = get_u32(h + 48), bl = get_u32(h + 52);
        if ((uint64_t)HEAD_SIZE + tl + gl + kl + pl + bl != length) continue;
        if (checksum(h, (Py_ssize_t)length) != get_u32(h + length)) continue;

        const char *s = h + HEAD_SIZE;
        PyObject *topic = decode_cached(&topic_cache, s, tl);
        s += tl;
        PyObject *tag = topic == NULL ? NULL : decode_cached(&tag_cache, s, gl);
        s += gl;
        PyObject *key = NULL;
        if (tag != NULL)
            key = (h[44] & FLAG_HAS_KEY) ? PyUnicode_DecodeUTF8(s, kl, "strict")
                                         : Py_NewRef(Py_None);
        s += kl;
        PyObject *props = NULL;
        if (key != NULL) {
            if (pl == 0) {
                props = PyDict_New();
            } else {
                PyObject *raw = PyBytes_FromStringAndSize(s, pl);
                props = raw == NULL ? NULL : PyObject_CallOneArg(decode_props, raw);
                Py_XDECREF(raw);
            }
        }
        s += pl;
        if (props == NULL) { /* undecodable: the slow path reports it */
            Py_XDECREF(topic);
            Py_XDECREF(tag);
            Py_XDECREF(key);
            /* Undecodable bytes: left to the slow path. MemoryError, KeyboardInterrupt
             * and the like are not about the record and go on up. */
            if (PyErr_ExceptionMatches(PyExc_MemoryError) ||
                !PyErr_ExceptionMatches(PyExc_Exception))
                goto fail;
            PyErr_Clear();
            continue;
        }
        PyObject *fields[12] = {
            message_id(id_prefix, position),
            topic,
            PyLong_FromLong(get_i32(h + 32)),
            PyLong_FromLongLong(get_i64(h + 24)),
            PyLong_FromLongLong(position),
            tag,
            key,
            props,
            PyLong_FromLong(get_i32(h + 36)),
            PyBytes_FromStringAndSize(s, bl),
            PyFloat_FromDouble((double)get_i64(h + 16) / 1e9),
            PyFloat_FromDouble((double)get_i64(h + 8) / 1e9),
        };
        PyObject *message = new_record((PyTypeObject *)message_type, 12, fields);
        if (message == NULL) goto fail;
        PyObject *pair = Py_BuildValue("(NI)", message, (unsigned int)get_u32(h + 40));
        if (pair == NULL) goto fail;
        PyList_SET_ITEM(out, i, pair);
        Py_DECREF(Py_None); /* the placeholder it replaces */
    }
    Py_XDECREF(topic_cache.str);
    Py_XDECREF(tag_cache.str);
    PyBuffer_Release(&view);
    return out;
fail:
    Py_XDECREF(topic_cache.str);
    Py_XDECREF(tag_cache.str);
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    return NULL;
}

/* --- collect -------------------------------------------------------------------- */

/* collect(entries, found, offset, queue_id, topic, room, out) -> (offset, bad)
 *
 * The untagged pull's loop over a run of queue entries [(position, tag hash)] from
 * queue offset ``offset``: each message in found[position] = (Message, stored tag
 * hash) is checked against its entry and appended to out, until out holds ``room``
 * more messages. An entry with no message (removed by retention or compaction) is
 * skipped. Returns the offset after the last entry looked at, and the index of the
 * first entry whose message does not match it (-1 if none; the caller raises). */
static PyObject *collect(PyObject *self, PyObject *args) {
    PyObject *entries, *found, *topic, *out;
    long long offset, queue_id;
    Py_ssize_t room;
    if (!PyArg_ParseTuple(args, "O!O!LLUnO!", &PyList_Type, &entries, &PyDict_Type, &found,
                          &offset, &queue_id, &topic, &room, &PyList_Type, &out))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(entries), taken = 0, bad = -1;
    for (Py_ssize_t k = 0; k < n && taken < room; k++) {
        PyObject *entry = PyList_GET_ITEM(entries, k);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
            PyErr_SetString(PyExc_TypeError, "queue entries are (position, tag hash) pairs");
            return NULL;
        }
        offset++;
        PyObject *pair = PyDict_GetItemWithError(found, PyTuple_GET_ITEM(entry, 0));
        if (pair == NULL) {
            if (PyErr_Occurred()) return NULL;
            continue; /* removed by retention or compaction */
        }
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "found values are (message, tag hash) pairs");
            return NULL;
        }
        PyObject *message = PyTuple_GET_ITEM(pair, 0);
        if (!PyTuple_Check(message) || PyTuple_GET_SIZE(message) < 4) {
            PyErr_SetString(PyExc_TypeError, "messages are Message tuples");
            return NULL;
        }
        int same_topic = PyUnicode_Compare(PyTuple_GET_ITEM(message, 1), topic);
        if (same_topic == -1 && PyErr_Occurred()) return NULL;
        long long qoff = PyLong_AsLongLong(PyTuple_GET_ITEM(message, 3));
        long long qid = PyLong_AsLongLong(PyTuple_GET_ITEM(message, 2));
        if (PyErr_Occurred()) return NULL;
        int same_hash = PyObject_RichCompareBool(PyTuple_GET_ITEM(pair, 1),
                                                 PyTuple_GET_ITEM(entry, 1), Py_EQ);
        if (same_hash < 0) return NULL;
        if (qoff != offset - 1 || qid != queue_id || same_topic != 0 || !same_hash) {
            bad = k;
            offset--;
            break;
        }
        if (PyList_Append(out, message) < 0) return NULL;
        taken++;
    }
    return Py_BuildValue("(Ln)", offset, bad);
}

/* --- scan_frames ---------------------------------------------------------------- */

/* scan_frames(buf, data_offset, available, max_length, start) -> (offset, count)
 *
 * Recovery's walk over the framed records of a chunk's data area from ``start``: every
 * frame with a non-zero length up to max_length, inside the ``available`` bytes, whose
 * suffix and checksum match. Stops at the first frame that is not such (or at a zero
 * length) and returns its data offset and how many records came before; the caller
 * looks at that frame again in Python, which says what is wrong with it. */
static PyObject *scan_frames(PyObject *self, PyObject *args) {
    PyObject *buf;
    Py_ssize_t data_offset, available, max_length, offset;
    if (!PyArg_ParseTuple(args, "Onnnn", &buf, &data_offset, &available, &max_length, &offset))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE) < 0) return NULL;
    if (data_offset < 0 || available < 0 || offset < 0 || data_offset + available > view.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "the data area lies outside the buffer");
        return NULL;
    }
    const char *data = (const char *)view.buf + data_offset;
    Py_ssize_t count = 0;
    Py_BEGIN_ALLOW_THREADS /* a read-only walk over memory nobody frees meanwhile */
    while (offset + 4 + 1 + 8 <= available) {
        uint32_t n = get_u32(data + offset);
        if (n == 0 || (Py_ssize_t)n > max_length || offset + 12 + (Py_ssize_t)n > available)
            break;
        const char *payload = data + offset + 4;
        if (get_u32(payload + n + 4) != n || get_u32(payload + n) != checksum(payload, n)) break;
        count++;
        offset += n + 12;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(nn)", offset, count);
}

/* --- last_nonzero --------------------------------------------------------------- */

/* last_nonzero(buf, start, stop) -> one past the last non-zero byte of buf[start:stop],
 * or start if they are all zero. Scans backwards a word at a time. */
static PyObject *last_nonzero(PyObject *self, PyObject *args) {
    PyObject *buf;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "Onn", &buf, &start, &stop)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE) < 0) return NULL;
    if (start < 0 || stop > view.len || start > stop) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "range outside the buffer");
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)view.buf;
    Py_ssize_t end = stop;
    Py_BEGIN_ALLOW_THREADS
    while (end > start && (end & 7) != 0 && p[end - 1] == 0) end--;
    while (end - 8 >= start) {
        uint64_t word;
        memcpy(&word, p + end - 8, 8);
        if (word != 0) break;
        end -= 8;
    }
    while (end > start && p[end - 1] == 0) end--;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(end);
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, NULL},
    {"xxh3_64", py_xxh3_64, METH_O, NULL},
    {"check_batch", check_batch, METH_VARARGS, NULL},
    {"check_one", check_one, METH_VARARGS, NULL},
    {"write_run", write_run, METH_VARARGS, NULL},
    {"write_one", write_one, METH_VARARGS, NULL},
    {"decode_run", decode_run, METH_VARARGS, NULL},
    {"collect", collect, METH_VARARGS, NULL},
    {"scan_frames", scan_frames, METH_VARARGS, NULL},
    {"last_nonzero", last_nonzero, METH_VARARGS, NULL},
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
    if (EMPTY_BYTES == NULL || ZERO == NULL) return NULL;
    return PyModule_Create(&module);
}
