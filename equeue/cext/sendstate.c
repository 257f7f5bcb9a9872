/* What the C Sender remembers between sends: sendstate.h says what and why. */
#include "sendstate.h"

#include <structmember.h>

static PyObject *S_chunk, *S_mm, *S_data_end, *S_writable_end, *S_record_count,
    *S_prefault_mark, *S_prefault, *S_base, *S_writer, *S_next_offset, *S_closed,
    *S_flush_error, *S_waiting, *S_time_ns;

int sendstate_names(void) {
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    INTERN(S_chunk, "_chunk") INTERN(S_mm, "_mm") INTERN(S_data_end, "data_end")
    INTERN(S_writable_end, "writable_end") INTERN(S_record_count, "record_count")
    INTERN(S_prefault_mark, "_prefault_mark") INTERN(S_prefault, "_prefault")
    INTERN(S_base, "base") INTERN(S_writer, "_writer") INTERN(S_next_offset, "next_offset")
    INTERN(S_closed, "_closed") INTERN(S_flush_error, "_flush_error")
    INTERN(S_waiting, "_waiting") INTERN(S_time_ns, "time_ns")
#undef INTERN
    return 0;
}

/* Dict versions (PEP 509) as CPython 3.11 keeps them: a new value for every change of
 * any dict (storing the very object already there is no change). Later versions
 * deprecate the field: there nothing is remembered and every send reads attributes. */
#if PY_VERSION_HEX < 0x030C0000
#define CAN_REMEMBER 1
static inline uint64_t dict_version(PyObject *d) { return ((PyDictObject *)d)->ma_version_tag; }
#else
#define CAN_REMEMBER 0
static inline uint64_t dict_version(PyObject *d) { (void)d; return 0; }
#endif

/* -DEQUEUE_SENDSTATE_STATS: how often a remembered dict was found changed, and which
 * keys changed (a diagnosis build only; written to $EQUEUE_SENDSTATE_STATS at exit). */
#ifdef EQUEUE_SENDSTATE_STATS
static PyObject *stat_counts; /* "site: what" -> count */
static void stat_bump(const char *what) {
    if (stat_counts == NULL && (stat_counts = PyDict_New()) == NULL) { PyErr_Clear(); return; }
    PyObject *k = PyUnicode_FromString(what);
    PyObject *old = k ? PyDict_GetItem(stat_counts, k) : NULL;
    PyObject *n = PyLong_FromLong(old ? PyLong_AsLong(old) + 1 : 1);
    if (k && n) PyDict_SetItem(stat_counts, k, n);
    Py_XDECREF(k); Py_XDECREF(n); PyErr_Clear();
}
static void stat_write(void) {
    const char *path = getenv("EQUEUE_SENDSTATE_STATS");
    if (path == NULL || stat_counts == NULL) return;
    FILE *f = fopen(path, "a");
    if (f == NULL) return;
    PyObject *k, *v; Py_ssize_t pos = 0;
    fprintf(f, "--- pid %d\n", (int)getpid());
    while (PyDict_Next(stat_counts, &pos, &k, &v))
        fprintf(f, "%ld %s\n", PyLong_AsLong(v), PyUnicode_AsUTF8(k));
    fclose(f);
}
/* A snapshot of a remembered dict: key -> (id, int value or None) */
static PyObject *snap_of(PyObject *dict) {
    PyObject *snap = PyDict_New(), *k, *v; Py_ssize_t pos = 0;
    while (snap && PyDict_Next(dict, &pos, &k, &v)) {
        PyObject *t = Py_BuildValue("(nO)", (Py_ssize_t)v, PyLong_CheckExact(v) ? v : Py_None);
        PyObject *iv = PyLong_CheckExact(v) ? PyNumber_Positive(v) : NULL;
        if (iv) { Py_DECREF(t); t = Py_BuildValue("(nN)", (Py_ssize_t)v, iv); }
        if (t) PyDict_SetItem(snap, k, t);
        Py_XDECREF(t);
    }
    PyErr_Clear();
    return snap;
}
static void snap_diff(const char *site, PyObject *snap, PyObject *dict) {
    char buf[200];
    PyObject *k, *v; Py_ssize_t pos = 0;
    if (snap == NULL) return;
    while (PyDict_Next(dict, &pos, &k, &v)) {
        PyObject *t = PyDict_GetItem(snap, k);
        int changed = t == NULL || PyTuple_GET_ITEM(t, 0) == NULL ||
            PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 0)) != (Py_ssize_t)v ||
            (PyLong_CheckExact(v) && PyObject_RichCompareBool(PyTuple_GET_ITEM(t, 1), v, Py_EQ) != 1);
        if (changed) {
            snprintf(buf, sizeof buf, "%s: changed %s", site, PyUnicode_AsUTF8(k));
            stat_bump(buf);
        }
    }
    PyErr_Clear();
}
static int stat_registered;
#define STAT(what) stat_bump(what)
#else
#define STAT(what) ((void)0)
#endif

