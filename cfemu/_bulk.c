/* The CF format's bulk work in C: a restore load's batches staged from columns (stage, cut: cfemu.bulk.
 * prepare_columns) and their commands packed (pair_parts, pack_groups: cfemu.resp.Packed), each described where it
 * is defined below; and the parts of a fetched batch's data, told in C (cfemu.bulk.parts), and the ids of a
 * fetch's HMGETs packed in C (pack_args): a backup reads every descriptor of the
 * structure, and the Python loop that read each one's data length cost it about half a microsecond an entry.
 * cfemu/bulk.py keeps the same rule in Python: the reference, and what runs where this module was not built.
 *
 * parts(descs, limit, length_of) -> [(a, b), ...]: the [a, b) index ranges in which the data of entries with
 * these descriptors (the CF's msgpack bytes, or None for an entry gone: 0 bytes) is read, at most `limit` bytes
 * each (0 <= limit < 2**61), one entry at least. A descriptor's data length is read at sight as cfemu.bulk.data_length reads it (its
 * "len" key once, an unsigned integer behind it); any other descriptor is handed to length_of (data_length
 * itself, which decodes it). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "msgpack_key.h"

#define MAX_LIMIT (1LL << 61)

static const uint8_t LEN_KEY[4] = {0xa3, 'l', 'e', 'n'}; /* msgpack's "len", a fixstr of 3 */

/* The data length at sight (cfemu.bulk.data_length's rule), or -1 where it cannot be read so. */
static long long length_at_sight(const uint8_t *raw, size_t n) {
    if (n < sizeof LEN_KEY) return -1;
    const uint8_t *k = find_msgpack_key(raw, n, LEN_KEY);
    if (k == NULL) return -1;
    size_t i = (size_t)(k - raw), j = i + 4;
    if (n - j >= sizeof LEN_KEY && find_msgpack_key(raw + j, n - j, LEN_KEY) != NULL) return -1;
    if (j >= n) return -1;
    uint8_t first = raw[j];
    if (first < 0x80) return first;
    size_t width = first == 0xcc ? 1 : first == 0xcd ? 2 : first == 0xce ? 4 : first == 0xcf ? 8 : 0;
    if (width == 0 || j + 1 + width > n) return -1;
    unsigned long long v = 0;
    for (size_t b = 0; b < width; b++) v = v << 8 | raw[j + 1 + b];
    return v > (unsigned long long)LLONG_MAX ? LLONG_MAX : (long long)v;
}

static PyObject *parts(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *descs, *length_of;
    long long limit;
    if (!PyArg_ParseTuple(args, "O!LO", &PyList_Type, &descs, &limit, &length_of)) return NULL;
    if (limit < 0 || limit >= MAX_LIMIT) {
        PyErr_Format(PyExc_ValueError, "a part's limit is 0 to 2**61 - 1 bytes, not %lld", limit);
        return NULL;
    }
    /* Sizes are taken within [-2^40, limit + 1]: every comparison with the limit answers as with the true size,
     * and no sum of a batch's sizes overflows. */
    const long long most = limit + 1, least = -(1LL << 40);
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(descs), start = 0;
    long long held = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *raw = PyList_GET_ITEM(descs, k);
        long long size = 0;
        if (raw != Py_None) {
            size = PyBytes_Check(raw) ? length_at_sight((const uint8_t *)PyBytes_AS_STRING(raw),
                                                        (size_t)PyBytes_GET_SIZE(raw))
                                      : -1;
            if (size < 0) {
                Py_INCREF(raw); /* length_of runs Python code: the item is held while it does */
                PyObject *said = PyObject_CallOneArg(length_of, raw);
                Py_DECREF(raw);
                if (said == NULL) goto fail;
                int overflow = 0;
                size = PyLong_AsLongLongAndOverflow(said, &overflow);
                Py_DECREF(said);
                if (size == -1 && PyErr_Occurred()) goto fail;
                if (overflow) size = overflow > 0 ? most : least;
                if (count != PyList_GET_SIZE(descs)) {
                    PyErr_SetString(PyExc_RuntimeError, "the descriptors changed while their parts were told");
                    goto fail;
                }
            }
            size = size > most ? most : size < least ? least : size;
        }
        if (k > start && held + size > limit) {
            PyObject *part = Py_BuildValue("(nn)", start, k);
            if (part == NULL || PyList_Append(out, part) < 0) {
                Py_XDECREF(part);
                goto fail;
            }
            Py_DECREF(part);
            start = k;
            held = 0;
        }
        held += size;
    }
    if (start < count) {
        PyObject *part = Py_BuildValue("(nn)", start, count);
        if (part == NULL || PyList_Append(out, part) < 0) {
            Py_XDECREF(part);
            goto fail;
        }
        Py_DECREF(part);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* pack_args(items) -> bytes: the items (bytes, or str as UTF-8) as RESP bulk strings, one after the other: the
 * arguments of a command after its count line, as hiredis.pack_command writes them. A fetch's HMGET of 2,000 ids
 * packed by pack_command cost about 0.1 us an id, as much as the parsing of its reply. */
/* "$<n>\r\n" at p (n >= 0), without printf's format parsing (two per entry a backup fetches); returns its end. */
static char *put_bulk_head(char *p, Py_ssize_t n) {
    char digits[24];
    int k = 0;
    do {
        digits[k++] = (char)('0' + n % 10);
        n /= 10;
    } while (n > 0);
    *p++ = '$';
    while (k > 0) *p++ = digits[--k];
    *p++ = '\r';
    *p++ = '\n';
    return p;
}

static PyObject *pack_args(PyObject *self, PyObject *arg) {
    (void)self;
    PyObject *items = PySequence_Fast(arg, "pack_args takes a list or a tuple of bytes or str");
    if (items == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items), total = 0;
    PyObject **item = PySequence_Fast_ITEMS(items), *out = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t n;
        if (PyBytes_Check(item[i])) {
            n = PyBytes_GET_SIZE(item[i]);
        } else if (PyUnicode_Check(item[i])) {
            if (PyUnicode_AsUTF8AndSize(item[i], &n) == NULL) goto done;
        } else {
            PyErr_Format(PyExc_TypeError, "argument %zd is %s, not bytes or str", i, Py_TYPE(item[i])->tp_name);
            goto done;
        }
        total += n + 25; /* "$", at most 20 digits, "\r\n", the bytes, "\r\n" */
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) goto done;
    char *p = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        const char *b;
        Py_ssize_t n;
        if (PyBytes_Check(item[i])) {
            b = PyBytes_AS_STRING(item[i]);
            n = PyBytes_GET_SIZE(item[i]);
        } else {
            b = PyUnicode_AsUTF8AndSize(item[i], &n); /* cached by the first pass */
        }
        p = put_bulk_head(p, n);
        memcpy(p, b, (size_t)n);
        p += n;
        *p++ = '\r';
        *p++ = '\n';
    }
    if (_PyBytes_Resize(&out, p - PyBytes_AS_STRING(out)) < 0) out = NULL;
done:
    Py_DECREF(items);
    return out;
}

