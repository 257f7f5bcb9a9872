/* The asyncio client's plain send with one request in flight on its connection
 * (equeue/client/aio.py, AsyncClient.send; wrapped by equeue/protocol/plainsend.py):
 *
 * client_send_frame(request_id, topic, body, max_frame_bytes) -> bytes | int | None
 *     the whole request frame: a 4-byte big-endian length, then
 *     [request_id, "send", {"topic": topic, "body": body}] byte for byte as
 *     msgpack.Packer(use_bin_type=True) writes it (RequestEncoder.frame's bytes); the
 *     payload's size, nothing built, when over max_frame_bytes; None (the caller packs
 *     it with msgpack, which says what is wrong) for a request id that is not an int in
 *     1 .. 2**64-1, a topic not an exact str encodable as UTF-8, a body not exact bytes
 *     or of 2**32 bytes or more.
 *
 * client_send_result(buffer, nbytes, request_id, topic, max_frame_bytes)
 *         -> SendResult | None
 *     the result in the first nbytes of buffer when they are exactly one frame
 *     [request_id, 0, [str, str, uint, uint, uint, float64]] (what the broker writes
 *     for a send, sendframe.c's send_answer or msgpack), the frame's length 1 ..
 *     max_frame_bytes, nothing after it: what AnswerReader.feed, answers() and
 *     DECODERS["send"] give for the same bytes. Anything else (part of a frame, two
 *     frames, another request's answer, an error answer, another encoding msgpack also
 *     reads, a str that is not UTF-8) is None: the caller reads the bytes the general
 *     way, which answers or refuses them as it always did. The result's topic is the
 *     caller's str object when the bytes are the same. */
#include "speedups.h"
#include "msgpack_min.h"

#define HEAD_ROOM 32 /* 0x93, the id (9), "send" (5), 0x82, "topic" (6), str head (5), "body" (5), bin head (5) */

/* The frame of request id `id` (1 .. 2**64-1): bytes | int (the payload's size, over
 * max) | None (a topic not UTF-8, a size past msgpack's); NULL with an error set. */
PyObject *clientsend_frame(unsigned long long id, PyObject *topic, PyObject *body,
                           Py_ssize_t max) {
    Py_ssize_t tlen;
    const char *tbytes = PyUnicode_AsUTF8AndSize(topic, &tlen);
    if (tbytes == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t blen = PyBytes_GET_SIZE(body);
    if ((uint64_t)blen > 0xffffffffULL || (uint64_t)tlen > 0xffffffffULL) Py_RETURN_NONE;
    char head[HEAD_ROOM];
    char *q = head;
    *q++ = (char)0x93;
    q += put_uint(q, id);
    memcpy(q, MP_OP_SEND "\x82\xa5topic", 12);
    q += 12;
    q += put_head(q, (uint64_t)tlen, 0xa0, 31, 0xd9, 0xda, 0xdb);
    Py_ssize_t before_topic = q - head;
    char mid[10];
    char *m = mid;
    memcpy(m, "\xa4" "body", 5);
    m += 5;
    m += put_head(m, (uint64_t)blen, 0, -1, 0xc4, 0xc5, 0xc6);
    Py_ssize_t mid_len = m - mid;
    Py_ssize_t payload = before_topic + tlen + mid_len + blen;
    if (payload > max || payload > 0xffffffffLL) return PyLong_FromSsize_t(payload);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 + payload);
    if (out == NULL) return NULL;
    char *o = PyBytes_AS_STRING(out);
    put_be_n(o, (uint64_t)payload, 4);
    o += 4;
    memcpy(o, head, (size_t)before_topic);
    o += before_topic;
    memcpy(o, tbytes, (size_t)tlen);
    o += tlen;
    memcpy(o, mid, (size_t)mid_len);
    o += mid_len;
    memcpy(o, PyBytes_AS_STRING(body), (size_t)blen);
    return out;
}

PyObject *client_send_frame(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "client_send_frame(request_id, topic, body, max_frame_bytes)");
        return NULL;
    }
    PyObject *rid = args[0], *topic = args[1], *body = args[2];
    if (!PyLong_CheckExact(rid) || !PyUnicode_CheckExact(topic) || !PyBytes_CheckExact(body))
        Py_RETURN_NONE;
    unsigned long long id = PyLong_AsUnsignedLongLong(rid);
    if (id == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (id == 0) Py_RETURN_NONE;
    Py_ssize_t max;
    if (get_limit(args[3], &max) < 0) return NULL;
    return clientsend_frame(id, topic, body, max);
}

typedef struct {
    const unsigned char *p, *end;
} Cur;

/* A msgpack uint (any of its encodings): 1, else 0. */
static int cur_uint(Cur *c, uint64_t *v) {
    if (c->p >= c->end) return 0;
    unsigned b = *c->p;
    if (b <= 0x7f) {
        *v = b;
        c->p++;
        return 1;
    }
    if (b < 0xcc || b > 0xcf) return 0;
    int n = 1 << (b - 0xcc);
    if (c->end - c->p < 1 + n) return 0;
    *v = get_be(c->p + 1, n);
    c->p += 1 + n;
    return 1;
}

