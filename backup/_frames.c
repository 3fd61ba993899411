/* A batch of backup frames framed in C (backup.files.BackupWriter.add_raw): the per-entry work of the copy loop
 * (the frame head, the msgpack bin head of the data, the CRC32C of the body, the copy of its bytes) with no
 * Python object made per entry. backup/files.py keeps the same framing in Python: the reference, and what runs
 * where this module was not built.
 *
 * append(buf, head, batch, limit) appends to the bytearray `buf` one frame a (descriptor, data) pair of the list
 * `batch` (both bytes): u32 body length, u32 CRC32C of the body (little endian), then the body: `head` (the
 * array head and step), the descriptor's bytes as they are, the bin head of the data, the data. It returns the
 * bytes appended; or -1, with nothing appended, when they would be more than `limit` (the caller then frames the
 * batch frame by frame, rolling files between them).
 *
 * select_append(buf, head, descs, datas, limit, at_sight, decide) is the copy loop of one fetched part: the lists
 * of the CF's raw descriptors and data as the fetch read them (None where an entry is gone), selected as
 * backup.protocol.select_raw selects them and framed as append frames them, in one pass with no Python object made
 * per copied entry. A pair with a None is gone (counted as vanished); a descriptor persistent at sight (at_sight
 * true: backup.protocol._persistent_at_sight's rule, the same bytes looked at) is copied as it is; any other is
 * handed to decide(descriptor), whose true copies it (decide counts what it leaves out). It returns (added,
 * copied, data bytes copied, vanished, overflow): added as append's; when the copies would be more than `limit`,
 * added is -1, nothing is appended, and overflow is the list of the (descriptor, data) pairs selected, to be
 * framed frame by frame (decide is never asked twice of an entry). `datas` may also be a fetched reply's strings
 * left in its bytes (cfemu.bulk.Bulks, passed as its (blob, spans)): framed from there, with no bytes object made
 * for any of them. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "crc32c.h" /* native/: shared with restore._columns */
#include "msgpack_key.h" /* native/: shared with cfemu._bulk */

#define FRAME_HEAD 8

static size_t bin_head(uint8_t *out, size_t n) {
    if (n < 0x100) {
        out[0] = 0xc4;
        out[1] = (uint8_t)n;
        return 2;
    }
    if (n < 0x10000) {
        out[0] = 0xc5;
        out[1] = (uint8_t)(n >> 8);
        out[2] = (uint8_t)n;
        return 3;
    }
    out[0] = 0xc6;
    out[1] = (uint8_t)(n >> 24);
    out[2] = (uint8_t)(n >> 16);
    out[3] = (uint8_t)(n >> 8);
    out[4] = (uint8_t)n;
    return 5;
}

static size_t bin_head_size(size_t n) { return n < 0x100 ? 2 : n < 0x10000 ? 3 : 5; }

static void put_u32le(uint8_t *out, uint32_t v) {
    out[0] = (uint8_t)v;
    out[1] = (uint8_t)(v >> 8);
    out[2] = (uint8_t)(v >> 16);
    out[3] = (uint8_t)(v >> 24);
}

/* One frame at `out` (room made for it): its head, then the body: `head`, the descriptor's bytes, the bin head
 * of the data, the data. Returns the end of the frame. */
static uint8_t *put_frame(uint8_t *out, const Py_buffer *head, PyObject *desc, const char *data, size_t n) {
    size_t nd = (size_t)PyBytes_GET_SIZE(desc);
    uint8_t *body = out + FRAME_HEAD, *p = body;
    memcpy(p, head->buf, (size_t)head->len);
    p += head->len;
    memcpy(p, PyBytes_AS_STRING(desc), nd);
    p += nd;
    p += bin_head(p, n);
    memcpy(p, data, n);
    p += n;
    size_t length = (size_t)(p - body);
    put_u32le(out, (uint32_t)length);
    put_u32le(out + 4, crc32c(body, length));
    return p;
}

/* The pair at i of the batch: its two items, checked to be bytes (borrowed references). */
static int pair_at(PyObject *batch, Py_ssize_t i, PyObject **desc, PyObject **data) {
    PyObject *pair = PyList_GET_ITEM(batch, i);
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        PyErr_Format(PyExc_TypeError, "batch item %zd is not a (descriptor, data) pair", i);
        return -1;
    }
    *desc = PyTuple_GET_ITEM(pair, 0);
    *data = PyTuple_GET_ITEM(pair, 1);
    if (!PyBytes_Check(*desc) || !PyBytes_Check(*data)) {
        PyErr_Format(PyExc_TypeError, "batch item %zd: descriptor and data must be bytes", i);
        return -1;
    }
    return 0;
}

