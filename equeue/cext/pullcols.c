/* A pull's answer in columns, protocol version 3 (docs/protocol.md, "pull_columns";
 * equeue/protocol/pullcols.py is the reference in Python and says the layout):
 *
 * pack_pull_columns(messages, next_offset, topic, queue_id, id_prefix, room)
 *     -> (bytes | None, kept) | None
 *   The broker's side: the msgpack bytes of the answer holding messages[:kept], the
 *   most that fit in ``room`` bytes (each message counted at the most its columns can
 *   take, so the answer never passes it); (None, 0) when not even the first fits. None
 *   when a message is not one this packs (not a C Message or tuple of the wire's exact
 *   types, another topic or queue, an id not of ``id_prefix``): Python packs it then.
 *   No field of a C Message is made: its slots and ints are read as they are.
 *
 * unpack_pull_columns(value, message_type) -> (messages, next_offset) | None
 *   The client's side: the decoded answer (msgpack's lists) turned into C Messages in
 *   one call, the bodies, tags and keys shared with the decoded lists, the ints kept as
 *   C ints until read. None for anything else (a wrong shape or type, a column of
 *   another length, a message id column): the Python path then decodes it or raises the
 *   ProtocolError that says what is wrong. */
#include "speedups.h"
#include <stddef.h>

enum { C_NEXT, C_TOPIC, C_QID, C_PREFIX, C_IDS, C_OFFSETS, C_POSITIONS, C_CREATED,
       C_STORED, C_BODIES, C_TAGS, C_KEYS, C_CODES, C_PROPS, NCOLUMNS };

/* --- msgpack writing -------------------------------------------------------------- */

static inline char *w_u8(char *p, int tag) { *p++ = (char)tag; return p; }
static inline char *w_be16(char *p, uint16_t v) { p[0] = (char)(v >> 8); p[1] = (char)v; return p + 2; }
static inline char *w_be32(char *p, uint32_t v) {
    for (int i = 3; i >= 0; i--) { p[i] = (char)v; v >>= 8; }
    return p + 4;
}
static inline char *w_be64(char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--) { p[i] = (char)v; v >>= 8; }
    return p + 8;
}

static char *w_int(char *p, long long v) {
    if (v >= 0) {
        uint64_t u = (uint64_t)v;
        if (u < 128) return w_u8(p, (int)u);
        if (u < 256) { p = w_u8(p, 0xcc); return w_u8(p, (int)u); }
        if (u < 65536) return w_be16(w_u8(p, 0xcd), (uint16_t)u);
        if (u < 4294967296ULL) return w_be32(w_u8(p, 0xce), (uint32_t)u);
        return w_be64(w_u8(p, 0xcf), u);
    }
    if (v >= -32) return w_u8(p, (int)(0xe0 | (v & 0x1f)));
    if (v >= -128) { p = w_u8(p, 0xd0); return w_u8(p, (int)(v & 0xff)); }
    if (v >= -32768) return w_be16(w_u8(p, 0xd1), (uint16_t)v);
    if (v >= -2147483648LL) return w_be32(w_u8(p, 0xd2), (uint32_t)v);
    return w_be64(w_u8(p, 0xd3), (uint64_t)v);
}

static char *w_head(char *p, size_t n, int fix, int fixmax, int t8, int t16, int t32) {
    if (fix >= 0 && n < (size_t)fixmax) return w_u8(p, fix | (int)n);
    if (t8 >= 0 && n < 256) { p = w_u8(p, t8); return w_u8(p, (int)n); }
    if (n < 65536) return w_be16(w_u8(p, t16), (uint16_t)n);
    return w_be32(w_u8(p, t32), (uint32_t)n);
}
#define W_ARRAY(p, n) w_head((p), (n), 0x90, 16, -1, 0xdc, 0xdd)
#define W_MAP(p, n) w_head((p), (n), 0x80, 16, -1, 0xde, 0xdf)

static char *w_bytes(char *p, const char *s, Py_ssize_t n, int is_str) {
    p = is_str ? w_head(p, (size_t)n, 0xa0, 32, 0xd9, 0xda, 0xdb)
               : w_head(p, (size_t)n, -1, 0, 0xc4, 0xc5, 0xc6);
    memcpy(p, s, (size_t)n);
    return p + n;
}