/* ---- A load batch from columns: stage() and cut() --------------------------------------------------------------
 *
 * stage(ids, descs, datas, masks, backup, overrides, start, end, list_name, index_prefixes, uow_prefix,
 *       aside_suffix) -> (descriptors, lists, sets, expiry, held, queues, nbytes) | None
 *
 * What cfemu.bulk.prepare makes of the entries [start, end) of these columns, without Python per entry: entry k
 * is ids[k] (str), its base descriptor descs[k] (the msgpack bytes a backup or a log holds) with the fields of
 * OVERRIDES (st, u, l, o1, o2, bc: bit j of masks[k] set means field j is overrides[j][k]; a backup's copy
 * (backup[k] true) whose property table is not a map has the CF's empty one), and its data datas[k]. Returned:
 * each entry's descriptor as cfemu.bulk.descriptor packs it (the same bytes), and the grouping prepare makes, in
 * its first-seen order: list name -> ids (the name by list_name(queue, state, priority), once a distinct place),
 * set name (bytes) -> ids (the UOW's set: uow_prefix + uow, then the correlation and message id indexes:
 * index_prefixes(queue) -> (its correlation ids' prefix, its message ids'), once a queue), [exp, id, ...], UOW ->
 * lowest LRSN, the queues, the data's bytes.
 *
 * None: an entry the C path does not take exactly as Python would (a descriptor that is not a map msgpack-python
 * would read into the same dict, an ext type, a string that is not strict UTF-8 where one is packed, a value of a
 * type prepare would convert or refuse, more than MAX_PROPERTIES properties, a queue ending in aside_suffix, ...): the caller
 * prepares the batch in Python (bulk.prepare), where every error and edge case is as it always was. RuntimeError:
 * list_name or index_prefixes (or a backup flag's truth) shortened the columns while their entries were staged.
 *
 * cut(datas, start, size, max_bytes) -> end | -1: where the batch that begins at `start` ends by the load's batch
 * rule, cfemu.bulk.batch_full (`size` entries, or fewer once their data reach max_bytes, 0: no bound), -1 where
 * datas end first. */

enum { K_MISSING = 0, K_NIL, K_BOOL, K_INT, K_FLOAT, K_STR, K_BIN, K_ARRAY, K_MAP };

typedef struct {
    int kind;
    int neg;          /* K_INT: negative (its value in i), else its value in u */
    uint64_t u;
    int64_t i;
    int b;            /* K_BOOL */
    double f;         /* K_FLOAT */
    const uint8_t *s; /* K_STR, K_BIN: the bytes; K_MAP, K_ARRAY: the first element's */
    size_t n;         /* K_STR, K_BIN: their length; K_MAP, K_ARRAY: the count */
} Val;

#define MAX_DEPTH 64       /* deeper values go to Python (msgpack-python's own stack is 128) */
#define MAX_PROPERTIES 256 /* more properties than this go to Python (a name twice is looked for pairwise) */

static uint64_t big_endian(const uint8_t *p, size_t w) {
    uint64_t v = 0;
    for (size_t k = 0; k < w; k++) v = v << 8 | p[k];
    return v;
}

/* One msgpack value at *pp: its kind and scalar, a container's contents skipped. -1: not one the C path takes
 * (truncated, too deep, an ext type, a map key that is an array or a map: unhashable in Python). */
static int read_value(const uint8_t **pp, const uint8_t *end, Val *v, int depth) {
    const uint8_t *p = *pp;
    if (p >= end || depth > MAX_DEPTH) return -1;
    uint8_t c = *p++;
    size_t w = 0, avail;
    v->kind = K_NIL, v->neg = 0, v->u = 0, v->i = 0;
    if (c <= 0x7f) {
        v->kind = K_INT, v->neg = 0, v->u = c;
    } else if (c >= 0xe0) {
        v->kind = K_INT, v->neg = 1, v->i = (int8_t)c;
    } else if (c >= 0xa0 && c <= 0xbf) {
        v->kind = K_STR, v->n = c & 0x1f;
    } else if (c >= 0x90 && c <= 0x9f) {
        v->kind = K_ARRAY, v->n = c & 0x0f;
    } else if (c >= 0x80 && c <= 0x8f) {
        v->kind = K_MAP, v->n = c & 0x0f;
    } else {
        switch (c) {
        case 0xc0: v->kind = K_NIL; break;
        case 0xc2: case 0xc3: v->kind = K_BOOL, v->b = c == 0xc3; break;
        case 0xc4: case 0xc5: case 0xc6: w = (size_t)1 << (c - 0xc4); v->kind = K_BIN; break;
        case 0xd9: case 0xda: case 0xdb: w = (size_t)1 << (c - 0xd9); v->kind = K_STR; break;
        case 0xdc: case 0xdd: w = (size_t)2 << (c - 0xdc); v->kind = K_ARRAY; break;
        case 0xde: case 0xdf: w = (size_t)2 << (c - 0xde); v->kind = K_MAP; break;
        case 0xca: case 0xcb: {
            size_t size = c == 0xca ? 4 : 8;
            if ((size_t)(end - p) < size) return -1;
            v->kind = K_FLOAT;
            v->f = size == 4 ? PyFloat_Unpack4((const char *)p, 0) : PyFloat_Unpack8((const char *)p, 0);
            if (v->f == -1.0 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
            p += size;
            break;
        }
        case 0xcc: case 0xcd: case 0xce: case 0xcf: {
            size_t size = (size_t)1 << (c - 0xcc);
            if ((size_t)(end - p) < size) return -1;
            v->kind = K_INT, v->neg = 0, v->u = big_endian(p, size);
            p += size;
            break;
        }
        case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
            size_t size = (size_t)1 << (c - 0xd0);
            if ((size_t)(end - p) < size) return -1;
            uint64_t raw = big_endian(p, size);
            int64_t x = size == 1 ? (int8_t)raw : size == 2 ? (int16_t)raw : size == 4 ? (int32_t)raw : (int64_t)raw;
            if (x >= 0) v->kind = K_INT, v->neg = 0, v->u = (uint64_t)x;
            else v->kind = K_INT, v->neg = 1, v->i = x;
            p += size;
            break;
        }
        default: return -1; /* 0xc1 (never used), and the ext types */
        }
    }
    if (w) {
        if ((size_t)(end - p) < w) return -1;
        v->n = (size_t)big_endian(p, w);
        p += w;
    }
    avail = (size_t)(end - p);
    if (v->kind == K_STR || v->kind == K_BIN) {
        if (v->n > avail) return -1;
        v->s = p;
        p += v->n;
    } else if (v->kind == K_ARRAY || v->kind == K_MAP) {
        if (v->n > avail) return -1; /* every element takes a byte at least */
        v->s = p;
        Val x;
        for (size_t k = 0; k < v->n; k++) {
            if (v->kind == K_MAP) {
                if (read_value(&p, end, &x, depth + 1) < 0 || x.kind == K_ARRAY || x.kind == K_MAP) return -1;
            }
            if (read_value(&p, end, &x, depth + 1) < 0) return -1;
        }
    }
    *pp = p;
    return 0;
}