static inline int type_plain(PyTypeObject *tp) {
    return tp->tp_getattro == PyObject_GenericGetAttr &&
           tp->tp_setattro == PyObject_GenericSetAttr;
}

static inline int type_unchanged(PyTypeObject *tp, unsigned int tp_version) {
    return tp->tp_version_tag == tp_version; /* 0 once the type was modified */
}

/* obj's dict at this moment, when each name is a plain instance attribute of it. */
static int seen_fill(PyObject *obj, Seen *seen, PyObject *const *names, int n) {
    PyTypeObject *tp = Py_TYPE(obj);
    if (!CAN_REMEMBER || !type_plain(tp)) return 0;
    for (int i = 0; i < n; i++)
        if (_PyType_Lookup(tp, names[i]) != NULL) return 0;
    if (!(tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) || tp->tp_version_tag == 0) return 0;
    PyObject **dict = _PyObject_GetDictPtr(obj);
    if (dict == NULL || *dict == NULL || !PyDict_CheckExact(*dict)) return 0;
#ifdef EQUEUE_SENDSTATE_STATS
    PyObject *snap = seen->snap;
    *seen = (Seen){*dict, dict_version(*dict), tp, tp->tp_version_tag, snap_of(*dict)};
    Py_XDECREF(snap);
    if (!stat_registered) stat_registered = Py_AtExit(stat_write) == 0;
#else
    *seen = (Seen){*dict, dict_version(*dict), tp, tp->tp_version_tag};
#endif
    return 1;
}

#ifdef EQUEUE_SENDSTATE_STATS
#define seen_valid(obj, seen, site) seen_valid_stat(obj, seen, site)
static int seen_valid_stat(PyObject *obj, const Seen *seen, const char *site) {
    char buf[120];
    snprintf(buf, sizeof buf, "%s: checked", site);
    stat_bump(buf);
    PyObject **dict = _PyObject_GetDictPtr(obj);
    const char *why = NULL;
    if (Py_TYPE(obj) != seen->type || !type_unchanged(seen->type, seen->tp_version))
        why = "type";
    else if (dict == NULL || *dict != seen->dict)
        why = "another dict";
    else if (dict_version(*dict) != seen->version)
        why = "version";
    if (why == NULL) return 1;
    snprintf(buf, sizeof buf, "%s: failed (%s)", site, why);
    stat_bump(buf);
    if (dict != NULL && *dict != NULL && *dict == seen->dict) snap_diff(site, seen->snap, *dict);
    return 0;
}
#else
static inline int seen_valid(PyObject *obj, const Seen *seen, const char *site) {
    (void)site;
    if (Py_TYPE(obj) != seen->type || !type_unchanged(seen->type, seen->tp_version))
        return 0;
    PyObject **dict = _PyObject_GetDictPtr(obj);
    return dict != NULL && *dict == seen->dict && dict_version(*dict) == seen->version;
}
#endif

/* An exact int value of a remembered dict, or -1 (not to be remembered). */
static Py_ssize_t dict_ssize(PyObject *dict, PyObject *name) {
    PyObject *v = PyDict_GetItemWithError(dict, name);
    if (v == NULL || !PyLong_CheckExact(v)) return -1;
    Py_ssize_t n = PyLong_AsSsize_t(v);
    if (n == -1) PyErr_Clear();
    return n;
}