static PyObject *append(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *buf, *batch;
    Py_buffer head;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "O!y*O!n", &PyByteArray_Type, &buf, &head, &PyList_Type, &batch, &limit)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t count = PyList_GET_SIZE(batch), total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *desc, *data;
        if (pair_at(batch, i, &desc, &data) < 0) goto done;
        size_t n = (size_t)PyBytes_GET_SIZE(data);
        if (n > UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "batch item %zd: data of %zu bytes is more than a frame holds", i, n);
            goto done;
        }
        total += FRAME_HEAD + head.len + PyBytes_GET_SIZE(desc) + (Py_ssize_t)bin_head_size(n) + (Py_ssize_t)n;
        if (total > limit) {
            result = PyLong_FromLong(-1);
            goto done;
        }
    }
    Py_ssize_t start = PyByteArray_GET_SIZE(buf);
    if (PyByteArray_Resize(buf, start + total) < 0) goto done;
    uint8_t *out = (uint8_t *)PyByteArray_AS_STRING(buf) + start;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *pair = PyList_GET_ITEM(batch, i), *data = PyTuple_GET_ITEM(pair, 1);
        out = put_frame(out, &head, PyTuple_GET_ITEM(pair, 0), PyBytes_AS_STRING(data),
                        (size_t)PyBytes_GET_SIZE(data));
    }
    result = PyLong_FromSsize_t(total);
done:
    PyBuffer_Release(&head);
    return result;
}

/* The descriptor "per" key as the CF's writers encode it (a fixstr of 3), and the persistent value behind it. */
static const uint8_t PER_KEY[4] = {0xa3, 'p', 'e', 'r'};
#define PERSISTENT 1

/* The first "per" key in p[0:n], or NULL. */
static const uint8_t *find_key(const uint8_t *p, size_t n) { return find_msgpack_key(p, n, PER_KEY); }

/* backup.protocol._persistent_at_sight: "per" once, followed by 1 (raw.find, the byte at i + 4, raw.find from
 * i + 4). */
static int persistent_at_sight(const uint8_t *raw, size_t n) {
    const uint8_t *k = find_key(raw, n);
    if (k == NULL) return 0;
    size_t i = (size_t)(k - raw);
    if (!(n > i + 4 && raw[i + 4] == PERSISTENT)) return 0;
    return find_key(raw + i + 4, n - (i + 4)) == NULL;
}

enum { GONE = 0, KEEP = 1, LEAVE = 2 };

/* A fetched part's data: a list of bytes or None, or a reply's strings left in its bytes (cfemu.bulk.Bulks, given
 * as the tuple (blob, spans): each string's offset and length as two native 64-bit integers, length -1 for
 * null). */
typedef struct {
    PyObject *list;
    const char *blob;
    Py_ssize_t blob_len, count;
    const int64_t *spans;
} Datas;

static int datas_open(PyObject *datas, Datas *d) {
    memset(d, 0, sizeof *d);
    if (PyList_Check(datas)) {
        d->list = datas;
        d->count = PyList_GET_SIZE(datas);
        return 0;
    }
    PyObject *blob, *spans;
    if (!PyTuple_Check(datas) || PyTuple_GET_SIZE(datas) != 2 || !PyBytes_Check(blob = PyTuple_GET_ITEM(datas, 0)) ||
        !PyBytes_Check(spans = PyTuple_GET_ITEM(datas, 1)) || PyBytes_GET_SIZE(spans) % 16) {
        PyErr_SetString(PyExc_TypeError, "the data are a list, or a (blob, spans) pair of bytes (cfemu.bulk.Bulks)");
        return -1;
    }
    d->blob = PyBytes_AS_STRING(blob);
    d->blob_len = PyBytes_GET_SIZE(blob);
    d->spans = (const int64_t *)PyBytes_AS_STRING(spans);
    d->count = PyBytes_GET_SIZE(spans) / 16;
    return 0;
}

/* The data of item i: 1 and its bytes, 0 for a None (gone), -1 with an error raised. */
static int data_at(const Datas *d, Py_ssize_t i, const char **p, size_t *n) {
    if (d->list != NULL) {
        PyObject *data = PyList_GET_ITEM(d->list, i);
        if (data == Py_None) return 0;
        if (!PyBytes_Check(data)) {
            PyErr_Format(PyExc_TypeError, "item %zd: descriptor and data must be bytes or None", i);
            return -1;
        }
        *p = PyBytes_AS_STRING(data);
        *n = (size_t)PyBytes_GET_SIZE(data);
        return 1;
    }
    int64_t at = d->spans[2 * i], len = d->spans[2 * i + 1];
    if (len == -1) return 0;
    if (at < 0 || len < 0 || at > d->blob_len || len > d->blob_len - at) {
        PyErr_Format(PyExc_ValueError, "item %zd: a span (%lld, %lld) outside the reply's %zd bytes", i, (long long)at,
                     (long long)len, d->blob_len);
        return -1;
    }
    *p = d->blob + at;
    *n = (size_t)len;
    return 1;
}

