/* The write side: the common valid case of a send checked (check_batch, and
 * check_fields for Sender), and a batch's records framed into the mapped log chunk
 * with their queue entries (write_run). */
#include "speedups.h"

/* --- checking a send ------------------------------------------------------------ */


void release_checked(Checked *c) {
    Py_CLEAR(c->tag_bytes);
    Py_CLEAR(c->hashed_obj);
    Py_CLEAR(c->key_bytes);
}

/* The common, valid case of validate.check_message: 1 with *out filled, 0 (nothing
 * set) when the message needs the Python checks, which then raise or handle it, or -1
 * with the exception check_tag raised. */
int check_fields(PyObject *body, PyObject *tag, PyObject *key, PyObject *props,
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

PyObject *checked_tuple(PyObject *body, PyObject *tag, PyObject *key, PyObject *props,
                        PyObject *code, PyObject *queue_id, PyObject *tag_check,
                        Py_ssize_t max_body, Py_ssize_t chunk_size, Py_ssize_t queue_count) {
    Checked c;
    int ok = check_fields(body, tag, key, props, code, queue_id, tag_check, max_body,
                          chunk_size, queue_count, &c);
    if (ok <= 0) return NULL;
    /* new_record steals the three references check_fields took */
    PyObject *items[8] = {Py_NewRef(c.body),  c.tag_bytes,          c.hashed_obj,
                          c.key_bytes,        Py_NewRef(c.key),     Py_NewRef(c.props),
                          Py_NewRef(c.code_obj), Py_NewRef(c.queue_id)};
    return new_record(&PyTuple_Type, 8, items);
}

/* The checked 8-tuple of one OutgoingMessage, or NULL with no exception set when the
 * message needs the Python checks. */
static PyObject *check_fast(PyObject *msg, PyObject *tag_check, Py_ssize_t max_body,
                            Py_ssize_t chunk_size, Py_ssize_t queue_count) {
    return checked_tuple(PyTuple_GET_ITEM(msg, 0), PyTuple_GET_ITEM(msg, 1),
                         PyTuple_GET_ITEM(msg, 2), PyTuple_GET_ITEM(msg, 3),
                         PyTuple_GET_ITEM(msg, 4), PyTuple_GET_ITEM(msg, 5), tag_check, max_body,
                         chunk_size, queue_count);
}

/* check_batch(items, outgoing_type, slow, tag_check, max_body, chunk_size, queue_count)
 * -> list of checked tuples. An item that is neither bytes nor a plain OutgoingMessage
 * of the common kind goes through slow(item), which checks it in Python. */
PyObject *check_batch(PyObject *self, PyObject *args) {
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
int frame_raw(char *p, Py_ssize_t length, int64_t position, int64_t now_ns, int64_t offset,
              int32_t q, int32_t code, uint32_t hashed, int has_key, PyObject *topic_bytes,
              PyObject *tag_bytes, PyObject *key_bytes, PyObject *props, const char *body,
              Py_ssize_t bl) {
    Py_ssize_t topic_len = PyBytes_GET_SIZE(topic_bytes), tl = PyBytes_GET_SIZE(tag_bytes);
    Py_ssize_t kl = PyBytes_GET_SIZE(key_bytes), pl = PyBytes_GET_SIZE(props);
    char *h = put_record_start(p, length, position, now_ns, offset, q);
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
    memcpy(w, body, (size_t)bl);
    w += bl;
    put_u32(w, checksum(h, length));
    put_u32(w + 4, (uint32_t)length);
    return 0;
}

/* frame_raw with the body a bytes object. */
int frame_message(char *p, Py_ssize_t length, int64_t position, int64_t now_ns,
                  int64_t offset, int32_t q, int32_t code, uint32_t hashed, int has_key,
                  PyObject *topic_bytes, PyObject *tag_bytes, PyObject *key_bytes,
                  PyObject *props, PyObject *body) {
    return frame_raw(p, length, position, now_ns, offset, q, code, hashed, has_key, topic_bytes,
                     tag_bytes, key_bytes, props, PyBytes_AS_STRING(body), PyBytes_GET_SIZE(body));
}

/* The fields of a checked 8-tuple (all borrowed), or -1 with TypeError. */
int unpack_checked(PyObject *c, Checked *out) {
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
 * published: the caller raises data_end of each chunk it wrote. room and queue_sizes
 * are the chunks' writable ends (Chunk.writable_end): nothing is written where no disk
 * block is allocated yet. taken[q] is the
 * number of entries written to queue q, keyed the (key, position) of keyed messages.
 * queue_maps[q] is None when queue q has no chunk (it then takes nothing). */
PyObject *write_run(PyObject *self, PyObject *args) {
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
        } else if (key != Py_None) {
            if ((q = queue_for_key(xxh32, key_bytes, count)) < 0) goto done;
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
        PyObject *result;
        if (result_type == (PyObject *)&SendResultType) { /* the batch's one float */
            result = lazy_send_result(id_prefix, topic, q, offset, position, now_ns, stored_at);
        } else {
            PyObject *fields[6] = {message_id(id_prefix, position), Py_NewRef(topic),
                                   PyLong_FromSsize_t(q), PyLong_FromLongLong(offset),
                                   PyLong_FromLongLong(position), Py_NewRef(stored_at)};
            result = new_record((PyTypeObject *)result_type, 6, fields);
        }
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
