// Phase 2 of the delta rule (delta_mma.cu's `walk`) with its products on wgmma (sm_90a): the same
// tf32 products in the same order, so, where wgmma's tf32 sums are chained mma.sync m16n8k8's
// (delta_wgmma.py checks every bit against the mma.sync walk before first use), the same bits.
//
// One CTA of two warpgroups per (BV state columns, value head), KD = 128, SPLIT 3. A step:
//   W S (warpgroup 0) and q S (warpgroup 1): wgmma m64n{BV}k8, A (W or q rows) from registers as
//       mma.sync's A fragments (split into tf32 pairs by each thread, as mma_split_b does), B = S
//       from shared memory, KD / 8 k-steps of three products each (a_hi b_lo, a_lo b_hi, a_hi b_hi);
//   V' = U - W S (warpgroup 0, stored split), O = e^c (q S) (warpgroup 1, in registers);
//   S = e^(c_last) S + (k e^(c_last - c))^T V' (warpgroup j: state rows 64 j..64 j + 63) and
//       O += M V' (warpgroup 1): wgmma m64n{BV}k8 over the sub-chunk's 64 rows, A from registers,
//       B = V' from shared memory.
// Each accumulator element is the mma.sync walk's: warp w of the CTA holds state rows 16 w + g,
// + 8 (its m-tile w) and V' / O rows 16 (w % 4) + g, + 8, at columns 8 nt + 2 t, + 1; wgmma's
// m64nN accumulator is mma.sync's m16n8 one repeated over N / 8 column tiles, a warp per 16 rows.
//
// S and V' sit in shared memory as wgmma's K-major B operands without swizzle (PTX ISA,
// "Shared Memory Matrix Layout"): core matrices of 8 columns (n) x 4 rows (k, 16 bytes), column n
// and row k at (n / 8) * SBO + (k / 4) * P + (n % 8) * 4 + k % 4 floats, P = 36 (144 bytes: the
// leading byte offset between core matrices along k; 4 floats of padding make a warp's split
// stores conflict-free, banks g + 8 t), SBO = (rows / 4) * P (the stride byte offset between
// 8-column groups). Descriptors as bench/wgmma_probe.py measured them (RESULTS.md, session 26).
//
// Appended to delta_mma.cu's and wgmma.cu's text (its helpers: wg_fence, wg_commit, wg_wait0,
// wg_keep, wg_proxy_fence, wg_desc), with the wgmma functions generated at the marker
// (executor/numba_cuda/nvrtc.py: wgmma_function(..., dtype="tf32")), and compiled by NVRTC for
// sm_90a to a cubin launched through the driver (delta_wgmma.py).

namespace delta {

// wgmma_tf32_n32 / wgmma_tf32_n64 (m64n{32,64}k8, A from registers, B K-major), generated:
// @WGMMA_FUNCTIONS@

// The host emulator (tests/executor/numba_cuda/emulator/cuda_host.h) stands in for everything above
// this line (and smem_addr, and wgmma.cu's helpers but wg_desc) and runs everything below it up to
// the namespace's end.

template <int BV>
__device__ __forceinline__ void wgmma_tf32(float (&d)[BV / 2], const u32* a, unsigned long long b_desc) {
    if constexpr (BV == 32) wgmma_tf32_n32(d, a, b_desc);
    else wgmma_tf32_n64(d, a, b_desc);
}

constexpr int CORE_P = 36;  // floats between core matrices along k in the layout of S and V' (the header's P)

// Shared-memory layout of the wgmma walk (floats). W, q, k, M and the row factors as WalkSmem's;
// S and V' (each a tf32 pair) in the core-matrix layout above.
template <int KD, int BV>
struct WgWalkSmem {
    static constexpr int LW = KD + 4;
    static constexpr int LK = KD + 8;
    static constexpr int LM = C + 4;
    static constexpr int P = CORE_P;
    static constexpr int SBO_S = KD / 4 * P;   // floats between 8-column groups of S
    static constexpr int SBO_V = C / 4 * P;    // ... of V'
    static constexpr int W = 0;
    static constexpr int Q = W + C * LW;
    static constexpr int K = Q + C * LW;
    static constexpr int M = K + C * LK;
    static constexpr int S = M + C * LM;                 // tf32(S)
    static constexpr int SL = S + BV / 8 * SBO_S;        // tf32(S - tf32(S))
    static constexpr int V = SL + BV / 8 * SBO_S;        // tf32(V')
    static constexpr int VL = V + BV / 8 * SBO_V;        // tf32(V' - tf32(V'))
    static constexpr int DV = VL + BV / 8 * SBO_V;       // e^c, e^(c_last - c)
    static constexpr int FLOATS = DV + 2 * C;
    static_assert(S % 4 == 0 && SL % 4 == 0 && V % 4 == 0 && VL % 4 == 0, "16-byte aligned operands");
};

// Float offset of (row k, column n) of a B operand in the core-matrix layout with stride sbo.
__device__ __forceinline__ int core_at(int k, int n, int sbo) {
    return (n >> 3) * sbo + (k >> 2) * CORE_P + (n & 7) * 4 + (k & 3);
}

// The pair `split` makes of a, for one wgmma A fragment: hi = tf32(a), lo = tf32(a - hi).
__device__ __forceinline__ void split_a(u32* hi, u32* lo, const float (&a)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        hi[i] = tf32(a[i]);
        lo[i] = tf32(__fsub_rn(a[i], __uint_as_float(hi[i])));
    }
}

