/*
 * tq_redis.codec._copy: batched memory copies for the data plane, with the GIL released.
 *
 * Why native code: a put or get_data of a big batch is thousands of row-sized copies (e.g.
 * 2048 x 32 KiB). Done one by one from Python, each is a separate memcpy too small for glibc to
 * use non-temporal stores, so every destination cache line is first read from DRAM and then
 * written back: about 1.7x the memory traffic of one large memcpy. Here the whole batch is one
 * call; rows of a large batch are written with streaming stores (no read-for-ownership), and the
 * interpreter lock is released so other threads (and the other node's copy) keep running.
 *
 * The module is optional: tq_redis.codec.fastcopy falls back to Python loops when it is not built.
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

/* A numpy-style int64 array argument: its data and element count. */
static int int64_array(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "q") && strcmp(f, "l"))) {
        PyErr_Format(PyExc_TypeError, "copy_table: %s must be an int64 array, got format %s", what,
                     view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(copy_table_doc,
"copy_table(dst, dst_offsets, sources, index, src_offsets, lengths)\n--\n\n"
"For every i, copy ``lengths[i]`` bytes from ``sources[index[i]]`` at ``src_offsets[i]`` to\n"
"the writable buffer ``dst`` at ``dst_offsets[i]``. The four tables are int64 arrays of one\n"
"length. Raises ValueError, before copying anything, when an entry falls outside its buffers.");

static PyObject *copy_table(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *doff_obj, *src_obj, *idx_obj, *soff_obj, *len_obj;
    if (!PyArg_ParseTuple(args, "OOOOOO:copy_table", &dst_obj, &doff_obj, &src_obj, &idx_obj, &soff_obj, &len_obj))
        return NULL;
    Py_buffer dst, tables[4];
    PyObject *table_objs[4] = {doff_obj, idx_obj, soff_obj, len_obj};
    const char *table_names[4] = {"dst_offsets", "index", "src_offsets", "lengths"};
    int have = 0;
    PyObject *seq = NULL, *result = NULL;
    held_t held = {NULL, 0};
    piece_t *pieces = NULL;
    Py_ssize_t nsrc = 0, n = 0;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    for (; have < 4; have++)
        if (int64_array(table_objs[have], &tables[have], table_names[have]) < 0)
            goto done;
    n = tables[0].len / 8;
    for (int t = 1; t < 4; t++) {
        if (tables[t].len / 8 != n) {
            PyErr_Format(PyExc_ValueError, "copy_table: %s has %zd entries but dst_offsets has %zd",
                         table_names[t], tables[t].len / 8, n);
            goto done;
        }
    }
    seq = PySequence_Fast(src_obj, "copy_table: sources must be a sequence of buffers");
    if (seq == NULL || hold_sources(seq, &held, &nsrc) < 0)
        goto done;
    pieces = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(piece_t));
    if (pieces == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *doff = tables[0].buf, *idx = tables[1].buf, *soff = tables[2].buf, *len = tables[3].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (idx[i] < 0 || idx[i] >= nsrc) {
            PyErr_Format(PyExc_ValueError, "copy_table: entry %zd names source %lld of %zd", i, (long long)idx[i], nsrc);
            goto done;
        }
        const Py_buffer *src = &held.views[idx[i]];
        if (len[i] < 0 || soff[i] < 0 || soff[i] > src->len - len[i]) {
            PyErr_Format(PyExc_ValueError,
                         "copy_table: entry %zd reads %lld bytes at offset %lld of a %zd-byte source",
                         i, (long long)len[i], (long long)soff[i], src->len);
            goto done;
        }
        if (doff[i] < 0 || doff[i] > dst.len - len[i]) {
            PyErr_Format(PyExc_ValueError,
                         "copy_table: entry %zd (%lld bytes at offset %lld) does not fit a %zd-byte destination",
                         i, (long long)len[i], (long long)doff[i], dst.len);
            goto done;
        }
        pieces[i].dst = (char *)dst.buf + doff[i];
        pieces[i].src = (const char *)src->buf + soff[i];
        pieces[i].len = (Py_ssize_t)len[i];
    }
    if (run_unlocked(pieces, n) == 0)
        result = Py_NewRef(Py_None);
done:
    PyMem_Free(pieces);
    release_all(&held);
    Py_XDECREF(seq);
    for (int t = 0; t < have; t++)
        PyBuffer_Release(&tables[t]);
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
    {"copy_table", copy_table, METH_VARARGS, copy_table_doc},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS, configure_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "tq_redis.codec._copy",
    .m_doc = "Batched memory copies with the GIL released (see tq_redis.codec.fastcopy).",
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