/* A counter's new value written into its int object in place, when nothing else can
 * see that int: held only by the one dict or slot (reference count 1: any reader, Python
 * or C, holds its own reference while it uses the value, and then it is not changed),
 * an exact int, the new value past the small-int cache (never made into one of those
 * shared objects) and of the same number of digits. What a reader of the attribute gets
 * is what it got before: the new value, from then on. It saves the allocation of the
 * new int, the dict store and the old int's release: about 250 instructions each, four
 * per send. CPython 3.11's int layout (ob_size digits of PyLong_SHIFT bits, the sign
 * in ob_size); elsewhere a new int is stored, as before. 1: done; 0: store a new one. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
static inline int int_overwrite(PyObject *o, Py_ssize_t value) {
    if (o == NULL || Py_REFCNT(o) != 1 || !PyLong_CheckExact(o) || value <= 256) return 0;
    if ((size_t)value <= PyLong_MASK) { /* one digit: every counter below 2**30 */
        if (Py_SIZE(o) != 1) return 0;
        ((PyLongObject *)o)->ob_digit[0] = (digit)value;
        return 1;
    }
    digit d[4];
    Py_ssize_t n = 0;
    for (size_t v = (size_t)value; v != 0 && n < 4; v >>= PyLong_SHIFT)
        d[n++] = (digit)(v & PyLong_MASK);
    if (Py_SIZE(o) != n) return 0;
    memcpy(((PyLongObject *)o)->ob_digit, d, (size_t)n * sizeof(digit));
    return 1;
}
#else
static inline int int_overwrite(PyObject *o, Py_ssize_t value) { return 0; }
#endif

/* name = value in the remembered dict; *held is the int the dict holds for it after. */
static int dict_set_ssize(Seen *seen, PyObject **held, PyObject *name, Py_ssize_t value) {
    if (int_overwrite(*held, value)) { /* (the dict unchanged: its version too) */
#ifdef EQUEUE_SENDSTATE_STATS
        Py_XSETREF(seen->snap, snap_of(seen->dict));
#endif
        return 0;
    }
    PyObject *v = PyLong_FromSsize_t(value);
    if (v == NULL) return -1;
    int r = PyDict_SetItem(seen->dict, name, v);
    Py_DECREF(v);
    seen->version = dict_version(seen->dict); /* this change is the send's own */
#ifdef EQUEUE_SENDSTATE_STATS
    Py_XSETREF(seen->snap, snap_of(seen->dict));
#endif
    *held = r < 0 ? NULL : v; /* (borrowed: the dict holds it while unchanged) */
    return r;
}

/* --- generic access, as before: what a send does when nothing is remembered --- */

static inline PyObject **plain_dict(PyObject *obj, PyObject *name) {
    PyTypeObject *tp = Py_TYPE(obj);
    if (!type_plain(tp) || _PyType_Lookup(tp, name) != NULL) return NULL;
    PyObject **dict = _PyObject_GetDictPtr(obj);
    return dict != NULL && *dict != NULL && PyDict_CheckExact(*dict) ? dict : NULL;
}

PyObject *get_attr(PyObject *obj, PyObject *name) {
    PyObject **dict = plain_dict(obj, name);
    if (dict != NULL) {
        PyObject *v = PyDict_GetItemWithError(*dict, name);
        if (v != NULL) return Py_NewRef(v);
        if (PyErr_Occurred()) return NULL;
    }
    return PyObject_GetAttr(obj, name); /* (raises the AttributeError) */
}

int set_attr(PyObject *obj, PyObject *name, PyObject *value) {
    PyObject **dict = plain_dict(obj, name);
    if (dict != NULL) return PyDict_SetItem(*dict, name, value);
    return PyObject_SetAttr(obj, name, value);
}

