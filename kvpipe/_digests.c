/* kvpipe._digests: the XXH3-64 digests of many block values in one call, without the GIL
 * (and, for the scatter of values lent by a store, their addresses in one call; for a value a
 * store hands to a host cache's sink, its checks and its copy into the cache in one call).
 *
 * python-xxhash gives up the GIL for each value it hashes and takes it back after; a copy
 * thread hashing a slice's blocks one call at a time then waits for the GIL once per block,
 * each time until the event loop's thread (or another copy thread) lets go of it: in the
 * memory store's read bench that wait was more than the hashing itself. These functions
 * take every value of a slice, release the GIL once, and hash them all.
 *
 * What a trailer holds and means stays in Python (kvpipe/_blockformat.py): seal() copies a
 * trailer Python packed into each value and writes the payload's digest at the offset it is
 * told; gather_seal() does the same for values it first copies out of the cache rows, each
 * piece hashed right after its copy (one pass over the bytes instead of two: a host write's
 * gather and seal ran 1.3x faster so); check_place() compares a fetched value's trailer with
 * one Python packed, and copies a value that passes into the cache rows in the same call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "xxhash.h"

/* On x86, the widest vector unit the processor has (AVX2, AVX-512), chosen at run time by
 * xxHash's dispatcher (built beside this file with baseline flags, as python-xxhash does):
 * about 3.5x the speed of the SSE2 baseline here. */
#ifdef XXHASH_X86_DISPATCH
#include "xxh_x86dispatch.h"
#define HASH64 XXH3_64bits_dispatch
#define UPDATE64 XXH3_64bits_update_dispatch
#else
#define HASH64 XXH3_64bits
#define UPDATE64 XXH3_64bits_update
#endif

/* Buffers of each item of `seq` (writable ones with `writable`), each at least `nbytes`. */
static Py_buffer *get_buffers(PyObject *seq, Py_ssize_t *count, Py_ssize_t nbytes, int writable) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &views[i], flags) < 0) {
            for (Py_ssize_t j = 0; j < i; j++) PyBuffer_Release(&views[j]);
            PyMem_Free(views);
            return NULL;
        }
        if (views[i].len < nbytes) {
            PyErr_Format(PyExc_ValueError, "value %zd has %zd bytes, fewer than %zd", i,
                         views[i].len, nbytes);
            for (Py_ssize_t j = 0; j <= i; j++) PyBuffer_Release(&views[j]);
            PyMem_Free(views);
            return NULL;
        }
    }
    *count = n;
    return views;
}

static void release_buffers(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
}

static PyObject *to_list(const uint64_t *digests, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyLong_FromUnsignedLongLong((unsigned long long)digests[i]);
        if (d == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, d);
    }
    return out;
}

PyDoc_STRVAR(payload_digests_doc,
             "payload_digests(values, nbytes, /) -> list[int]\n\n"
             "The XXH3-64 of the first `nbytes` bytes of each value (C-contiguous buffers),\n"
             "all computed with the GIL released once.");

static PyObject *payload_digests(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *values, *seq;
    Py_ssize_t nbytes, n = 0;
    if (!PyArg_ParseTuple(args, "On:payload_digests", &values, &nbytes)) return NULL;
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must not be negative");
        return NULL;
    }
    seq = PySequence_Fast(values, "values must be a sequence");
    if (seq == NULL) return NULL;
    Py_buffer *views = get_buffers(seq, &n, nbytes, 0);
    Py_DECREF(seq);
    if (views == NULL) return NULL;
    uint64_t *digests = PyMem_Malloc(n ? (size_t)n * sizeof(uint64_t) : 1);
    if (digests == NULL) {
        release_buffers(views, n);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) digests[i] = HASH64(views[i].buf, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    release_buffers(views, n);
    PyObject *out = to_list(digests, n);
    PyMem_Free(digests);
    return out;
}

/* Finish sealing `value`, whose first `payload` bytes `state` has hashed: copy `trailer`
 * (`tlen` bytes) right after the payload with the payload's digest at byte `digest_at`
 * (little-endian), and return the XXH3-64 of the whole sealed value. */
