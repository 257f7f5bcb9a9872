#include "sender.h"
#include <time.h>

/* --- Sender: a whole single send in one call ------------------------------------
 *
 * MessageStore.send's common case: check the fields, take the write lock, frame the
 * record into the log chunk's mapping, write its queue entry, publish both and return
 * the SendResult, without a Python frame in between. The state stays where the Python
 * paths keep it (ChunkWriter._chunk, Chunk.data_end/record_count, Queue.next_offset,
 * the store's topic dicts), read and raised here exactly as Appender.append and
 * Chunk.publish do, so both paths can serve the same store one send after the other.
 * None (nothing written, the lock released) hands the send to the Python path: a new
 * topic, a field to check in Python, a chunk to complete or create, a closed store. */

static PyObject *S_acquire, *S_release, *S_is_owned, *S_wake, *S_add, *S_tag, *S_key,
    *S_properties, *S_code, *S_queue_id, *S_empty;

int intern_names(void) {
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    INTERN(S_acquire, "acquire") INTERN(S_release, "release") INTERN(S_is_owned, "_is_owned")
    INTERN(S_wake, "_wake") INTERN(S_add, "add") INTERN(S_tag, "tag") INTERN(S_key, "key")
    INTERN(S_properties, "properties") INTERN(S_code, "code") INTERN(S_queue_id, "queue_id")
    INTERN(S_empty, "")
#undef INTERN
    return sendstate_names();
}


static void forget_state(Sender *s) {
    s->store_seen.valid = s->clock_seen.valid = s->log_seen.valid = 0;
    for (int i = 0; i < WRITER_CACHE_SLOTS; i++) s->queue_seen[i] = (WriterCache){0};
    s->queue_slots = (QueueSlots){0};
}

static int Sender_traverse(Sender *s, visitproc visit, void *arg) {
    Py_VISIT(s->store); Py_VISIT(s->lock); Py_VISIT(s->writer); Py_VISIT(s->queues);
    Py_VISIT(s->topic_bytes); Py_VISIT(s->round_robin); Py_VISIT(s->keys);
    Py_VISIT(s->id_prefix); Py_VISIT(s->result_type); Py_VISIT(s->tag_check);
    Py_VISIT(s->xxh32); Py_VISIT(s->clock); Py_VISIT(s->fallback); Py_VISIT(s->time_ns); Py_VISIT(s->acquire); Py_VISIT(s->owned);
    Py_VISIT(s->release);
    return 0;
}

static int Sender_clear(Sender *s) {
    forget_state(s);
    Py_CLEAR(s->store); Py_CLEAR(s->lock); Py_CLEAR(s->writer); Py_CLEAR(s->queues);
    Py_CLEAR(s->topic_bytes); Py_CLEAR(s->round_robin); Py_CLEAR(s->keys);
    Py_CLEAR(s->id_prefix); Py_CLEAR(s->result_type); Py_CLEAR(s->tag_check);
    Py_CLEAR(s->xxh32); Py_CLEAR(s->clock); Py_CLEAR(s->fallback); Py_CLEAR(s->time_ns); Py_CLEAR(s->acquire); Py_CLEAR(s->owned);
    Py_CLEAR(s->release);
    return 0;
}

