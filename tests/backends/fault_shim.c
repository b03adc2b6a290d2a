/* A fault injector for the C extension's tests, preloaded (LD_PRELOAD) into a child Python:
 * it wraps the libc calls _fileio makes, to hit a window or a failure deterministically.
 * Each knob is an environment variable and fires once.
 *
 * KVPIPE_FAULT_RENAME="FROM\tTO": at the first shared flock (a reader between its open and
 *     its check), rename FROM over TO (absolute paths), past the file system's time tick.
 * KVPIPE_FAULT_FSTAT_AFTER_WRITE=1: the first fstat after a pwritev fails with EIO.
 * KVPIPE_FAULT_SHORT_DIRECT=1: the first pwritev to an O_DIRECT file writes only one page
 *     and 100 bytes (through the page cache), as a write cut short by a full disk can; and
 *     from then on a pwritev to an O_DIRECT file at an offset off a 512-byte boundary fails
 *     with EINVAL, as on a device that needs its blocks aligned. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static int renamed, wrote, fstat_failed, shortened;

int flock(int fd, int op) {
    int (*real)(int, int) = (int (*)(int, int))dlsym(RTLD_NEXT, "flock");
    const char *spec = getenv("KVPIPE_FAULT_RENAME");
    if (spec && !renamed && (op & LOCK_SH)) {
        renamed = 1;
        char buf[8192];
        snprintf(buf, sizeof buf, "%s", spec);
        char *tab = strchr(buf, '\t');
        if (tab) {
            *tab = 0;
            struct timespec tick = {0, 20 * 1000 * 1000};
            nanosleep(&tick, NULL);
            if (rename(buf, tab + 1) != 0) {
                abort();
            }
        }
    }
    return real(fd, op);
}

static int fail_fstat(void) {
    if (getenv("KVPIPE_FAULT_FSTAT_AFTER_WRITE") && wrote && !fstat_failed) {
        fstat_failed = 1;
        errno = EIO;
        return 1;
    }
    return 0;
}

int fstat64(int fd, struct stat64 *st) {
    int (*real)(int, struct stat64 *) =
        (int (*)(int, struct stat64 *))dlsym(RTLD_NEXT, "fstat64");
    return fail_fstat() ? -1 : real(fd, st);
}

int fstat(int fd, struct stat *st) {
    int (*real)(int, struct stat *) = (int (*)(int, struct stat *))dlsym(RTLD_NEXT, "fstat");
    return fail_fstat() ? -1 : real(fd, st);
}

ssize_t pwritev64(int fd, const struct iovec *iov, int cnt, off_t at) {
    ssize_t (*real)(int, const struct iovec *, int, off_t) =
        (ssize_t (*)(int, const struct iovec *, int, off_t))dlsym(RTLD_NEXT, "pwritev64");
    wrote = 1;
    int flags = fcntl(fd, F_GETFL);
    if (getenv("KVPIPE_FAULT_SHORT_DIRECT") && !shortened && flags >= 0 && (flags & O_DIRECT)) {
        shortened = 1;
        struct iovec part[64];
        size_t want = 4096 + 100, have = 0;
        int n = 0;
        for (; n < cnt && n < 64 && have < want; n++) {
            part[n] = iov[n];
            if (part[n].iov_len > want - have) {
                part[n].iov_len = want - have;
            }
            have += part[n].iov_len;
        }
        fcntl(fd, F_SETFL, flags & ~O_DIRECT);
        ssize_t r = real(fd, part, n, at);
        fcntl(fd, F_SETFL, flags);
        return r;
    }
    if (getenv("KVPIPE_FAULT_SHORT_DIRECT") && flags >= 0 && (flags & O_DIRECT) && at % 512) {
        errno = EINVAL;
        return -1;
    }
    return real(fd, iov, cnt, at);
}

ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t at) {
    return pwritev64(fd, iov, cnt, at);
}