static uint64_t seal_after(XXH3_state_t *state, unsigned char *value, Py_ssize_t payload,
                           const unsigned char *trailer, Py_ssize_t tlen, Py_ssize_t digest_at) {
    uint64_t d = XXH3_64bits_digest(state);
    unsigned char *end = value + payload;
    memcpy(end, trailer, (size_t)tlen);
    for (int b = 0; b < 8; b++) end[digest_at + b] = (unsigned char)(d >> (8 * b));
    UPDATE64(state, end, (size_t)tlen);
    return XXH3_64bits_digest(state);
}

PyDoc_STRVAR(seal_doc,
             "seal(values, payload_nbytes, trailers, digest_at, /) -> list[int]\n\n"
             "For each value (writable, C-contiguous): hash its payload (the first\n"
             "`payload_nbytes` bytes), copy trailer i (`trailers` holds one after another,\n"
             "each len(trailers) / len(values) bytes) right after the payload with the\n"
             "payload's XXH3-64 written at byte `digest_at` of it (little-endian), and return\n"
             "the XXH3-64 of each whole sealed value (payload and trailer), from the same\n"
             "pass over the payload. The GIL is released once for all of them.");

static PyObject *seal(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *values, *seq;
    Py_buffer trailers;
    Py_ssize_t payload, digest_at, n = 0;
    if (!PyArg_ParseTuple(args, "Ony*n:seal", &values, &payload, &trailers, &digest_at))
        return NULL;
    seq = PySequence_Fast(values, "values must be a sequence");
    if (seq == NULL) {
        PyBuffer_Release(&trailers);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t tlen = count ? trailers.len / count : 0;
    /* no sums that could overflow: digest_at + 8 and payload + tlen are compared apart */
    if (payload < 0 || (count && trailers.len != tlen * count) || digest_at < 0 ||
        (count && digest_at > tlen - 8) || payload > PY_SSIZE_T_MAX - tlen) {
        PyErr_SetString(PyExc_ValueError, "bad payload size, trailers or digest offset");
        Py_DECREF(seq);
        PyBuffer_Release(&trailers);
        return NULL;
    }
    Py_buffer *views = get_buffers(seq, &n, payload + tlen, 1);
    Py_DECREF(seq);
    if (views == NULL) {
        PyBuffer_Release(&trailers);
        return NULL;
    }
    uint64_t *digests = PyMem_Malloc(n ? (size_t)n * sizeof(uint64_t) : 1);
    XXH3_state_t *state = XXH3_createState();
    if (digests == NULL || state == NULL) {
        PyMem_Free(digests);
        XXH3_freeState(state);
        release_buffers(views, n);
        PyBuffer_Release(&trailers);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char *value = views[i].buf;
        XXH3_64bits_reset(state);
        UPDATE64(state, value, (size_t)payload);
        digests[i] = seal_after(state, value, payload,
                                (const unsigned char *)trailers.buf + i * tlen, tlen, digest_at);
    }
    Py_END_ALLOW_THREADS
    XXH3_freeState(state);
    release_buffers(views, n);
    PyBuffer_Release(&trailers);
    PyObject *out = to_list(digests, n);
    PyMem_Free(digests);
    return out;
}

PyDoc_STRVAR(addresses_doc,
             "addresses(values, /) -> list[int]\n\n"
             "The address of each value's first byte, -1 for a value that is not one\n"
             "contiguous buffer: what ``ndarray.ctypes.data`` gives, at a thirtieth of its\n"
             "cost per value.");

static PyObject *addresses(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *values;
    if (!PyArg_ParseTuple(args, "O:addresses", &values)) return NULL;
    PyObject *seq = PySequence_Fast(values, "values must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        Py_buffer view;
        PyObject *addr = NULL;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &view, PyBUF_C_CONTIGUOUS) == 0) {
            addr = PyLong_FromVoidPtr(view.buf);
            PyBuffer_Release(&view);
        } else { /* not one contiguous buffer */
            PyErr_Clear();
            addr = PyLong_FromLong(-1);
        }
        if (addr == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, addr);
    }
    Py_DECREF(seq);
    return out;
}


/* The cache rows a copy reads or writes: 2-D byte arrays, each row contiguous. */
typedef struct {
    PyObject *seq;
    Py_buffer *bufs;
    Py_ssize_t taken; /* buffers held, released by release_rows */
} Rows;

static void release_rows(Rows *r) {
    for (Py_ssize_t j = 0; j < r->taken; j++) PyBuffer_Release(&r->bufs[j]);
    PyMem_Free(r->bufs);
    Py_XDECREF(r->seq);
}

