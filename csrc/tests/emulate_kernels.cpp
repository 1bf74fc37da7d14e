// emulate_kernels.cpp: runs the CUDA copy kernels (csrc/cuda/kvcopy_kernels.cuh)
// on the CPU, one (block, thread) at a time, against a direct loop-nest
// reference, for thousands of random geometries: random K/V/head/token orders
// on both sides,
// padded blocks, evenly and unevenly spaced layers, unaligned rows (every
// vector width), short and long runs, gather and scatter.  The kernels use no
// shared memory or barriers, so sequential execution is a faithful model of
// their index math.  Built and run by tests/test_kvcopy_cuda.py.
//
//   c++ -O1 -std=c++17 -Wno-unknown-pragmas -Icsrc csrc/tests/emulate_kernels.cpp -o emu && ./emu [trials]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

// --- shims: CUDA device-code spellings as host C++
struct Dim3Shim {
    unsigned x = 0, y = 0, z = 0;
};
static Dim3Shim threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __restrict__
struct uint4 {
    unsigned x, y, z, w;
};
struct uint2 {
    unsigned x, y;
};
using std::min;

#include "cuda/kvcopy_kernels.cuh"

using namespace kvcopy_cuda;

template <typename K>
static void emu_launch(K kern, const KParams& kp, int blocks) {
    gridDim.x = blocks;
    blockDim.x = kThreads;
    for (unsigned b = 0; b < (unsigned)blocks; ++b)
        for (unsigned t = 0; t < (unsigned)kThreads; ++t) {
            blockIdx.x = b;
            threadIdx.x = t;
            kern(kp);
        }
}

template <typename V>
static void launch_t(const KParams& kp, int sm) {
    bool long_kernel = false;
    const int blocks = grid_blocks(kp, (int)sizeof(V), sm, &long_kernel);
    if (long_kernel)
        emu_launch(kv_copy_long<V, kUnroll>, kp, blocks);
    else
        emu_launch(kv_copy_short<V, kUnroll>, kp, blocks);
}

// mirror of run_kernel() minus the CUDA calls
static int g_multi_piece = 0, g_short = 0;

static int run(const Geometry& g, const uint64_t* lp, const int64_t* ids, const uint64_t* blocks,
               int64_t n, bool to_store, int sm) {
    Plan plan = kvcopy::make_plan(g, lp, to_store);
    KParams kp;
    const int vec = build_params(g, plan, lp, blocks, n, to_store, &kp);
    kp.layer_ptrs = lp;
    kp.ids = ids;
    kp.blocks = blocks;
    g_multi_piece += kp.pieces_per_run > 1;
    g_short += kp.run / vec < 32;
    switch (vec) {
        case 16: launch_t<uint4>(kp, sm); break;
        case 8: launch_t<uint2>(kp, sm); break;
        case 4: launch_t<unsigned>(kp, sm); break;
        case 2: launch_t<unsigned short>(kp, sm); break;
        default: launch_t<unsigned char>(kp, sm); break;
    }
    return vec;
}