/* Strict UTF-8 as Python's codec takes it (no surrogates, no overlong forms, nothing above U+10FFFF). */
static int utf8_ok(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
        } else if (c >= 0xc2 && c <= 0xdf) {
            if (n - i < 2 || (s[i + 1] & 0xc0) != 0x80) return 0;
            i += 2;
        } else if (c >= 0xe0 && c <= 0xef) {
            if (n - i < 3 || (s[i + 1] & 0xc0) != 0x80 || (s[i + 2] & 0xc0) != 0x80) return 0;
            if ((c == 0xe0 && s[i + 1] < 0xa0) || (c == 0xed && s[i + 1] >= 0xa0)) return 0;
            i += 3;
        } else if (c >= 0xf0 && c <= 0xf4) {
            if (n - i < 4 || (s[i + 1] & 0xc0) != 0x80 || (s[i + 2] & 0xc0) != 0x80 || (s[i + 3] & 0xc0) != 0x80)
                return 0;
            if ((c == 0xf0 && s[i + 1] < 0x90) || (c == 0xf4 && s[i + 1] >= 0x90)) return 0;
            i += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

typedef struct {
    uint8_t *p;
    size_t n, cap;
} Buf;

static int grow(Buf *b, size_t more) {
    if (b->n + more <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + more) cap *= 2;
    uint8_t *p = PyMem_Realloc(b->p, cap);
    if (p == NULL) { PyErr_NoMemory(); return -1; }
    b->p = p, b->cap = cap;
    return 0;
}

static int put(Buf *b, const void *s, size_t n) {
    if (grow(b, n) < 0) return -1;
    memcpy(b->p + b->n, s, n);
    b->n += n;
    return 0;
}

static int put_be(Buf *b, uint8_t head, uint64_t v, size_t w) {
    uint8_t t[9];
    t[0] = head;
    for (size_t k = 0; k < w; k++) t[1 + k] = (uint8_t)(v >> (8 * (w - 1 - k)));
    return put(b, t, 1 + w);
}

/* A str as msgpack.Packer(use_bin_type=False) packs it: an old-spec raw (no str 8). */
static int put_str(Buf *b, const uint8_t *s, size_t n) {
    int r = n < 32 ? put_be(b, (uint8_t)(0xa0 | n), 0, 0) : n < 65536 ? put_be(b, 0xda, n, 2) : put_be(b, 0xdb, n, 4);
    return r < 0 ? -1 : put(b, s, n);
}

/* An int as msgpack.Packer packs it: the smallest form, unsigned for a positive value. */
static int put_int(Buf *b, int neg, uint64_t u, int64_t i) {
    if (neg) {
        if (i >= -32) return put_be(b, (uint8_t)(int8_t)i, 0, 0);
        if (i >= -128) return put_be(b, 0xd0, (uint64_t)i & 0xff, 1);
        if (i >= -32768) return put_be(b, 0xd1, (uint64_t)i & 0xffff, 2);
        if (i >= -2147483648LL) return put_be(b, 0xd2, (uint64_t)i & 0xffffffffu, 4);
        return put_be(b, 0xd3, (uint64_t)i, 8);
    }
    if (u < 128) return put_be(b, (uint8_t)u, 0, 0);
    if (u < 256) return put_be(b, 0xcc, u, 1);
    if (u < 65536) return put_be(b, 0xcd, u, 2);
    if (u < 4294967296ULL) return put_be(b, 0xce, u, 4);
    return put_be(b, 0xcf, u, 8);
}

static int put_map_header(Buf *b, size_t n) {
    return n < 16 ? put_be(b, (uint8_t)(0x80 | n), 0, 0) : n < 65536 ? put_be(b, 0xde, n, 2) : put_be(b, 0xdf, n, 4);
}

static int put_key(Buf *b, const char *name) { return put_str(b, (const uint8_t *)name, strlen(name)); }

/* int(value) where prepare converts a field (an int or a bool; a missing field is 0). 0, or -1: not taken. */
static int as_int(const Val *v, int *neg, uint64_t *u, int64_t *i) {
    *neg = 0, *u = 0, *i = 0;
    if (v->kind == K_MISSING) return 0;
    if (v->kind == K_BOOL) { *u = (uint64_t)v->b; return 0; }
    if (v->kind != K_INT) return -1;
    *neg = v->neg, *u = v->u, *i = v->i;
    return 0;
}

static int put_int_field(Buf *b, const char *name, const Val *v) {
    int neg;
    uint64_t u;
    int64_t i;
    if (as_int(v, &neg, &u, &i) < 0) return 1;
    return put_key(b, name) < 0 || put_int(b, neg, u, i) < 0 ? -1 : 0;
}

/* A field prepare packs as it is, "" where missing: a str (strict UTF-8) or nil taken. */
static int put_text_field(Buf *b, const char *name, const Val *v) {
    if (v->kind != K_MISSING && v->kind != K_NIL && !(v->kind == K_STR && utf8_ok(v->s, v->n))) return 1;
    if (put_key(b, name) < 0) return -1;
    if (v->kind == K_NIL) return put_be(b, 0xc0, 0, 0);
    return v->kind == K_STR ? put_str(b, v->s, v->n) : put_str(b, (const uint8_t *)"", 0);
}

static int truthy(const Val *v) { /* a str or nil field as Python's `if x:` takes it */
    return v->kind == K_STR && v->n > 0;
}

static int same_text(const Val *a, const Val *b) { return a->n == b->n && memcmp(a->s, b->s, a->n) == 0; }

/* The properties: str names with str, int, float or bool values, in order. 0, 1: not taken, -1: error. */
static int put_properties(Buf *b, const Val *pr, const uint8_t *end, int from_backup) {
    if (pr->kind != K_MAP) {
        if (pr->kind == K_MISSING || pr->kind == K_NIL || from_backup) return put_map_header(b, 0) < 0 ? -1 : 0;
        return 1; /* a log's copy with another table: prepare says what it makes of it */
    }
    if (pr->n > MAX_PROPERTIES) return 1;
    const uint8_t *p = pr->s;
    Val keys_[MAX_PROPERTIES], vals[MAX_PROPERTIES];
    size_t kept = 0;
    for (size_t k = 0; k < pr->n; k++)
        if (read_value(&p, end, &keys_[k], 1) < 0 || read_value(&p, end, &vals[k], 1) < 0) return 1;
    for (size_t k = 0; k < pr->n; k++) { /* a name twice: the dict keeps its first place and its last value */
        if (keys_[k].kind != K_STR) continue;
        for (size_t j = 0; j < k; j++) {
            if (keys_[j].kind == K_STR && same_text(&keys_[j], &keys_[k])) {
                vals[j] = vals[k];
                keys_[k].kind = K_MISSING;
                break;
            }
        }
    }
    for (size_t k = 0; k < pr->n; k++) {
        int kind = vals[k].kind;
        if (keys_[k].kind == K_STR && (kind == K_STR || kind == K_INT || kind == K_FLOAT || kind == K_BOOL)) {
            if (!utf8_ok(keys_[k].s, keys_[k].n) || (kind == K_STR && !utf8_ok(vals[k].s, vals[k].n))) return 1;
            kept++;
        }
    }
    if (put_map_header(b, kept) < 0) return -1;
    for (size_t k = 0; k < pr->n; k++) {
        const Val *v = &vals[k];
        if (keys_[k].kind != K_STR || !(v->kind == K_STR || v->kind == K_INT || v->kind == K_FLOAT || v->kind == K_BOOL))
            continue;
        if (put_str(b, keys_[k].s, keys_[k].n) < 0) return -1;
        int r;
        if (v->kind == K_STR) {
            r = put_str(b, v->s, v->n);
        } else if (v->kind == K_INT) {
            r = put_int(b, v->neg, v->u, v->i);
        } else if (v->kind == K_BOOL) {
            r = put_be(b, v->b ? 0xc3 : 0xc2, 0, 0);
        } else {
            uint8_t t[9];
            t[0] = 0xcb;
            if (PyFloat_Pack8(v->f, (char *)t + 1, 0) < 0) return -1;
            r = put(b, t, 9);
        }
        if (r < 0) return -1;
    }
    return 0;
}

/* The descriptor's fields prepare reads, by name (the last of a name wins, as in the dict msgpack makes). */
enum { F_ID, F_Q, F_P, F_PER, F_MID, F_CID, F_EXP, F_PT, F_BC, F_PR, F_ST, F_L, F_U, F_O1, F_O2, F_COUNT };
static const char *const FIELD_NAMES[F_COUNT] = {"id", "q", "p", "per", "mid", "cid", "exp", "pt", "bc", "pr",
                                                 "st", "l", "u", "o1", "o2"};
/* The fields a mask's bits set, bit j field OVERRIDDEN[j] (cfemu.bulk.OVERRIDES). */
static const int OVERRIDDEN[6] = {F_ST, F_U, F_L, F_O1, F_O2, F_BC};

static int field_of(const Val *key) {
    if (key->kind != K_STR || key->n > 3) return -1;
    for (int f = 0; f < F_COUNT; f++)
        if (strlen(FIELD_NAMES[f]) == key->n && memcmp(FIELD_NAMES[f], key->s, key->n) == 0) return f;
    return -1;
}

/* A column's value as a field: a str (as its UTF-8), an int, or None. 0, 1: not taken. */
static int column_value(PyObject *o, Val *v) {
    if (o == Py_None) { v->kind = K_NIL; return 0; }
    if (PyUnicode_CheckExact(o)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(o, &n);
        if (s == NULL) { PyErr_Clear(); return 1; }
        v->kind = K_STR, v->s = (const uint8_t *)s, v->n = (size_t)n;
        return 0;
    }
    if (PyLong_CheckExact(o)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || (x == -1 && PyErr_Occurred())) { PyErr_Clear(); return 1; }
        v->kind = K_INT, v->neg = x < 0, v->i = x, v->u = x < 0 ? 0 : (uint64_t)x;
        return 0;
    }
    return 1;
}

