/* Frames of msgpack records decoded straight into columns (restore.columns): the readers of the columnar restore
 * engine, so that no Python object is made per record.
 *
 * scan(buffer, start, end, capacity, first_frame, min_lrsn, mode, first_rid, check_crc, shift) reads the frames
 * of `buffer` (the bytes of a file from offset `shift` on: every offset taken and given is the file's) from `start` (each: u32 body length, u32 CRC32C of the body, the body; little endian) and appends a row
 * per record to the tables of restore.columns (recs, ss, ev, descs), as column buffers. It stops at the first
 * frame it cannot take, and says why: the caller then reads from there with the house's own reader, which raises
 * the error that frame deserves (or, at a torn end of a live log, ends where it ends). Nothing is appended for the
 * frame it stopped at.
 *
 * mode 0: log records (a map: k, l, u, s, g, at, o, by, e, d, i, ids, dd, ss; every str must be UTF-8, as the log's
 * reader decodes them); mode 1: backup frames ([step, descriptor, data]; a str need not be UTF-8 except the
 * descriptor fields taken as columns). A descriptor's own bytes and its data are not copied: their offsets in
 * the buffer are columns, read back for the entries that survive. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define MAX_RECORD_BYTES (256u << 20)
#define MAX_DEPTH 64

enum { STOP_END = 0, STOP_FRAME = 1, STOP_BODY = 2 };

#include "crc32c.h" /* native/: shared with backup._frames */

/* ------------------------------------------------------------------------------------------------ columns */
/* A column grows while the scan runs without the GIL: its buffers come from the raw allocator (PyMem_Raw*), which
 * needs no GIL; PyMem_Malloc's family does (pymalloc's pools are the GIL's), and PYTHONMALLOC=debug stops the
 * process on such a call. */
typedef struct {
    int is_str;
    Py_ssize_t n, cap;
    int64_t *i;      /* int64 values, or (str) n + 1 offsets */
    uint8_t *valid;  /* one byte a row */
    char *s;
    size_t slen, scap;
} Col;

static int col_grow(Col *c) {
    if (c->n + 2 <= c->cap) return 0;
    Py_ssize_t cap = c->cap ? c->cap * 2 : 1024;
    int64_t *i = PyMem_RawRealloc(c->i, (size_t)(cap + 1) * sizeof(int64_t));
    if (!i) return -1;
    c->i = i;
    uint8_t *v = PyMem_RawRealloc(c->valid, (size_t)cap);
    if (!v) return -1;
    c->valid = v;
    if (c->cap == 0 && c->is_str) c->i[0] = 0;
    c->cap = cap;
    return 0;
}

static int col_int(Col *c, int64_t v, int valid) {
    if (col_grow(c)) return -1;
    c->i[c->n] = valid ? v : 0;
    c->valid[c->n++] = (uint8_t)valid;
    return 0;
}

/* A string value of `a` then `b` (NULL, 0: nothing more). */
static int col_str2(Col *c, const char *a, size_t alen, const char *b, size_t blen, int valid) {
    if (col_grow(c)) return -1;
    size_t len = alen + blen;
    if (valid && len) {
        if (c->slen + len > c->scap) {
            size_t cap = c->scap ? c->scap : 4096;
            while (cap < c->slen + len) cap *= 2;
            char *ns = PyMem_RawRealloc(c->s, cap);
            if (!ns) return -1;
            c->s = ns;
            c->scap = cap;
        }
        memcpy(c->s + c->slen, a, alen);
        if (blen) memcpy(c->s + c->slen + alen, b, blen);
        c->slen += len;
    }
    c->valid[c->n] = (uint8_t)valid;
    c->i[++c->n] = (int64_t)c->slen;
    return 0;
}

static int col_str(Col *c, const char *s, size_t len, int valid) { return col_str2(c, s, len, NULL, 0, valid); }

static int hex_digit(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    return -1;
}

/* An entry id as the plan's tables hold it (restore.columns.entry_id reads it back): the 12 bytes its 24 lowercase
 * hex digits spell, for the ids members make, which DuckDB then holds inline (a string of more than 12 bytes it
 * keeps apart, behind a pointer, in every table, join and grouping); any other id as its UTF-8 after a marker,
 * "~", or "!~" for an id of 11 bytes: never 12 bytes long, so that no two ids are held alike. */
static int col_eid(Col *c, const char *s, size_t len) {
    if (len == 24) {
        char b[12];
        int k = 0;
        for (; k < 12; k++) {
            int hi = hex_digit(s[2 * k]), lo = hex_digit(s[2 * k + 1]);
            if (hi < 0 || lo < 0) break;
            b[k] = (char)(hi << 4 | lo);
        }
        if (k == 12) return col_str(c, b, 12, 1);
    }
    return len == 11 ? col_str2(c, "!~", 2, s, len, 1) : col_str2(c, "~", 1, s, len, 1);
}

static void col_truncate(Col *c, Py_ssize_t n) {
    if (n >= c->n) return;
    c->n = n;
    if (c->is_str) c->slen = (size_t)c->i[n];
}

