/* kvpipe._digests: the XXH3-64 digests of many block values in one call, without the GIL
 * (and, for the scatter of values lent by a store, their addresses in one call).
 *
 * python-xxhash gives up the GIL for each value it hashes and takes it back after; a copy
 * thread hashing a slice's blocks one call at a time then waits for the GIL once per block,
 * each time until the event loop's thread (or another copy thread) lets go of it: in the
 * memory store's read bench that wait was more than the hashing itself. These functions
 * take every value of a slice, release the GIL once, and hash them all.
 *
 * What a trailer holds and means stays in Python (kvpipe/_blockformat.py): seal() copies a
 * trailer Python packed into each value and writes the payload's digest at the offset it is
 * told.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

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
    if (payload < 0 || (count && trailers.len != tlen * count) || digest_at < 0 ||
        (count && digest_at + 8 > tlen)) {
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
        unsigned char *trailer = value + payload;
        XXH3_64bits_reset(state);
        UPDATE64(state, value, (size_t)payload);
        uint64_t d = XXH3_64bits_digest(state);
        memcpy(trailer, (const unsigned char *)trailers.buf + i * tlen, (size_t)tlen);
        for (int b = 0; b < 8; b++) trailer[digest_at + b] = (unsigned char)(d >> (8 * b));
        UPDATE64(state, trailer, (size_t)tlen);
        digests[i] = XXH3_64bits_digest(state);
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

static PyMethodDef methods[] = {
    {"payload_digests", payload_digests, METH_VARARGS, payload_digests_doc},
    {"seal", seal, METH_VARARGS, seal_doc},
    {"addresses", addresses, METH_VARARGS, addresses_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvpipe._digests",
    "XXH3-64 digests of many block values in one call, without the GIL.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__digests(void) { return PyModule_Create(&module); }