/* A msgpack str: its bytes at *s, its length; -1 if not one or it runs past the end. */
static Py_ssize_t cur_str(Cur *c, const unsigned char **s) {
    if (c->p >= c->end) return -1;
    unsigned b = *c->p;
    uint64_t len;
    int n;
    if ((b & 0xe0) == 0xa0) {
        len = b & 0x1f;
        n = 0;
    } else if (b >= 0xd9 && b <= 0xdb) {
        n = 1 << (b - 0xd9);
        if (c->end - c->p < 1 + n) return -1;
        len = get_be(c->p + 1, n);
    } else
        return -1;
    const unsigned char *data = c->p + 1 + n;
    if ((uint64_t)(c->end - data) < len) return -1;
    *s = data;
    c->p = data + len;
    return (Py_ssize_t)len;
}

/* The str of the n bytes at s (UTF-8); NULL with no error set when they are not. */
static PyObject *utf8_str(const unsigned char *s, Py_ssize_t n) {
    unsigned char any = 0;
    for (Py_ssize_t i = 0; i < n; i++) any |= s[i];
    if (any < 0x80) { /* ASCII (a message id always): copied as it is */
        PyObject *ascii = PyUnicode_New(n, 127);
        if (ascii != NULL) memcpy(PyUnicode_1BYTE_DATA(ascii), s, (size_t)n);
        return ascii;
    }
    PyObject *str = PyUnicode_DecodeUTF8((const char *)s, n, NULL);
    if (str == NULL) PyErr_Clear();
    return str;
}

/* The SendResult in the first nbytes of p when they are exactly the answer to `rid`
 * (see client_send_result), else None; NULL with an error set. */
PyObject *clientsend_result(const unsigned char *p, Py_ssize_t nbytes, uint64_t rid,
                            PyObject *topic, Py_ssize_t max) {
    PyObject *out = NULL;
    PyObject *items[6] = {NULL};
    if (nbytes < 5) goto none;
    uint64_t length = get_be(p, 4);
    if (length == 0 || length > (uint64_t)max || length + 4 != (uint64_t)nbytes) goto none;
    Cur c = {p + 4, p + nbytes};
    uint64_t got, q, offset, position;
    if (*c.p++ != 0x93 || !cur_uint(&c, &got) || got != rid) goto none;
    if (c.end - c.p < 2 || c.p[0] != MP_STATUS_OK || c.p[1] != 0x96) goto none;
    c.p += 2;
    const unsigned char *id, *name;
    Py_ssize_t id_len = cur_str(&c, &id);
    if (id_len < 0) goto none;
    Py_ssize_t name_len = cur_str(&c, &name);
    if (name_len < 0) goto none;
    if (!cur_uint(&c, &q) || !cur_uint(&c, &offset) || !cur_uint(&c, &position)) goto none;
    if (c.end - c.p != 9 || c.p[0] != 0xcb) goto none;
    uint64_t bits = get_be(c.p + 1, 8);
    double stored;
    memcpy(&stored, &bits, 8);
    if ((items[0] = utf8_str(id, id_len)) == NULL) goto fail_or_none;
    Py_ssize_t tlen;
    const char *tbytes = PyUnicode_AsUTF8AndSize(topic, &tlen);
    if (tbytes == NULL) goto fail;
    if (tlen == name_len && memcmp(tbytes, name, (size_t)tlen) == 0)
        items[1] = Py_NewRef(topic);
    else if ((items[1] = utf8_str(name, name_len)) == NULL)
        goto fail_or_none;
    if ((items[2] = PyLong_FromUnsignedLongLong(q)) == NULL ||
        (items[3] = PyLong_FromUnsignedLongLong(offset)) == NULL ||
        (items[4] = PyLong_FromUnsignedLongLong(position)) == NULL ||
        (items[5] = PyFloat_FromDouble(stored)) == NULL)
        goto fail;
    out = PyObject_Vectorcall((PyObject *)&SendResultType, items, 6, NULL);
    goto done;
fail_or_none:
    if (PyErr_Occurred()) goto fail;
none:
    out = Py_NewRef(Py_None);
    goto done;
fail:
    out = NULL;
done:
    for (int i = 0; i < 6; i++) Py_XDECREF(items[i]);
    return out;
}

PyObject *client_send_result(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "client_send_result(buffer, nbytes, request_id, "
                                         "topic, max_frame_bytes)");
        return NULL;
    }
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[1]);
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t max;
    if (get_limit(args[4], &max) < 0) return NULL;
    PyObject *rid_obj = args[2], *topic = args[3];
    if (!PyLong_CheckExact(rid_obj) || !PyUnicode_CheckExact(topic)) Py_RETURN_NONE;
    unsigned long long rid = PyLong_AsUnsignedLongLong(rid_obj);
    if (rid == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *out = nbytes > view.len ? Py_NewRef(Py_None)
                                      : clientsend_result((const unsigned char *)view.buf,
                                                          nbytes, rid, topic, max);
    PyBuffer_Release(&view);
    return out;
}
