/* kvpipe.backends.file._fileio: read and write many block files in one call, without the GIL.
 *
 * A worker thread that reads a block file from Python goes through the GIL after every
 * system call (open, read, close); beside a busy event loop each of those waits, and for
 * small blocks that, not the disk, sets the pace. read_files() takes a batch of files and
 * their destination buffers, releases the GIL once, and for each file opens it confined to
 * the store's root (openat2 with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
 * RESOLVE_NO_MAGICLINKS, O_NOFOLLOW, O_NONBLOCK so a FIFO cannot block), reads it from
 * offset 0 with preadv until the buffers are full or the file ends, and closes it. With
 * `direct`, a file the page cache holds (cachestat says so) is read from it (preadv2 with
 * RWF_NOWAIT, which stops where a page has gone since) and anything else, or the rest, with
 * O_DIRECT: a block hit again while cached costs a memory copy, one that is not a read from
 * the device that does not go through (nor fill) the cache. read_cached_files() reads only
 * files the page cache holds whole and never waits for the device to read file data.
 * write_files() publishes a batch of files atomically the same way the Python path does
 * (temporary file, fdatasync, rename, directory fsync per durability). Everything else
 * (which files, headers, checksums, what the bytes mean) stays in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef SYS_openat2
#define SYS_openat2 437
#endif

/* Result for something other than a regular file at a block's name. */
#define NOT_REGULAR (-1000000)
/* Result of a cached-only read for a file the page cache does not hold whole. */
#define NOT_CACHED (-1000001)
/* still_block: the file changed since it was opened (renamed, over or away): whatever is at
 * its name now is opened once more, then it reads as missing. */
#define CHANGED (-1000002)
#define MAX_VIEWS 16

static int open_confined(int dir_fd, const char *path, int flags) {
    struct open_how how;
    memset(&how, 0, sizeof how);
    how.flags = (unsigned long long)(flags | O_NOFOLLOW | O_CLOEXEC);
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    return (int)syscall(SYS_openat2, dir_fd, path, &how, sizeof how);
}

/* Whether a block file opened at fd (`st`: its fstat right after the open) may be read: a
 * shared lock keeps a writer reusing the file (a deleted block's, see write_one) out while it
 * is read, and its change time, the same after the lock, says it was not deleted and reused
 * between the open and the lock (a rename changes it). 0; -ENOENT: a writer holds it (read as
 * missing); CHANGED: it changed since the open (a put renamed a new block over its name, or
 * a delete moved it aside), open the name again. Where the file system has no locks, 0 — or,
 * with `must_lock` (a mapping, whose value is checked before it is copied: only the lock
 * keeps it from changing in between), NOT_CACHED: read it instead, and check the copy. */
static long still_block(int fd, const struct stat *st, int must_lock) {
    if (flock(fd, LOCK_SH | LOCK_NB) != 0) {
        if (errno == EWOULDBLOCK) {
            return -ENOENT;
        }
        return must_lock ? NOT_CACHED : 0;
    }
    struct stat now;
    if (fstat(fd, &now) != 0) {
        return -errno;
    }
    if (now.st_ctim.tv_sec != st->st_ctim.tv_sec || now.st_ctim.tv_nsec != st->st_ctim.tv_nsec) {
        return CHANGED;
    }
    return 0;
}

static long not_regular_or(int fd, long err) {
    struct stat st;
    if (fstat(fd, &st) == 0 && !S_ISREG(st.st_mode)) {
        return NOT_REGULAR;
    }
    return err;
}

#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008
#endif
#define PAGE 4096

/* Move the first `n` bytes of iov[*at...cnt) past: whole views are skipped, a partial one is
 * shortened from its start. */
static void advance(struct iovec *iov, int cnt, int *at, size_t n) {
    while (*at < cnt && n >= iov[*at].iov_len) {
        n -= iov[*at].iov_len;
        (*at)++;
    }
    if (*at < cnt && n > 0) {
        iov[*at].iov_base = (char *)iov[*at].iov_base + n;
        iov[*at].iov_len -= n;
    }
}

