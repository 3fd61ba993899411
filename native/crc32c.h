/* CRC32C (Castagnoli), the checksum of every frame of the logs and the backups: shared by the C extensions of
 * the floors that write and read frames (backup._frames, restore._columns), each built with this directory on
 * its include path. SSE4.2's crc32 instruction where the CPU has it (crc32c_init asks once), eight tables of
 * 256 entries elsewhere. crc32c_extend(crc, p, n) continues a finished CRC over more bytes, as the crc32c
 * package's crc32c(data, value) does, so that a body of two pieces is checked without joining them. */
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
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c32, const uint8_t *p, size_t n) {
    uint64_t c = c32;
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
#endif
}

static inline uint32_t crc32c_extend(uint32_t crc, const uint8_t *p, size_t n) {
    return CRC_STEP(crc ^ 0xFFFFFFFFu, p, n) ^ 0xFFFFFFFFu;
}

static inline uint32_t crc32c(const uint8_t *p, size_t n) { return crc32c_extend(0, p, n); }

#endif
