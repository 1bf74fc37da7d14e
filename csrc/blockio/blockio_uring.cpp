// The io_uring backend: each calling thread takes a ring of `depth` entries from a pool and keeps
// up to `depth` block files' data I/O in flight. The calling thread does the rest of each block
// meanwhile: the temp file's open, the checksum (an xattr-layout write is hashed while its own
// data is in flight; a read is hashed while the next ones are), the header, the rename. Only the
// payload goes through the ring: open/xattr/utime/rename have no asynchronous form worth the
// chain here (futimens has none at all).
#include "blockio.hpp"

#ifdef BLOCKIO_HAVE_URING

#include <cerrno>
#include <cstring>
#include <liburing.h>
#include <mutex>
#include <sys/uio.h>
#include <unordered_set>

namespace blockio {
namespace {

struct Done {  // a completion: whose, and what it returned
    void* job;
    long res;
};

class Uring final : public Backend {
public:
    Uring(int depth, io_uring* first) : depth_(depth) { free_.push_back(first); }
    ~Uring() override {
        for (io_uring* r : free_) {
            io_uring_queue_exit(r);
            delete r;
        }
    }
    const char* name() const override { return "io_uring"; }

    void write(std::vector<WriteJob>& jobs, const Ctx& c) override {
        std::vector<iovec> iov(2 * jobs.size());
        run(jobs.size(),
            [&](size_t i, io_uring_sqe* sqe) -> bool {  // prepare and submit block i
                WriteJob& j = jobs[i];
                if (!write_open(j, c)) return false;
                if (c.inline_hdr) {
                    write_hash(j, c);
                    iov[2 * i] = {j.hdr, HEADER_BYTES};
                    iov[2 * i + 1] = {const_cast<uint8_t*>(j.payload), j.payload_io};
                    io_uring_prep_writev(sqe, j.fd, &iov[2 * i], 2, 0);
                } else {
                    io_uring_prep_write(sqe, j.fd, j.payload, unsigned(j.payload_io), 0);
                }
                io_uring_sqe_set_data(sqe, &j);
                return true;
            },
            [&](void* p) {  // after the submit: an xattr-layout block is hashed while it is written
                WriteJob& j = *static_cast<WriteJob*>(p);
                if (!c.inline_hdr) write_hash(j, c);
            },
            [&](void* p, long res) { write_finish(*static_cast<WriteJob*>(p), c, res); },
            [&](size_t i, int err) {  // the SQE was never taken: the block was opened (and hashed) or not
                WriteJob& j = jobs[i];
                if (j.fd < 0 && j.err == 0 && !write_open(j, c)) return;
                if (j.fd < 0) return;
                write_hash(j, c);
                if (err) write_finish(j, c, -err);
                else write_data_sync(j, c);
            });
    }