typedef struct {
    PyObject *lists, *sets, *expiry, *held, *queues, *places, *prefixes, *list_name, *index_prefixes;
    const uint8_t *uow_prefix;
    size_t uow_prefix_n;
    /* the place and the queue of the entry before (load order keeps them together): their text copied here, never
     * pointing into an entry's bytes, which a callback into Python may free once that entry is staged */
    PyObject *members;
    Val last_q, last_st;
    Buf last_q_text, last_st_text, last_pq_text;
    int last_neg;
    uint64_t last_u;
    int64_t last_i;
    PyObject *last_prefixes; /* (correlation prefix, message prefix) of last_pq, bytes */
    Val last_pq;
    Buf name;
} Group;

/* `v`'s text copied into `b`, `kept` made to read it there. */
static int keep_text(Buf *b, Val *kept, const Val *v) {
    b->n = 0;
    if (grow(b, v->n + 1) < 0) return -1; /* a byte more: an empty text has a buffer too */
    memcpy(b->p, v->s, v->n);
    kept->s = b->p, kept->n = v->n;
    return 0;
}

static PyObject *text_of(const Val *v) { return PyUnicode_DecodeUTF8((const char *)v->s, (Py_ssize_t)v->n, "strict"); }

/* The ids list of the entry's place (queue, state, priority): list_name's list, looked up once a place. */
static PyObject *place_members(Group *g, const Val *q, const Val *st, int neg, uint64_t u, int64_t i) {
    if (g->members != NULL && same_text(q, &g->last_q) && same_text(st, &g->last_st) && neg == g->last_neg &&
        u == g->last_u && i == g->last_i)
        return g->members;
    PyObject *p = neg ? PyLong_FromLongLong(i) : PyLong_FromUnsignedLongLong(u);
    PyObject *key = p == NULL ? NULL : Py_BuildValue("(y#y#O)", q->s, (Py_ssize_t)q->n, st->s, (Py_ssize_t)st->n, p);
    PyObject *members = key == NULL ? NULL : PyDict_GetItemWithError(g->places, key);
    if (members == NULL && key != NULL && !PyErr_Occurred()) {
        PyObject *qs = text_of(q), *sts = text_of(st), *name = NULL;
        if (qs != NULL && sts != NULL) name = PyObject_CallFunctionObjArgs(g->list_name, qs, sts, p, NULL);
        if (name != NULL && !PyUnicode_Check(name)) {
            PyErr_SetString(PyExc_TypeError, "a list's name is a str");
            Py_CLEAR(name);
        }
        if (name != NULL) {
            PyObject *fresh = PyList_New(0);
            members = fresh == NULL ? NULL : PyDict_SetDefault(g->lists, name, fresh);
            Py_XDECREF(fresh);
            if (members != NULL && (PyDict_SetItem(g->places, key, members) < 0 || PySet_Add(g->queues, qs) < 0))
                members = NULL;
        }
        Py_XDECREF(qs);
        Py_XDECREF(sts);
        Py_XDECREF(name);
    }
    Py_XDECREF(p);
    Py_XDECREF(key);
    if (members == NULL) return NULL;
    if (keep_text(&g->last_q_text, &g->last_q, q) < 0 || keep_text(&g->last_st_text, &g->last_st, st) < 0) {
        g->members = NULL;
        return NULL;
    }
    g->members = members, g->last_neg = neg, g->last_u = u, g->last_i = i;
    return members;
}

/* Append id to the set `prefix` + value (bytes names, first-seen order). */
static int add_to_set(Group *g, const uint8_t *prefix, size_t pn, const Val *value, PyObject *id) {
    g->name.n = 0;
    if (put(&g->name, prefix, pn) < 0 || put(&g->name, value->s, value->n) < 0) return -1;
    PyObject *name = PyBytes_FromStringAndSize((const char *)g->name.p, (Py_ssize_t)g->name.n);
    if (name == NULL) return -1;
    PyObject *members = PyDict_GetItemWithError(g->sets, name);
    int r = -1;
    if (members == NULL && !PyErr_Occurred()) {
        PyObject *fresh = PyList_New(0);
        if (fresh != NULL && PyDict_SetItem(g->sets, name, fresh) == 0) members = fresh;
        Py_XDECREF(fresh); /* the dict holds it */
    }
    if (members != NULL) r = PyList_Append(members, id);
    Py_DECREF(name);
    return r;
}

static PyObject *queue_prefixes(Group *g, const Val *q) {
    if (g->last_prefixes != NULL && same_text(q, &g->last_pq)) return g->last_prefixes;
    PyObject *key = PyBytes_FromStringAndSize((const char *)q->s, (Py_ssize_t)q->n);
    if (key == NULL) return NULL;
    PyObject *found = PyDict_GetItemWithError(g->prefixes, key);
    if (found == NULL && !PyErr_Occurred()) {
        PyObject *qs = text_of(q), *said = qs == NULL ? NULL : PyObject_CallOneArg(g->index_prefixes, qs);
        Py_XDECREF(qs);
        PyObject *c = NULL, *m = NULL;
        if (said != NULL && PyTuple_Check(said) && PyTuple_GET_SIZE(said) == 2 &&
            PyUnicode_Check(PyTuple_GET_ITEM(said, 0)) && PyUnicode_Check(PyTuple_GET_ITEM(said, 1))) {
            c = PyUnicode_AsUTF8String(PyTuple_GET_ITEM(said, 0));
            m = c == NULL ? NULL : PyUnicode_AsUTF8String(PyTuple_GET_ITEM(said, 1));
        } else if (said != NULL) {
            PyErr_SetString(PyExc_TypeError, "a queue's index prefixes are two str");
        }
        PyObject *pair = m == NULL ? NULL : PyTuple_Pack(2, c, m);
        Py_XDECREF(said);
        Py_XDECREF(c);
        Py_XDECREF(m);
        if (pair != NULL && PyDict_SetItem(g->prefixes, key, pair) == 0) found = pair;
        Py_XDECREF(pair); /* the dict holds it */
    }
    Py_DECREF(key);
    if (found != NULL && keep_text(&g->last_pq_text, &g->last_pq, q) < 0) found = NULL;
    g->last_prefixes = found;
    return found;
}

