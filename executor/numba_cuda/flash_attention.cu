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
// is online over the blocks in ascending order: m = max(m, blockmax),
// alpha = 2^(m_old - m), p = bf16(2^(x - m)) (ex2.approx, cvt.rn.bf16x2), l = l * alpha +
// sum(p), O = O * alpha + P V; the O rescale is skipped when no row of the warp moved its
// max (alpha = 1 exactly: the same bits), and the causal mask is applied only on blocks
// that reach past the warp's first position.
//
// Exactness (DESIGN "invariant grid"): a row's bits depend only on its position, its
// head and the cache. Its keys, blocks, block order and every reduction order (a thread's
// columns in a fixed order, then the quad's xor-1 and xor-2 shuffles) are the same
// whatever chunk, tile or warp it sits in; a block past the row's position (processed
// because another row of the warp needs it) has every x = -inf, so m and l are unchanged,
// alpha = 2^0 = 1 and P = 0 adds exact zeros: same bits as not processing it. Rows of
// one mma never mix (row i of D reads row i of A only), so neither the warps a CTA has
// nor the rows beside a row in its CTA change its bits.
//
// Shapes (all row-major, C-contiguous): q f32 [rows, q_heads, D] (after QK-norm and
// RoPE); qg f32 [rows, q_heads * 2 * D] (the gate is the second half of each head);
// kc, vc bf16 bits [capacity, kv_heads, D] (one slot of one layer; keys [0, start + rows)
// written and every row below a multiple of BN past them finite); out bf16 bits
// [rows, q_heads * D] = bf16((O / l) / (1 + exp(-gate))).

typedef unsigned short bf16_t;
typedef unsigned int u32;

#define NEG_INF __int_as_float(0xff800000)

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

// Copy keys [block * BN, block * BN + BN) of one K/V head into dst [BN, LDS] (one
// commit group per call, empty for threads with no piece).
template <int D, int BN, int THREADS>
__device__ __forceinline__ void load_block(bf16_t* dst, const bf16_t* src, size_t row_stride, int block) {
    constexpr int LDS = D + 8;
    constexpr int PIECES = D / 8;
#pragma unroll
    for (int c = threadIdx.x; c < BN * PIECES; c += THREADS) {
        int key = c / PIECES, piece = c % PIECES;
        copy16(smem_addr(dst + key * LDS + piece * 8), src + (size_t)(block * BN + key) * row_stride + piece * 8);
    }
    commit();
}

