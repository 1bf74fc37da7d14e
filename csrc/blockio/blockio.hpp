// Batched block-file I/O for the NVMe tier (issue 34): the per-block steps shared by both
// backends (the io_uring ring, blockio_uring.cpp; the pwritev/preadv thread pool,
// blockio_threads.cpp). One block is one file, exactly as kvstore/tiers/nvme/tier.py writes it:
//
//   write: openat(tmp_dir, tmp, O_CREAT|O_EXCL|O_NOFOLLOW[|O_DIRECT], 0600), or a pooled file
//          opened O_NOFOLLOW|O_NONBLOCK and checked (regular, ours, 0600, one link, the block
//          file's size: anything else is a failure, the wrapper removes it) -> the payload
//          (inline layout: [4 KiB header][payload]) -> xxh3-64 of the payload into the header
//          -> xattr layout: fsetxattr("user.kvstore.hdr", the header's 88 bytes) -> futimens(mtime)
//          -> close -> renameat(tmp_dir, tmp, leaf, name) (the fan-out folder opened with
//          O_NOFOLLOW, made 0700 when missing). Any failure unlinks the temp file.
//   read:  the fan-out folder (never created) -> openat(O_RDONLY|O_NONBLOCK|O_NOFOLLOW[|O_DIRECT])
//          -> fstat (a regular file no larger than the buffer) -> fgetxattr (xattr layout) -> the
//          file -> xxh3-64 of the payload (its length from the header's raw field) -> futimens when
//          the raw header's checksum matches. Python validates the header (fileformat.unpack_header,
//          the tier's checks) and compares checksums: the engine never decides a block is good.
//
// Only the common case is served here: folders and files of this user with modes 0700 / 0600, a
// whole file, a header and checksum that pass. Anything else (a missing file too) is not a
// verdict: the Python wrapper sends that block through the tier's own write or read, which
// counts, fixes or removes it by the tier's rules (kvstore/tiers/nvme/tier.py).
//
// The file format is kvstore/tiers/fileformat.py: the engine knows two offsets of the header (the
// payload checksum at 32, the header checksum over [0, 80) at 80) and nothing else of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace blockio {

constexpr size_t HEADER_BYTES = 4096;  // fileformat.HEADER_BYTES
constexpr size_t HEADER_CORE = 88;     // fileformat.HEADER_CORE: what an xattr file's attribute holds
constexpr size_t OFF_PAYLOAD_LEN = 24, OFF_CHECKSUM = 32, OFF_HEADER_SUM = 80;
constexpr const char* XATTR = "user.kvstore.hdr";

// how a read ended (Python maps each to the tier's counted reason)
enum ReadStatus : int {
    R_OK = 0,         // read whole; checksum computed over `hashed` payload bytes (-1: not hashed)
    R_MISSING = 1,    // leaf folder or file absent (ENOENT)
    R_LEAF_BAD = 2,   // a leaf folder could not be opened, or is not ours / not 0700
    R_OPEN_FAILED = 3,
    R_NOT_A_FILE = 4,
    R_TOO_BIG = 5,    // larger than the buffer: not read (size says how large)
    R_NO_XATTR = 6,   // xattr layout: no header attribute (err says why)
    R_READ_FAILED = 7,
    R_SHORT = 8,      // read returned fewer bytes than the file's size (`got`)
    R_NOT_OURS = 9,   // another user's file, or a mode other than 0600
};

struct Ctx {          // one batch
    int root_fd = -1, tmp_fd = -1;
    bool inline_hdr = false, o_direct = false;
    bool hash = true;  // checksums here (false: the caller packed whole headers / checks reads itself)
};

struct WriteJob {
    const char* name = nullptr;      // "<key hex>.kvb": in the fan-out folder name[0:2]
    const char* tmp_name = nullptr;  // in tmp_fd
    uint8_t* hdr = nullptr;          // HEADER_BYTES (inline) or >= HEADER_CORE (xattr); checksums patched in
    const uint8_t* payload = nullptr;
    size_t payload_len = 0;          // checksummed bytes
    size_t payload_io = 0;           // bytes written (padded to 4 KiB)
    double mtime = 0;
    uint64_t checksum = 0;
    bool reuse = false;              // tmp_name is a pooled file (kvstore/tiers/nvme/pool.py): overwritten
                                     // in place if it is a fit (regular, ours, 0600, one link, the size)
    // out
    int fd = -1;
    int err = 0;                     // 0: stored; else errno
    int stage = 0;                   // 2 open, 3 write, 4 xattr, 5 utime, 6 close, 7 leaf folder or rename
};

struct ReadJob {
    const char* name = nullptr;
    uint8_t* hdr = nullptr;          // >= HEADER_BYTES: the inline header, or the xattr's bytes
    uint8_t* dst = nullptr;
    size_t dst_len = 0;              // payload capacity (padded)
    double mtime = 0;
    // out
    int fd = -1, leaf = -1;
    int status = R_OK, err = 0;
    int64_t size = -1, got = -1, hdr_len = 0, hashed = -1;
    uint64_t checksum = 0;
    size_t want = 0;                 // bytes submitted
};

uint64_t xxh3(const void* p, size_t n);
bool have_xxhash();

// the steps (blockio_steps.cpp); each returns false when the job ended (err/status set)
bool write_open(WriteJob& j, const Ctx& c);                 // tmp file
void write_hash(WriteJob& j, const Ctx& c);                 // payload checksum + header patch
bool write_data_sync(WriteJob& j, const Ctx& c);            // pwritev of [hdr,] payload
void write_finish(WriteJob& j, const Ctx& c, long res);     // res: bytes the data write returned
bool read_open(ReadJob& j, const Ctx& c);                   // leaf, open, fstat, xattr
void read_finish(ReadJob& j, const Ctx& c, long res);       // res: bytes read (or -errno)
long read_data_sync(ReadJob& j, const Ctx& c);

// a backend runs a batch at depth; both are safe to call from several threads at once
class Backend {
public:
    virtual ~Backend() = default;
    virtual void write(std::vector<WriteJob>& jobs, const Ctx& c) = 0;
    virtual void read(std::vector<ReadJob>& jobs, const Ctx& c) = 0;
    virtual const char* name() const = 0;
    virtual uint64_t helped() const { return 0; }  // blocks helper threads took from callers' batches
    virtual uint64_t wait_errors() const { return 0; }  // io_uring waits that failed (each waited again)
};

Backend* make_threads(int depth);
// io_uring, or nullptr with `why` set (not built with liburing, or the kernel refused a ring);
// `threads` - 1 helper threads share a caller's batch (blockio_uring.cpp)
Backend* make_uring(int depth, int threads, std::string& why);

}  // namespace blockio
