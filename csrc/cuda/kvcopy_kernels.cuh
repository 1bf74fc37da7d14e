// kvcopy_kernels.cuh: the CUDA copy kernels and their host-side set-up.
//
// Kept free of CUDA runtime calls so that tests/test_kvcopy_cuda.py can compile
// this header as plain C++ (with small shims for __global__, threadIdx, uint4...)
// and run the kernels block by block on the CPU: their index math is checked on
// machines without a GPU (csrc/tests/emulate_kernels.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kvcopy_plan.hpp"

namespace kvcopy_cuda {

using kvcopy::Geometry;
using kvcopy::Plan;

struct KParams {
    const uint64_t* layer_ptrs;  // device copy
    const int64_t* ids;          // device copy
    const uint64_t* blocks;      // device copy (device-visible addresses)
    int nd;
    int layer_indexed;
    int64_t size[Plan::kMaxDims];
    int64_t s[Plan::kMaxDims];
    int64_t t[Plan::kMaxDims];
    int64_t s_block;
    int64_t run;
    int64_t runs_per_block;
    int64_t piece;
    int64_t pieces_per_run;
    int64_t total_items;
    int to_store;
};

// Addresses of run r (flat index over blocks x outer dims), paged and store side.
__device__ __forceinline__ void run_addr(const KParams& p, int64_t r, uint8_t*& paged,
                                         uint8_t*& store) {
    const int64_t blk = r / p.runs_per_block;
    int64_t o = r - blk * p.runs_per_block;
    int64_t so = p.ids[blk] * p.s_block, to = 0;
    const uint8_t* base = (const uint8_t*)p.layer_ptrs[0];
    for (int k = p.nd - 1; k >= 0; --k) {
        const int64_t idx = o % p.size[k];
        o /= p.size[k];
        if (k == 0 && p.layer_indexed)
            base = (const uint8_t*)p.layer_ptrs[idx];
        else
            so += idx * p.s[k];
        to += idx * p.t[k];
    }
    paged = const_cast<uint8_t*>(base) + so;
    store = (uint8_t*)p.blocks[blk] + to;
}

// Long runs: one warp per piece (<= 32 KiB) of a run, lanes on consecutive vectors.
template <typename V, int UNROLL>
__global__ void __launch_bounds__(256) kv_copy_long(const KParams p) {
    const int lane = threadIdx.x & 31;
    const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t item = warp; item < p.total_items; item += nwarps) {
        const int64_t r = item / p.pieces_per_run;
        const int64_t pc = item - r * p.pieces_per_run;
        uint8_t *paged, *store;
        run_addr(p, r, paged, store);
        const int64_t off = pc * p.piece;
        const int64_t len = min(p.piece, p.run - off);
        const V* __restrict__ src = (const V*)((p.to_store ? paged : store) + off);
        V* __restrict__ dst = (V*)((p.to_store ? store : paged) + off);
        const int64_t nvec = len / (int64_t)sizeof(V);
        for (int64_t v = lane; v < nvec; v += 32 * UNROLL) {
            V tmp[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                if (v + u * 32 < nvec) tmp[u] = src[v + u * 32];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                if (v + u * 32 < nvec) dst[v + u * 32] = tmp[u];
        }
    }
}

// Short runs (fewer than 32 vectors, e.g. one 64-256 B head row): every thread
// takes single vectors of the flattened (run, vector) space, so all lanes work.
template <typename V, int UNROLL>
__global__ void __launch_bounds__(256) kv_copy_short(const KParams p) {
    const int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
    const int64_t vpr = p.run / (int64_t)sizeof(V);
    const int64_t total = p.total_items * vpr;  // total_items = runs here
    for (int64_t base = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; base < total;
         base += nthreads * UNROLL) {
        V tmp[UNROLL];
        V* dst[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int64_t v = base + u * nthreads;
            dst[u] = nullptr;
            if (v < total) {
                const int64_t r = v / vpr;
                const int64_t w = v - r * vpr;
                uint8_t *paged, *store;
                run_addr(p, r, paged, store);
                const V* src = (const V*)(p.to_store ? paged : store) + w;
                dst[u] = (V*)(p.to_store ? store : paged) + w;
                tmp[u] = *src;
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (dst[u]) *dst[u] = tmp[u];
    }
}

// Host side: kernel parameters for a plan.  Returns the vector width (16, 8, 4, 2
// or 1 bytes): the largest that divides every address and stride involved.
inline int build_params(const Geometry& g, const Plan& plan, const uint64_t* layer_ptrs,
                        const uint64_t* dev_blocks, int64_t n, bool to_store, KParams* kp) {
    uint64_t acc = (uint64_t)plan.run | (uint64_t)g.s_block;
    for (int k = 0; k < plan.nd; ++k) acc |= (uint64_t)plan.dims[k].s | (uint64_t)plan.dims[k].t;
    for (int64_t l = 0; l < g.num_layers; ++l) acc |= layer_ptrs[l];
    for (int64_t i = 0; i < n; ++i) acc |= dev_blocks[i];
    const int vec = (acc & 15) == 0 ? 16 : (acc & 7) == 0 ? 8 : (acc & 3) == 0 ? 4 : (acc & 1) == 0 ? 2 : 1;
    *kp = KParams{};
    kp->nd = plan.nd;
    kp->layer_indexed = plan.layer_indexed ? 1 : 0;
    for (int k = 0; k < plan.nd; ++k) {
        kp->size[k] = plan.dims[k].size;
        kp->s[k] = plan.dims[k].s;
        kp->t[k] = plan.dims[k].t;
    }
    kp->s_block = g.s_block;
    kp->run = plan.run;
    kp->runs_per_block = plan.runs_per_block;
    const int64_t vpr = plan.run / vec;
    if (vpr >= 32) {  // long runs: warps take pieces of <= 32 KiB
        int64_t piece = std::min<int64_t>(plan.run, 32 << 10);
        piece = std::max<int64_t>(vec, piece / vec * vec);
        kp->piece = piece;
        kp->pieces_per_run = (plan.run + piece - 1) / piece;
    } else {  // short runs: one item per run, threads take single vectors
        kp->piece = plan.run;
        kp->pieces_per_run = 1;
    }
    kp->total_items = n * plan.runs_per_block * kp->pieces_per_run;
    kp->to_store = to_store ? 1 : 0;
    return vec;
}

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// Grid size and kernel choice for params built with vector width `vec`.
inline int grid_blocks(const KParams& kp, int vec, int sm_count, bool* long_kernel, int max_ctas = 0) {
    const int64_t cap = max_ctas > 0 ? (int64_t)max_ctas : (int64_t)std::max(sm_count, 1) * 8;
    const int64_t vpr = kp.run / vec;
    *long_kernel = vpr >= 32;
    int64_t want = *long_kernel ? (kp.total_items + (kThreads / 32) - 1) / (kThreads / 32)
                                : (kp.total_items * vpr + kThreads * kUnroll - 1) / (kThreads * kUnroll);
    return (int)std::max<int64_t>(1, std::min(want, cap));
}

}  // namespace kvcopy_cuda
