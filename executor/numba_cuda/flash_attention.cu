// Prefill attention in one pass on the tensor cores (FlashAttention-2's loop: Dao, 2023,
// "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning",
// arXiv:2307.08691, Algorithm 1), written for warmstate's exactness rules.
//
// Called from a numba kernel (attention_flash.py) through numba-cuda's `link=`: the
// entry points are `extern "C" __device__` with numba's calling convention
// (int status return, first argument a pointer to the result), compiled by NVRTC.
//
// One CTA: WARPS warps, 16 "virtual rows" each; virtual row v of K/V head h is query row
// v / group of the chunk and query head h * group + v % group (the layout of
// attention_mm.py), so a CTA's warps share every K/V block they load. Keys go in blocks of
// BN = 32 rows anchored at key 0; K_b and V_b are copied to shared memory with cp.async,
// V_b while S = Q K_b^T runs and K_{b+1} while the softmax and P V_b run. The products
// are mma.sync.m16n8k16 (bf16 in, fp32 accumulate; fragments through ldmatrix, V's
// transposed). Scores are kept in log2 units (x = s * scale * log2 e) and a row's softmax
// is online over the blocks of a key segment (SEG_BLOCKS blocks, anchored at key 0) in
// ascending order with a lazy max: m = blockmax when m = -inf or blockmax > m + LAZY_LOG2 (8),
// else m stays, alpha = 2^(m_old - m), p = bf16(2^(x - m)) <= 256 (ex2.approx, cvt.rn.bf16x2),
// l = l * alpha + sum(p), O = O * alpha + P V; the O rescale is skipped when no row of the warp
// moved its m (alpha = 1 exactly: the same bits), which the lazy max makes the rule, and the
// causal mask is applied only on blocks that reach past the warp's first position. The
// segments' (m, l, O) are then folded in ascending order (`fold`): in the CTA that walks
// them all (a long chunk), or, for a short chunk whose few CTAs would leave most SMs idle
// while each walks every block, by `flash_combine` over the partials of CTAs that take one
// segment each (`flash_split`): the same operations in the same order, so the same bits.
//
// Exactness (DESIGN "invariant grid"): a row's bits depend only on its position, its
// head and the cache. Its keys, blocks, block order and every reduction order (a thread's
// columns in a fixed order, then the quad's xor-1 and xor-2 shuffles) are the same
// whatever chunk, tile or warp it sits in; a block past the row's position (processed
// because another row of the warp needs it) has every x = -inf, so m and l are unchanged,
// alpha = 2^0 = 1 and P = 0 adds exact zeros: same bits as not processing it; a segment
// wholly past it (walked because a warp-mate needs it) leaves m = -inf and folds with c1 = 1,
// c2 = 0, which changes no bit, and `flash_combine` never reads it. Rows of one mma never mix
// (row i of D reads row i of A only), so neither the warps a CTA has, nor the rows beside a
// row in its CTA, nor whether its segments are split over CTAs change its bits. One
// exception is left, in the sign of a zero only: an output element that is exactly -0 (every
// product p v of the row in that column -0, or an O scaled below the smallest float) turns
// +0 when an exact zero is added to it, which a masked block or an empty segment does for
// some chunkings and not others. No such element was ever seen; a review found it (session 20).
//
// Shapes (all row-major, C-contiguous): q f32 [rows, q_heads, D] (after QK-norm and
// RoPE); qg f32 [rows, q_heads * 2 * D] (the gate is the second half of each head);
// kc, vc bf16 bits [capacity, kv_heads, D] (one slot of one layer; keys [0, start + rows)
// written and every row below a multiple of BN past them finite); out bf16 bits
// [rows, q_heads * D] = bf16((O / l) / (1 + exp(-gate))).

typedef unsigned short bf16_t;
typedef unsigned int u32;

