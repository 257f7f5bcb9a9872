/* Sender.append_bodies: a batch of plain bodies (no tag, key, properties, code or queue
 * id: the broker's send_bodies, send_batch of bytes) framed into the log chunk, their
 * queue entries written and both published, in one call under the write lock.
 *
 * It is Appender._run (write_run) without the checked 8-tuple per message and without a
 * SendResult per message: the chunk state comes from the Sender's remembered views
 * (sendstate.h), as a single send reads it, and the results go into five column lists.
 * What it writes is what Appender.append writes for each body, byte for byte but for the
 * stored time (one clock reading per run, where Appender reads it per message): it stops
 * (returns the index reached) where a body does not fit the log chunk's allocated end or
 * its queue chunk's, and the caller sends that body through Appender.append, which
 * completes, creates or reserves chunks exactly as for any send, then calls again. */
#include "sender.h"
#include "hex16.h"
#include "msgpack_min.h"

/* One queue as the batch writes it: opened on its first message. */
typedef struct {
    int state; /* 0: not yet looked at; 1: ready; -1: the Python path (no chunk) */
    PyObject *queue, *writer; /* new references */
    WriterCache *seen;
    ChunkView view;
    Py_buffer buf;
    Py_ssize_t next_offset, free, taken;
} QueueRun;

typedef struct {
    Py_ssize_t q;
    int64_t position;
} BodyEntry;

static int open_queue(Sender *s, PyObject *queues, Py_ssize_t q, QueueRun *r) {
    r->state = -1;
    r->queue = Py_NewRef(PyList_GET_ITEM(queues, q));
    if (queue_state(&s->queue_slots, r->queue, &r->writer, &r->next_offset) < 0) return -1;
    if (r->writer == Py_None) return 0; /* the property creates it: Appender.append */
    r->seen = writer_cache(s->queue_seen, r->writer);
    int got = writer_view(r->writer, r->seen, 0, &r->view);
    if (got <= 0) return got;
    if (PyObject_GetBuffer(r->view.mm, &r->buf, PyBUF_WRITABLE) < 0) return -1;
    if (s->data_offset + r->view.size > r->buf.len || r->view.end > r->view.size) {
        PyErr_SetString(PyExc_ValueError, "a queue chunk's data area lies outside its mapping");
        return -1;
    }
    r->free = (r->view.size - r->view.end) / QUEUE_RECORD;
    r->state = 1;
    return 0;
}

static void close_queue(QueueRun *r) {
    if (r->buf.obj != NULL) PyBuffer_Release(&r->buf);
    view_clear(&r->view);
    Py_CLEAR(r->queue);
    Py_CLEAR(r->writer);
}

/* --- the columns packed as they go (msgpack, as records.pack_columns packs them) --- */

static inline void put_be(char *p, uint64_t v, int n) { put_be_n(p, v, n); }

/* The most bytes one message adds to each packed column. */
static void packed_room(PyObject *id_prefix, Py_ssize_t *per) {
    per[0] = 3 + PyUnicode_GET_LENGTH(id_prefix) + 16; /* str16 header at most */
    per[1] = per[2] = per[3] = per[4] = 9;
}

/* One message's id, queue id, offset, position and stored_at appended (packed) at
 * pos[k] of the five bytearrays, which have the room (packed_room). */
static void add_packed(PyObject *const *cols, Py_ssize_t *pos, PyObject *id_prefix,
                       Py_ssize_t q, int64_t offset, int64_t position, double stored) {
    char *p = PyByteArray_AS_STRING(cols[0]) + pos[0];
    Py_ssize_t plen = PyUnicode_GET_LENGTH(id_prefix), len = plen + 16, h;
    if (len <= 31) {
        p[0] = (char)(0xa0 | len);
        h = 1;
    } else if (len <= 0xff) {
        p[0] = (char)0xd9;
        p[1] = (char)len;
        h = 2;
    } else {
        p[0] = (char)0xda;
        put_be(p + 1, (uint64_t)len, 2);
        h = 3;
    }
    memcpy(p + h, PyUnicode_1BYTE_DATA(id_prefix), (size_t)plen);
    put_hex16(p + h + plen, (uint64_t)position);
    pos[0] += h + len;
    pos[1] += put_uint(PyByteArray_AS_STRING(cols[1]) + pos[1], (uint64_t)q);
    pos[2] += put_uint(PyByteArray_AS_STRING(cols[2]) + pos[2], (uint64_t)offset);
    pos[3] += put_uint(PyByteArray_AS_STRING(cols[3]) + pos[3], (uint64_t)position);
    uint64_t bits;
    memcpy(&bits, &stored, 8);
    p = PyByteArray_AS_STRING(cols[4]) + pos[4];
    p[0] = (char)0xcb;
    put_be(p + 1, bits, 8);
    pos[4] += 9;
}