int main(int argc, char** argv) {
    const int trials = argc > 1 ? std::atoi(argv[1]) : 2000;
    std::mt19937_64 rng(42);
    int fails = 0, cases = 0, by_vec[17] = {0};
    for (int trial = 0; trial < trials; ++trial) {
    Geometry g; int64_t L = 1 + rng()%4, KV = (rng()%4==0)?1:2, H = 1 + rng()%3, N = 1 + rng()%20, D = 1 + rng()%40, es = 1 << (rng()%3);
    if (trial % 3 == 0) { D = 64; es = 2; N = 16 + 16*(rng()%3); }  // aligned / long runs
    if (trial % 7 == 0) { KV = 2; H = 4; N = 64; D = 64; es = 2; }  // pages > 32 KiB: several pieces
    int64_t B = 3 + rng()%6, n = 1 + rng()%B;
    g.num_layers=L; g.num_kv=KV; g.num_heads=H; g.block_size=N; g.row_bytes=D*es; g.num_blocks=B;
    // paged: random permutation of (kv, head, token) inside a block, then blocks, optional padding
    int order[3] = {0,1,2}; std::shuffle(order, order+3, rng);
    if (trial % 14 == 0) { order[0] = 1; order[1] = 0; order[2] = 2; }  // [head][kv][token]: the store order
    int64_t sizes[3] = {KV, H, N}; int64_t st[3]; int64_t acc = g.row_bytes;
    for (int k = 2; k >= 0; --k) { st[order[k]] = acc; acc *= sizes[order[k]]; }
    int64_t pad = (rng()%2) ? 16*(rng()%3) : 0;
    g.s_kv=st[0]; g.s_head=st[1]; g.s_tok=st[2]; g.s_block = acc + pad;
    int64_t layer_bytes = B * g.s_block;
    bool uniform = rng()%2;
    std::vector<uint8_t> cache(L * (layer_bytes + 48) + 64);
    for (auto& c : cache) c = rng();
    std::vector<uint64_t> lp(L);
    uint8_t* base = cache.data() + (16 - ((uintptr_t)cache.data() & 15)) % 16;
    for (int64_t l = 0; l < L; ++l) lp[l] = (uint64_t)(base + l * (layer_bytes + 32) + (uniform ? 0 : 16 * (l % 2)));
    // store block: a random order of (layer, kv, head, token), each packing's order included
    int sorder[4] = {0, 1, 2, 3}; std::shuffle(sorder, sorder + 4, rng);
    int64_t ssizes[4] = {L, KV, H, N}; int64_t sst[4]; int64_t sacc = g.row_bytes;
    for (int k = 3; k >= 0; --k) { sst[sorder[k]] = sacc; sacc *= ssizes[sorder[k]]; }
    g.t_layer = sst[0]; g.t_kv = sst[1]; g.t_head = sst[2]; g.t_tok = sst[3];
    int64_t bb = sacc;
    std::vector<int64_t> ids(B); for (int64_t i = 0; i < B; ++i) ids[i] = i; std::shuffle(ids.begin(), ids.end(), rng); ids.resize(n);
    std::vector<uint8_t> store(n * (bb + 32) + 64, 0xAB);
    std::vector<uint64_t> bp(n); uint8_t* sb = store.data() + (16 - ((uintptr_t)store.data() & 15)) % 16;
    for (int64_t i = 0; i < n; ++i) bp[i] = (uint64_t)(sb + (n - 1 - i) * (bb + 32 * (trial % 2)));
    for (int to_store = 1; to_store >= 0; --to_store) {
      std::vector<uint8_t> cache_before = cache;
      if (!to_store) for (int64_t i = 0; i < n; ++i) for (int64_t k = 0; k < bb; ++k) ((uint8_t*)bp[i])[k] = rng();
      int vec = run(g, lp.data(), ids.data(), bp.data(), n, to_store, 1 + rng()%3);
      // check: gather -> store equals reference; scatter -> cache equals reference
      std::vector<uint8_t> expect = to_store ? std::vector<uint8_t>() : cache_before;
      bool ok = true;
      for (int64_t i = 0; i < n; ++i) for (int64_t l = 0; l < L; ++l) for (int64_t kv = 0; kv < KV; ++kv) for (int64_t h = 0; h < H; ++h) for (int64_t t = 0; t < N; ++t) {
        const uint8_t* pg = (const uint8_t*)lp[l] + ids[i]*g.s_block + kv*g.s_kv + h*g.s_head + t*g.s_tok;
        const uint8_t* so = (const uint8_t*)bp[i] + l*g.t_layer + kv*g.t_kv + h*g.t_head + t*g.t_tok;
        if (to_store) { if (memcmp(pg, so, g.row_bytes)) ok = false; }
        else { size_t off = pg - cache.data(); memcpy(expect.data() + off, so, g.row_bytes); }
      }
      if (!to_store && expect != cache) ok = false;
      cases++;
      by_vec[vec]++;
      if (!ok) { fails++; printf("FAIL trial %d to_store %d L%ld KV%ld H%ld N%ld R%ld vec%d uniform%d order %d%d%d\n", trial, to_store, L, KV, H, N, g.row_bytes, vec, uniform, order[0],order[1],order[2]); }
    }
  }
  printf("%d cases (vector width 16:%d 8:%d 4:%d 2:%d 1:%d; short-run kernel %d, multi-piece runs %d), "
         "%d failures\n", cases, by_vec[16], by_vec[8], by_vec[4], by_vec[2], by_vec[1], g_short,
         g_multi_piece, fails);
  return fails != 0;
}
