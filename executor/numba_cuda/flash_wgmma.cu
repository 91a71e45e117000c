// Prefill attention's walk with its two products on wgmma (sm_90a): flash_attention.cu's walk
// (`flash_prefill<256, 8, 32, 3, false>`: one CTA of 8 warps walks every 512-key segment of its
// 128 virtual rows, folding as it goes) with
//   S = Q K_b^T   wgmma m64n32k16, Q from registers (load_q's fragments), K_b from shared memory,
//                 K-major;
//   O += P V_b    wgmma m64n256k16, P from registers (block_softmax's fragments), V_b from shared
//                 memory, MN-major.
// Everything else (the softmax, segments, fold, gate) is flash_attention.cu's own code, and
// wgmma sums its k-steps as chained mma.sync m16n8k16 does (bench/RESULTS.md, session 26), so
// every output bit is the mma.sync walk's: attention_wgmma.py checks it before first use and
// tests/executor/numba_cuda/test_gpu_flash_attention.py on the H200.
//
// K and V blocks (32 keys) sit in shared memory in the 128-byte swizzle (PTX ISA, "Shared Memory
// Matrix Layout", 128B swizzling; TMA's CU_TENSOR_MAP_SWIZZLE_128B): head_dim in chunks of 64
// (128 bytes a key), chunk j of key r at j * 32 * 128 + r * 128 bytes, its 16-byte piece p at
// (p ^ (r % 8)) * 16 inside, the ring 1024-byte aligned. A warp's copy reads four whole 128-byte
// rows of a key head and writes 512 contiguous bytes (no bank conflict). Descriptors (PTX ISA,
// "Matrix Descriptor Format", swizzle mode 1; measured on the H200, RESULTS.md session 27): K_b
// (K-major) at chunk k / 4 plus 32 bytes a k-step inside it, stride byte offset 1024 (8 keys);
// V_b (MN-major) at 2048 bytes a k-step (16 keys), leading byte offset 4096 (the next 64 dims),
// stride byte offset 1024 (the next 8 keys); the other way round V's bits are wrong. The session
// 26 walk on the no-swizzle core-matrix layout spent 43% of its time issuing the copies (each a
// warp's 8 half-used rows) and ran no faster than mma.sync at 9B long chunks; this one 1.7-1.8x.
//
// Appended to flash_attention.cu's text with the two wgmma functions generated at the marker
// (executor/numba_cuda/nvrtc.py: wgmma_function) and compiled by NVRTC for sm_90a to a cubin
// launched through the driver (attention_wgmma.py).

// wg_desc (wgmma.cu, before this text) in the 128-byte swizzle (bits 62-63: 1).
__device__ __forceinline__ unsigned long long wg_desc_128b(u32 addr, u32 lbo, u32 sbo) {
    return wg_desc(addr, lbo, sbo) | (1ull << 62);
}
// wg_desc_128b(addr + offset, ...) from desc = wg_desc_128b(addr, ...): the address field (bits
// 0-13, addr >> 4) moves by offset >> 4 (offset a multiple of 16, as every k-step's is); nothing
// carries out of it while addr + offset < 256 KB (shared memory is 228 KB). The walk works each
// block's two descriptors out once and adds the k-steps' offsets: 4 instructions between S's
// products instead of 7, 464 a warp a block instead of 513, the same descriptors
// (bench/RESULTS.md, session 36: 0.88x the time at 9B's 32K chunks).
__device__ __forceinline__ unsigned long long wg_desc_plus(unsigned long long desc, u32 offset) {
    return (desc & 0xFFFFFFFF00000000ull) | (u32)((u32)desc + (offset >> 4));
}

// TMA and mbarriers (PTX ISA, "cp.async.bulk.tensor", "mbarrier"). A tensor map is the driver's
// 128-byte CUtensorMap (cuTensorMapEncodeTiled, attention_wgmma.tensor_map), passed by value as a
// __grid_constant__ parameter and addressed generically.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// One arrival that also expects `bytes` of transactions (the TMA copies of this phase).
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Until the barrier's phase of this parity completed (its copies landed).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}
// Box (c0.., c1, c2..) of a 3-d tensor map into shared memory at dst, completing on bar.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap* map, int c0, int c1, int c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}

// wgmma_s (m64n32k16, A from registers, B K-major) and wgmma_o (m64n256k16, A from registers,
// B MN-major), generated (their operand lists are long):
// @WGMMA_FUNCTIONS@