static void Sender_dealloc(Sender *s) {
    PyObject_GC_UnTrack(s);
    Sender_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* Sender(store, lock, writer, queues, topic_bytes, round_robin, keys, id_prefix,
 *        result_type, tag_check, xxh32, clock, data_offset, max_body, chunk_size
 *        [, fallback]) */
static int Sender_init(Sender *s, PyObject *args, PyObject *kwargs) {
    PyObject *o[12], *fallback = Py_None;
    Py_ssize_t data_offset, max_body, chunk_size;
    if (!configured()) return -1;
    if (s->store != NULL) { /* send() reads the fields while Python code runs */
        PyErr_SetString(PyExc_TypeError, "a Sender is initialised once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOOO!O!O!OUO!OOOnnn|O", &o[0], &o[1], &o[2], &PyDict_Type,
                          &o[3], &PyDict_Type, &o[4], &PyDict_Type, &o[5], &o[6], &o[7],
                          &PyType_Type, &o[8], &o[9], &o[10], &o[11], &data_offset, &max_body,
                          &chunk_size, &fallback))
        return -1;
    if (!PyUnicode_IS_COMPACT_ASCII(o[7]) ||
        !(o[8] == (PyObject *)&SendResultType ||
          PyType_IsSubtype((PyTypeObject *)o[8], &PyTuple_Type)) ||
        data_offset < 0 ||
        max_body < 0 || chunk_size < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "Sender: an ASCII id prefix, SendResult or a tuple type, sizes >= 0");
        return -1;
    }
    Sender_clear(s);
    PyObject **slots[12] = {&s->store,     &s->lock,      &s->writer,      &s->queues,
                            &s->topic_bytes, &s->round_robin, &s->keys,    &s->id_prefix,
                            &s->result_type, &s->tag_check, &s->xxh32,     &s->clock};
    for (int i = 0; i < 12; i++) *slots[i] = Py_NewRef(o[i]);
    s->fallback = fallback == Py_None ? NULL : Py_NewRef(fallback);
    /* The builtin, whatever the clock module holds now (a test may have replaced it) */
    PyObject *time_module = PyImport_ImportModule("time");
    s->time_ns = time_module == NULL ? NULL : PyObject_GetAttrString(time_module, "time_ns");
    Py_XDECREF(time_module);
    if (s->time_ns != NULL && !PyCFunction_Check(s->time_ns)) Py_CLEAR(s->time_ns);
    PyErr_Clear(); /* (without it, every send calls the clock) */
    s->acquire = PyObject_GetAttr(s->lock, S_acquire);
    s->release = PyObject_GetAttr(s->lock, S_release);
    s->owned = PyObject_GetAttr(s->lock, S_is_owned); /* an RLock's */
    if (s->acquire == NULL || s->release == NULL || s->owned == NULL) {
        Sender_clear(s);
        return -1;
    }
    s->lock_in_place = rlock_mirrorable(s->lock);
    s->data_offset = data_offset;
    s->max_body = max_body;
    s->chunk_size = chunk_size;
    return 0;
}

/* The send itself, with the write lock held: a SendResult, None (nothing written), or
 * NULL with an exception. */
