/* The few msgpack pieces the C send paths write and read by hand (sendframe.c,
 * answercols.c, batch.c), in one place: big-endian loads, a uint's shortest encoding,
 * the answer status and the op names as msgpack strs. The wire's values are
 * equeue/protocol/frames.py's; tests hold these to them (test_server_fastsend.py). */
#ifndef EQUEUE_MSGPACK_MIN_H
#define EQUEUE_MSGPACK_MIN_H
#include <stdint.h>
#include <string.h>
#include "hex16.h" /* put_be_n */

#define MP_STATUS_OK 0x00            /* frames.STATUS_OK, a positive fixint */
#define MP_OP_SEND "\xa4send"        /* the str "send" */
#define MP_OP_SEND_BODIES "\xabsend_bodies"

/* The n bytes (1, 2, 4 or 8) at p as a big-endian uint. */
static inline uint64_t get_be(const unsigned char *p, int n) {
    if (n == 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        return __builtin_bswap64(v);
    }
    if (n == 4) {
        uint32_t v;
        memcpy(&v, p, 4);
        return __builtin_bswap32(v);
    }
    if (n == 2) {
        uint16_t v;
        memcpy(&v, p, 2);
        return __builtin_bswap16(v);
    }
    return p[0]; /* n == 1 */
}

/* A request body's head: [, an array of 3, then the request id, a positive uint. 1 with
 * *p past them and the id in *rid; else 0 (the id 0 is the connection's own: the
 * general path refuses it). (sendframe.c, bodyspans.c) */
static inline int take_request_id(const unsigned char **p, const unsigned char *end,
                                  uint64_t *rid) {
    const unsigned char *q = *p;
    if (end - q < 2 || q[0] != 0x93) return 0;
    unsigned c = q[1];
    q += 2;
    if (c <= 0x7f)
        *rid = c;
    else if (c >= 0xcc && c <= 0xcf) {
        int n = 1 << (c - 0xcc);
        if (end - q < n) return 0;
        *rid = get_be(q, n);
        q += n;
    } else
        return 0;
    *p = q;
    return *rid != 0;
}

/* u's shortest msgpack uint encoding at p (9 bytes of room), as msgpack.Packer writes
 * it: its length. */
static inline Py_ssize_t put_uint(char *p, uint64_t u) {
    if (u <= 0x7f) {
        p[0] = (char)u;
        return 1;
    }
    int n = u <= 0xff ? 1 : u <= 0xffff ? 2 : u <= 0xffffffffULL ? 4 : 8;
    p[0] = (char)(n == 1 ? 0xcc : n == 2 ? 0xcd : n == 4 ? 0xce : 0xcf);
    put_be_n(p + 1, u, n);
    return 1 + n;
}

/* A str/bin/array header (fix family at fix_base when n <= fix_max, -1: none; the
 * 8/16/32 markers, m8 0 for none) at p (5 bytes of room): its length. */
static inline Py_ssize_t put_head(char *p, uint64_t n, int fix_base, long long fix_max, int m8,
                                  int m16, int m32) {
    if (fix_max >= 0 && n <= (uint64_t)fix_max) {
        p[0] = (char)(fix_base | (int)n);
        return 1;
    }
    if (m8 && n <= 0xff) {
        p[0] = (char)m8;
        p[1] = (char)n;
        return 2;
    }
    if (n <= 0xffff) {
        p[0] = (char)m16;
        put_be_n(p + 1, n, 2);
        return 3;
    }
    p[0] = (char)m32;
    put_be_n(p + 1, n, 4);
    return 5;
}
#endif