/* Take the buffers of `rows_obj` (writable ones with `writable`), each a 2-D byte array with
 * contiguous rows holding every one of the `nblocks` `blocks`; then check every piece of
 * `table` (int64 triples: row array, offset, bytes) lies within `limit` bytes of a value and
 * is as wide as its row, and give piece i's row array start and row stride in base[i] and
 * stride[i]. Returns 0, or -1 with an exception set (release_rows either way). */
static int take_rows(Rows *r, PyObject *rows_obj, int writable, const int64_t *blocks,
                     Py_ssize_t nblocks, const Py_buffer *table, Py_ssize_t limit, char **base,
                     Py_ssize_t *stride) {
    r->seq = PySequence_Fast(rows_obj, "rows must be a sequence");
    if (r->seq == NULL) return -1;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(r->seq);
    r->bufs = PyMem_Calloc((size_t)(m > 0 ? m : 1), sizeof(Py_buffer));
    if (r->bufs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    while (r->taken < m) {
        Py_buffer *b = &r->bufs[r->taken];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(r->seq, r->taken), b,
                               PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0)) < 0)
            return -1;
        r->taken++;
        if (b->ndim != 2 || b->itemsize != 1 || b->strides[1] != 1) {
            PyErr_SetString(PyExc_ValueError, "rows must be 2-D byte arrays, each row contiguous");
            return -1;
        }
        for (Py_ssize_t i = 0; i < nblocks; i++) {
            if (blocks[i] < 0 || blocks[i] >= b->shape[0]) {
                PyErr_SetString(PyExc_IndexError, "block out of range");
                return -1;
            }
        }
    }
    const int64_t *t = (const int64_t *)table->buf;
    for (Py_ssize_t i = 0; i < table->len / (Py_ssize_t)(3 * sizeof(int64_t)); i++) {
        int64_t which = t[3 * i], at = t[3 * i + 1], len = t[3 * i + 2];
        if (which < 0 || which >= m || at < 0 || len < 0 || at > limit - len ||
            len != r->bufs[which].shape[1]) {
            PyErr_SetString(PyExc_ValueError, "a piece does not fit its value or row");
            return -1;
        }
        base[i] = (char *)r->bufs[which].buf;
        stride[i] = r->bufs[which].strides[0];
    }
    return 0;
}

/* A value that maps a file (check_place with `mapped`) faults with SIGBUS where the file has
 * shrunk since it was mapped, or a page of it cannot be read: the thread reading it jumps back
 * to check_place instead of the process dying. Any other SIGBUS (a fault outside the value,
 * or a signal sent) goes to the handler there was before, called from on_bus, which stays the
 * process's handler: putting the one before back instead left every other thread reading a
 * mapped value unguarded until the next guard_bus (a signal sent to the process and ignored,
 * say, and then a file that shrank under another thread's read ended the process). Where
 * there was none, the default action: a fault when its instruction runs again, a sent signal
 * raised again. */
static _Thread_local sigjmp_buf *volatile bus_jump;
static _Thread_local const char *volatile bus_from, *volatile bus_to; /* the mapped value */
static _Thread_local volatile int bus_chained; /* on_bus is calling the handler before */
static struct sigaction bus_before;

/* The default action for a SIGBUS not ours: the process ends by it. */
static void bus_default(int sig, const siginfo_t *info) {
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    if (info->si_code <= 0) {
        raise(sig); /* sent, not a fault that happens again when the instruction reruns */
    }
}

static void on_bus(int sig, siginfo_t *info, void *context) {
    sigjmp_buf *jump = bus_jump;
    const char *at = (const char *)info->si_addr;
    if (jump != NULL && info->si_code > 0 && at >= bus_from && at < bus_to) {
        bus_jump = NULL;
        siglongjmp(*jump, 1);
    }
    struct sigaction before = bus_before;
    if (bus_chained || before.sa_handler == SIG_DFL) {
        /* none before, or the one before raised it again having put on_bus back (as
           faulthandler does when it was enabled after the guard) */
        bus_default(sig, info);
        return;
    }
    if (before.sa_handler == SIG_IGN) {
        if (info->si_code > 0) bus_default(sig, info); /* a fault cannot be ignored */
        return;
    }
    if (before.sa_flags & SA_RESETHAND) { /* a handler for one signal only */
        memset(&bus_before, 0, sizeof bus_before);
        bus_before.sa_handler = SIG_DFL;
    }
    /* as the kernel would call it: its mask blocked, and the signal unless SA_NODEFER */
    sigset_t mask, old;
    mask = before.sa_mask;
    if (!(before.sa_flags & SA_NODEFER)) sigaddset(&mask, sig);
    pthread_sigmask(SIG_BLOCK, &mask, &old);
    bus_chained = 1;
    if (before.sa_flags & SA_SIGINFO) {
        before.sa_sigaction(sig, info, context);
    } else {
        before.sa_handler(sig);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL); /* a signal it raised, pending, comes first */
    bus_chained = 0;
}