/* Appends one message's results: to the five columns (ids, queue ids, offsets,
 * positions, stored_at), or (ncols 1) a SendResult to the one list. */
static int add_columns(Sender *s, PyObject *topic, PyObject *const *cols, int ncols,
                       Py_ssize_t q, int64_t offset, int64_t position, long long now_ns,
                       PyObject *stored) {
    PyObject *id_prefix = s->id_prefix, *result;
    if (ncols == 1) {
        if (s->result_type == (PyObject *)&SendResultType) { /* made when read */
            result = lazy_send_result(id_prefix, topic, q, offset, position, now_ns, stored);
        } else {
            PyObject *fields[6] = {message_id(id_prefix, position), Py_NewRef(topic),
                                   PyLong_FromSsize_t(q), PyLong_FromLongLong(offset),
                                   PyLong_FromLongLong(position), Py_NewRef(stored)};
            result = new_record((PyTypeObject *)s->result_type, 6, fields);
        }
        int r = result == NULL ? -1 : PyList_Append(cols[0], result);
        Py_XDECREF(result);
        return r;
    }
    PyObject *v[4] = {message_id(id_prefix, position), PyLong_FromSsize_t(q),
                      PyLong_FromLongLong(offset), PyLong_FromLongLong(position)};
    int ok = 1;
    for (int k = 0; k < 4; k++) {
        ok = ok && v[k] != NULL && PyList_Append(cols[k], v[k]) == 0;
        Py_XDECREF(v[k]);
    }
    return ok && PyList_Append(cols[4], stored) == 0 ? 0 : -1;
}

/* frame_raw for a plain body (no tag, key, properties or code): the same bytes, without
 * the three empty copies (a call each: ~50 instructions a message of ~1,400). */
static inline void frame_plain(char *p, Py_ssize_t length, int64_t position, int64_t now_ns,
                               int64_t offset, int32_t q, const char *topic,
                               Py_ssize_t topic_len, const char *body, Py_ssize_t bl) {
    char *h = put_record_start(p, length, position, now_ns, offset, q);
    memset(h + 36, 0, 9); /* code, hashed key, flags */
    h[45] = (char)topic_len;
    memset(h + 46, 0, 6); /* tag and key lengths, properties' length */
    put_u32(h + 52, (uint32_t)bl);
    char *w = h + HEAD_SIZE;
    memcpy(w, topic, (size_t)topic_len);
    w += topic_len;
    memcpy(w, body, (size_t)bl);
    w += bl;
    put_u32(w, checksum(h, length));
    put_u32(w + 4, (uint32_t)length);
}

/* append_bodies(topic, queues, bodies, start, columns) -> the index reached.
 * The caller holds the write lock, and checked every body (bytes within max_body and
 * the chunk size) before any was written. columns: a list of five lists (ids, queue
 * ids, offsets, positions, stored_at), or of one (a SendResult each), appended to; or
 * of five bytearrays, to which each value is appended msgpack-encoded (what
 * pack_columns writes for the columns' items). */