/* One entry: its descriptor appended to `out`, its places in the groups. 0, 1: not taken, -1: error. */
static int stage_one(Group *g, Buf *out, PyObject *id, PyObject *desc, PyObject *data, PyObject *mask_o,
                     int from_backup, PyObject *const *fields, const char *aside, size_t aside_n) {
    if (!PyUnicode_CheckExact(id) || !PyBytes_CheckExact(desc) || !PyBytes_CheckExact(data) ||
        !PyLong_CheckExact(mask_o))
        return 1;
    Py_ssize_t idn;
    if (PyUnicode_AsUTF8AndSize(id, &idn) == NULL) { PyErr_Clear(); return 1; }
    long mask = PyLong_AsLong(mask_o);
    if (mask == -1 && PyErr_Occurred()) { PyErr_Clear(); return 1; }
    const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(desc), *end = p + PyBytes_GET_SIZE(desc);
    Val top, key, value, f[F_COUNT];
    memset(f, 0, sizeof f);
    if (read_value(&p, end, &top, 0) < 0 || top.kind != K_MAP || p != end) return 1;
    p = top.s;
    for (size_t n = 0; n < top.n; n++) {
        read_value(&p, end, &key, 1); /* read whole above: these hold */
        read_value(&p, end, &value, 1);
        int which = field_of(&key);
        if (which >= 0) f[which] = value;
    }
    for (int j = 0; j < 6; j++) {
        if (!(mask & (1L << j))) continue;
        if (fields[j] == NULL) { /* held for every bit set whose column was given */
            PyErr_Format(PyExc_ValueError, "a mask sets field %s and its column was not given", FIELD_NAMES[OVERRIDDEN[j]]);
            return -1;
        }
        if (column_value(fields[j], &f[OVERRIDDEN[j]])) return 1;
    }
    const Val *q = &f[F_Q], *st = &f[F_ST], *u = &f[F_U], *cid = &f[F_CID], *mid = &f[F_MID];
    if (f[F_ID].kind != K_STR || q->kind != K_STR || st->kind != K_STR || !utf8_ok(st->s, st->n)) return 1;
    if (!utf8_ok(q->s, q->n) || (aside_n && q->n >= aside_n && memcmp(q->s + q->n - aside_n, aside, aside_n) == 0))
        return 1;
    int per;
    const Val *pv = &f[F_PER];
    switch (pv->kind) {
    case K_MISSING: per = 1; break;
    case K_NIL: per = 0; break;
    case K_BOOL: per = pv->b; break;
    case K_INT: per = pv->neg || pv->u; break;
    case K_FLOAT: per = pv->f != 0.0; break;
    default: per = pv->n > 0; /* a str, bin, array or map: its length */
    }
    int pneg, eneg, lneg = 0;
    uint64_t pu, eu, lu = 0;
    int64_t pi, ei, li = 0;
    if (as_int(&f[F_P], &pneg, &pu, &pi) < 0 || as_int(&f[F_EXP], &eneg, &eu, &ei) < 0) return 1;
    if (truthy(u) && (f[F_L].kind == K_MISSING || as_int(&f[F_L], &lneg, &lu, &li) < 0)) return 1;
    /* the descriptor, in descriptor()'s order */
    int r;
    if (put_map_header(out, 16) < 0) return -1;
    if ((r = put_text_field(out, "id", &f[F_ID])) || (r = put_text_field(out, "q", q)) || (r = put_int_field(out, "p", &f[F_P]))) return r;
    if (put_key(out, "per") < 0 || put_be(out, (uint8_t)per, 0, 0) < 0) return -1;
    if ((r = put_text_field(out, "mid", mid)) || (r = put_text_field(out, "cid", cid)) ||
        (r = put_int_field(out, "exp", &f[F_EXP])) || (r = put_int_field(out, "pt", &f[F_PT])) ||
        (r = put_int_field(out, "bc", &f[F_BC])))
        return r;
    if (put_key(out, "pr") < 0) return -1;
    if ((r = put_properties(out, &f[F_PR], end, from_backup))) return r;
    if ((r = put_text_field(out, "st", st)) || (r = put_int_field(out, "l", &f[F_L])) ||
        (r = put_text_field(out, "u", u)) || (r = put_int_field(out, "o1", &f[F_O1])) ||
        (r = put_int_field(out, "o2", &f[F_O2])))
        return r;
    if (put_key(out, "len") < 0 || put_int(out, 0, (uint64_t)PyBytes_GET_SIZE(data), 0) < 0) return -1;
    /* the grouping, in prepare's order: the place, the UOW (its set, its lowest LRSN), the expiry, the indexes */
    PyObject *members = place_members(g, q, st, pneg, pu, pi);
    if (members == NULL || PyList_Append(members, id) < 0) return -1;
    if (truthy(u)) {
        PyObject *us = text_of(u);
        PyObject *first = us == NULL ? NULL : lneg ? PyLong_FromLongLong(li) : PyLong_FromUnsignedLongLong(lu);
        PyObject *had = first == NULL ? NULL : PyDict_GetItemWithError(g->held, us);
        int lower = had == NULL ? (PyErr_Occurred() ? -1 : 1) : PyObject_RichCompareBool(first, had, Py_LT);
        r = first == NULL || lower < 0 || (lower && PyDict_SetItem(g->held, us, first) < 0) ? -1 : 0;
        Py_XDECREF(us);
        Py_XDECREF(first);
        if (r < 0 || add_to_set(g, g->uow_prefix, g->uow_prefix_n, u, id) < 0) return -1;
    }
    if (f[F_EXP].kind != K_MISSING && !eneg && eu > 0) {
        PyObject *score = PyLong_FromUnsignedLongLong(eu);
        r = score == NULL || PyList_Append(g->expiry, score) < 0 || PyList_Append(g->expiry, id) < 0 ? -1 : 0;
        Py_XDECREF(score);
        if (r < 0) return -1;
    }
    if (truthy(cid) || truthy(mid)) {
        PyObject *pair = queue_prefixes(g, q);
        if (pair == NULL) return -1;
        PyObject *c = PyTuple_GET_ITEM(pair, 0), *m = PyTuple_GET_ITEM(pair, 1);
        if (truthy(cid) && add_to_set(g, (const uint8_t *)PyBytes_AS_STRING(c), (size_t)PyBytes_GET_SIZE(c), cid, id) < 0)
            return -1;
        if (truthy(mid) && add_to_set(g, (const uint8_t *)PyBytes_AS_STRING(m), (size_t)PyBytes_GET_SIZE(m), mid, id) < 0)
            return -1;
    }
    return 0;
}

static int column_list(PyObject *o, Py_ssize_t end, const char *what) {
    if (!PyList_Check(o) || PyList_GET_SIZE(o) < end) {
        PyErr_Format(PyExc_ValueError, "%s is a list of one item an entry at least", what);
        return -1;
    }
    return 0;
}

/* Entry k's items, held: its id, descriptor, data, mask and backup flag, and the fields its mask sets (NULL: not
 * set, or its column not given). -1: a column is too short now (a callback into Python changed it while the
 * entries before were staged). */