/* Turn O_DIRECT off on fd: 1, or 0 when it was not on (or could not be). */
static int drop_direct(int fd) {
    int flags = fcntl(fd, F_GETFL);
    return flags >= 0 && (flags & O_DIRECT) && fcntl(fd, F_SETFL, flags & ~O_DIRECT) == 0;
}

/* preadv (or pwritev) from file offset `start` through iov (which starts there) until it is
 * all done or, reading, the file ends: the offset reached, or -errno. A direct write cut
 * short (a full disk) may stop off the device's blocks, and the next one from there fails
 * with EINVAL: not a refusal of direct I/O (the first write passed), so the rest goes through
 * the page cache, where the real error, if any (ENOSPC), shows. */
static long transfer(int fd, struct iovec *iov, int cnt, long start, int writing) {
    long moved = start;
    int at = 0;
    advance(iov, cnt, &at, 0); /* past empty views: a write of nothing (0) reads as -EIO */
    while (at < cnt) {
        ssize_t r = writing ? pwritev(fd, iov + at, cnt - at, moved)
                            : preadv(fd, iov + at, cnt - at, moved);
        if (r < 0) {
            int err = errno;
            if (err == EINTR) {
                continue;
            }
            if (writing && err == EINVAL && moved > start && drop_direct(fd)) {
                continue;
            }
            return -err;
        }
        if (r == 0) {
            if (writing) {
                return -EIO;
            }
            break;
        }
        moved += r;
        advance(iov, cnt, &at, (size_t)r);
    }
    return moved;
}

/* Read from offset 0 only what the page cache holds (preadv2 with RWF_NOWAIT), up to `size`
 * bytes (the file's size) or until iov is full. The bytes read (iov then starts past them),
 * or -errno; *complete: nothing more to read (the file or iov ended), rather than the cache
 * running out (or the file system not reading without waiting). */
static long read_cached(int fd, struct iovec *iov, int cnt, long size, int *complete) {
    long moved = 0;
    int at = 0;
    *complete = 0;
    while (at < cnt && moved < size) {
        ssize_t r = preadv2(fd, iov + at, cnt - at, moved, RWF_NOWAIT);
        if (r < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno == EAGAIN || errno == EOPNOTSUPP || errno == EINVAL) {
                return moved; /* not cached (or no RWF_NOWAIT here): read the rest */
            }
            return -errno;
        }
        if (r == 0) {
            break;
        }
        moved += r;
        advance(iov, cnt, &at, (size_t)r);
    }
    *complete = 1;
    return moved;
}

