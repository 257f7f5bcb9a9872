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

/* --- checking a send ------------------------------------------------------------ */

/* One message's fields once checked: body, key, properties and queue id borrowed, and
 * tag_bytes, hashed_obj and key_bytes owned when filled by check_fields (release with
 * release_checked), borrowed when unpack_checked read them from a checked tuple. */
typedef struct {
    PyObject *body, *tag_bytes, *hashed_obj, *key_bytes, *key, *props, *code_obj, *queue_id;
    uint32_t hashed;
    long code;
    Py_ssize_t length; /* of the record, without the topic */
} Checked;

static void release_checked(Checked *c) {
    Py_CLEAR(c->tag_bytes);
    Py_CLEAR(c->hashed_obj);
    Py_CLEAR(c->key_bytes);
}

/* The common, valid case of validate.check_message: 1 with *out filled, 0 (nothing
 * set) when the message needs the Python checks, which then raise or handle it, or -1
 * with the exception check_tag raised. */
static int check_fields(PyObject *body, PyObject *tag, PyObject *key, PyObject *props,
                        PyObject *code, PyObject *queue_id, PyObject *tag_check,
                        Py_ssize_t max_body, Py_ssize_t chunk_size, Py_ssize_t queue_count,
                        Checked *out) {
    if (!PyBytes_CheckExact(body) || PyBytes_GET_SIZE(body) > max_body) return 0;
    if (!PyUnicode_CheckExact(tag) || props != Py_None || !PyLong_CheckExact(code)) return 0;
    int overflow = 0;
    long long code_value = PyLong_AsLongLongAndOverflow(code, &overflow);
    if (overflow || code_value < INT32_MIN || code_value > INT32_MAX) return 0;
    if (queue_id != Py_None) {
        if (!PyLong_CheckExact(queue_id)) return 0;
        long long q = PyLong_AsLongLongAndOverflow(queue_id, &overflow);
        if (overflow || q < 0 || q >= queue_count) return 0;
    }
    PyObject *key_bytes;
    if (key == Py_None) {
        key_bytes = Py_NewRef(EMPTY_BYTES);
    } else if (PyUnicode_CheckExact(key)) {
        Py_ssize_t klen;
        const char *k = PyUnicode_AsUTF8AndSize(key, &klen);
        if (k == NULL || klen > MAX_NAME) { /* not UTF-8 encodable, or too long */
            PyErr_Clear();
            return 0;
        }
        key_bytes = PyBytes_FromStringAndSize(k, klen);
        if (key_bytes == NULL) return -1;
    } else {
        return 0;
    }
    PyObject *tag_bytes, *hashed;
    if (PyUnicode_GET_LENGTH(tag) == 0) {
        tag_bytes = Py_NewRef(EMPTY_BYTES);
        hashed = Py_NewRef(ZERO);
    } else { /* validate.check_tag: cached, and it raises the precise error */
        PyObject *pair = PyObject_CallOneArg(tag_check, tag);
        if (pair == NULL) {
            Py_DECREF(key_bytes);
            return -1;
        }
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !PyBytes_Check(PyTuple_GET_ITEM(pair, 0))) {
            Py_DECREF(pair);
            Py_DECREF(key_bytes);
            PyErr_SetString(PyExc_TypeError, "check_tag must return (bytes, int)");
            return -1;
        }
        tag_bytes = Py_NewRef(PyTuple_GET_ITEM(pair, 0));
        hashed = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
        Py_DECREF(pair);
    }
    *out = (Checked){.body = body, .tag_bytes = tag_bytes, .hashed_obj = hashed,
                     .key_bytes = key_bytes, .key = key, .props = EMPTY_BYTES,
                     .code_obj = code, .queue_id = queue_id, .code = (long)code_value};
    out->hashed = (uint32_t)PyLong_AsUnsignedLongMask(hashed);
    if (out->hashed == (uint32_t)-1 && PyErr_Occurred()) {
        release_checked(out);
        return -1;
    }
    out->length = HEAD_SIZE + PyBytes_GET_SIZE(tag_bytes) + PyBytes_GET_SIZE(key_bytes) +
                  PyBytes_GET_SIZE(body);
    /* As StoreMessage._check: the head, the strings and 255 bytes of topic at most. */
    if (out->length + 255 + FRAME_OVERHEAD > chunk_size) {
        release_checked(out);
        return 0;
    }
    return 1;
}