static int hold_entry(PyObject *const *cols, Py_ssize_t k, PyObject **item) {
    long mask = 0;
    for (int j = 0; j < 11; j++) {
        item[j] = NULL;
        if (cols[j] == NULL || (j >= 5 && !(mask & (1L << (j - 5))))) continue;
        if (k >= PyList_GET_SIZE(cols[j])) {
            for (int i = 0; i < j; i++) Py_XDECREF(item[i]);
            PyErr_SetString(PyExc_RuntimeError, "the columns changed while their entries were staged");
            return -1;
        }
        item[j] = Py_NewRef(PyList_GET_ITEM(cols[j], k));
        if (j == 3 && PyLong_CheckExact(item[3])) {
            mask = PyLong_AsLong(item[3]);
            if (mask == -1 && PyErr_Occurred()) PyErr_Clear(); /* stage_one steps aside for it */
        }
    }
    return 0;
}

static PyObject *stage(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ids, *descs, *datas, *masks, *backup, *overrides, *list_name, *index_prefixes;
    Py_ssize_t start, end, uow_prefix_n, aside_n;
    const char *uow_prefix, *aside;
    if (!PyArg_ParseTuple(args, "OOOOOO!nnOOs#s#", &ids, &descs, &datas, &masks, &backup, &PyTuple_Type, &overrides,
                          &start, &end, &list_name, &index_prefixes, &uow_prefix, &uow_prefix_n, &aside, &aside_n))
        return NULL;
    if (start < 0 || start > end) {
        PyErr_SetString(PyExc_ValueError, "start and end are 0 <= start <= end");
        return NULL;
    }
    if (column_list(ids, end, "ids") < 0 || column_list(descs, end, "descs") < 0 ||
        column_list(datas, end, "datas") < 0 || column_list(masks, end, "masks") < 0 ||
        column_list(backup, end, "backup") < 0)
        return NULL;
    if (PyTuple_GET_SIZE(overrides) != 6) {
        PyErr_SetString(PyExc_ValueError, "overrides are six columns (or None): st, u, l, o1, o2, bc");
        return NULL;
    }
    PyObject *const *columns = &PyTuple_GET_ITEM(overrides, 0);
    for (int j = 0; j < 6; j++)
        if (columns[j] != Py_None && column_list(columns[j], end, "an override column") < 0) return NULL;
    PyObject *cols[11] = {ids, descs, datas, masks, backup};
    for (int j = 0; j < 6; j++) cols[5 + j] = columns[j] == Py_None ? NULL : columns[j];
    Group g;
    memset(&g, 0, sizeof g);
    g.list_name = list_name, g.index_prefixes = index_prefixes;
    g.uow_prefix = (const uint8_t *)uow_prefix, g.uow_prefix_n = (size_t)uow_prefix_n;
    g.lists = PyDict_New(), g.sets = PyDict_New(), g.expiry = PyList_New(0), g.held = PyDict_New();
    g.queues = PySet_New(NULL), g.places = PyDict_New(), g.prefixes = PyDict_New();
    PyObject *descriptors = PyList_New(end - start), *result = NULL;
    Buf out = {NULL, 0, 0};
    long long nbytes = 0;
    int r = !g.lists || !g.sets || !g.expiry || !g.held || !g.queues || !g.places || !g.prefixes || !descriptors ? -1 : 0;
    for (Py_ssize_t k = start; r == 0 && k < end; k++) {
        /* The entry's items, held while it is staged: list_name, index_prefixes and a backup flag's truth run
         * Python code, which may change the caller's lists (the fields read point into these items' bytes). */
        PyObject *item[11];
        if (hold_entry(cols, k, item) < 0) {
            r = -1;
            break;
        }
        int from_backup = PyObject_IsTrue(item[4]); /* as prepare's caller takes it: may raise */
        out.n = 0;
        r = from_backup < 0 ? -1 : stage_one(&g, &out, item[0], item[1], item[2], item[3], from_backup, item + 5,
                                             aside, (size_t)aside_n);
        if (r == 0) {
            PyObject *d = PyBytes_FromStringAndSize((const char *)out.p, (Py_ssize_t)out.n);
            if (d == NULL) r = -1;
            else PyList_SET_ITEM(descriptors, k - start, d);
            nbytes += PyBytes_GET_SIZE(item[2]);
        }
        for (int j = 0; j < 11; j++) Py_XDECREF(item[j]);
    }
    if (r == 0) {
        result = Py_BuildValue("(OOOOOOL)", descriptors, g.lists, g.sets, g.expiry, g.held, g.queues, nbytes);
    } else if (r > 0) {
        result = Py_NewRef(Py_None);
    }
    PyMem_Free(out.p);
    PyMem_Free(g.name.p);
    Py_XDECREF(descriptors);
    Py_XDECREF(g.lists), Py_XDECREF(g.sets), Py_XDECREF(g.expiry), Py_XDECREF(g.held);
    Py_XDECREF(g.queues), Py_XDECREF(g.places), Py_XDECREF(g.prefixes);
    PyMem_Free(g.last_q_text.p), PyMem_Free(g.last_st_text.p), PyMem_Free(g.last_pq_text.p);
    return result;
}

static PyObject *cut(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *datas;
    Py_ssize_t start, size;
    long long max_bytes;
    if (!PyArg_ParseTuple(args, "O!nnL", &PyList_Type, &datas, &start, &size, &max_bytes)) return NULL;
    if (start < 0 || size < 1) {
        PyErr_SetString(PyExc_ValueError, "a batch starts at 0 or later and holds one entry at least");
        return NULL;
    }
    long long held = 0;
    for (Py_ssize_t k = start, count = 1; k < PyList_GET_SIZE(datas); k++, count++) {
        PyObject *d = PyList_GET_ITEM(datas, k);
        Py_ssize_t n = PyObject_Length(d);
        if (n < 0) return NULL;
        held += n;
        if (count >= size || (max_bytes && held >= max_bytes)) return PyLong_FromSsize_t(k + 1);
    }
    return PyLong_FromLong(-1);
}


/* ---- A batch's commands packed in C: pair_parts() and pack_groups() ---------------------------------------------
 *
 * pair_parts(fields, values) -> [part, ...] | None: the parts cfemu.resp.Packed.add_pairs appends after HSET's
 * header, each field with the header of its value, then the value itself (the very object: never copied), and
 * the last value's end. None where a field is not str or bytes, or a value not bytes: add_pairs does it in Python.
 *
 * pack_groups(command, groups) -> bytes | None: the commands (command, key, *members) for each key -> members of
 * the dict `groups`, in its order, as hiredis.pack_command packs each (str as UTF-8). None where a key or member
 * is neither str nor bytes (or a str is not UTF-8): the caller packs them with pack_command. A load's batch has a
 * set of one member for most entries (its message id's index): packed here, with no Python a set. */

/* The bytes of a str (UTF-8) or bytes argument; NULL without an error set where it is neither (or not UTF-8). */
static const char *argument_bytes(PyObject *o, Py_ssize_t *n) {
    if (PyBytes_CheckExact(o)) {
        *n = PyBytes_GET_SIZE(o);
        return PyBytes_AS_STRING(o);
    }
    if (PyUnicode_CheckExact(o)) {
        const char *s = PyUnicode_AsUTF8AndSize(o, n);
        if (s == NULL) PyErr_Clear();
        return s;
    }
    return NULL;
}

