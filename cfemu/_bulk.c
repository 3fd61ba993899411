/* The parts of a fetched batch's data, told in C (cfemu.bulk.parts), and the ids of a fetch's HMGETs packed in C
 * (pack_args): a backup reads every descriptor of the
 * structure, and the Python loop that read each one's data length cost it about half a microsecond an entry.
 * cfemu/bulk.py keeps the same rule in Python: the reference, and what runs where this module was not built.
 *
 * parts(descs, limit, length_of) -> [(a, b), ...]: the [a, b) index ranges in which the data of entries with
 * these descriptors (the CF's msgpack bytes, or None for an entry gone: 0 bytes) is read, at most `limit` bytes
 * each (0 <= limit < 2**61), one entry at least. A descriptor's data length is read at sight as cfemu.bulk.data_length reads it (its
 * "len" key once, an unsigned integer behind it); any other descriptor is handed to length_of (data_length
 * itself, which decodes it). */
#define _GNU_SOURCE /* memmem */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define MAX_LIMIT (1LL << 61)

static const uint8_t LEN_KEY[4] = {0xa3, 'l', 'e', 'n'}; /* msgpack's "len", a fixstr of 3 */

/* The data length at sight (cfemu.bulk.data_length's rule), or -1 where it cannot be read so. */
static long long length_at_sight(const uint8_t *raw, size_t n) {
    if (n < sizeof LEN_KEY) return -1;
    const uint8_t *k = memmem(raw, n, LEN_KEY, sizeof LEN_KEY);
    if (k == NULL) return -1;
    size_t i = (size_t)(k - raw), j = i + 4;
    if (n - j >= sizeof LEN_KEY && memmem(raw + j, n - j, LEN_KEY, sizeof LEN_KEY) != NULL) return -1;
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
        p += sprintf(p, "$%zd\r\n", n);
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

static PyMethodDef methods[] = {
    {"parts", parts, METH_VARARGS, "The [a, b) parts in which a batch's data is read (see cfemu/_bulk.c)."},
    {"pack_args", pack_args, METH_O, "A command's arguments as RESP bulk strings (see cfemu/_bulk.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bulk", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__bulk(void) { return PyModule_Create(&module); }