#ifndef SYS_cachestat
#define SYS_cachestat 451
#endif
struct kv_cachestat_range {
    unsigned long long off, len;
};
struct kv_cachestat {
    unsigned long long nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

/* Whether the page cache may hold all of the file open at fd, `size` bytes: cachestat
 * (Linux >= 6.5) counts its cached pages without reading any in. Where the call is missing
 * or fails, !strict (not strict: the caller then finds out by reading with RWF_NOWAIT, which
 * starts a read-ahead of what it does not find: avoided here, as the rest is read directly
 * anyway). */
static int all_cached(int fd, long size, int strict) {
    static volatile int missing = 0;
    if (missing) {
        return !strict;
    }
    struct kv_cachestat_range range = {0, 0};
    struct kv_cachestat cs;
    if (syscall(SYS_cachestat, fd, &range, &cs, 0) != 0) {
        if (errno == ENOSYS) {
            missing = 1; /* not EPERM: newer kernels refuse it per file (one not writable) */
        }
        return !strict;
    }
    long page = sysconf(_SC_PAGESIZE); /* cachestat counts the kernel's pages */
    long pages = (size + page - 1) / page;
    return cs.nr_cache >= (unsigned long long)pages;
}

/* One file: bytes read (>= 0), NOT_REGULAR, or -errno. Opened through the page cache: with
 * `direct`, what the cache holds is read from it and the rest with O_DIRECT from the last
 * page boundary reached (every view's address and length must then suit the device);
 * without, the rest is read through the cache as well. -EINVAL: direct I/O refused. */
static long read_one(int dir_fd, const char *path, struct iovec *iov, int cnt, int direct) {
    int flags = O_RDONLY | O_NONBLOCK;
    int fd = open_confined(dir_fd, path, flags);
    if (fd < 0) {
        return -errno;
    }
    struct stat st;
    long got;
    if (fstat(fd, &st) != 0) {
        got = -errno;
    } else if (!S_ISREG(st.st_mode)) {
        got = NOT_REGULAR;
    } else if ((got = still_block(fd, &st, 0)) != 0) {
        /* -ENOENT, CHANGED or -errno */
    } else if (!direct) {
        got = transfer(fd, iov, cnt, 0, 0);
    } else {
        struct iovec whole[MAX_VIEWS];
        memcpy(whole, iov, (size_t)cnt * sizeof *iov);
        int complete = 0;
        got = all_cached(fd, (long)st.st_size, 0) ? read_cached(fd, iov, cnt, (long)st.st_size,
                                                             &complete)
                                               : 0;
        if (got >= 0 && !complete) {
            long from = got / PAGE * PAGE;
            int at = 0;
            advance(whole, cnt, &at, (size_t)from);
            if (fcntl(fd, F_SETFL, flags | O_DIRECT) != 0) {
                got = -errno;
            } else {
                got = transfer(fd, whole + at, cnt - at, from, 0);
            }
        }
    }
    if (got < 0 && got != NOT_REGULAR && got != CHANGED) {
        got = not_regular_or(fd, got);
    }
    close(fd);
    return got;
}

/* read_one, the name opened once more where the file changed under the first open. */
static long read_one_again(int dir_fd, const char *path, struct iovec *iov, int cnt,
                           int direct) {
    long got = read_one(dir_fd, path, iov, cnt, direct);
    if (got == CHANGED) {
        got = read_one(dir_fd, path, iov, cnt, direct);
    }
    return got == CHANGED ? -ENOENT : got;
}

/* Open block file `path` if it is a regular file that the page cache holds whole, with a
 * shared lock on it (still_block): the descriptor, its size in *size; or NOT_CACHED,
 * NOT_REGULAR or -errno, nothing left open. `strict`: where cachestat is missing, NOT_CACHED
 * (else the caller finds out by reading). */
static long open_cached_once(int dir_fd, const char *path, long *size, int strict) {
    int fd = open_confined(dir_fd, path, O_RDONLY | O_NONBLOCK);
    if (fd < 0) {
        return -errno;
    }
    struct stat st;
    long got = 0;
    if (fstat(fd, &st) != 0) {
        got = -errno;
    } else if (!S_ISREG(st.st_mode)) {
        got = NOT_REGULAR;
    } else if ((got = still_block(fd, &st, strict)) != 0) {
        got = got == CHANGED ? got : not_regular_or(fd, got);
    } else if (!all_cached(fd, (long)st.st_size, strict)) {
        got = NOT_CACHED;
    }
    if (got != 0) {
        close(fd);
        return got;
    }
    *size = (long)st.st_size;
    return fd;
}

/* open_cached_once, the name opened once more where the file changed under the first open
 * (then -ENOENT). */
static long open_cached_fd(int dir_fd, const char *path, long *size, int strict) {
    long got = open_cached_once(dir_fd, path, size, strict);
    if (got == CHANGED) {
        got = open_cached_once(dir_fd, path, size, strict);
    }
    return got == CHANGED ? -ENOENT : got;
}

/* One file, only if the page cache holds all of it (read_cached_files): bytes read
 * (>= 0), NOT_CACHED (the views may hold part of it), NOT_REGULAR, or -errno. Never waits for
 * the device to read file data. */
static long read_one_cached(int dir_fd, const char *path, struct iovec *iov, int cnt) {
    long size = 0, fd = open_cached_fd(dir_fd, path, &size, 0);
    if (fd < 0) {
        return fd;
    }
    int complete = 0;
    long got = read_cached((int)fd, iov, cnt, size, &complete);
    if (got >= 0 && !complete) {
        got = NOT_CACHED;
    } else if (got < 0) {
        got = not_regular_or((int)fd, got);
    }
    close((int)fd);
    return got;
}

/* Take the buffers of sequence `item` (at most MAX_VIEWS) into bufs[*nbufs...] and `iov`;
 * their number into *count. -1 with an exception set on error (what was taken stays counted
 * in *nbufs, for the caller to release). */
static int take_buffers(PyObject *item, int flags, Py_buffer *bufs, Py_ssize_t *nbufs,
                        struct iovec *iov, int *count) {
    PyObject *seq = PySequence_Fast(item, "each file's buffers must be a sequence");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    if (m > MAX_VIEWS) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many buffers for one file");
        return -1;
    }
    for (Py_ssize_t j = 0; j < m; j++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, j), &bufs[*nbufs], flags) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        iov[j].iov_base = bufs[*nbufs].buf;
        iov[j].iov_len = (size_t)bufs[*nbufs].len;
        (*nbufs)++;
    }
    *count = (int)m;
    Py_DECREF(seq);
    return 0;
}