// A CTA's rows and key blocks: WARPS row groups of 16 virtual rows (warp w takes group w %
// WARPS), tile = the CTA's index from the longest (gridDim.x - 1 - blockIdx.x), K/V head
// blockIdx.y; `empty` when the tile starts past the chunk's virtual rows. As flash_prefill
// works them out.
template <int WARPS, int BN>
struct Tile {
    int group, h, warp, lane, g, t, vrows, cta_first, blocks, warp_first, warp_blocks, unmasked;
    int pos[2];
    bool empty;
    // heads_fast: a one-dimensional grid of tiles x kv_heads CTAs, the K/V head varying fastest
    // (CTAs that run together stream different heads' keys), longest tiles first.
    __device__ __forceinline__ Tile(int rows, int start, int q_heads, int kv_heads, bool heads_fast = false) {
        group = q_heads / kv_heads;
        h = heads_fast ? blockIdx.x % kv_heads : blockIdx.y;
        warp = threadIdx.x / 32 % WARPS;
        lane = threadIdx.x % 32;
        g = lane >> 2;
        t = lane & 3;
        vrows = rows * group;
        cta_first = (heads_fast ? gridDim.x / kv_heads - 1 - blockIdx.x / kv_heads : gridDim.x - 1 - blockIdx.x) * WARPS * 16;
        empty = cta_first >= vrows;
        const int cta_last = min(cta_first + WARPS * 16, vrows) - 1;
        blocks = (start + cta_last / group) / BN + 1;
        warp_first = cta_first + warp * 16;
        warp_blocks = warp_first < vrows ? (start + min(warp_first + 15, vrows - 1) / group) / BN + 1 : 0;
        unmasked = warp_first < vrows ? (start + warp_first / group + 1) / BN : 0;
        int vr[2], row[2], head[2];
        row_pair(vr, row, head, warp_first, g, vrows, group, h);
        pos[0] = start + row[0];
        pos[1] = start + row[1];
    }
};

// Ping-pong turns of a CTA's two warpgroups on the tensor cores (FlashAttention-3's order: S of 0,
// S of 1, P V of 0, P V of 1, ...; named barriers 1 and 2): `mine()` before a warpgroup issues,
// `pass()` after it committed, `start()` once before the walk (warpgroup 0 goes first) and
// `finish()` once after it (warpgroup 1's last turn passed). All no-ops when not ON.
template <bool ON, int THREADS>
struct Turns {
    const int wg = threadIdx.x / 128;
    __device__ __forceinline__ void mine() const {
        if constexpr (ON) asm volatile("bar.sync %0, %1;" ::"r"(1 + wg), "r"(THREADS) : "memory");
    }
    __device__ __forceinline__ void pass() const {
        if constexpr (ON) asm volatile("bar.arrive %0, %1;" ::"r"(2 - wg), "r"(THREADS) : "memory");
    }
    __device__ __forceinline__ void start() const {
        if (ON && wg == 1) pass();
    }
    __device__ __forceinline__ void finish() const {
        if (ON && wg == 0) mine();
    }
};

// The key segment's running (m, l, O) of a warp's rows, reset (O: N column tiles of m16n8).
template <int N>
__device__ __forceinline__ void reset_segment(float (&acc)[N][4], float (&m)[2], float (&l)[2]) {
#pragma unroll
    for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    m[0] = m[1] = NEG_INF;
    l[0] = l[1] = 0.0f;
}

// A warp's part of a walk (every wgmma walk: this file's and bench/flash_wgmma.cu's): its Tile,
// the scale in log2 units, Q's fragments (load_q) and the key segment's running (m, l, O) with
// their reset. Arrays indexed by constants only, so they live in registers.
template <int D, int BN, int WARPS>
struct WalkWarp {
    const Tile<WARPS, BN> c;
    const float scale2;
    u32 qf[D / 16][4];
    float acc[D / 8][4];
    float m[2], l[2];
    __device__ __forceinline__ WalkWarp(const float* q, int rows, int start, int q_heads, int kv_heads, float scale,
                                        bool heads_fast = false)
        : c(rows, start, q_heads, kv_heads, heads_fast), scale2(scale * 1.4426950408889634f) {
        if (c.empty) return;
        int vr[2], row[2], head[2];
        row_pair(vr, row, head, c.warp_first, c.g, c.vrows, c.group, c.h);
        load_q<D>(qf, q, row, head, q_heads, c.t);
        reset();
    }
    __device__ __forceinline__ void reset() { reset_segment<D / 8>(acc, m, l); }
};