#define NEG_INF __int_as_float(0xff800000)
// The lazy max's margin in log2 units (block_probs): a row's running m moves only when a block's
// top score passes it by more than this, so p <= 2^8 (FlashAttention-4's conditional rescale,
// flash-attn's CuTe DSL kernels for Blackwell: the same 8.0). bf16 p keeps its 8 significant
// bits at any scale; l and O (fp32) grow by at most 256x over a max-subtracted softmax.
#define LAZY_LOG2 8.0f

// Two floats to packed bf16 (lo in the low half), round to nearest even: one cvt.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// 2^x (MUFU.EX2; flush-to-zero: exact zeros for the masked keys and for x < -126).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 addr;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(p));
    return addr;
}

__device__ __forceinline__ void copy16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::); }

template <int N>
__device__ __forceinline__ void wait_groups() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ void ldsm4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void ldsm2(u32& r0, u32& r1, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(addr));
}

__device__ __forceinline__ void ldsm4t(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void mma(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Copy keys [block * BN, block * BN + BN) of one K/V head into dst [BN, LDS] (the caller
// commits the group).
template <int D, int BN, int THREADS>
__device__ __forceinline__ void load_block(bf16_t* dst, const bf16_t* src, size_t row_stride, int block) {
    constexpr int LDS = D + 8;
    constexpr int PIECES = D / 8;
#pragma unroll
    for (int c = threadIdx.x; c < BN * PIECES; c += THREADS) {
        int key = c / PIECES, piece = c % PIECES;
        copy16(smem_addr(dst + key * LDS + piece * 8), src + (size_t)(block * BN + key) * row_stride + piece * 8);
    }
}

// Virtual rows g and g + 8 of the warp (clamped to the last): their chunk row and query head.
__device__ __forceinline__ void row_pair(int (&vr)[2], int (&row)[2], int (&head)[2], int warp_first, int g,
                                         int vrows, int group, int h) {
    vr[0] = warp_first + g;
    vr[1] = warp_first + g + 8;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int v = min(vr[r], vrows - 1);
        row[r] = v / group;
        head[r] = h * group + v % group;
    }
}

// The warp's Q fragments (bf16 of the f32 rows) for S = Q K^T.
template <int D>
__device__ __forceinline__ void load_q(u32 (&qf)[D / 16][4], const float* q, const int* row, const int* head,
                                       int q_heads, int t) {
    const float* q0 = q + ((size_t)row[0] * q_heads + head[0]) * D + 2 * t;
    const float* q1 = q + ((size_t)row[1] * q_heads + head[1]) * D + 2 * t;
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
        float2 a = *reinterpret_cast<const float2*>(q0 + k * 16);
        float2 b = *reinterpret_cast<const float2*>(q1 + k * 16);
        float2 c = *reinterpret_cast<const float2*>(q0 + k * 16 + 8);
        float2 e = *reinterpret_cast<const float2*>(q1 + k * 16 + 8);
        qf[k][0] = pack2(a.x, a.y);
        qf[k][1] = pack2(b.x, b.y);
        qf[k][2] = pack2(c.x, c.y);
        qf[k][3] = pack2(e.x, e.y);
    }
}

// S = Q K_b^T for the warp's 16 rows against the block in shared memory at k_lane.
template <int D, int BN>
__device__ __forceinline__ void block_scores(float (&s)[BN / 8][4], const u32 (&qf)[D / 16][4], u32 k_lane) {
    constexpr int LDS = D + 8;
    constexpr int KSTEPS = D / 16;
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int k = 0; k + 1 < KSTEPS; k += 2) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            u32 b0, b1, b2, b3;
            ldsm4(b0, b1, b2, b3, k_lane + 2u * (n * 8 * LDS + k * 16));
            mma(s[n], qf[k], b0, b1);
            mma(s[n], qf[k + 1], b2, b3);
        }
    }
    if (KSTEPS % 2) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            u32 b0, b1;
            ldsm2(b0, b1, k_lane + 2u * (n * 8 * LDS + (KSTEPS - 1) * 16));
            mma(s[n], qf[KSTEPS - 1], b0, b1);
        }
    }
}

