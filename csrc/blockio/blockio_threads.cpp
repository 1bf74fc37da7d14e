// The fallback backend: `depth` worker threads, each running one block's whole sequence with
// plain syscalls (pwritev/preadv), shared by every caller of the engine. Chosen at start-up where
// the module was built without liburing or the kernel refuses io_uring (io_uring_disabled,
// seccomp, an old kernel).
#include "blockio.hpp"

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <pthread.h>
#include <thread>

namespace blockio {
namespace {

struct Latch {  // a batch's countdown
    std::mutex m;
    std::condition_variable cv;
    size_t left;
    explicit Latch(size_t n) : left(n) {}
    void done() {
        std::lock_guard<std::mutex> g(m);
        if (--left == 0) cv.notify_all();
    }
    void wait() {
        std::unique_lock<std::mutex> g(m);
        cv.wait(g, [&] { return left == 0; });
    }
};

class Threads final : public Backend {
public:
    explicit Threads(int depth) {
        for (int i = 0; i < depth; ++i)
            workers_.emplace_back([this] {
                pthread_setname_np(pthread_self(), "kvstore-bio");
                loop();
            });
    }
    ~Threads() override {
        {
            std::lock_guard<std::mutex> g(m_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
    }
    const char* name() const override { return "threads"; }

    void write(std::vector<WriteJob>& jobs, const Ctx& c) override {
        run(jobs.size(), [&](size_t i) {
            WriteJob& j = jobs[i];
            if (!write_open(j, c)) return;
            write_hash(j, c);
            write_data_sync(j, c);
        });
    }

    void read(std::vector<ReadJob>& jobs, const Ctx& c) override {
        run(jobs.size(), [&](size_t i) {
            ReadJob& j = jobs[i];
            if (!read_open(j, c)) return;
            read_finish(j, c, read_data_sync(j, c));
        });
    }

private:
    void run(size_t n, const std::function<void(size_t)>& fn) {
        if (n == 0) return;
        Latch latch(n);
        {
            std::lock_guard<std::mutex> g(m_);
            for (size_t i = 0; i < n; ++i)
                q_.emplace_back([&fn, &latch, i] {
                    fn(i);
                    latch.done();
                });
        }
        cv_.notify_all();
        latch.wait();
    }

    void loop() {
        for (;;) {
            std::function<void()> task;
            {
                std::unique_lock<std::mutex> g(m_);
                cv_.wait(g, [&] { return stop_ || !q_.empty(); });
                if (q_.empty()) return;  // stopping, nothing left
                task = std::move(q_.front());
                q_.pop_front();
            }
            task();
        }
    }

    std::mutex m_;
    std::condition_variable cv_;
    std::deque<std::function<void()>> q_;
    std::vector<std::thread> workers_;
    bool stop_ = false;
};

}  // namespace

Backend* make_threads(int depth) { return new Threads(depth < 1 ? 1 : depth); }

}  // namespace blockio
