// Host emulation of the CUDA features executor/numba_cuda/delta_mma.cu uses, so its device
// code compiles with g++ and runs on a CPU (CI has no GPU): one ucontext fiber per CUDA
// thread; __syncthreads and warp-collective barriers; mma.sync.m16n8k8 tf32 built from the PTX
// ISA fragment tables ("Matrix fragments for mma.m16n8k8", .tf32), exact products summed in
// double; shfl_up; cp.async that poisons its destination with NaN when issued and lands only
// at cp.async.wait_group (so a read before the wait, or a missing barrier, shows as NaN or as a
// wrong value). The scheduler can run threads in order, reversed, shuffled, or one warp ahead
// of the others to its next barrier (DELTA_HOST_ORDER=0..4), which exposes missing barriers;
// DELTA_HOST_EAGER=1 lands copies at issue. Not a simulator of timing or of the tensor cores' own summation
// order: values match the hardware to rounding, bits are compared only between emulated runs.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
using std::max;
using std::min;

#define __device__
#define __forceinline__ inline
#define __global__
#define __align__(x)
#define FULL_MASK 0xffffffffu
typedef unsigned int u32;

struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
// _rn intrinsics: one IEEE operation each (volatile keeps g++ from contracting or reordering)
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }

enum FiberState { RUN, WAIT_BLOCK, WAIT_WARP, WAIT_GROUP, DONE };
struct Copy { float* dst; const float* src; bool live; };
struct Wgmma { float* d; int n; unsigned long long desc; int seq; std::vector<u32> b; bool committed; };
struct Fiber {
    ucontext_t ctx;
    FiberState state;
    int tid;
    std::vector<char> stack;
    std::vector<Copy> open;                 // cp.async issued, not yet committed
    std::vector<std::vector<Copy>> groups;  // committed groups, oldest first
    std::vector<Wgmma> wgmma;               // wgmma issued since the last wait (committed or not)
};
struct Dim3 { int x, y, z; };
struct ThreadIdx { int x; };

extern Fiber* g_fiber;         // the running thread
extern ucontext_t g_scheduler;
extern Dim3 blockIdx;
extern float* g_smem;          // the block's dynamic shared memory
extern int g_async;            // 0: cp.async lands at issue; 1: poison at issue, land at wait
extern unsigned g_exchange[64][32][8];  // per warp and lane: values a warp collective exchanges

#define threadIdx (ThreadIdx{g_fiber->tid})

inline void yield_as(FiberState s) {
    g_fiber->state = s;
    swapcontext(&g_fiber->ctx, &g_scheduler);
}
inline void __syncthreads() { yield_as(WAIT_BLOCK); }
inline void warp_barrier() { yield_as(WAIT_WARP); }
inline void warpgroup_barrier() { yield_as(WAIT_GROUP); }  // the 128 threads of the caller's warpgroup

inline float __shfl_up_sync(unsigned, float v, int d) {
    const int w = g_fiber->tid / 32, l = g_fiber->tid % 32;
    g_exchange[w][l][0] = __float_as_uint(v);
    warp_barrier();
    const float r = l >= d ? __uint_as_float(g_exchange[w][l - d][0]) : v;
    warp_barrier();
    return r;
}

