/*
 * tq_redis._copy: batched memory copies for the data plane, with the GIL released.
 *
 * Why native code: a put or get_data of a big batch is thousands of row-sized copies (e.g.
 * 2048 x 32 KiB). Done one by one from Python, each is a separate memcpy too small for glibc to
 * use non-temporal stores, so every destination cache line is first read from DRAM and then
 * written back: about 1.7x the memory traffic of one large memcpy. Here the whole batch is one
 * call; rows of a large batch are written with streaming stores (no read-for-ownership), and the
 * interpreter lock is released so other threads (and the other node's copy) keep running.
 *
 * The module is optional: tq_redis.fastcopy falls back to Python loops when it is not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define TQ_HAVE_STREAM 1
#else
#define TQ_HAVE_STREAM 0
#endif

/* A batch at least this large is written with streaming stores: it cannot stay in cache anyway. */
static Py_ssize_t stream_min_total = 4 << 20;
/* Pieces shorter than this are copied normally (a streaming store needs whole 64-byte lines). */
#define STREAM_MIN_PIECE 1024
/* Threads one large batch is split over, and the bytes each must get at least. */
static int copy_threads = 1;
static Py_ssize_t bytes_per_thread = 4 << 20;
#define MAX_THREADS 16

typedef struct {
    char *dst;
    const char *src;
    Py_ssize_t len;
} piece_t;

static void copy_plain(char *dst, const char *src, Py_ssize_t len)
{
    memcpy(dst, src, (size_t)len);
}

#if TQ_HAVE_STREAM
static void copy_stream(char *dst, const char *src, Py_ssize_t len)
{
    if (len < STREAM_MIN_PIECE) {
        memcpy(dst, src, (size_t)len);
        return;
    }
    /* align the destination to 64 bytes with an ordinary copy, stream whole lines, then the tail */
    Py_ssize_t head = (Py_ssize_t)((64 - ((uintptr_t)dst & 63)) & 63);
    memcpy(dst, src, (size_t)head);
    dst += head;
    src += head;
    len -= head;
    Py_ssize_t lines = len >> 6;
    __m128i *d = (__m128i *)dst;
    const __m128i *s = (const __m128i *)src;
    for (Py_ssize_t i = 0; i < lines; i++) {
        __m128i a = _mm_loadu_si128(s);
        __m128i b = _mm_loadu_si128(s + 1);
        __m128i c = _mm_loadu_si128(s + 2);
        __m128i e = _mm_loadu_si128(s + 3);
        _mm_stream_si128(d, a);
        _mm_stream_si128(d + 1, b);
        _mm_stream_si128(d + 2, c);
        _mm_stream_si128(d + 3, e);
        d += 4;
        s += 4;
    }
    Py_ssize_t done = lines << 6;
    memcpy(dst + done, src + done, (size_t)(len - done));
}
#endif

/* One worker's share: bytes [begin, end) of the pieces laid end to end (``starts`` = prefix sums). */
typedef struct {
    const piece_t *pieces;
    const Py_ssize_t *starts;
    Py_ssize_t n, begin, end;
    int stream;
} share_t;

static void *copy_share(void *arg)
{
    const share_t *sh = (const share_t *)arg;
    void (*copy)(char *, const char *, Py_ssize_t) = copy_plain;
#if TQ_HAVE_STREAM
    if (sh->stream)
        copy = copy_stream;
#endif
    /* the first piece that ends after ``begin`` */
    Py_ssize_t lo = 0, hi = sh->n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (sh->starts[mid] + sh->pieces[mid].len <= sh->begin)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (Py_ssize_t i = lo; i < sh->n && sh->starts[i] < sh->end; i++) {
        Py_ssize_t a = sh->starts[i], b = a + sh->pieces[i].len;
        Py_ssize_t from = a > sh->begin ? a : sh->begin, to = b < sh->end ? b : sh->end;
        if (to > from)
            copy(sh->pieces[i].dst + (from - a), sh->pieces[i].src + (from - a), to - from);
    }
#if TQ_HAVE_STREAM
    if (sh->stream)
        _mm_sfence(); /* streaming stores are weakly ordered: drain them before reporting done */
#endif
    return NULL;
}

