// kvcopy_cuda.cu: CUDA gather/scatter between a paged KV cache in GPU memory and
// store blocks in pinned host memory (or GPU memory).
//
// Two ways to move the bytes, both enqueued on the caller's stream, never with
// a device-wide synchronisation:
//   kernel: ONE launch for all layers and blocks.  A warp copies one piece (up
//           to 32 KiB) of a contiguous run with 16-byte loads/stores where all
//           addresses and strides allow (else 8/4/2/1 bytes); runs shorter than
//           32 vectors are spread one vector per thread instead.  Host blocks are
//           reached through the device pointers of mapped pinned memory.
//   dma:    the copy engines: cudaMemcpyBatchAsync (CUDA >= 12.8) or a loop of
//           cudaMemcpyAsync, one per contiguous run.
// The small descriptor arrays the kernel reads (layer pointers, block ids, block
// pointers) go through a pool of pinned+device scratch buffers, each guarded by
// an event, so a buffer is only reused once the copy that read it is done.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/kvcopy_cuda.h"
#include "cuda/kvcopy_kernels.cuh"

using kvcopy::Dim;
using kvcopy::Geometry;
using kvcopy::Plan;

namespace kvcopy_cuda {
namespace {

void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
        cudaGetLastError();  // clear a non-sticky error
        throw std::runtime_error(std::string("kvcopy CUDA: ") + what + ": " +
                                 cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
    }
}

struct DeviceGuard {
    int prev = -1;
    explicit DeviceGuard(int dev) {
        check(cudaGetDevice(&prev), "cudaGetDevice");
        if (prev != dev) check(cudaSetDevice(dev), "cudaSetDevice");
    }
    ~DeviceGuard() {
        int cur = -1;
        if (prev >= 0 && cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
    }
};

// ---------------------------------------------------- descriptor scratch pool
struct Slot {
    uint8_t* host = nullptr;  // pinned
    uint8_t* dev = nullptr;
    size_t cap = 0;
    int device = -1;
    cudaEvent_t done = nullptr;  // recorded after the kernel that reads this slot
    bool busy = false;           // between acquire_slot and release_slot
};

std::mutex g_slots_mu;
std::vector<Slot*> g_slots;  // never freed (process lifetime, a few KiB each)
constexpr size_t kMaxSlots = 16;

Slot* acquire_slot(size_t bytes, int device) {
    std::lock_guard<std::mutex> lk(g_slots_mu);
    Slot* pick = nullptr;
    for (Slot* s : g_slots) {
        if (s->device != device || s->busy) continue;
        cudaError_t q = cudaEventQuery(s->done);
        if (q == cudaErrorNotReady) continue;
        check(q, "cudaEventQuery");
        if (s->cap >= bytes) {
            s->busy = true;
            return s;
        }
        if (!pick) pick = s;
    }
    if (!pick && g_slots.size() < kMaxSlots) {
        pick = new Slot();
        pick->device = device;
        check(cudaEventCreateWithFlags(&pick->done, cudaEventDisableTiming), "cudaEventCreate");
        g_slots.push_back(pick);
    }
    if (!pick) {
        // All busy: wait for the oldest of this device's slots (that event only).
        for (Slot* s : g_slots)
            if (s->device == device && !s->busy) {
                pick = s;
                break;
            }
        if (!pick)
            throw std::runtime_error("kvcopy CUDA: too many concurrent copies (descriptor pool)");
        check(cudaEventSynchronize(pick->done), "cudaEventSynchronize");
    }
    if (pick->cap < bytes) {
        if (pick->host) check(cudaFreeHost(pick->host), "cudaFreeHost");
        if (pick->dev) check(cudaFree(pick->dev), "cudaFree");
        pick->host = nullptr;
        pick->dev = nullptr;
        size_t cap = std::max<size_t>(bytes, 64 << 10);
        cap = (cap + 4095) & ~(size_t)4095;
        check(cudaHostAlloc((void**)&pick->host, cap, cudaHostAllocDefault), "cudaHostAlloc");
        check(cudaMalloc((void**)&pick->dev, cap), "cudaMalloc");
        pick->cap = cap;
    }
    pick->busy = true;
    return pick;
}

void release_slot(Slot* s) {
    std::lock_guard<std::mutex> lk(g_slots_mu);
    s->busy = false;
}

struct SlotLease {
    Slot* s;
    ~SlotLease() { release_slot(s); }
};

// --------------------------------------------------------------- settings
std::mutex g_cfg_mu;
int64_t g_dma_min_run = 1 << 20;  // auto: DMA when runs are >= 1 MiB (tune from bench)
int g_use_batch = 1;
int g_batch_broken = 0;           // set once cudaMemcpyBatchAsync has been refused
std::vector<int> g_sm_count;

int sm_count(int device) {
    std::lock_guard<std::mutex> lk(g_cfg_mu);
    if ((int)g_sm_count.size() <= device) g_sm_count.resize(device + 1, 0);
    if (!g_sm_count[device]) {
        int v = 0;
        check(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device),
              "cudaDeviceGetAttribute");
        g_sm_count[device] = std::max(v, 1);
    }
    return g_sm_count[device];
}

// Device-visible address of a store block; 0 if the kernel cannot reach it
// (pageable host memory).  Throws for memory of another device.
uint64_t device_view(uint64_t addr, int device, const char* what) {
    cudaPointerAttributes a;
    check(cudaPointerGetAttributes(&a, (const void*)addr), "cudaPointerGetAttributes");
    switch (a.type) {
        case cudaMemoryTypeHost:
            return (uint64_t)(uintptr_t)a.devicePointer;  // null if not mapped
        case cudaMemoryTypeDevice:
            if (a.device != device)
                throw std::invalid_argument(std::string("kvcopy CUDA: ") + what +
                                            " is on another device");
            return addr;
        case cudaMemoryTypeManaged:
            return addr;
        default:
            return 0;  // cudaMemoryTypeUnregistered: pageable host memory
    }
}

template <typename V>
void launch_t(const KParams& kp, int device, cudaStream_t stream, int max_ctas) {
    bool long_kernel = false;
    const int blocks = grid_blocks(kp, (int)sizeof(V), sm_count(device), &long_kernel, max_ctas);
    if (long_kernel)
        kv_copy_long<V, kUnroll><<<blocks, kThreads, 0, stream>>>(kp);
    else
        kv_copy_short<V, kUnroll><<<blocks, kThreads, 0, stream>>>(kp);
    check(cudaGetLastError(), "kernel launch");
}

void run_kernel(const Request& r, const Plan& plan, const std::vector<uint64_t>& dev_blocks,
                cudaStream_t stream) {
    const int64_t L = r.g.num_layers, n = r.n;
    KParams kp;
    const int vec = build_params(r.g, plan, r.layer_ptrs, dev_blocks.data(), n, r.to_store, &kp);

    // descriptors: [layer_ptrs L][ids n][blocks n], 8 bytes each
    const size_t bytes = (size_t)(L + 2 * n) * 8;
    Slot* slot = acquire_slot(bytes, r.device);
    SlotLease lease{slot};
    uint64_t* h = (uint64_t*)slot->host;
    std::memcpy(h, r.layer_ptrs, L * 8);
    std::memcpy(h + L, r.ids, n * 8);
    std::memcpy(h + L + n, dev_blocks.data(), n * 8);
    check(cudaMemcpyAsync(slot->dev, slot->host, bytes, cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync(descriptors)");
    const uint64_t* d = (const uint64_t*)slot->dev;
    kp.layer_ptrs = d;
    kp.ids = (const int64_t*)(d + L);
    kp.blocks = d + L + n;

    switch (vec) {
        case 16: launch_t<uint4>(kp, r.device, stream, r.max_ctas); break;
        case 8: launch_t<uint2>(kp, r.device, stream, r.max_ctas); break;
        case 4: launch_t<unsigned int>(kp, r.device, stream, r.max_ctas); break;
        case 2: launch_t<unsigned short>(kp, r.device, stream, r.max_ctas); break;
        default: launch_t<unsigned char>(kp, r.device, stream, r.max_ctas); break;
    }
    check(cudaEventRecord(slot->done, stream), "cudaEventRecord(slot)");
}

void run_dma(const Request& r, const Plan& plan, cudaStream_t stream) {
    const int64_t runs = r.n * plan.runs_per_block;
    std::vector<void*> dsts(runs);
    std::vector<const void*> srcs(runs);
    std::vector<size_t> sizes(runs, (size_t)plan.run);
    kvcopy::RunCursor c{&plan, &r.g, r.layer_ptrs, r.ids, r.blocks};
    c.num_blocks_total = r.n;
    c.seek(0);
    for (int64_t k = 0; k < runs; ++k) {
        if (r.to_store) {
            dsts[k] = c.store;
            srcs[k] = c.paged;
        } else {
            dsts[k] = c.paged;
            srcs[k] = c.store;
        }
        if (k + 1 < runs) c.next();
    }
    bool done = false;
#if CUDART_VERSION >= 12080
    if (g_use_batch && !g_batch_broken && stream != nullptr && stream != cudaStreamLegacy) {
        cudaMemcpyAttributes attr;
        std::memset(&attr, 0, sizeof(attr));
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
        size_t attr_idx = 0;
        const int64_t chunk = 1 << 16;
        for (int64_t k = 0; k < runs; k += chunk) {
            size_t cnt = (size_t)std::min(chunk, runs - k);
#if CUDART_VERSION >= 13000
            cudaError_t e = cudaMemcpyBatchAsync(dsts.data() + k, srcs.data() + k,
                                                 sizes.data() + k, cnt, &attr, &attr_idx, 1,
                                                 stream);
#else
            size_t fail_idx = 0;
            cudaError_t e = cudaMemcpyBatchAsync(dsts.data() + k, srcs.data() + k,
                                                 sizes.data() + k, cnt, &attr, &attr_idx, 1,
                                                 &fail_idx, stream);
#endif
            if (e == cudaSuccess) continue;
            if (k == 0 && (e == cudaErrorNotSupported || e == cudaErrorInvalidValue ||
                           e == cudaErrorCallRequiresNewerDriver)) {
                // refused outright: not supported here, use the loop from now on
                cudaGetLastError();
                g_batch_broken = 1;
                break;
            }
            check(e, "cudaMemcpyBatchAsync");
        }
        done = !g_batch_broken;
    }
#endif
    if (!done) {
        for (int64_t k = 0; k < runs; ++k)
            check(cudaMemcpyAsync(dsts[k], srcs[k], sizes[k], cudaMemcpyDefault, stream),
                  "cudaMemcpyAsync");
    }
}

}  // namespace

void* copy(const Request& r, int* used_mode) {
    if (r.n <= 0) throw std::invalid_argument("kvcopy CUDA: empty copy");
    for (int64_t i = 0; i < r.n; ++i)
        if (r.ids[i] < 0 || r.ids[i] >= r.g.num_blocks)
            throw std::out_of_range("kvcopy: block id " + std::to_string(r.ids[i]) +
                                    " out of range [0, " + std::to_string(r.g.num_blocks) + ")");
    DeviceGuard guard(r.device);
    cudaStream_t stream = (cudaStream_t)r.stream;
    Plan plan = kvcopy::make_plan(r.g, r.layer_ptrs, r.to_store);

    for (int64_t l = 0; l < r.g.num_layers; ++l) {
        cudaPointerAttributes a;
        check(cudaPointerGetAttributes(&a, (const void*)r.layer_ptrs[l]),
              "cudaPointerGetAttributes(cache)");
        if (!(a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) ||
            (a.type == cudaMemoryTypeDevice && a.device != r.device))
            throw std::invalid_argument("kvcopy CUDA: the KV cache must be memory of device " +
                                        std::to_string(r.device));
    }

    int mode = r.mode;
    std::vector<uint64_t> dev_blocks;
    if (mode != kDma) {
        dev_blocks.resize(r.n);
        bool reachable = true;
        for (int64_t i = 0; i < r.n && reachable; ++i) {
            dev_blocks[i] = device_view(r.blocks[i], r.device, "a store block");
            reachable = dev_blocks[i] != 0;
        }
        if (!reachable) {
            if (mode == kKernel)
                throw std::invalid_argument(
                    "kvcopy CUDA: mode='kernel' needs store blocks in pinned (page-locked, "
                    "mapped) host memory or device memory; use mode='dma' for pageable memory");
            mode = kDma;
        } else if (mode == kAuto) {
            int64_t thr;
            {
                std::lock_guard<std::mutex> lk(g_cfg_mu);
                thr = g_dma_min_run;
            }
            mode = plan.run >= thr ? kDma : kKernel;
        }
    }
    if (mode == kKernel)
        run_kernel(r, plan, dev_blocks, stream);
    else
        run_dma(r, plan, stream);

    cudaEvent_t ev;
    check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    cudaError_t e = cudaEventRecord(ev, stream);
    if (e != cudaSuccess) {
        cudaEventDestroy(ev);
        check(e, "cudaEventRecord");
    }
    if (used_mode) *used_mode = mode;
    return (void*)ev;
}

bool event_query(void* ev) {
    cudaError_t e = cudaEventQuery((cudaEvent_t)ev);
    if (e == cudaErrorNotReady) return false;
    check(e, "cudaEventQuery");
    return true;
}

void event_synchronize(void* ev) { check(cudaEventSynchronize((cudaEvent_t)ev), "cudaEventSynchronize"); }

void event_destroy(void* ev) {
    if (ev) cudaEventDestroy((cudaEvent_t)ev);
}

void stream_wait_event(uintptr_t stream, void* ev) {
    check(cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)ev, 0), "cudaStreamWaitEvent");
}

int device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

std::string runtime_info() {
    int rt = 0, drv = 0;
    cudaRuntimeGetVersion(&rt);
    if (cudaDriverGetVersion(&drv) != cudaSuccess) cudaGetLastError();
    std::string s = "runtime " + std::to_string(rt) + ", driver " + std::to_string(drv);
#if CUDART_VERSION >= 12080
    s += ", cudaMemcpyBatchAsync compiled in";
    if (g_batch_broken) s += " (refused at run time, using cudaMemcpyAsync loop)";
#else
    s += ", cudaMemcpyBatchAsync not available (cudaMemcpyAsync loop)";
#endif
    return s;
}

void set_dma_min_run(int64_t nbytes) {
    std::lock_guard<std::mutex> lk(g_cfg_mu);
    g_dma_min_run = nbytes;
}
int64_t get_dma_min_run() {
    std::lock_guard<std::mutex> lk(g_cfg_mu);
    return g_dma_min_run;
}
void set_use_batch_api(int on) { g_use_batch = on; }

}  // namespace kvcopy_cuda