// The online softmax over block b: scale and mask S, move m (lazily) and l, give P as bf16 A fragments
// and O's scale alpha (O itself is not touched: `rescale`). FRESH_ONE: alpha = 1, not 0, for a
// row whose segment had no key before the block (the same bits, below); the lookahead walk keeps
// 0, since ptxas then moves the two alphas' exponentials out of its overlap window (16 of 18
// left there, session 36).
template <int BN, bool FRESH_ONE = true>
__device__ __forceinline__ void block_probs(u32 (&pf)[BN / 16][4], float (&alpha)[2], float (&s)[BN / 8][4],
                                            float (&m)[2], float (&l)[2], const int* pos, int b, bool masked,
                                            float scale2, int t) {
    constexpr int ST = BN / 8;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float top = NEG_INF;
#pragma unroll
        for (int n = 0; n < ST; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float x = __fmul_rn(s[n][2 * r + e], scale2);  // _rn: never fused, whatever the path
                if (masked && b * BN + n * 8 + 2 * t + e > pos[r]) x = NEG_INF;
                s[n][2 * r + e] = x;
                top = fmaxf(top, x);
            }
        }
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
        // The lazy max (FlashAttention-4's conditional rescale): m moves only when the block's
        // top passes it by more than LAZY_LOG2, so p = 2^(x - m) <= 2^LAZY_LOG2 = 256 and O, l
        // keep their scale (alpha = 1) on nearly every block. A row with no key yet (m = -inf)
        // takes the top. (The segments' fold needs no max: any m a segment's p are relative to
        // folds the same way.)
        const float fresh = m[r] == NEG_INF || top > __fadd_rn(m[r], LAZY_LOG2) ? top : m[r];
        // a row with no key yet in its segment (every x = -inf so far): base 0, so p = 0 (not
        // 2^(-inf + inf) = NaN); any other row: base = its m
        const float base = fresh == NEG_INF ? 0.0f : fresh;
        // alpha: exactly 1 when m holds. A row whose segment had no key before this block
        // (m = -inf: its first block, or every key so far masked) has l = 0 and O = 0 (reset, then
        // only p = 0 added; K and V finite, as everywhere here), so scaling them by 2^(-inf) = 0 or
        // by 1 gives the same bits; 1 lets
        // `rescale` skip O when every row of the warp starts its segment here (bench/RESULTS.md,
        // session 36: 0.98x the wgmma walk's time at 9B's long chunks, the same bits).
        alpha[r] = FRESH_ONE && m[r] == NEG_INF ? 1.0f : exp2_approx(__fsub_rn(m[r], base));
        m[r] = fresh;
        float total = 0.0f;
#pragma unroll
        for (int n = 0; n < ST; ++n) {
            const u32 p = pack2(exp2_approx(__fsub_rn(s[n][2 * r], base)),
                                exp2_approx(__fsub_rn(s[n][2 * r + 1], base)));
            total += __uint_as_float(p << 16);
            total += __uint_as_float(p & 0xFFFF0000u);
            // A fragment of P for k-step n / 2: a0/a1 rows g / g+8 keys 2t.., a2/a3 keys 8+2t..
            pf[n / 2][(n % 2) * 2 + r] = p;
        }
        l[r] = __fadd_rn(__fmul_rn(l[r], alpha[r]), total);
    }
}

// O *= alpha, skipped when every row of the warp kept its m (alpha = 1: the same bits).
template <int D>
__device__ __forceinline__ void rescale(float (&acc)[D / 8][4], const float (&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            acc[n][0] *= alpha[0];
            acc[n][1] *= alpha[0];
            acc[n][2] *= alpha[1];
            acc[n][3] *= alpha[1];
        }
    }
}

