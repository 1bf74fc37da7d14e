// _kvcopy_cpu: multi-threaded gather/scatter between a paged KV cache in host
// memory and contiguous store blocks.  See csrc/README.md for the block format.
//
// The Python wrapper (kvstore/kvcopy) validates every argument and hands over
// raw addresses in uint64 arrays (DLPack ndarrays through nanobind); this file
// re-checks what is cheap to check (block-id ranges, counts) so that a wrapper
// bug cannot turn into an out-of-bounds access through a bad block id.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <pthread.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVCOPY_X86 1
#endif

#include "kvcopy_plan.hpp"

namespace nb = nanobind;
using namespace kvcopy;

namespace {

// ---------------------------------------------------------------- copy runs
// Non-temporal stores skip the read-for-ownership of the destination lines and
// keep a large copy from evicting the caches.  Used for big copies only.
inline void copy_nt(uint8_t* dst, const uint8_t* src, size_t n) {
#ifdef KVCOPY_X86
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    if (head) {
        std::memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
    }
    size_t body = n & ~(size_t)63;
    for (size_t k = 0; k < body; k += 64) {
        __m128i a = _mm_loadu_si128((const __m128i*)(src + k));
        __m128i b = _mm_loadu_si128((const __m128i*)(src + k + 16));
        __m128i c = _mm_loadu_si128((const __m128i*)(src + k + 32));
        __m128i d = _mm_loadu_si128((const __m128i*)(src + k + 48));
        _mm_stream_si128((__m128i*)(dst + k), a);
        _mm_stream_si128((__m128i*)(dst + k + 16), b);
        _mm_stream_si128((__m128i*)(dst + k + 32), c);
        _mm_stream_si128((__m128i*)(dst + k + 48), d);
    }
    if (n > body) std::memcpy(dst + body, src + body, n - body);
#else
    std::memcpy(dst, src, n);
#endif
}

inline void store_fence() {
#ifdef KVCOPY_X86
    _mm_sfence();
#endif
}

// ------------------------------------------------------------- thread pool
// A small persistent pool: the calling thread takes part as worker 0.  One job
// runs at a time (calls from several Python threads queue on call_mu).  After a
// fork() the child gets a fresh pool (the parent's threads do not exist there).
class Pool {
  public:
    explicit Pool(int nworkers) : pid_(getpid()) {
        for (int i = 0; i < nworkers; ++i) workers_.emplace_back([this, i] { loop(i); });
    }
    ~Pool() {
        {
            std::lock_guard<std::mutex> lk(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
    }
    int size() const { return (int)workers_.size(); }
    pid_t pid() const { return pid_; }

    // Runs fn(0..nthreads-1), fn(0) on the calling thread.
    void run(int nthreads, const std::function<void(int)>& fn) {
        std::lock_guard<std::mutex> call(call_mu_);
        int helpers = std::min(nthreads - 1, (int)workers_.size());
        if (helpers <= 0) {
            fn(0);
            return;
        }
        {
            std::lock_guard<std::mutex> lk(mu_);
            job_ = &fn;
            participants_ = helpers;
            pending_ = helpers;
            ++gen_;
        }
        cv_.notify_all();
        std::exception_ptr err;
        try {
            fn(0);
        } catch (...) {
            err = std::current_exception();
        }
        std::unique_lock<std::mutex> lk(mu_);
        done_cv_.wait(lk, [this] { return pending_ == 0; });
        job_ = nullptr;
        if (err) std::rethrow_exception(err);
    }

  private:
    void loop(int id) {
#ifdef __linux__
        // named, so a profile (and bench e2e's per-thread CPU) can tell kvstore's copies apart
        pthread_setname_np(pthread_self(), "kvstore-copy");
#endif
        uint64_t seen = 0;
        for (;;) {
            const std::function<void(int)>* job;
            {
                std::unique_lock<std::mutex> lk(mu_);
                cv_.wait(lk, [&] { return stop_ || gen_ != seen; });
                if (stop_) return;
                seen = gen_;
                if (id >= participants_) continue;
                job = job_;
            }
            try {
                (*job)(id + 1);
            } catch (...) {
                // copy workers do not throw; never let an exception kill the process
            }
            {
                std::lock_guard<std::mutex> lk(mu_);
                if (--pending_ == 0) done_cv_.notify_all();
            }
        }
    }

    pid_t pid_;
    std::vector<std::thread> workers_;
    std::mutex call_mu_, mu_;
    std::condition_variable cv_, done_cv_;
    const std::function<void(int)>* job_ = nullptr;
    int participants_ = 0, pending_ = 0;
    uint64_t gen_ = 0;
    bool stop_ = false;
};

std::mutex g_pool_mu;
Pool* g_pool = nullptr;  // leaked on purpose at exit / after fork

int default_threads() {
    if (const char* e = std::getenv("KVSTORE_COPY_THREADS")) {
        int v = std::atoi(e);
        if (v > 0) return std::min(v, 256);
    }
    unsigned hc = std::thread::hardware_concurrency();
    int cores = hc ? (int)hc : 1;
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = std::max(1, CPU_COUNT(&set));
#endif
    return std::min(cores, 4);
}
std::atomic<int> g_threads{0};  // 0 = not yet decided

int num_threads() {
    int t = g_threads.load();
    if (t <= 0) {
        t = default_threads();
        g_threads.store(t);
    }
    return t;
}

Pool& pool_for(int nthreads) {
    std::lock_guard<std::mutex> lk(g_pool_mu);
    if (g_pool && g_pool->pid() != getpid()) g_pool = nullptr;  // forked child: abandon
    if (!g_pool || g_pool->size() < nthreads - 1) {
        // Grow by replacing; the old pool may still be running another caller's
        // job, so it is left alive (idle threads, rare: only when the thread
        // count goes up).
        g_pool = new Pool(std::max(nthreads - 1, 0));
    }
    return *g_pool;
}

// Copies smaller than this run on the calling thread only.
constexpr int64_t kParallelMin = 256 << 10;
// Copies at least this large use non-temporal stores when nt = auto.
int64_t g_nt_threshold = 8 << 20;

struct CopyArgs {
    Geometry g;
    Plan plan;
    const uint64_t* layer_ptrs;
    const int64_t* ids;
    const uint64_t* blocks;
    int64_t n;
    bool to_store;  // gather: paged -> store
    bool nt;
};

void copy_range(const CopyArgs& a, int64_t b0, int64_t b1) {
    if (b0 >= b1) return;
    const int64_t run = a.plan.run;
    RunCursor c{&a.plan, &a.g, a.layer_ptrs, a.ids, a.blocks};
    c.num_blocks_total = a.n;
    c.seek(b0 / run);
    int64_t off = b0 % run;
    int64_t b = b0;
    while (b < b1) {
        int64_t len = std::min(run - off, b1 - b);
        uint8_t* dst = a.to_store ? c.store : c.paged;
        const uint8_t* src = a.to_store ? c.paged : c.store;
        if (a.nt)
            copy_nt(dst + off, src + off, (size_t)len);
        else
            std::memcpy(dst + off, src + off, (size_t)len);
        b += len;
        off = 0;
        if (b < b1) c.next();
    }
    if (a.nt) store_fence();
}

void run_copy(const CopyArgs& a, int nthreads) {
    const int64_t total = a.n * a.plan.block_bytes;
    if (total == 0) return;
    if (nthreads <= 0) nthreads = num_threads();
    if (total < kParallelMin) nthreads = 1;
    // No thread gets less than ~128 KiB.
    nthreads = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, total / (128 << 10)));
    if (nthreads == 1) {
        copy_range(a, 0, total);
        return;
    }
    auto fn = [&](int t) {
        // Byte ranges in store order, cut on 64-byte boundaries.
        int64_t b0 = (total * t / nthreads) & ~(int64_t)63;
        int64_t b1 = t + 1 == nthreads ? total : (total * (t + 1) / nthreads) & ~(int64_t)63;
        copy_range(a, b0, b1);
    };
    pool_for(nthreads).run(nthreads, fn);
}

using U64 = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I64 = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U64Out = nb::ndarray<uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Geom = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;
using Strides4 = std::tuple<int64_t, int64_t, int64_t, int64_t>;

Geometry make_geometry(const Geom& geom, const Strides4& paged, const Strides4& store) {
    Geometry g;
    std::tie(g.num_layers, g.num_kv, g.num_heads, g.block_size, g.row_bytes, g.num_blocks) = geom;
    std::tie(g.s_block, g.s_kv, g.s_head, g.s_tok) = paged;
    std::tie(g.t_layer, g.t_kv, g.t_head, g.t_tok) = store;
    return g;
}

void copy_blocks(bool to_store, U64 layer_ptrs, const Geom& geom, const Strides4& paged,
                 const Strides4& store, I64 block_ids, U64 block_ptrs, int nthreads, int nt) {
    CopyArgs a;
    a.g = make_geometry(geom, paged, store);
    if ((int64_t)layer_ptrs.shape(0) != a.g.num_layers)
        throw nb::value_error("kvcopy: one cache pointer per layer expected");
    if (block_ids.shape(0) != block_ptrs.shape(0))
        throw nb::value_error("kvcopy: block_ids and store blocks differ in length");
    a.n = (int64_t)block_ids.shape(0);
    if (a.n == 0) return;
    a.ids = block_ids.data();
    a.layer_ptrs = layer_ptrs.data();
    a.blocks = block_ptrs.data();
    int64_t bad = first_bad_id(a.ids, a.n, a.g.num_blocks);
    if (bad >= 0)
        throw nb::index_error(("kvcopy: block id " + std::to_string(a.ids[bad]) +
                               " out of range [0, " + std::to_string(a.g.num_blocks) + ")")
                                  .c_str());
    for (int64_t l = 0; l < a.g.num_layers; ++l)
        if (!a.layer_ptrs[l]) throw nb::value_error("kvcopy: null cache pointer");
    for (int64_t i = 0; i < a.n; ++i)
        if (!a.blocks[i]) throw nb::value_error("kvcopy: null store block pointer");
    a.plan = make_plan(a.g, a.layer_ptrs, to_store);
    a.to_store = to_store;
    const int64_t total = a.n * a.plan.block_bytes;
    a.nt = nt > 0 || (nt < 0 && total >= g_nt_threshold);
    nb::gil_scoped_release release;
    run_copy(a, nthreads);
}

// The addresses of store blocks given as a list of buffer-protocol objects (the DRAM tier's slot
// views are numpy arrays): out[i] <- the address of blocks[i] while each is a C-contiguous 1-D
// buffer of exactly block_bytes one-byte items (and writable, when asked). Returns how many
// leading blocks passed; the wrapper checks the rest one by one (torch tensors, and the clear
// error for a bad one). Reading the address through numpy's ctypes in Python cost ~1.45 us a
// block (371 us for the 255 blocks of an 8k-token DRAM hit); here 12.6 us for the 255 (measured).
int64_t buffer_ptrs(nb::list blocks, int64_t block_bytes, bool writable, U64Out out) {
    const Py_ssize_t n = PyList_GET_SIZE(blocks.ptr());
    if ((Py_ssize_t)out.shape(0) < n) throw nb::value_error("kvcopy: the address array is too short");
    uint64_t* o = out.data();
    const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    for (Py_ssize_t i = 0; i < n; ++i) {
        Py_buffer v;
        if (PyObject_GetBuffer(PyList_GET_ITEM(blocks.ptr(), i), &v, flags) != 0) {
            PyErr_Clear();  // not a buffer, not contiguous or read-only: the wrapper's checks say which
            return i;
        }
        const bool ok = v.ndim == 1 && v.itemsize == 1 && v.len == block_bytes && v.buf != nullptr;
        o[i] = (uint64_t)(uintptr_t)v.buf;
        PyBuffer_Release(&v);
        if (!ok) return i;
    }
    return n;
}

// For tests and the benchmark: how a layout's copy decomposes.
std::tuple<int64_t, int64_t, int, bool> plan_info(U64 layer_ptrs, const Geom& geom,
                                                  const Strides4& paged, const Strides4& store,
                                                  bool to_store) {
    Geometry g = make_geometry(geom, paged, store);
    if ((int64_t)layer_ptrs.shape(0) != g.num_layers)
        throw nb::value_error("kvcopy: one cache pointer per layer expected");
    Plan p = make_plan(g, layer_ptrs.data(), to_store);
    return {p.run, p.runs_per_block, p.nd, p.layer_indexed};
}

// Plain parallel memcpy with the same threads and store policy as the copy:
// the benchmark's same-run limit.
void memcpy_mt(uint64_t dst, uint64_t src, int64_t nbytes, int nthreads, int nt) {
    if (nbytes <= 0) return;
    if (!dst || !src) throw nb::value_error("kvcopy: null pointer");
    bool use_nt = nt > 0 || (nt < 0 && nbytes >= g_nt_threshold);
    nb::gil_scoped_release release;
    if (nthreads <= 0) nthreads = num_threads();
    nthreads = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, nbytes / (128 << 10)));
    auto fn = [&](int t) {
        int64_t b0 = (nbytes * t / nthreads) & ~(int64_t)63;
        int64_t b1 = t + 1 == nthreads ? nbytes : (nbytes * (t + 1) / nthreads) & ~(int64_t)63;
        if (b1 <= b0) return;
        if (use_nt) {
            copy_nt((uint8_t*)(uintptr_t)dst + b0, (const uint8_t*)(uintptr_t)src + b0, b1 - b0);
            store_fence();
        } else {
            std::memcpy((uint8_t*)(uintptr_t)dst + b0, (const uint8_t*)(uintptr_t)src + b0, b1 - b0);
        }
    };
    if (nthreads == 1)
        fn(0);
    else
        pool_for(nthreads).run(nthreads, fn);
}

}  // namespace

