/* The broker's send_bodies without msgpack's decoder (equeue/server/handlers.py
 * send_spans): a request body of exactly
 *     [request_id > 0, "send_bodies", {"topic": str, "bodies": [bin, ...]}]  (either key
 * order, at least one body) is read into (request_id, topic, BodySpans), where BodySpans
 * holds the frame and each body's offset and length in it: no bytes object per body.
 * Sender.append_bodies (batch.c) frames them into the log chunk from there. Anything
 * else (another op or encoding msgpack also reads, an empty array, a body that is not
 * bin, a topic that is not UTF-8, trailing bytes) gives None, and the broker decodes the
 * frame the general way, which answers or refuses it as it always did. A BodySpans is a
 * sequence of bytes to Python (len, [i] copies that body out): the store's Python path
 * takes it where it takes a list of bodies. */
#include "speedups.h"
#include "msgpack_min.h"

static void spans_dealloc(BodySpans *self) {
    Py_XDECREF(self->frame);
    PyMem_Free(self->at);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t spans_length(BodySpans *self) { return self->n; }

static PyObject *spans_item(BodySpans *self, Py_ssize_t i) {
    if (i < 0 || i >= self->n) {
        PyErr_SetString(PyExc_IndexError, "BodySpans index out of range");
        return NULL;
    }
    return PyBytes_FromStringAndSize(self->base + self->at[2 * i], self->at[2 * i + 1]);
}

static PySequenceMethods spans_sequence = {
    .sq_length = (lenfunc)spans_length,
    .sq_item = (ssizeargfunc)spans_item,
};

PyTypeObject BodySpansType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "equeue._speedups.BodySpans",
    .tp_basicsize = sizeof(BodySpans),
    .tp_dealloc = (destructor)spans_dealloc,
    .tp_as_sequence = &spans_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A send_bodies request's bodies, where they lie in its frame.",
};

int body_spans_ready(void) { return PyType_Ready(&BodySpansType); }

/* The length of a str (kind 's') or bin ('b') header at *p (advanced past it), its
 * bytes then following; -1 if p is not one or they run past end. */
static Py_ssize_t raw_head(const unsigned char **p, const unsigned char *end, char kind) {
    const unsigned char *q = *p;
    if (q >= end) return -1;
    unsigned c = *q++;
    uint64_t len;
    if (kind == 's' && (c & 0xe0) == 0xa0)
        len = c & 0x1f;
    else {
        unsigned base = kind == 's' ? 0xd9 : 0xc4;
        if (c < base || c > base + 2) return -1;
        int n = 1 << (c - base); /* 1, 2, 4 length bytes */
        if (end - q < n) return -1;
        len = get_be(q, n);
        q += n;
    }
    if ((uint64_t)(end - q) < len) return -1;
    *p = q;
    return (Py_ssize_t)len;
}

/* The bodies array at *p (advanced past it) as a new BodySpans of owner's bytes from
 * base on; None (new reference) when it is not a non-empty array of bin alone, or holds
 * more than max bodies; NULL on no memory. */
static PyObject *read_spans(PyObject *owner, const unsigned char *base, const unsigned char **p,
                            const unsigned char *end, uint64_t max) {
    const unsigned char *q = *p;
    if (q >= end) Py_RETURN_NONE;
    unsigned c = *q++;
    uint64_t n;
    if ((c & 0xf0) == 0x90)
        n = c & 0x0f;
    else if (c == 0xdc || c == 0xdd) {
        int k = c == 0xdc ? 2 : 4;
        if (end - q < k) Py_RETURN_NONE;
        n = get_be(q, k);
        q += k;
    } else
        Py_RETURN_NONE;
    /* A body takes two bytes at least (an empty bin), so the bytes left bound the count,
     * but only to the frame's size: the spans take 16 bytes a body, and the request is
     * refused past max anyway (max_batch_messages). More than that, nothing is allocated:
     * the general path refuses it (its decoder's limit on items). */
    if (n == 0 || n > max || n > (uint64_t)(end - q) / 2) Py_RETURN_NONE;
    BodySpans *spans = PyObject_New(BodySpans, &BodySpansType);
    if (spans == NULL) return NULL;
    spans->frame = Py_NewRef(owner);
    spans->base = (const char *)base;
    spans->n = (Py_ssize_t)n;
    spans->at = PyMem_Malloc((size_t)n * 2 * sizeof(Py_ssize_t));
    if (spans->at == NULL) {
        Py_DECREF(spans);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < (Py_ssize_t)n; i++) {
        Py_ssize_t len = raw_head(&q, end, 'b');
        if (len < 0) {
            Py_DECREF(spans);
            Py_RETURN_NONE;
        }
        spans->at[2 * i] = q - base;
        spans->at[2 * i + 1] = len;
        q += len;
    }
    *p = q;
    return (PyObject *)spans;
}

/* The send_bodies request body from p to end (owner's bytes) as (request_id, topic,
 * BodySpans); None when it is not one (see the top); NULL on an error. */
