/* The Spark batch source's columns (equeue/spark/columns.py): the records of a block of
 * checked frames (ChunkFile.frame_blocks, which verified every frame's lengths and
 * checksum) laid out as the buffers of Arrow arrays, which pyarrow then wraps without
 * copying (pa.Array.from_buffers). Python builds the same bytes where this is not built
 * (columns.py: record_columns_py, record_bodies_py); tests/test_spark_source.py holds the
 * two to each other. */
#include "speedups.h"

/* A bytes object of n bytes, NULL with MemoryError. */
static PyObject *new_bytes(Py_ssize_t n) { return PyBytes_FromStringAndSize(NULL, n); }

/* Python's floor division by 1000 (ns to the µs of Arrow/Spark timestamps), also for
 * times before 1970. */
static inline int64_t floor_us(int64_t ns) {
    int64_t q = ns / 1000;
    return (ns % 1000 < 0) ? q - 1 : q;
}

/* The head of the record framed at buf + offset, if the frame lies in the buffer and its
 * lengths add up (the head's field lengths to the frame's payload length); else NULL. */
static inline const char *head_at(const char *buf, Py_ssize_t len, int64_t offset) {
    if (offset < 0 || offset > (int64_t)len - 4 - HEAD_SIZE) return NULL;
    const char *h = buf + offset + 4;
    uint32_t n = get_u32(buf + offset);
    if ((int64_t)n > (int64_t)len - offset - 4 || n < (uint32_t)HEAD_SIZE) return NULL;
    uint64_t sum = (uint64_t)HEAD_SIZE + (uint8_t)h[45] + (uint8_t)h[46] + (uint8_t)h[47] +
                   get_u32(h + 48) + get_u32(h + 52);
    return sum == n ? h : NULL;
}

/* record_columns(buf, offsets, id_prefix) -> (done, queue_id, queue_offset, position,
 *     created_us, stored_us, topic_offsets, topic_data, tag_offsets, tag_data,
 *     key_offsets, key_data, key_valid, ids, props)
 *
 * For the frames at the given offsets of buf (little-endian int64, as frame_offsets
 * packs them): the fixed-width fields as packed little-endian arrays; topic, tag and key
 * as int32 offsets (n + 1) and one data buffer; the key's validity bitmap (a bit per
 * row, LSB first: the record has a key); the message ids (24 ASCII bytes each:
 * id_prefix, then the position in 16 hex digits); and (row, start in buf, length) as
 * int64 triples for each record with properties. ``done`` is the number of records
 * laid out: less than all only where a record's lengths do not add up (the caller
 * names that one). */