static PyObject *send_locked(Sender *s, PyObject *topic, PyObject *queues, Checked *c) {
    PyObject *result = NULL, *queue = NULL, *qwriter = NULL, *topic_bytes = NULL;
    ChunkView log = {0}, entries = {0};
    Py_buffer lbuf = {0}, qbuf = {0};
    int r;

    if (store_state(s->store, &s->store_seen) < 0) return NULL;
    if (s->store_seen.closed) return Py_NewRef(Py_None);
    Py_ssize_t count = PyList_GET_SIZE(queues);
    topic_bytes = Py_XNewRef(PyDict_GetItemWithError(s->topic_bytes, topic));
    if (topic_bytes == NULL) goto fallback_or_fail;
    if (!PyBytes_Check(topic_bytes)) goto fallback;
    if ((r = writer_view(s->writer, &s->log_seen, 1, &log)) <= 0) goto fallback_or_fail;
    Py_ssize_t length = c->length + PyBytes_GET_SIZE(topic_bytes);
    /* Past the allocated blocks: Chunk.reserve or a new chunk, on the Python path */
    if (log.end + length + FRAME_OVERHEAD > log.size) goto fallback;

    Py_ssize_t q, turn = -1;
    PyObject *old_turn = NULL; /* borrowed: compared only while the dict is unchanged */
    uint64_t turns_version = 0;
    if (c->queue_id != Py_None) {
        q = PyLong_AsSsize_t(c->queue_id);
        if (q == -1 && PyErr_Occurred()) goto fail;
        if (q < 0 || q >= count) goto fallback;
    } else if (c->key != Py_None) {
        if ((q = queue_for_key(s->xxh32, c->key_bytes, count)) < 0) goto fail;
    } else {
        PyObject *t = PyDict_GetItemWithError(s->round_robin, topic);
        if (t == NULL) goto fallback_or_fail;
        turn = PyLong_AsSsize_t(t);
        if (turn < 0) goto fallback_or_fail;
        old_turn = t;
        turns_version = dict_state(s->round_robin);
        q = turn % count;
        turn = q + 1;
    }
    queue = Py_NewRef(PyList_GET_ITEM(queues, q));
    Py_ssize_t offset;
    if (queue_state(&s->queue_slots, queue, &qwriter, &offset) < 0) goto fail;
    if (qwriter == Py_None) goto fallback; /* the property creates it */
    WriterCache *queue_seen = writer_cache(s->queue_seen, qwriter);
    if ((r = writer_view(qwriter, queue_seen, 0, &entries)) <= 0) goto fallback_or_fail;
    if (entries.end + QUEUE_RECORD > entries.size) goto fallback; /* Queue.make_room() */
    long long base = log.base;
    if (base < 0) goto fallback;
    long long now_ns;
    if (sender_clock(s, &now_ns) < 0) goto fail;

    if (PyObject_GetBuffer(log.mm, &lbuf, PyBUF_WRITABLE) < 0 ||
        PyObject_GetBuffer(entries.mm, &qbuf, PyBUF_WRITABLE) < 0)
        goto fail;
    if (s->data_offset + log.size > lbuf.len || s->data_offset + entries.size > qbuf.len) {
        PyErr_SetString(PyExc_ValueError, "a data area lies outside its mapping");
        goto fail;
    }
    int64_t position = base + log.end;
    frame_message((char *)lbuf.buf + s->data_offset + log.end, length, position, now_ns, offset,
                  (int32_t)q, (int32_t)c->code, c->hashed, c->key != Py_None, topic_bytes,
                  c->tag_bytes, c->key_bytes, c->props, c->body);
    if (s->result_type == (PyObject *)&SendResultType) { /* id, ints, float made when read */
        result = lazy_send_result(s->id_prefix, topic, q, offset, position, now_ns, NULL);
    } else {
        PyObject *fields[6] = {message_id(s->id_prefix, position), Py_NewRef(topic),
                               PyLong_FromSsize_t(q), PyLong_FromSsize_t(offset),
                               PyLong_FromLongLong(position),
                               PyFloat_FromDouble((double)now_ns / 1e9)};
        result = new_record((PyTypeObject *)s->result_type, 6, fields);
        if (result != NULL && PyObject_GC_IsTracked(result)) /* str, ints, a float: no cycle */
            PyObject_GC_UnTrack(result);
    }
    if (result == NULL) goto fail;
    /* The entry after its frame, once nothing before can fail; then publish the record
     * before the entry, as Appender.append does (and prefault both chunks as
     * Chunk.publish does). */
    char *slot = (char *)qbuf.buf + s->data_offset + entries.end;
    put_i64(slot, position + 1);
    put_u32(slot + 8, c->hashed);
    PyBuffer_Release(&qbuf);
    PyBuffer_Release(&lbuf);
    if (view_publish(&s->log_seen, &log, log.end + length + FRAME_OVERHEAD) < 0 ||
        view_publish(queue_seen, &entries, entries.end + QUEUE_RECORD) < 0 ||
        queue_advance(&s->queue_slots, queue, offset + 1) < 0)
        goto fail;
    if (turn >= 0) {
        PyObject *t = PyLong_FromSsize_t(turn);
        /* The same int object already there (one queue: the turn stays 1): no change to
         * make, so none made (the dict unchanged since it was read, so it still holds it) */
        if (t != NULL && t == old_turn && turns_version != 0 &&
            dict_state(s->round_robin) == turns_version) {
            Py_DECREF(t);
        } else if (t == NULL || PyDict_SetItem(s->round_robin, topic, t) < 0) {
            Py_XDECREF(t);
            goto fail;
        }
        Py_DECREF(t);
    }
    if (c->key != Py_None) {
        PyObject *pos = PyLong_FromLongLong(position);
        PyObject *args[4] = {s->keys, topic, c->key, pos};
        PyObject *added = pos == NULL ? NULL
            : PyObject_VectorcallMethod(S_add, args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_XDECREF(pos);
        if (added == NULL) goto fail;
        Py_DECREF(added);
    }
    goto done;

fallback_or_fail:
    if (PyErr_Occurred()) goto fail;
fallback:
    result = Py_NewRef(Py_None);
    goto done;
fail:
    Py_CLEAR(result);
done:
    if (qbuf.obj != NULL) PyBuffer_Release(&qbuf);
    if (lbuf.obj != NULL) PyBuffer_Release(&lbuf);
    view_clear(&log);
    view_clear(&entries);
    Py_XDECREF(queue);
    Py_XDECREF(qwriter);
    Py_XDECREF(topic_bytes);
    return result;
}

/* Release the lock, keeping any exception already raised. */
static int release_lock(Sender *s) {
    if (s->lock_in_place && rlock_release(s->lock)) return 0;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallNoArgs(s->release);
    if (type != NULL) {
        Py_XDECREF(r);
        PyErr_Restore(type, value, tb); /* the first error wins */
        return -1;
    }
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* send(topic, body, tag, key, properties, code, queue_id) -> SendResult or None */
static int sender_ready(Sender *s) {
    if (s->store == NULL) {
        PyErr_SetString(PyExc_TypeError, "Sender.__init__ was not called");
        return 0;
    }
    return 1;
}

static PyObject *send_fields(Sender *s, PyObject *const *args);

static PyObject *Sender_send(Sender *s, PyObject *const *args, Py_ssize_t nargs) {
    if (!sender_ready(s)) return NULL;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "send takes the seven fields of a send");
        return NULL;
    }
    return send_fields(s, args);
}