static void col_free(Col *c) {
    PyMem_RawFree(c->i);
    PyMem_RawFree(c->valid);
    PyMem_RawFree(c->s);
    memset(c, 0, sizeof(*c));
}

/* (values or offsets, data or None, validity bitmap or None, null count) */
static PyObject *col_export(Col *c, int is_str) {
    Py_ssize_t n = c->n, nulls = 0;
    PyObject *bitmap = PyBytes_FromStringAndSize(NULL, (n + 7) / 8);
    if (!bitmap) return NULL;
    uint8_t *b = (uint8_t *)PyBytes_AS_STRING(bitmap);
    memset(b, 0, (size_t)(n + 7) / 8);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (c->valid[k]) b[k >> 3] |= (uint8_t)(1u << (k & 7));
        else nulls++;
    }
    PyObject *vals;
    if (is_str) {
        if (n == 0) {
            int64_t zero = 0;
            vals = PyBytes_FromStringAndSize((const char *)&zero, 8);
        } else {
            vals = PyBytes_FromStringAndSize((const char *)c->i, (Py_ssize_t)((size_t)(n + 1) * sizeof(int64_t)));
        }
    } else {
        vals = PyBytes_FromStringAndSize((const char *)c->i, (Py_ssize_t)((size_t)n * sizeof(int64_t)));
    }
    PyObject *data = is_str ? PyBytes_FromStringAndSize(c->s ? c->s : "", (Py_ssize_t)c->slen) : (Py_INCREF(Py_None), Py_None);
    if (!vals || !data) {
        Py_XDECREF(vals);
        Py_XDECREF(data);
        Py_DECREF(bitmap);
        return NULL;
    }
    if (nulls == 0) {
        Py_DECREF(bitmap);
        Py_INCREF(Py_None);
        bitmap = Py_None;
    }
    return Py_BuildValue("(NNNn)", vals, data, bitmap, nulls);
}

/* The tables and their columns: restore/columns.py names them in this order. */
enum { R_RID, R_L, R_OFF, R_K, R_U, R_S, R_G, R_AT, R_O, R_BY, R_EU, R_N };
enum { S_RID, S_S, S_G, S_N };
enum { E_RID, E_SRC, E_EID, E_DDS, E_N };
enum { D_RID, D_SRC, D_POS, D_EID, D_S, D_Q, D_P, D_EXP, D_ST, D_U, D_L, D_O1, D_O2, D_BC, D_BOFF, D_BLEN, D_DOFF,
       D_DLEN, D_N };
static const char R_STR[R_N] = {0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1};
static const char S_STR[S_N] = {0, 1, 0};
static const char E_STR[E_N] = {0, 0, 1, 1};
static const char D_STR[D_N] = {0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0};
/* Where an entry id comes from (ev.src), and a descriptor (descs.src). */
enum { SRC_E = 0, SRC_I = 1, SRC_IDS = 2, SRC_DD = 3, SRC_BACKUP = 4 };

typedef struct {
    Col r[R_N], s[S_N], e[E_N], d[D_N];
    int64_t shift;  /* the buffer's offset in its file: added to every offset a column holds */
} Tables;

static void tables_init(Tables *t) {
    memset(t, 0, sizeof(*t));
    for (int k = 0; k < R_N; k++) t->r[k].is_str = R_STR[k];
    for (int k = 0; k < S_N; k++) t->s[k].is_str = S_STR[k];
    for (int k = 0; k < E_N; k++) t->e[k].is_str = E_STR[k];
    for (int k = 0; k < D_N; k++) t->d[k].is_str = D_STR[k];
}

static void tables_free(Tables *t) {
    for (int k = 0; k < R_N; k++) col_free(&t->r[k]);
    for (int k = 0; k < S_N; k++) col_free(&t->s[k]);
    for (int k = 0; k < E_N; k++) col_free(&t->e[k]);
    for (int k = 0; k < D_N; k++) col_free(&t->d[k]);
}

typedef struct { Py_ssize_t r, s, e, d; } Marks;

static Marks tables_mark(Tables *t) { return (Marks){t->r[0].n, t->s[0].n, t->e[0].n, t->d[0].n}; }

static void tables_truncate(Tables *t, Marks m) {
    for (int k = 0; k < R_N; k++) col_truncate(&t->r[k], m.r);
    for (int k = 0; k < S_N; k++) col_truncate(&t->s[k], m.s);
    for (int k = 0; k < E_N; k++) col_truncate(&t->e[k], m.e);
    for (int k = 0; k < D_N; k++) col_truncate(&t->d[k], m.d);
}

static PyObject *export_table(Col *cols, const char *is_str, int n) {
    PyObject *out = PyTuple_New(n);
    if (!out) return NULL;
    for (int k = 0; k < n; k++) {
        PyObject *c = col_export(&cols[k], is_str[k]);
        if (!c) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, k, c);
    }
    return out;
}

/* ------------------------------------------------------------------------------------------------ msgpack */
typedef struct {
    const uint8_t *p, *end;
    int strict;  /* every str must be UTF-8 */
} Rd;