// Keys [block * BN, +BN) of one K/V head into the 128-byte swizzle at `dst` (see the header).
// Thread x copies piece x % 8 of key x / 8 in every 64-dim chunk.
template <int D, int BN, int THREADS>
__device__ __forceinline__ void load_block_swizzled(u32 dst, const bf16_t* src, size_t row_stride, int block) {
    static_assert(THREADS == 8 * BN, "a thread keeps one key and one piece of every chunk");
    const int p = threadIdx.x % 8, r = threadIdx.x / 8;
    const bf16_t* from = src + (size_t)(block * BN + r) * row_stride + p * 8;
    const u32 to = dst + r * 128 + ((p ^ (r % 8)) * 16);
#pragma unroll
    for (int j = 0; j < D / 64; ++j) copy16(to + j * BN * 128, from + j * 64);
}

// A ring walk with one barrier a block (the ping-pong experiments'): for block b, wait for its
// copy, a barrier, then `load(b + 1)` (into block b - 2's stage: every warpgroup waited for its
// last product on block b - 2 in block b - 1) and `run(b)`; `segment_end(s0)` after each key
// segment. `load` commits one copy group, empty for a block at or past `last`.
template <int SEG, typename Load, typename Run, typename SegmentEnd>
__device__ __forceinline__ void one_barrier_ring(int first, int last, Load load, Run run, SegmentEnd segment_end) {
    load(first);
    for (int s0 = first; s0 < last; s0 += SEG) {
        const int s1 = min(s0 + SEG, last);
        for (int b = s0; b < s1; ++b) {
            wait_groups<0>();
            wg_proxy_fence();
            __syncthreads();  // block b is in for every thread; block b - 2's stage is free
            load(b + 1);
            run(b);
        }
        segment_end(s0);
    }
    wait_groups<0>();
    __syncthreads();
}

// The walk over key blocks [0, last) through a ring of STAGES (K, V) block pairs: for block b,
// wait for its copy and a barrier, `scores(b, K_b)` (S_b issued and waited, with P_{b-1} V_{b-1}
// before it), a barrier (every warpgroup is done with block b - 1), `values(b, V_b)` (softmax,
// P_b V_b issued, not waited), then block b + STAGES - 1's copy into block b - 1's stage (it runs
// under P_b V_b on the tensor cores); `segment_end(s0)` after each key segment. Every thread of
// the CTA calls this. PINGPONG (an experiment, bench/flash_wgmma.py `swz-pingpong`): one barrier a
// block, at which block b + 1 is copied into block b - 2's stage (both warpgroups waited for
// P_{b-2} V_{b-2} in block b - 1's scores), so a warpgroup may run up to a block ahead.
template <int D, int BN, int THREADS, int STAGES, int SEG, typename Scores, typename Values, typename SegmentEnd,
          bool PINGPONG = false>
__device__ __forceinline__ void walk_blocks_swizzled(u32 ring0, const bf16_t* kbase, const bf16_t* vbase,
                                                     size_t row_stride, int last, Scores scores, Values values,
                                                     SegmentEnd segment_end) {
    static_assert(!PINGPONG || STAGES >= 3, "block b + 1 goes into block b - 2's stage");
    constexpr u32 BLOCK_BYTES = BN * D * 2;
    auto load_pair = [&](int block) {  // K and V of `block` into its stage, one copy group (empty past last)
        if (block < last) {
            const u32 stage = ring0 + 2u * (block % STAGES) * BLOCK_BYTES;
            load_block_swizzled<D, BN, THREADS>(stage, kbase, row_stride, block);
            load_block_swizzled<D, BN, THREADS>(stage + BLOCK_BYTES, vbase, row_stride, block);
        }
        commit();
    };
    if constexpr (PINGPONG) {
        one_barrier_ring<SEG>(0, last, load_pair, [&](int b) {
            const u32 stage = ring0 + 2u * (b % STAGES) * BLOCK_BYTES;
            scores(b, stage);
            values(b, stage + BLOCK_BYTES);
        }, segment_end);
        return;
    }
    for (int p = 0; p < STAGES - 1; ++p) load_pair(p);
    for (int s0 = 0; s0 < last; s0 += SEG) {
        const int s1 = min(s0 + SEG, last);
        for (int b = s0; b < s1; ++b) {
            wait_groups<STAGES - 2>();
            wg_proxy_fence();  // cp.async writes, then wgmma reads
            __syncthreads();  // block b is in for every thread
            const u32 stage = ring0 + 2u * (b % STAGES) * BLOCK_BYTES;
            scores(b, stage);
            __syncthreads();  // every warpgroup is done with block b - 1
            values(b, stage + BLOCK_BYTES);
            load_pair(b + STAGES - 1);
        }
        segment_end(s0);
    }
    wait_groups<0>();
    __syncthreads();
}

