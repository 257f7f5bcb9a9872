/* Reading msgpack from a frame's bytes, for the client's answer readers in C
 * (answercols.c, pullanswer.c): a cursor that never passes ``end``. */
#ifndef EQUEUE_CURSOR_H
#define EQUEUE_CURSOR_H
#include "msgpack_min.h"

typedef struct {
    const unsigned char *p, *end;
} Cursor;

static inline int take(Cursor *c, Py_ssize_t n) { return c->end - c->p >= n; }

/* A msgpack uint (any, up to 2**64-1): 1, else 0. */
static inline __attribute__((always_inline)) int read_uint64(Cursor *c, uint64_t *v) {
    if (!take(c, 1)) return 0;
    unsigned char b = *c->p;
    if (b <= 0x7f) {
        *v = b;
        c->p += 1;
        return 1;
    }
    int n = b == 0xcc ? 1 : b == 0xcd ? 2 : b == 0xce ? 4 : b == 0xcf ? 8 : 0;
    if (n == 0 || !take(c, 1 + n)) return 0;
    *v = get_be(c->p + 1, n);
    c->p += 1 + n;
    return 1;
}

/* A msgpack uint below 2**63 (a column's value, held as int64): 1, else 0. */
static inline __attribute__((always_inline)) int read_uint(Cursor *c, uint64_t *v) {
    return read_uint64(c, v) && *v <= (uint64_t)INT64_MAX;
}

/* An array header: its length, or -1. */
static inline Py_ssize_t read_array(Cursor *c) {
    if (!take(c, 1)) return -1;
    unsigned char b = *c->p;
    if ((b & 0xf0) == 0x90) {
        c->p += 1;
        return b & 0x0f;
    }
    int n = b == 0xdc ? 2 : b == 0xdd ? 4 : 0;
    if (n == 0 || !take(c, 1 + n)) return -1;
    uint64_t v = get_be(c->p + 1, n);
    c->p += 1 + n;
    return (Py_ssize_t)v;
}

/* A str header: its length (the bytes there), or -1. */
static inline __attribute__((always_inline)) Py_ssize_t read_str(Cursor *c) {
    if (!take(c, 1)) return -1;
    unsigned char b = *c->p;
    if ((b & 0xe0) == 0xa0) {
        c->p += 1;
        return take(c, b & 0x1f) ? (Py_ssize_t)(b & 0x1f) : -1;
    }
    int n = b == 0xd9 ? 1 : b == 0xda ? 2 : b == 0xdb ? 4 : 0;
    if (n == 0 || !take(c, 1 + n)) return -1;
    Py_ssize_t len = (Py_ssize_t)get_be(c->p + 1, n);
    c->p += 1 + n;
    return take(c, len) ? len : -1;
}

/* The answer frame's head read, its value read by ``read`` (answercols.c). */
PyObject *answer_frame(PyObject *args, PyObject *(*read)(Cursor *));

#endif