// The online softmax over block b: `block_probs`, then O's `rescale`.
template <int D, int BN>
__device__ __forceinline__ void block_softmax(u32 (&pf)[BN / 16][4], float (&s)[BN / 8][4], float (&m)[2],
                                              float (&l)[2], float (&acc)[D / 8][4], const int* pos, int b,
                                              bool masked, float scale2, int t) {
    float alpha[2];
    block_probs<BN>(pf, alpha, s, m, l, pos, b, masked, scale2, t);
    rescale<D>(acc, alpha);
}

// O += P V_b for the block in shared memory at v_lane.
template <int D, int BN>
__device__ __forceinline__ void block_values(float (&acc)[D / 8][4], const u32 (&pf)[BN / 16][4], u32 v_lane) {
    constexpr int LDS = D + 8;
#pragma unroll
    for (int k = 0; k < BN / 16; ++k) {
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            u32 b0, b1, b2, b3;
            ldsm4t(b0, b1, b2, b3, v_lane + 2u * (k * 16 * LDS + n * 8));
            mma(acc[n], pf[k], b0, b1);
            mma(acc[n + 1], pf[k], b2, b3);
        }
    }
}

// The fold of one key segment's (m_s, l_s, O_s) into a row's running (M, L, O): the same
// code in the CTA that walks every segment (`flash_prefill<..., SPLIT = false>`, O in shared
// memory) and in `flash_combine` (the partials of the CTAs of a split): M' = max(M, m_s),
// c1 = 2^(M - M'), c2 = 2^(m_s - M'), L = L c1 + l_s c2, O = O c1 + O_s c2, never contracted.
// The first fold (M = -inf: c1 = 0, c2 = 1) gives the segment's own (l_s, O_s) exactly.
__device__ __forceinline__ void fold_factors(float& M, float m_s, float& c1, float& c2) {
    const float fresh = fmaxf(M, m_s);
    c1 = exp2_approx(__fsub_rn(M, fresh));
    c2 = exp2_approx(__fsub_rn(m_s, fresh));
    M = fresh;
}

__device__ __forceinline__ float fold(float total, float part, float c1, float c2) {
    return __fadd_rn(__fmul_rn(total, c1), __fmul_rn(part, c2));
}

// The gated output of one element: (O / L) / (1 + e^-gate), as ops.sigmoid_gate.
__device__ __forceinline__ float gated(float o, float l, float gate) {
    return __fdiv_rn(__fdiv_rn(o, l), __fadd_rn(1.0f, expf(-gate)));
}

// l summed over the quad (the four threads of a row): xor-1, then xor-2.
__device__ __forceinline__ float quad_sum(float l) {
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    return l;
}

// The thread's part of its warp's O total in shared memory from `base` (D / 8 float4 at
// [n * 32], n the column tile; warps one after another), zeroed.
template <int D>
__device__ __forceinline__ float4* zeroed_total(bf16_t* base, int warp, int lane) {
    float4* total = reinterpret_cast<float4*>(base) + warp * (D / 8) * 32 + lane;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) total[n * 32] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    return total;
}

// The segment's factors for the thread's two rows (fold_factors), with L folded: c1 scales the
// running total, c2 the segment's part.
__device__ __forceinline__ void fold_rows(float (&c1)[2], float (&c2)[2], float (&M)[2], float (&L)[2],
                                          const float (&m)[2], const float (&l)[2]) {
    const float ls[2] = {quad_sum(l[0]), quad_sum(l[1])};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        fold_factors(M[r], m[r], c1[r], c2[r]);
        L[r] = fold(L[r], ls[r], c1[r], c2[r]);
    }
}