static PyObject *select_append(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *buf, *descs, *datas_in, *decide, *datas = NULL;
    Py_buffer head;
    Py_ssize_t limit;
    int at_sight;
    if (!PyArg_ParseTuple(args, "O!y*O!OnpO", &PyByteArray_Type, &buf, &head, &PyList_Type, &descs, &datas_in,
                          &limit, &at_sight, &decide))
        return NULL;
    PyObject *result = NULL, *overflow = NULL;
    uint8_t *verdict = NULL;
    Py_ssize_t count = PyList_GET_SIZE(descs), total = 0, copied = 0, vanished = 0;
    unsigned long long nbytes = 0;
    Datas d;
    /* Lists of their own: decide runs Python code, which must not change (and free) the items looked at (a
     * (blob, spans) pair is of bytes: it cannot change). */
    descs = PyList_GetSlice(descs, 0, count);
    if (descs == NULL) goto done;
    datas = PyList_Check(datas_in) ? PyList_GetSlice(datas_in, 0, PyList_GET_SIZE(datas_in)) : Py_NewRef(datas_in);
    if (datas == NULL || datas_open(datas, &d) < 0) goto done;
    if (d.count != count) {
        PyErr_Format(PyExc_ValueError, "%zd descriptors and %zd data", count, d.count);
        goto done;
    }
    verdict = PyMem_Malloc(count ? (size_t)count : 1);
    if (verdict == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* Pass 1: each pair's verdict, and the size of the frames of the copies. */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *desc = PyList_GET_ITEM(descs, i);
        const char *data;
        size_t n;
        int present = data_at(&d, i, &data, &n);
        if (present < 0) goto done;
        if (desc == Py_None || !present) {
            verdict[i] = GONE;
            vanished++;
            continue;
        }
        if (!PyBytes_Check(desc)) {
            PyErr_Format(PyExc_TypeError, "item %zd: descriptor and data must be bytes or None", i);
            goto done;
        }
        int keep = at_sight && persistent_at_sight((const uint8_t *)PyBytes_AS_STRING(desc),
                                                   (size_t)PyBytes_GET_SIZE(desc));
        if (!keep) {
            PyObject *said = PyObject_CallOneArg(decide, desc);
            if (said == NULL) goto done;
            keep = PyObject_IsTrue(said);
            Py_DECREF(said);
            if (keep < 0) goto done;
        }
        verdict[i] = keep ? KEEP : LEAVE;
        if (!keep) continue;
        if (n > UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "item %zd: data of %zu bytes is more than a frame holds", i, n);
            goto done;
        }
        copied++;
        nbytes += n;
        total += FRAME_HEAD + head.len + PyBytes_GET_SIZE(desc) + (Py_ssize_t)bin_head_size(n) + (Py_ssize_t)n;
    }
    if (total > limit) {
        overflow = PyList_New(copied);
        if (overflow == NULL) goto done;
        for (Py_ssize_t i = 0, k = 0; i < count; i++) {
            if (verdict[i] != KEEP) continue;
            const char *data;
            size_t n;
            data_at(&d, i, &data, &n); /* checked in pass 1 */
            PyObject *bytes = PyBytes_FromStringAndSize(data, (Py_ssize_t)n);
            PyObject *pair = bytes == NULL ? NULL : PyTuple_Pack(2, PyList_GET_ITEM(descs, i), bytes);
            Py_XDECREF(bytes);
            if (pair == NULL) goto done;
            PyList_SET_ITEM(overflow, k++, pair);
        }
        result = Py_BuildValue("nnKnO", (Py_ssize_t)-1, copied, nbytes, vanished, overflow);
        goto done;
    }
    /* Pass 2: the frames of the copies, in the batch's order. */
    Py_ssize_t start = PyByteArray_GET_SIZE(buf);
    if (PyByteArray_Resize(buf, start + total) < 0) goto done;
    uint8_t *out = (uint8_t *)PyByteArray_AS_STRING(buf) + start;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (verdict[i] != KEEP) continue;
        const char *data;
        size_t n;
        data_at(&d, i, &data, &n);
        out = put_frame(out, &head, PyList_GET_ITEM(descs, i), data, n);
    }
    result = Py_BuildValue("nnKnO", total, copied, nbytes, vanished, Py_None);
done:
    PyMem_Free(verdict);
    Py_XDECREF(overflow);
    Py_XDECREF(descs);
    Py_XDECREF(datas);
    PyBuffer_Release(&head);
    return result;
}

static PyMethodDef methods[] = {
    {"append", append, METH_VARARGS, "Append a batch's frames to a bytearray (see backup/_frames.c)."},
    {"select_append", select_append, METH_VARARGS,
     "Select a fetched part's copies and append their frames to a bytearray (see backup/_frames.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_frames", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__frames(void) {
    crc32c_init();
    return PyModule_Create(&module);
}