/* An int attribute as a Py_ssize_t; -1 with an exception if missing or not an int. */
Py_ssize_t ssize_attr(PyObject *obj, PyObject *name) {
    PyObject *v = get_attr(obj, name);
    if (v == NULL) return -1;
    Py_ssize_t n = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (n < 0 && !PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%R is negative", name);
    return n;
}

static int set_ssize_attr(PyObject *obj, PyObject *name, Py_ssize_t value) {
    PyObject *v = PyLong_FromSsize_t(value);
    if (v == NULL) return -1;
    int r = set_attr(obj, name, v);
    Py_DECREF(v);
    return r;
}

static int longlong_attr(PyObject *obj, PyObject *name, long long *out) {
    PyObject *v = get_attr(obj, name);
    if (v == NULL) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* --- the store and the clock --- */

int store_state(PyObject *store, StoreCache *sc) {
    if (sc->valid && seen_valid(store, &sc->seen, "store")) return 0;
    STAT(sc->valid ? "store: re-read (changed)" : "store: re-read (not remembered)");
    sc->valid = 0;
    PyObject *closed = get_attr(store, S_closed);
    PyObject *error = closed == NULL ? NULL : get_attr(store, S_flush_error);
    PyObject *waiting = error == NULL ? NULL : get_attr(store, S_waiting);
    int ok = waiting != NULL && (sc->closed = PyObject_IsTrue(closed)) >= 0 &&
             (sc->waiting = PyObject_IsTrue(waiting)) >= 0;
    sc->failed = error != Py_None;
    /* Truth values that no code computes: remembered while the dict is unchanged */
    static PyObject **names[3] = {&S_closed, &S_flush_error, &S_waiting};
    PyObject *n[3] = {*names[0], *names[1], *names[2]};
    if (ok && PyBool_Check(closed) && PyLong_CheckExact(waiting) && seen_fill(store, &sc->seen, n, 3))
        sc->valid = 1;
    Py_XDECREF(closed);
    Py_XDECREF(error);
    Py_XDECREF(waiting);
    return ok ? 0 : -1;
}

PyObject *clock_function(PyObject *clock, ClockCache *cc) {
    if (cc->valid && PyModule_CheckExact(clock)) {
        PyObject *dict = PyModule_GetDict(clock);
        if (dict == cc->seen.dict && dict_version(dict) == cc->seen.version)
            return Py_NewRef(cc->time_ns);
    }
    cc->valid = 0;
    PyObject *f = get_attr(clock, S_time_ns);
    if (f != NULL && CAN_REMEMBER && PyModule_CheckExact(clock)) {
        PyObject *dict = PyModule_GetDict(clock);
        if (PyDict_GetItemWithError(dict, S_time_ns) == f) { /* not a module __getattr__'s */
            cc->seen = (Seen){dict, dict_version(dict), NULL, 0};
            cc->time_ns = f;
            cc->valid = 1;
        }
        PyErr_Clear();
    }
    return f;
}

/* --- chunks open for writing --- */

Py_ssize_t sendstate_rereads[2];

void view_clear(ChunkView *v) {
    Py_CLEAR(v->chunk);
    Py_CLEAR(v->mm);
}

/* The chunk's fields as the dict holds them now, for the next sends. */
static void remember(PyObject *writer, WriterCache *wc, ChunkView *v) {
    static PyObject **writer_names[1] = {&S_chunk};
    static PyObject **chunk_names[6] = {&S_mm, &S_data_end, &S_writable_end,
                                        &S_record_count, &S_prefault_mark, &S_base};
    PyObject *wn[1] = {*writer_names[0]}, *cn[6];
    for (int i = 0; i < 6; i++) cn[i] = *chunk_names[i];
    wc->valid = 0;
    if (!seen_fill(writer, &wc->writer, wn, 1) || !seen_fill(v->chunk, &wc->chunk, cn, 6))
        return;
    PyObject *d = wc->chunk.dict;
    if (PyDict_GetItemWithError(wc->writer.dict, S_chunk) != v->chunk ||
        PyDict_GetItemWithError(d, S_mm) != v->mm || dict_ssize(d, S_data_end) != v->end ||
        dict_ssize(d, S_writable_end) != v->size || dict_ssize(d, S_record_count) != v->count) {
        PyErr_Clear();
        return;
    }
    PyObject *mark = PyDict_GetItemWithError(d, S_prefault_mark);
    if (mark == NULL || !PyLong_CheckExact(mark)) {
        PyErr_Clear();
        return;
    }
    wc->end_obj = PyDict_GetItemWithError(d, S_data_end); /* (both there: read above) */
    wc->count_obj = PyDict_GetItemWithError(d, S_record_count);
    wc->chunk_obj = v->chunk;
    wc->mm = v->mm;
    wc->end = v->end;
    wc->size = v->size;
    wc->count = v->count;
    wc->base = v->base;
    wc->mark = v->mark;
    wc->valid = 1;
}

/* The chunk's dict changed, but perhaps not in what a send uses: a flush (flushed_end,
 * synced_end, by the flusher thread or the group commit, once per fdatasync) or a read
 * (last_used). Its six fields looked up again in the dict, the same dict of an unchanged
 * type: when each is what was remembered, so is the rest (about 300 instructions, where
 * a re-read is about 3,000). 1: still valid, at the dict's new version. Called only
 * where chunk_obj is alive: the writer's dict found unchanged (it holds the chunk), or
 * the send's own reference to it (view_publish_n). */
static int chunk_recheck(WriterCache *wc) {
    PyObject *chunk = wc->chunk_obj;
    Seen *seen = &wc->chunk;
    if (Py_TYPE(chunk) != seen->type || !type_unchanged(seen->type, seen->tp_version))
        return 0;
    PyObject **dict = _PyObject_GetDictPtr(chunk);
    if (dict == NULL || *dict != seen->dict || dict_version(seen->dict) == 0) return 0;
    PyObject *d = seen->dict;
    PyObject *mark = PyDict_GetItemWithError(d, S_prefault_mark);
    int same = PyDict_GetItemWithError(d, S_mm) == wc->mm &&
               PyDict_GetItemWithError(d, S_data_end) == wc->end_obj &&
               PyDict_GetItemWithError(d, S_record_count) == wc->count_obj &&
               dict_ssize(d, S_data_end) == wc->end && dict_ssize(d, S_record_count) == wc->count &&
               dict_ssize(d, S_writable_end) == wc->size && mark != NULL &&
               PyLong_CheckExact(mark) && PyLong_AsLongLong(mark) == wc->mark &&
               (wc->base < 0 || (long long)dict_ssize(d, S_base) == wc->base);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (!same) return 0;
    STAT("chunk: rechecked, unchanged");
    seen->version = dict_version(d);
#ifdef EQUEUE_SENDSTATE_STATS
    Py_XSETREF(seen->snap, snap_of(d));
#endif
    return 1;
}

int writer_view(PyObject *writer, WriterCache *wc, int want_base, ChunkView *out) {
    *out = (ChunkView){0};
    if (wc->valid && seen_valid(writer, &wc->writer, want_base ? "log writer" : "queue writer") &&
        (seen_valid(wc->chunk_obj, &wc->chunk, want_base ? "log chunk" : "queue chunk") ||
         chunk_recheck(wc))) {
        *out = (ChunkView){Py_NewRef(wc->chunk_obj), Py_NewRef(wc->mm), wc->end, wc->size,
                           wc->count, wc->base, wc->mark};
        return 1;
    }
    sendstate_rereads[want_base ? 0 : 1]++;
    STAT(want_base ? (wc->valid ? "log view: re-read (changed)" : "log view: re-read (not remembered)")
                   : (wc->valid ? "queue view: re-read (changed)" : "queue view: re-read (not remembered)"));
    wc->valid = 0;
    PyObject *chunk = get_attr(writer, S_chunk);
    if (chunk == NULL) return -1;
    if (chunk == Py_None) {
        Py_DECREF(chunk);
        return 0;
    }
    PyObject *mm = get_attr(chunk, S_mm);
    if (mm == NULL || mm == Py_None) {
        Py_DECREF(chunk);
        Py_XDECREF(mm);
        return mm == NULL ? -1 : 0;
    }
    out->chunk = chunk;
    out->mm = mm;
    if ((out->end = ssize_attr(chunk, S_data_end)) < 0 ||
        (out->size = ssize_attr(chunk, S_writable_end)) < 0 ||
        (out->count = ssize_attr(chunk, S_record_count)) < 0 ||
        longlong_attr(chunk, S_prefault_mark, &out->mark) < 0 ||
        (want_base && longlong_attr(chunk, S_base, &out->base) < 0)) {
        view_clear(out);
        return -1;
    }
    if (!want_base) out->base = -1; /* a queue chunk's base is not read */
    remember(writer, wc, out);
    return 1;
}

/* Chunk.publish(end, n): count the records, raise data_end, prefault the next window. */
int view_publish_n(WriterCache *wc, ChunkView *v, Py_ssize_t end, Py_ssize_t n) {
    long long mark;
    if (wc->valid && v->chunk == wc->chunk_obj &&
        (seen_valid(v->chunk, &wc->chunk, "publish chunk") || chunk_recheck(wc))) {
        if (dict_set_ssize(&wc->chunk, &wc->count_obj, S_record_count, wc->count + n) < 0 ||
            dict_set_ssize(&wc->chunk, &wc->end_obj, S_data_end, end) < 0) {
            wc->valid = 0;
            return -1;
        }
        wc->count += n;
        wc->end = end;
        mark = wc->mark;
    } else {
        wc->valid = 0;
        Py_ssize_t count = ssize_attr(v->chunk, S_record_count);
        if (count < 0 || set_ssize_attr(v->chunk, S_record_count, count + n) < 0) return -1;
        if (set_ssize_attr(v->chunk, S_data_end, end) < 0) return -1;
        if (longlong_attr(v->chunk, S_prefault_mark, &mark) < 0) return -1;
    }
    STAT("publish");
    if (end > mark) { /* Python code, which moves the mark: read again next time */
        STAT("publish: prefault");
        wc->valid = 0;
        PyObject *end_obj = PyLong_FromSsize_t(end);
        if (end_obj == NULL) return -1;
        PyObject *r = PyObject_CallMethodOneArg(v->chunk, S_prefault, end_obj);
        Py_DECREF(end_obj);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
}

int view_publish(WriterCache *wc, ChunkView *v, Py_ssize_t end) {
    return view_publish_n(wc, v, end, 1);
}

WriterCache *writer_cache(WriterCache *table, PyObject *writer) {
    uintptr_t h = ((uintptr_t)writer * (uintptr_t)0x9E3779B97F4A7C15ULL) >> 40;
    for (int i = 0; i < WRITER_CACHE_PROBE; i++) {
        WriterCache *wc = &table[(h + i) % WRITER_CACHE_SLOTS];
        if (wc->owner == writer) return wc;
    }
    /* Not there: a slot of the probe never used, else one holding nothing valid, else
     * the writer's own slot, taken over */
    WriterCache *wc = NULL;
    for (int pass = 0; pass < 2 && wc == NULL; pass++)
        for (int i = 0; i < WRITER_CACHE_PROBE && wc == NULL; i++) {
            WriterCache *free = &table[(h + i) % WRITER_CACHE_SLOTS];
            if (pass == 0 ? free->owner == NULL : !free->valid) wc = free;
        }
    if (wc == NULL) wc = &table[h % WRITER_CACHE_SLOTS];
    STAT(wc->owner == NULL ? "queue cache: slot taken (free)" : "queue cache: slot taken over");
    wc->valid = 0; /* another writer's state until writer_view fills it */
    wc->owner = writer;
    return wc;
}

/* --- queues: __slots__, read and set in place --- */

static void slot_find(PyObject *obj, PyObject *name, SlotAt *out) {
    PyTypeObject *tp = Py_TYPE(obj);
    *out = (SlotAt){0};
    if (!type_plain(tp)) return;
    PyObject *descr = _PyType_Lookup(tp, name);
    if (descr == NULL || Py_TYPE(descr) != &PyMemberDescr_Type) return;
    PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
    if (m->type != T_OBJECT_EX || (m->flags & READONLY)) return;
    if (!(tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) || tp->tp_version_tag == 0) return;
    *out = (SlotAt){tp, tp->tp_version_tag, m->offset};
}

/* The slot's place in obj, if obj's type is the one found and unchanged since. */
static inline PyObject **slot_at(PyObject *obj, SlotAt *slot, PyObject *name) {
    PyTypeObject *tp = Py_TYPE(obj);
    if (slot->type != tp || !type_unchanged(tp, slot->tp_version)) slot_find(obj, name, slot);
    if (slot->type == NULL) return NULL;
    PyObject **p = (PyObject **)((char *)obj + slot->offset);
    return *p != NULL ? p : NULL; /* unset: generic access raises the AttributeError */
}

int queue_state(QueueSlots *qs, PyObject *queue, PyObject **writer, Py_ssize_t *next_offset) {
    PyObject **w = slot_at(queue, &qs->writer, S_writer);
    *writer = w != NULL ? Py_NewRef(*w) : get_attr(queue, S_writer);
    if (*writer == NULL) return -1;
    if (*writer == Py_None) return 0; /* the property creates it: the Python path */
    PyObject **n = slot_at(queue, &qs->next_offset, S_next_offset);
    if (n != NULL && PyLong_CheckExact(*n)) {
        *next_offset = PyLong_AsSsize_t(*n);
        if (*next_offset >= 0) return 0;
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%R is negative", S_next_offset);
    } else {
        *next_offset = ssize_attr(queue, S_next_offset);
        if (*next_offset >= 0) return 0;
    }
    Py_CLEAR(*writer);
    return -1;
}

int queue_advance(QueueSlots *qs, PyObject *queue, Py_ssize_t next_offset) {
    PyObject **n = slot_at(queue, &qs->next_offset, S_next_offset);
    if (n == NULL || !PyLong_CheckExact(*n)) return set_ssize_attr(queue, S_next_offset, next_offset);
    if (int_overwrite(*n, next_offset)) return 0;
    PyObject *v = PyLong_FromSsize_t(next_offset);
    if (v == NULL) return -1;
    Py_SETREF(*n, v); /* the old int: no code runs as it goes */
    return 0;
}

/* --- the write lock: a _thread.RLock taken and released in place when it is free ---
 *
 * Its three method calls (_is_owned, acquire with its argument parsing, release) were
 * about 780 instructions of a 6,800-instruction send. CPython 3.11's RLock is this
 * struct (Modules/_threadmodule.c, rlockobject), checked by name and size; acquired
 * here only without waiting (the same PyThread call acquire() tries first), else by
 * its acquire(), which waits with the GIL released. Other versions call the methods. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    unsigned long owner, count;
    PyObject *weakrefs;
} RLockMirror;

int rlock_mirrorable(PyObject *lock) {
    PyTypeObject *tp = Py_TYPE(lock);
    return strcmp(tp->tp_name, "_thread.RLock") == 0 && tp->tp_basicsize == sizeof(RLockMirror);
}

int rlock_owned(PyObject *lock) {
    RLockMirror *r = (RLockMirror *)lock;
    return r->count > 0 && r->owner == PyThread_get_thread_ident();
}

int rlock_try(PyObject *lock) {
    RLockMirror *r = (RLockMirror *)lock;
    if (r->count > 0 || !PyThread_acquire_lock(r->lock, NOWAIT_LOCK)) return 0;
    r->owner = PyThread_get_thread_ident();
    r->count = 1;
    return 1;
}

int rlock_release(PyObject *lock) {
    RLockMirror *r = (RLockMirror *)lock;
    if (r->count == 0 || r->owner != PyThread_get_thread_ident()) return 0; /* release() says */
    if (--r->count == 0) {
        r->owner = 0;
        PyThread_release_lock(r->lock);
    }
    return 1;
}
#else
int rlock_mirrorable(PyObject *lock) { (void)lock; return 0; }
int rlock_owned(PyObject *lock) { (void)lock; return 0; }
int rlock_try(PyObject *lock) { (void)lock; return 0; }
int rlock_release(PyObject *lock) { (void)lock; return 0; }
#endif

uint64_t dict_state(PyObject *dict) { return dict_version(dict); }
