// The io_uring backend: each calling thread takes a ring of `depth` entries from a pool and keeps
// up to `depth` block files' data I/O in flight. `threads` - 1 helper threads join a batch on
// rings of their own while fewer than `threads` rings are busy in all: every thread takes the next
// block from one shared cursor, so they end together (a batch cut into fixed parts on Python's
// pool ended with the slowest part, the parts started one GIL hand-off apart: at 2 MiB blocks,
// calls of 32, the last part started 0.38 ms after the first, the parts ended 0.3-0.5 ms apart,
// and 0.3 ms of Python ran before the first I/O, each of a 16 ms call). A thread does the rest of
// each block meanwhile: the temp file's open, the checksum (an xattr-layout write is hashed while its own
// data is in flight; a read is hashed while the next ones are), the header, the rename. Only the
// payload goes through the ring: open/xattr/utime/rename have no asynchronous form worth the
// chain here (futimens has none at all).
#include "blockio.hpp"

#ifdef BLOCKIO_HAVE_URING

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <liburing.h>
#include <mutex>
#include <pthread.h>
#include <thread>
#include <sys/uio.h>
#include <algorithm>
#include <unordered_set>

namespace blockio {
namespace {

struct Done {  // a completion: whose, and what it returned
    void* job;
    long res;
};

enum class Ring { kept, broken, gone };  // how a ring came out of a batch: back to the pool, to close, closed

struct Batch {  // a batch helpers may join: its shared cursor, and who is in it (the engine's lock)
    // runs blocks off the cursor on a ring (nullptr: none to be had, depth 1), counting them
    std::function<Ring(io_uring*, size_t&)> work;
    const std::atomic<size_t>* next;
    size_t n;
    int workers = 0;  // helper threads inside
    bool open() const { return next->load(std::memory_order_relaxed) < n; }
};

// A test's way to make io_uring_wait_cqe fail with I/O in flight (the kernel gives no way to force
// it): KVSTORE_BLOCKIO_FAIL_WAITS=N makes the process's first N waits report EIO without waiting.
// Read once; 0 (unset) in production.
std::atomic<int> g_fail_waits{[] {
    const char* s = std::getenv("KVSTORE_BLOCKIO_FAIL_WAITS");
    return s ? std::atoi(s) : 0;
}()};

bool failed_wait() {
    int n = g_fail_waits.load(std::memory_order_relaxed);
    while (n > 0)
        if (g_fail_waits.compare_exchange_weak(n, n - 1)) return true;
    return false;
}

class Uring final : public Backend {
public:
    Uring(int depth, int threads, io_uring* first) : depth_(depth), threads_(threads < 1 ? 1 : threads) {
        free_.push_back(first);
        for (int i = 1; i < threads_; ++i) {
            helpers_.emplace_back([this] { help(); });
            pthread_setname_np(helpers_.back().native_handle(), "kvstore-bio");  // named before this returns
        }
    }
    ~Uring() override {
        {
            std::lock_guard<std::mutex> g(m_);
            stop_ = true;
        }
        wake_.notify_all();
        for (auto& t : helpers_) t.join();
        for (io_uring* r : free_) {
            io_uring_queue_exit(r);
            delete r;
        }
    }
    const char* name() const override { return "io_uring"; }
    uint64_t helped() const override { return helped_.load(std::memory_order_relaxed); }
    uint64_t wait_errors() const override { return wait_errors_.load(std::memory_order_relaxed); }

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
    // A batch: posted for the helpers, then run on this thread's own ring off the shared cursor;
    // returns (or unwinds) only once no helper is in it: the jobs and closures are this frame's.
    template <class Prep, class After, class Finish, class Sync>
    void run(size_t n, Prep prep, After after, Finish finish, Sync sync) {
        if (n == 0) return;
        std::atomic<size_t> next{0};
        auto work = [&](io_uring* r, size_t& taken) -> Ring {
            if (r) return drain(r, next, n, taken, prep, after, finish, sync);
            for (size_t i; (i = next.fetch_add(1)) < n; ++taken) sync(i, 0);  // no ring: depth 1
            return Ring::gone;
        };
        Batch b{work, &next, n};
        struct Leave {  // the batch leaves the queue, helpers still in it are waited for
            Uring& u;
            Batch& b;
            bool shared;
            ~Leave() {
                std::unique_lock<std::mutex> g(u.m_);
                --u.busy_;
                if (shared) {
                    u.q_.erase(std::find(u.q_.begin(), u.q_.end(), &b));
                    u.left_.wait(g, [&] { return b.workers == 0; });
                }
                g.unlock();
                u.wake_.notify_all();  // a ring came free: helpers may join another batch
            }
        };
        const bool shared = !helpers_.empty() && n > 1;
        {
            std::lock_guard<std::mutex> g(m_);
            ++busy_;  // this thread's ring (a caller always runs its own batch)
            if (shared) q_.push_back(&b);
        }
        Leave leave{*this, b, shared};
        if (shared) wake_.notify_all();
        size_t mine = 0;
        io_uring* r = take();
        settle(r, work(r, mine));
    }