// The fold of a segment's (m, l, O) (registers, O as the warp's mma accumulator fragments) into
// the warp's running (M, L) (registers) and O total (shared memory, `total[n * 32]` the float4 of
// column tile n): see `fold_factors`. No key of a row in the segment (m = -inf): c1 = 1, c2 = 0,
// O_s = l_s = 0, so the fold changes no bit (but a -0 in O: see the header).
template <int D>
__device__ __forceinline__ void fold_into_total(float4* total, float (&M)[2], float (&L)[2], const float (&acc)[D / 8][4],
                                                const float (&m)[2], const float (&l)[2]) {
    float c1[2], c2[2];
    fold_rows(c1, c2, M, L, m, l);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        float4 o = total[n * 32];
        o.x = fold(o.x, acc[n][0], c1[0], c2[0]);
        o.y = fold(o.y, acc[n][1], c1[0], c2[0]);
        o.z = fold(o.z, acc[n][2], c1[1], c2[1]);
        o.w = fold(o.w, acc[n][3], c1[1], c2[1]);
        total[n * 32] = o;
    }
}

// out (bf16 [rows, q_heads * D]) of the warp's two rows g and g + 8 from its O total and L:
// (O / L) gated by qg's second half of each head (`gated`).
template <int D>
__device__ __forceinline__ void write_gated(bf16_t* out, const float* qg, const float4* total, const float (&L)[2],
                                            int warp_first, int g, int t, int vrows, int group, int h, int q_heads) {
    const size_t gate_stride = (size_t)q_heads * 2 * D;
    const size_t out_stride = (size_t)q_heads * D;
    int vr[2], row[2], head[2];
    row_pair(vr, row, head, warp_first, g, vrows, group, h);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (vr[r] >= vrows) continue;
        const float* gate = qg + row[r] * gate_stride + (size_t)head[r] * 2 * D + D + 2 * t;
        u32* dst = reinterpret_cast<u32*>(out + row[r] * out_stride + (size_t)head[r] * D + 2 * t);
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            const float4 o = total[n * 32];
            dst[n * 4] = pack2(gated(r ? o.z : o.x, L[r], gate[n * 8]), gated(r ? o.w : o.y, L[r], gate[n * 8 + 1]));
        }
    }
}

// The CTA's walk over key blocks [first, last) through a ring of STAGES (K, V) block pairs in
// dynamic shared memory, blocks b + 1 .. b + STAGES - 1 in flight while block b runs (one
// barrier a block): a short chunk has a CTA or two per SM and nothing else to hide the copies'
// latency behind. `step(b, k_lane, v_lane)` runs block b for the warp (the caller skips the
// blocks its rows do not reach); `segment_end(s0)` runs after the blocks of the key segment
// that starts at block s0 (`first` is a segment's first block). Segments are an outer loop,
// not a test in the block loop: there the compiler if-converted the fold and the reset into
// every block (20% of a long chunk's time, H200). Every thread of the CTA calls this.
template <int D, int BN, int THREADS, int STAGES, int SEG, typename Step, typename SegmentEnd>
__device__ __forceinline__ void walk_blocks(bf16_t* ring, const bf16_t* kbase, const bf16_t* vbase,
                                            size_t row_stride, int first, int last, u32 k_off, u32 v_off,
                                            Step step, SegmentEnd segment_end) {
    constexpr int BLOCK = BN * (D + 8);  // elements of one K or V block in shared memory
    const u32 ring0 = smem_addr(ring);
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) {  // prologue: blocks first .. first + STAGES - 2, one group each
        if (first + p < last) {
            load_block<D, BN, THREADS>(ring + (2 * p) * BLOCK, kbase, row_stride, first + p);
            load_block<D, BN, THREADS>(ring + (2 * p + 1) * BLOCK, vbase, row_stride, first + p);
        }
        commit();
    }
    for (int s0 = first; s0 < last; s0 += SEG) {
        const int s1 = min(s0 + SEG, last);
        for (int b = s0; b < s1; ++b) {
            wait_groups<STAGES - 2>();  // block b's group is in (STAGES - 1 + b - first groups committed)
            __syncthreads();            // ... for every thread; every warp is done with block b - 1
            const int next = b + STAGES - 1;  // into block b - 1's stage
            if (next < last) {
                const int stage = (next - first) % STAGES;
                load_block<D, BN, THREADS>(ring + (2 * stage) * BLOCK, kbase, row_stride, next);
                load_block<D, BN, THREADS>(ring + (2 * stage + 1) * BLOCK, vbase, row_stride, next);
            }
            commit();  // empty past the last block: the group count stays b - first + STAGES
            const int stage = (b - first) % STAGES;
            step(b, ring0 + 2u * (2 * stage) * BLOCK + k_off, ring0 + 2u * (2 * stage + 1) * BLOCK + v_off);
        }
        segment_end(s0);
    }
    wait_groups<0>();
    __syncthreads();  // the ring is free for the next walk
}

