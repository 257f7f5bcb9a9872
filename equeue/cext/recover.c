/* Recovery at open: the walk over the last chunk's frames (scan_frames), the
 * re-dispatch of records whose queue entries are in place (match_run), and the search
 * for the last non-zero byte past a cut (last_nonzero). */
#include "speedups.h"

/* --- scan_frames ---------------------------------------------------------------- */

/* scan_frames(buf, data_offset, available, max_length, start) -> (offset, count)
 *
 * Recovery's walk over the framed records of a chunk's data area from ``start``: every
 * frame with a non-zero length up to max_length, inside the ``available`` bytes, whose
 * suffix and checksum match. Stops at the first frame that is not such (or at a zero
 * length) and returns its data offset and how many records came before; the caller
 * looks at that frame again in Python, which says what is wrong with it. */
PyObject *scan_frames(PyObject *self, PyObject *args) {
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
    uint32_t n;
    while ((n = valid_frame(data, offset, available, max_length)) != 0) {
        count++;
        offset += n + 12;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(nn)", offset, count);
}

/* --- match_run ------------------------------------------------------------------ */

/* match_run(mm, data_offset, start, end, base, verify, queues, key_from, keyed, touched)
 * -> (stop, matched)
 *
 * Recovery's re-dispatch, for the records whose queue entry is already in place (all
 * but the last few after a crash): walks the frames of one uncompacted log chunk from
 * data offset start to end and, while each record's entry matches, goes on. queues maps
 * a topic's UTF-8 bytes to a list, per queue id, of [entries, first, count, seen, ...]:
 * entries is the mapping of the queue chunk holding offsets first..first+count-1 (data
 * area at data_offset, as in the log), and seen (written here) is one past the last
 * offset matched; each list whose seen is written is appended to touched. A keyed record at or past key_from is added to keyed as (topic, key,
 * position). With verify, each record's checksum is checked (a range the chunk's own
 * scan checked already need not be). It stops at the first record that is not a well
 * formed frame at its own position, or whose queue is not in queues, or whose entry is
 * not there or differs: the Python loop takes that one. */
typedef struct {
    PyObject *list; /* the [entries, first, count, seen, ...] list */
    Py_buffer view;
    Py_ssize_t first, count, seen;
} Target;

static int target_release(Target *t, PyObject *touched) {
    int r = 0;
    if (t->list != NULL && t->seen >= 0) {
        PyObject *v = PyLong_FromSsize_t(t->seen);
        r = v == NULL || PyList_SetItem(t->list, 3, v) < 0 ? -1 : PyList_Append(touched, t->list);
    }
    if (t->view.obj != NULL) PyBuffer_Release(&t->view);
    t->list = NULL;
    return r;
}

static int target_take(Target *t, PyObject *list, Py_ssize_t data_offset) {
    *t = (Target){.seen = -1};
    if (!PyList_Check(list) || PyList_GET_SIZE(list) < 4) return 0;
    t->first = PyLong_AsSsize_t(PyList_GET_ITEM(list, 1));
    t->count = PyLong_AsSsize_t(PyList_GET_ITEM(list, 2));
    if (PyErr_Occurred()) return -1;
    PyObject *entries = PyList_GET_ITEM(list, 0);
    if (entries == Py_None || t->first < 0 || t->count < 0) return 0;
    if (PyObject_GetBuffer(entries, &t->view, PyBUF_SIMPLE) < 0) return -1;
    if (data_offset + t->count * QUEUE_RECORD > t->view.len) {
        PyBuffer_Release(&t->view);
        PyErr_SetString(PyExc_ValueError, "a queue chunk's entries lie outside its mapping");
        return -1;
    }
    t->list = list;
    return 1;
}

PyObject *match_run(PyObject *self, PyObject *args) {
    PyObject *mm, *queues, *keyed, *touched;
    Py_ssize_t data_offset, start, end;
    long long base, key_from;
    int verify;
    if (!PyArg_ParseTuple(args, "OnnnLpO!LO!O!", &mm, &data_offset, &start, &end, &base,
                          &verify, &PyDict_Type, &queues, &key_from, &PyList_Type, &keyed,
                          &PyList_Type, &touched))
        return NULL;
    if (!configured()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(mm, &view, PyBUF_SIMPLE) < 0) return NULL;
    Target target = {.seen = -1};
    PyObject *topic_key = NULL, *topic_str = NULL, *topic_queues = NULL;
    Py_ssize_t offset = start, matched = 0;
    int failed = 0;
    if (data_offset < 0 || start < 0 || base < 0 || end > view.len - data_offset) {
        PyErr_SetString(PyExc_ValueError, "the data area lies outside the mapping");
        failed = 1;
        goto done;
    }
    const char *data = (const char *)view.buf + data_offset;
    while (offset + FRAME_OVERHEAD + HEAD_SIZE <= end) {
        const char *p = data + offset;
        uint32_t length = get_u32(p);
        if (length < (uint32_t)HEAD_SIZE || (Py_ssize_t)length > end - offset - FRAME_OVERHEAD)
            break;
        const char *h = p + 4;
        if (get_u32(h + length + 4) != length || get_i64(h) != base + offset) break;
        uint32_t tl = (uint8_t)h[45], gl = (uint8_t)h[46], kl = (uint8_t)h[47];
        if ((uint64_t)HEAD_SIZE + tl + gl + kl + get_u32(h + 48) + get_u32(h + 52) != length)
            break;
        if (verify && checksum(h, (Py_ssize_t)length) != get_u32(h + length)) break;
        const char *topic = h + HEAD_SIZE;
        if (topic_key == NULL || PyBytes_GET_SIZE(topic_key) != (Py_ssize_t)tl ||
            memcmp(PyBytes_AS_STRING(topic_key), topic, tl) != 0) {
            Py_CLEAR(topic_key);
            Py_CLEAR(topic_str);
            if (target_release(&target, touched) < 0) goto fail;
            topic_key = PyBytes_FromStringAndSize(topic, tl);
            if (topic_key == NULL) goto fail;
            topic_queues = PyDict_GetItemWithError(queues, topic_key);
            if (topic_queues == NULL && PyErr_Occurred()) goto fail;
        }
        int32_t q = get_i32(h + 32);
        if (topic_queues == NULL || !PyList_Check(topic_queues) || q < 0 ||
            q >= PyList_GET_SIZE(topic_queues))
            break;
        PyObject *list = PyList_GET_ITEM(topic_queues, q);
        if (list != target.list) {
            if (target_release(&target, touched) < 0) goto fail;
            int r = target_take(&target, list, data_offset);
            if (r < 0) goto fail;
            if (r == 0) break;
        }
        int64_t qoff = get_i64(h + 24);
        if (qoff < target.first || qoff - target.first >= target.count) break;
        const char *slot = (const char *)target.view.buf + data_offset +
                           (qoff - target.first) * QUEUE_RECORD;
        if (get_i64(slot) != base + offset + 1 || get_u32(slot + 8) != get_u32(h + 40)) break;
        if ((h[44] & FLAG_HAS_KEY) && base + offset >= key_from) {
            if (topic_str == NULL &&
                (topic_str = PyUnicode_DecodeUTF8(topic, tl, "replace")) == NULL)
                goto fail;
            PyObject *row = Py_BuildValue("(ONL)", topic_str,
                                          PyUnicode_DecodeUTF8(topic + tl + gl, kl, "replace"),
                                          base + offset);
            if (row == NULL || PyList_Append(keyed, row) < 0) {
                Py_XDECREF(row);
                goto fail;
            }
            Py_DECREF(row);
        }
        target.seen = (Py_ssize_t)qoff + 1;
        matched++;
        offset += length + FRAME_OVERHEAD;
    }
    goto done;
fail:
    failed = 1;
done:
    if (target_release(&target, touched) < 0) failed = 1;
    Py_XDECREF(topic_key);
    Py_XDECREF(topic_str);
    PyBuffer_Release(&view);
    if (failed) return NULL;
    return Py_BuildValue("(nn)", offset, matched);
}

/* --- last_nonzero --------------------------------------------------------------- */

/* last_nonzero(buf, start, stop) -> one past the last non-zero byte of buf[start:stop],
 * or start if they are all zero. Scans backwards a word at a time. */
PyObject *last_nonzero(PyObject *self, PyObject *args) {
    PyObject *buf;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "Onn", &buf, &start, &stop)) return NULL;
    Py_buffer view;
    if (get_range(buf, &view, start, stop) < 0) return NULL;
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
