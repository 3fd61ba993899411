/* A batch of backup frames framed in C (backup.files.BackupWriter.add_raw): the per-entry work of the copy loop
 * (the frame head, the msgpack bin head of the data, the CRC32C of the body, the copy of its bytes) with no
 * Python object made per entry. backup/files.py keeps the same framing in Python: the reference, and what runs
 * where this module was not built.
 *
 * append(buf, head, batch, limit) appends to the bytearray `buf` one frame a (descriptor, data) pair of the list
 * `batch` (both bytes): u32 body length, u32 CRC32C of the body (little endian), then the body: `head` (the
 * array head and step), the descriptor's bytes as they are, the bin head of the data, the data. It returns the
 * bytes appended; or -1, with nothing appended, when they would be more than `limit` (the caller then frames the
 * batch frame by frame, rolling files between them). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "crc32c.h" /* native/: shared with restore._columns */

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
        PyObject *pair = PyList_GET_ITEM(batch, i), *desc = PyTuple_GET_ITEM(pair, 0), *data = PyTuple_GET_ITEM(pair, 1);
        size_t nd = (size_t)PyBytes_GET_SIZE(desc), n = (size_t)PyBytes_GET_SIZE(data);
        uint8_t *body = out + FRAME_HEAD, *p = body;
        memcpy(p, head.buf, (size_t)head.len);
        p += head.len;
        memcpy(p, PyBytes_AS_STRING(desc), nd);
        p += nd;
        p += bin_head(p, n);
        memcpy(p, PyBytes_AS_STRING(data), n);
        p += n;
        size_t length = (size_t)(p - body);
        put_u32le(out, (uint32_t)length);
        put_u32le(out + 4, crc32c(body, length));
        out = p;
    }
    result = PyLong_FromSsize_t(total);
done:
    PyBuffer_Release(&head);
    return result;
}

static PyMethodDef methods[] = {
    {"append", append, METH_VARARGS, "Append a batch's frames to a bytearray (see backup/_frames.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_frames", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__frames(void) {
    crc32c_init();
    return PyModule_Create(&module);
}
