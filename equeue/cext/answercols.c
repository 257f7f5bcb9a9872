/* columns_answer(frame, rids) -> [request id, 0, (results,)] or None: the client's read of
 * a send_bodies answer (SendColumns packed by the broker: [topic, ids, queue ids, offsets,
 * positions, stored_at]) straight from the frame's bytes, for a request id in ``rids``.
 *
 * msgpack would make a str per id, three ints and a float per message and six lists,
 * and results_of_columns a SendResult of them; here each SendResult is made as the C send
 * makes its own (lazy_send_result: the batch's one id prefix, the ints as C values, the
 * id and ints made when read). It takes only what it can reproduce exactly: every id the
 * same ASCII prefix followed by the 16 lowercase hex digits of its position, uints below
 * 2**63, float64 stored times, one length for every column, nothing after the value.
 * Anything else (or a request id not in ``rids``) is None: the caller decodes the frame
 * with msgpack and the Python checks say what is wrong. The tuple marks the value as
 * already read: msgpack never makes one (use_list). */
#include "speedups.h"
#include "hex16.h"
#include "msgpack_min.h"
#include "cursor.h"

/* Whether the n bytes at a and b are equal: 8 at a time (an id prefix is 8 bytes). */
static inline int same_prefix(const unsigned char *a, const unsigned char *b, Py_ssize_t n) {
    Py_ssize_t k = 0;
    for (; k + 8 <= n; k += 8) {
        uint64_t x, y;
        memcpy(&x, a + k, 8);
        memcpy(&y, b + k, 8);
        if (x != y) return 0;
    }
    for (; k < n; k++)
        if (a[k] != b[k]) return 0;
    return 1;
}

typedef struct {
    const unsigned char *tail; /* the id's last 16 bytes, in the frame */
    uint64_t q, offset, position;
    double stored;
} Row;

/* The results, or None (not this answer's exact form), or NULL (an error). */
static PyObject *read_columns(Cursor *c) {
    PyObject *topic = NULL, *prefix = NULL, *out = NULL, *stored = NULL;
    Row *rows = NULL;
    if (read_array(c) != 6) goto none;
    Py_ssize_t tlen = read_str(c);
    if (tlen < 0) goto none;
    topic = PyUnicode_DecodeUTF8((const char *)c->p, tlen, NULL);
    if (topic == NULL) {
        PyErr_Clear();
        goto none;
    }
    c->p += tlen;
    Py_ssize_t n = read_array(c);
    /* every message takes at least 14 bytes of the frame: no huge allocation from a
     * forged count */
    if (n < 0 || n > (c->end - c->p) / 14) goto none;
    rows = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Row));
    if (rows == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    const unsigned char *first = NULL;
    Py_ssize_t idlen = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = read_str(c);
        if (len < 16 || (idlen >= 0 && len != idlen)) goto none;
        if (first == NULL) {
            first = c->p;
            idlen = len;
            for (Py_ssize_t k = 0; k < len - 16; k++)
                if (first[k] >= 0x80) goto none;
        } else if (!same_prefix(c->p, first, len - 16)) {
            goto none;
        }
        rows[i].tail = c->p + len - 16;
        c->p += len;
    }
    for (int col = 0; col < 3; col++) {
        if (read_array(c) != n) goto none;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t v;
            if (!read_uint(c, &v)) goto none;
            if (col == 0) rows[i].q = v;
            else if (col == 1) rows[i].offset = v;
            else rows[i].position = v;
        }
    }
    if (read_array(c) != n) goto none;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t digits[2], tail[2]; /* the id must be the one its position makes */
        put_hex16((char *)digits, rows[i].position);
        memcpy(tail, rows[i].tail, 16);
        if (!take(c, 9) || c->p[0] != 0xcb || digits[0] != tail[0] || digits[1] != tail[1])
            goto none;
        uint64_t bits = get_be(c->p + 1, 8);
        memcpy(&rows[i].stored, &bits, 8);
        c->p += 9;
    }
    if (c->p != c->end) goto none;
    prefix = PyUnicode_DecodeASCII((const char *)(first ? first : c->p), first ? idlen - 16 : 0,
                                   NULL);
    out = prefix == NULL ? NULL : PyList_New(n);
    if (out == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* one float for a run of equal stored times (a batch has one) */
        double last = stored == NULL ? 0.0 : PyFloat_AS_DOUBLE(stored);
        if (stored == NULL || memcmp(&last, &rows[i].stored, 8) != 0) {
            Py_XDECREF(stored);
            if ((stored = PyFloat_FromDouble(rows[i].stored)) == NULL) goto fail;
        }
        PyObject *r = lazy_send_result(prefix, topic, (long long)rows[i].q,
                                       (long long)rows[i].offset, (long long)rows[i].position,
                                       0, stored);
        if (r == NULL) goto fail;
        PyList_SET_ITEM(out, i, r);
    }
    goto done;
none:
    Py_CLEAR(out);
    out = Py_NewRef(Py_None);
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyMem_Free(rows);
    Py_XDECREF(stored);
    Py_XDECREF(prefix);
    Py_XDECREF(topic);
    return out;
}

/* columns_answer and pull_answer (pullanswer.c): the frame's [request id, status, value]
 * with ``read`` reading the value, for a request id in the set given, an OK status and
 * a value ``read`` takes (else None: msgpack decodes the frame). */
