// kvcopy_cuda.h: plain C++ interface of the CUDA copy path (implemented in
// kvcopy_cuda.cu, compiled by nvcc; bound to Python in bind_cuda.cpp, compiled
// by the host compiler, so nanobind never goes through nvcc).
#pragma once

#include <cstdint>
#include <string>

#include "kvcopy_plan.hpp"

namespace kvcopy_cuda {

enum Mode : int { kAuto = 0, kKernel = 1, kDma = 2 };

struct Request {
    kvcopy::Geometry g;
    const uint64_t* layer_ptrs = nullptr;  // L addresses of the paged cache (device memory)
    const int64_t* ids = nullptr;          // n block ids (host array)
    const uint64_t* blocks = nullptr;      // n store-block addresses (pinned host or device)
    int64_t n = 0;
    bool to_store = true;                  // gather (cache -> store) or scatter
    int mode = kAuto;
    uintptr_t stream = 0;                  // cudaStream_t as an integer
    int device = 0;                        // device of the paged cache
    int max_ctas = 0;                      // the kernel's grid at most (0: 8 per SM); a copy on a
                                           // side stream takes fewer SMs from the engine's kernels
};

// Enqueues the copy on req.stream and returns a cudaEvent_t (as void*) recorded
// after it; the caller owns the event (event_destroy).  *used_mode receives
// kKernel or kDma.  Throws std::invalid_argument / std::runtime_error.
void* copy(const Request& req, int* used_mode);

bool event_query(void* ev);   // true when complete; throws on a CUDA error
void event_synchronize(void* ev);
void event_destroy(void* ev);
void stream_wait_event(uintptr_t stream, void* ev);

int device_count();           // 0 when no driver/device (never throws)
std::string runtime_info();   // runtime / driver versions, batch-API availability

// auto mode picks DMA when the contiguous runs are at least this long (bytes)
void set_dma_min_run(int64_t nbytes);
int64_t get_dma_min_run();
// 0 = never use cudaMemcpyBatchAsync (loop of cudaMemcpyAsync), 1 = use when available
void set_use_batch_api(int on);

}  // namespace kvcopy_cuda