// d += A B for k-step `s` (8 rows of B), A's fragment given split (ah, al), B at descriptor b_hi /
// b_lo plus s k-steps of KSTEP bytes (two core matrices along k): a_hi b_lo, a_lo b_hi, a_hi b_hi,
// mma_split_b's order. Issued, not committed: the caller commits and waits.
constexpr u32 KSTEP = 4 * 2 * CORE_P;
template <int BV>
__device__ __forceinline__ void wg_split_step(float (&d)[BV / 2], const u32 (&ah)[4], const u32 (&al)[4],
                                              unsigned long long b_hi, unsigned long long b_lo, int s) {
    const unsigned long long o = (unsigned long long)((s * KSTEP) >> 4);
    wgmma_tf32<BV>(d, ah, b_lo + o);
    wgmma_tf32<BV>(d, al, b_hi + o);
    wgmma_tf32<BV>(d, ah, b_hi + o);
}

// INTERLEAVE: a phase builds each k-step's A fragments, fences and issues its products in turn, so
// the loads and conversions of k-step s + 1 run while the tensor cores work on s (a wgmma.fence
// orders registers, it does not wait for wgmma in flight); else it builds every fragment first.
// The same products in the same order either way.
constexpr bool INTERLEAVE = true;

template <int KD, int BV>
__device__ __forceinline__ void walk_wgmma(const float* q, const float* k, const float* w_in, const float* u_in,
                                           const float* m_in, const float* dv_in, float* state, float* out,
                                           int rows, int off, int key_heads, int value_heads, int value_dim) {
    using L = WgWalkSmem<KD, BV>;
    constexpr int THREADS = 256;
    constexpr int NT = BV / 8;
    constexpr int KS = KD / 8;                 // k-steps of W S and q S
    static_assert(KD == 128 && (BV == 32 || BV == 64), "the wgmma walk's shapes");
    extern __shared__ __align__(16) float smem[];
    float* ws = smem + L::W;
    float* qs = smem + L::Q;
    float* kt = smem + L::K;
    float* ms = smem + L::M;
    float* ss = smem + L::S;
    float* sl = smem + L::SL;
    float* vn = smem + L::V;
    float* vl = smem + L::VL;
    float* dv = smem + L::DV;

    const int hv = blockIdx.y, col0 = blockIdx.x * BV;
    const int kh = hv / (value_heads / key_heads);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gq = lane >> 2, tq = lane & 3;
    const int pr = 16 * (warp % 4) + gq;     // this thread's first sub-chunk row of V' and O
    const int m0 = 16 * warp + gq;           // this thread's first state row
    const bool makes_v = warp < 4;           // warpgroup 0: W S and V'; warpgroup 1: q S and O
    const int subchunks = (off + rows + C - 1) / C;
    state += (size_t)hv * KD * value_dim;

    // descriptors (leading byte offset P floats, stride byte offset SBO floats)
    const unsigned long long s_hi = wg_desc(smem_addr(ss), L::P * 4, L::SBO_S * 4);
    const unsigned long long s_lo = wg_desc(smem_addr(sl), L::P * 4, L::SBO_S * 4);
    const unsigned long long v_hi = wg_desc(smem_addr(vn), L::P * 4, L::SBO_V * 4);
    const unsigned long long v_lo = wg_desc(smem_addr(vl), L::P * 4, L::SBO_V * 4);

    float sacc[BV / 2];  // state rows m0, m0 + 8 at columns 8 nt + 2 tq, + 1 ([nt][e] flattened)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const float* src = state + (size_t)m0 * value_dim + col0 + 8 * nt + 2 * tq;
        const float2 a = *reinterpret_cast<const float2*>(src);
        const float2 b = *reinterpret_cast<const float2*>(src + 8 * value_dim);
        sacc[4 * nt + 0] = a.x;
        sacc[4 * nt + 1] = a.y;
        sacc[4 * nt + 2] = b.x;
        sacc[4 * nt + 3] = b.y;
    }

    const WalkCopies<KD, THREADS, L> copies(q, k, w_in, m_in, dv_in, rows, off, key_heads, value_heads, hv, kh);

    copies.stage_a(0, ws, qs);
    for (int s = 0; s < subchunks; ++s) {
        const int lo = max(0, s * C - off), n = min(rows, (s + 1) * C - off) - lo;
        // the state at the sub-chunk start, split, as wgmma's B operand
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int at = core_at(m0 + 8 * (e >> 1), 8 * nt + 2 * tq + (e & 1), L::SBO_S);
                split_store<3>(ss + at, sl + at, sacc[4 * nt + e]);
            }
        }
        float uf[BV / 2];
        if (makes_v) {
            const float* u = u_in + ((size_t)s * value_heads + hv) * C * value_dim + col0;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int col = 8 * nt + 2 * tq;
                const float2 a = *reinterpret_cast<const float2*>(u + (size_t)pr * value_dim + col);
                const float2 b = *reinterpret_cast<const float2*>(u + (size_t)(pr + 8) * value_dim + col);
                uf[4 * nt + 0] = a.x;
                uf[4 * nt + 1] = a.y;
                uf[4 * nt + 2] = b.x;
                uf[4 * nt + 3] = b.y;
            }
        }
        wg_proxy_fence();  // the split stores, then wgmma's reads
        wait_groups<0>();   // stage A of s is in
        __syncthreads();    // S stored; the previous step's k, M, V' and row factors read
        copies.stage_b(s, kt, ms, dv);

        // W S (warpgroup 0) or q S (warpgroup 1), the A fragments split first
        float acc[BV / 2];
