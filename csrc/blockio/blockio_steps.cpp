// The per-block steps of a write and a read (see blockio.hpp), shared by both backends.
#include "blockio.hpp"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/xattr.h>
#include <unistd.h>

#ifdef BLOCKIO_HAVE_XXHASH
// Debian's libxxhash picks the widest vector unit at run time (AVX2 here); XXH3_64bits_dispatch
// gives the same value as the scalar XXH3_64bits and as Python's xxhash.xxh3_64_intdigest (the
// XXH3 output is frozen since xxHash 0.8.0; tests/test_blockio.py compares them).
#include <xxh_x86dispatch.h>
#endif

namespace blockio {

uint64_t xxh3(const void* p, size_t n) {
#ifdef BLOCKIO_HAVE_XXHASH
    return XXH3_64bits_dispatch(p, n);
#else
    (void)p; (void)n;
    return 0;
#endif
}

bool have_xxhash() {
#ifdef BLOCKIO_HAVE_XXHASH
    return true;
#else
    return false;
#endif
}

namespace {

constexpr int DIR_FLAGS = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;

void put_le64(uint8_t* p, uint64_t v) {
    for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}

uint64_t get_le64(const uint8_t* p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

// folder.open_subdir's common case: the real folder `nm` in `parent` (never through a symlink),
// ours and 0700, made so when missing and `create`. Returns a descriptor or -errno; -EPERM for a
// folder that is another user's or has another mode (the tier's own path decides what to do).
int open_subdir(int parent, const char* two, bool create) {
    const char nm[3] = {two[0], two[1], 0};
    int fd = openat(parent, nm, DIR_FLAGS);
    if (fd < 0) {
        if (errno != ENOENT || !create) return -errno;
        if (mkdirat(parent, nm, 0700) != 0 && errno != EEXIST) return -errno;
        fd = openat(parent, nm, DIR_FLAGS);
        if (fd < 0) return -errno;
        struct stat st;
        if (fstat(fd, &st) == 0 && st.st_uid == geteuid() && (st.st_mode & 07777) != 0700)
            (void)fchmod(fd, 0700);  // made just now: whatever the umask
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_uid != geteuid() || (st.st_mode & 07777) != 0700) {
        close(fd);
        return -EPERM;
    }
    return fd;
}

// the fan-out folder of a block name ("ab" of "abcd....kvb"): a descriptor or -errno
int open_leaf(int root, const char* name, bool create) { return open_subdir(root, name, create); }

bool plain_name(const char* s, size_t min_len) {  // one path component, no "." or ".."
    if (!s) return false;
    const size_t n = strlen(s);
    return n >= min_len && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

int touch(int fd, double t) {  // os.utime(fd, (t, t)): floor to the nanosecond
    const double s = std::floor(t);
    long ns = long((t - s) * 1e9);
    if (ns > 999999999L) ns = 999999999L;
    const timespec ts[2] = {{time_t(s), ns}, {time_t(s), ns}};
    return futimens(fd, ts);
}

void write_fail(WriteJob& j, const Ctx& c, int err, int stage) {
    j.err = err ? err : EIO;
    j.stage = stage;
    if (j.fd >= 0) {
        close(j.fd);
        j.fd = -1;
    }
    if (stage > 2) unlinkat(c.tmp_fd, j.tmp_name, 0);  // the temp file this job made
}

}  // namespace

bool write_open(WriteJob& j, const Ctx& c) {
    if (!plain_name(j.name, 5) || !plain_name(j.tmp_name, 1)) {
        write_fail(j, c, EINVAL, 2);
        return false;
    }
    const int direct = c.o_direct ? O_DIRECT : 0;
    if (!j.reuse) {
        j.fd = openat(c.tmp_fd, j.tmp_name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | direct, 0600);
        if (j.fd < 0) {
            write_fail(j, c, errno, 2);
            return false;
        }
        return true;
    }
    // a pooled file, overwritten in place: only a fit (pool.py's FilePool.open checks the same)
    j.fd = openat(c.tmp_fd, j.tmp_name, O_WRONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | direct);
    if (j.fd < 0) {
        write_fail(j, c, errno, 2);
        return false;
    }
    struct stat st;
    const size_t size = (c.inline_hdr ? HEADER_BYTES : 0) + j.payload_io;
    if (fstat(j.fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 07777) != 0600 ||
        st.st_nlink != 1 || size_t(st.st_size) != size) {
        write_fail(j, c, EEXIST, 2);  // not written through; the wrapper removes it
        return false;
    }
    return true;
}

void write_hash(WriteJob& j, const Ctx& c) {
    if (!c.hash) return;  // the caller packed the whole header, checksums included
    j.checksum = xxh3(j.payload, j.payload_len);
    put_le64(j.hdr + OFF_CHECKSUM, j.checksum);
    put_le64(j.hdr + OFF_HEADER_SUM, xxh3(j.hdr, OFF_HEADER_SUM));
}

bool write_data_sync(WriteJob& j, const Ctx& c) {
    iovec iov[2] = {{j.hdr, HEADER_BYTES}, {const_cast<uint8_t*>(j.payload), j.payload_io}};
    long res;
    do {
        res = c.inline_hdr ? pwritev(j.fd, iov, 2, 0) : pwrite(j.fd, j.payload, j.payload_io, 0);
    } while (res < 0 && errno == EINTR);
    write_finish(j, c, res < 0 ? -errno : res);
    return j.err == 0;
}

void write_finish(WriteJob& j, const Ctx& c, long res) {
    if (res < 0) return write_fail(j, c, int(-res), 3);
    const size_t hdr = c.inline_hdr ? HEADER_BYTES : 0, total = hdr + j.payload_io;
    size_t done = size_t(res);
    while (done < total) {  // a short write (rare): the rest with plain writes, as the tier does
        const uint8_t* p = done < hdr ? j.hdr + done : j.payload + (done - hdr);
        const size_t len = done < hdr ? hdr - done : total - done;
        const long n = pwrite(j.fd, p, len, off_t(done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return write_fail(j, c, n < 0 ? errno : EIO, 3);
        done += size_t(n);
    }
    if (!c.inline_hdr && fsetxattr(j.fd, XATTR, j.hdr, HEADER_CORE, 0) != 0) return write_fail(j, c, errno, 4);
    if (touch(j.fd, j.mtime) != 0) return write_fail(j, c, errno, 5);
    const int fd = j.fd;
    j.fd = -1;
    if (close(fd) != 0 && errno != EINTR) return write_fail(j, c, errno, 6);
    const int leaf = open_leaf(c.root_fd, j.name, true);
    if (leaf < 0) return write_fail(j, c, -leaf, 7);
    const int rc = renameat(c.tmp_fd, j.tmp_name, leaf, j.name);
    const int e = errno;
    close(leaf);
    if (rc != 0) return write_fail(j, c, e, 7);
    j.err = 0;
}

bool read_open(ReadJob& j, const Ctx& c) {
    if (!plain_name(j.name, 5)) {
        j.status = R_OPEN_FAILED;
        j.err = EINVAL;
        return false;
    }
    j.leaf = open_leaf(c.root_fd, j.name, false);
    if (j.leaf < 0) {
        j.err = -j.leaf;
        j.status = j.err == ENOENT ? R_MISSING : R_LEAF_BAD;
        j.leaf = -1;
        return false;
    }
    const int flags = O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | (c.o_direct ? O_DIRECT : 0);
    j.fd = openat(j.leaf, j.name, flags);
    auto end = [&](int status, int err) {
        j.status = status;
        j.err = err;
        if (j.fd >= 0) close(j.fd);
        close(j.leaf);
        j.fd = j.leaf = -1;
        return false;
    };
    if (j.fd < 0) return end(errno == ENOENT ? R_MISSING : R_OPEN_FAILED, errno);
    struct stat st;
    if (fstat(j.fd, &st) != 0) return end(R_READ_FAILED, errno);
    j.size = int64_t(st.st_size);
    if (!S_ISREG(st.st_mode)) return end(R_NOT_A_FILE, 0);
    if (st.st_uid != geteuid() || (st.st_mode & 07777) != 0600) return end(R_NOT_OURS, 0);
    const size_t hdr = c.inline_hdr ? HEADER_BYTES : 0;
    if (size_t(st.st_size) > hdr + j.dst_len) return end(R_TOO_BIG, 0);
    if (!c.inline_hdr) {
        const ssize_t n = fgetxattr(j.fd, XATTR, j.hdr, HEADER_BYTES);
        if (n < 0) return end(R_NO_XATTR, errno);
        j.hdr_len = n;
    }
    j.want = size_t(st.st_size);
    return true;
}

long read_data_sync(ReadJob& j, const Ctx& c) {
    iovec iov[2] = {{j.hdr, HEADER_BYTES}, {j.dst, j.dst_len}};
    long res;
    do {
        res = c.inline_hdr ? preadv(j.fd, iov, 2, 0) : pread(j.fd, j.dst, j.dst_len, 0);
    } while (res < 0 && errno == EINTR);
    return res < 0 ? -errno : res;
}

void read_finish(ReadJob& j, const Ctx& c, long res) {
    if (res < 0) {
        j.status = R_READ_FAILED;
        j.err = int(-res);
    } else if (size_t(res) != j.want) {
        j.status = R_SHORT;
        j.got = res;
    } else {
        j.got = res;
        size_t avail = size_t(res);
        if (c.inline_hdr) {
            j.hdr_len = int64_t(avail < HEADER_BYTES ? avail : HEADER_BYTES);
            avail = avail > HEADER_BYTES ? avail - HEADER_BYTES : 0;
        }
        if (!c.hash) {
            (void)touch(j.fd, j.mtime);  // the caller checks; a bad file is removed anyway
        } else if (j.hdr_len >= int64_t(OFF_CHECKSUM + 8)) {
            const uint64_t plen = get_le64(j.hdr + OFF_PAYLOAD_LEN);  // raw: Python validates the header
            if (plen <= avail) {
                j.checksum = xxh3(j.dst, size_t(plen));
                j.hashed = int64_t(plen);
                if (j.checksum == get_le64(j.hdr + OFF_CHECKSUM)) (void)touch(j.fd, j.mtime);  // the hit's time
            }
        }
    }
    close(j.fd);
    close(j.leaf);
    j.fd = j.leaf = -1;
}

}  // namespace blockio