static int utf8_ok(const uint8_t *s, size_t n) {
    size_t k = 0;
    while (k < n) {
        if (k + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + k, 8);
            if (!(w & 0x8080808080808080ull)) {
                k += 8;
                continue;
            }
        }
        uint8_t c = s[k];
        if (c < 0x80) {
            k++;
        } else if (c >= 0xC2 && c <= 0xDF) {
            if (k + 1 >= n || (s[k + 1] & 0xC0) != 0x80) return 0;
            k += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (k + 2 >= n || (s[k + 1] & 0xC0) != 0x80 || (s[k + 2] & 0xC0) != 0x80) return 0;
            if (c == 0xE0 && s[k + 1] < 0xA0) return 0;
            if (c == 0xED && s[k + 1] > 0x9F) return 0;  /* surrogates */
            k += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (k + 3 >= n || (s[k + 1] & 0xC0) != 0x80 || (s[k + 2] & 0xC0) != 0x80 || (s[k + 3] & 0xC0) != 0x80)
                return 0;
            if (c == 0xF0 && s[k + 1] < 0x90) return 0;
            if (c == 0xF4 && s[k + 1] > 0x8F) return 0;
            k += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

static int need(Rd *r, size_t n) { return (size_t)(r->end - r->p) >= n; }

static uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int k = 0; k < n; k++) v = (v << 8) | p[k];
    return v;
}

/* A str header: 1 and its bytes, 0 for nil (consumed), -1 for another type (not consumed) or a short buffer. */
static int rd_str(Rd *r, const char **s, size_t *len) {
    if (!need(r, 1)) return -1;
    uint8_t t = *r->p;
    size_t h, n;
    if ((t & 0xE0) == 0xA0) { h = 1; n = t & 0x1F; }
    else if (t == 0xD9) { if (!need(r, 2)) return -1; h = 2; n = r->p[1]; }
    else if (t == 0xDA) { if (!need(r, 3)) return -1; h = 3; n = be(r->p + 1, 2); }
    else if (t == 0xDB) { if (!need(r, 5)) return -1; h = 5; n = be(r->p + 1, 4); }
    else if (t == 0xC0) { r->p++; return 0; }
    else return -1;
    if (!need(r, h + n)) return -1;
    *s = (const char *)r->p + h;
    *len = n;
    r->p += h + n;
    return 1;
}

static int rd_bin(Rd *r, const uint8_t **s, size_t *len) {
    if (!need(r, 1)) return -1;
    uint8_t t = *r->p;
    size_t h, n;
    if (t == 0xC4) { if (!need(r, 2)) return -1; h = 2; n = r->p[1]; }
    else if (t == 0xC5) { if (!need(r, 3)) return -1; h = 3; n = be(r->p + 1, 2); }
    else if (t == 0xC6) { if (!need(r, 5)) return -1; h = 5; n = be(r->p + 1, 4); }
    else return -1;
    if (!need(r, h + n)) return -1;
    *s = r->p + h;
    *len = n;
    r->p += h + n;
    return 1;
}

/* An integer: 1 and its value, 0 for nil (consumed), -1 for another type or one above int64. */
static int rd_int(Rd *r, int64_t *v) {
    if (!need(r, 1)) return -1;
    uint8_t t = *r->p;
    if (t <= 0x7F) { *v = t; r->p++; return 1; }
    if (t >= 0xE0) { *v = (int8_t)t; r->p++; return 1; }
    int n;
    int sign = 0;
    switch (t) {
        case 0xC0: r->p++; return 0;
        case 0xCC: n = 1; break;
        case 0xCD: n = 2; break;
        case 0xCE: n = 4; break;
        case 0xCF: n = 8; break;
        case 0xD0: n = 1; sign = 1; break;
        case 0xD1: n = 2; sign = 1; break;
        case 0xD2: n = 4; sign = 1; break;
        case 0xD3: n = 8; sign = 1; break;
        default: return -1;
    }
    if (!need(r, 1 + (size_t)n)) return -1;
    uint64_t u = be(r->p + 1, n);
    if (sign) {
        if (n < 8 && (u >> (8 * n - 1)) & 1) u |= ~0ull << (8 * n);
        *v = (int64_t)u;
    } else {
        if (u > (uint64_t)INT64_MAX) return -1;
        *v = (int64_t)u;
    }
    r->p += 1 + n;
    return 1;
}

static int rd_container(Rd *r, int map, uint32_t *count) {
    if (!need(r, 1)) return -1;
    uint8_t t = *r->p;
    if (map && (t & 0xF0) == 0x80) { *count = t & 0x0F; r->p++; return 1; }
    if (!map && (t & 0xF0) == 0x90) { *count = t & 0x0F; r->p++; return 1; }
    uint8_t t16 = map ? 0xDE : 0xDC, t32 = map ? 0xDF : 0xDD;
    if (t == t16) { if (!need(r, 3)) return -1; *count = (uint32_t)be(r->p + 1, 2); r->p += 3; return 1; }
    if (t == t32) { if (!need(r, 5)) return -1; *count = (uint32_t)be(r->p + 1, 4); r->p += 5; return 1; }
    return -1;
}