template <int D, int WARPS, int BN>
__device__ __forceinline__ void flash_prefill(const float* q, const float* qg, const bf16_t* kc, const bf16_t* vc,
                                              bf16_t* out, int rows, int start, int q_heads, int kv_heads,
                                              float scale) {
    constexpr int LDS = D + 8;      // shared row stride (elements): rows 16-byte aligned, ldmatrix conflict-free
    constexpr int KSTEPS = D / 16;  // k-steps of S = Q K^T
    constexpr int DT = D / 8;       // n-tiles of O
    constexpr int ST = BN / 8;      // n-tiles of S
    constexpr int THREADS = WARPS * 32;
    __shared__ __align__(16) bf16_t ks[BN * LDS];
    __shared__ __align__(16) bf16_t vs[BN * LDS];

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

    int vr[2] = {warp_first + g, warp_first + g + 8};
    int row[2], head[2], pos[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int v = min(vr[r], vrows - 1);
        row[r] = v / group;
        head[r] = h * group + v % group;
        pos[r] = start + row[r];
    }

    u32 qf[KSTEPS][4];
    {
        const float* q0 = q + ((size_t)row[0] * q_heads + head[0]) * D + 2 * t;
        const float* q1 = q + ((size_t)row[1] * q_heads + head[1]) * D + 2 * t;
#pragma unroll
        for (int k = 0; k < KSTEPS; ++k) {
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

    float acc[DT][4];
#pragma unroll
    for (int n = 0; n < DT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF};  // running max, log2 units
    float l[2] = {0.0f, 0.0f};        // this thread's share of the running sum

    const size_t row_stride = (size_t)kv_heads * D;
    const bf16_t* kbase = kc + (size_t)h * D;
    const bf16_t* vbase = vc + (size_t)h * D;
    const u32 ks0 = smem_addr(ks), vs0 = smem_addr(vs);
    // ldmatrix row addresses (bytes): K non-transposed (matrix j = lane / 8 covers dims
    // 8j..8j+7 of two k-steps), V transposed (matrices: keys +0 / +8, dims +0 / +8).
    const u32 k_lane = ks0 + 2u * ((lane & 7) * LDS + (lane >> 3) * 8);
    const u32 v_lane = vs0 + 2u * (((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8);

    load_block<D, BN, THREADS>(ks, kbase, row_stride, 0);
    for (int b = 0; b < blocks; ++b) {
        wait_groups<0>();
        __syncthreads();  // K_b is in; every warp is done with V_{b-1}
        load_block<D, BN, THREADS>(vs, vbase, row_stride, b);
        const bool active = b < warp_blocks;
        float s[ST][4];
#pragma unroll
        for (int n = 0; n < ST; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        if (active) {
#pragma unroll
            for (int k = 0; k + 1 < KSTEPS; k += 2) {
#pragma unroll
                for (int n = 0; n < ST; ++n) {
                    u32 b0, b1, b2, b3;
                    ldsm4(b0, b1, b2, b3, k_lane + 2u * (n * 8 * LDS + k * 16));
                    mma(s[n], qf[k], b0, b1);
                    mma(s[n], qf[k + 1], b2, b3);
                }
            }
            if (KSTEPS % 2) {
#pragma unroll
                for (int n = 0; n < ST; ++n) {
                    u32 b0, b1;
                    ldsm2(b0, b1, k_lane + 2u * (n * 8 * LDS + (KSTEPS - 1) * 16));
                    mma(s[n], qf[KSTEPS - 1], b0, b1);
                }
            }
        }
        __syncthreads();  // every warp is done with K_b
        if (b + 1 < blocks) load_block<D, BN, THREADS>(ks, kbase, row_stride, b + 1);
        u32 pf[BN / 16][4];
        if (active) {
            const bool masked = b >= unmasked;  // warp-uniform
            float alpha[2];
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
                const float fresh = fmaxf(m[r], top);
                alpha[r] = exp2_approx(__fsub_rn(m[r], fresh));  // exactly 1 when the max holds
                m[r] = fresh;
                float total = 0.0f;
#pragma unroll
                for (int n = 0; n < ST; ++n) {
                    const u32 p = pack2(exp2_approx(__fsub_rn(s[n][2 * r], fresh)),
                                        exp2_approx(__fsub_rn(s[n][2 * r + 1], fresh)));
                    total += __uint_as_float(p << 16);
                    total += __uint_as_float(p & 0xFFFF0000u);
                    // A fragment of P for k-step n / 2: a0/a1 rows g / g+8 keys 2t.., a2/a3 keys 8+2t..
                    pf[n / 2][(n % 2) * 2 + r] = p;
                }
                l[r] = __fadd_rn(__fmul_rn(l[r], alpha[r]), total);
            }
            // O *= alpha, skipped when every row of the warp kept its max (alpha = 1: the same bits)
            if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
                for (int n = 0; n < DT; ++n) {
                    acc[n][0] *= alpha[0];
                    acc[n][1] *= alpha[0];
                    acc[n][2] *= alpha[1];
                    acc[n][3] *= alpha[1];
                }
            }
        }
        if (b + 1 < blocks) {
            wait_groups<1>();
        } else {
            wait_groups<0>();
        }
        __syncthreads();  // V_b is in
        if (active) {
#pragma unroll
            for (int k = 0; k < BN / 16; ++k) {
#pragma unroll
                for (int n = 0; n < DT; n += 2) {
                    u32 b0, b1, b2, b3;
                    ldsm4t(b0, b1, b2, b3, v_lane + 2u * (k * 16 * LDS + n * 8));
                    mma(acc[n], pf[k], b0, b1);
                    mma(acc[n + 1], pf[k], b2, b3);
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    const size_t gate_stride = (size_t)q_heads * 2 * D;
    const size_t out_stride = (size_t)q_heads * D;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (vr[r] >= vrows) continue;
        const float* gate = qg + row[r] * gate_stride + (size_t)head[r] * 2 * D + D + 2 * t;
        u32* dst = reinterpret_cast<u32*>(out + row[r] * out_stride + (size_t)head[r] * D + 2 * t);
#pragma unroll
        for (int n = 0; n < DT; ++n) {
            float lo = (acc[n][2 * r] / l[r]) / (1.0f + expf(-gate[n * 8]));
            float hi = (acc[n][2 * r + 1] / l[r]) / (1.0f + expf(-gate[n * 8 + 1]));
            dst[n * 4] = pack2(lo, hi);
        }
    }
}

// Entry points: numba's ABI (status return, result pointer first); pointers and counts
// as int64 (what numba types a Python int as), the scale as float32.
#define FLASH_ENTRY(D, WARPS, BN)                                                                                  \
    extern "C" __device__ int flash_prefill_##D##_##WARPS##_##BN(int* result, long long q, long long qg, long long kc, \
                                                          long long vc, long long out, long long rows,         \
                                                          long long start, long long q_heads,                  \
                                                          long long kv_heads, float scale) {                   \
        flash_prefill<D, WARPS, BN>(reinterpret_cast<const float*>(q), reinterpret_cast<const float*>(qg),          \
                                reinterpret_cast<const bf16_t*>(kc), reinterpret_cast<const bf16_t*>(vc),       \
                                reinterpret_cast<bf16_t*>(out), (int)rows, (int)start, (int)q_heads,           \
                                (int)kv_heads, scale);                                                        \
        *result = 0;                                                                                           \
        return 0;                                                                                              \
    }

FLASH_ENTRY(16, 4, 32)
FLASH_ENTRY(32, 4, 32)
FLASH_ENTRY(64, 4, 32)
FLASH_ENTRY(128, 4, 32)
FLASH_ENTRY(128, 8, 32)
FLASH_ENTRY(256, 4, 32)
FLASH_ENTRY(256, 2, 32)
FLASH_ENTRY(256, 1, 32)
FLASH_ENTRY(256, 8, 32)
