// kvcopy_plan.hpp: the layout-independent copy plan shared by the CPU and the
// CUDA paths (host code only, no dependencies beyond the C++ standard library).
//
// A copy moves, for each of n store blocks i and each layer l, the
// KV x H x N rows of R bytes (R = head_size * elem_size) between
//
//   paged side:  layer_ptr[l] + block_id[i]*s_block + kv*s_kv + h*s_head + n*s_tok
//   store side:  block_ptr[i] + l*t_layer + kv*t_kv + h*t_head + n*t_tok
//
// (all strides in bytes).  The plan merges dimensions that are contiguous on
// both sides into one long run, so a layout whose block interior matches the
// store block format copies whole pages with one memcpy per (block, layer) or
// even per block; the rest iterate over at most four outer dimensions.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvcopy {

// Geometry and strides of one copy, as the Python wrapper hands them over.
struct Geometry {
    int64_t num_layers = 0;   // L
    int64_t num_kv = 0;       // 2 (K and V), 1 for MLA
    int64_t num_heads = 0;    // H (1 for MLA)
    int64_t block_size = 0;   // N tokens per block
    int64_t row_bytes = 0;    // R = head_size * elem_size (MLA: latent * elem)
    int64_t num_blocks = 0;   // blocks in the paged cache (for bounds)
    // paged side, bytes
    int64_t s_block = 0, s_kv = 0, s_head = 0, s_tok = 0;
    // store side (the block format), bytes
    int64_t t_layer = 0, t_kv = 0, t_head = 0, t_tok = 0;
};

struct Dim {
    int64_t size;
    int64_t s;  // paged-side stride (bytes)
    int64_t t;  // store-side stride (bytes)
};

// The merged loop nest of one block: dims[0] outermost.  If layer_indexed is
// true, the outermost dim is the layer and the paged-side address comes from
// the per-layer pointer table (layers are not evenly spaced); otherwise the
// layer dim is an ordinary strided dim (or merged away) and only
// layer_ptrs[0] is used as the base.
struct Plan {
    static constexpr int kMaxDims = 4;
    int nd = 0;
    Dim dims[kMaxDims];
    bool layer_indexed = false;
    int64_t run = 0;             // contiguous bytes per copy
    int64_t runs_per_block = 1;  // product of dims[].size
    int64_t block_bytes = 0;     // bytes moved per store block
};

// to_store: the copy reads the paged side (gather).  Runs are visited in the
// source's address order: sequential reads, while the destination is written in
// whole runs (with non-temporal stores on big copies, the pattern that measured
// fastest on CPU: strided reads cost ~2.5x more than strided writes there).
inline Plan make_plan(const Geometry& g, const uint64_t* layer_ptrs, bool to_store) {
    if (g.num_layers <= 0 || g.num_kv <= 0 || g.num_heads <= 0 || g.block_size <= 0 ||
        g.row_bytes <= 0)
        throw std::invalid_argument("kvcopy: all layout dimensions must be positive");
    Plan p;
    p.block_bytes = g.num_layers * g.num_kv * g.num_heads * g.block_size * g.row_bytes;

    // Are the layers evenly spaced?  Then the layer dim is a plain strided dim.
    bool uniform = true;
    int64_t s_layer = 0;
    if (g.num_layers > 1) {
        s_layer = (int64_t)(layer_ptrs[1] - layer_ptrs[0]);
        for (int64_t l = 2; l < g.num_layers && uniform; ++l)
            uniform = (int64_t)(layer_ptrs[l] - layer_ptrs[l - 1]) == s_layer;
    }

    std::vector<Dim> d;  // candidate dims, any order for now
    if (g.num_layers > 1 && uniform) d.push_back({g.num_layers, s_layer, g.t_layer});
    if (g.num_kv > 1) d.push_back({g.num_kv, g.s_kv, g.t_kv});
    if (g.num_heads > 1) d.push_back({g.num_heads, g.s_head, g.t_head});
    if (g.block_size > 1) d.push_back({g.block_size, g.s_tok, g.t_tok});
    // Visit in the source's order (ties: the other side's order).
    std::stable_sort(d.begin(), d.end(), [to_store](const Dim& a, const Dim& b) {
        int64_t ka = to_store ? a.s : a.t, kb = to_store ? b.s : b.t;
        if (ka != kb) return ka > kb;
        return (to_store ? a.t : a.s) > (to_store ? b.t : b.s);
    });

    // Merge the innermost dims into the contiguous run.
    int64_t run = g.row_bytes;
    while (!d.empty() && d.back().s == run && d.back().t == run) {
        run *= d.back().size;
        d.pop_back();
    }
    // Merge adjacent outer dims that are contiguous with each other.
    for (size_t k = 0; k + 1 < d.size();) {
        Dim& a = d[k];
        const Dim& b = d[k + 1];
        if (a.s == b.s * b.size && a.t == b.t * b.size) {
            a.size *= b.size;
            a.s = b.s;
            a.t = b.t;
            d.erase(d.begin() + k + 1);
        } else {
            ++k;
        }
    }
    // Then put a small axis that is adjacent to the run on the destination side
    // innermost: the writes become sequential while the reads stay a few (<= 4)
    // sequential streams.  (Gathering [2, B, N, H, D] pages into [token][head][kv]
    // blocks: K and V rows alternate; measured 0.66 -> 0.84 of memcpy.)
    if (d.size() >= 2) {
        size_t j = 0;
        for (size_t k = 1; k < d.size(); ++k) {
            int64_t dk = to_store ? d[k].t : d[k].s, dj = to_store ? d[j].t : d[j].s;
            if (dk < dj) j = k;
        }
        const Dim dj = d[j];
        if (j + 1 != d.size() && dj.size <= 4 && (to_store ? dj.t : dj.s) == run) {
            d.erase(d.begin() + j);
            d.push_back(dj);
        }
    }
    if (g.num_layers > 1 && !uniform) {
        d.insert(d.begin(), Dim{g.num_layers, 0, g.t_layer});
        p.layer_indexed = true;
    }
    if ((int)d.size() > Plan::kMaxDims) throw std::logic_error("kvcopy: too many dims");
    p.nd = (int)d.size();
    p.runs_per_block = 1;
    for (int k = 0; k < p.nd; ++k) {
        p.dims[k] = d[k];
        p.runs_per_block *= d[k].size;
    }
    p.run = run;
    return p;
}