/* Skip one object; 0, or -1 when it is not well formed (or, strict, holds a str that is not UTF-8). */
static int rd_skip(Rd *r, int depth) {
    if (depth > MAX_DEPTH || !need(r, 1)) return -1;
    uint8_t t = *r->p;
    if (t <= 0x7F || t >= 0xE0 || t == 0xC0 || t == 0xC2 || t == 0xC3) { r->p++; return 0; }
    if ((t & 0xE0) == 0xA0 || t == 0xD9 || t == 0xDA || t == 0xDB) {
        const char *s;
        size_t n;
        if (rd_str(r, &s, &n) != 1) return -1;
        return r->strict && !utf8_ok((const uint8_t *)s, n) ? -1 : 0;
    }
    if ((t & 0xF0) == 0x80 || (t & 0xF0) == 0x90 || t == 0xDC || t == 0xDD || t == 0xDE || t == 0xDF) {
        int map = (t & 0xF0) == 0x80 || t == 0xDE || t == 0xDF;
        uint32_t n;
        if (rd_container(r, map, &n) != 1) return -1;
        for (uint64_t k = 0; k < (uint64_t)n * (map ? 2 : 1); k++)
            if (rd_skip(r, depth + 1)) return -1;
        return 0;
    }
    size_t h = 0, n = 0;
    switch (t) {
        case 0xC4: if (!need(r, 2)) return -1; h = 2; n = r->p[1]; break;
        case 0xC5: if (!need(r, 3)) return -1; h = 3; n = be(r->p + 1, 2); break;
        case 0xC6: if (!need(r, 5)) return -1; h = 5; n = be(r->p + 1, 4); break;
        case 0xC7: if (!need(r, 3)) return -1; h = 3; n = r->p[1]; break;
        case 0xC8: if (!need(r, 4)) return -1; h = 4; n = be(r->p + 1, 2); break;
        case 0xC9: if (!need(r, 6)) return -1; h = 6; n = be(r->p + 1, 4); break;
        case 0xCA: h = 5; break;
        case 0xCB: h = 9; break;
        case 0xCC: case 0xD0: h = 2; break;
        case 0xCD: case 0xD1: h = 3; break;
        case 0xCE: case 0xD2: h = 5; break;
        case 0xCF: case 0xD3: h = 9; break;
        case 0xD4: h = 3; break;
        case 0xD5: h = 4; break;
        case 0xD6: h = 6; break;
        case 0xD7: h = 10; break;
        case 0xD8: h = 18; break;
        default: return -1;
    }
    if (!need(r, h + n)) return -1;
    r->p += h + n;
    return 0;
}

static int key_is(const char *k, size_t n, const char *want) { return strlen(want) == n && memcmp(k, want, n) == 0; }

/* The descs column a descriptor's key fills, or -1 for a field the plan does not read. */
static int desc_col(const char *key, size_t klen) {
    if (klen > 3) return -1;
    if (key_is(key, klen, "id")) return D_EID;
    if (key_is(key, klen, "q")) return D_Q;
    if (key_is(key, klen, "p")) return D_P;
    if (key_is(key, klen, "exp")) return D_EXP;
    if (key_is(key, klen, "st")) return D_ST;
    if (key_is(key, klen, "u")) return D_U;
    if (key_is(key, klen, "l")) return D_L;
    if (key_is(key, klen, "o1")) return D_O1;
    if (key_is(key, klen, "o2")) return D_O2;
    if (key_is(key, klen, "bc")) return D_BC;
    return -1;
}

/* A descriptor (a wire-form map) as a row of descs, with the structure `s` (NULL: none), its bytes' place in the
 * buffer; the data's place is set by the caller (set_data). Returns 0, -1 (not one we read), -2 (no memory). */
static int take_desc(Rd *r, Tables *t, const uint8_t *base, int64_t rid, int64_t src, int64_t pos, const char *s,
                     size_t slen) {
    const uint8_t *start = r->p;
    uint32_t n;
    if (rd_container(r, 1, &n) != 1) return -1;
    const char *strs[D_N] = {0};
    size_t lens[D_N] = {0};
    int64_t ints[D_N] = {0};
    int valid[D_N] = {0}, seen[D_N] = {0};
    for (uint32_t k = 0; k < n; k++) {
        const char *key;
        size_t klen;
        if (rd_str(r, &key, &klen) != 1) return -1;
        if (r->strict && !utf8_ok((const uint8_t *)key, klen)) return -1;
        int col = desc_col(key, klen);
        if (col < 0) {
            if (rd_skip(r, 1)) return -1;
            continue;
        }
        if (seen[col]) return -1;  /* a repeated key: left to the house's reader */
        seen[col] = 1;
        if (D_STR[col]) {
            int g = rd_str(r, &strs[col], &lens[col]);
            if (g < 0 || (g == 1 && !utf8_ok((const uint8_t *)strs[col], lens[col]))) return -1;
            valid[col] = g == 1;
        } else {
            int g = rd_int(r, &ints[col]);
            if (g < 0) return -1;
            valid[col] = g == 1;
        }
    }
    if (!valid[D_EID] || !valid[D_L]) return -1;
    Col *d = t->d;
    int e = 0;
    e |= col_int(&d[D_RID], rid, 1);
    e |= col_int(&d[D_SRC], src, 1);
    e |= col_int(&d[D_POS], pos, 1);
    e |= col_eid(&d[D_EID], strs[D_EID], lens[D_EID]);
    e |= col_str(&d[D_S], s, slen, s != NULL);
    e |= col_str(&d[D_Q], strs[D_Q], lens[D_Q], 1);  /* q absent: "" (desc.get("q", "")) */
    /* p, exp, o1, o2, bc absent or nil: 0 (int(desc.get(name, 0))) */
    e |= col_int(&d[D_P], ints[D_P], 1);
    e |= col_int(&d[D_EXP], ints[D_EXP], 1);
    e |= col_str(&d[D_ST], strs[D_ST], lens[D_ST], valid[D_ST]);
    e |= col_str(&d[D_U], strs[D_U], lens[D_U], 1);  /* u absent or nil: "" (desc.get("u") or "") */
    e |= col_int(&d[D_L], ints[D_L], 1);
    e |= col_int(&d[D_O1], ints[D_O1], 1);
    e |= col_int(&d[D_O2], ints[D_O2], 1);
    e |= col_int(&d[D_BC], ints[D_BC], 1);
    e |= col_int(&d[D_BOFF], (int64_t)(start - base) + t->shift, 1);
    e |= col_int(&d[D_BLEN], (int64_t)(r->p - start), 1);
    e |= col_int(&d[D_DOFF], 0, 1);
    e |= col_int(&d[D_DLEN], 0, 1);
    return e ? -2 : 0;
}

