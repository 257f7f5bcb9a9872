/* pull_answer(frame, rids) -> [request id, 0, (messages, next_offset)] or None: the
 * client's read of a pull_columns answer (protocol/pullcols.py: 14 columns) straight
 * from the frame's bytes into Messages, for a request id in ``rids``.
 *
 * msgpack would make an int for each of four columns, a bytes a message and six lists,
 * then unpack_pull_columns (pullcols.c) the Messages of them; here each Message is made
 * from the frame at once (lazy_message, as the store's decoded ones: the ints as C
 * values, the id from the answer's prefix and the position when read). It takes only
 * the common form, which it reproduces exactly: no ids column (every id of the prefix),
 * one tag for all, no keys, one code, no properties, an ASCII prefix, nothing after the
 * value. Anything else (or a request id not in ``rids``, or an error status) is None:
 * the caller decodes the frame with msgpack, and unpack_pull_columns or the Python
 * checks say what is wrong. The tuple marks the value as already read: msgpack never
 * makes one (use_list). */
#include "speedups.h"
#include "msgpack_min.h"
#include "cursor.h"

/* A msgpack int of any family within int64: 1, else 0. */
static inline int read_int(Cursor *c, int64_t *v) {
    if (!take(c, 1)) return 0;
    unsigned char b = *c->p;
    if (b >= 0xe0) { /* negative fixint */
        *v = (int8_t)b;
        c->p += 1;
        return 1;
    }
    if (b >= 0xd0 && b <= 0xd3) {
        int n = 1 << (b - 0xd0);
        if (!take(c, 1 + n)) return 0;
        uint64_t u = get_be(c->p + 1, n);
        if (n < 8) { /* sign-extend */
            uint64_t sign = 1ULL << (8 * n - 1);
            u = (u ^ sign) - sign;
        }
        *v = (int64_t)u;
        c->p += 1 + n;
        return 1;
    }
    uint64_t u;
    if (!read_uint(c, &u)) return 0;
    *v = (int64_t)u;
    return 1;
}

/* A bin header: its length (the bytes there), or -1. */
static inline Py_ssize_t read_bin(Cursor *c) {
    if (!take(c, 1)) return -1;
    unsigned char b = *c->p;
    int n = b == 0xc4 ? 1 : b == 0xc5 ? 2 : b == 0xc6 ? 4 : 0;
    if (n == 0 || !take(c, 1 + n)) return -1;
    Py_ssize_t len = (Py_ssize_t)get_be(c->p + 1, n);
    c->p += 1 + n;
    return take(c, len) ? len : -1;
}

static inline int take_nil(Cursor *c) {
    if (!take(c, 1) || *c->p != 0xc0) return 0;
    c->p += 1;
    return 1;
}

/* A str made of the next str in the frame (ascii: refused unless ASCII), or NULL with no
 * error set (not this form) or with one (out of memory). */
static PyObject *take_str(Cursor *c, int ascii) {
    Py_ssize_t len = read_str(c);
    if (len < 0) return NULL;
    const char *at = (const char *)c->p;
    PyObject *s = ascii ? PyUnicode_DecodeASCII(at, len, NULL) : PyUnicode_DecodeUTF8(at, len, NULL);
    if (s == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
    c->p += len;
    return s;
}

typedef struct {
    int64_t offset, position, created, stored;
    const unsigned char *body;
    Py_ssize_t size;
} Row;

/* (messages, next_offset), or None (not this form), or NULL (an error). */
static PyObject *read_pull(Cursor *c) {
    PyObject *topic = NULL, *prefix = NULL, *tag = NULL, *messages = NULL, *out = NULL;
    Row *rows = NULL;
    uint64_t next, queue_id;
    int64_t code;
    if (read_array(c) != 14 || !read_uint(c, &next)) goto none;
    if ((topic = take_str(c, 0)) == NULL) goto none_or_fail;
    if (!read_uint(c, &queue_id)) goto none;
    if ((prefix = take_str(c, 1)) == NULL) goto none_or_fail;
    if (!take_nil(c)) goto none; /* the ids column: every id is of the prefix */
    Py_ssize_t n = read_array(c);
    /* every message takes at least 5 bytes of the frame (four ints and a bin head): no
     * huge allocation from a forged count */
    if (n < 0 || n > (c->end - c->p) / 5) goto none;
    rows = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Row));
    if (rows == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        if (!read_uint(c, &v)) goto none;
        rows[i].offset = (int64_t)v;
    }
    if (read_array(c) != n) goto none;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        if (!read_uint(c, &v)) goto none;
        rows[i].position = (int64_t)v;
    }
    if (read_array(c) != n) goto none;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!read_int(c, &rows[i].created)) goto none;
    if (read_array(c) != n) goto none;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!read_int(c, &rows[i].stored)) goto none;
    if (read_array(c) != n) goto none;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t size = read_bin(c);
        if (size < 0) goto none;
        rows[i].body = c->p;
        rows[i].size = size;
        c->p += size;
    }
    if ((tag = take_str(c, 0)) == NULL) goto none_or_fail; /* one tag for all */
    if (!take_nil(c) || !read_int(c, &code) || !take_nil(c)) goto none; /* keys, props */
    if (c->p != c->end) goto none;
    if ((messages = PyList_New(n)) == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        const Row *r = &rows[i];
        PyObject *m = lazy_message(
            prefix, Py_NewRef(topic), Py_NewRef(tag), Py_NewRef(Py_None), NULL,
            PyBytes_FromStringAndSize((const char *)r->body, r->size), r->position,
            (long long)queue_id, r->offset, code, r->created, r->stored);
        if (m == NULL) goto fail;
        PyList_SET_ITEM(messages, i, m); /* untracked, as a message the store decoded */
    }
    out = Py_BuildValue("(OL)", messages, (long long)next);
    goto done;
none_or_fail:
    if (PyErr_Occurred()) goto fail;
none:
    out = Py_NewRef(Py_None);
    goto done;
fail:
    out = NULL;
done:
    PyMem_Free(rows);
    Py_XDECREF(messages);
    Py_XDECREF(tag);
    Py_XDECREF(prefix);
    Py_XDECREF(topic);
    return out;
}

PyObject *pull_answer(PyObject *self, PyObject *args) { return answer_frame(args, read_pull); }