// Keys go in segments of SEG_BLOCKS blocks (SEG_BLOCKS * BN keys) anchored at key 0. A row's
// softmax runs online over the blocks of each segment (m, l, O from zero at its start) and the
// segments are folded in ascending order (`fold`), whatever the chunk: so a short chunk can
// spread its segments over CTAs (SPLIT: CTA z of the grid's z-dimension takes segments z,
// z + gridDim.z, ... and writes each segment's (m, l, O) to the partials, which
// `flash_combine` folds) and give every row the bits of a long chunk, whose CTAs walk every
// segment and fold as they go (not SPLIT: O's running total in shared memory, 16 KB a warp at
// head_dim 256, M and L in registers).
#define SEG_BLOCKS 16

// The partials of a split (f32, row-major): o [segments, pstride, q_heads, D] and ml
// [segments, pstride, q_heads, 2] = (m in log2 units, l), rows at their chunk row.
template <int D, int WARPS, int BN, int STAGES, bool SPLIT>
__device__ __forceinline__ void flash_prefill(const float* q, const float* qg, const bf16_t* kc, const bf16_t* vc,
                                              bf16_t* out, float* po, float* pml, int pstride, int rows, int start,
                                              int q_heads, int kv_heads, float scale) {
    constexpr int THREADS = WARPS * 32;
    constexpr int BLOCK = BN * (D + 8);

    const int group = q_heads / kv_heads;
    const int h = blockIdx.y;
    const int tile = gridDim.x - 1 - blockIdx.x;  // longest tiles first
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, t = lane & 3;
    const int vrows = rows * group;
    const int cta_first = tile * WARPS * 16;
    const int cta_last = min(cta_first + WARPS * 16, vrows) - 1;
    const int blocks = (start + cta_last / group) / BN + 1;
    const int warp_first = cta_first + warp * 16;
    const int warp_blocks = warp_first < vrows ? (start + min(warp_first + 15, vrows - 1) / group) / BN + 1 : 0;
    // blocks wholly at or below the warp's first position need no mask
    const int unmasked = warp_first < vrows ? (start + warp_first / group + 1) / BN : 0;
    const float scale2 = scale * 1.4426950408889634f;  // scores in log2 units: exp(x) = 2^(x log2 e)
    int pos[2];
    u32 qf[D / 16][4];
    {
        int vr[2], row[2], head[2];  // not kept through the loop: the writes work them out again
        row_pair(vr, row, head, warp_first, g, vrows, group, h);
        pos[0] = start + row[0];
        pos[1] = start + row[1];
        load_q<D>(qf, q, row, head, q_heads, t);
    }
    float acc[D / 8][4];
    float m[2], l[2];  // the segment's running m (the lazy max, log2 units) and this thread's share of its sum

    const size_t row_stride = (size_t)kv_heads * D;
    const bf16_t* kbase = kc + (size_t)h * D;
    const bf16_t* vbase = vc + (size_t)h * D;
    // ldmatrix row offsets (bytes): K non-transposed (matrix j = lane / 8 covers dims
    // 8j..8j+7 of two k-steps), V transposed (matrices: keys +0 / +8, dims +0 / +8).
    const u32 k_off = 2u * ((lane & 7) * (D + 8) + (lane >> 3) * 8);
    const u32 v_off = 2u * (((lane & 7) + ((lane >> 3) & 1) * 8) * (D + 8) + (lane >> 4) * 8);
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    bf16_t* ring = reinterpret_cast<bf16_t*>(smem_bytes);  // STAGES x (K block, V block)

    auto reset = [&]() {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
        m[0] = m[1] = NEG_INF;
        l[0] = l[1] = 0.0f;
    };
    auto run = [&](int b, u32 k_lane, u32 v_lane) {
        if (b >= warp_blocks) return;
        float s[BN / 8][4];
        block_scores<D, BN>(s, qf, k_lane);
        u32 pf[BN / 16][4];
        block_softmax<D, BN>(pf, s, m, l, acc, pos, b, b >= unmasked, scale2, t);
        block_values<D, BN>(acc, pf, v_lane);
    };
    const int segments = (blocks + SEG_BLOCKS - 1) / SEG_BLOCKS;  // the CTA's

    if constexpr (SPLIT) {
        for (int seg = blockIdx.z; seg < segments; seg += gridDim.z) {
            const int first = seg * SEG_BLOCKS;
            reset();
            walk_blocks<D, BN, THREADS, STAGES, SEG_BLOCKS>(ring, kbase, vbase, row_stride, first,
                                                            min(first + SEG_BLOCKS, blocks), k_off, v_off, run,
                                                            [](int) {});
            if (first >= warp_blocks) continue;  // no row of the warp reaches the segment
            const float ls[2] = {quad_sum(l[0]), quad_sum(l[1])};
            int vr[2], row[2], head[2];
            row_pair(vr, row, head, warp_first, g, vrows, group, h);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                if (vr[r] >= vrows) continue;
                const size_t at = ((size_t)seg * pstride + row[r]) * q_heads + head[r];
                float2* dst = reinterpret_cast<float2*>(po + at * D + 2 * t);
#pragma unroll
                for (int n = 0; n < D / 8; ++n) dst[n * 4] = make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
                if (t == 0) *reinterpret_cast<float2*>(pml + 2 * at) = make_float2(m[r], ls[r]);
            }
        }
    } else {
        // O's running total: thread-private, acc[n] as the float4 [n][lane] of its warp's part
        // (a warp's 16-byte accesses to one n are consecutive: no bank conflict; 4-wide, so a
        // fold is 32 shared round trips a thread, not 128: with every register taken by O and
        // Q, they barely overlap)
        float4* total = zeroed_total<D>(ring + 2 * STAGES * BLOCK, warp, lane);
        float M[2] = {NEG_INF, NEG_INF}, L[2] = {0.0f, 0.0f};
        reset();
        auto fold_segment = [&](int s0) {
            if (s0 >= warp_blocks) return;  // no row of the warp reaches the segment
            fold_into_total<D>(total, M, L, acc, m, l);
            reset();
        };
        walk_blocks<D, BN, THREADS, STAGES, SEG_BLOCKS>(ring, kbase, vbase, row_stride, 0, blocks, k_off, v_off, run,
                                                        fold_segment);
        write_gated<D>(out, qg, total, L, warp_first, g, t, vrows, group, h, q_heads);
    }
}

