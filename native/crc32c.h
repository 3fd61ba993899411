/* CRC32C (Castagnoli), the checksum of every frame of the logs and the backups: shared by the C extensions of
 * the floors that write and read frames (backup._frames, restore._columns), each built with this directory on
 * its include path. SSE4.2's crc32 instruction where the CPU has it (crc32c_init asks once), eight tables of
 * 256 entries elsewhere. crc32c_extend(crc, p, n) continues a finished CRC over more bytes, as the crc32c
 * package's crc32c(data, value) does, so that a body of two pieces is checked without joining them.
 *
 * The instruction takes three cycles to give its result and can start one every cycle: one chain of it over a
 * buffer runs at a third of the speed the CPU has. So a buffer of at least three blocks is taken as three chains
 * side by side, one a block, and the three CRCs are joined: the CRC of a block that follows another is that of
 * the first shifted over the second's length in zeros (a linear operator on 32 bits, applied by four tables of
 * 256 entries made at init for each block length), xored with the second's own from zero. This is zlib's
 * crc32_combine, with the block lengths fixed so that the operators are tables made once. */
#ifndef CFEMU_CRC32C_H
#define CFEMU_CRC32C_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static uint32_t crc_table[8][256];

static uint32_t crc_soft(uint32_t c, const uint8_t *p, size_t n) {
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^ crc_table[5][(w >> 16) & 0xff] ^
            crc_table[4][(w >> 24) & 0xff] ^ crc_table[3][(w >> 32) & 0xff] ^ crc_table[2][(w >> 40) & 0xff] ^
            crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xff];
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
enum { CRC_LONG = 8192, CRC_SHORT = 256 }; /* the blocks of the three chains: long buffers, then what is left */
static uint32_t crc_long[4][256], crc_short[4][256]; /* CRC_LONG and CRC_SHORT zero bytes, as operators */

static inline uint32_t crc_shift(uint32_t zeros[4][256], uint32_t c) {
    return zeros[0][c & 0xff] ^ zeros[1][(c >> 8) & 0xff] ^ zeros[2][(c >> 16) & 0xff] ^ zeros[3][c >> 24];
}

/* Three blocks of `block` bytes at p as three chains side by side; the first chain's CRC is shifted over each of
 * the other blocks (`zeros`: the operator of `block` zero bytes) and joined with theirs. */
__attribute__((target("sse4.2"))) static inline uint64_t crc_three(uint64_t c, const uint8_t *p, size_t block,
                                                                   uint32_t zeros[4][256]) {
    uint64_t c1 = 0, c2 = 0;
    for (const uint8_t *end = p + block; p < end; p += 8) {
        uint64_t w0, w1, w2;
        memcpy(&w0, p, 8);
        memcpy(&w1, p + block, 8);
        memcpy(&w2, p + 2 * block, 8);
        c = __builtin_ia32_crc32di(c, w0);
        c1 = __builtin_ia32_crc32di(c1, w1);
        c2 = __builtin_ia32_crc32di(c2, w2);
    }
    c = crc_shift(zeros, (uint32_t)c) ^ (uint32_t)c1;
    return crc_shift(zeros, (uint32_t)c) ^ (uint32_t)c2;
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c32, const uint8_t *p, size_t n) {
    uint64_t c = c32;
    for (; n >= 3 * CRC_LONG; p += 3 * CRC_LONG, n -= 3 * CRC_LONG) c = crc_three(c, p, CRC_LONG, crc_long);
    for (; n >= 3 * CRC_SHORT; p += 3 * CRC_SHORT, n -= 3 * CRC_SHORT) c = crc_three(c, p, CRC_SHORT, crc_short);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = __builtin_ia32_crc32di(c, w);
        p += 8;
        n -= 8;
    }
    c32 = (uint32_t)c;
    while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
static int have_hw;
#define CRC_STEP(c, p, n) (have_hw ? crc_hw((c), (p), (n)) : crc_soft((c), (p), (n)))
#else
#define CRC_STEP(c, p, n) crc_soft((c), (p), (n))
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* The operators on a CRC of 32 bits as 32 columns (mat[k]: the image of bit k). */
static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    for (; vec; vec >>= 1, mat++)
        if (vec & 1) sum ^= *mat;
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int k = 0; k < 32; k++) square[k] = gf2_times(mat, mat[k]);
}

/* The tables of the operator that shifts a CRC over `len` zero bytes (len a power of two). */
static void crc_zeros(uint32_t zeros[4][256], size_t len) {
    uint32_t odd[32], even[32], *op = even;
    odd[0] = 0x82F63B78u; /* one zero bit */
    for (int k = 1; k < 32; k++) odd[k] = (uint32_t)1 << (k - 1);
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four */
    for (;;) {             /* then one zero byte, two, four, ... until len */
        gf2_square(even, odd);
        op = even;
        len >>= 1;
        if (len == 0) break;
        gf2_square(odd, even);
        op = odd;
        len >>= 1;
        if (len == 0) break;
    }
    for (uint32_t b = 0; b < 256; b++)
        for (int t = 0; t < 4; t++) zeros[t][b] = gf2_times(op, b << (8 * t));
}
#endif

static void crc32c_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++) crc_table[t][n] = (crc_table[t - 1][n] >> 8) ^ crc_table[0][crc_table[t - 1][n] & 0xff];
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    have_hw = __builtin_cpu_supports("sse4.2");
    crc_zeros(crc_long, CRC_LONG);
    crc_zeros(crc_short, CRC_SHORT);
#endif
}

static inline uint32_t crc32c_extend(uint32_t crc, const uint8_t *p, size_t n) {
    return CRC_STEP(crc ^ 0xFFFFFFFFu, p, n) ^ 0xFFFFFFFFu;
}

static inline uint32_t crc32c(const uint8_t *p, size_t n) { return crc32c_extend(0, p, n); }

#endif