    void help() {
        std::unique_lock<std::mutex> g(m_);
        for (;;) {
            Batch* b = nullptr;
            wake_.wait(g, [&] { return stop_ || (busy_ < threads_ && (b = pick()) != nullptr); });
            if (stop_) return;
            ++b->workers;
            ++busy_;
            g.unlock();
            size_t taken = 0;
            io_uring* r = take();  // none to be had: this helper runs blocks at depth 1 (never spins)
            settle(r, b->work(r, taken));
            helped_.fetch_add(taken, std::memory_order_relaxed);
            g.lock();
            --busy_;
            --b->workers;
            left_.notify_all();
        }
    }

    Batch* pick() const {
        for (Batch* b : q_)
            if (b->open()) return b;
        return nullptr;
    }

    // Blocks off the shared cursor on ring r, up to depth_ in flight, until the cursor runs dry and
    // this thread's blocks are done. prep(i, sqe): open block i and fill its SQE (false: the block
    // already ended); after(job): CPU work once it is submitted; finish(job, res): its completion;
    // sync(i, err): run block i without the ring (err != 0: fail it with err).
    template <class Prep, class After, class Finish, class Sync>
    Ring drain(io_uring* r, std::atomic<size_t>& next, size_t n, size_t& taken, Prep& prep, After& after,
               Finish& finish, Sync& sync) {
        size_t inflight = 0;
        bool broken = false;
        std::unordered_set<void*> flying;  // jobs whose I/O the ring holds
        std::vector<Done> ready;
        ready.reserve(size_t(depth_));
        auto fill_one = [&]() {
            while (inflight < size_t(depth_)) {
                const size_t i = next.fetch_add(1);
                if (i >= n) return;
                ++taken;
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
        auto more = [&] { return next.load(std::memory_order_relaxed) < n; };
        for (size_t k = 0; k < size_t(depth_); ++k) fill_one();
        while (inflight) {
            io_uring_cqe* cqe = nullptr;
            for (int tries = 0;; ++tries) {
                const int w = failed_wait() ? -EIO : io_uring_wait_cqe(r, &cqe);
                if (w == 0) break;
                if (w == -EINTR || w == -EAGAIN || w == -ETIME) continue;
                // A wait that failed says nothing of the I/O in flight: the kernel still owns those
                // buffers and will complete into them, ring closed or not (closing it cancels nothing
                // a disk already has). So no job is failed and no buffer given back until its
                // completion is reaped: keep waiting, backing off to 100 ms; the ring is closed
                // after this batch and no new block goes through it. (This gave up at once, failing
                // the jobs in flight: a late DMA could land in a buffer the caller had reused.)
                broken = true;
                wait_errors_.fetch_add(1, std::memory_order_relaxed);
                std::this_thread::sleep_for(std::chrono::milliseconds(1 << std::min(tries, 7)));
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
            while (inflight < size_t(depth_) && more()) fill_one();
        }
        return broken ? Ring::broken : Ring::kept;
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

    void settle(io_uring* r, Ring how) {  // a ring after a batch: back to the pool, or closed
        if (!r || how == Ring::gone) return;
        if (how == Ring::broken) {
            io_uring_queue_exit(r);
            delete r;
            return;
        }
        std::lock_guard<std::mutex> g(m_);
        free_.push_back(r);
    }

    int depth_, threads_;
    std::mutex m_;  // the ring pool, the queue of open batches, busy_, stop_
    std::vector<io_uring*> free_;
    std::vector<Batch*> q_;
    int busy_ = 0;  // rings in use by callers and helpers
    bool stop_ = false;
    std::condition_variable wake_, left_;  // helpers: work to join / a helper left a batch
    std::vector<std::thread> helpers_;
    std::atomic<uint64_t> helped_{0};  // blocks the helpers took
    std::atomic<uint64_t> wait_errors_{0};  // waits for a completion that failed (and were waited again)
};



}  // namespace

Backend* make_uring(int depth, int threads, std::string& why) {
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
    return new Uring(depth, threads, r);
}

}  // namespace blockio

#else  // built without liburing

namespace blockio {
Backend* make_uring(int, int, std::string& why) {
    why = "built without liburing (apt-get install liburing-dev, then rebuild)";
    return nullptr;
}
}  // namespace blockio

#endif