static PyObject *pair_parts(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *fields, *values;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &fields, &PyList_Type, &values)) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(fields);
    if (count != PyList_GET_SIZE(values)) Py_RETURN_NONE;
    PyObject *out = PyList_New(2 * count + 1);
    if (out == NULL) return NULL;
    char head[96];
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *v = PyList_GET_ITEM(values, k);
        Py_ssize_t fn;
        const char *f = argument_bytes(PyList_GET_ITEM(fields, k), &fn);
        if (f == NULL || !PyBytes_CheckExact(v)) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        int hn = snprintf(head, sizeof head, "%s$%zd\r\n", k ? "\r\n" : "", fn);
        Py_ssize_t vn = PyBytes_GET_SIZE(v);
        char tail[32];
        int tn = snprintf(tail, sizeof tail, "\r\n$%zd\r\n", vn);
        PyObject *h = PyBytes_FromStringAndSize(NULL, hn + fn + tn);
        if (h == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        char *p = PyBytes_AS_STRING(h);
        memcpy(p, head, (size_t)hn);
        memcpy(p + hn, f, (size_t)fn);
        memcpy(p + hn + fn, tail, (size_t)tn);
        PyList_SET_ITEM(out, 2 * k, h);
        PyList_SET_ITEM(out, 2 * k + 1, Py_NewRef(v));
    }
    PyObject *end = PyBytes_FromString(count ? "\r\n" : "");
    if (end == NULL) {
        Py_DECREF(out);
        return NULL;
    }
    PyList_SET_ITEM(out, 2 * count, end);
    return out;
}

static int put_bulk(Buf *b, const char *s, Py_ssize_t n) {
    char head[32];
    int hn = snprintf(head, sizeof head, "$%zd\r\n", n);
    return put(b, head, (size_t)hn) < 0 || put(b, s, (size_t)n) < 0 || put(b, "\r\n", 2) < 0 ? -1 : 0;
}

static PyObject *pack_groups(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *command, *groups, *key, *members, *result = NULL;
    if (!PyArg_ParseTuple(args, "O!O!", &PyBytes_Type, &command, &PyDict_Type, &groups)) return NULL;
    Buf b = {NULL, 0, 0};
    Py_ssize_t pos = 0;
    int taken = 1;
    while (taken && PyDict_Next(groups, &pos, &key, &members)) {
        Py_ssize_t kn;
        const char *k = argument_bytes(key, &kn);
        if (k == NULL || !PyList_CheckExact(members)) {
            taken = 0;
            break;
        }
        char head[32];
        int hn = snprintf(head, sizeof head, "*%zd\r\n", PyList_GET_SIZE(members) + 2);
        if (put(&b, head, (size_t)hn) < 0 || put_bulk(&b, PyBytes_AS_STRING(command), PyBytes_GET_SIZE(command)) < 0 ||
            put_bulk(&b, k, kn) < 0)
            goto done;
        for (Py_ssize_t m = 0; m < PyList_GET_SIZE(members); m++) {
            Py_ssize_t mn;
            const char *s = argument_bytes(PyList_GET_ITEM(members, m), &mn);
            if (s == NULL) {
                taken = 0;
                break;
            }
            if (put_bulk(&b, s, mn) < 0) goto done;
        }
    }
    result = taken ? PyBytes_FromStringAndSize(b.p ? (const char *)b.p : "", (Py_ssize_t)b.n) : Py_NewRef(Py_None);
done:
    PyMem_Free(b.p);
    return result;
}


/* read_bulks(fd, count, size_hint) -> (blob, spans) | str: one reply of the CF read from the blocking socket `fd`
 * and parsed with the GIL let go: an array of `count` bulk strings or nulls, as HMGET answers (RESP2's $-1 and
 * RESP3's _ both read as null). blob: the reply's bytes as received; spans: `count` pairs of signed 64-bit
 * integers in the machine's order, (offset in blob, length) of each string, length -1 for a null. No Python object
 * is made per string: a backup's fetch reads a million of them (cfemu.bulk.Bulks reads them back; backup/_frames.c
 * frames them from the blob). An error reply answers its text as a str (the connection is still in step).
 * size_hint: the bytes expected (the data lengths the descriptors record), the blob's first size. timeout_ms:
 * below 0 for a blocking socket (the kernel's receive timeout ends a recv with EAGAIN), else how long to wait for
 * each receive of a non-blocking one (Python's socket timeout, of any length, kept across signals as Python's recv
 * keeps it). Raises OSError from the socket (EAGAIN,
 * TimeoutError: the timeout), EOFError when the CF closes the connection within the reply, ValueError for a
 * reply that is not such an array (the connection is then out of step: the caller drops it). */
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>

#define MAX_BULK (512LL << 20) /* the longest bulk string the CF sends (proto-max-bulk-len's default) */
#define MAX_LINE 32            /* a string's header line's longest: a type byte, a 64-bit length and CRLF */
#define MAX_ERROR_LINE 65536   /* an error reply's longest line */

enum { NEED_MORE = 0, PARSED = 1, BAD = -1, ERROR_REPLY = 2 };

typedef struct {
    const char *buf;
    Py_ssize_t pos, end;   /* parsed up to pos; received up to end */
    Py_ssize_t count, got; /* strings expected, parsed */
    int64_t *spans;
    Py_ssize_t err_start, err_len; /* an error reply's text */
    long long want;                /* bytes of the bulk being parsed after its header; -1 none */
    const char *why;               /* what is wrong with a bad reply */
} Reader;

/* The length of the line at pos (up to CRLF, at most `most` bytes with them), or NEED_MORE / BAD. */
static int line_at(Reader *r, Py_ssize_t most, Py_ssize_t *len) {
    Py_ssize_t avail = r->end - r->pos;
    const char *p = r->buf + r->pos;
    const char *cr = memchr(p, '\r', (size_t)(avail < most ? avail : most));
    if (cr == NULL) {
        if (avail >= most) {
            r->why = "a header line without its end";
            return BAD;
        }
        return NEED_MORE;
    }
    if (cr + 1 >= r->buf + r->end) return NEED_MORE;
    if (cr[1] != '\n') {
        r->why = "a CR without LF";
        return BAD;
    }
    *len = cr - p;
    return PARSED;
}

/* A decimal integer of the header line p[1..n) (after its type byte); -1 allowed; else BAD via *ok = 0. */
static long long number(const char *p, Py_ssize_t n, int *ok) {
    long long v = 0;
    Py_ssize_t i = 1;
    int neg = 0;
    *ok = 0;
    if (n > 1 && p[1] == '-') {
        neg = 1;
        i = 2;
    }
    if (i >= n || n - i > 18) return 0;
    for (; i < n; i++) {
        if (p[i] < '0' || p[i] > '9') return 0;
        v = v * 10 + (p[i] - '0');
    }
    if (neg && v != 1) return 0;
    *ok = 1;
    return neg ? -1 : v;
}