static PyObject *read_request(PyObject *owner, const unsigned char *p, const unsigned char *end,
                              uint64_t max) {
    const unsigned char *base = p;
    uint64_t rid;
    if (end - p < 16 || !take_request_id(&p, end, &rid)) Py_RETURN_NONE;
    if (end - p < 13 || memcmp(p, MP_OP_SEND_BODIES "\x82", 13) != 0) Py_RETURN_NONE;
    p += 13;
    const unsigned char *topic = NULL;
    Py_ssize_t topic_len = -1;
    PyObject *spans = NULL, *t = NULL, *r = NULL;
    for (int i = 0; i < 2; i++) {
        Py_ssize_t n = raw_head(&p, end, 's');
        if (n == 5 && memcmp(p, "topic", 5) == 0 && topic == NULL) {
            p += 5;
            topic_len = raw_head(&p, end, 's');
            if (topic_len < 0) goto none;
            topic = p;
            p += topic_len;
        } else if (n == 6 && memcmp(p, "bodies", 6) == 0 && spans == NULL) {
            p += 6;
            spans = read_spans(owner, base, &p, end, max);
            if (spans == NULL) return NULL;
            if (spans == Py_None) goto none;
        } else
            goto none;
    }
    if (p != end) goto none;
    t = PyUnicode_DecodeUTF8((const char *)topic, topic_len, "strict");
    if (t == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) goto fail;
        PyErr_Clear();
        goto none;
    }
    r = PyLong_FromUnsignedLongLong(rid);
    if (r == NULL) goto fail;
    PyObject *out = PyTuple_Pack(3, r, t, spans);
    Py_DECREF(r);
    Py_DECREF(t);
    Py_DECREF(spans);
    return out;
none:
    Py_XDECREF(spans);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(spans);
    Py_XDECREF(t);
    return NULL;
}

/* bodies_body(body, max_bodies): a frame body (bytes) holding a send_bodies request of
 * at most max_bodies bodies as (request_id, topic, BodySpans); else None. */
PyObject *bodies_body(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "bodies_body(body: bytes, max_bodies: int)");
        return NULL;
    }
    PyObject *frame = args[0];
    unsigned long long max = PyLong_AsUnsignedLongLong(args[1]);
    if (max == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (!PyBytes_CheckExact(frame)) Py_RETURN_NONE;
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(frame);
    return read_request(frame, p, p + PyBytes_GET_SIZE(frame), max);
}

/* bodies_read(view, nbytes, max_frame_bytes, max_bodies): the first nbytes of view (the
 * broker connection's read buffer, a memoryview) when they are exactly one frame, of at
 * most max_frame_bytes, holding a send_bodies request of at most max_bodies bodies, as
 * (request_id, topic, BodySpans): the spans point into the buffer itself (no copy of the
 * frame), valid until the next read into it, so the caller appends them before it
 * returns and keeps nothing. Else None, and the caller reads the frame the general way.
 * The BodySpans holds the memoryview: the buffer cannot be resized while it lives. */
PyObject *bodies_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyMemoryView_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError,
                        "bodies_read(view: memoryview, nbytes, max_frame_bytes, max_bodies)");
        return NULL;
    }
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[1]), max_frame = PyLong_AsSsize_t(args[2]);
    unsigned long long max = PyLong_AsUnsignedLongLong(args[3]);
    if ((nbytes == -1 || max_frame == -1 || max == (unsigned long long)-1) && PyErr_Occurred())
        return NULL;
    /* Taken through the buffer protocol, not PyMemoryView_GET_BUFFER: a released view
     * raises ValueError here (its buffer may be freed), a non-contiguous one BufferError
     * (read the general way: None). */
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_BufferError)) return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *read = NULL;
    const unsigned char *p = (const unsigned char *)view.buf;
    if (nbytes <= 4 || nbytes > view.len || get_be(p, 4) != (uint64_t)(nbytes - 4) ||
        (uint64_t)(nbytes - 4) > (uint64_t)max_frame)
        read = Py_NewRef(Py_None);
    else
        read = read_request(args[0], p + 4, p + nbytes, max);
    PyBuffer_Release(&view);
    return read;
}

/* answer_around(request_id, result): the whole frame of the answer [request_id, 0,
 * result] where result is the msgpack-encoded value (bytes): the 4-byte length, the
 * array's head, the id, the OK status, then result's bytes; one allocation, one copy. */
PyObject *answer_around(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyLong_CheckExact(args[0]) || !PyBytes_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "answer_around(request_id: int, result: bytes)");
        return NULL;
    }
    unsigned long long rid = PyLong_AsUnsignedLongLong(args[0]);
    if (rid == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_ssize_t len = PyBytes_GET_SIZE(args[1]);
    char head[16];
    head[0] = (char)0x93;
    Py_ssize_t h = 1 + put_uint(head + 1, rid);
    head[h++] = (char)MP_STATUS_OK;
    if ((uint64_t)(h + len) > 0xffffffffULL) {
        PyErr_SetString(PyExc_OverflowError, "answer_around: the frame's length passes 2**32-1");
        return NULL;
    }
    PyObject *frame = PyBytes_FromStringAndSize(NULL, 4 + h + len);
    if (frame == NULL) return NULL;
    char *out = PyBytes_AS_STRING(frame);
    put_be_n(out, (uint64_t)(h + len), 4);
    memcpy(out + 4, head, (size_t)h);
    memcpy(out + 4 + h, PyBytes_AS_STRING(args[1]), (size_t)len);
    return frame;
}