/* --- check_batch ---------------------------------------------------------------- */

/* The checked 8-tuple of one OutgoingMessage, or NULL with no exception set when the
 * message needs the Python checks. */
static PyObject *check_fast(PyObject *msg, PyObject *tag_check, Py_ssize_t max_body,
                            Py_ssize_t chunk_size, Py_ssize_t queue_count) {
    Checked c;
    int ok = check_fields(PyTuple_GET_ITEM(msg, 0), PyTuple_GET_ITEM(msg, 1),
                          PyTuple_GET_ITEM(msg, 2), PyTuple_GET_ITEM(msg, 3),
                          PyTuple_GET_ITEM(msg, 4), PyTuple_GET_ITEM(msg, 5), tag_check,
                          max_body, chunk_size, queue_count, &c);
    if (ok <= 0) return NULL;
    /* new_record steals the three references check_fields took */
    PyObject *items[8] = {Py_NewRef(c.body),  c.tag_bytes,          c.hashed_obj,
                          c.key_bytes,        Py_NewRef(c.key),     Py_NewRef(c.props),
                          Py_NewRef(c.code_obj), Py_NewRef(c.queue_id)};
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

/* The fields of a checked 8-tuple (all borrowed), or -1 with TypeError. */
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
    out->hashed_obj = PyTuple_GET_ITEM(c, 2);
    out->code_obj = PyTuple_GET_ITEM(c, 6);
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

/* --- Sender: a whole single send in one call ------------------------------------
 *
 * MessageStore.send's common case: check the fields, take the write lock, frame the
 * record into the log chunk's mapping, write its queue entry, publish both and return
 * the SendResult, without a Python frame in between. The state stays where the Python
 * paths keep it (ChunkWriter._chunk, Chunk.data_end/record_count, Queue.next_offset,
 * the store's topic dicts), read and raised here exactly as Appender.append and
 * Chunk.publish do, so both paths can serve the same store one send after the other.
 * None (nothing written, the lock released) hands the send to the Python path: a new
 * topic, a field to check in Python, a chunk to complete or create, a closed store. */

static PyObject *S_acquire, *S_release, *S_chunk, *S_data_end, *S_data_size, *S_base, *S_mm,
    *S_record_count, *S_prefault_mark, *S_prefault, *S_writer, *S_next_offset, *S_closed,
    *S_flush_error, *S_waiting, *S_wake, *S_add, *S_time_ns;

static int intern_names(void) {
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    INTERN(S_acquire, "acquire") INTERN(S_release, "release") INTERN(S_chunk, "_chunk")
    INTERN(S_data_end, "data_end") INTERN(S_data_size, "data_size") INTERN(S_base, "base")
    INTERN(S_mm, "_mm") INTERN(S_record_count, "record_count")
    INTERN(S_prefault_mark, "_prefault_mark") INTERN(S_prefault, "_prefault")
    INTERN(S_writer, "_writer") INTERN(S_next_offset, "next_offset") INTERN(S_closed, "_closed")
    INTERN(S_flush_error, "_flush_error") INTERN(S_waiting, "_waiting") INTERN(S_wake, "_wake")
    INTERN(S_add, "add") INTERN(S_time_ns, "time_ns")
#undef INTERN
    return 0;
}

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
    Py_ssize_t data_offset, max_body, chunk_size;
} Sender;

static int Sender_traverse(Sender *s, visitproc visit, void *arg) {
    Py_VISIT(s->store); Py_VISIT(s->lock); Py_VISIT(s->writer); Py_VISIT(s->queues);
    Py_VISIT(s->topic_bytes); Py_VISIT(s->round_robin); Py_VISIT(s->keys);
    Py_VISIT(s->id_prefix); Py_VISIT(s->result_type); Py_VISIT(s->tag_check);
    Py_VISIT(s->xxh32); Py_VISIT(s->clock);
    return 0;
}

static int Sender_clear(Sender *s) {
    Py_CLEAR(s->store); Py_CLEAR(s->lock); Py_CLEAR(s->writer); Py_CLEAR(s->queues);
    Py_CLEAR(s->topic_bytes); Py_CLEAR(s->round_robin); Py_CLEAR(s->keys);
    Py_CLEAR(s->id_prefix); Py_CLEAR(s->result_type); Py_CLEAR(s->tag_check);
    Py_CLEAR(s->xxh32); Py_CLEAR(s->clock);
    return 0;
}