// walk_blocks_swizzled's order with the copies by TMA: one thread issues a block's K and V (a box
// of 64 dims x 1 head x BN keys per 64-dim chunk: the 128-byte swizzle's layout, as
// load_block_swizzled writes it) against the stage's mbarrier, and every thread waits on that
// barrier (phase parity: the stage's use count) instead of its own copy group and a CTA barrier.
// The stage of block b - 1 is refilled right after the barrier that ends every warpgroup's S_b
// (each waited for its P_{b-1} V_{b-1} there), before block b's softmax. Tensor maps
// (attention_wgmma.tensor_map): dims (D, kv_heads, slots x capacity), box (64, 1, BN); row0 = the
// slot's first row.
template <int D, int BN, int STAGES, int SEG, typename Scores, typename Values, typename SegmentEnd>
__device__ __forceinline__ void walk_blocks_tma(u32 ring0, u32 bars, const TensorMap* kmap, const TensorMap* vmap,
                                                int h, int row0, int last, Scores scores, Values values,
                                                SegmentEnd segment_end) {
    constexpr u32 BLOCK_BYTES = BN * D * 2;
    const bool issuer = threadIdx.x == 0;
    if (issuer) {
#pragma unroll
        for (int i = 0; i < STAGES; ++i) mbar_init(bars + 8 * i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto load_pair = [&](int block) {  // by the issuer: K and V of `block` into its stage (nothing past last)
        if (block >= last) return;
        const u32 stage = ring0 + 2u * (block % STAGES) * BLOCK_BYTES, bar = bars + 8 * (block % STAGES);
        mbar_expect(bar, 2 * BLOCK_BYTES);
#pragma unroll
        for (int j = 0; j < D / 64; ++j) {
            tma_load_3d(stage + j * BN * 128, kmap, j * 64, h, row0 + block * BN, bar);
            tma_load_3d(stage + BLOCK_BYTES + j * BN * 128, vmap, j * 64, h, row0 + block * BN, bar);
        }
    };
    if (issuer)
        for (int p = 0; p < STAGES - 1; ++p) load_pair(p);
    for (int s0 = 0; s0 < last; s0 += SEG) {
        const int s1 = min(s0 + SEG, last);
        for (int b = s0; b < s1; ++b) {
            mbar_wait(bars + 8 * (b % STAGES), (b / STAGES) & 1);  // block b is in
            const u32 stage = ring0 + 2u * (b % STAGES) * BLOCK_BYTES;
            scores(b, stage);
            __syncthreads();  // every warpgroup is done with block b - 1
            if (issuer) load_pair(b + STAGES - 1);  // into block b - 1's stage, under the softmax
            values(b, stage + BLOCK_BYTES);
        }
        segment_end(s0);
    }
    __syncthreads();
}

// The walk of one CTA (8 warps: 2 warpgroups of 64 virtual rows). Every block of the CTA runs in
// both warpgroups (a divergent wgmma makes ptxas serialize them); a block past a warpgroup's rows
// is masked for them, the same bits as skipping it. PINGPONG (an experiment the backend does not
// use): the warpgroups take turns issuing their products (S_b of 0, S_b of 1, P_b V_b of 0, P_b V_b
// of 1: named barriers 1 and 2), so one's softmax can run under the other's products
// (FlashAttention-3's ping-pong), on walk_blocks_swizzled's one-barrier ring.
//
// With maps (kmap, vmap not null; not with PINGPONG) the K/V blocks come by TMA (walk_blocks_tma;
// kc / vc unused, row0 the slot's first row of the maps' tensors).
template <int D, int BN, int STAGES, bool PINGPONG = false>
__device__ __forceinline__ void wgmma_walk(const float* q, const float* qg, const bf16_t* kc, const bf16_t* vc,
                                           bf16_t* out, int rows, int start, int q_heads, int kv_heads, float scale,
                                           const TensorMap* kmap = nullptr, const TensorMap* vmap = nullptr,
                                           int row0 = 0) {
    constexpr int WARPS = 8;
    constexpr int THREADS = WARPS * 32;
    WalkWarp<D, BN, WARPS> w(q, rows, start, q_heads, kv_heads, scale);
    const Tile<WARPS, BN>& c = w.c;
    if (c.empty) return;
    const size_t row_stride = (size_t)kv_heads * D;
    extern __shared__ __align__(128) unsigned char smem_bytes[];
    const u32 base = smem_addr(smem_bytes);
    const u32 ring0 = base + ((1024 - (base & 1023)) & 1023);  // 1 KB more is launched
    constexpr u32 RING_BYTES = 2 * STAGES * BN * D * 2;         // then the 8 warps' running outputs
    float4* total = zeroed_total<D>(reinterpret_cast<bf16_t*>(smem_bytes + (ring0 - base) + RING_BYTES), c.warp,
                                    c.lane);

    const Turns<PINGPONG, THREADS> turns;
    turns.start();
    float s[BN / 8][4];
    auto scores = [&](int b, u32 k_addr) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        const unsigned long long k_desc = wg_desc_128b(k_addr, 16, 1024);
        turns.mine();
        wg_fence();
#pragma unroll
        for (int k = 0; k < D / 16; ++k)  // k-step k: chunk k / 4, 32 bytes a step inside it
            wgmma_s(reinterpret_cast<float(&)[BN / 2]>(s), w.qf[k],
                    wg_desc_plus(k_desc, (k / 4) * BN * 128 + (k % 4) * 32));
        wg_commit();
        turns.pass();
        wg_wait0();
        wg_keep<BN / 2>(&s[0][0]);
        wg_keep<D / 2>(&w.acc[0][0]);
    };
    auto values = [&](int b, u32 v_addr) {
        u32 pf[BN / 16][4];
        block_softmax<D, BN>(pf, s, w.m, w.l, w.acc, c.pos, b, b >= c.unmasked, w.scale2, c.t);
        const unsigned long long v_desc = wg_desc_128b(v_addr, BN * 128, 1024);
        turns.mine();
        wg_fence();
#pragma unroll
        for (int k = 0; k < BN / 16; ++k)  // keys 16 k..: the next 64 dims BN * 128 bytes on, 8 keys 1024
            wgmma_o(reinterpret_cast<float(&)[D / 2]>(w.acc), pf[k], wg_desc_plus(v_desc, k * 2048));
        wg_commit();
        turns.pass();
    };
    float M[2] = {NEG_INF, NEG_INF}, L[2] = {0.0f, 0.0f};
    auto fold_segment = [&](int s0) {
        wg_wait0();
        wg_keep<D / 2>(&w.acc[0][0]);
        if (s0 >= c.warp_blocks) return;
        fold_into_total<D>(total, M, L, w.acc, w.m, w.l);
        w.reset();
    };
    if (!PINGPONG && kmap != nullptr) {
        const u32 bars = ring0 + RING_BYTES + WARPS * 16 * D * 4;  // after the running outputs
        walk_blocks_tma<D, BN, STAGES, SEG_BLOCKS>(ring0, bars, kmap, vmap, c.h, row0, c.blocks, scores, values,
                                                   fold_segment);
    } else {
        walk_blocks_swizzled<D, BN, THREADS, STAGES, SEG_BLOCKS, decltype(scores), decltype(values),
                             decltype(fold_segment), PINGPONG>(ring0, kc + (size_t)c.h * D, vc + (size_t)c.h * D,
                                                               row_stride, c.blocks, scores, values, fold_segment);
    }
    turns.finish();
    write_gated<D>(out, qg, total, L, c.warp_first, c.g, c.t, c.vrows, c.group, c.h, q_heads);
}

// `lookahead`: the backend's walk (wgmma_walk) in FlashAttention-3's intra-warpgroup order (Shah et
// al., 2024, "FlashAttention-3", arXiv:2407.08608, section 3.2, Algorithm 2): the tensor cores run
// S_{b+1} = Q K_{b+1}^T and P_b V_b while the warps work out block b + 1's probabilities. Block b
// (S_b done and P_b worked out in the step before; P_{b-1} V_{b-1} done):
//   1. the copy group G_b = {K_{b+1}, V_b} in (cp.async wait, proxy fence) and ONE CTA barrier:
//      every thread's part of G_b is in, and every warpgroup is done with K_b and V_{b-1};
//   2. S_{b+1} issued, then P_b V_b, each its own wgmma group (S_{b+1} also past the last block, on a
//      stale slot, never read: a wgmma under a branch is serialized by ptxas, C7518);
//   3. G_{b+2} = {K_{b+3}, V_{b+2}} copied into K_b's and V_{b-1}'s slots, under the products;
//   4. wait for S_{b+1} only; block b + 1's scale, mask, max, P and l (block_probs), under P_b V_b;
//   5. wait for P_b V_b; O's rescale by block b + 1's alpha (rescale).
// After a segment's last block (and the last block), step 4 waits for both, folds the segment and
// then works out block b + 1 (the first of the next segment). O is read only after the wait that
// retires its P V (else ptxas serializes every wgmma, C7514), and P_b's registers are not written
// while P_b V_b reads them (block b + 1's P goes to other registers).
// K and V have their own slots (K_j and V_j in stage j % 3's halves, as the backend's ring), so K
// runs a block ahead of V in the same 96 KB ring, and a block needs one barrier, not two. Every
// product, its operands and its order, and every softmax and fold operation are the backend walk's,
// in the same order per row (but O's scale for a row with no key yet in its segment: 0 here, 1 in
// the backend's walk, FRESH_ONE; O and l are 0 there either way): every output bit the same. Opt-in (attention_wgmma.LOOKAHEAD_KERNEL,
// WARMSTATE_FLASH_LOOKAHEAD=1), its SASS checked on the CPU (tests/bench/test_sass.py). On the H200
// (session 35) its bits are the backend walk's, its softmax overlaps P V, and it is slower: 11.45
// against 10.55 ms at the 9B's 8192 rows from 24,576 keys (the backend's two warpgroups already
// overlap one's softmax with the other's products; this walk runs at 255 registers and spills).
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }

// wg_wait0 placed after the work that computes x. ptxas schedules a WARPGROUP.DEPBAR as early as it
// can (it reads no register), so a wait written after the softmax ran before it, in SASS, and
// nothing overlapped (session 33, cuobjdump -sass). A branch on x pins it: both paths wait, and x
// never has the bits 0xffffffff (x = l, a sum of products: a NaN from arithmetic is 0x7fffffff),
// so every thread of the warpgroup takes the first path, as wgmma.wait_group's .aligned asks.
__device__ __forceinline__ void wg_wait0_after(float x) {
    if (__float_as_uint(x) != 0xffffffffu)
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    else
        asm volatile("wgmma.wait_group.sync.aligned 0;  // the same wait, never taken" ::: "memory");
}

template <int D, int BN, int STAGES>
__device__ __forceinline__ void lookahead_walk(const float* q, const float* qg, const bf16_t* kc, const bf16_t* vc,
                                               bf16_t* out, int rows, int start, int q_heads, int kv_heads,
                                               float scale) {
    static_assert(STAGES == 3, "K_{b+3} goes into K_b's slot and V_{b+2} into V_{b-1}'s");
    constexpr int WARPS = 8;
    constexpr int THREADS = WARPS * 32;
    constexpr u32 BLOCK_BYTES = BN * D * 2;
    constexpr u32 RING_BYTES = 2 * STAGES * BLOCK_BYTES;
    WalkWarp<D, BN, WARPS> w(q, rows, start, q_heads, kv_heads, scale);
    const Tile<WARPS, BN>& c = w.c;
    if (c.empty) return;
    const size_t row_stride = (size_t)kv_heads * D;
    const bf16_t* kbase = kc + (size_t)c.h * D;
    const bf16_t* vbase = vc + (size_t)c.h * D;
    extern __shared__ __align__(128) unsigned char smem_bytes[];
    const u32 base = smem_addr(smem_bytes);
    const u32 ring0 = base + ((1024 - (base & 1023)) & 1023);  // 1 KB more is launched
    float4* total = zeroed_total<D>(reinterpret_cast<bf16_t*>(smem_bytes + (ring0 - base) + RING_BYTES), c.warp,
                                    c.lane);
    const int last = c.blocks;
    // 0 (q_heads, an int32 head count, is >= 0), a value ptxas cannot know. P V's A registers must not
    // be the registers the next block's P is written to while P V runs (else ptxas serializes every
    // wgmma, C7513). A plain `mov.b32 pf, pn` was enough for NVRTC 13.5's ptxas. NVRTC 13.0's (the GPU
    // machine's) propagated the copy: P V read pn itself, the softmax wrote it under P V, and every
    // wgmma was serialized (session 35: the walk 1.48x the mma.sync walk's speed against the backend
    // walk's 1.76x). pn ^ opaque_zero is a new value to both.
    const u32 opaque_zero = static_cast<u32>(q_heads) >> 31;
    auto k_slot = [&](int block) { return ring0 + 2u * (block % STAGES) * BLOCK_BYTES; };
    auto v_slot = [&](int block) { return ring0 + 2u * (block % STAGES) * BLOCK_BYTES + BLOCK_BYTES; };
    auto load_group = [&](int j) {  // G_j = {K_{j+1}, V_j}: one copy group, empty past the last block
        if (j + 1 < last) load_block_swizzled<D, BN, THREADS>(k_slot(j + 1), kbase, row_stride, j + 1);
        if (j >= 0 && j < last) load_block_swizzled<D, BN, THREADS>(v_slot(j), vbase, row_stride, j);
        commit();
    };
    float s[BN / 8][4];  // S of the block after the one whose P V runs
    auto issue_scores = [&](int b) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        wg_fence();
#pragma unroll
        for (int k = 0; k < D / 16; ++k)  // k-step k: chunk k / 4, 32 bytes a step inside it
            wgmma_s(reinterpret_cast<float(&)[BN / 2]>(s), w.qf[k],
                    wg_desc_128b(k_slot(b) + (k / 4) * BN * 128 + (k % 4) * 32, 16, 1024));
        wg_commit();
    };
    u32 pn[BN / 16][4];  // P of the next block, as block_probs gives it
    float alpha[2];
    auto probs = [&](int b) {  // block b's softmax, but for O's rescale (S_b in s)
        block_probs<BN, false>(pn, alpha, s, w.m, w.l, c.pos, b, b >= c.unmasked, w.scale2, c.t);
    };
    // the running (M, L) of the warp's 16 rows in shared memory after the O totals (1 KB in all; out
    // of the registers, which the walk needs all of): row r's at ml[2 r], ml[2 r + 1]; each quad's
    // four threads hold the same values, its thread t = 0 writes them
    float* ml = reinterpret_cast<float*>(smem_bytes + (ring0 - base) + RING_BYTES + WARPS * 16 * D * 4) + c.warp * 32;
    if (c.t == 0) {
        ml[2 * c.g] = ml[2 * (c.g + 8)] = NEG_INF;
        ml[2 * c.g + 1] = ml[2 * (c.g + 8) + 1] = 0.0f;
    }
    __syncwarp();
    auto fold_segment = [&]() {
        float M[2] = {ml[2 * c.g], ml[2 * (c.g + 8)]}, L[2] = {ml[2 * c.g + 1], ml[2 * (c.g + 8) + 1]};
        fold_into_total<D>(total, M, L, w.acc, w.m, w.l);
        __syncwarp();
        if (c.t == 0) {
            ml[2 * c.g] = M[0];
            ml[2 * (c.g + 8)] = M[1];
            ml[2 * c.g + 1] = L[0];
            ml[2 * (c.g + 8) + 1] = L[1];
        }
        __syncwarp();
    };
    load_group(-1);  // K_0
    load_group(0);   // K_1, V_0
    load_group(1);   // K_2, V_1
    wait_groups<2>();
    wg_proxy_fence();
    __syncthreads();
    issue_scores(0);
    wg_wait0();
    wg_keep<BN / 2>(&s[0][0]);
    probs(0);
    rescale<D>(w.acc, alpha);
    for (int b = 0; b < last; ++b) {
        wait_groups<1>();  // G_b in (G_{b+1} may not be)
        wg_proxy_fence();  // cp.async writes, then wgmma reads
        __syncthreads();
        u32 pf[BN / 16][4];
#pragma unroll
        for (int k = 0; k < BN / 16; ++k)
#pragma unroll
            for (int e = 0; e < 4; ++e)  // P V's A registers: pn ^ 0, a new value, not a copy (see `opaque_zero`)
                asm volatile("xor.b32 %0, %1, %2;" : "=r"(pf[k][e]) : "r"(pn[k][e]), "r"(opaque_zero));
        issue_scores(b + 1);
        wg_fence();
#pragma unroll
        for (int k = 0; k < BN / 16; ++k)  // keys 16 k..: the next 64 dims BN * 128 bytes on, 8 keys 1024
            wgmma_o(reinterpret_cast<float(&)[D / 2]>(w.acc), pf[k], wg_desc_128b(v_slot(b) + k * 2048, BN * 128, 1024));
        wg_commit();
        load_group(b + 2);  // issued under the products, not before them
        if ((b + 1) % SEG_BLOCKS != 0 && b + 1 < last) {  // block b + 1 in the same segment
            wg_wait1();  // S_{b+1}
            wg_keep<BN / 2>(&s[0][0]);
            probs(b + 1);
            wg_wait0_after(w.l[0]);  // P_b V_b
            wg_keep<D / 2>(&w.acc[0][0]);
            rescale<D>(w.acc, alpha);
        } else {  // the segment's last block: fold it, then block b + 1 starts the next
            wg_wait0();
            wg_keep<BN / 2>(&s[0][0]);
            wg_keep<D / 2>(&w.acc[0][0]);
            if (b - b % SEG_BLOCKS < c.warp_blocks) {  // the segment reaches the warp's rows
                fold_segment();
                w.reset();
            }
            if (b + 1 < last) {
                probs(b + 1);
                rescale<D>(w.acc, alpha);
            }
        }
    }
    wait_groups<0>();
    __syncthreads();
    // the tile again from the arguments (as opaque values, so not merged with c): what only the
    // gated write needs is not kept in registers through the walk
    int rows2, start2, q2, kv2;
    asm volatile("mov.b32 %0, %1;" : "=r"(rows2) : "r"(rows));
    asm volatile("mov.b32 %0, %1;" : "=r"(start2) : "r"(start));
    asm volatile("mov.b32 %0, %1;" : "=r"(q2) : "r"(q_heads));
    asm volatile("mov.b32 %0, %1;" : "=r"(kv2) : "r"(kv_heads));
    const Tile<WARPS, BN> e(rows2, start2, q2, kv2);
    const float L[2] = {ml[2 * e.g + 1], ml[2 * (e.g + 8) + 1]};
    write_gated<D>(out, qg, total, L, e.warp_first, e.g, e.t, e.vrows, e.group, e.h, q2);
}