/* The bytes of path `item` into *out; -1 with an exception set when it is not bytes. */
static int take_path(PyObject *item, const char **out) {
    if (!PyBytes_Check(item)) {
        PyErr_SetString(PyExc_TypeError, "paths must be bytes");
        return -1;
    }
    *out = PyBytes_AS_STRING(item);
    return 0;
}

/* A list of n ints from `values`; NULL with an exception set on error. */
static PyObject *int_list(const long *values, Py_ssize_t n) {
    PyObject *result = PyList_New(n);
    if (result == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLong(values[i]);
        if (v == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        PyList_SET_ITEM(result, i, v);
    }
    return result;
}

PyDoc_STRVAR(read_files_doc,
"read_files(dir_fd, paths, views, direct) -> list[int]\n\n"
"Read each file paths[i] (relative to dir_fd, never through a symbolic link or out of it)\n"
"from offset 0 into the writable buffers views[i], in order, until they are full or the file\n"
"ends. Per file: the bytes read, -errno, or NOT_REGULAR. direct: read what the page cache\n"
"does not hold with O_DIRECT (every buffer's address and length must then be whole pages;\n"
"-EINVAL: the file system refused). The GIL is released throughout.");

PyDoc_STRVAR(read_cached_files_doc,
"read_cached_files(dir_fd, paths, views) -> list[int]\n\n"
"As read_files, but a file only if the page cache holds all of it, never waiting for the\n"
"device to read file data: NOT_CACHED where it does not (its views may then hold part of\n"
"it). The GIL is released throughout.");

/* A tuple of what `obj` holds now (NULL with an exception set). The calls below keep
 * pointers into their paths' bytes while the GIL is released, and taking a file's buffers
 * may run Python code (an iterable's): a list they were given, changed meanwhile (by that
 * code, or by another thread once the GIL is released), would drop the paths they use. */
static PyObject *snapshot(PyObject *obj, const char *what) {
    PyObject *t = PySequence_Tuple(obj);
    if (t == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Format(PyExc_TypeError, "%s must be a sequence", what);
    }
    return t;
}

/* read_files and read_cached_files (cached_only), their arguments parsed. */
static PyObject *read_many(int dir_fd, PyObject *paths_obj, PyObject *views_obj, int direct,
                           int cached_only) {
    PyObject *paths = snapshot(paths_obj, "paths");
    if (paths == NULL) {
        return NULL;
    }
    PyObject *views = snapshot(views_obj, "views");
    if (views == NULL) {
        Py_DECREF(paths);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(paths);
    PyObject *result = NULL;
    const char **cpaths = NULL;
    struct iovec *iov = NULL;
    int *counts = NULL;
    long *got = NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t nbufs = 0;

    if (PySequence_Fast_GET_SIZE(views) != n) {
        PyErr_SetString(PyExc_ValueError, "one list of views per path");
        goto done;
    }
    cpaths = calloc((size_t)n + 1, sizeof *cpaths);
    iov = calloc((size_t)n * MAX_VIEWS + 1, sizeof *iov);
    counts = calloc((size_t)n + 1, sizeof *counts);
    got = calloc((size_t)n + 1, sizeof *got);
    bufs = calloc((size_t)n * MAX_VIEWS + 1, sizeof *bufs);
    if (!cpaths || !iov || !counts || !got || !bufs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (take_path(PySequence_Fast_GET_ITEM(paths, i), &cpaths[i]) < 0) {
            goto done;
        }
        if (take_buffers(PySequence_Fast_GET_ITEM(views, i), PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS,
                         bufs, &nbufs, iov + i * MAX_VIEWS, &counts[i]) < 0) {
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        got[i] = cached_only ? read_one_cached(dir_fd, cpaths[i], iov + i * MAX_VIEWS, counts[i])
                             : read_one_again(dir_fd, cpaths[i], iov + i * MAX_VIEWS, counts[i],
                                              direct);
    }
    Py_END_ALLOW_THREADS
    result = int_list(got, n);
done:
    for (Py_ssize_t k = 0; k < nbufs; k++) {
        PyBuffer_Release(&bufs[k]);
    }
    free(cpaths);
    free(iov);
    free(counts);
    free(got);
    free(bufs);
    Py_DECREF(paths);
    Py_DECREF(views);
    return result;
}

PyDoc_STRVAR(file_sizes_doc,
"file_sizes(dir_fd, paths, stop_at_missing) -> list[int]\n\n"
"The size of each of paths (relative to dir_fd, never through a symbolic link or out of it)\n"
"that is a regular file; -1 for one that is not (missing, a link, a directory...); -1 - errno\n"
"for one that could not be looked at (EMFILE, EACCES, EIO...: it may be there). With\n"
"stop_at_missing, every path after the first that is not known to be one is answered -1\n"
"without being looked at. The GIL is released throughout.");

static PyObject *file_sizes(PyObject *self, PyObject *args) {
    (void)self;
    int dir_fd, stop;
    PyObject *paths_obj;
    if (!PyArg_ParseTuple(args, "iOp", &dir_fd, &paths_obj, &stop)) {
        return NULL;
    }
    PyObject *paths = snapshot(paths_obj, "paths");
    if (paths == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(paths);
    const char **cpaths = calloc((size_t)n + 1, sizeof *cpaths);
    long long *sizes = calloc((size_t)n + 1, sizeof *sizes);
    PyObject *result = NULL;
    if (!cpaths || !sizes) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        sizes[i] = -1;
        if (take_path(PySequence_Fast_GET_ITEM(paths, i), &cpaths[i]) < 0) {
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int fd = open_confined(dir_fd, cpaths[i], O_PATH);
        if (fd < 0) {
            /* Only a path that is not there, or not a regular file inside the root, is -1:
             * EMFILE, EACCES, EIO... say nothing about the file. */
            int err = errno;
            if (err != ENOENT && err != ENOTDIR && err != ELOOP && err != EXDEV) {
                sizes[i] = -1 - (long long)err;
            }
        } else {
            struct stat st;
            if (fstat(fd, &st) != 0) {
                sizes[i] = -1 - (long long)errno;
            } else if (S_ISREG(st.st_mode)) {
                sizes[i] = (long long)st.st_size;
            }
            close(fd);
        }
        if (stop && sizes[i] < 0) {
            break;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(sizes[i]);
        if (v == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, v);
    }
done:
    free(cpaths);
    free(sizes);
    Py_DECREF(paths);
    return result;
}

/* One file: 0 published, ABANDONED, or -errno (nothing published, no temporary file left);
 * or UNSYNCED + errno: published (it cannot be taken back), then the directory's fsync failed. */
#define ABANDONED 1
#define UNSYNCED 0x10000

/* The directory of `path` (beneath dir_fd, opened confined) and, in *name, its last part. */
static int open_parent(int dir_fd, const char *path, const char **name) {
    const char *slash = strrchr(path, '/');
    char dir[4096];
    size_t n = slash ? (size_t)(slash - path) : 0;
    if (!slash || n >= sizeof dir) {
        errno = EINVAL;
        return -1;
    }
    memcpy(dir, path, n);
    dir[n] = 0;
    *name = slash + 1;
    return open_confined(dir_fd, dir, O_RDONLY | O_DIRECTORY);
}

/* Take the deleted block file at `spare` (a path beneath dir_fd: directory, then one of the
 * store's temporary names) for a new block, moved to `tmp` in dfd: opened for writing and
 * locked exclusively, so that no reader is reading it (a reader holds a shared lock: see
 * still_block) and none starts until it is published again. The descriptor, or -1 when it
 * cannot be had (gone, being read, or on a file system without locks, where no reader could
 * be seen: then it is let go of, a reader keeps what it opened). */
static int claim_spare(int dir_fd, const char *spare, int dfd, const char *tmp, int direct) {
    const char *name;
    int sdfd = open_parent(dir_fd, spare, &name);
    if (sdfd < 0) {
        return -1;
    }
    /* O_NONBLOCK: something else put at its name, a FIFO, must not keep the open waiting */
    int fd = openat(sdfd, name,
                    O_WRONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | (direct ? O_DIRECT : 0));
    struct stat st;
    if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
                    fcntl(fd, F_SETFL, direct ? O_DIRECT : 0) != 0)) { /* a block file, blocking */
        close(fd);
        fd = -1;
    }
    if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) != 0) { /* read, or no locks here: not reused */
        close(fd);
        fd = -1;
    }
    if (fd >= 0 && renameat(sdfd, name, dfd, tmp) != 0) {
        close(fd);
        fd = -1;
    }
    if (fd < 0) {
        unlinkat(sdfd, name, 0);
    }
    close(sdfd);
    return fd;
}

/* Remove the spare at `spare` (beneath dir_fd) that a file did not use. */
static void drop_spare(int dir_fd, const char *spare) {
    const char *name;
    int sdfd = open_parent(dir_fd, spare, &name);
    if (sdfd >= 0) {
        unlinkat(sdfd, name, 0);
        close(sdfd);
    }
}

/* Whether `s` is one path component, as the Python path checks its names (_fs._check):
 * the directory is opened confined, but a temporary or final name is used as it is, beside
 * it (a '/' or "..": out of the store, or through a link). */
static int is_name(const char *s) {
    return s[0] != 0 && strchr(s, '/') == NULL && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

static long write_one(int dir_fd, const char *dir, const char *tmp, const char *name,
                      const char *spare, struct iovec *iov, int cnt, int durability, int direct,
                      volatile const char *abandoned) {
    int dfd = is_name(tmp) && is_name(name) ? open_confined(dir_fd, dir, O_RDONLY | O_DIRECTORY)
                                            : (errno = EINVAL, -1);
    if (dfd < 0) {
        long err = -errno;
        if (spare) {
            drop_spare(dir_fd, spare);
        }
        return err;
    }
    long out = 0;
    int fd = spare ? claim_spare(dir_fd, spare, dfd, tmp, direct) : -1;
    int reused = fd >= 0;
    if (reused) {
        futimens(fd, NULL); /* a fresh temporary file to anyone sweeping stale ones */
    } else {
        fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC |
                    (direct ? O_DIRECT : 0), 0600);
    }
    if (fd < 0) {
        out = -errno;
        if (direct && out == -EINVAL) {
            /* a file system without O_DIRECT (ramfs; tmpfs before Linux 6.6) refuses it
               only after creating the file (O_EXCL: it can only be ours) */
            unlinkat(dfd, tmp, 0);
        }
        close(dfd);
        return out;
    }
    long moved = transfer(fd, iov, cnt, 0, 1);
    struct stat st;
    if (moved < 0) {
        out = moved;
    } else if (reused && (fstat(fd, &st) != 0 || st.st_size > moved) &&
               ftruncate(fd, moved) != 0) {
        out = -errno; /* a reused file longer than this block (or of a size unknown) */
    }
    if (out == 0 && durability >= 1 && fdatasync(fd) != 0) {
        out = -errno;
    }
    if (reused) {
        /* The lock belongs to the open file description, which a process forked meanwhile
           (without exec: O_CLOEXEC does not apply) shares: close would leave it held by
           that child, and the block published below would read as missing everywhere until
           the child exits. */
        flock(fd, LOCK_UN);
    }
    if (close(fd) != 0 && out == 0) {
        out = -errno;
    }
    if (out == 0 && *abandoned) {
        out = ABANDONED;
    }
    if (out == 0 && renameat(dfd, tmp, dfd, name) != 0) {
        out = -errno;
    }
    if (out != 0) {
        unlinkat(dfd, tmp, 0);
    } else if (durability >= 2 && fsync(dfd) != 0) {
        out = UNSYNCED + errno; /* published, but the directory may not be durable */
    }
    close(dfd);
    return out;
}

PyDoc_STRVAR(write_files_doc,
"write_files(dir_fd, dirs, temps, names, chunks, durability, direct, abandoned, spares=None)\n"
"-> list[int]\n\n"
"Publish each file atomically: write chunks[i] into dirs[i]/temps[i] (created 0600, never\n"
"through a link; dirs[i] beneath dir_fd), fdatasync it (durability >= 1), rename it over\n"
"dirs[i]/names[i], and with durability 2 fsync the directory (-EINVAL: temps[i] or names[i]\n"
"is not a name in it, one path component). When abandoned[0] is set the\n"
"file is removed instead of published. spares[i], None or a path beneath dir_fd: a deleted\n"
"block file to reuse as the temporary file (overwritten in place, cut to length; skipped\n"
"while a reader holds it); it is used or removed either way. Per file: 0, ABANDONED,\n"
"-errno (a file not published leaves no temporary file), or UNSYNCED + errno (published,\n"
"then the directory's fsync failed). The GIL is released throughout.");

static PyObject *write_files(PyObject *self, PyObject *args) {
    (void)self;
    int dir_fd, durability, direct;
    PyObject *dirs_obj, *temps_obj, *names_obj, *chunks_obj, *abandoned_obj, *spares_obj = Py_None;
    if (!PyArg_ParseTuple(args, "iOOOOipO|O", &dir_fd, &dirs_obj, &temps_obj, &names_obj,
                          &chunks_obj, &durability, &direct, &abandoned_obj, &spares_obj)) {
        return NULL;
    }
    Py_buffer flag;
    if (PyObject_GetBuffer(abandoned_obj, &flag, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    /* the four paths of a file (spares[i] may be None), then its chunks */
    PyObject *seqs[5] = {NULL, NULL, NULL, NULL, NULL};
    PyObject *objs[5] = {dirs_obj, temps_obj, names_obj, spares_obj, chunks_obj};
    PyObject *result = NULL;
    const char **strs = NULL;
    struct iovec *iov = NULL;
    int *counts = NULL;
    long *codes = NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t nbufs = 0, n = 0;
    if (flag.len < 1) {
        PyErr_SetString(PyExc_ValueError, "abandoned must hold a byte");
        goto done;
    }
    if (spares_obj == Py_None) { /* none to reuse: one None per file */
        objs[3] = dirs_obj;
    }
    for (int k = 0; k < 5; k++) {
        seqs[k] = snapshot(objs[k], "dirs, temps, names, spares and chunks");
        if (seqs[k] == NULL) {
            goto done;
        }
    }
    n = PySequence_Fast_GET_SIZE(seqs[0]);
    for (int k = 1; k < 5; k++) {
        if (PySequence_Fast_GET_SIZE(seqs[k]) != n) {
            PyErr_SetString(PyExc_ValueError, "dirs, temps, names, spares and chunks differ in length");
            goto done;
        }
    }
    strs = calloc(4 * (size_t)n + 1, sizeof *strs);
    iov = calloc((size_t)n * MAX_VIEWS + 1, sizeof *iov);
    counts = calloc((size_t)n + 1, sizeof *counts);
    codes = calloc((size_t)n + 1, sizeof *codes);
    bufs = calloc((size_t)n * MAX_VIEWS + 1, sizeof *bufs);
    if (!strs || !iov || !counts || !codes || !bufs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        for (int k = 0; k < 4; k++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seqs[k], i);
            if (k == 3 && (item == Py_None || spares_obj == Py_None)) {
                strs[4 * i + k] = NULL;
            } else if (take_path(item, &strs[4 * i + k]) < 0) {
                goto done;
            }
        }
        if (take_buffers(PySequence_Fast_GET_ITEM(seqs[4], i), PyBUF_C_CONTIGUOUS, bufs, &nbufs,
                         iov + i * MAX_VIEWS, &counts[i]) < 0) {
            goto done;
        }
    }
    volatile const char *abandoned = (volatile const char *)flag.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const char **at = strs + 4 * i;
        if (*abandoned) {
            codes[i] = ABANDONED;
            if (at[3]) {
                drop_spare(dir_fd, at[3]);
            }
        } else {
            codes[i] = write_one(dir_fd, at[0], at[1], at[2], at[3], iov + i * MAX_VIEWS,
                                 counts[i], durability, direct, abandoned);
        }
    }
    Py_END_ALLOW_THREADS
    result = int_list(codes, n);
done:
    for (Py_ssize_t k = 0; k < nbufs; k++) {
        PyBuffer_Release(&bufs[k]);
    }
    PyBuffer_Release(&flag);
    for (int k = 0; k < 5; k++) {
        Py_XDECREF(seqs[k]);
    }
    free(strs);
    free(iov);
    free(counts);
    free(codes);
    free(bufs);
    return result;
}

static PyObject *read_files(PyObject *self, PyObject *args) {
    (void)self;
    int dir_fd, direct;
    PyObject *paths_obj, *views_obj;
    if (!PyArg_ParseTuple(args, "iOOp", &dir_fd, &paths_obj, &views_obj, &direct)) {
        return NULL;
    }
    return read_many(dir_fd, paths_obj, views_obj, direct, 0);
}

static PyObject *read_cached_files(PyObject *self, PyObject *args) {
    (void)self;
    int dir_fd;
    PyObject *paths_obj, *views_obj;
    if (!PyArg_ParseTuple(args, "iOO", &dir_fd, &paths_obj, &views_obj)) {
        return NULL;
    }
    return read_many(dir_fd, paths_obj, views_obj, 0, 1);
}

PyDoc_STRVAR(open_cached_doc,
             "open_cached(dir_fd, path, /) -> tuple[int, int]\n\n"
             "Open block file `path` (bytes, beneath dir_fd, confined as read_files does)\n"
             "read-only, with a shared lock on it, if it is a regular file that the page cache\n"
             "holds whole (cachestat says so; where that call is missing, never) and it can be\n"
             "locked: (descriptor, size). Else (NOT_CACHED, 0), (NOT_REGULAR, 0) or (-errno,\n"
             "0), nothing left open.\n"
             "The lock goes with the last descriptor of the open file (a mapping's included).");

static PyObject *open_cached(PyObject *self, PyObject *args) {
    (void)self;
    int dir_fd;
    PyObject *path_obj;
    const char *path;
    if (!PyArg_ParseTuple(args, "iO:open_cached", &dir_fd, &path_obj) ||
        take_path(path_obj, &path) < 0) {
        return NULL;
    }
    long size = 0, got;
    Py_BEGIN_ALLOW_THREADS
    got = open_cached_fd(dir_fd, path, &size, 1);
    Py_END_ALLOW_THREADS
    PyObject *r = Py_BuildValue("ll", got, size);
    if (r == NULL && got >= 0) {
        close((int)got);
    }
    return r;
}

static PyMethodDef methods[] = {
    {"open_cached", open_cached, METH_VARARGS, open_cached_doc},
    {"write_files", write_files, METH_VARARGS, write_files_doc},
    {"read_files", read_files, METH_VARARGS, read_files_doc},
    {"read_cached_files", read_cached_files, METH_VARARGS, read_cached_files_doc},
    {"file_sizes", file_sizes, METH_VARARGS, file_sizes_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fileio",
    "Batched, confined block-file reads without the GIL (see read_files).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fileio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "NOT_REGULAR", NOT_REGULAR) < 0 ||
        PyModule_AddIntConstant(m, "MAX_VIEWS", MAX_VIEWS) < 0 ||
        PyModule_AddIntConstant(m, "NOT_CACHED", NOT_CACHED) < 0 ||
        PyModule_AddIntConstant(m, "ABANDONED", ABANDONED) < 0 ||
        PyModule_AddIntConstant(m, "UNSYNCED", UNSYNCED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