PyObject *record_columns(PyObject *self, PyObject *args) {
    PyObject *buf, *offsets, *prefix;
    if (!PyArg_ParseTuple(args, "OSU", &buf, &offsets, &prefix)) return NULL;
    if (!configured()) return NULL;
    if (!PyUnicode_IS_COMPACT_ASCII(prefix) || PyUnicode_GET_LENGTH(prefix) != 8) {
        PyErr_SetString(PyExc_ValueError, "id_prefix must be 8 ASCII characters");
        return NULL;
    }
    const char *pre = (const char *)PyUnicode_1BYTE_DATA(prefix);
    Py_buffer view;
    if (PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE) < 0) return NULL;
    const char *data = (const char *)view.buf;
    const char *offs = PyBytes_AS_STRING(offsets);
    Py_ssize_t n = PyBytes_GET_SIZE(offsets) / 8, done = 0;
    Py_ssize_t tl_sum = 0, gl_sum = 0, kl_sum = 0, nprops = 0;
    /* First pass: check every head and size the variable-width buffers. */
    for (; done < n; done++) {
        const char *h = head_at(data, view.len, get_i64(offs + done * 8));
        if (h == NULL) break;
        tl_sum += (uint8_t)h[45];
        gl_sum += (uint8_t)h[46];
        if (h[44] & FLAG_HAS_KEY) kl_sum += (uint8_t)h[47]; /* (as the second pass copies) */
        nprops += get_u32(h + 48) != 0;
    }
    n = done;
    PyObject *out[14] = {
        new_bytes(n * 4),       new_bytes(n * 8),       new_bytes(n * 8),
        new_bytes(n * 8),       new_bytes(n * 8),       new_bytes((n + 1) * 4),
        new_bytes(tl_sum),      new_bytes((n + 1) * 4), new_bytes(gl_sum),
        new_bytes((n + 1) * 4), new_bytes(kl_sum),      new_bytes((n + 7) / 8),
        new_bytes(n * 24),      new_bytes(nprops * 24),
    };
    for (int i = 0; i < 14; i++) {
        if (out[i] == NULL) {
            for (int j = 0; j < 14; j++) Py_XDECREF(out[j]);
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    char *qid = PyBytes_AS_STRING(out[0]), *qoff = PyBytes_AS_STRING(out[1]);
    char *pos = PyBytes_AS_STRING(out[2]), *created = PyBytes_AS_STRING(out[3]);
    char *stored = PyBytes_AS_STRING(out[4]);
    char *to = PyBytes_AS_STRING(out[5]), *td = PyBytes_AS_STRING(out[6]);
    char *go = PyBytes_AS_STRING(out[7]), *gd = PyBytes_AS_STRING(out[8]);
    char *ko = PyBytes_AS_STRING(out[9]), *kd = PyBytes_AS_STRING(out[10]);
    uint8_t *kv = (uint8_t *)PyBytes_AS_STRING(out[11]);
    char *ids = PyBytes_AS_STRING(out[12]), *props = PyBytes_AS_STRING(out[13]);
    static const char hex[] = "0123456789abcdef";
    Py_BEGIN_ALLOW_THREADS /* the buffer is held; the outputs are not shared yet */
    memset(kv, 0, (size_t)((n + 7) / 8));
    int32_t tpos = 0, gpos = 0, kpos = 0;
    Py_ssize_t p = 0;
    put_i32(to, 0);
    put_i32(go, 0);
    put_i32(ko, 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t offset = get_i64(offs + i * 8);
        const char *h = data + offset + 4;
        int64_t position = get_i64(h);
        put_i32(qid + i * 4, get_i32(h + 32));
        put_i64(qoff + i * 8, get_i64(h + 24));
        put_i64(pos + i * 8, position);
        put_i64(created + i * 8, floor_us(get_i64(h + 16)));
        put_i64(stored + i * 8, floor_us(get_i64(h + 8)));
        uint32_t tl = (uint8_t)h[45], gl = (uint8_t)h[46], kl = (uint8_t)h[47];
        uint32_t pl = get_u32(h + 48);
        const char *s = h + HEAD_SIZE;
        memcpy(td + tpos, s, tl);
        tpos += (int32_t)tl;
        put_i32(to + (i + 1) * 4, tpos);
        memcpy(gd + gpos, s + tl, gl);
        gpos += (int32_t)gl;
        put_i32(go + (i + 1) * 4, gpos);
        if (h[44] & FLAG_HAS_KEY) {
            memcpy(kd + kpos, s + tl + gl, kl);
            kpos += (int32_t)kl;
            kv[i / 8] |= (uint8_t)(1u << (i % 8));
        }
        put_i32(ko + (i + 1) * 4, kpos);
        char *id = ids + i * 24;
        memcpy(id, pre, 8);
        uint64_t v = (uint64_t)position;
        for (int d = 15; d >= 0; d--) {
            id[8 + d] = hex[v & 15];
            v >>= 4;
        }
        if (pl != 0) {
            put_i64(props + p * 24, (int64_t)i);
            put_i64(props + p * 24 + 8, (int64_t)(s + tl + gl + kl - data));
            put_i64(props + p * 24 + 16, (int64_t)pl);
            p++;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyObject *result = PyTuple_New(15);
    if (result == NULL) {
        for (int j = 0; j < 14; j++) Py_DECREF(out[j]);
        return NULL;
    }
    PyTuple_SET_ITEM(result, 0, PyLong_FromSsize_t(n));
    if (PyTuple_GET_ITEM(result, 0) == NULL) {
        for (int j = 0; j < 14; j++) Py_DECREF(out[j]);
        Py_DECREF(result);
        return NULL;
    }
    for (int j = 0; j < 14; j++) PyTuple_SET_ITEM(result, j + 1, out[j]);
    return result;
}

/* record_bodies(buf, offsets) -> (done, body_offsets, body_data)
 *
 * The bodies of the frames at the given offsets gathered into one buffer, with int32
 * offsets (n + 1); ``done`` as record_columns's. A block's bodies are fewer bytes than a
 * chunk's data area (at most 2 GiB, with frames and heads), so int32 offsets hold. */
PyObject *record_bodies(PyObject *self, PyObject *args) {
    PyObject *buf, *offsets;
    if (!PyArg_ParseTuple(args, "OS", &buf, &offsets)) return NULL;
    if (!configured()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE) < 0) return NULL;
    const char *data = (const char *)view.buf;
    const char *offs = PyBytes_AS_STRING(offsets);
    Py_ssize_t n = PyBytes_GET_SIZE(offsets) / 8, done = 0;
    int64_t total = 0;
    for (; done < n; done++) {
        const char *h = head_at(data, view.len, get_i64(offs + done * 8));
        if (h == NULL || total + get_u32(h + 52) > INT32_MAX) break;
        total += get_u32(h + 52);
    }
    n = done;
    PyObject *bo = new_bytes((n + 1) * 4), *bd = new_bytes((Py_ssize_t)total);
    if (bo == NULL || bd == NULL) {
        Py_XDECREF(bo);
        Py_XDECREF(bd);
        PyBuffer_Release(&view);
        return NULL;
    }
    char *o = PyBytes_AS_STRING(bo), *d = PyBytes_AS_STRING(bd);
    Py_BEGIN_ALLOW_THREADS
    int32_t at = 0;
    put_i32(o, 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *h = data + get_i64(offs + i * 8) + 4;
        uint32_t bl = get_u32(h + 52);
        const char *body = h + get_u32(h - 4) - bl; /* the body ends the payload */
        memcpy(d + at, body, bl);
        at += (int32_t)bl;
        put_i32(o + (i + 1) * 4, at);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(nNN)", n, bo, bd);
}