// The launchable lookahead walk: flash_wgmma_prefill_256's grid, threads and arguments;
// attention_wgmma.LOOKAHEAD_SHARED_BYTES (SHARED_BYTES and the running (M, L) rows).
extern "C" __global__ void __launch_bounds__(256, 1)
    flash_wgmma_lookahead_prefill_256(const float* q, const float* qg, const bf16_t* kc, const bf16_t* vc,
                                      long long slot_bytes, bf16_t* out, const int* meta, int q_heads, int kv_heads,
                                      float scale) {
    const size_t slot = (size_t)meta[2] * (size_t)slot_bytes / sizeof(bf16_t);
    lookahead_walk<256, 32, 3>(q, qg, kc + slot, vc + slot, out, meta[0], meta[1], q_heads, kv_heads, scale);
}

// The launchable walk at head_dim 256 (grid: tiles of 128 virtual rows, kv_heads; 256 threads;
// attention_wgmma.SHARED_BYTES of dynamic shared memory). meta (i32 device [3]) = (rows in use,
// start, slot), read here so a captured chunk replays with other values; kc / vc: one layer's
// caches, slot s at s * slot_bytes; CTAs whose tile starts past the rows in use return at once (a
// padded grid).
extern "C" __global__ void __launch_bounds__(256, 1)
    flash_wgmma_prefill_256(const float* q, const float* qg, const bf16_t* kc, const bf16_t* vc, long long slot_bytes,
                            bf16_t* out, const int* meta, int q_heads, int kv_heads, float scale) {
    const size_t slot = (size_t)meta[2] * (size_t)slot_bytes / sizeof(bf16_t);
    wgmma_walk<256, 32, 3>(q, qg, kc + slot, vc + slot, out, meta[0], meta[1], q_heads, kv_heads, scale);
}

// The walk with its K/V blocks by TMA (walk_blocks_tma): the same grid, threads and arguments as
// flash_wgmma_prefill_256 but the caches as tensor maps over [slots x capacity, kv_heads, 256]
// bf16 (attention_wgmma.tensor_map) and `capacity` (rows a slot) for the slot's first row;
// attention_wgmma.TMA_SHARED_BYTES (the STAGES mbarriers after the running outputs).
extern "C" __global__ void __launch_bounds__(256, 1)
    flash_wgmma_tma_prefill_256(const __grid_constant__ TensorMap kmap, const __grid_constant__ TensorMap vmap,
                                const float* q, const float* qg, int capacity, bf16_t* out, const int* meta,
                                int q_heads, int kv_heads, float scale) {
    wgmma_walk<256, 32, 3>(q, qg, nullptr, nullptr, out, meta[0], meta[1], q_heads, kv_heads, scale, &kmap, &vmap,
                           meta[2] * capacity);
}
