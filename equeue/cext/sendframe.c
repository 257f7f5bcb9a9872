/* The broker's plain send, the commonest request, without msgpack's general decoder and
 * packer (equeue/server/connection.py): a request body of exactly
 *     [request_id > 0, "send", {"topic": str, "body": bin}]   (either key order)
 * is read into (request_id, topic, body), and its answer, [request_id, 0, SendResult as
 * an array], is written as one whole frame, byte for byte what msgpack.Packer(
 * use_bin_type=True) writes behind a 4-byte big-endian length. Anything else (another
 * op, more arguments, another encoding msgpack also reads, such as a map16 of 2 or a
 * signed int id, a topic that is not UTF-8, trailing bytes) gives None, and the broker
 * decodes the frame the general way, which answers or refuses it as it always did. */
#include "speedups.h"
#include "msgpack_min.h"


/* The length of a str (kind 's') or bin ('b') at p, its bytes at *data; -1 if p is not
 * one or it runs past end. */
static Py_ssize_t take_raw(const unsigned char **p, const unsigned char *end, char kind,
                           const unsigned char **data) {
    const unsigned char *q = *p;
    if (q >= end) return -1;
    unsigned c = *q++;
    int n;
    uint64_t len;
    if (kind == 's' && (c & 0xe0) == 0xa0) {
        len = c & 0x1f;
        n = 0;
    } else {
        int base = kind == 's' ? 0xd9 : 0xc4;
        if (c < (unsigned)base || c > (unsigned)base + 2) return -1;
        n = 1 << (c - (unsigned)base); /* 1, 2, 4 length bytes */
        if (end - q < n) return -1;
        len = get_be(q, n);
        q += n;
    }
    if ((uint64_t)(end - q) < len) return -1;
    *data = q;
    *p = q + len;
    return (Py_ssize_t)len;
}

/* (a, b, c), taking the three references; NULL (and them released) without memory. */
static PyObject *triple(PyObject *a, PyObject *b, PyObject *c) {
    PyObject *out = PyTuple_New(3);
    if (out == NULL) {
        Py_DECREF(a);
        Py_DECREF(b);
        Py_DECREF(c);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 0, a);
    PyTuple_SET_ITEM(out, 1, b);
    PyTuple_SET_ITEM(out, 2, c);
    return out;
}

/* 1 with out = (request_id, topic, body) (new references), 0 when not a plain send in
 * the encoding read here, -1 with an error (memory). */
static int parse_parts(const unsigned char *p, const unsigned char *end, PyObject *out[3]) {
    uint64_t rid;
    if (end - p < 8 || !take_request_id(&p, end, &rid)) return 0;
    if (end - p < 6 || memcmp(p, MP_OP_SEND "\x82", 6) != 0) return 0;
    p += 6;
    const unsigned char *topic = NULL, *body = NULL;
    Py_ssize_t topic_len = -1, body_len = -1;
    for (int i = 0; i < 2; i++) {
        const unsigned char *key;
        Py_ssize_t n = take_raw(&p, end, 's', &key);
        if (n == 5 && memcmp(key, "topic", 5) == 0 && topic == NULL) {
            topic_len = take_raw(&p, end, 's', &topic);
            if (topic_len < 0) return 0;
        } else if (n == 4 && memcmp(key, "body", 4) == 0 && body == NULL) {
            body_len = take_raw(&p, end, 'b', &body);
            if (body_len < 0) return 0;
        } else
            return 0;
    }
    if (p != end || topic == NULL || body == NULL) return 0;
    PyObject *t = PyUnicode_DecodeUTF8((const char *)topic, topic_len, "strict");
    if (t == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    PyObject *b = PyBytes_FromStringAndSize((const char *)body, body_len);
    PyObject *r = b == NULL ? NULL : PyLong_FromUnsignedLongLong(rid);
    if (r == NULL) {
        Py_DECREF(t);
        Py_XDECREF(b);
        return -1;
    }
    out[0] = r;
    out[1] = t;
    out[2] = b;
    return 1;
}

/* The tuple, None (not a plain send in the encoding read here), or NULL with an error
 * (memory). */
static PyObject *parse(const unsigned char *p, const unsigned char *end) {
    PyObject *out[3];
    int got = parse_parts(p, end, out);
    if (got < 0) return NULL;
    if (got == 0) Py_RETURN_NONE;
    return triple(out[0], out[1], out[2]);
}


/* send_frame(buffer, nbytes, max_frame_bytes): the first nbytes of buffer as one whole
 * frame (its length field is nbytes - 4, at most max_frame_bytes) holding a plain send,
 * as (request_id, topic, body); else None. */
/* send_frame's read as parse_parts gives it. */
static int send_frame_parts(PyObject *const *args, PyObject *out[3]) {
    PyObject *buffer = args[0];
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[1]), max_frame = PyLong_AsSsize_t(args[2]);
    if ((nbytes == -1 || max_frame == -1) && PyErr_Occurred()) return -1;
    Py_buffer view;
    if (get_range(buffer, &view, 0, nbytes) < 0) return -1;
    int got = 0;
    const unsigned char *p = view.buf;
    if (nbytes > 4) {
        uint64_t length = get_be(p, 4);
        if ((Py_ssize_t)length == nbytes - 4 && (Py_ssize_t)length <= max_frame)
            got = parse_parts(p + 4, p + nbytes, out);
    }
    PyBuffer_Release(&view);
    return got;
}

