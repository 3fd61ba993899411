/* A msgpack map key the CF's writers encode as a fixstr of 3 (4 bytes: 0xa3 and its three letters), found in a
 * descriptor's bytes: shared by backup/_frames.c ("per") and cfemu/_bulk.c ("len").
 *
 * memchr for the key's first byte, then a compare of the three after it. A descriptor is some hundred bytes, where
 * memmem's set-up for each call cost more than the search (a twentieth of a backup's CPU). */
#ifndef CFEMU_MSGPACK_KEY_H
#define CFEMU_MSGPACK_KEY_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MSGPACK_KEY_BYTES 4

/* The first occurrence of the 4-byte `key` in p[0:n], or NULL. */
static inline const uint8_t *find_msgpack_key(const uint8_t *p, size_t n, const uint8_t key[MSGPACK_KEY_BYTES]) {
    const uint8_t *end = p + n;
    while ((size_t)(end - p) >= MSGPACK_KEY_BYTES) {
        const uint8_t *k = memchr(p, key[0], (size_t)(end - p) - (MSGPACK_KEY_BYTES - 1));
        if (k == NULL) return NULL;
        if (memcmp(k + 1, key + 1, MSGPACK_KEY_BYTES - 1) == 0) return k;
        p = k + 1;
    }
    return NULL;
}

#endif