/* call(topic, body, *, tag="", key=None, properties=None, code=0, queue_id=None): the
 * store's own send when bound to the handle (MessageStore._open), with no Python frame
 * for a send the C path stores. Anything else, from a keyword it does not know to a send
 * it hands back (None), goes to MessageStore.send itself, with the arguments as given:
 * the same result, and the same errors, as a store without this binding. */
static PyObject *Sender_call(Sender *s, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames) {
    if (!sender_ready(s)) return NULL;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (s->fallback == NULL) {
        PyErr_SetString(PyExc_TypeError, "this Sender has no fallback to call");
        return NULL;
    }
    PyObject *fields[7] = {NULL, NULL, S_empty, Py_None, Py_None, ZERO, Py_None};
    int plain = nargs == 2;
    if (plain) {
        fields[0] = args[0];
        fields[1] = args[1];
    }
    for (Py_ssize_t i = 0; plain && i < nkw; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        /* Keywords arrive interned from calls written in Python: identity first. */
        static PyObject **names[5] = {&S_tag, &S_key, &S_properties, &S_code, &S_queue_id};
        int slot = -1;
        for (int k = 0; k < 5 && slot < 0; k++)
            if (name == *names[k]) slot = k;
        for (int k = 0; k < 5 && slot < 0; k++)
            if (PyUnicode_Check(name) && PyUnicode_Compare(name, *names[k]) == 0) slot = k;
        if (slot < 0) plain = 0; /* the Python signature raises the TypeError */
        else fields[2 + slot] = args[nargs + i];
    }
    if (plain) {
        PyObject *result = send_fields(s, fields);
        if (result != Py_None) return result; /* a SendResult, or NULL with the error */
        Py_DECREF(result);
    }
    /* MessageStore.send(store, *args, **kwargs), the arguments as the caller gave them */
    Py_ssize_t total = nargs + nkw;
    PyObject *small[8], **full = total + 1 <= 8 ? small : PyMem_New(PyObject *, total + 1);
    if (full == NULL) return PyErr_NoMemory();
    full[0] = s->store;
    for (Py_ssize_t i = 0; i < total; i++) full[i + 1] = args[i];
    PyObject *result = PyObject_Vectorcall(s->fallback, full, (size_t)(nargs + 1), kwnames);
    if (full != small) PyMem_Free(full);
    return result;
}

