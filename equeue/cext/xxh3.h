/* The record checksum, XXH3-64 with seed 0, written out (see below): a header of static
 * inline functions, so that every file checksumming records (write.c, sender.c, read.c,
 * recover.c) inlines it; measured about 10% of send_batch when it was a call into
 * another file. Included by speedups.h. */
#ifndef EQUEUE_CEXT_XXH3_H
#define EQUEUE_CEXT_XXH3_H

/* --- XXH3-64 with seed 0 --------------------------------------------------------
 *
 * The record checksum is the low 32 bits of XXH3_64bits(payload) (format/chunk.py),
 * which Python computes with the xxhash package. This is the same function written
 * out from its specification (the XXH3 algorithm and its default 192-byte secret),
 * seed 0 only; tests/test_speedups.py checks it against the package for every
 * length up to 2 KiB and random contents. */

static const uint8_t SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
#define P32_1 0x9E3779B1u
#define P32_2 0x85EBCA77u
#define P32_3 0xC2B2AE3Du
#define P64_1 0x9E3779B185EBCA87ull
#define P64_2 0xC2B2AE3D27D4EB4Full
#define P64_3 0x165667B19E3779F9ull
#define P64_4 0x85EBCA77C2B2AE63ull
#define P64_5 0x27D4EB2F165667C5ull
#define MX1 0x165667919E3779F9ull
#define MX2 0x9FB21C651E98DF25ull

static inline uint64_t r64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t r32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t fold_mul(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static inline uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    return h ^ (h >> 32);
}

static inline uint64_t xxh3_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= MX1;
    return h ^ (h >> 32);
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *secret) {
    return fold_mul(r64(in) ^ r64(secret), r64(in + 8) ^ r64(secret + 8));
}

static inline uint64_t xxh3_short(const uint8_t *in, size_t len) { /* 0..16 bytes */
    if (len > 8) {
        uint64_t lo = (r64(SECRET + 24) ^ r64(SECRET + 32)) ^ r64(in);
        uint64_t hi = (r64(SECRET + 40) ^ r64(SECRET + 48)) ^ r64(in + len - 8);
        return xxh3_avalanche(len + __builtin_bswap64(lo) + hi + fold_mul(lo, hi));
    }
    if (len >= 4) {
        uint64_t both = (uint64_t)r32(in + len - 4) | ((uint64_t)r32(in) << 32);
        uint64_t acc = (r64(SECRET + 8) ^ r64(SECRET + 16)) ^ both;
        acc ^= rotl(acc, 49) ^ rotl(acc, 24);
        acc *= MX2;
        acc ^= (acc >> 35) + len;
        acc *= MX2;
        return acc ^ (acc >> 28);
    }
    if (len > 0) {
        uint32_t combined = ((uint32_t)in[0] << 16) | ((uint32_t)in[len >> 1] << 24) |
                            (uint32_t)in[len - 1] | ((uint32_t)len << 8);
        return xxh64_avalanche((uint64_t)combined ^ (uint64_t)(r32(SECRET) ^ r32(SECRET + 4)));
    }
    return xxh64_avalanche(r64(SECRET + 56) ^ r64(SECRET + 64));
}

/* One 64-byte stripe into the eight accumulators: acc[i ^ 1] += value[i], and acc[i] +=
 * the product of the low and high halves of value[i] ^ key[i]. With SSE2 (every x86-64)
 * two lanes at a time, as xxHash's own SSE2 path does: 2.5 times the scalar speed. */
#if defined(__SSE2__)
#include <emmintrin.h>
static inline void accumulate_stripe(uint64_t *acc, const uint8_t *stripe, const uint8_t *key) {
    for (int i = 0; i < 4; i++) {
        __m128i *lane = (__m128i *)(void *)acc + i;
        __m128i value = _mm_loadu_si128((const __m128i *)(const void *)stripe + i);
        __m128i keyed = _mm_xor_si128(value, _mm_loadu_si128((const __m128i *)(const void *)key + i));
        __m128i high = _mm_shuffle_epi32(keyed, _MM_SHUFFLE(0, 3, 0, 1));
        __m128i product = _mm_mul_epu32(keyed, high);
        __m128i swapped = _mm_shuffle_epi32(value, _MM_SHUFFLE(1, 0, 3, 2));
        _mm_store_si128(lane, _mm_add_epi64(_mm_load_si128(lane), _mm_add_epi64(product, swapped)));
    }
}
#define ACC_ALIGN _Alignas(16)
#else
static inline void accumulate_stripe(uint64_t *acc, const uint8_t *stripe, const uint8_t *key) {
    for (int i = 0; i < 8; i++) {
        uint64_t value = r64(stripe + 8 * i), keyed = value ^ r64(key + 8 * i);
        acc[i ^ 1] += value;
        acc[i] += (uint64_t)(uint32_t)keyed * (keyed >> 32);
    }
}
#define ACC_ALIGN
#endif

static inline uint64_t xxh3_long(const uint8_t *in, size_t len) { /* more than 240 bytes */
    const size_t stripes_per_block = (sizeof SECRET - 64) / 8, block = 64 * stripes_per_block;
    ACC_ALIGN uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    size_t blocks = (len - 1) / block;
    for (size_t b = 0; b <= blocks; b++) {
        const uint8_t *base = in + b * block;
        size_t stripes = b < blocks ? stripes_per_block : (len - 1 - block * blocks) / 64;
        for (size_t s = 0; s < stripes; s++)
            accumulate_stripe(acc, base + 64 * s, SECRET + 8 * s);
        if (b < blocks) /* scramble after each full block */
            for (int i = 0; i < 8; i++) {
                acc[i] ^= acc[i] >> 47;
                acc[i] ^= r64(SECRET + sizeof SECRET - 64 + 8 * i);
                acc[i] *= P32_1;
            }
    }
    accumulate_stripe(acc, in + len - 64, SECRET + sizeof SECRET - 64 - 7);
    uint64_t result = (uint64_t)len * P64_1;
    for (int i = 0; i < 4; i++)
        result += fold_mul(acc[2 * i] ^ r64(SECRET + 11 + 16 * i),
                           acc[2 * i + 1] ^ r64(SECRET + 11 + 16 * i + 8));
    return xxh3_avalanche(result);
}

static inline uint64_t xxh3_64(const uint8_t *in, size_t len) {
    if (len <= 16) return xxh3_short(in, len);
    if (len <= 128) {
        uint64_t acc = len * P64_1, end = 0;
        size_t rounds = (len - 1) / 32; /* pairs of 16-byte mixes from each end, 0..3 more */
        for (size_t i = 0; i <= rounds; i++) {
            acc += mix16(in + 16 * i, SECRET + 32 * i);
            end += mix16(in + len - 16 * (i + 1), SECRET + 32 * i + 16);
        }
        return xxh3_avalanche(acc + end);
    }
    if (len <= 240) {
        uint64_t acc = len * P64_1;
        for (size_t i = 0; i < 8; i++) acc += mix16(in + 16 * i, SECRET + 16 * i);
        acc = xxh3_avalanche(acc);
        for (size_t i = 8; i < len / 16; i++) acc += mix16(in + 16 * i, SECRET + 16 * (i - 8) + 3);
        acc += mix16(in + len - 16, SECRET + 136 - 17);
        return xxh3_avalanche(acc);
    }
    return xxh3_long(in, len);
}

/* The record checksum of format/chunk.py: the low 32 bits of xxh3_64(payload). */
static inline uint32_t checksum(const char *data, Py_ssize_t n) {
    return (uint32_t)xxh3_64((const uint8_t *)data, (size_t)n);
}

#endif