    void read(std::vector<ReadJob>& jobs, const Ctx& c) override {
        std::vector<iovec> iov(2 * jobs.size());
        run(jobs.size(),
            [&](size_t i, io_uring_sqe* sqe) -> bool {
                ReadJob& j = jobs[i];
                if (!read_open(j, c)) return false;
                if (c.inline_hdr) {
                    iov[2 * i] = {j.hdr, HEADER_BYTES};
                    iov[2 * i + 1] = {j.dst, j.dst_len};
                    io_uring_prep_readv(sqe, j.fd, &iov[2 * i], 2, 0);
                } else {
                    io_uring_prep_read(sqe, j.fd, j.dst, unsigned(j.dst_len), 0);
                }
                io_uring_sqe_set_data(sqe, &j);
                return true;
            },
            [](void*) {},
            [&](void* p, long res) { read_finish(*static_cast<ReadJob*>(p), c, res); },
            [&](size_t i, int err) {
                ReadJob& j = jobs[i];
                if (j.fd < 0 && j.status == R_OK && !read_open(j, c)) return;
                if (j.fd < 0) return;
                read_finish(j, c, err ? -err : read_data_sync(j, c));
            });
    }

private:
    // prep(i, sqe): open block i and fill its SQE (false: the block already ended);
    // after(job): CPU work once it is submitted; finish(job, res): its completion;
    // sync(i, err): run block i without the ring (err != 0: fail it with err).
    template <class Prep, class After, class Finish, class Sync>
    void run(size_t n, Prep prep, After after, Finish finish, Sync sync) {
        if (n == 0) return;
        io_uring* r = take();
        if (!r) {  // no ring to be had now: the batch runs at depth 1 on this thread
            for (size_t i = 0; i < n; ++i) sync(i, 0);
            return;
        }
        size_t next = 0, inflight = 0;
        bool broken = false;
        std::unordered_set<void*> flying;  // jobs whose I/O the ring holds
        std::vector<Done> ready;
        ready.reserve(size_t(depth_));
        auto fill_one = [&]() {
            while (next < n && inflight < size_t(depth_)) {
                const size_t i = next++;
                io_uring_sqe* sqe = broken ? nullptr : io_uring_get_sqe(r);
                if (!sqe) {
                    sync(i, 0);
                    continue;
                }
                if (!prep(i, sqe)) {  // ended before any I/O: the SQE goes out as a no-op
                    io_uring_prep_nop(sqe);
                    io_uring_sqe_set_data(sqe, nullptr);
                }
                void* job = reinterpret_cast<void*>(uintptr_t(sqe->user_data));
                int s;
                do s = io_uring_submit(r);
                while (s == -EINTR || s == -EAGAIN);
                if (s < 0) {  // the ring is unusable: this block fails, the rest runs without it
                    broken = true;
                    if (job) sync(i, -s);
                    continue;
                }
                ++inflight;
                if (job) {
                    flying.insert(job);
                    after(job);
                }
                return;
            }
        };
        for (size_t k = 0; k < size_t(depth_); ++k) fill_one();
        while (inflight) {
            io_uring_cqe* cqe = nullptr;
            int w;
            do w = io_uring_wait_cqe(r, &cqe);
            while (w == -EINTR || w == -EAGAIN || w == -ETIME);
            if (w < 0) {  // never seen: fail what is in flight; closing the ring cancels its I/O
                for (void* job : flying) finish(job, long(w));
                io_uring_queue_exit(r);
                delete r;
                while (next < n) sync(next++, 0);
                return;
            }
            ready.clear();
            unsigned head, seen = 0;
            io_uring_for_each_cqe(r, head, cqe) {
                ready.push_back({io_uring_cqe_get_data(cqe), long(cqe->res)});
                ++seen;
            }
            io_uring_cq_advance(r, seen);
            inflight -= seen;
            for (const Done& d : ready) {
                fill_one();  // the next block goes out before this one's CPU work
                if (d.job) {
                    flying.erase(d.job);
                    finish(d.job, d.res);
                }
            }
            while (inflight < size_t(depth_) && next < n) fill_one();
        }
        give(r, broken);
    }

    io_uring* take() {
        {
            std::lock_guard<std::mutex> g(m_);
            if (!free_.empty()) {
                io_uring* r = free_.back();
                free_.pop_back();
                return r;
            }
        }
        io_uring* r = new io_uring;
        if (io_uring_queue_init(unsigned(depth_), r, 0) != 0) {
            delete r;
            return nullptr;
        }
        return r;
    }

    void give(io_uring* r, bool broken) {
        if (broken) {
            io_uring_queue_exit(r);
            delete r;
            return;
        }
        std::lock_guard<std::mutex> g(m_);
        free_.push_back(r);
    }

    int depth_;
    std::mutex m_;
    std::vector<io_uring*> free_;
};

}  // namespace

Backend* make_uring(int depth, std::string& why) {
    if (depth < 1) depth = 1;
    io_uring* r = new io_uring;
    const int rc = io_uring_queue_init(unsigned(depth), r, 0);
    if (rc != 0) {
        why = std::string("io_uring_setup refused: ") + strerror(-rc);
        delete r;
        return nullptr;
    }
    io_uring_probe* p = io_uring_get_probe_ring(r);
    const bool ok = p && io_uring_opcode_supported(p, IORING_OP_READV) && io_uring_opcode_supported(p, IORING_OP_WRITEV) &&
                    io_uring_opcode_supported(p, IORING_OP_READ) && io_uring_opcode_supported(p, IORING_OP_WRITE) &&
                    io_uring_opcode_supported(p, IORING_OP_NOP);
    if (p) io_uring_free_probe(p);
    if (!ok) {
        why = "io_uring lacks read/write opcodes (kernel older than 5.6)";
        io_uring_queue_exit(r);
        delete r;
        return nullptr;
    }
    return new Uring(depth, r);
}

}  // namespace blockio

#else  // built without liburing

namespace blockio {
Backend* make_uring(int, std::string& why) {
    why = "built without liburing (apt-get install liburing-dev, then rebuild)";
    return nullptr;
}
}  // namespace blockio

#endif