// The fold of a split's partials: CTA (row, head) of the chunk, D / 2 threads of two elements;
// segments 0 .. (start + row) / (SEG_BLOCKS * BN), every one of which holds a key of the row.
template <int D, int BN>
__device__ __forceinline__ void flash_combine(const float* po, const float* pml, const float* qg, bf16_t* out,
                                              int pstride, int rows, int start, int q_heads) {
    const int row = blockIdx.x, head = blockIdx.y, e = 2 * threadIdx.x;
    if (row >= rows) return;
    const int last = (start + row) / (SEG_BLOCKS * BN);
    float M = NEG_INF, L = 0.0f, o0 = 0.0f, o1 = 0.0f;
    for (int seg = 0; seg <= last; ++seg) {
        const size_t at = ((size_t)seg * pstride + row) * q_heads + head;
        const float2 ml = *reinterpret_cast<const float2*>(pml + 2 * at);
        const float2 o = *reinterpret_cast<const float2*>(po + at * D + e);
        float c1, c2;
        fold_factors(M, ml.x, c1, c2);
        L = fold(L, ml.y, c1, c2);
        o0 = fold(o0, o.x, c1, c2);
        o1 = fold(o1, o.y, c1, c2);
    }
    const float* gate = qg + (size_t)row * q_heads * 2 * D + (size_t)head * 2 * D + D + e;
    *reinterpret_cast<u32*>(out + (size_t)row * q_heads * D + (size_t)head * D + e) =
        pack2(gated(o0, L, gate[0]), gated(o1, L, gate[1]));
}