/* Make on_bus the SIGBUS handler, unless it is (a handler installed since, faulthandler's
 * say, becomes the one it hands other faults to). 0, or -1 with errno set. */
static int guard_bus(void) {
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0) return -1;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_bus) return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_bus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK; /* NODEFER: sigsetjmp(, 0) suffices */
    sigemptyset(&sa.sa_mask);
    bus_before = now;
    return sigaction(SIGBUS, &sa, NULL);
}

/* Whether the trailer `got` (len bytes) matches `want` but for the 8 bytes at digest_at,
 * which with `verify` must hold `digest` (little-endian): 0, or 2 where it does not. */
static int trailer_differs(const unsigned char *got, const unsigned char *want, Py_ssize_t len,
                           Py_ssize_t digest_at, int verify, uint64_t digest) {
    for (Py_ssize_t b = 0; b < len; b++) {
        if (b >= digest_at && b < digest_at + 8) {
            if (verify && got[b] != (unsigned char)(digest >> (8 * (b - digest_at)))) return 2;
        } else if (got[b] != want[b]) {
            return 2;
        }
    }
    return 0;
}

/* What check_place checks and copies. */
typedef struct {
    const unsigned char *v; /* the value, len bytes: payload, then trailer */
    Py_ssize_t len, payload, digest_at, block, n;
    uint64_t checksum;
    const Py_buffer *trailer;
    int verify, whole; /* whole: compare the whole value's XXH3-64 with checksum */
    char **dst;
    const Py_ssize_t *stride;
    const int64_t *t; /* n pieces */
} Place;

#if defined(__SSE2__)
#include <emmintrin.h>
/* Copy n bytes with non-temporal stores where the destination allows (16-byte aligned runs
 * of 64 bytes): the cache rows are not read back here, so their lines are written without
 * being read first and without pushing the value out of the processor's cache. */
static void copy_rows(char *dst, const unsigned char *src, size_t n) {
    size_t head = (size_t)(-(uintptr_t)dst) & 15;
    if (n < 4096 || head > n) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; dst += 64, src += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
}
#define FENCE() _mm_sfence()
#else
#define copy_rows(dst, src, n) memcpy((dst), (src), (n))
#define FENCE() ((void)0)
#endif

/* check_place's work: the value checked, then copied only if it passes (0, 1 or 2). */
static int place(const Place *p) {
    uint64_t digest = 0;
    if (p->whole) {
        XXH3_state_t state;
        XXH3_64bits_reset(&state);
        UPDATE64(&state, p->v, (size_t)p->payload);
        digest = XXH3_64bits_digest(&state);
        UPDATE64(&state, p->v + p->payload, (size_t)(p->len - p->payload));
        if (XXH3_64bits_digest(&state) != p->checksum) return 1;
    } else if (p->verify) {
        digest = HASH64(p->v, (size_t)p->payload);
    }
    if (trailer_differs(p->v + p->payload, p->trailer->buf, p->trailer->len, p->digest_at,
                        p->verify, digest))
        return 2;
    for (Py_ssize_t i = 0; i < p->n; i++)
        copy_rows(p->dst[i] + p->block * p->stride[i], p->v + p->t[3 * i + 1],
                  (size_t)p->t[3 * i + 2]);
    FENCE();
    return 0;
}

/* place() under the SIGBUS guard: 3 where reading the value faulted. */
static int place_guarded(const Place *p) {
    sigjmp_buf jump;
    if (sigsetjmp(jump, 0) != 0) return 3; /* on_bus jumped here and cleared bus_jump */
    bus_from = (const char *)p->v;
    bus_to = (const char *)p->v + p->len;
    bus_jump = &jump;
    int code = place(p);
    bus_jump = NULL;
    return code;
}