PyObject *Sender_append_bodies(Sender *s, PyObject *const *args, Py_ssize_t nargs) {
    if (s->store == NULL || nargs != 5 || !PyUnicode_Check(args[0]) ||
        !PyList_CheckExact(args[1]) || PyList_GET_SIZE(args[1]) < 1 ||
        !(PyList_CheckExact(args[2]) || Py_IS_TYPE(args[2], &BodySpansType)) ||
        !PyLong_Check(args[3]) ||
        !PyList_CheckExact(args[4]) ||
        (PyList_GET_SIZE(args[4]) != 5 && PyList_GET_SIZE(args[4]) != 1)) {
        PyErr_SetString(PyExc_TypeError,
                        "append_bodies(topic, queues, bodies (a list or BodySpans), start, "
                        "[five lists] or [a list])");
        return NULL;
    }
    if (!PyUnicode_CheckExact(args[0])) /* a str subclass: Appender.append stores it */
        return Py_NewRef(args[3]);
    PyObject *topic = args[0], *queues = Py_NewRef(args[1]), *bodies = Py_NewRef(args[2]);
    PyObject *cols[5];
    Py_ssize_t before[5], pos[5], per[5];
    int ncols = (int)PyList_GET_SIZE(args[4]);
    int packed = ncols == 5 && PyByteArray_CheckExact(PyList_GET_ITEM(args[4], 0));
    for (int k = 0; k < ncols; k++) {
        cols[k] = PyList_GET_ITEM(args[4], k);
        if (packed ? !PyByteArray_CheckExact(cols[k]) : !PyList_CheckExact(cols[k])) {
            Py_DECREF(queues);
            Py_DECREF(bodies);
            PyErr_SetString(PyExc_TypeError,
                            "append_bodies: the columns are five lists or five bytearrays");
            return NULL;
        }
        before[k] = pos[k] = packed ? PyByteArray_GET_SIZE(cols[k]) : PyList_GET_SIZE(cols[k]);
    }
    if (packed) packed_room(s->id_prefix, per);
    Py_ssize_t start = PyLong_AsSsize_t(args[3]), i = start;
    /* spans: the bodies where they lie in the request's frame (bodyspans.c) */
    BodySpans *spans = Py_IS_TYPE(bodies, &BodySpansType) ? (BodySpans *)bodies : NULL;
    Py_ssize_t count = PyList_GET_SIZE(queues);
    Py_ssize_t n = spans != NULL ? spans->n : PyList_GET_SIZE(bodies);
    PyObject *topic_bytes = NULL, *stored = NULL, *result = NULL;
    ChunkView log = {0};
    Py_buffer lbuf = {0};
    QueueRun *runs = NULL;
    BodyEntry *entries = NULL;
    Py_ssize_t done = 0, turn = 0;
    int ok = 0, published = 0;
    if (start < 0 || start > n) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "start outside the bodies");
        goto out;
    }
    if (start == n) goto reached;
    topic_bytes = Py_XNewRef(PyDict_GetItemWithError(s->topic_bytes, topic));
    if (topic_bytes == NULL || !PyBytes_Check(topic_bytes)) goto reached_or_fail;
    PyObject *t = PyDict_GetItemWithError(s->round_robin, topic);
    if (t == NULL || (turn = PyLong_AsSsize_t(t)) < 0) goto reached_or_fail;
    int got = writer_view(s->writer, &s->log_seen, 1, &log);
    if (got <= 0 || log.base < 0) goto reached_or_fail;
    long long now_ns;
    if (sender_clock(s, &now_ns) < 0) goto out;
    stored = PyFloat_FromDouble((double)now_ns / 1e9); /* the run's one stored_at */
    runs = PyMem_Calloc((size_t)count, sizeof(QueueRun));
    entries = PyMem_Calloc((size_t)(n - start), sizeof(BodyEntry));
    if (stored == NULL || runs == NULL || entries == NULL) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto out;
    }
    if (PyObject_GetBuffer(log.mm, &lbuf, PyBUF_WRITABLE) < 0) goto out;
    if (s->data_offset + log.size > lbuf.len || log.end > log.size) {
        PyErr_SetString(PyExc_ValueError, "the log chunk's data area lies outside its mapping");
        goto out;
    }
    char *data = (char *)lbuf.buf + s->data_offset;
    Py_ssize_t topic_len = PyBytes_GET_SIZE(topic_bytes), end = log.end;
    const char *topic_chars = PyBytes_AS_STRING(topic_bytes);
    for (int k = 0; packed && k < 5; k++) /* room for every body; cut to pos[k] after */
        if (PyByteArray_Resize(cols[k], before[k] + (n - start) * per[k]) < 0) goto out;
    double stored_at = (double)now_ns / 1e9;
    for (; i < n; i++) {
        const char *body;
        Py_ssize_t body_len;
        if (spans != NULL) {
            body = spans->base + spans->at[2 * i];
            body_len = spans->at[2 * i + 1];
        } else {
            PyObject *item = PyList_GET_ITEM(bodies, i);
            if (!PyBytes_CheckExact(item)) {
                PyErr_SetString(PyExc_TypeError, "append_bodies takes checked bytes bodies");
                goto out;
            }
            body = PyBytes_AS_STRING(item);
            body_len = PyBytes_GET_SIZE(item);
        }
        Py_ssize_t length = HEAD_SIZE + topic_len + body_len;
        if (end + length + FRAME_OVERHEAD > log.size) break; /* Chunk.reserve, a new chunk */
        Py_ssize_t q = turn % count;
        QueueRun *r = &runs[q];
        if (r->state == 0 && open_queue(s, queues, q, r) < 0) goto out;
        if (r->state < 0 || r->taken >= r->free) break; /* Queue.make_room() */
        int64_t offset = r->next_offset + r->taken, position = log.base + end;
        frame_plain(data + end, length, position, now_ns, offset, (int32_t)q, topic_chars,
                    topic_len, body, body_len);
        if (packed)
            add_packed(cols, pos, s->id_prefix, q, offset, position, stored_at);
        else if (add_columns(s, topic, cols, ncols, q, offset, position, now_ns, stored) < 0)
            goto out;
        entries[done++] = (BodyEntry){q, position};
        r->taken++;
        turn = q + 1;
        end += length + FRAME_OVERHEAD;
    }
    if (done == 0) goto reached;
    /* The entries after every frame they point to; then the records published before
     * their entries, as Appender._run does */
    for (Py_ssize_t k = 0; k < done; k++) {
        QueueRun *r = &runs[entries[k].q];
        char *slot = (char *)r->buf.buf + s->data_offset + r->view.end;
        put_i64(slot, entries[k].position + 1);
        put_u32(slot + 8, 0);
        r->view.end += QUEUE_RECORD;
    }
    PyBuffer_Release(&lbuf);
    if (view_publish_n(&s->log_seen, &log, end, done) < 0) goto out;
    published = 1; /* from here on, an error leaves these messages sent */
    for (Py_ssize_t q = 0; q < count; q++) {
        QueueRun *r = &runs[q];
        if (r->taken == 0) continue;
        if (r->buf.obj != NULL) PyBuffer_Release(&r->buf);
        if (view_publish_n(r->seen, &r->view, r->view.end, r->taken) < 0 ||
            queue_advance(&s->queue_slots, r->queue, r->next_offset + r->taken) < 0)
            goto out;
    }
    {
        PyObject *next = PyLong_FromSsize_t(turn);
        int set = next == NULL ? -1 : PyDict_SetItem(s->round_robin, topic, next);
        Py_XDECREF(next);
        if (set < 0) goto out;
    }