NB_MODULE(_kvcopy_cpu, m) {
    m.doc() = "kvstore CPU copy kernels (gather/scatter between a paged KV cache and store blocks)";
    m.def("copy_blocks", &copy_blocks, nb::arg("to_store"), nb::arg("layer_ptrs"),
          nb::arg("geom"), nb::arg("paged_strides"), nb::arg("store_strides"),
          nb::arg("block_ids"), nb::arg("block_ptrs"), nb::arg("num_threads") = 0,
          nb::arg("nt") = -1,
          "Copy n store blocks. geom = (layers, kv, heads, block_size, row_bytes, "
          "num_blocks); strides in bytes; to_store=True gathers, False scatters.");
    m.def("buffer_ptrs", &buffer_ptrs, nb::arg("blocks"), nb::arg("block_bytes"),
          nb::arg("writable"), nb::arg("out"),
          "out[i] <- the address of blocks[i] (a list of buffers) while each is a C-contiguous "
          "1-D buffer of block_bytes one-byte items (writable if asked); returns how many passed.");
    m.def("plan_info", &plan_info, nb::arg("layer_ptrs"), nb::arg("geom"),
          nb::arg("paged_strides"), nb::arg("store_strides"), nb::arg("to_store") = true,
          "(run_bytes, runs_per_block, outer_dims, layer_indexed) of a copy plan.");
    m.def("memcpy", &memcpy_mt, nb::arg("dst"), nb::arg("src"), nb::arg("nbytes"),
          nb::arg("num_threads") = 0, nb::arg("nt") = -1,
          "Parallel memcpy between raw addresses (benchmark limit; no checks beyond null).");
    m.def("set_num_threads", [](int n) {
        if (n <= 0) n = default_threads();
        g_threads.store(std::min(n, 256));
    }, nb::arg("n"), "Worker threads per copy (<= 0: default min(cores, 4)).");
    m.def("get_num_threads", &num_threads);
    m.def("set_nt_threshold", [](int64_t b) { g_nt_threshold = b; }, nb::arg("nbytes"),
          "Copies of at least this many bytes use non-temporal stores (nt=-1).");
    m.def("get_nt_threshold", [] { return g_nt_threshold; });
    m.attr("ABI_VERSION") = 1;
}
