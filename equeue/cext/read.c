/* The read side: a pull's run of records decoded and checked (decode_run), the
 * untagged pull's check of each message against its queue entry (collect), and the
 * streaming reader's walk over a block of frames (frame_offsets, chunks/stream.py). */
#include "speedups.h"

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

typedef struct {
    PyObject *topic; /* borrowed from the message */
    long long queue_id, queue_offset;
    uint32_t hash;
} Head;

/* The record at ``position`` of a chunk whose data area is data[0:data_end] and whose
 * first position is ``base``, checked (length, suffix, checksum, the head's own
 * position) and decoded as a message_type (the C Message, or a NamedTuple class), with its
 * topic, queue id, queue offset and stored tag hash in *head; Py_None (a new
 * reference) where anything is off, for the caller to read the slow way, which raises
 * the precise error; NULL with an exception for an error not about the record. */
static PyObject *decode_record(const char *data, Py_ssize_t data_end, long long base,
                               long long position, Last *topic_cache, Last *tag_cache,
                               PyObject *message_type, PyObject *id_prefix,
                               PyObject *decode_props, Head *head) {
    /* The positions come from queue entries, which a damaged file can set to anything:
     * every comparison below is arranged so that no value can overflow. */
    if (position < base || position - base > (long long)(data_end - FRAME_OVERHEAD - HEAD_SIZE))
        Py_RETURN_NONE; /* not a record here: the Python path names the problem */
    long long local = position - base;
    const char *p = data + local;
    uint32_t length = get_u32(p);
    if (length < (uint32_t)HEAD_SIZE ||
        (long long)length > (long long)data_end - local - FRAME_OVERHEAD)
        Py_RETURN_NONE;
    const char *h = p + 4;
    if (get_u32(h + length + 4) != length) Py_RETURN_NONE;
    if (get_i64(h) != position) Py_RETURN_NONE;
    uint32_t tl = (uint8_t)h[45], gl = (uint8_t)h[46], kl = (uint8_t)h[47];
    uint32_t pl = get_u32(h + 48), bl = get_u32(h + 52);
    if ((uint64_t)HEAD_SIZE + tl + gl + kl + pl + bl != length) Py_RETURN_NONE;
    if (checksum(h, (Py_ssize_t)length) != get_u32(h + length)) Py_RETURN_NONE;

    const char *s = h + HEAD_SIZE;
    PyObject *topic = decode_cached(topic_cache, s, tl);
    s += tl;
    PyObject *tag = topic == NULL ? NULL : decode_cached(tag_cache, s, gl);
    s += gl;
    PyObject *key = NULL;
    if (tag != NULL)
        key = (h[44] & FLAG_HAS_KEY) ? PyUnicode_DecodeUTF8(s, kl, "strict") : Py_NewRef(Py_None);
    s += kl;
    /* The C Message makes an empty properties dict when it is first read. */
    int lazy = message_type == (PyObject *)&MessageType;
    PyObject *props = NULL;
    if (key != NULL) {
        if (pl == 0) {
            props = lazy ? Py_NewRef(Py_None) : PyDict_New();
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
        if (PyErr_ExceptionMatches(PyExc_MemoryError) || !PyErr_ExceptionMatches(PyExc_Exception))
            return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    long long queue_id = get_i32(h + 32), queue_offset = get_i64(h + 24);
    head->topic = topic;
    head->queue_id = queue_id;
    head->queue_offset = queue_offset;
    head->hash = get_u32(h + 40);
    if (lazy) {
        if (props == Py_None) Py_CLEAR(props);
        return lazy_message(id_prefix, topic, tag, key, props, PyBytes_FromStringAndSize(s, bl),
                            position, queue_id, queue_offset, get_i32(h + 36), get_i64(h + 16),
                            get_i64(h + 8));
    }
    PyObject *fields[12] = {
        message_id(id_prefix, position),
        topic,
        PyLong_FromLongLong(queue_id),
        PyLong_FromLongLong(queue_offset),
        PyLong_FromLongLong(position),
        tag,
        key,
        props,
        PyLong_FromLong(get_i32(h + 36)),
        PyBytes_FromStringAndSize(s, bl),
        PyLong_FromLongLong(get_i64(h + 16)),
        PyLong_FromLongLong(get_i64(h + 8)),
    };
    /* (A tuple is left tracked by the garbage collector, as the Python path's are: a
     * caller may put the message itself into its properties dict.) */
    return new_record((PyTypeObject *)message_type, 12, fields);
}

/* decode_run(mm, data_offset, data_end, base, positions, message_type, id_prefix,
 *            decode_properties) -> list of (Message, stored tag hash) or None
 *
 * For each position of a chunk that is not compacted: decode_record's message and tag
 * hash, or None where it found the record not intact; the caller reads that one again
 * the slow way, which raises the precise error. */
PyObject *decode_run(PyObject *self, PyObject *args) {
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
        if (overflow) continue;
        Head head;
        PyObject *message = decode_record(data, data_end, base, position, &topic_cache,
                                          &tag_cache, message_type, id_prefix, decode_props,
                                          &head);
        if (message == NULL) goto fail;
        if (message == Py_None) {
            Py_DECREF(message);
            continue;
        }
        PyObject *pair = Py_BuildValue("(NI)", message, (unsigned int)head.hash);
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

/* --- pull_chunk ----------------------------------------------------------------- */

/* pull_chunk(mm, data_offset, data_end, base, entries, first, offset, queue_id, topic,
 *            room, out, message_type, id_prefix, decode_properties) -> taken
 *
 * An untagged pull's run through one log chunk (not compacted), without the lists and
 * dicts of decode_run and collect: ``entries`` is a block of raw queue records (the
 * QUEUE_RECORD layout: int64 position + 1, uint32 tag hash), as the queue file holds
 * them; from record ``first`` (the entry for queue offset ``offset``) on, each record
 * the entry names is decoded as decode_record does, checked against its entry (queue
 * offset, queue id, topic, tag hash) and appended to out, until out holds ``room`` more
 * messages. Stops before the first entry that is anything else: a position outside
 * this chunk, a record not intact, a message that does not match its entry; the caller
 * goes on from there (the next chunk, or the general path, which raises the precise
 * error). Returns how many entries it took. */
PyObject *pull_chunk(PyObject *self, PyObject *args) {
    PyObject *mm, *entries, *topic, *out, *message_type, *id_prefix, *decode_props;
    Py_ssize_t data_offset, data_end, room, first;
    long long base, offset, queue_id;
    if (!PyArg_ParseTuple(args, "OnnLOnLLUnO!O!UO", &mm, &data_offset, &data_end, &base,
                          &entries, &first, &offset, &queue_id, &topic, &room, &PyList_Type,
                          &out, &PyType_Type, &message_type, &id_prefix, &decode_props))
        return NULL;
    if (!configured()) return NULL;
    if (!PyUnicode_IS_COMPACT_ASCII(id_prefix)) {
        PyErr_SetString(PyExc_ValueError, "id_prefix must be ASCII");
        return NULL;
    }
    if (!PyUnicode_CheckExact(topic)) return PyLong_FromLong(0); /* the general path's */
    Py_buffer view, block;
    if (PyObject_GetBuffer(entries, &block, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(mm, &view, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&block);
        return NULL;
    }
    Last topic_cache = {0}, tag_cache = {0};
    Py_ssize_t taken = -1, count = block.len / QUEUE_RECORD;
    if (data_offset < 0 || data_end < 0 || base < 0 || data_offset + data_end > view.len) {
        PyErr_SetString(PyExc_ValueError, "the data area lies outside the mapping");
        goto done;
    }
    if (first < 0 || first > count) {
        PyErr_SetString(PyExc_ValueError, "first lies outside the entries");
        goto done;
    }
    const char *data = (const char *)view.buf + data_offset;
    /* The topic's str, so that a matching message shares it, as decode_run's do. */
    topic_cache.str = Py_NewRef(topic);
    topic_cache.bytes = PyUnicode_AsUTF8AndSize(topic, &topic_cache.len);
    if (topic_cache.bytes == NULL) goto done;
    Py_ssize_t k = 0;
    for (; k < room && first + k < count; k++) {
        const char *entry = (const char *)block.buf + (first + k) * QUEUE_RECORD;
        long long stored = get_i64(entry), hashed = get_u32(entry + 8);
        if (stored <= 0) break; /* (no position) */
        long long position = stored - 1;
        if (position < base || position - base >= (long long)data_end) break;
        Head head;
        PyObject *message = decode_record(data, data_end, base, position, &topic_cache,
                                          &tag_cache, message_type, id_prefix, decode_props,
                                          &head);
        if (message == NULL) goto done;
        if (message == Py_None) {
            Py_DECREF(message);
            break;
        }
        if (head.topic != topic || head.queue_offset != offset + k ||
            head.queue_id != queue_id || (long long)head.hash != hashed) {
            Py_DECREF(message);
            break;
        }
        int appended = PyList_Append(out, message);
        Py_DECREF(message);
        if (appended < 0) goto done;
    }
    taken = k;
done:
    Py_XDECREF(topic_cache.str);
    Py_XDECREF(tag_cache.str);
    PyBuffer_Release(&view);
    PyBuffer_Release(&block);
    return taken < 0 ? NULL : PyLong_FromSsize_t(taken);
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
PyObject *collect(PyObject *self, PyObject *args) {
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
        PyObject *message = PyTuple_GET_ITEM(pair, 0), *message_topic;
        long long qoff, qid;
        if (message_check_fields(message, &message_topic, &qid, &qoff) < 0) return NULL;
        int same_topic = PyUnicode_Compare(message_topic, topic);
        if (same_topic == -1 && PyErr_Occurred()) return NULL;
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

/* --- frame_offsets -------------------------------------------------------------- */

/* frame_offsets(buf, start, end) -> (offset, offsets)
 *
 * The streaming reader's walk (chunks/stream.py) over buf[start:end]: the same checks as
 * scan_frames (a non-zero length, the frame wholly before end, matching suffix and
 * checksum), and also each valid frame's offset in buf, packed as little-endian int64 in
 * the bytes ``offsets``. Stops at the first frame that is not such and returns its
 * offset; the caller reads more, or looks at that frame in Python, which says what is
 * wrong with it. */
PyObject *frame_offsets(PyObject *self, PyObject *args) {
    PyObject *buf;
    Py_ssize_t offset, end;
    if (!PyArg_ParseTuple(args, "Onn", &buf, &offset, &end)) return NULL;
    Py_buffer view;
    if (get_range(buf, &view, offset, end) < 0) return NULL;
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
    uint32_t n;
    while ((n = valid_frame(data, offset, end, PY_SSIZE_T_MAX)) != 0) {
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