/* Copy every piece; large batches are split by bytes over up to ``copy_threads`` threads. */
static void copy_all(const piece_t *pieces, const Py_ssize_t *starts, Py_ssize_t n, Py_ssize_t total)
{
    int stream = TQ_HAVE_STREAM && total >= stream_min_total;
    Py_ssize_t want = bytes_per_thread > 0 ? total / bytes_per_thread : copy_threads;
    int k = (int)(want < copy_threads ? want : copy_threads);
    if (k < 1)
        k = 1;
    share_t shares[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < k; t++) {
        shares[t] = (share_t){pieces, starts, n, total * t / k, total * (t + 1) / k, stream};
        /* 64-byte cut points keep every worker's stores on whole cache lines */
        if (t)
            shares[t].begin &= ~(Py_ssize_t)63;
        if (t + 1 < k)
            shares[t].end &= ~(Py_ssize_t)63;
    }
    for (int t = 1; t < k; t++)
        started[t] = pthread_create(&tids[t], NULL, copy_share, &shares[t]) == 0;
    copy_share(&shares[0]);
    for (int t = 1; t < k; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else
            copy_share(&shares[t]); /* no thread to be had: do its share here */
    }
}

/* Buffers acquired for one call, released together. */
typedef struct {
    Py_buffer *views;
    Py_ssize_t count;
} held_t;

static void release_all(held_t *held)
{
    for (Py_ssize_t i = 0; i < held->count; i++)
        PyBuffer_Release(&held->views[i]);
    PyMem_Free(held->views);
    held->views = NULL;
    held->count = 0;
}

static int hold_sources(PyObject *seq, held_t *held, Py_ssize_t *n_out)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    held->views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    held->count = 0;
    if (held->views == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(items[i], &held->views[i], PyBUF_C_CONTIGUOUS) < 0) {
            release_all(held);
            return -1;
        }
        held->count = i + 1;
    }
    *n_out = n;
    return 0;
}

/* Copy the pieces, without the interpreter lock for any batch worth the hand-off. */
static int run_unlocked(const piece_t *pieces, Py_ssize_t n)
{
    Py_ssize_t *starts = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    if (starts == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        starts[i] = total;
        total += pieces[i].len;
    }
    if (total < (64 << 10)) {
        copy_all(pieces, starts, n, total);
    } else {
        Py_BEGIN_ALLOW_THREADS
        copy_all(pieces, starts, n, total);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(starts);
    return 0;
}

PyDoc_STRVAR(scatter_doc,
"scatter(dst, offsets, parts)\n--\n\n"
"Copy each buffer ``parts[i]`` into the writable buffer ``dst`` at byte ``offsets[i]``.\n\n"
"``offsets`` is a buffer of native int64 (e.g. a numpy array). Raises ValueError when a part\n"
"would land outside ``dst`` or the lengths differ; nothing is copied then.");

static PyObject *scatter(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *off_obj, *parts_obj;
    if (!PyArg_ParseTuple(args, "OOO:scatter", &dst_obj, &off_obj, &parts_obj))
        return NULL;
    Py_buffer dst, offs;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(off_obj, &offs, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(parts_obj, "scatter: parts must be a sequence of buffers");
    held_t held = {NULL, 0};
    piece_t *pieces = NULL;
    PyObject *result = NULL;
    Py_ssize_t n = 0;
    if (seq == NULL || hold_sources(seq, &held, &n) < 0)
        goto done;
    if (offs.len != n * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "scatter: %zd parts but %zd bytes of int64 offsets", n, offs.len);
        goto done;
    }
    pieces = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(piece_t));
    if (pieces == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *off = (const int64_t *)offs.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = held.views[i].len;
        if (off[i] < 0 || off[i] > dst.len - len) {
            PyErr_Format(PyExc_ValueError,
                         "scatter: part %zd (%zd bytes at offset %lld) does not fit a %zd-byte destination",
                         i, len, (long long)off[i], dst.len);
            goto done;
        }
        pieces[i].dst = (char *)dst.buf + off[i];
        pieces[i].src = (const char *)held.views[i].buf;
        pieces[i].len = len;
    }
    if (run_unlocked(pieces, n) == 0)
        result = Py_NewRef(Py_None);
done:
    PyMem_Free(pieces);
    release_all(&held);
    Py_XDECREF(seq);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&dst);
    return result;
}