static void Sender_dealloc(Sender *s) {
    PyObject_GC_UnTrack(s);
    Sender_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* Sender(store, lock, writer, queues, topic_bytes, round_robin, keys, id_prefix,
 *        result_type, tag_check, xxh32, clock, data_offset, max_body, chunk_size) */
static int Sender_init(Sender *s, PyObject *args, PyObject *kwargs) {
    PyObject *o[12];
    Py_ssize_t data_offset, max_body, chunk_size;
    if (!configured()) return -1;
    if (!PyArg_ParseTuple(args, "OOOO!O!O!OUO!OOOnnn", &o[0], &o[1], &o[2], &PyDict_Type, &o[3],
                          &PyDict_Type, &o[4], &PyDict_Type, &o[5], &o[6], &o[7], &PyType_Type,
                          &o[8], &o[9], &o[10], &o[11], &data_offset, &max_body, &chunk_size))
        return -1;
    if (!PyUnicode_IS_COMPACT_ASCII(o[7]) ||
        !PyType_IsSubtype((PyTypeObject *)o[8], &PyTuple_Type) || data_offset < 0 ||
        max_body < 0 || chunk_size < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "Sender: an ASCII id prefix, a tuple result type, sizes >= 0");
        return -1;
    }
    Sender_clear(s);
    PyObject **slots[12] = {&s->store,     &s->lock,      &s->writer,      &s->queues,
                            &s->topic_bytes, &s->round_robin, &s->keys,    &s->id_prefix,
                            &s->result_type, &s->tag_check, &s->xxh32,     &s->clock};
    for (int i = 0; i < 12; i++) *slots[i] = Py_NewRef(o[i]);
    s->data_offset = data_offset;
    s->max_body = max_body;
    s->chunk_size = chunk_size;
    return 0;
}

/* An int attribute as a Py_ssize_t; -1 with an exception if missing or not an int. */
static Py_ssize_t ssize_attr(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    Py_ssize_t n = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (n < 0 && !PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "%R is negative", name);
    return n;
}

static int set_ssize_attr(PyObject *obj, PyObject *name, Py_ssize_t value) {
    PyObject *v = PyLong_FromSsize_t(value);
    if (v == NULL) return -1;
    int r = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return r;
}

