/*
 * tq_redis.codec._scan: one pass in C over the Python objects of a batch (see tq_redis.codec.batchscan).
 *
 * Why native code: a put of a big batch hands the store thousands of values, each a list of
 * buffer segments under a string key. Reading their sizes and hashing their keys from Python
 * costs 100-400 ns per object (a map, a getattr, a set, a numpy fromiter for each property);
 * for 2048 values of 32 KiB over loopback TCP that was about a millisecond before the first
 * byte was sent. Decoding a small field of a claim (16 rows of token ids, say) is the same kind
 * of work: check each value's header, read its length, join the payloads. Here each object is
 * visited once.
 *
 * The module is optional: tq_redis.codec.batchscan falls back to the same work in Python, with the
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

/* ------------------------------------------------------------------ joined payloads */

typedef struct {
    const char *data;
    Py_ssize_t len;
} span_t;

/* The bytes of each value (a bytes object, or a bytearray or memoryview the buffer protocol hands
 * out as one C-contiguous block), held in `views` until release_spans; -1 with no error set when a
 * value is none of those. */
static int value_spans(PyObject *values, span_t *spans, Py_buffer *views, Py_ssize_t *held)
{
    Py_ssize_t n = PyList_GET_SIZE(values);
    *held = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(values, i);
        if (PyBytes_CheckExact(v)) {
            spans[i].data = PyBytes_AS_STRING(v);
            spans[i].len = PyBytes_GET_SIZE(v);
            continue;
        }
        if (!(PyMemoryView_Check(v) || PyByteArray_CheckExact(v))
                || PyObject_GetBuffer(v, &views[*held], PyBUF_SIMPLE) < 0) {
            PyErr_Clear();
            return -1;
        }
        spans[i].data = views[*held].buf;
        spans[i].len = views[*held].len;
        (*held)++;
    }
    return 0;
}

static void release_spans(Py_buffer *views, Py_ssize_t held)
{
    for (Py_ssize_t k = 0; k < held; k++)
        PyBuffer_Release(&views[k]);
}

/* A little-endian int64 (the wire format's byte order, whatever the host's). */
static int64_t read_le64(const char *p)
{
    uint64_t v = 0;
    for (int b = 7; b >= 0; b--)
        v = (v << 8) | (unsigned char)p[b];
    return (int64_t)v;
}

PyDoc_STRVAR(join_framed_doc,
"join_framed(values, prefix, size) -> bytearray or None\n\n"
"values: a list of bytes, bytearrays or memoryviews, each exactly `size` bytes starting with\n"
"`prefix` (the header every dense value of a field shares). Returns their parts after the prefix,\n"
"one after the other, in a new bytearray; None when a value is not like that (or none of those\n"
"types).");

static PyObject *join_framed(PyObject *self, PyObject *args)
{
    PyObject *values;
    const char *prefix;
    Py_ssize_t plen, size;
    if (!PyArg_ParseTuple(args, "O!y#n", &PyList_Type, &values, &prefix, &plen, &size))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(values), held = 0;
    if (size < plen)
        Py_RETURN_NONE;
    span_t *spans = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(span_t));
    Py_buffer *views = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_buffer));
    PyObject *out = NULL;
    if (spans == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (value_spans(values, spans, views, &held) < 0)
        goto none;
    for (Py_ssize_t i = 0; i < n; i++)
        if (spans[i].len != size || memcmp(spans[i].data, prefix, (size_t)plen) != 0)
            goto none;
    Py_ssize_t part = size - plen;
    if (part && n > PY_SSIZE_T_MAX / part)
        goto none;
    out = PyByteArray_FromStringAndSize(NULL, n * part);
    if (out == NULL)
        goto done;
    char *dst = PyByteArray_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++)
        memcpy(dst + i * part, spans[i].data + plen, (size_t)part);
    goto done;
none:
    out = Py_NewRef(Py_None);
done:
    release_spans(views, held);
    PyMem_Free(spans);
    PyMem_Free(views);
    return out;
}

PyDoc_STRVAR(join_rows_doc,
"join_rows(values, prefix, itemsize, max_bytes) -> (bytearray, offsets, min, max) or None\n\n"
"values: a list of bytes, bytearrays or memoryviews, each a one-dimensional row: `prefix`, its\n"
"length n as a little-endian int64, then exactly n * itemsize bytes. Returns the rows' payloads\n"
"one after the other in a new bytearray, the len(values) + 1 start offsets (in items) as a\n"
"bytearray of native int64, and the shortest and longest length. None when a value is not like\n"
"that, or the payloads add up to more than max_bytes (the caller then takes its general path,\n"
"which names what is wrong).");

static PyObject *join_rows(PyObject *self, PyObject *args)
{
    PyObject *values;
    const char *prefix;
    Py_ssize_t plen, itemsize, max_bytes;
    if (!PyArg_ParseTuple(args, "O!y#nn", &PyList_Type, &values, &prefix, &plen, &itemsize, &max_bytes))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(values), held = 0, head = plen + 8;
    if (itemsize <= 0 || n == 0)
        Py_RETURN_NONE;
    span_t *spans = PyMem_Malloc((size_t)n * sizeof(span_t));
    Py_buffer *views = PyMem_Malloc((size_t)n * sizeof(Py_buffer));
    PyObject *joined = NULL, *offsets = NULL, *out = NULL;
    if (spans == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (value_spans(values, spans, views, &held) < 0)
        goto none;
    offsets = PyByteArray_FromStringAndSize(NULL, (n + 1) * 8);
    if (offsets == NULL)
        goto done;
    int64_t *bounds = (int64_t *)PyByteArray_AS_STRING(offsets);
    int64_t total = 0, shortest = INT64_MAX, longest = 0;
    bounds[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (spans[i].len < head || memcmp(spans[i].data, prefix, (size_t)plen) != 0)
            goto none;
        int64_t rows = read_le64(spans[i].data + plen);
        if (rows < 0 || rows > (int64_t)((spans[i].len - head) / itemsize) || spans[i].len != head + rows * itemsize)
            goto none;
        total += rows;
        if ((total * itemsize) > (int64_t)max_bytes)
            goto none;
        bounds[i + 1] = total;
        if (rows < shortest)
            shortest = rows;
        if (rows > longest)
            longest = rows;
    }
    joined = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(total * itemsize));
    if (joined == NULL)
        goto done;
    char *dst = PyByteArray_AS_STRING(joined);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t part = spans[i].len - head;
        memcpy(dst, spans[i].data + head, (size_t)part);
        dst += part;
    }
    out = Py_BuildValue("(OOLL)", joined, offsets, (long long)shortest, (long long)longest);
    goto done;
none:
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(joined);
    Py_XDECREF(offsets);
    release_spans(views, held);
    PyMem_Free(spans);
    PyMem_Free(views);
    return out;
}

static PyMethodDef methods[] = {
    {"segments", segments, METH_VARARGS, segments_doc},
    {"crc32_keys", crc32_keys, METH_VARARGS, crc32_keys_doc},
    {"join_framed", join_framed, METH_VARARGS, join_framed_doc},
    {"join_rows", join_rows, METH_VARARGS, join_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "tq_redis.codec._scan",
    .m_doc = "One pass in C over a batch's Python objects (see tq_redis.codec.batchscan).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__scan(void)
{
    crc_init();
    return PyModule_Create(&module);
}