PyDoc_STRVAR(gather_rows_doc,
"gather_rows(dst, parts, skip, row)\n--\n\n"
"Copy bytes ``[skip, skip + row)`` of each buffer ``parts[i]`` to ``dst[i * row:(i + 1) * row]``.\n\n"
"Raises ValueError when a part is shorter than ``skip + row`` or ``dst`` is too small; nothing\n"
"is copied then.");

static PyObject *gather_rows(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *parts_obj;
    Py_ssize_t skip, row;
    if (!PyArg_ParseTuple(args, "OOnn:gather_rows", &dst_obj, &parts_obj, &skip, &row))
        return NULL;
    if (skip < 0 || row < 0) {
        PyErr_SetString(PyExc_ValueError, "gather_rows: skip and row must be >= 0");
        return NULL;
    }
    Py_buffer dst;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(parts_obj, "gather_rows: parts must be a sequence of buffers");
    held_t held = {NULL, 0};
    piece_t *pieces = NULL;
    PyObject *result = NULL;
    Py_ssize_t n = 0;
    if (seq == NULL || hold_sources(seq, &held, &n) < 0)
        goto done;
    if (row && n > dst.len / row) {
        PyErr_Format(PyExc_ValueError, "gather_rows: %zd rows of %zd bytes do not fit a %zd-byte destination",
                     n, row, dst.len);
        goto done;
    }
    pieces = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(piece_t));
    if (pieces == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (held.views[i].len - skip < row) {
            PyErr_Format(PyExc_ValueError, "gather_rows: part %zd has %zd bytes, fewer than %zd + %zd",
                         i, held.views[i].len, skip, row);
            goto done;
        }
        pieces[i].dst = (char *)dst.buf + i * row;
        pieces[i].src = (const char *)held.views[i].buf + skip;
        pieces[i].len = row;
    }
    if (run_unlocked(pieces, n) == 0)
        result = Py_NewRef(Py_None);
done:
    PyMem_Free(pieces);
    release_all(&held);
    Py_XDECREF(seq);
    PyBuffer_Release(&dst);
    return result;
}

PyDoc_STRVAR(configure_doc,
"configure(threads=-1, stream_min=-1, bytes_per_thread=-1) -> tuple\n--\n\n"
"Set how batches are copied (a negative argument keeps the current value): at most ``threads``\n"
"threads per batch, each given at least ``bytes_per_thread`` bytes; streaming stores from\n"
"``stream_min`` batch bytes. Returns the settings now in force as\n"
"``(threads, stream_min, bytes_per_thread)``.");

static PyObject *configure(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"threads", "stream_min", "bytes_per_thread", NULL};
    int threads = -1;
    Py_ssize_t smin = -1, per = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|inn:configure", names, &threads, &smin, &per))
        return NULL;
    if (threads >= 0)
        copy_threads = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
    if (smin >= 0)
        stream_min_total = smin;
    if (per >= 0)
        bytes_per_thread = per;
    return Py_BuildValue("(inn)", copy_threads, stream_min_total, bytes_per_thread);
}

static PyMethodDef methods[] = {
    {"scatter", scatter, METH_VARARGS, scatter_doc},
    {"gather_rows", gather_rows, METH_VARARGS, gather_rows_doc},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS, configure_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "tq_redis._copy",
    .m_doc = "Batched memory copies with the GIL released (see tq_redis.fastcopy).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__copy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "HAVE_STREAM", TQ_HAVE_STREAM) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