PyDoc_STRVAR(check_place_doc,
             "check_place(value, payload_nbytes, checksum, trailer, digest_at, verify, rows,\n"
             "            block, table, mapped=False, whole=True, /) -> int\n\n"
             "Check a fetched value and, only when it passes, copy its pieces into cache block\n"
             "`block`, all with the GIL released once. It passes when its XXH3-64 (all of\n"
             "it) is `checksum` (only with `whole`: without, `checksum` is not compared and\n"
             "the payload is hashed only with `verify`) and the len(trailer) bytes after its\n"
             "first `payload_nbytes`\n"
             "are `trailer`, but for the 8 at `digest_at`: with `verify`, they must hold the\n"
             "payload's XXH3-64 (little-endian); without, they are not compared. `table`\n"
             "holds int64 triples (row array index, offset in the value, bytes): piece\n"
             "value[offset:offset+bytes] goes to rows[index][block], whose width it must fill\n"
             "(2-D byte arrays, each row contiguous). Arguments are checked before anything is\n"
             "hashed. Returns 0 (checked and copied), 1 (the value is not `checksum`: nothing\n"
             "copied) or 2 (the trailer differs: nothing copied).\n\n"
             "With `mapped` (the value maps a file): a read of it that faults (SIGBUS: the\n"
             "file shrank, or a page of it could not be read) returns 3; the block may then\n"
             "hold part of the value.");