static void set_data(Tables *t, Py_ssize_t row, int64_t off, int64_t len) {
    t->d[D_DOFF].i[row] = off;
    t->d[D_DLEN].i[row] = len;
}

static const char *str_at(Col *c, Py_ssize_t row, size_t *len) {
    *len = (size_t)(c->i[row + 1] - c->i[row]);
    return c->s + c->i[row];
}

/* One log record (a map) as rows. 0, -1 (not a record we read: the caller's reader says why), -2 (no memory). */
static int take_record(Rd *r, Tables *t, const uint8_t *base, int64_t rid, int64_t off, int64_t *lrsn) {
    uint32_t n;
    if (rd_container(r, 1, &n) != 1) return -1;
    Col *c = t->r;
    const char *k = NULL, *u = NULL, *s = NULL, *o = NULL, *by = NULL, *eu = NULL;
    size_t klen = 0, ulen = 0, slen = 0, olen = 0, bylen = 0, eulen = 0;
    int has_k = 0, has_l = 0, has_u = 0, has_s = 0, has_g = 0, has_at = 0, has_o = 0, has_by = 0, has_eu = 0;
    int64_t l = 0, g = 0, at = 0;
    const uint8_t *data = NULL;
    size_t dlen = 0;
    Py_ssize_t edesc = -1;
    static const char *const known[] = {"k", "l", "u", "s", "g", "at", "o", "by", "d", "e", "i", "ids", "dd", "ss"};
    uint32_t seen = 0;
    for (uint32_t x = 0; x < n; x++) {
        const char *key;
        size_t kl;
        if (rd_str(r, &key, &kl) != 1 || !utf8_ok((const uint8_t *)key, kl)) return -1;
        for (unsigned b = 0; b < sizeof(known) / sizeof(known[0]); b++) {
            if (key_is(key, kl, known[b])) {
                if (seen & (1u << b)) return -1;  /* a repeated key (msgpack keeps the last): the house's reader */
                seen |= 1u << b;
                break;
            }
        }
        int g_;
        if (key_is(key, kl, "k")) {
            if (rd_str(r, &k, &klen) != 1 || !utf8_ok((const uint8_t *)k, klen)) return -1;
            has_k = 1;
        } else if (key_is(key, kl, "l")) {
            if (rd_int(r, &l) != 1) return -1;
            has_l = 1;
        } else if (key_is(key, kl, "u")) {
            g_ = rd_str(r, &u, &ulen);
            if (g_ < 0 || (g_ == 1 && !utf8_ok((const uint8_t *)u, ulen))) return -1;
            has_u = g_ == 1;
        } else if (key_is(key, kl, "s")) {
            g_ = rd_str(r, &s, &slen);
            if (g_ < 0 || (g_ == 1 && !utf8_ok((const uint8_t *)s, slen))) return -1;
            has_s = g_ == 1;
        } else if (key_is(key, kl, "g")) {
            g_ = rd_int(r, &g);
            if (g_ < 0) return -1;
            has_g = g_ == 1;
        } else if (key_is(key, kl, "at")) {
            g_ = rd_int(r, &at);
            if (g_ < 0) return -1;
            has_at = g_ == 1;
        } else if (key_is(key, kl, "o")) {
            g_ = rd_str(r, &o, &olen);
            if (g_ < 0 || (g_ == 1 && !utf8_ok((const uint8_t *)o, olen))) return -1;
            has_o = g_ == 1;
        } else if (key_is(key, kl, "by")) {
            g_ = rd_str(r, &by, &bylen);
            if (g_ < 0 || (g_ == 1 && !utf8_ok((const uint8_t *)by, bylen))) return -1;
            has_by = g_ == 1;
        } else if (key_is(key, kl, "d")) {
            if (rd_bin(r, &data, &dlen) != 1) return -1;
        } else if (key_is(key, kl, "e")) {
            /* the descriptor of a put or a relog copy; its holder ("u") is the record's `eu` */
            edesc = t->d[D_RID].n;
            int rc = take_desc(r, t, base, rid, SRC_E, 0, NULL, 0);
            if (rc) return rc;
            has_eu = 1;
            size_t idl;
            const char *id = str_at(&t->d[D_EID], edesc, &idl);
            if (col_int(&t->e[E_RID], rid, 1) || col_int(&t->e[E_SRC], SRC_E, 1) || col_str(&t->e[E_EID], id, idl, 1) ||
                col_str(&t->e[E_DDS], NULL, 0, 0))
                return -2;
        } else if (key_is(key, kl, "i")) {
            const char *i;
            size_t il;
            if (rd_str(r, &i, &il) != 1 || !utf8_ok((const uint8_t *)i, il)) return -1;
            if (col_int(&t->e[E_RID], rid, 1) || col_int(&t->e[E_SRC], SRC_I, 1) || col_eid(&t->e[E_EID], i, il) ||
                col_str(&t->e[E_DDS], NULL, 0, 0))
                return -2;
        } else if (key_is(key, kl, "ids")) {
            uint32_t m;
            if (rd_container(r, 0, &m) != 1) return -1;
            for (uint32_t y = 0; y < m; y++) {
                const char *i;
                size_t il;
                if (rd_str(r, &i, &il) != 1 || !utf8_ok((const uint8_t *)i, il)) return -1;
                if (col_int(&t->e[E_RID], rid, 1) || col_int(&t->e[E_SRC], SRC_IDS, 1) ||
                    col_eid(&t->e[E_EID], i, il) || col_str(&t->e[E_DDS], NULL, 0, 0))
                    return -2;
            }
        } else if (key_is(key, kl, "dd")) {
            /* [[structure, descriptor, data], ...]: the entries of a backed-out UOW's gets */
            uint32_t m;
            if (rd_container(r, 0, &m) != 1) return -1;
            for (uint32_t y = 0; y < m; y++) {
                uint32_t three;
                const char *ds;
                size_t dsl;
                const uint8_t *dd;
                size_t ddl;
                if (rd_container(r, 0, &three) != 1 || three != 3) return -1;
                if (rd_str(r, &ds, &dsl) != 1 || !utf8_ok((const uint8_t *)ds, dsl)) return -1;
                Py_ssize_t row = t->d[D_RID].n;
                int rc = take_desc(r, t, base, rid, SRC_DD, y, ds, dsl);
                if (rc) return rc;
                if (rd_bin(r, &dd, &ddl) != 1) return -1;
                set_data(t, row, (int64_t)(dd - base) + t->shift, (int64_t)ddl);
                size_t idl;
                const char *id = str_at(&t->d[D_EID], row, &idl);
                if (col_int(&t->e[E_RID], rid, 1) || col_int(&t->e[E_SRC], SRC_DD, 1) || col_str(&t->e[E_EID], id, idl, 1) ||
                    col_str(&t->e[E_DDS], ds, dsl, 1))
                    return -2;
            }
        } else if (key_is(key, kl, "ss")) {
            uint32_t m;
            if (rd_container(r, 1, &m) != 1) return -1;
            for (uint32_t y = 0; y < m; y++) {
                const char *ss;
                size_t ssl;
                int64_t sg = 0;
                if (rd_str(r, &ss, &ssl) != 1 || !utf8_ok((const uint8_t *)ss, ssl)) return -1;
                int gg = rd_int(r, &sg);
                if (gg < 0) return -1;
                if (col_int(&t->s[S_RID], rid, 1) || col_str(&t->s[S_S], ss, ssl, 1) || col_int(&t->s[S_G], sg, gg == 1))
                    return -2;
            }
        } else {
            if (rd_skip(r, 1)) return -1;
        }
    }
    if (!has_k || !has_l) return -1;
    if (edesc >= 0) {
        if (data) set_data(t, edesc, (int64_t)(data - base) + t->shift, (int64_t)dlen);
        eu = str_at(&t->d[D_U], edesc, &eulen);  /* the copy's holder, "" for none */
    }
    *lrsn = l;
    int e = 0;
    e |= col_int(&c[R_RID], rid, 1);
    e |= col_int(&c[R_L], l, 1);
    e |= col_int(&c[R_OFF], off, 1);
    e |= col_str(&c[R_K], k, klen, 1);
    e |= col_str(&c[R_U], u, ulen, has_u);
    e |= col_str(&c[R_S], s, slen, has_s);
    e |= col_int(&c[R_G], g, has_g);
    e |= col_int(&c[R_AT], at, has_at);
    e |= col_str(&c[R_O], o, olen, has_o);
    e |= col_str(&c[R_BY], by, bylen, has_by);
    e |= col_str(&c[R_EU], eu, eulen, has_eu);
    return e ? -2 : 0;
}