reached:
    ok = 1;
    result = PyLong_FromSsize_t(i);
    goto out;
reached_or_fail:
    if (!PyErr_Occurred()) goto reached;
out:
    if (lbuf.obj != NULL) PyBuffer_Release(&lbuf);
    if (runs != NULL)
        for (Py_ssize_t q = 0; q < count; q++) close_queue(&runs[q]);
    PyMem_Free(runs);
    PyMem_Free(entries);
    view_clear(&log);
    Py_XDECREF(stored);
    Py_XDECREF(topic_bytes);
    if (!ok || result == NULL) Py_CLEAR(result);
    if (result == NULL && !published) { /* none of this run was sent */
        for (int k = 0; k < ncols; k++) {
            if (packed) pos[k] = before[k];
            else if (PyList_GET_SIZE(cols[k]) > before[k])
                PyList_SetSlice(cols[k], before[k], PyList_GET_SIZE(cols[k]), NULL);
        }
    }
    for (int k = 0; packed && k < 5; k++) /* (shrinking: cannot fail) */
        if (PyByteArray_GET_SIZE(cols[k]) != pos[k]) PyByteArray_Resize(cols[k], pos[k]);
    Py_DECREF(queues);
    Py_DECREF(bodies);
    return result;
}

/* plain_bodies(items) -> whether items is a non-empty list of bytes bodies (or a
 * BodySpans) that the checks of a send pass as they are (check_batch's plain case:
 * within max_body, and the record within a chunk with the longest topic): the bodies
 * append_bodies takes. */
PyObject *Sender_plain_bodies(Sender *s, PyObject *items) {
    if (s->store == NULL) {
        PyErr_SetString(PyExc_TypeError, "Sender.__init__ was not called");
        return NULL;
    }
    BodySpans *spans = Py_IS_TYPE(items, &BodySpansType) ? (BodySpans *)items : NULL;
    if (spans == NULL && !PyList_CheckExact(items)) Py_RETURN_FALSE;
    Py_ssize_t n = spans != NULL ? spans->n : PyList_GET_SIZE(items);
    if (n == 0) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t size;
        if (spans != NULL)
            size = spans->at[2 * i + 1];
        else {
            PyObject *body = PyList_GET_ITEM(items, i);
            if (!PyBytes_CheckExact(body)) Py_RETURN_FALSE;
            size = PyBytes_GET_SIZE(body);
        }
        if (size > s->max_body || HEAD_SIZE + size + MAX_NAME + FRAME_OVERHEAD > s->chunk_size)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* --- the answer: SendColumns packed as msgpack, as msgpack.packb(list(columns),
 * use_bin_type=True) packs it, byte for byte (records.pack_columns) --- */

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
} Out;