#pragma unroll
        for (int i = 0; i < BV / 2; ++i) acc[i] = 0.f;
        // KB k-steps a commit group: all 16 at BV 32; 8 at BV 64, whose registers would not hold 16
        constexpr int KB = BV == 32 ? KS : KS / 2;
        const float* ar = (makes_v ? ws : qs) + pr * L::LW + tq;
#pragma unroll
        for (int g0 = 0; g0 < KS; g0 += KB) {
            u32 ah[KB][4], al[KB][4];
#pragma unroll
            for (int s8 = 0; s8 < KB; ++s8) {
                const int k0 = 8 * (g0 + s8);
                const float a[4] = {ar[k0], ar[8 * L::LW + k0], ar[k0 + 4], ar[8 * L::LW + k0 + 4]};
                split_a(ah[s8], al[s8], a);
                if constexpr (INTERLEAVE) {
                    wg_fence();
                    wg_split_step<BV>(acc, ah[s8], al[s8], s_hi, s_lo, g0 + s8);
                }
            }
            if constexpr (!INTERLEAVE) {
                wg_fence();
#pragma unroll
                for (int s8 = 0; s8 < KB; ++s8) wg_split_step<BV>(acc, ah[s8], al[s8], s_hi, s_lo, g0 + s8);
            }
            wg_commit();
            wg_wait0();
            wg_keep<BV / 2>(acc);
            wg_keep<4 * KB>(&ah[0][0]);
            wg_keep<4 * KB>(&al[0][0]);
        }
        wait_groups<0>();  // stage B of s is in
        __syncthreads();   // W, q and S buffers read
        if (s + 1 < subchunks) copies.stage_a(s + 1, ws, qs);

        // V' = U - W S (into shared memory); O = e^c (q S)
        if (makes_v) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int at = core_at(pr + 8 * (e >> 1), 8 * nt + 2 * tq + (e & 1), L::SBO_V);
                    split_store<3>(vn + at, vl + at, __fsub_rn(uf[4 * nt + e], acc[4 * nt + e]));
                }
            }
        } else {
            const float e0 = dv[pr], e1 = dv[pr + 8];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                acc[4 * nt + 0] = __fmul_rn(acc[4 * nt + 0], e0);
                acc[4 * nt + 1] = __fmul_rn(acc[4 * nt + 1], e0);
                acc[4 * nt + 2] = __fmul_rn(acc[4 * nt + 2], e1);
                acc[4 * nt + 3] = __fmul_rn(acc[4 * nt + 3], e1);
            }
        }
        wg_proxy_fence();
        __syncthreads();  // V' stored

        // S = e^(c_last) S + (k e^(c_last - c))^T V' (this warpgroup's 64 state rows) and, in
        // warpgroup 1, O += M V'
        const float decay = dv[n - 1];