PyObject *send_frame(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "send_frame(buffer, nbytes, max_frame_bytes)");
        return NULL;
    }
    PyObject *out[3];
    int got = send_frame_parts(args, out);
    if (got < 0) return NULL;
    if (got == 0) Py_RETURN_NONE;
    return triple(out[0], out[1], out[2]);
}

/* send_body(body): a frame body (bytes) holding a plain send, as send_frame reads it. */
PyObject *send_body(PyObject *self, PyObject *body) {
    if (!PyBytes_CheckExact(body)) Py_RETURN_NONE;
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(body);
    return parse(p, p + PyBytes_GET_SIZE(body));
}

/* An exact int in 0 .. 2**64-1 written at *q (advanced): 1, else 0. */
static int put_int(unsigned char **q, PyObject *v) {
    if (!PyLong_CheckExact(v)) return 0;
    unsigned long long u = PyLong_AsUnsignedLongLong(v);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *q += put_uint((char *)*q, u);
    return 1;
}

static int put_str(unsigned char **q, PyObject *s, Py_ssize_t room) {
    if (!PyUnicode_CheckExact(s)) return 0;
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(s, &n);
    if (utf8 == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (n > room) return 0;
    unsigned char *p = *q;
    if (n <= 31)
        *p++ = (unsigned char)(0xa0 | n);
    else if (n <= 0xff) {
        *p++ = 0xd9;
        *p++ = (unsigned char)n;
    } else if (n <= 0xffff) {
        *p++ = 0xda;
        *p++ = (unsigned char)(n >> 8);
        *p++ = (unsigned char)n;
    } else
        return 0;
    memcpy(p, utf8, (size_t)n);
    *q = p + n;
    return 1;
}

/* A bytes object of type kind (bytes or a subclass without a __dict__, such as the
 * broker's Frame) holding data: made as bytes.__new__ makes a subclass's, without the
 * call of kind(...) and its copy of an intermediate bytes. */
static PyObject *bytes_of(PyTypeObject *kind, const char *data, Py_ssize_t n) {
    if (kind == &PyBytes_Type) return PyBytes_FromStringAndSize(data, n);
    PyObject *out = kind->tp_alloc(kind, n);
    if (out == NULL) return NULL;
    memcpy(PyBytes_AS_STRING(out), data, (size_t)n);
    PyBytes_AS_STRING(out)[n] = '\0';
    /* "not hashed yet", as bytes_subtype_new sets it (tp_alloc zeroed it: a hash of 0) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    ((PyBytesObject *)out)->ob_shash = -1;
#pragma GCC diagnostic pop
    return out;
}

/* The whole answer frame of a send (request_id, result: a SendResult) as kind, None when
 * a field is not of the type a SendResult holds, NULL with an error (memory). */
int send_result_fields(PyObject *obj, PyObject *f[6], PyObject **id_prefix,
                       long long ints[6]); /* sendresult.c */

/* The frame of a SendResult (the C type) packed from its fields in place, and where the C
 * send has not made them yet from its C values (no id string, ints or float made, no
 * PySequence_GetItem: ~1.5 k instructions a send): the bytes answer_of's general way
 * writes for the same fields. NULL with no error when a value is not what that way packs
 * (the caller goes the general way), NULL with an error (memory). */
static PyObject *answer_of_fields(PyObject *rid, PyObject *result, PyTypeObject *kind) {
    PyObject *f[6], *prefix;
    long long ints[6];
    if (!send_result_fields(result, f, &prefix, ints)) return NULL;
    unsigned char buf[4 + 1 + 9 + 1 + 1 + 2 * (2 + 255) + 3 * 9 + 9];
    unsigned char *q = buf + 4;
    *q++ = 0x93;
    if (!put_int(&q, rid)) return NULL;
    *q++ = MP_STATUS_OK;
    *q++ = 0x96;
    if (f[0] != NULL) {
        if (!put_str(&q, f[0], 255)) return NULL;
    } else { /* message_id(prefix, position), as a fixstr */
        Py_ssize_t plen = PyUnicode_GET_LENGTH(prefix);
        if (!PyUnicode_IS_COMPACT_ASCII(prefix) || plen + 16 > 31) return NULL;
        *q++ = (unsigned char)(0xa0 | (plen + 16));
        memcpy(q, PyUnicode_1BYTE_DATA(prefix), (size_t)plen);
        put_hex16((char *)q + plen, (uint64_t)ints[4]); /* (a digit at a time: ~110 more) */
        q += plen + 16;
    }
    if (f[1] == NULL || !put_str(&q, f[1], 255)) return NULL;
    for (int i = 2; i < 5; i++) {
        if (f[i] != NULL) {
            if (!put_int(&q, f[i])) return NULL;
        } else if (ints[i] < 0) { /* (put_int's general way refuses these too) */
            return NULL;
        } else {
            q += put_uint((char *)q, (uint64_t)ints[i]);
        }
    }
    if (f[5] != NULL && !PyFloat_CheckExact(f[5])) return NULL;
    double d = f[5] != NULL ? PyFloat_AS_DOUBLE(f[5]) : (double)ints[5] / 1e9; /* as field() */
    uint64_t bits;
    memcpy(&bits, &d, 8);
    *q++ = 0xcb;
    put_be_n((char *)q, bits, 8);
    q += 8;
    put_be_n((char *)buf, (uint64_t)(q - buf - 4), 4);
    return bytes_of(kind, (const char *)buf, q - buf);
}

static PyObject *answer_of(PyObject *rid, PyObject *result, PyTypeObject *kind) {
    PyObject *f[6] = {NULL};
    PyObject *out = answer_of_fields(rid, result, kind);
    if (out != NULL || PyErr_Occurred()) return out;
    for (int i = 0; i < 6; i++) {
        f[i] = PySequence_GetItem(result, i);
        if (f[i] == NULL) {
            PyErr_Clear();
            goto plain;
        }
    }
    unsigned char buf[4 + 1 + 9 + 1 + 1 + 2 * (2 + 255) + 3 * 9 + 9];
    unsigned char *q = buf + 4;
    *q++ = 0x93;
    if (!put_int(&q, rid)) goto plain;
    *q++ = MP_STATUS_OK;
    *q++ = 0x96;
    if (!put_str(&q, f[0], 255) || !put_str(&q, f[1], 255)) goto plain;
    for (int i = 2; i < 5; i++)
        if (!put_int(&q, f[i])) goto plain;
    if (!PyFloat_CheckExact(f[5])) goto plain;
    double d = PyFloat_AS_DOUBLE(f[5]);
    uint64_t bits;
    memcpy(&bits, &d, 8);
    *q++ = 0xcb;
    for (int i = 7; i >= 0; i--) *q++ = (unsigned char)(bits >> (8 * i));
    uint32_t length = (uint32_t)(q - buf - 4);
    for (int i = 0; i < 4; i++) buf[i] = (unsigned char)(length >> (8 * (3 - i)));
    out = bytes_of(kind, (const char *)buf, q - buf);
    goto done;
plain:
    out = Py_None;
    Py_INCREF(out);
done:
    for (int i = 0; i < 6; i++) Py_XDECREF(f[i]);
    return out;
}

/* kind of a send_answer/plain_send argument: bytes, or a bytes subclass without a __dict__
 * (the broker's Frame); NULL with TypeError else. */
static PyTypeObject *answer_kind(PyObject *k) {
    if (!PyType_Check(k) || !PyType_IsSubtype((PyTypeObject *)k, &PyBytes_Type) ||
        ((PyTypeObject *)k)->tp_dictoffset != 0) {
        PyErr_SetString(PyExc_TypeError,
                        "kind must be bytes or a bytes subclass with __slots__ = ()");
        return NULL;
    }
    return (PyTypeObject *)k;
}

/* send_answer(request_id, result[, kind]): the whole answer frame of a send, as bytes or
 * as kind (a bytes subclass with __slots__ = (): the durable answer the broker keeps until
 * its fdatasync, connection.py), or None when a field is not of the type a SendResult
 * holds (the caller packs it with msgpack). */
PyObject *send_answer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "send_answer(request_id, result[, kind])");
        return NULL;
    }
    PyTypeObject *kind = nargs == 3 ? answer_kind(args[2]) : &PyBytes_Type;
    return kind == NULL ? NULL : answer_of(args[0], args[1], kind);
}