/* One backup frame [step, descriptor, data] as a row of descs. */
static int take_copy(Rd *r, Tables *t, const uint8_t *base, int64_t rid) {
    uint32_t three;
    int64_t step;
    const uint8_t *data;
    size_t dlen;
    if (rd_container(r, 0, &three) != 1 || three != 3 || rd_int(r, &step) != 1) return -1;
    Py_ssize_t row = t->d[D_RID].n;
    int rc = take_desc(r, t, base, rid, SRC_BACKUP, 0, NULL, 0);
    if (rc) return rc;
    if (rd_bin(r, &data, &dlen) != 1) return -1;
    set_data(t, row, (int64_t)(data - base) + t->shift, (int64_t)dlen);
    return 0;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    Py_ssize_t start, end, cap, first_frame;
    long long min_lrsn, first_rid;
    int mode, check_crc;
    long long shift;
    if (!PyArg_ParseTuple(args, "y*nnnnLiLpL", &view, &start, &end, &cap, &first_frame, &min_lrsn, &mode, &first_rid,
                          &check_crc, &shift))
        return NULL;
    if (start < 0 || end > view.len || start > end) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "scan: start and end must lie within the buffer");
        return NULL;
    }
    const uint8_t *base = view.buf;
    Tables *t = PyMem_Malloc(sizeof(Tables));
    if (!t) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    tables_init(t);
    t->shift = shift;
    Py_ssize_t off = start;
    int64_t rid = first_rid, max_lrsn = INT64_MIN, records = 0;
    int stop = STOP_END, nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    while (off < end) {
        if (end - off < 8) { stop = STOP_FRAME; break; }
        uint32_t length = (uint32_t)base[off] | (uint32_t)base[off + 1] << 8 | (uint32_t)base[off + 2] << 16 |
                          (uint32_t)base[off + 3] << 24;
        uint32_t crc = (uint32_t)base[off + 4] | (uint32_t)base[off + 5] << 8 | (uint32_t)base[off + 6] << 16 |
                       (uint32_t)base[off + 7] << 24;
        int64_t at = (int64_t)off + shift;  /* the frame's offset in its file */
        if (length == 0 || length > MAX_RECORD_BYTES || (at != first_frame && at + 8 + (int64_t)length > cap) ||
            off + 8 + (Py_ssize_t)length > end) {
            stop = STOP_FRAME;
            break;
        }
        const uint8_t *body = base + off + 8;
        if (check_crc && crc32c(body, length) != crc) { stop = STOP_FRAME; break; }
        Rd r = {body, body + length, mode == 0};
        Marks m = tables_mark(t);
        int64_t lrsn = 0;
        int rc = mode == 0 ? take_record(&r, t, base, rid, at, &lrsn) : take_copy(&r, t, base, rid);
        if (rc == 0 && r.p != r.end) rc = -1;  /* trailing bytes: msgpack's unpackb refuses them */
        if (rc) {
            tables_truncate(t, m);
            if (rc == -2) nomem = 1;
            else stop = STOP_BODY;
            break;
        }
        if (mode == 0 && lrsn < min_lrsn) {
            tables_truncate(t, m);  /* decoded (a bad one stops the scan as the reader would) but not kept */
        } else {
            if (mode == 0 && lrsn > max_lrsn) max_lrsn = lrsn;
            rid++;
            records++;
        }
        off += 8 + (Py_ssize_t)length;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (nomem) {
        tables_free(t);
        PyMem_Free(t);
        return PyErr_NoMemory();
    }
    PyObject *rt = export_table(t->r, R_STR, R_N), *st = export_table(t->s, S_STR, S_N),
             *et = export_table(t->e, E_STR, E_N), *dt = export_table(t->d, D_STR, D_N);
    Py_ssize_t nr = t->r[0].n, ns = t->s[0].n, ne = t->e[0].n, nd = t->d[0].n;
    tables_free(t);
    PyMem_Free(t);
    if (!rt || !st || !et || !dt) {
        Py_XDECREF(rt);
        Py_XDECREF(st);
        Py_XDECREF(et);
        Py_XDECREF(dt);
        return NULL;
    }
    return Py_BuildValue("(LiLL((nN)(nN)(nN)(nN)))", (long long)off + shift, stop, (long long)records,
                         (long long)(max_lrsn == INT64_MIN ? -1 : max_lrsn), nr, rt, ns, st, ne, et, nd, dt);
}

