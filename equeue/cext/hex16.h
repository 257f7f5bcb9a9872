/* Helpers of the batched send path (batch.c, answercols.c): a position's 16 lowercase hex
 * digits eight at a time (a message id's tail, as message_id writes it), and big-endian
 * stores of 2, 4 or 8 bytes in one go. */
#ifndef EQUEUE_HEX16_H
#define EQUEUE_HEX16_H
#include <stdint.h>
#include <string.h>

/* x's 8 hex digits as 8 ASCII bytes, the first digit in the lowest byte (SWAR: each
 * nibble spread to a byte, then '0'..'9' or 'a'..'f' in one go; ~15 instructions where
 * the table takes ~30). */
static inline uint64_t hex8(uint32_t x) {
    uint64_t v = x;
    v = ((v & 0xffff0000ULL) << 16) | (v & 0xffffULL);
    v = ((v & 0x0000ff000000ff00ULL) << 8) | (v & 0x000000ff000000ffULL);
    v = ((v & 0x00f000f000f000f0ULL) << 4) | (v & 0x000f000f000f000fULL);
    /* a nibble of 10..15 gets bit 4 set by adding 6: 'a' - '0' - 10 (39) more */
    uint64_t letters = ((v + 0x0606060606060606ULL) >> 4) & 0x0101010101010101ULL;
    v += 0x3030303030303030ULL + letters * 39;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    v = __builtin_bswap64(v); /* the first digit at the lowest address */
#endif
    return v;
}

static inline void put_hex16(char *p, uint64_t v) {
    uint64_t hi = hex8((uint32_t)(v >> 32)), lo = hex8((uint32_t)v);
    memcpy(p, &hi, 8);
    memcpy(p + 8, &lo, 8);
}

/* v's low n bytes (n: 1, 2, 4 or 8) big-endian at p. */
static inline void put_be_n(char *p, uint64_t v, int n) {
    if (n == 8) {
        uint64_t b = __builtin_bswap64(v);
        memcpy(p, &b, 8);
    } else if (n == 4) {
        uint32_t b = __builtin_bswap32((uint32_t)v);
        memcpy(p, &b, 4);
    } else if (n == 2) {
        uint16_t b = __builtin_bswap16((uint16_t)v);
        memcpy(p, &b, 2);
    } else {
        p[0] = (char)(v & 0xff);
    }
}
#endif