/* plain_send(buffer, nbytes, max_frame_bytes, send, kind, reserved): send_frame's read of
 * a plain send, appended by send(topic, body) (the store's C sender) and answered, in one
 * call (connection.py's buffer_updated: no Python frame per send between the read and the
 * append). (request_id, result, frame): the frame as kind, or None when the result's fields
 * are not what send_answer packs or packing it failed (no memory: the message is stored,
 * so it must be answered; the caller packs it); (request_id, None, exception) when send
 * raised an Exception (nothing appended; the caller answers it); None when the read is not
 * one plain send or its topic starts with reserved (the general path answers those). Past
 * a successful send only the 3-tuple itself can fail (no memory for it): MemoryError, the
 * message stored and unanswered, as any MemoryError in the broker's loop. */
/* plain_send's work, its answer in out (new references) instead of a tuple: 1 with out,
 * 0 for None, -1 with an error (sendlane.c calls it for every read). */
int plain_send_parts(PyObject *const *args, PyObject *out[3]) {
    if (!PyUnicode_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "plain_send: reserved must be a str");
        return -1;
    }
    PyTypeObject *kind = answer_kind(args[4]);
    if (kind == NULL) return -1;
    PyObject *read[3];
    int got = send_frame_parts(args, read);
    if (got <= 0) return got;
    PyObject *rid = read[0], *topic = read[1];
    Py_ssize_t reserved = PyUnicode_Tailmatch(topic, args[5], 0, PY_SSIZE_T_MAX, -1);
    PyObject *result = NULL, *third = NULL;
    if (reserved != 0) {
        got = reserved < 0 ? -1 : 0;
        goto done;
    }
    PyObject *call[2] = {topic, read[2]};
    result = PyObject_Vectorcall(args[3], call, 2, NULL);
    if (result == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) { /* KeyboardInterrupt and the like */
            got = -1;
            goto done;
        }
        PyObject *type, *tb;
        PyErr_Fetch(&type, &third, &tb);
        PyErr_NormalizeException(&type, &third, &tb);
        if (tb != NULL) PyException_SetTraceback(third, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        result = Py_NewRef(Py_None);
    } else {
        third = answer_of(rid, result, kind);
        if (third == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                Py_CLEAR(result);
                got = -1;
                goto done;
            }
            PyErr_Clear(); /* appended: answered all the same, packed by the caller */
            third = Py_NewRef(Py_None);
        }
    }
    out[0] = Py_NewRef(rid);
    out[1] = result;
    out[2] = third;
done:
    Py_DECREF(read[0]);
    Py_DECREF(read[1]);
    Py_DECREF(read[2]);
    return got;
}

PyObject *plain_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "plain_send(buffer, nbytes, max_frame_bytes, send, kind, reserved)");
        return NULL;
    }
    PyObject *out[3];
    int got = plain_send_parts(args, out);
    if (got < 0) return NULL;
    if (got == 0) Py_RETURN_NONE;
    return triple(out[0], out[1], out[2]);
}