namespace delta {
constexpr int C = 64;

// cvt.rna.tf32.f32: round to nearest, ties away from zero, the low 13 bits cleared.
inline u32 tf32(float x) {
    const u32 u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return (u & 0xffffe000u) | ((u & 0x7fffffu) ? 0x1000u : 0u);
    return (u + 0x1000u) & 0xffffe000u;
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 for the calling warp. Aborts when an
// operand is NaN (every buffer starts as NaN, and a cp.async destination is NaN until its
// wait: the kernel read memory nothing wrote yet) or not a tf32 value (low 13 bits set: the
// kernel must convert or pre-round it).
inline void mma_tf32(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const int w = g_fiber->tid / 32, l = g_fiber->tid % 32;
    unsigned* mine = g_exchange[w][l];
    const u32 ops[6] = {a0, a1, a2, a3, b0, b1};
    for (int i = 0; i < 6; ++i) {
        if ((ops[i] & 0x7f800000u) == 0x7f800000u && (ops[i] & 0x7fffffu)) {
            std::fprintf(stderr, "mma operand %d of lane %d is NaN: a read of memory not yet written\n", i, l);
            std::abort();
        }
        if (ops[i] & 0x1fffu) {
            std::fprintf(stderr, "mma operand %d of lane %d is not tf32\n", i, l);
            std::abort();
        }
        mine[i] = ops[i];
    }
    warp_barrier();
    double a[16][8], b[8][8];
    for (int x = 0; x < 32; ++x) {  // A: a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4); B: b0 (t, g), b1 (t+4, g)
        const int g = x / 4, t = x % 4;
        const unsigned* o = g_exchange[w][x];
        a[g][t] = __uint_as_float(o[0]);
        a[g + 8][t] = __uint_as_float(o[1]);
        a[g][t + 4] = __uint_as_float(o[2]);
        a[g + 8][t + 4] = __uint_as_float(o[3]);
        b[t][g] = __uint_as_float(o[4]);
        b[t + 4][g] = __uint_as_float(o[5]);
    }
    const int g = l / 4, t = l % 4;  // D: d0 (g, 2t), d1 (g, 2t+1), d2 (g+8, 2t), d3 (g+8, 2t+1)
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    float out[4];
    for (int i = 0; i < 4; ++i) {
        double s = d[i];
        for (int k = 0; k < 8; ++k) s += a[rows[i]][k] * b[k][cols[i]];
        out[i] = (float)s;
    }
    warp_barrier();
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

inline void copy16(float* dst, const float* src, bool live) {
    if (!g_async) {
        for (int i = 0; i < 4; ++i) dst[i] = live ? src[i] : 0.f;
        return;
    }
    for (int i = 0; i < 4; ++i) dst[i] = NAN;  // in flight: undefined until the wait
    g_fiber->open.push_back({dst, src, live});
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 of 32-bit elements for the calling warp: lane l gives
// the address of row l % 8 of matrix l / 8 (4 floats); register i of lane l gets float l % 4 of
// row l / 4 of matrix i. Aborts when a row is not a 16-byte aligned address in the block's shared
// memory (the hardware's requirement). The row pointer goes through exchange slots 6-7, clear of
// the 0-5 that mma_tf32 uses.
inline void ldsm_x4(u32* r, const float* row) {
    const int w = g_fiber->tid / 32, l = g_fiber->tid % 32;
    const std::ptrdiff_t at = reinterpret_cast<const char*>(row) - reinterpret_cast<const char*>(g_smem);
    if (at < 0 || at % 16) {
        std::fprintf(stderr, "ldmatrix row at byte %td of shared memory: not 16-byte aligned in it\n", at);
        std::abort();
    }
    std::memcpy(&g_exchange[w][l][6], &row, sizeof(row));
    warp_barrier();
    for (int i = 0; i < 4; ++i) {
        const float* p;
        std::memcpy(&p, &g_exchange[w][8 * i + l / 4][6], sizeof(p));
        r[i] = __float_as_uint(p[l % 4]);
    }
    warp_barrier();
}

inline void commit() {
    if (g_async) {
        g_fiber->groups.push_back(g_fiber->open);
        g_fiber->open.clear();
    }
}

template <int N>
inline void wait_groups() {
    auto& groups = g_fiber->groups;
    while ((int)groups.size() > N) {
        for (const Copy& c : groups.front())
            for (int i = 0; i < 4; ++i) c.dst[i] = c.live ? c.src[i] : 0.f;
        groups.erase(groups.begin());
    }
}
// Shared-memory addresses are byte offsets into the block's shared memory (wgmma descriptors
// carry them).
inline u32 smem_addr(const void* p) {
    return (u32)(reinterpret_cast<const char*>(p) - reinterpret_cast<const char*>(g_smem));
}

// wgmma (delta_wgmma.cu): wgmma.mma_async.sync.aligned.m64n{32,64}k8.f32.tf32.tf32 with A from
// registers and B K-major in shared memory without swizzle, issued asynchronously: an issue
// records the thread's A fragment in its warpgroup's table, and the B elements its outputs need,
// read from shared memory then, in its list; the products run at wgmma.wait_group (wg_wait0) in
// issue order, after a warpgroup barrier (every thread's fragment is in) and before another (no
// one refills the table early), each as mma_tf32 sums: exact products over the k-step summed in
// double onto d, rounded once. So the emulated wgmma walk's bits are the emulated mma.sync walk's.
// The hardware may read B at any time between issue and wait, so the wait reads B again and
// aborts when it changed (a store racing an in-flight wgmma); a B not yet stored at issue is NaN
// (shared memory starts so) and aborts too, as do a non-tf32 operand, a swizzled descriptor and
// B outside shared memory.
constexpr int WGMMA_MAX = 128;  // wgmma a thread may issue between waits
extern unsigned g_wg_a[2][WGMMA_MAX][128][4];
extern unsigned long long g_wg_op[2][WGMMA_MAX][128];  // each thread's (desc, n) of its wgmma seq, for the check
extern int g_wg_count[2][128];                          // wgmma each thread issued since its last wait
extern size_t g_smem_bytes;    // the block's shared memory, for the descriptor check

inline void check_tf32(u32 x, const char* what) {
    if ((x & 0x7f800000u) == 0x7f800000u && (x & 0x7fffffu)) {
        std::fprintf(stderr, "wgmma %s is NaN: a read of memory not yet written\n", what);
        std::abort();
    }
    if (x & 0x1fffu) {
        std::fprintf(stderr, "wgmma %s is not tf32\n", what);
        std::abort();
    }
}

// The B elements (k 0..7, this thread's columns 8 nt + 2 t, + 1) a thread's outputs need, read from
// shared memory through descriptor desc: [nt][j][k], N / 8 x 2 x 8.
inline std::vector<u32> wgmma_b(unsigned long long desc, int n) {
    const size_t start = (desc & 0x3FFF) << 4, lbo = ((desc >> 16) & 0x3FFF) << 4, sbo = ((desc >> 32) & 0x3FFF) << 4;
    if (desc >> 62) {
        std::fprintf(stderr, "wgmma descriptor with a swizzle: not emulated\n");
        std::abort();
    }
    const int t = g_fiber->tid % 4;
    std::vector<u32> b;
    for (int nt = 0; nt < n / 8; ++nt)
        for (int j = 0; j < 2; ++j)
            for (int k = 0; k < 8; ++k) {
                const int col = 8 * nt + 2 * t + j;
                const size_t at = start + (col / 8) * sbo + (k / 4) * lbo + (col % 8) * 16 + (k % 4) * 4;
                if (at + 4 > g_smem_bytes) {
                    std::fprintf(stderr, "wgmma B at byte %zu: outside shared memory\n", at);
                    std::abort();
                }
                u32 x;
                std::memcpy(&x, reinterpret_cast<const char*>(g_smem) + at, 4);
                check_tf32(x, "B operand");
                b.push_back(x);
            }
    return b;
}

template <int N>
inline void wgmma_tf32_issue(float (&d)[N / 2], const u32* a, unsigned long long desc) {
    const int wg = g_fiber->tid / 128, r = g_fiber->tid % 128;
    const int seq = (int)g_fiber->wgmma.size();
    if (seq >= WGMMA_MAX) {
        std::fprintf(stderr, "more than %d wgmma before a wait\n", WGMMA_MAX);
        std::abort();
    }
    for (int i = 0; i < 4; ++i) {
        check_tf32(a[i], "A operand");
        g_wg_a[wg][seq][r][i] = a[i];
    }
    g_wg_op[wg][seq][r] = desc ^ ((unsigned long long)N << 48);  // bits 48-55 of a descriptor are 0 here
    g_wg_count[wg][r] = seq + 1;
    g_fiber->wgmma.push_back({d, N, desc, seq, wgmma_b(desc, N), false});
}
inline void wgmma_tf32_n32(float (&d)[16], const u32* a, unsigned long long desc) { wgmma_tf32_issue<32>(d, a, desc); }
inline void wgmma_tf32_n64(float (&d)[32], const u32* a, unsigned long long desc) { wgmma_tf32_issue<64>(d, a, desc); }

inline void wg_fence() {}
inline void wg_commit() {
    for (Wgmma& op : g_fiber->wgmma) op.committed = true;
}
inline void wg_proxy_fence() {}
template <int N, typename T>
inline void wg_keep(T*) {}

// wgmma.wait_group 0: every committed wgmma of the thread done. Aborts on a wgmma issued and not
// committed (wait_group does not wait for it on the hardware) and on a warpgroup whose threads did
// not all issue the same wgmma (count, shape, descriptor: the instructions are .sync.aligned).
inline void wg_wait0() {
    warpgroup_barrier();
    const int wg = g_fiber->tid / 128, r = g_fiber->tid % 128, w = r / 32, g = r % 32 / 4;
    const int count = (int)g_fiber->wgmma.size();
    for (int x = 0; x < 128; ++x) {
        bool same = g_wg_count[wg][x] == count;
        for (int i = 0; same && i < count; ++i) same = g_wg_op[wg][i][x] == g_wg_op[wg][i][r];
        if (!same) {
            std::fprintf(stderr, "wgmma of threads %d and %d of a warpgroup differ: not .aligned\n", r, x);
            std::abort();
        }
    }
    for (const Wgmma& op : g_fiber->wgmma) {
        if (!op.committed) {
            std::fprintf(stderr, "wgmma issued and not committed before wgmma.wait_group\n");
            std::abort();
        }
        if (wgmma_b(op.desc, op.n) != op.b) {
            std::fprintf(stderr, "wgmma B operand changed between issue and wait: a store raced it\n");
            std::abort();
        }
        double a[2][8];  // this thread's rows 16 w + g, + 8 of A
        for (int x = 0; x < 4; ++x) {  // lanes of row g: a0 (g, t'), a1 (g + 8, t'), a2 (g, t' + 4), a3 (g + 8, t' + 4)
            const unsigned* o = g_wg_a[wg][op.seq][32 * w + 4 * g + x];
            a[0][x] = __uint_as_float(o[0]);
            a[1][x] = __uint_as_float(o[1]);
            a[0][x + 4] = __uint_as_float(o[2]);
            a[1][x + 4] = __uint_as_float(o[3]);
        }
        for (int nt = 0; nt < op.n / 8; ++nt)
            for (int e = 0; e < 4; ++e) {
                const int row = e >> 1;
                double s = op.d[4 * nt + e];
                for (int k = 0; k < 8; ++k)
                    s += a[row][k] * (double)__uint_as_float(op.b[(2 * nt + (e & 1)) * 8 + k]);
                op.d[4 * nt + e] = (float)s;
            }
    }
    g_fiber->wgmma.clear();
    warpgroup_barrier();
    g_wg_count[wg][r] = 0;
}
}  // namespace delta

// Run fn as one CUDA block of `threads` threads with block index bid and shared memory smem.
// Aborts on a deadlock (a barrier not every thread reaches) or a thread that ends while
// cp.async copies are in flight.
void run_block(int threads, Dim3 bid, float* smem, const std::function<void()>& fn);