static PyObject *send_fields(Sender *s, PyObject *const *args) {
    PyObject *topic = args[0];
    if (!PyUnicode_CheckExact(topic)) Py_RETURN_NONE;
    uint64_t queues_version = dict_state(s->queues);
    PyObject *queues = PyDict_GetItemWithError(s->queues, topic);
    if (queues == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE; /* a new topic: created on the Python path */
    }
    if (!PyList_CheckExact(queues) || PyList_GET_SIZE(queues) < 1) Py_RETURN_NONE;
    Py_INCREF(queues); /* check_tag, time_ns and KeyIndex.add run Python code */
    Checked c;
    PyObject *result = NULL;
    int ok = check_fields(args[1], args[2], args[3], args[4], args[5], args[6], s->tag_check,
                          s->max_body, s->chunk_size, PyList_GET_SIZE(queues), &c);
    if (ok <= 0) {
        Py_DECREF(queues);
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    }
    if (store_state(s->store, &s->store_seen) < 0) goto out;
    if (s->store_seen.failed) { /* the Python path refuses it */
        result = Py_NewRef(Py_None);
        goto out;
    }
    /* This thread holds the (reentrant) lock already: a send from a signal handler or a
     * callback inside another send. Acquired, it would not block, and would write where
     * the outer send is writing: the Python path raises ReentrantSendError. */
    int held;
    if (s->lock_in_place) {
        held = rlock_owned(s->lock);
    } else {
        PyObject *owned = PyObject_CallNoArgs(s->owned);
        held = owned == NULL ? -1 : PyObject_IsTrue(owned);
        Py_XDECREF(owned);
    }
    if (held != 0) {
        result = held < 0 ? NULL : Py_NewRef(Py_None);
        goto out;
    }
    if (!s->lock_in_place || !rlock_try(s->lock)) {
        PyObject *acquired = PyObject_CallNoArgs(s->acquire);
        if (acquired == NULL) goto out;
        Py_DECREF(acquired);
    }
    /* delete_topic may have closed these queues while this send waited for the lock:
     * the Python path looks the topic up again (unless the dict did not change) */
    PyObject *now_queues = queues_version != 0 && dict_state(s->queues) == queues_version
                               ? queues
                               : PyDict_GetItemWithError(s->queues, topic);
    if (now_queues != queues) {
        result = PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    } else {
        result = send_locked(s, topic, queues, &c);
    }
    if (release_lock(s) < 0) Py_CLEAR(result);
    if (result != NULL && result != Py_None) { /* wake pulls waiting for a message */
        int w = store_state(s->store, &s->store_seen) < 0 ? -1 : s->store_seen.waiting;
        PyObject *woken = w > 0 ? PyObject_CallMethodNoArgs(s->store, S_wake) : NULL;
        if (w < 0 || (w > 0 && woken == NULL)) Py_CLEAR(result);
        Py_XDECREF(woken);
    }
out:
    release_checked(&c);
    Py_DECREF(queues);
    return result;
}

/* write_checked(topic, queues, checked) -> SendResult or None: the send of one checked
 * 8-tuple, by a caller that holds the write lock (the group commit leader). */