/* read_pieces(fds, f, boff, blen, doff, dlen) -> (descriptors, datas): for each row k, the blen[k] bytes at
 * boff[k] and the dlen[k] bytes at doff[k] of the file fds[f[k]] (f, boff, ...: buffers of int64, one a row).
 * The rows are read in the order of their places: pieces of one file that lie close together (the survivors of
 * one queue, in commit order, lie close together in the log that put them) are read by one pread of the span
 * that holds them (SPAN_BYTES at most, gaps of GAP_BYTES at most): a pread costs more than copying some bytes
 * too many. The bytes a read did not find (a file shorter than its columns say) raise OSError. */
#define SPAN_BYTES (1 << 20)
#define GAP_BYTES (64 << 10)

typedef struct {
    int64_t f, off, end;  /* the file, and the span of the row's descriptor and data in it */
    Py_ssize_t row;
} Piece;

static int piece_cmp(const void *a, const void *b) {
    const Piece *x = a, *y = b;
    if (x->f != y->f) return x->f < y->f ? -1 : 1;
    if (x->off != y->off) return x->off < y->off ? -1 : 1;
    return 0;
}

static int pread_all(int fd, char *buf, int64_t len, int64_t off) {
    while (len > 0) {
        ssize_t got = pread(fd, buf, (size_t)len, (off_t)off);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (got == 0) {
            errno = EIO;
            return -1;
        }
        buf += got;
        len -= got;
        off += got;
    }
    return 0;
}