/* Chunk.publish(end, 1): count the record, raise data_end, prefault the next window. */
static int publish_one(PyObject *chunk, Py_ssize_t end) {
    Py_ssize_t count = ssize_attr(chunk, S_record_count);
    if (count < 0 || set_ssize_attr(chunk, S_record_count, count + 1) < 0) return -1;
    if (set_ssize_attr(chunk, S_data_end, end) < 0) return -1;
    PyObject *mark = PyObject_GetAttr(chunk, S_prefault_mark);
    if (mark == NULL) return -1;
    long long m = PyLong_AsLongLong(mark);
    Py_DECREF(mark);
    if (m == -1 && PyErr_Occurred()) return -1;
    if (end > m) {
        PyObject *end_obj = PyLong_FromSsize_t(end);
        if (end_obj == NULL) return -1;
        PyObject *r = PyObject_CallMethodOneArg(chunk, S_prefault, end_obj);
        Py_DECREF(end_obj);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* A chunk open for writing and its data end, size and mapping (new references), or 0
 * when there is none (writer._chunk is None, or not mapped), or -1 with an exception. */
typedef struct {
    PyObject *chunk, *mm;
    Py_ssize_t end, size;
} Open;

static int open_chunk(PyObject *writer, Open *out) {
    *out = (Open){0};
    PyObject *chunk = PyObject_GetAttr(writer, S_chunk);
    if (chunk == NULL) return -1;
    if (chunk == Py_None) {
        Py_DECREF(chunk);
        return 0;
    }
    PyObject *mm = PyObject_GetAttr(chunk, S_mm);
    if (mm == NULL || mm == Py_None) {
        Py_DECREF(chunk);
        Py_XDECREF(mm);
        return mm == NULL ? -1 : 0;
    }
    out->chunk = chunk;
    out->mm = mm;
    if ((out->end = ssize_attr(chunk, S_data_end)) < 0 ||
        (out->size = ssize_attr(chunk, S_data_size)) < 0) {
        Py_CLEAR(out->chunk);
        Py_CLEAR(out->mm);
        return -1;
    }
    return 1;
}

static void close_open(Open *o) {
    Py_CLEAR(o->chunk);
    Py_CLEAR(o->mm);
}

/* The send itself, with the write lock held: a SendResult, None (nothing written), or
 * NULL with an exception. */
static PyObject *send_locked(Sender *s, PyObject *topic, PyObject *queues, Checked *c) {
    PyObject *result = NULL, *queue = NULL, *qwriter = NULL, *topic_bytes = NULL;
    Open log = {0}, entries = {0};
    Py_buffer lbuf = {0}, qbuf = {0};
    int r;

    {
        PyObject *closed = PyObject_GetAttr(s->store, S_closed);
        if (closed == NULL) return NULL;
        r = PyObject_IsTrue(closed);
        Py_DECREF(closed);
        if (r != 0) return r < 0 ? NULL : Py_NewRef(Py_None);
    }
    Py_ssize_t count = PyList_GET_SIZE(queues);
    topic_bytes = Py_XNewRef(PyDict_GetItemWithError(s->topic_bytes, topic));
    if (topic_bytes == NULL) goto fallback_or_fail;
    if (!PyBytes_Check(topic_bytes)) goto fallback;
    if ((r = open_chunk(s->writer, &log)) <= 0) goto fallback_or_fail;
    Py_ssize_t length = c->length + PyBytes_GET_SIZE(topic_bytes);
    if (log.end + length + FRAME_OVERHEAD > log.size) goto fallback; /* a new chunk */

    Py_ssize_t q, turn = -1;
    if (c->queue_id != Py_None) {
        q = PyLong_AsSsize_t(c->queue_id);
        if (q == -1 && PyErr_Occurred()) goto fail;
        if (q < 0 || q >= count) goto fallback;
    } else if (c->key != Py_None) { /* pick_queue: xxh32 of the key, by the xxhash package */
        PyObject *h = PyObject_CallOneArg(s->xxh32, c->key_bytes);
        if (h == NULL) goto fail;
        unsigned long long hv = PyLong_AsUnsignedLongLongMask(h);
        Py_DECREF(h);
        if (PyErr_Occurred()) goto fail;
        q = (Py_ssize_t)(hv % (unsigned long long)count);
    } else {
        PyObject *t = PyDict_GetItemWithError(s->round_robin, topic);
        if (t == NULL) goto fallback_or_fail;
        turn = PyLong_AsSsize_t(t);
        if (turn < 0) goto fallback_or_fail;
        q = turn % count;
        turn = q + 1;
    }
    queue = Py_NewRef(PyList_GET_ITEM(queues, q));
    if ((qwriter = PyObject_GetAttr(queue, S_writer)) == NULL) goto fail;
    if (qwriter == Py_None) goto fallback; /* the property creates it */
    if ((r = open_chunk(qwriter, &entries)) <= 0) goto fallback_or_fail;
    if (entries.end + QUEUE_RECORD > entries.size) goto fallback; /* make_room() */
    Py_ssize_t offset = ssize_attr(queue, S_next_offset);
    if (offset < 0) goto fail;
    PyObject *position_base = PyObject_GetAttr(log.chunk, S_base);
    if (position_base == NULL) goto fail;
    long long base = PyLong_AsLongLong(position_base);
    Py_DECREF(position_base);
    if (base < 0) goto fallback_or_fail;
    PyObject *now_obj = PyObject_CallMethodNoArgs(s->clock, S_time_ns);
    if (now_obj == NULL) goto fail;
    long long now_ns = PyLong_AsLongLong(now_obj);
    Py_DECREF(now_obj);
    if (now_ns == -1 && PyErr_Occurred()) goto fail;

    if (PyObject_GetBuffer(log.mm, &lbuf, PyBUF_WRITABLE) < 0 ||
        PyObject_GetBuffer(entries.mm, &qbuf, PyBUF_WRITABLE) < 0)
        goto fail;
    if (s->data_offset + log.size > lbuf.len || s->data_offset + entries.size > qbuf.len) {
        PyErr_SetString(PyExc_ValueError, "a data area lies outside its mapping");
        goto fail;
    }
    int64_t position = base + log.end;
    frame_message((char *)lbuf.buf + s->data_offset + log.end, length, position, now_ns, offset,
                  (int32_t)q, (int32_t)c->code, c->hashed, c->key != Py_None, topic_bytes,
                  c->tag_bytes, c->key_bytes, c->props, c->body);
    PyObject *fields[6] = {message_id(s->id_prefix, position), Py_NewRef(topic),
                           PyLong_FromSsize_t(q), PyLong_FromSsize_t(offset),
                           PyLong_FromLongLong(position),
                           PyFloat_FromDouble((double)now_ns / 1e9)};
    result = new_record((PyTypeObject *)s->result_type, 6, fields);
    if (result == NULL) goto fail;
    /* The entry after its frame, once nothing before can fail; then publish the record
     * before the entry, as Appender.append does. */
    char *slot = (char *)qbuf.buf + s->data_offset + entries.end;
    put_i64(slot, position + 1);
    put_u32(slot + 8, c->hashed);
    PyBuffer_Release(&qbuf);
    PyBuffer_Release(&lbuf);
    if (publish_one(log.chunk, log.end + length + FRAME_OVERHEAD) < 0 ||
        publish_one(entries.chunk, entries.end + QUEUE_RECORD) < 0 ||
        set_ssize_attr(queue, S_next_offset, offset + 1) < 0)
        goto fail;
    if (turn >= 0) {
        PyObject *t = PyLong_FromSsize_t(turn);
        if (t == NULL || PyDict_SetItem(s->round_robin, topic, t) < 0) {
            Py_XDECREF(t);
            goto fail;
        }
        Py_DECREF(t);
    }
    if (c->key != Py_None) {
        PyObject *pos = PyLong_FromLongLong(position);
        PyObject *args[4] = {s->keys, topic, c->key, pos};
        PyObject *added = pos == NULL ? NULL
            : PyObject_VectorcallMethod(S_add, args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_XDECREF(pos);
        if (added == NULL) goto fail;
        Py_DECREF(added);
    }
    goto done;

fallback_or_fail:
    if (PyErr_Occurred()) goto fail;
fallback:
    result = Py_NewRef(Py_None);
    goto done;
fail:
    Py_CLEAR(result);
done:
    if (qbuf.obj != NULL) PyBuffer_Release(&qbuf);
    if (lbuf.obj != NULL) PyBuffer_Release(&lbuf);
    close_open(&log);
    close_open(&entries);
    Py_XDECREF(queue);
    Py_XDECREF(qwriter);
    Py_XDECREF(topic_bytes);
    return result;
}

/* Release the lock, keeping any exception already raised. */
static int release_lock(Sender *s) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallMethodNoArgs(s->lock, S_release);
    if (type != NULL) {
        Py_XDECREF(r);
        PyErr_Restore(type, value, tb); /* the first error wins */
        return -1;
    }
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* send(topic, body, tag, key, properties, code, queue_id) -> SendResult or None */
static PyObject *Sender_send(Sender *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "send takes the seven fields of a send");
        return NULL;
    }
    PyObject *topic = args[0];
    if (!PyUnicode_CheckExact(topic)) Py_RETURN_NONE;
    PyObject *queues = PyDict_GetItemWithError(s->queues, topic);
    if (queues == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE; /* a new topic: created on the Python path */
    }
    if (!PyList_CheckExact(queues) || PyList_GET_SIZE(queues) < 1) Py_RETURN_NONE;
    Py_INCREF(queues); /* check_tag, time_ns and KeyIndex.add run Python code */
    Checked c;
    PyObject *result = NULL;
    int ok = check_fields(args[1], args[2], args[3], args[4], args[5], args[6], s->tag_check,
                          s->max_body, s->chunk_size, PyList_GET_SIZE(queues), &c);
    if (ok <= 0) {
        Py_DECREF(queues);
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject *flush_error = PyObject_GetAttr(s->store, S_flush_error);
    if (flush_error == NULL || flush_error != Py_None) { /* the Python path refuses it */
        result = flush_error == NULL ? NULL : Py_NewRef(Py_None);
        Py_XDECREF(flush_error);
        goto out;
    }
    Py_DECREF(flush_error);
    PyObject *acquired = PyObject_CallMethodNoArgs(s->lock, S_acquire);
    if (acquired == NULL) goto out;
    Py_DECREF(acquired);
    result = send_locked(s, topic, queues, &c);
    if (release_lock(s) < 0) Py_CLEAR(result);
    if (result != NULL && result != Py_None) { /* wake pulls waiting for a message */
        PyObject *waiting = PyObject_GetAttr(s->store, S_waiting);
        int w = waiting == NULL ? -1 : PyObject_IsTrue(waiting);
        Py_XDECREF(waiting);
        PyObject *woken = w > 0 ? PyObject_CallMethodNoArgs(s->store, S_wake) : NULL;
        if (w < 0 || (w > 0 && woken == NULL)) Py_CLEAR(result);
        Py_XDECREF(woken);
    }
out:
    release_checked(&c);
    Py_DECREF(queues);
    return result;
}

/* write_checked(topic, queues, checked) -> SendResult or None: the send of one checked
 * 8-tuple, by a caller that holds the write lock (the group commit leader). */
static PyObject *Sender_write_checked(Sender *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyUnicode_CheckExact(args[0]) || !PyList_CheckExact(args[1]) ||
        PyList_GET_SIZE(args[1]) < 1) {
        PyErr_SetString(PyExc_TypeError, "write_checked(topic, queues, checked)");
        return NULL;
    }
    Checked c; /* borrowed from the tuple, which is held while Python code may run */
    if (unpack_checked(args[2], &c) < 0) return NULL;
    PyObject *queues = Py_NewRef(args[1]), *checked = Py_NewRef(args[2]);
    PyObject *result = send_locked(s, args[0], queues, &c);
    Py_DECREF(checked);
    Py_DECREF(queues);
    return result;
}

static PyMethodDef Sender_methods[] = {
    {"send", (PyCFunction)(void (*)(void))Sender_send, METH_FASTCALL, NULL},
    {"write_checked", (PyCFunction)(void (*)(void))Sender_write_checked, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SenderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "equeue._speedups.Sender",
    .tp_basicsize = sizeof(Sender),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Sender_init,
    .tp_dealloc = (destructor)Sender_dealloc,
    .tp_traverse = (traverseproc)Sender_traverse,
    .tp_clear = (inquiry)Sender_clear,
    .tp_methods = Sender_methods,
};

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

/* --- frame_offsets -------------------------------------------------------------- */

/* frame_offsets(buf, start, end) -> (offset, offsets)
 *
 * The streaming reader's walk (chunks/stream.py) over buf[start:end]: the same checks as
 * scan_frames (a non-zero length, the frame wholly before end, matching suffix and
 * checksum), and also each valid frame's offset in buf, packed as little-endian int64 in
 * the bytes ``offsets``. Stops at the first frame that is not such and returns its
 * offset; the caller reads more, or looks at that frame in Python, which says what is
 * wrong with it. */
static PyObject *frame_offsets(PyObject *self, PyObject *args) {
    PyObject *buf;
    Py_ssize_t offset, end;
    if (!PyArg_ParseTuple(args, "Onn", &buf, &offset, &end)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE) < 0) return NULL;
    if (offset < 0 || offset > end || end > view.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "range outside the buffer");
        return NULL;
    }
    /* A frame takes at least 13 bytes: room for every offset the range can hold. */
    PyObject *out = PyBytes_FromStringAndSize(NULL, ((end - offset) / 13 + 1) * 8);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    char *o = PyBytes_AS_STRING(out);
    const char *data = (const char *)view.buf;
    Py_ssize_t count = 0;
    Py_BEGIN_ALLOW_THREADS /* a read-only walk; ``out`` is not shared yet */
    while (offset + 4 + 1 + 8 <= end) {
        uint32_t n = get_u32(data + offset);
        if (n == 0 || offset + 12 + (Py_ssize_t)n > end) break;
        const char *payload = data + offset + 4;
        if (get_u32(payload + n + 4) != n || get_u32(payload + n) != checksum(payload, n)) break;
        put_i64(o + count * 8, (int64_t)offset);
        count++;
        offset += n + 12;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (_PyBytes_Resize(&out, count * 8) < 0) return NULL;
    PyObject *result = Py_BuildValue("(nN)", offset, out);
    return result;
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
    {"write_run", write_run, METH_VARARGS, NULL},
    {"decode_run", decode_run, METH_VARARGS, NULL},
    {"collect", collect, METH_VARARGS, NULL},
    {"scan_frames", scan_frames, METH_VARARGS, NULL},
    {"frame_offsets", frame_offsets, METH_VARARGS, NULL},
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
    if (EMPTY_BYTES == NULL || ZERO == NULL || intern_names() < 0) return NULL;
    if (PyType_Ready(&SenderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Sender", (PyObject *)&SenderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