#pragma unroll
        for (int i = 0; i < BV / 2; ++i) sacc[i] = __fmul_rn(sacc[i], decay);
        {
            constexpr int CS = C / 8;
            u32 kh_[CS][4], kl_[CS][4], mh[CS][4], ml[CS][4];  // M's only in warpgroup 1
#pragma unroll
            for (int s8 = 0; s8 < CS; ++s8) {
                const int k0 = 8 * s8;
                const float d0 = dv[C + k0 + tq], d1 = dv[C + k0 + tq + 4];
                const float a[4] = {__fmul_rn(kt[(k0 + tq) * L::LK + m0], d0),
                                    __fmul_rn(kt[(k0 + tq) * L::LK + m0 + 8], d0),
                                    __fmul_rn(kt[(k0 + tq + 4) * L::LK + m0], d1),
                                    __fmul_rn(kt[(k0 + tq + 4) * L::LK + m0 + 8], d1)};
                split_a(kh_[s8], kl_[s8], a);
                if (!makes_v) {
                    float am[4];
                    a_fragment(am, ms, L::LM, pr, k0, tq);
                    split_a(mh[s8], ml[s8], am);
                }
                if constexpr (INTERLEAVE) {
                    wg_fence();
                    wg_split_step<BV>(sacc, kh_[s8], kl_[s8], v_hi, v_lo, s8);
                    if (!makes_v) wg_split_step<BV>(acc, mh[s8], ml[s8], v_hi, v_lo, s8);
                }
            }
            if constexpr (!INTERLEAVE) {
                wg_fence();
#pragma unroll
                for (int s8 = 0; s8 < CS; ++s8) wg_split_step<BV>(sacc, kh_[s8], kl_[s8], v_hi, v_lo, s8);
                if (!makes_v)
#pragma unroll
                    for (int s8 = 0; s8 < CS; ++s8) wg_split_step<BV>(acc, mh[s8], ml[s8], v_hi, v_lo, s8);
            }
            wg_commit();
            wg_wait0();
            wg_keep<BV / 2>(sacc);
            wg_keep<BV / 2>(acc);
            wg_keep<4 * CS>(&kh_[0][0]);
            wg_keep<4 * CS>(&kl_[0][0]);
            if (!makes_v) {
                wg_keep<4 * CS>(&mh[0][0]);
                wg_keep<4 * CS>(&ml[0][0]);
            }
        }
        if (!makes_v) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int col = col0 + 8 * nt + 2 * tq;
                if (pr < n)
                    *reinterpret_cast<float2*>(out + ((size_t)(lo + pr) * value_heads + hv) * value_dim + col) =
                        make_float2(acc[4 * nt + 0], acc[4 * nt + 1]);
                if (pr + 8 < n)
                    *reinterpret_cast<float2*>(out + ((size_t)(lo + pr + 8) * value_heads + hv) * value_dim + col) =
                        make_float2(acc[4 * nt + 2], acc[4 * nt + 3]);
            }
        }
    }

#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float* dst = state + (size_t)m0 * value_dim + col0 + 8 * nt + 2 * tq;
        *reinterpret_cast<float2*>(dst) = make_float2(sacc[4 * nt + 0], sacc[4 * nt + 1]);
        *reinterpret_cast<float2*>(dst + 8 * value_dim) = make_float2(sacc[4 * nt + 2], sacc[4 * nt + 3]);
    }
}

}  // namespace delta

// Launchable walks: grid (value_dim / BV, value_heads), 256 threads, WgWalkSmem<KD, BV>::FLOATS * 4
// bytes of dynamic shared memory. meta (i32 device [3]) = (rows in use, start row, slot), read here
// as the numba walk reads it (a captured launch replays with other values).
#define DELTA_WALK_WGMMA(KD, BV)                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 1) delta_walk_wgmma_##KD##_##BV(                          \
        const float* q, const float* k, const float* w, const float* u, const float* m, const float* dv,        \
        float* states, long long slot_bytes, float* out, const int* meta, int key_heads, int value_heads,        \
        int value_dim) {                                                                                        \
        const int rows = meta[0];                                                                               \
        const int off = meta[1] % delta::C;                                                                     \
        float* state = reinterpret_cast<float*>(reinterpret_cast<char*>(states) + (long long)meta[2] * slot_bytes); \
        delta::walk_wgmma<KD, BV>(q, k, w, u, m, dv, state, out, rows, off, key_heads, value_heads, value_dim); \
    }
DELTA_WALK_WGMMA(128, 32)
DELTA_WALK_WGMMA(128, 64)