static int out_room(Out *o, Py_ssize_t n) {
    if (o->len + n <= o->cap) return 0;
    Py_ssize_t cap = (o->cap + n) * 2;
    char *buf = PyMem_Realloc(o->buf, (size_t)cap);
    if (buf == NULL) return -1;
    o->buf = buf;
    o->cap = cap;
    return 0;
}

/* A header of a fix/8/16/32 family (fix: n <= fix_max, marked fix_base | n). */
static int pack_head(Out *o, uint64_t n, int fix_base, long long fix_max, int m8, int m16,
                     int m32) {
    if (out_room(o, 9) < 0) return -1;
    o->len += put_head(o->buf + o->len, n, fix_base, fix_max, m8, m16, m32);
    return 0;
}

static int pack_str(Out *o, PyObject *s) {
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(s, &n);
    if (utf8 == NULL || pack_head(o, (uint64_t)n, 0xa0, 31, 0xd9, 0xda, 0xdb) < 0 ||
        out_room(o, n) < 0)
        return -1;
    memcpy(o->buf + o->len, utf8, (size_t)n);
    o->len += n;
    return 0;
}

/* 1 packed; 0 not an exact int >= 0 below 2**64 (the caller packs it otherwise). */
static int pack_uint(Out *o, PyObject *v) {
    if (!PyLong_CheckExact(v)) return 0;
    unsigned long long u = PyLong_AsUnsignedLongLong(v);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (out_room(o, 9) < 0) return -1;
    o->len += put_uint(o->buf + o->len, u);
    return 1;
}

/* pack_columns(columns) -> bytes, or None when a value is not of the answer's types
 * (the caller packs it with msgpack, which raises what it raises). */
PyObject *pack_columns(PyObject *self, PyObject *columns) {
    if (!PyTuple_Check(columns) || PyTuple_GET_SIZE(columns) != 6 ||
        !PyUnicode_CheckExact(PyTuple_GET_ITEM(columns, 0)))
        Py_RETURN_NONE;
    for (int k = 1; k < 6; k++)
        if (!PyList_CheckExact(PyTuple_GET_ITEM(columns, k))) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(PyTuple_GET_ITEM(columns, 1));
    Out o = {PyMem_Malloc(64 + (size_t)n * 64), 0, 64 + n * 64};
    if (o.buf == NULL) return PyErr_NoMemory();
    int plain = 1;
    if (pack_head(&o, 6, 0x90, 15, 0, 0xdc, 0xdd) < 0 ||
        pack_str(&o, PyTuple_GET_ITEM(columns, 0)) < 0)
        goto fail;
    for (int k = 1; k < 6 && plain; k++) {
        PyObject *column = PyTuple_GET_ITEM(columns, k);
        if (PyList_GET_SIZE(column) != n) { /* msgpack would pack it; the answer is not */
            plain = 0;
            break;
        }
        if (pack_head(&o, (uint64_t)n, 0x90, 15, 0, 0xdc, 0xdd) < 0) goto fail;
        for (Py_ssize_t i = 0; i < n && plain; i++) {
            PyObject *v = PyList_GET_ITEM(column, i);
            if (k == 1) {
                if (!PyUnicode_CheckExact(v)) plain = 0;
                else if (pack_str(&o, v) < 0) goto fail;
            } else if (k == 5) {
                if (!PyFloat_CheckExact(v) || out_room(&o, 9) < 0) {
                    if (PyErr_Occurred()) goto fail;
                    plain = 0;
                } else {
                    double d = PyFloat_AS_DOUBLE(v);
                    uint64_t bits;
                    memcpy(&bits, &d, 8);
                    o.buf[o.len] = (char)0xcb;
                    put_be(o.buf + o.len + 1, bits, 8);
                    o.len += 9;
                }
            } else {
                int r = pack_uint(&o, v);
                if (r < 0) goto fail;
                plain = r;
            }
        }
    }
    PyObject *result = plain ? PyBytes_FromStringAndSize(o.buf, o.len) : Py_NewRef(Py_None);
    PyMem_Free(o.buf);
    return result;
fail:
    PyMem_Free(o.buf);
    return NULL;
}