PyObject *answer_frame(PyObject *args, PyObject *(*read)(Cursor *)) {
    Py_buffer frame;
    PyObject *rids;
    if (!PyArg_ParseTuple(args, "y*O!", &frame, &PySet_Type, &rids)) return NULL;
    Cursor c = {frame.buf, (const unsigned char *)frame.buf + frame.len};
    PyObject *result = NULL, *rid = NULL, *value = NULL;
    uint64_t id;
    if (read_array(&c) != 3 || !read_uint64(&c, &id) || !take(&c, 1) || *c.p != MP_STATUS_OK) {
        result = Py_NewRef(Py_None);
        goto out;
    }
    c.p += 1;
    rid = PyLong_FromUnsignedLongLong(id);
    int known = rid == NULL ? -1 : PySet_Contains(rids, rid);
    if (known <= 0) {
        if (known == 0) result = Py_NewRef(Py_None);
        goto out;
    }
    value = read(&c);
    if (value == NULL) goto out;
    if (value == Py_None) {
        result = Py_NewRef(Py_None);
        goto out;
    }
    result = Py_BuildValue("[OiO]", rid, 0, value);
out:
    Py_XDECREF(value);
    Py_XDECREF(rid);
    PyBuffer_Release(&frame);
    return result;
}

/* (results,): the tuple marks them as read */
static PyObject *read_columns_tuple(Cursor *c) {
    PyObject *results = read_columns(c);
    if (results == NULL || results == Py_None) return results;
    PyObject *one = PyTuple_Pack(1, results);
    Py_DECREF(results);
    return one;
}

PyObject *columns_answer(PyObject *self, PyObject *args) {
    return answer_frame(args, read_columns_tuple);
}

/* --- the request: bodies_request(request id, topic, bodies, max_frame_bytes) -> the
 * whole frame (its 4-byte length, then [request id, "send_bodies", {"topic": topic,
 * "bodies": bodies}] as msgpack.Packer(use_bin_type=True) packs it, byte for byte); the
 * body's size (an int) when it is over max_frame_bytes or the length field's 2**32-1,
 * checked before anything is allocated (the caller refuses it); or None when topic is
 * not an exact str encodable as UTF-8 or bodies not a list of exact bytes (the caller
 * packs it with msgpack, which says what is wrong). One allocation, one copy a body. */

static Py_ssize_t head_size(Py_ssize_t n, Py_ssize_t fix_max, int has8) {
    return n <= fix_max ? 1 : (has8 && n <= 0xff) ? 2 : n <= 0xffff ? 3 : 5;
}

PyObject *bodies_request(PyObject *self, PyObject *args) {
    PyObject *rid_obj, *topic, *bodies, *limit;
    Py_ssize_t max_frame_bytes;
    if (!PyArg_ParseTuple(args, "OOOO", &rid_obj, &topic, &bodies, &limit) ||
        get_limit(limit, &max_frame_bytes) < 0)
        return NULL;
    if (!PyLong_CheckExact(rid_obj) || !PyUnicode_CheckExact(topic) ||
        !PyList_CheckExact(bodies))
        Py_RETURN_NONE;
    unsigned long long rid = PyLong_AsUnsignedLongLong(rid_obj);
    if (rid == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t tlen;
    const char *tutf8 = PyUnicode_AsUTF8AndSize(topic, &tlen);
    if (tutf8 == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if ((uint64_t)tlen > 0xffffffffULL) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(bodies);
    if ((uint64_t)n > 0xffffffffULL) Py_RETURN_NONE;
    static const char OP[] = MP_OP_SEND_BODIES "\x82\xa5topic";
    static const char KEY[] = "\xa6" "bodies";
    int rid_size = rid <= 0x7f ? 1 : rid <= 0xff ? 2 : rid <= 0xffff ? 3 : rid <= 0xffffffffULL ? 5 : 9;
    /* 0x93, rid, op and the map's first key, topic, "bodies", the array */
    Py_ssize_t size = 1 + rid_size + (Py_ssize_t)sizeof OP - 1 + head_size(tlen, 31, 1) + tlen +
                      (Py_ssize_t)sizeof KEY - 1 + head_size(n, 15, 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(bodies, i);
        if (!PyBytes_CheckExact(b)) Py_RETURN_NONE;
        Py_ssize_t len = PyBytes_GET_SIZE(b);
        if ((uint64_t)len > 0xffffffffULL) Py_RETURN_NONE;
        size += head_size(len, -1, 1) + len;
    }
    /* size is the body's length, what the 4-byte length field holds */
    if (size > max_frame_bytes || size > (Py_ssize_t)0xffffffffLL)
        return PyLong_FromSsize_t(size);
    PyObject *frame = PyBytes_FromStringAndSize(NULL, 4 + size);
    if (frame == NULL) return NULL;
    char *start = PyBytes_AS_STRING(frame), *p = start + 4;
    *p++ = (char)0x93;
    p += put_uint(p, rid);
    memcpy(p, OP, sizeof OP - 1);
    p += sizeof OP - 1;
    p += put_head(p, (uint64_t)tlen, 0xa0, 31, 0xd9, 0xda, 0xdb);
    memcpy(p, tutf8, (size_t)tlen);
    p += tlen;
    memcpy(p, KEY, sizeof KEY - 1);
    p += sizeof KEY - 1;
    p += put_head(p, (uint64_t)n, 0x90, 15, 0, 0xdc, 0xdd);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(bodies, i);
        Py_ssize_t len = PyBytes_GET_SIZE(b);
        p += put_head(p, (uint64_t)len, 0, -1, 0xc4, 0xc5, 0xc6);
        memcpy(p, PyBytes_AS_STRING(b), (size_t)len);
        p += len;
    }
    put_be_n(start, (uint64_t)size, 4); /* (p - start == 4 + size) */
    return frame;
}