static PyObject *read_pieces(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *fds_obj;
    Py_buffer b[5];
    if (!PyArg_ParseTuple(args, "Oy*y*y*y*y*", &fds_obj, &b[0], &b[1], &b[2], &b[3], &b[4])) return NULL;
    PyObject *descs = NULL, *datas = NULL, *fds = NULL, *out = NULL;
    char *span = NULL;
    Piece *order = NULL;
    Py_ssize_t n = b[0].len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *f = b[0].buf, *boff = b[1].buf, *blen = b[2].buf, *doff = b[3].buf, *dlen = b[4].buf;
    for (int k = 1; k < 5; k++) {
        if (b[k].len != b[0].len) {
            PyErr_SetString(PyExc_ValueError, "read_pieces: the columns differ in length");
            goto done;
        }
    }
    fds = PySequence_Fast(fds_obj, "read_pieces: fds must be a sequence");
    if (!fds) goto done;
    Py_ssize_t nfds = PySequence_Fast_GET_SIZE(fds);
    descs = PyList_New(n);
    datas = PyList_New(n);
    order = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Piece));
    span = PyMem_Malloc(SPAN_BYTES);
    if (!descs || !datas || !order || !span) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (f[k] < 0 || f[k] >= nfds || boff[k] < 0 || blen[k] < 0 || dlen[k] < 0 || (dlen[k] && doff[k] < 0)) {
            PyErr_SetString(PyExc_ValueError, "read_pieces: a row names no open source, or no place in it");
            goto done;
        }
        int64_t lo = boff[k], hi = boff[k] + blen[k];
        if (dlen[k]) {
            if (doff[k] < lo) lo = doff[k];
            if (doff[k] + dlen[k] > hi) hi = doff[k] + dlen[k];
        }
        order[k] = (Piece){f[k], lo, hi, k};
        PyObject *d = PyBytes_FromStringAndSize(NULL, blen[k]);
        if (!d) goto done;
        PyList_SET_ITEM(descs, k, d);
        PyObject *x = PyBytes_FromStringAndSize(NULL, dlen[k]);
        if (!x) goto done;
        PyList_SET_ITEM(datas, k, x);
    }
    qsort(order, (size_t)n, sizeof(Piece), piece_cmp);
    for (Py_ssize_t g = 0; g < n;) {
        /* the group: the rows from g on whose spans fit in one read */
        Py_ssize_t h = g + 1;
        int64_t lo = order[g].off, hi = order[g].end;
        while (h < n && order[h].f == order[g].f && order[h].off - hi <= GAP_BYTES &&
               (order[h].end > hi ? order[h].end : hi) - lo <= SPAN_BYTES) {
            if (order[h].end > hi) hi = order[h].end;
            h++;
        }
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(fds, order[g].f));
        if (fd < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "read_pieces: a row names no open source");
            goto done;
        }
        for (Py_ssize_t k = g; k < h; k++) {
            Py_ssize_t row = order[k].row;
            char *d = PyBytes_AS_STRING(PyList_GET_ITEM(descs, row)), *x = PyBytes_AS_STRING(PyList_GET_ITEM(datas, row));
            int rc = 0;
            if (hi - lo <= SPAN_BYTES) {
                if (k == g) rc = pread_all((int)fd, span, hi - lo, lo);
                if (rc == 0) {
                    memcpy(d, span + (boff[row] - lo), (size_t)blen[row]);
                    if (dlen[row]) memcpy(x, span + (doff[row] - lo), (size_t)dlen[row]);
                }
            } else {  /* one piece larger than a span: read as it is */
                rc = pread_all((int)fd, d, blen[row], boff[row]);
                if (rc == 0 && dlen[row]) rc = pread_all((int)fd, x, dlen[row], doff[row]);
            }
            if (rc) {
                PyErr_SetFromErrno(PyExc_OSError);
                goto done;
            }
        }
        g = h;
    }
    out = PyTuple_Pack(2, descs, datas);
done:
    Py_XDECREF(descs);
    Py_XDECREF(datas);
    Py_XDECREF(fds);
    PyMem_Free(span);
    PyMem_Free(order);
    for (int k = 0; k < 5; k++) PyBuffer_Release(&b[k]);
    return out;
}

static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*", &view)) return NULL;
    uint32_t c = crc32c(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "Frames of msgpack records as column buffers (see restore/columns.py)."},
    {"crc32c", py_crc32c, METH_VARARGS, "CRC32C of a buffer (the frames' checksum)."},
    {"read_pieces", read_pieces, METH_VARARGS, "Descriptors and data read back by their places (restore/columns.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_columns", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__columns(void) {
    crc32c_init();
    return PyModule_Create(&module);
}