static PyObject *Sender_write_checked(Sender *s, PyObject *const *args, Py_ssize_t nargs) {
    if (!sender_ready(s)) return NULL;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "write_checked(topic, queues, checked)");
        return NULL;
    }
    /* A str subclass as topic (the Python path stores it), or anything unusual: None. */
    if (!PyUnicode_CheckExact(args[0]) || !PyList_CheckExact(args[1]) ||
        PyList_GET_SIZE(args[1]) < 1)
        Py_RETURN_NONE;
    Checked c; /* borrowed from the tuple, which is held while Python code may run */
    if (unpack_checked(args[2], &c) < 0) return NULL;
    PyObject *queues = Py_NewRef(args[1]), *checked = Py_NewRef(args[2]);
    PyObject *result = send_locked(s, args[0], queues, &c);
    Py_DECREF(checked);
    Py_DECREF(queues);
    return result;
}

/* check(queue_count, body, tag, key, properties, code, queue_id) -> the checked 8-tuple
 * of validate.check_message, or None when the Python checks must decide: for sends the
 * C path does not store (under flush="sync", or handed back). */
static PyObject *Sender_check(Sender *s, PyObject *const *args, Py_ssize_t nargs) {
    if (!sender_ready(s)) return NULL;
    if (nargs != 7 || !PyLong_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "check takes a queue count and six fields");
        return NULL;
    }
    Py_ssize_t count = PyLong_AsSsize_t(args[0]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    PyObject *checked = checked_tuple(args[1], args[2], args[3], args[4], args[5], args[6],
                                      s->tag_check, s->max_body, s->chunk_size, count);
    if (checked == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return checked;
}

static PyMethodDef Sender_methods[] = {
    {"check", (PyCFunction)(void (*)(void))Sender_check, METH_FASTCALL, NULL},
    {"send", (PyCFunction)(void (*)(void))Sender_send, METH_FASTCALL, NULL},
    {"call", (PyCFunction)(void (*)(void))Sender_call, METH_FASTCALL | METH_KEYWORDS,
     /* MessageStore.send's signature (inspect.signature, help()): the store's send is
      * this method when bound (tests/test_queue_cache_fixes.py compares the two) */
     "call($self, topic, body, *, tag='', key=None, properties=None, code=0, "
     "queue_id=None)\n--\n\n"
     "Append one message to ``topic`` (created on first use unless auto_create_topics\n"
     "is off) and return where it went: SendResult (message id, queue id and offset, log\n"
     "position, stored_at in seconds). ``queue_id`` None: round robin over the queues.\n"
     "Durable as ``StoreConfig.flush`` says when it returns.\n\n"
     "MessageStore.send, run in C (equeue/cext/sender.c) on a store opened with the\n"
     "accelerator, flush \"async\" or \"os\"; it raises what MessageStore.send raises."},
    {"write_checked", (PyCFunction)(void (*)(void))Sender_write_checked, METH_FASTCALL, NULL},
    {"append_bodies", (PyCFunction)(void (*)(void))Sender_append_bodies, METH_FASTCALL, NULL},
    {"plain_bodies", (PyCFunction)Sender_plain_bodies, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyObject *Sender_rereads(Sender *s, void *closure) {
    (void)s, (void)closure;
    return Py_BuildValue("(nn)", sendstate_rereads[0], sendstate_rereads[1]);
}

static PyGetSetDef Sender_getset[] = {
    {"rereads", (getter)Sender_rereads, NULL,
     "(log, queue): chunk views this process read by attribute, not remembered", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject SenderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "equeue._speedups.Sender",
    .tp_basicsize = sizeof(Sender),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Sender_init,
    .tp_dealloc = (destructor)Sender_dealloc,
    .tp_traverse = (traverseproc)Sender_traverse,
    .tp_clear = (inquiry)Sender_clear,
    .tp_methods = Sender_methods,
    .tp_getset = Sender_getset,
};
