/* Helpers of the batched send path (batch.c, answercols.c): a position's 16 lowercase hex
 * digits two at a time (a message id's tail, as message_id writes it), and big-endian
 * stores of 2, 4 or 8 bytes in one go. */
#ifndef EQUEUE_HEX16_H
#define EQUEUE_HEX16_H
#include <stdint.h>
#include <string.h>

static const char HEX_PAIRS[513] =
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
    "202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f"
    "404142434445464748494a4b4c4d4e4f505152535455565758595a5b5c5d5e5f"
    "606162636465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7f"
    "808182838485868788898a8b8c8d8e8f909192939495969798999a9b9c9d9e9f"
    "a0a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebf"
    "c0c1c2c3c4c5c6c7c8c9cacbcccdcecfd0d1d2d3d4d5d6d7d8d9dadbdcdddedf"
    "e0e1e2e3e4e5e6e7e8e9eaebecedeeeff0f1f2f3f4f5f6f7f8f9fafbfcfdfeff";

static inline void put_hex16(char *p, uint64_t v) {
    for (int k = 7; k >= 0; k--, v >>= 8) memcpy(p + 2 * k, HEX_PAIRS + 2 * (v & 0xff), 2);
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