// Odometer over the runs of a plan: walks runs in store order, starting at any
// flat run index r = block * runs_per_block + (index inside the block).
struct RunCursor {
    const Plan* p;
    const Geometry* g;
    const uint64_t* layer_ptrs;
    const int64_t* ids;
    const uint64_t* blocks;
    int64_t blk = 0;
    int64_t idx[Plan::kMaxDims] = {0, 0, 0, 0};
    uint8_t* paged = nullptr;  // address of the current run, paged side
    uint8_t* store = nullptr;  // address of the current run, store side

    void seek(int64_t r) {
        blk = r / p->runs_per_block;
        int64_t o = r % p->runs_per_block;
        for (int k = p->nd - 1; k >= 0; --k) {
            idx[k] = o % p->dims[k].size;
            o /= p->dims[k].size;
        }
        recompute();
    }
    void recompute() {
        int64_t so = ids[blk] * g->s_block, to = 0;
        const uint8_t* base = (const uint8_t*)(uintptr_t)layer_ptrs[0];
        int k0 = 0;
        if (p->layer_indexed) {
            base = (const uint8_t*)(uintptr_t)layer_ptrs[idx[0]];
            to += idx[0] * p->dims[0].t;
            k0 = 1;
        }
        for (int k = k0; k < p->nd; ++k) {
            so += idx[k] * p->dims[k].s;
            to += idx[k] * p->dims[k].t;
        }
        paged = const_cast<uint8_t*>(base) + so;
        store = (uint8_t*)(uintptr_t)blocks[blk] + to;
    }
    void next() {
        // Fast path: bump the innermost strided dim.
        int k = p->nd - 1;
        if (k >= 0 && !(p->layer_indexed && k == 0) && idx[k] + 1 < p->dims[k].size) {
            ++idx[k];
            paged += p->dims[k].s;
            store += p->dims[k].t;
            return;
        }
        for (; k >= 0; --k) {
            if (++idx[k] < p->dims[k].size) break;
            idx[k] = 0;
        }
        if (k < 0) ++blk;
        recompute_if_valid();
    }
    int64_t num_blocks_total = 0;
    void recompute_if_valid() {
        if (blk < num_blocks_total) recompute();
    }
};

// Checks every block id against [0, num_blocks); returns the first bad index or -1.
inline int64_t first_bad_id(const int64_t* ids, int64_t n, int64_t num_blocks) {
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= num_blocks) return i;
    return -1;
}

}  // namespace kvcopy