/* A str's UTF-8 (cached in the str), or NULL with the error cleared: not packable. */
static const char *utf8(PyObject *s, Py_ssize_t *n) {
    const char *u = PyUnicode_AsUTF8AndSize(s, n);
    if (u == NULL) PyErr_Clear();
    return u;
}

static char *w_str(char *p, PyObject *s) {
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n); /* checked in the counting pass */
    return w_bytes(p, u, n, 1);
}

/* --- pack_pull_columns ------------------------------------------------------------ */

typedef struct {
    PyObject *body, *tag, *key, *props; /* borrowed; key Py_None for none, props NULL */
    long long qoff, pos, created, stored, code;
} Row;

static int same_str(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    return PyUnicode_CheckExact(a) && PyUnicode_CheckExact(b) && PyUnicode_Compare(a, b) == 0;
}

static int as_ll(PyObject *v, long long *out) {
    if (!PyLong_CheckExact(v)) return 0;
    int overflow = 0;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (*out == -1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    return !overflow;
}

/* The most bytes a properties map packs to; -1 if it is not a dict of str to str. */
static Py_ssize_t props_bound(PyObject *props) {
    if (!PyDict_CheckExact(props)) return -1;
    Py_ssize_t i = 0, total = 5, n;
    PyObject *k, *v;
    while (PyDict_Next(props, &i, &k, &v)) {
        if (!PyUnicode_CheckExact(k) || !PyUnicode_CheckExact(v)) return -1;
        if (utf8(k, &n) == NULL) return -1;
        total += 5 + n;
        if (utf8(v, &n) == NULL) return -1;
        total += 5 + n;
    }
    return total;
}

/* Row ``i`` from a message (a C Message's slots, or a tuple's items) and the most bytes
 * its columns take; -1: not one this packs. pullcols.py's _pack and _bound count the
 * same (ROW_BOUND, KEY_HEAD, PROPS_BOUND, ENTRY_BOUND, HEAD_BOUND there): change both
 * (tests/test_pull_columns.py checks that both cut an answer at the same message). */
static Py_ssize_t read_row(PyObject *message, PyObject *topic, long long queue_id,
                           PyObject *id_prefix, Row *r) {
    PyObject *f[MSG_NFIELDS], *prefix = NULL;
    long long ints[MSG_NFIELDS];
    if (message_slots(message, f, ints, &prefix)) {
        /* a slot made (or given from Python) is read as the value it holds */
        if ((f[MSG_QID] && !as_ll(f[MSG_QID], &ints[MSG_QID])) ||
            (f[MSG_QOFF] && !as_ll(f[MSG_QOFF], &ints[MSG_QOFF])) ||
            (f[MSG_POS] && !as_ll(f[MSG_POS], &ints[MSG_POS])) ||
            (f[MSG_CODE] && !as_ll(f[MSG_CODE], &ints[MSG_CODE])) ||
            (f[MSG_CREATED] && !as_ll(f[MSG_CREATED], &ints[MSG_CREATED])) ||
            (f[MSG_STORED] && !as_ll(f[MSG_STORED], &ints[MSG_STORED])))
            return -1;
    } else if (PyTuple_Check(message) && PyTuple_GET_SIZE(message) == MSG_NFIELDS) {
        for (int i = 0; i < MSG_NFIELDS; i++) f[i] = PyTuple_GET_ITEM(message, i);
        for (int i = MSG_QID; i <= MSG_STORED; i++)
            if (i != MSG_TAG && i != MSG_KEY && i != MSG_PROPS && i != MSG_BODY &&
                !as_ll(f[i], &ints[i]))
                return -1;
    } else {
        return -1;
    }
    if (f[MSG_TOPIC] == NULL || !same_str(f[MSG_TOPIC], topic) || ints[MSG_QID] != queue_id)
        return -1;
    if (ints[MSG_QOFF] < 0 || ints[MSG_POS] < 0) return -1;
    if (f[MSG_ID] != NULL || prefix == NULL || !same_str(prefix, id_prefix)) {
        /* an id made or given: it must read as the prefix and the position */
        PyObject *want = message_id(id_prefix, ints[MSG_POS]);
        if (want == NULL) return -1;
        int same = f[MSG_ID] != NULL && same_str(f[MSG_ID], want);
        Py_DECREF(want);
        if (!same) return -1;
    }
    r->body = f[MSG_BODY];
    r->tag = f[MSG_TAG];
    r->key = f[MSG_KEY];
    r->props = f[MSG_PROPS];
    if (r->body == NULL || !PyBytes_CheckExact(r->body) || r->tag == NULL ||
        !PyUnicode_CheckExact(r->tag) || r->key == NULL ||
        (r->key != Py_None && !PyUnicode_CheckExact(r->key)))
        return -1;
    r->qoff = ints[MSG_QOFF];
    r->pos = ints[MSG_POS];
    r->created = ints[MSG_CREATED];
    r->stored = ints[MSG_STORED];
    r->code = ints[MSG_CODE];
    Py_ssize_t n, bound = 4 * 9 + 9 + 5 + PyBytes_GET_SIZE(r->body); /* ints, code, body */
    if (utf8(r->tag, &n) == NULL) return -1;
    bound += 5 + n;
    if (r->key != Py_None) {
        if (utf8(r->key, &n) == NULL) return -1;
        bound += 5 + n;
    } else {
        bound += 1;
    }
    if (r->props != NULL) {
        if (PyDict_CheckExact(r->props) && PyDict_GET_SIZE(r->props) == 0) {
            r->props = NULL;
        } else {
            Py_ssize_t p = props_bound(r->props);
            if (p < 0) return -1;
            bound += 1 + 9 + p; /* [index, map] */
        }
    }
    return bound;
}

/* An array of the rows' long long field at ``field`` (offsetof in Row). */
static char *w_ints(char *p, const Row *rows, Py_ssize_t n, size_t field) {
    p = W_ARRAY(p, (size_t)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v;
        memcpy(&v, (const char *)&rows[i] + field, sizeof v);
        p = w_int(p, v);
    }
    return p;
}

PyObject *pack_pull_columns(PyObject *self, PyObject *args) {
    PyObject *messages, *topic, *id_prefix;
    long long next_offset, queue_id;
    Py_ssize_t room;
    if (!PyArg_ParseTuple(args, "O!LULUn", &PyList_Type, &messages, &next_offset, &topic,
                          &queue_id, &id_prefix, &room))
        return NULL;
    if (!PyUnicode_IS_COMPACT_ASCII(id_prefix) || next_offset < 0 || queue_id < 0)
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(messages), tl, pl;
    if (utf8(topic, &tl) == NULL) Py_RETURN_NONE;
    pl = PyUnicode_GET_LENGTH(id_prefix);
    Row *rows = PyMem_Malloc(sizeof(Row) * (size_t)(n ? n : 1));
    if (rows == NULL) return PyErr_NoMemory();
    PyObject *out = NULL;
    /* the array head, next_offset, topic, queue id, prefix, ids, 8 column heads */
    Py_ssize_t total = 1 + 9 + 5 + tl + 9 + 5 + pl + 1 + 8 * 5 + 5;
    Py_ssize_t kept = 0;
    int same_tag = 1, same_code = 1, any_key = 0, props = 0;
    for (; kept < n; kept++) {
        Row *r = &rows[kept];
        Py_ssize_t bound =
            read_row(PyList_GET_ITEM(messages, kept), topic, queue_id, id_prefix, r);
        if (bound < 0) {
            PyMem_Free(rows);
            Py_RETURN_NONE;
        }
        if (total + bound > room) break;
        total += bound;
        if (kept) {
            same_tag &= same_str(r->tag, rows[0].tag);
            same_code &= r->code == rows[0].code;
        }
        any_key |= r->key != Py_None;
        props += r->props != NULL;
    }
    if (n > 0 && kept == 0) {
        PyMem_Free(rows);
        return Py_BuildValue("(On)", Py_None, (Py_ssize_t)0);
    }
    if (kept < n) next_offset = rows[kept].qoff; /* cut: go on from the first left out */
    PyObject *data = PyBytes_FromStringAndSize(NULL, total);
    if (data == NULL) goto done;
    char *p = PyBytes_AS_STRING(data);
    p = W_ARRAY(p, NCOLUMNS);
    p = w_int(p, next_offset);
    p = w_str(p, topic);
    p = w_int(p, queue_id);
    p = w_bytes(p, (const char *)PyUnicode_1BYTE_DATA(id_prefix), pl, 1);
    p = w_u8(p, 0xc0); /* ids: each is the prefix and its position */
    p = w_ints(p, rows, kept, offsetof(Row, qoff));
    p = w_ints(p, rows, kept, offsetof(Row, pos));
    p = w_ints(p, rows, kept, offsetof(Row, created));
    p = w_ints(p, rows, kept, offsetof(Row, stored));
    p = W_ARRAY(p, (size_t)kept);
    for (Py_ssize_t i = 0; i < kept; i++)
        p = w_bytes(p, PyBytes_AS_STRING(rows[i].body), PyBytes_GET_SIZE(rows[i].body), 0);
    if (same_tag) {
        p = kept ? w_str(p, rows[0].tag) : w_u8(p, 0xa0); /* (no message: "") */
    } else {
        p = W_ARRAY(p, (size_t)kept);
        for (Py_ssize_t i = 0; i < kept; i++) p = w_str(p, rows[i].tag);
    }
    if (!any_key) {
        p = w_u8(p, 0xc0);
    } else {
        p = W_ARRAY(p, (size_t)kept);
        for (Py_ssize_t i = 0; i < kept; i++)
            p = rows[i].key == Py_None ? w_u8(p, 0xc0) : w_str(p, rows[i].key);
    }
    p = same_code ? w_int(p, kept ? rows[0].code : 0) : w_ints(p, rows, kept, offsetof(Row, code));
    if (!props) {
        p = w_u8(p, 0xc0);
    } else {
        p = W_ARRAY(p, (size_t)props);
        for (Py_ssize_t i = 0; i < kept; i++) {
            PyObject *d = rows[i].props, *k, *v;
            if (d == NULL) continue;
            p = W_ARRAY(p, 2);
            p = w_int(p, i);
            p = W_MAP(p, (size_t)PyDict_GET_SIZE(d));
            Py_ssize_t j = 0;
            while (PyDict_Next(d, &j, &k, &v)) {
                p = w_str(p, k);
                p = w_str(p, v);
            }
        }
    }
    if (_PyBytes_Resize(&data, p - PyBytes_AS_STRING(data)) < 0) goto done;
    out = Py_BuildValue("(Nn)", data, kept);
done:
    PyMem_Free(rows);
    return out;
}

/* --- unpack_pull_columns ---------------------------------------------------------- */

/* column ``i`` of ``value`` if it is a list of n items, else NULL */
static PyObject *column(PyObject *value, int i, Py_ssize_t n) {
    PyObject *c = PyList_GET_ITEM(value, i);
    return PyList_CheckExact(c) && PyList_GET_SIZE(c) == n ? c : NULL;
}

static int item_ll(PyObject *list, Py_ssize_t i, long long *out, int uint) {
    return as_ll(PyList_GET_ITEM(list, i), out) && (!uint || *out >= 0);
}

PyObject *unpack_pull_columns(PyObject *self, PyObject *args) {
    PyObject *value, *message_type;
    if (!PyArg_ParseTuple(args, "OO", &value, &message_type)) return NULL;
    if (message_type != (PyObject *)&MessageType || !PyList_CheckExact(value) ||
        PyList_GET_SIZE(value) != NCOLUMNS)
        Py_RETURN_NONE;
    PyObject *topic = PyList_GET_ITEM(value, C_TOPIC), *prefix = PyList_GET_ITEM(value, C_PREFIX);
    PyObject *offsets = PyList_GET_ITEM(value, C_OFFSETS);
    long long next_offset, queue_id;
    if (!as_ll(PyList_GET_ITEM(value, C_NEXT), &next_offset) || next_offset < 0 ||
        !PyUnicode_CheckExact(topic) || !as_ll(PyList_GET_ITEM(value, C_QID), &queue_id) ||
        queue_id < 0 || !PyUnicode_CheckExact(prefix) || !PyUnicode_IS_COMPACT_ASCII(prefix) ||
        PyList_GET_ITEM(value, C_IDS) != Py_None || !PyList_CheckExact(offsets))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(offsets);
    PyObject *positions = column(value, C_POSITIONS, n), *created = column(value, C_CREATED, n);
    PyObject *stored = column(value, C_STORED, n), *bodies = column(value, C_BODIES, n);
    PyObject *tags = PyList_GET_ITEM(value, C_TAGS), *keys = PyList_GET_ITEM(value, C_KEYS);
    PyObject *codes = PyList_GET_ITEM(value, C_CODES), *props = PyList_GET_ITEM(value, C_PROPS);
    long long code = 0;
    if (positions == NULL || created == NULL || stored == NULL || bodies == NULL)
        Py_RETURN_NONE;
    if (!PyUnicode_CheckExact(tags) && column(value, C_TAGS, n) == NULL) Py_RETURN_NONE;
    if (keys != Py_None && column(value, C_KEYS, n) == NULL) Py_RETURN_NONE;
    if (!as_ll(codes, &code) && column(value, C_CODES, n) == NULL) Py_RETURN_NONE;
    if (props != Py_None && (!PyList_CheckExact(props) || PyList_GET_SIZE(props) > n))
        Py_RETURN_NONE;
    Py_ssize_t next_prop = 0, prop_at = -1;
    PyObject *prop_map = NULL;
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) PyList_SET_ITEM(out, i, Py_NewRef(Py_None));
    for (Py_ssize_t i = 0; i < n; i++) {
        long long qoff, pos, made, kept, c = code;
        if (!item_ll(offsets, i, &qoff, 1) || !item_ll(positions, i, &pos, 1) ||
            !item_ll(created, i, &made, 0) || !item_ll(stored, i, &kept, 0) ||
            (codes != Py_None && PyList_CheckExact(codes) && !item_ll(codes, i, &c, 0)))
            goto refuse;
        PyObject *body = PyList_GET_ITEM(bodies, i);
        PyObject *tag = PyUnicode_CheckExact(tags) ? tags : PyList_GET_ITEM(tags, i);
        PyObject *key = keys == Py_None ? Py_None : PyList_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(body) || !PyUnicode_CheckExact(tag) ||
            (key != Py_None && !PyUnicode_CheckExact(key)))
            goto refuse;
        if (prop_at < i && props != Py_None && next_prop < PyList_GET_SIZE(props)) {
            PyObject *pair = PyList_GET_ITEM(props, next_prop);
            long long at;
            if (!PyList_CheckExact(pair) || PyList_GET_SIZE(pair) != 2 ||
                !as_ll(PyList_GET_ITEM(pair, 0), &at) || at <= prop_at || at >= n)
                goto refuse;
            prop_at = (Py_ssize_t)at;
            prop_map = PyList_GET_ITEM(pair, 1);
            if (!PyDict_CheckExact(prop_map)) goto refuse;
            Py_ssize_t j = 0;
            PyObject *k, *v;
            while (PyDict_Next(prop_map, &j, &k, &v))
                if (!PyUnicode_CheckExact(k) || !PyUnicode_CheckExact(v)) goto refuse;
            next_prop++;
        }
        PyObject *own_props = NULL;
        if (prop_at == i && PyDict_GET_SIZE(prop_map) > 0) {
            own_props = PyDict_Copy(prop_map); /* the message's own, as a decoded one's */
            if (own_props == NULL) goto fail;
        }
        PyObject *m = lazy_message(prefix, Py_NewRef(topic), Py_NewRef(tag), Py_NewRef(key),
                                   own_props, Py_NewRef(body), pos, queue_id, qoff, c, made,
                                   kept);
        if (m == NULL) goto fail;
        Py_DECREF(Py_None); /* the placeholder it replaces */
        PyList_SET_ITEM(out, i, m); /* untracked, as a message the store decoded */
    }
    if (props != Py_None && next_prop != PyList_GET_SIZE(props)) goto refuse;
    return Py_BuildValue("(NL)", out, next_offset);
refuse:
    Py_DECREF(out);
    Py_RETURN_NONE;
fail:
    Py_DECREF(out);
    return NULL;
}