/* Parse what was received: PARSED once the whole reply is, NEED_MORE, BAD, or ERROR_REPLY. */
static int parse(Reader *r) {
    for (;;) {
        if (r->want >= 0) { /* a bulk's bytes and their CRLF */
            if (r->end - r->pos < r->want + 2) return NEED_MORE;
            if (r->buf[r->pos + r->want] != '\r' || r->buf[r->pos + r->want + 1] != '\n') {
                r->why = "a bulk string without CRLF after its bytes";
                return BAD;
            }
            r->spans[2 * r->got] = r->pos;
            r->spans[2 * r->got + 1] = r->want;
            r->got++;
            r->pos += r->want + 2;
            r->want = -1;
        }
        if (r->count >= 0 && r->got == r->count) return PARSED;
        Py_ssize_t n;
        int said = line_at(r, r->count < 0 ? MAX_ERROR_LINE : MAX_LINE, &n);
        if (said != PARSED) return said;
        const char *p = r->buf + r->pos;
        int ok = 1;
        if (r->count < 0) { /* the reply's head */
            if (n >= 1 && p[0] == '-') {
                r->err_start = r->pos + 1;
                r->err_len = n - 1;
                r->pos += n + 2;
                return ERROR_REPLY;
            }
            long long c = (n >= 1 && p[0] == '*') ? number(p, n, &ok) : -2;
            if (!ok || c != r->got) { /* got holds the count asked for until the head is read */
                r->why = c == -2 ? "not an array" : "an array of another length than the fields asked for";
                return BAD;
            }
            r->count = (Py_ssize_t)c;
            r->got = 0;
        } else if (n == 1 && p[0] == '_') {
            r->spans[2 * r->got] = 0;
            r->spans[2 * r->got + 1] = -1;
            r->got++;
        } else if (n >= 1 && p[0] == '$') {
            long long len = number(p, n, &ok);
            if (!ok || len > MAX_BULK) {
                r->why = "a bulk string's length that is not one";
                return BAD;
            }
            if (len < 0) {
                r->spans[2 * r->got] = 0;
                r->spans[2 * r->got + 1] = -1;
                r->got++;
            } else {
                r->want = len;
            }
        } else {
            r->why = "an item that is neither a bulk string nor a null";
            return BAD;
        }
        r->pos += n + 2;
    }
}

static long long monotonic_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static PyObject *read_bulks(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    long long timeout_ms;
    Py_ssize_t count, hint;
    if (!PyArg_ParseTuple(args, "innL", &fd, &count, &hint, &timeout_ms)) return NULL;
    if (timeout_ms > (1LL << 52)) timeout_ms = 1LL << 52; /* over 100,000 years: the deadline's sum stays in range */
    if (count < 0 || count > PY_SSIZE_T_MAX / 64) {
        PyErr_Format(PyExc_ValueError, "cannot read %zd strings", count);
        return NULL;
    }
    /* The hint is only the blob's first size: never more than `count` strings of MAX_BULK bytes could fill (a
     * hint beyond that, however large, neither overflows the sums below nor allocates for bytes that cannot come);
     * with count <= PY_SSIZE_T_MAX / 64, data + 64 + count * 16 stays below PY_SSIZE_T_MAX. */
    Py_ssize_t most = count < (PY_SSIZE_T_MAX / 2) / (MAX_BULK + MAX_LINE) ? count * (MAX_BULK + MAX_LINE)
                                                                            : PY_SSIZE_T_MAX / 2;
    Py_ssize_t data = hint < most ? hint : most;
    Py_ssize_t cap = data < 4096 ? 4096 : data + 64 + count * 16; /* the data and each string's header */
    PyObject *blob = PyBytes_FromStringAndSize(NULL, cap);
    PyObject *spans = blob == NULL ? NULL : PyBytes_FromStringAndSize(NULL, count * 16 + 1);
    if (spans == NULL) {
        Py_XDECREF(blob);
        return NULL;
    }
    Reader r = {NULL, 0, 0, -1, count, (int64_t *)PyBytes_AS_STRING(spans), 0, 0, -1, NULL};
    int said = NEED_MORE, failed = 0; /* failed: errno of the socket; -1: closed by the CF */
    /* When the wait for the next bytes times out (a non-blocking socket): a deadline kept across signals, as
     * Python's recv keeps it (PEP 475), so that signals more often than the timeout do not wait for ever; -1
     * while no wait is on. */
    long long deadline = -1;
    while (said == NEED_MORE) {
        if (r.end == cap) { /* room for more: the blob grows (with the GIL: it is a Python object) */
            Py_ssize_t more = cap < (PY_SSIZE_T_MAX >> 1) ? cap * 2 : PY_SSIZE_T_MAX;
            if (more == cap || _PyBytes_Resize(&blob, more) < 0) {
                if (!PyErr_Occurred()) PyErr_NoMemory();
                goto fail;
            }
            cap = more;
        }
        char *buf = PyBytes_AS_STRING(blob);
        r.buf = buf;
        Py_BEGIN_ALLOW_THREADS
        while (said == NEED_MORE && r.end < cap) {
            ssize_t n = recv(fd, buf + r.end, (size_t)(cap - r.end), 0);
            if (n > 0) {
                r.end += n;
                deadline = -1;
                said = parse(&r);
            } else if (n == 0) {
                failed = -1;
                break;
            } else if ((errno == EAGAIN || errno == EWOULDBLOCK) && timeout_ms >= 0) {
                long long now = monotonic_ms();
                if (deadline < 0) deadline = now + timeout_ms;
                struct pollfd pfd = {fd, POLLIN, 0};
                long long left = deadline > now ? deadline - now : 0; /* poll waits an int's milliseconds */
                int ready = poll(&pfd, 1, left < INT_MAX ? (int)left : INT_MAX);
                if (ready == 0 && left >= INT_MAX) continue;
                if (ready == 0) {
                    failed = ETIMEDOUT;
                    break;
                }
                if (ready < 0) {
                    failed = errno;
                    break;
                }
            } else {
                failed = errno; /* EINTR among them: handled with the GIL */
                break;
            }
        }
        Py_END_ALLOW_THREADS
        if (failed == EINTR) { /* a signal: its Python handler runs (and may raise) before the read goes on */
            failed = 0;
            if (PyErr_CheckSignals() < 0) goto fail;
        } else if (failed == -1) {
            PyErr_SetString(PyExc_EOFError, "the CF closed the connection within a reply");
            goto fail;
        } else if (failed) {
            errno = failed;
            PyErr_SetFromErrno(PyExc_OSError);
            goto fail;
        }
    }
    if (said == BAD) {
        PyErr_Format(PyExc_ValueError, "the CF's reply is not an array of bulk strings: %s", r.why);
        goto fail;
    }
    if (r.pos != r.end) {
        PyErr_SetString(PyExc_ValueError, "the CF sent more than the reply asked for");
        goto fail;
    }
    if (said == ERROR_REPLY) {
        PyObject *text = PyUnicode_DecodeUTF8(r.buf + r.err_start, r.err_len, "replace");
        Py_DECREF(blob);
        Py_DECREF(spans);
        return text;
    }
    if (_PyBytes_Resize(&blob, r.end) < 0 || _PyBytes_Resize(&spans, count * 16) < 0) goto fail;
    return Py_BuildValue("(NN)", blob, spans);
fail:
    Py_XDECREF(blob);
    Py_XDECREF(spans);
    return NULL;
}

static PyMethodDef methods[] = {
    {"parts", parts, METH_VARARGS, "The [a, b) parts in which a batch's data is read (see cfemu/_bulk.c)."},
    {"pack_args", pack_args, METH_O, "A command's arguments as RESP bulk strings (see cfemu/_bulk.c)."},
    {"read_bulks", read_bulks, METH_VARARGS, "One array reply of bulk strings, read from a socket (see cfemu/_bulk.c)."},
    {"stage", stage, METH_VARARGS, "A load batch's descriptors and grouping from columns (see cfemu/_bulk.c)."},
    {"cut", cut, METH_VARARGS, "Where a load batch of these data ends (see cfemu/_bulk.c)."},
    {"pair_parts", pair_parts, METH_VARARGS, "HSET's parts after its header (see cfemu/_bulk.c)."},
    {"pack_groups", pack_groups, METH_VARARGS, "Commands of a key and its members, packed (see cfemu/_bulk.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bulk", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__bulk(void) { return PyModule_Create(&module); }