/* --- the answer read back (the clients): records.unpack_send_columns --- */

/* results_of_columns(value, result_type) -> list of result_type(id, topic, queue id,
 * offset, position, stored_at), or None when value is not [str, five lists of one
 * length] of str ids, uints below 2**63 (exact ints: a bool is not one) and floats:
 * the Python code then says what is wrong. */
PyObject *results_of_columns(PyObject *self, PyObject *args) {
    PyObject *value, *result_type;
    if (!PyArg_ParseTuple(args, "OO", &value, &result_type)) return NULL;
    if (!PyList_CheckExact(value) || PyList_GET_SIZE(value) != 6 ||
        !PyUnicode_CheckExact(PyList_GET_ITEM(value, 0)))
        Py_RETURN_NONE;
    PyObject *cols[5];
    for (int k = 0; k < 5; k++) {
        cols[k] = PyList_GET_ITEM(value, k + 1);
        if (!PyList_CheckExact(cols[k])) Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(cols[0]);
    for (int k = 1; k < 5; k++)
        if (PyList_GET_SIZE(cols[k]) != n) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyUnicode_CheckExact(PyList_GET_ITEM(cols[0], i)) ||
            !PyFloat_CheckExact(PyList_GET_ITEM(cols[4], i)))
            Py_RETURN_NONE;
        for (int k = 1; k < 4; k++) {
            PyObject *v = PyList_GET_ITEM(cols[k], i);
            if (!PyLong_CheckExact(v)) Py_RETURN_NONE;
            int overflow = 0;
            long long u = PyLong_AsLongLongAndOverflow(v, &overflow);
            if (overflow || u < 0) {
                PyErr_Clear();
                Py_RETURN_NONE;
            }
        }
    }
    PyObject *topic = PyList_GET_ITEM(value, 0), *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *fields[6] = {PyList_GET_ITEM(cols[0], i), topic, PyList_GET_ITEM(cols[1], i),
                               PyList_GET_ITEM(cols[2], i), PyList_GET_ITEM(cols[3], i),
                               PyList_GET_ITEM(cols[4], i)};
        PyObject *r = PyObject_Vectorcall(result_type, fields, 6, NULL);
        if (r == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, r);
    }
    return out;
}

/* all_bytes(items) -> whether items is a non-empty list of bytes objects alone. */
PyObject *all_bytes(PyObject *self, PyObject *items) {
    if (!PyList_CheckExact(items) || PyList_GET_SIZE(items) == 0) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++)
        if (!PyBytes_CheckExact(PyList_GET_ITEM(items, i))) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* packed_answer(topic, count, columns) -> the send_bodies answer around five columns of
 * count packed items each (bytearrays, append_bodies' packed form): what
 * records.packed_answer joins in Python (and what pack_columns gives for the same
 * results), in one allocation; None when the arguments are not of those types. */
PyObject *packed_answer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyUnicode_CheckExact(args[0]) || !PyLong_CheckExact(args[1]) ||
        !PyList_CheckExact(args[2]) || PyList_GET_SIZE(args[2]) != 5)
        Py_RETURN_NONE;
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    if (count < 0 || count > (Py_ssize_t)0xffffffffLL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t tlen;
    const char *topic = PyUnicode_AsUTF8AndSize(args[0], &tlen);
    if (topic == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t size = 1 + 5 + tlen + 5 * 5;
    for (int k = 0; k < 5; k++) {
        PyObject *column = PyList_GET_ITEM(args[2], k);
        if (!PyByteArray_CheckExact(column)) Py_RETURN_NONE;
        size += PyByteArray_GET_SIZE(column);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (out == NULL) return NULL;
    char *start = PyBytes_AS_STRING(out), *p = start;
    *p++ = (char)0x96;
    p += put_head(p, (uint64_t)tlen, 0xa0, 31, 0xd9, 0xda, 0xdb);
    memcpy(p, topic, (size_t)tlen);
    p += tlen;
    for (int k = 0; k < 5; k++) {
        PyObject *column = PyList_GET_ITEM(args[2], k);
        p += put_head(p, (uint64_t)count, 0x90, 15, 0, 0xdc, 0xdd);
        memcpy(p, PyByteArray_AS_STRING(column), (size_t)PyByteArray_GET_SIZE(column));
        p += PyByteArray_GET_SIZE(column);
    }
    if (_PyBytes_Resize(&out, p - start) < 0) return NULL;
    return out;
}