static PyObject *check_place(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer value, trailer, table;
    unsigned long long checksum;
    Py_ssize_t payload, digest_at, block;
    int verify, mapped = 0, whole = 1;
    PyObject *rows_obj;
    if (!PyArg_ParseTuple(args, "y*nKy*npOny*|pp:check_place", &value, &payload, &checksum,
                          &trailer, &digest_at, &verify, &rows_obj, &block, &table, &mapped,
                          &whole))
        return NULL;
    PyObject *result = NULL;
    Rows rows = {NULL, NULL, 0};
    const int64_t *t = (const int64_t *)table.buf, at_block = block;
    Py_ssize_t n = table.len / (Py_ssize_t)(3 * sizeof(int64_t));
    char **dst = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(char *));
    Py_ssize_t *stride = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(Py_ssize_t));
    if (dst == NULL || stride == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (table.len % (Py_ssize_t)(3 * sizeof(int64_t)) != 0 || payload < 0 ||
        payload > value.len - trailer.len || digest_at < 0 || digest_at > trailer.len - 8) {
        PyErr_SetString(PyExc_ValueError, "bad table, payload size, trailer or digest offset");
        goto done;
    }
    if (take_rows(&rows, rows_obj, 1, &at_block, 1, &table, value.len, dst, stride) < 0)
        goto done;
    if (mapped && guard_bus() != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    Place p = {value.buf, value.len, payload, digest_at, block, n, (uint64_t)checksum,
               &trailer, verify, whole, dst, stride, t};
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = mapped ? place_guarded(&p) : place(&p);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(code);
done:
    release_rows(&rows);
    PyMem_Free(dst);
    PyMem_Free(stride);
    PyBuffer_Release(&table);
    PyBuffer_Release(&trailer);
    PyBuffer_Release(&value);
    return result;
}

PyDoc_STRVAR(gather_seal_doc,
             "gather_seal(rows, blocks, table, values, payload_nbytes, trailers, digest_at, /)\n"
             "    -> list[int]\n\n"
             "For each value i (writable, C-contiguous): copy cache block blocks[i]'s pieces\n"
             "into it (`table` holds int64 triples (row array index, offset in the value,\n"
             "bytes): rows[index][blocks[i]], whose width it must be, goes to\n"
             "value[offset:offset+bytes]), then seal it as seal() does, and return the\n"
             "XXH3-64 of each whole sealed value. `blocks` is an int64 buffer with one entry\n"
             "per value. Where the pieces lie back to back from offset 0 to `payload_nbytes`,\n"
             "each is hashed right after its copy, while it is still in the processor's cache;\n"
             "otherwise the payload is hashed after all of its pieces are copied. Arguments\n"
             "are checked before anything is copied; the GIL is released once for all.");

static PyObject *gather_seal(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *rows_obj, *values_obj;
    Py_buffer blocks, table, trailers;
    Py_ssize_t payload, digest_at;
    if (!PyArg_ParseTuple(args, "Oy*y*Ony*n:gather_seal", &rows_obj, &blocks, &table,
                          &values_obj, &payload, &trailers, &digest_at))
        return NULL;
    PyObject *result = NULL, *seq = NULL;
    Rows rows = {NULL, NULL, 0};
    Py_buffer *views = NULL;
    Py_ssize_t n = 0;
    const int64_t *t = (const int64_t *)table.buf, *ids = (const int64_t *)blocks.buf;
    Py_ssize_t pieces = table.len / (Py_ssize_t)(3 * sizeof(int64_t));
    char **src = PyMem_Calloc((size_t)(pieces > 0 ? pieces : 1), sizeof(char *));
    Py_ssize_t *stride = PyMem_Calloc((size_t)(pieces > 0 ? pieces : 1), sizeof(Py_ssize_t));
    uint64_t *digests = NULL;
    if (src == NULL || stride == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    seq = PySequence_Fast(values_obj, "values must be a sequence");
    if (seq == NULL) goto done;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t tlen = count ? trailers.len / count : 0;
    if (table.len % (Py_ssize_t)(3 * sizeof(int64_t)) != 0 ||
        blocks.len != count * (Py_ssize_t)sizeof(int64_t) || payload < 0 ||
        (count && trailers.len != tlen * count) || digest_at < 0 ||
        (count && digest_at > tlen - 8) || payload > PY_SSIZE_T_MAX - tlen) {
        PyErr_SetString(PyExc_ValueError,
                        "bad table, blocks, payload size, trailers or digest offset");
        goto done;
    }
    if (take_rows(&rows, rows_obj, 0, ids, count, &table, payload, src, stride) < 0) goto done;
    digests = PyMem_Malloc(count ? (size_t)count * sizeof(uint64_t) : 1);
    if (digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* one pass (each piece hashed after its copy) where the pieces lie back to back */
    int fused = 1;
    int64_t end = 0;
    for (Py_ssize_t i = 0; i < pieces; i++) {
        if (t[3 * i + 1] != end) fused = 0;
        end = t[3 * i + 1] + t[3 * i + 2];
    }
    if (end != payload) fused = 0;
    views = get_buffers(seq, &n, payload + tlen, 1);
    if (views == NULL) goto done;
    if (n != count) { /* taking the rows ran Python code (an iterable's) that changed values */
        PyErr_SetString(PyExc_ValueError, "values changed while the rows were taken");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    XXH3_state_t state;
    for (Py_ssize_t v = 0; v < n; v++) {
        unsigned char *value = views[v].buf;
        XXH3_64bits_reset(&state);
        for (Py_ssize_t i = 0; i < pieces; i++) {
            int64_t at = t[3 * i + 1], len = t[3 * i + 2];
            memcpy(value + at, src[i] + ids[v] * stride[i], (size_t)len);
            if (fused) UPDATE64(&state, value + at, (size_t)len);
        }
        if (!fused) UPDATE64(&state, value, (size_t)payload);
        digests[v] = seal_after(&state, value, payload,
                                (const unsigned char *)trailers.buf + v * tlen, tlen, digest_at);
    }
    Py_END_ALLOW_THREADS
    result = to_list(digests, n);
done:
    if (views != NULL) release_buffers(views, n);
    release_rows(&rows);
    PyMem_Free(src);
    PyMem_Free(stride);
    PyMem_Free(digests);
    Py_XDECREF(seq);
    PyBuffer_Release(&trailers);
    PyBuffer_Release(&table);
    PyBuffer_Release(&blocks);
    return result;
}

static PyMethodDef methods[] = {
    {"payload_digests", payload_digests, METH_VARARGS, payload_digests_doc},
    {"seal", seal, METH_VARARGS, seal_doc},
    {"addresses", addresses, METH_VARARGS, addresses_doc},
    {"check_place", check_place, METH_VARARGS, check_place_doc},
    {"gather_seal", gather_seal, METH_VARARGS, gather_seal_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvpipe._digests",
    "XXH3-64 digests of block values, and their checked copy into a cache, without the GIL.",
    -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__digests(void) { return PyModule_Create(&module); }
