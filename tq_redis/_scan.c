/*
 * tq_redis._scan: one pass in C over the Python objects of a batch (see tq_redis.batchscan).
 *
 * Why native code: a put of a big batch hands the store thousands of values, each a list of
 * buffer segments under a string key. Reading their sizes and hashing their keys from Python
 * costs 100-400 ns per object (a map, a getattr, a set, a numpy fromiter for each property);
 * for 2048 values of 32 KiB over loopback TCP that was about a millisecond before the first
 * byte was sent. Here each object is visited once.
 *
 * The module is optional: tq_redis.batchscan falls back to the same work in Python, with the
 * same results, when it is not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ segments */

/* The byte size of a plain segment, or -1: a plain segment is a bytes object or a one-dimensional,
 * C-contiguous memoryview of unsigned bytes (format "B"), what the codec produces. */
static Py_ssize_t plain_size(PyObject *seg)
{
    if (PyBytes_CheckExact(seg))
        return PyBytes_GET_SIZE(seg);
    if (!PyMemoryView_Check(seg))
        return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(seg, &view, PyBUF_FULL_RO) < 0) {
        PyErr_Clear(); /* e.g. a released view: the Python path raises the error that names it */
        return -1;
    }
    Py_ssize_t size = -1;
    int byte_format = view.format == NULL || strcmp(view.format, "B") == 0;
    if (view.ndim == 1 && byte_format && PyBuffer_IsContiguous(&view, 'C'))
        size = view.len;
    PyBuffer_Release(&view);
    return size;
}

PyDoc_STRVAR(segments_doc,
"segments(values) -> (flat, sizes, counts) or None\n\n"
"values: a list of values, each a list or tuple of segments. flat: every segment in order (a\n"
"list); sizes: each segment's byte size and counts: each value's number of segments, both as\n"
"native-endian int64 bytes. None when a value is not a list or tuple, or a segment is not plain\n"
"(bytes, or a 1-D C-contiguous memoryview of format 'B').");

static PyObject *segments(PyObject *self, PyObject *args)
{
    PyObject *values;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &values))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(values), total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(values, i);
        if (PyList_CheckExact(v))
            total += PyList_GET_SIZE(v);
        else if (PyTuple_CheckExact(v))
            total += PyTuple_GET_SIZE(v);
        else
            Py_RETURN_NONE;
    }
    PyObject *flat = PyList_New(total);
    PyObject *sizes = PyBytes_FromStringAndSize(NULL, total * 8);
    PyObject *counts = PyBytes_FromStringAndSize(NULL, n * 8);
    if (flat == NULL || sizes == NULL || counts == NULL)
        goto fail;
    int64_t *size_out = (int64_t *)PyBytes_AS_STRING(sizes);
    int64_t *count_out = (int64_t *)PyBytes_AS_STRING(counts);
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(values, i);
        Py_ssize_t m = PyList_CheckExact(v) ? PyList_GET_SIZE(v) : PyTuple_GET_SIZE(v);
        PyObject **items = PyList_CheckExact(v) ? ((PyListObject *)v)->ob_item : ((PyTupleObject *)v)->ob_item;
        if (k + m > total) /* cannot happen with the GIL held throughout; kept as a bounds check */
            goto none;
        for (Py_ssize_t j = 0; j < m; j++) {
            PyObject *seg = items[j];
            Py_ssize_t size = plain_size(seg);
            if (size < 0)
                goto none;
            Py_INCREF(seg);
            PyList_SET_ITEM(flat, k, seg);
            size_out[k++] = (int64_t)size;
        }
        count_out[i] = (int64_t)m;
    }
    if (k != total)
        goto none;
    return Py_BuildValue("(NNN)", flat, sizes, counts);
none:
    Py_DECREF(flat); /* items not yet set are NULL, which list deallocation skips */
    Py_DECREF(sizes);
    Py_DECREF(counts);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(flat);
    Py_XDECREF(sizes);
    Py_XDECREF(counts);
    return NULL;
}

/* ------------------------------------------------------------------ key hashes */

static uint32_t crc_table[256];

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int b = 0; b < 8; b++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

/* CRC-32 as zlib.crc32 computes it (reflected, polynomial 0xEDB88320, initial and final xor ~0). */
static uint32_t crc32_of(const unsigned char *p, Py_ssize_t len)
{
    uint32_t c = 0xFFFFFFFFu;
    for (Py_ssize_t i = 0; i < len; i++)
        c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

PyDoc_STRVAR(crc32_keys_doc,
"crc32_keys(keys) -> bytes\n\n"
"zlib.crc32 of each key's UTF-8 bytes, as native-endian uint64 bytes (one per key). keys: a list or\n"
"tuple of str; TypeError for another key type, UnicodeEncodeError for a key UTF-8 cannot hold.");

static PyObject *crc32_keys(PyObject *self, PyObject *args)
{
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "O", &keys))
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "crc32_keys() takes a list or tuple of str");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out == NULL)
        goto done;
    uint64_t *hashes = (uint64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyUnicode_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "a key must be a str, got %.100s", Py_TYPE(items[i])->tp_name);
            Py_CLEAR(out);
            goto done;
        }
        Py_ssize_t len;
        const char *utf8 = PyUnicode_AsUTF8AndSize(items[i], &len);
        if (utf8 == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        hashes[i] = crc32_of((const unsigned char *)utf8, len);
    }
done:
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"segments", segments, METH_VARARGS, segments_doc},
    {"crc32_keys", crc32_keys, METH_VARARGS, crc32_keys_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "tq_redis._scan",
    .m_doc = "One pass in C over a batch's Python objects (see tq_redis.batchscan).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__scan(void)
{
    crc_init();
    return PyModule_Create(&module);
}