// Entry points: numba's ABI (status return, result pointer first); pointers and counts
// as int64 (what numba types a Python int as), the scale as float32.
#define FLASH_ENTRY(D, WARPS, BN, STAGES, SPLIT, NAME)                                                             \
    extern "C" __device__ int NAME##_##D##_##WARPS##_##BN##_##STAGES(                                              \
        int* result, long long q, long long qg, long long kc, long long vc, long long out, long long po,          \
        long long pml, long long pstride, long long rows, long long start, long long q_heads, long long kv_heads,  \
        float scale) {                                                                                             \
        flash_prefill<D, WARPS, BN, STAGES, SPLIT>(                                                                \
            reinterpret_cast<const float*>(q), reinterpret_cast<const float*>(qg),                                 \
            reinterpret_cast<const bf16_t*>(kc), reinterpret_cast<const bf16_t*>(vc), reinterpret_cast<bf16_t*>(out), \
            reinterpret_cast<float*>(po), reinterpret_cast<float*>(pml), (int)pstride, (int)rows, (int)start,      \
            (int)q_heads, (int)kv_heads, scale);                                                                   \
        *result = 0;                                                                                               \
        return 0;                                                                                                  \
    }
#define FLASH_ENTRIES(D, WARPS, BN, STAGES)                  \
    FLASH_ENTRY(D, WARPS, BN, STAGES, false, flash_prefill) \
    FLASH_ENTRY(D, WARPS, BN, STAGES, true, flash_split)

#define COMBINE_ENTRY(D, BN)                                                                                         \
    extern "C" __device__ int flash_combine_##D##_##BN(int* result, long long po, long long pml, long long qg,      \
                                                       long long out, long long pstride, long long rows,            \
                                                       long long start, long long q_heads) {                        \
        flash_combine<D, BN>(reinterpret_cast<const float*>(po), reinterpret_cast<const float*>(pml),               \
                             reinterpret_cast<const float*>(qg), reinterpret_cast<bf16_t*>(out), (int)pstride,       \
                             (int)rows, (int)start, (int)q_heads);                                                   \
        *result = 0;                                                                                                 \
        return 0;                                                                                                    \
    }

FLASH_ENTRIES(16, 4, 32, 3)
FLASH_ENTRIES(32, 4, 32, 3)
FLASH_ENTRIES(64, 4, 32, 3)
FLASH_ENTRIES(128, 4, 32, 3)
FLASH_ENTRIES(128, 8, 32, 3)
FLASH_ENTRIES(256, 1, 32, 3)
FLASH_ENTRIES(256, 2, 32, 3)
FLASH_ENTRIES(256, 4, 32, 2)
FLASH_ENTRIES(256, 4, 32, 3)
FLASH_ENTRIES(256, 4, 32, 4)
FLASH_ENTRIES(256, 8, 32, 2)
FLASH_ENTRIES(256, 8, 32, 3)
COMBINE_ENTRY(16, 32)
COMBINE_ENTRY(32, 32)
COMBINE_ENTRY(64, 32)
COMBINE_ENTRY(128, 32)
COMBINE_ENTRY(256, 32)
