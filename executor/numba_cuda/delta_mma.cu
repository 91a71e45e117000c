// The chunked gated delta rule of a prefill chunk on the tensor cores (tf32 mma.sync), written
// for warmstate's exactness rules. Same math as delta_chunked.py (the CUDA-core path) and its
// float64 twin ops.gated_delta_rule_chunked; the work is split the way FLA's
// chunk_gated_delta_rule splits it (Yang, Kautz, Hatamizadeh, 2024, "Gated Delta Networks",
// arXiv:2412.06464, section 3.3; fla-org/flash-linear-attention, ops/gated_delta_rule): what does
// not depend on the state runs in parallel over sub-chunks, and only the state walk is serial.
//
// Per sub-chunk of C = 64 rows (anchored at absolute multiples of 64) and value head, with
// c = cumsum(g) inside the sub-chunk:
//   A  = strict_lower(beta_i (k_i . k_j) e^(c_i - c_j)),  T = (I + A)^-1
//   W  = T (beta e^c k),  U = T (beta v),  M = lower_incl((q_i . k_j) e^(c_i - c_j))
//   V' = U - W S
//   O  = e^c (q S) + M V'
//   S  = e^(c_last) S + (k e^(c_last - c))^T V'
// `delta_prepare` (phase 1: parallel over sub-chunks) computes W, U, M and the row factors
// e^c, e^(c_last - c); `delta_walk` (phase 2: one CTA per value head and BV state columns)
// walks the sub-chunks in order with its state columns in registers.
//
// Exactness (DESIGN "invariant grid"): every value a sub-chunk produces depends on that
// sub-chunk's rows and the fp32 state at its start only, through the same operations in the
// same order whatever chunk the sub-chunk sits in, and the state is carried between sub-chunks
// in fp32 exactly as between chunks. So any chunking whose cuts lie on multiples of 64 gives
// every output row and the final state the same bits. Rows past a chunk's end inside its
// last sub-chunk are zeros (k, q, v, beta, e^c all 0) and add exact zeros. The CTA shape
// (BV, warps) and how many value heads a phase-1 CTA serves change no bit: each output
// element is one mma chain over the same k-steps in the same order.
//
// Products are mma.sync.m16n8k8 with tf32 operands and fp32 accumulation; SPLIT = 3 runs each
// as three tf32 products (big*small + small*big + big*big, "3xTF32"), which carries ~21 bits
// of each operand instead of 10. With SPLIT 1, operands that are stored to be multiplied (W and
// M in scratch, S and V' in shared memory) are stored already rounded to tf32 (the value the
// product would use anyway), so the inner loops convert only q and k. With SPLIT 3, S and V'
// are stored as their (tf32(x), tf32(x - tf32(x))) pairs by the warp that owns x, the pair
// every reader would make: each is read by 4 or 8 warps, which then convert only their A
// operands (the same products in the same order: the same bits). Phase 1 does the same with
// its operands: k and T are stored as their pairs once (`split`, then `mma_split`), and each B
// element of W and U is converted by the one warp that multiplies it. T comes from a blockwise
// forward substitution in fp32 on the CUDA cores (16 x 16 diagonal blocks, then block rows in
// order).
//
// Called from numba kernels (delta_mma.py) through numba-cuda's `link=`: entry points are
// `extern "C" __device__` with numba's calling convention (int status return, result pointer
// first), pointers and counts passed as int64. Shared memory is dynamic (`extern __shared__`);
// the Python side raises the kernel's dynamic shared-memory limit before the first launch.
//
// Layouts (f32, row-major, C-contiguous):
//   q, k      [rows, key_heads, KD]        (q already scaled by KD^-0.5, both L2-normalised)
//   mixed     [rows, channels]              v of value head h at columns v0 + h * VD
//   g, beta   [rows, value_heads]
//   w         [subchunks, value_heads, C, KD]   u [subchunks, value_heads, C, VD]
//   m         [subchunks, value_heads, C, C]    dv [subchunks, value_heads, 2, C] (e^c, e^(c_last - c))
//   state     [value_heads, KD, VD]         (one slot of one layer)
//   out       [rows, value_heads, VD]
// Value head h reads key head h / (value_heads / key_heads).

typedef unsigned int u32;

#define FULL_MASK 0xffffffffu

namespace delta {

constexpr int C = 64;  // rows per sub-chunk

__device__ __forceinline__ u32 tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void mma_tf32(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// d += a b for one m16n8k8 tile. a: A fragment (rows g, g+8; columns t, t+4: a0 (g, t),
// a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)); b: B fragment (b0 (k t, n g), b1 (k t+4, n g));
// d: C fragment (d0 (g, 2t), d1 (g, 2t+1), d2 (g+8, 2t), d3 (g+8, 2t+1)); g = lane / 4,
// t = lane % 4 (PTX ISA, "Matrix fragments for mma.m16n8k8", .tf32).
// The product (the header's): with SPLIT 3, d += a_hi b_lo, then a_lo b_hi, then a_hi b_hi, where
// x_hi = tf32(x) and x_lo = tf32(x - x_hi); with SPLIT 1, d += a_hi b_hi. Here b comes already
// converted: bh = tf32(b) and, for SPLIT 3, bl = tf32(b - bh) (`split_store` wrote them); A_TF32:
// a already holds tf32 values (rounded when stored), so with SPLIT 1 its conversion is skipped
// (cvt.rna of a tf32 value is the value). A warp that only reads b skips its conversion: the
// walk's B operands (S, V') are stored once by the warp that owns them and read by 4 or 8.
template <int SPLIT, bool A_TF32 = false>
__device__ __forceinline__ void mma_split_b(float* d, const float* a, const float* bh, const float* bl) {
    u32 ab[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) ab[i] = (SPLIT == 1 && A_TF32) ? __float_as_uint(a[i]) : tf32(a[i]);
    if (SPLIT == 3) {
        u32 as[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) as[i] = tf32(__fsub_rn(a[i], __uint_as_float(ab[i])));
        mma_tf32(d, ab[0], ab[1], ab[2], ab[3], __float_as_uint(bl[0]), __float_as_uint(bl[1]));
        mma_tf32(d, as[0], as[1], as[2], as[3], __float_as_uint(bh[0]), __float_as_uint(bh[1]));
    }
    mma_tf32(d, ab[0], ab[1], ab[2], ab[3], __float_as_uint(bh[0]), __float_as_uint(bh[1]));
}

// Store x as a B operand of mma_split_b: hi[0] = tf32(x) and, for SPLIT 3, lo[0] =
// tf32(x - tf32(x)) (the pair `mma` would make from x); SPLIT 1 stores tf32(x) alone.
template <int SPLIT>
__device__ __forceinline__ void split_store(float* hi, float* lo, float x) {
    const u32 h = tf32(x);
    hi[0] = __uint_as_float(h);
    if (SPLIT == 3) lo[0] = __uint_as_float(tf32(__fsub_rn(x, __uint_as_float(h))));
}

// The operand pairs `mma` makes from x[0..N): hi = tf32(x) and, for SPLIT 3, lo = tf32(x - hi).
// Phase 1 splits each fragment once and multiplies it by several (mma_split): the Gram loop's
// k fragment serves k k^T and q k^T, and T's fragments every n-tile of W and U.
template <int SPLIT, int N>
__device__ __forceinline__ void split(u32* hi, u32* lo, const float* x) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        hi[i] = tf32(x[i]);
        if (SPLIT == 3) lo[i] = tf32(__fsub_rn(x[i], __uint_as_float(hi[i])));
    }
}

// d += a b, the product `mma_split_b` makes, both operands given as their `split` pairs: the same
// tf32 products in the same order (big*small, small*big, big*big), so the same bits.
template <int SPLIT>
__device__ __forceinline__ void mma_split(float* d, const u32* ah, const u32* al, const u32* bh, const u32* bl) {
    if (SPLIT == 3) {
        mma_tf32(d, ah[0], ah[1], ah[2], ah[3], bl[0], bl[1]);
        mma_tf32(d, al[0], al[1], al[2], al[3], bh[0], bh[1]);
    }
    mma_tf32(d, ah[0], ah[1], ah[2], ah[3], bh[0], bh[1]);
}

// The 4 floats at x (16-byte aligned) as the pairs `split` makes: tf32(x) in place and, for SPLIT 3,
// tf32(x - tf32(x)) at lo (16-byte aligned). Phase 1 stores k and T this way once for all readers.
template <int SPLIT>
__device__ __forceinline__ void split4_in_place(float* x, float* lo) {
    const float4 x4 = *reinterpret_cast<const float4*>(x);
    const float v[4] = {x4.x, x4.y, x4.z, x4.w};
    u32 h[4], l[4];
    split<SPLIT, 4>(h, l, v);
    *reinterpret_cast<float4*>(x) =
        make_float4(__uint_as_float(h[0]), __uint_as_float(h[1]), __uint_as_float(h[2]), __uint_as_float(h[3]));
    if (SPLIT == 3)
        *reinterpret_cast<float4*>(lo) =
            make_float4(__uint_as_float(l[0]), __uint_as_float(l[1]), __uint_as_float(l[2]), __uint_as_float(l[3]));
}

// x as the value a SPLIT-1 product will use (tf32), or x itself for SPLIT 3 (which splits it).
template <int SPLIT>
__device__ __forceinline__ float operand(float x) {
    return SPLIT == 1 ? __uint_as_float(tf32(x)) : x;
}

// The A fragment of rows r, r + 8 and columns k0 + t, k0 + t + 4 of a row-major matrix with
// row stride ld (floats): a0 (r, k0+t), a1 (r+8, k0+t), a2 (r, k0+t+4), a3 (r+8, k0+t+4).
__device__ __forceinline__ void a_fragment(float* a, const float* m, int ld, int r, int k0, int t) {
    a[0] = m[r * ld + k0 + t];
    a[1] = m[(r + 8) * ld + k0 + t];
    a[2] = m[r * ld + k0 + t + 4];
    a[3] = m[(r + 8) * ld + k0 + t + 4];
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 addr;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(p));
    return addr;
}

// 16 bytes global -> shared; src_bytes 0 writes zeros (src is not read).
__device__ __forceinline__ void copy16(float* dst, const float* src, bool live) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(live ? 16 : 0));
}

// ldmatrix.m8n8 (.b16) of 32-bit elements: each 8 x 8 b16 matrix is 8 rows of 4 floats, and lane l
// receives float l % 4 of row l / 4: an A fragment's 8 x 4 quarter or a B fragment's half. Lane l
// gives the address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned); register i gets
// matrix i. The x4 loads an A fragment (rows r.., r+8.., columns k0.., k0+4..) in one instruction
// where `a_fragment` issues four loads. The address comes from __cvta_generic_to_shared, not
// `smem_addr`, whose volatile asm kept the compiler from sharing the address arithmetic (phase 1
// then spilled 20 words a thread under NVRTC 13.0).
__device__ __forceinline__ void ldsm_x4(u32* r, const float* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((u32)__cvta_generic_to_shared(row)));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::); }

template <int N>
__device__ __forceinline__ void wait_groups() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// Shared-memory layout of phase 1 (floats). Strides are 4 mod 32 where rows are read as
// A fragments (banks 4g + t; ldmatrix rows 16 bytes at banks 4r..4r+3: conflict-free). Before the
// first head, the A and T buffers hold tf32(k - tf32(k)) (row stride LK) for the Gram products;
// after the forward substitution, T holds tf32(T) and A tf32(T - tf32(T)) for W and U.
template <int KD, int VD>
struct PrepareSmem {
    static constexpr int LK = KD + 4;                      // k rows
    static constexpr int LQ = (VD > KD ? VD : KD) + 4;     // q rows, then v rows
    static constexpr int LC = C + 4;                       // [C, C] matrices
    static constexpr int K = 0;
    static constexpr int Q = K + C * LK;
    static constexpr int A = Q + C * LQ;
    static constexpr int T = A + C * LC;
    static constexpr int VEC = T + C * LC;                 // c, beta, beta e^c
    static constexpr int FLOATS = VEC + 3 * C;
    static_assert(C * LK <= VEC - A, "tf32(k - tf32(k)) before the first head fits the A and T buffers");
};

// The Gram fragments of phase 1: acc_k[j] += k k^T and acc_q[j] += q k^T over the key dim in order, at
// rows gr, gr + 8 and the columns of n-tile warp / 4 + 2 j, for j < NJ (the tiles left of the warp's
// 16-row block's right edge; the others stay zeros). k comes split (kh: tf32(k), kl: tf32(k - tf32(k)),
// row stride LK); a k-step splits the warp's q fragment once for all its tiles, and each k pair serves
// both products.
template <int KD, int LK, int LQ, int SPLIT, int NJ>
__device__ __forceinline__ void gram(float (&acc_k)[C / 16][4], float (&acc_q)[C / 16][4], const float* kh,
                                     const float* kl, const float* qs, int gr, int warp, int gq, int tq) {
    // the rows this lane gives ldsm_x4: an A fragment at rows gr - gq.. and, with SPLIT 3, the B
    // fragment's (tf32(k), tf32(k - tf32(k))) pair at n-tile warp / 4 (matrices: hi k0.., hi k0+4..,
    // lo k0.., lo k0+4..), both at k-step 0 (the others: immediates)
    const int lane = 4 * gq + tq;
    const int arow = (lane & 7) + 8 * ((lane >> 3) & 1);
    const float* akh0 = kh + (gr - gq + arow) * LK + 4 * (lane >> 4);
    const float* akl0 = kl + (gr - gq + arow) * LK + 4 * (lane >> 4);
    const float* aq0 = qs + (gr - gq + arow) * LQ + 4 * (lane >> 4);
    const float* b0 = (lane >> 4 ? kl : kh) + (8 * (warp / 4) + (lane & 7)) * LK + 4 * ((lane >> 3) & 1);
#pragma unroll 2
    for (int k0 = 0; k0 < KD; k0 += 8) {
        u32 akh[4], akl[4], aqh[4], aql[4], aq[4];
        ldsm_x4(akh, akh0 + k0);
        if (SPLIT == 3) ldsm_x4(akl, akl0 + k0);
        ldsm_x4(aq, aq0 + k0);
        float aqf[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) aqf[e] = __uint_as_float(aq[e]);
        split<SPLIT, 4>(aqh, aql, aqf);
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const int col = 8 * (warp / 4 + 2 * j) + gq;
            u32 bh[2], bl[2];
            if (SPLIT == 3) {
                u32 b[4];
                ldsm_x4(b, b0 + 16 * j * LK + k0);
                bh[0] = b[0];
                bh[1] = b[1];
                bl[0] = b[2];
                bl[1] = b[3];
            } else {
                bh[0] = __float_as_uint(kh[col * LK + k0 + tq]);
                bh[1] = __float_as_uint(kh[col * LK + k0 + tq + 4]);
            }
            mma_split<SPLIT>(acc_k[j], akh, akl, bh, bl);
            mma_split<SPLIT>(acc_q[j], aqh, aql, bh, bl);
        }
    }
}

// out = T (diag(f) x) for phase 1's W (x: k rows, f: beta e^c; stored as the tf32 value the walk
// multiplies with SPLIT 1) and U (x: v rows, f: beta): [C, N] row-major. th, tl: T's `split` pairs
// (row stride C + 4); x row stride LX. Warp w makes the 4 m-tiles of n-tiles w + 8 j: each B element
// f_j x_jc is made and converted by one warp, the A fragments come split. Per output element the
// k-steps in order, each one product (`mma_split_b`'s) of the same operands: the same bits as
// converting both operands at every product.
template <int N, int LX, int SPLIT, bool ROUND>
__device__ __forceinline__ void product_t(float* out, const float* th, const float* tl, const float* x,
                                          const float* f, int warp, int gq, int tq) {
    constexpr int LC = C + 4;
    constexpr int NJ = (N / 8 + 7) / 8;  // n-tiles a warp makes (at most)
    float acc[C / 16][NJ][4];
#pragma unroll
    for (int mt = 0; mt < C / 16; ++mt)
#pragma unroll
        for (int jn = 0; jn < NJ; ++jn)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][jn][e] = 0.f;
    // the row this lane gives ldsm_x4 for an A fragment at m-tile 0, k-step 0 (the others: immediates)
    const int lane = 4 * gq + tq;
    const int lrow = ((lane & 7) + 8 * ((lane >> 3) & 1)) * LC + 4 * (lane >> 4);
    const float* ah0 = th + lrow;
    const float* al0 = tl + lrow;
    const float* xb = x + tq * LX + 8 * warp + gq;  // B: row 8 kt + tq, column 8 (warp + 8 jn) + gq
    const float* fb = f + tq;
#pragma unroll 4  // 2 spills 20 bytes a thread (prepare<128, 128, 3>, 128 registers)
    for (int kt = 0; kt < C / 8; ++kt) {
        u32 ah[C / 16][4], al[C / 16][4];
#pragma unroll
        for (int mt = 0; mt < C / 16; ++mt) {
            ldsm_x4(ah[mt], ah0 + 16 * mt * LC + 8 * kt);
            if (SPLIT == 3) ldsm_x4(al[mt], al0 + 16 * mt * LC + 8 * kt);
        }
        const float f0 = fb[8 * kt], f1 = fb[8 * kt + 4];
#pragma unroll
        for (int jn = 0; jn < NJ; ++jn) {
            const int nt = warp + 8 * jn;
            if (nt < N / 8) {
                const float* xk = xb + 8 * kt * LX + 64 * jn;
                const float b[2] = {__fmul_rn(xk[0], f0), __fmul_rn(xk[4 * LX], f1)};
                u32 bh[2], bl[2];
                split<SPLIT, 2>(bh, bl, b);
#pragma unroll
                for (int mt = 0; mt < C / 16; ++mt) mma_split<SPLIT>(acc[mt][jn], ah[mt], al[mt], bh, bl);
            }
        }
    }
#pragma unroll
    for (int jn = 0; jn < NJ; ++jn) {
        const int nt = warp + 8 * jn;
        if (nt < N / 8) {
#pragma unroll
            for (int mt = 0; mt < C / 16; ++mt) {
                const int r = 16 * mt + gq, col = 8 * nt + 2 * tq;
                const float* d = acc[mt][jn];
                *reinterpret_cast<float2*>(out + r * N + col) =
                    ROUND ? make_float2(operand<SPLIT>(d[0]), operand<SPLIT>(d[1])) : make_float2(d[0], d[1]);
                *reinterpret_cast<float2*>(out + (r + 8) * N + col) =
                    ROUND ? make_float2(operand<SPLIT>(d[2]), operand<SPLIT>(d[3])) : make_float2(d[2], d[3]);
            }
        }
    }
}

// Phase 1: one CTA of 8 warps per (sub-chunk, `per_block` value heads of one key head).
// Every operand is split into its tf32 pair once and the pairs are multiplied as often as they are
// used (`split`, `mma_split`): k once per CTA (before the Gram products, its low parts in the A and T
// buffers; k itself is copied again for W), T once per head (hi in place, lo in A's buffer), q's
// fragments once per k-step for all the warp's tiles, and each B element of W and U (beta e^c k,
// beta v) by the one warp that multiplies it (W and U: warp w makes all 4 m-tiles of n-tiles
// w + 8 j). v rows are copied raw (cp.async, issued when a head starts, landing while A and T are
// made) and multiplied by beta as U reads them: the product __fmul_rn(v, beta) the stored beta v
// was. Tiles right of a warp's diagonal 16-row block are zeros in A and M: their Gram products
// are not made (nothing reads them). A fragments load by ldmatrix. Every output element keeps its
// operations and order (each k-step one product of the same operands; the same fma chains,
// expf, fmul): the same bits. Thread tid's place in a 16 x 16 block (the forward substitution's
// block rows): row tid / 16, column tid % 16. Session 37 (NVRTC 13.0 sm_90, prepare<128, 128, 3>
// at launch bounds (256, 2)): 128 registers, 64 -> 0 spill bytes a thread, ~14,300 -> ~9,300 SASS
// instructions a warp a CTA of two value heads (warp 0's path; the same 103 KB of shared memory).
// On the H100 (bench/RESULTS.md, session 37), phase 1 alone at 32,768 rows: 9B 2.340 -> 1.725 ms,
// 27B 3.218 -> 2.413 ms, outputs and states byte for byte the same; the 9B's 32K prefill's delta rule
// 164.6 -> 148.8 ms with the same logits digest.
template <int KD, int VD, int SPLIT>
__device__ __forceinline__ void prepare(const float* q, const float* k, const float* mixed, const float* g,
                                        const float* beta, float* w_out, float* u_out, float* m_out, float* dv_out,
                                        int rows, int off, int key_heads, int value_heads, int channels, int v0,
                                        int per_block) {
    using L = PrepareSmem<KD, VD>;
    constexpr int THREADS = 256;
    extern __shared__ __align__(16) float smem[];
    float* ks = smem + L::K;
    float* qs = smem + L::Q;
    float* as = smem + L::A;
    float* ts = smem + L::T;
    float* kl = smem + L::A;  // until the first head: tf32(k - tf32(k)), row stride LK (A and T hold C LK floats)
    float* cs = smem + L::VEC;
    float* bs = cs + C;
    float* sc = bs + C;

    const int s = blockIdx.x;
    const int group = value_heads / key_heads;
    const int blocks_per_key_head = group / per_block;
    const int kh = blockIdx.y / blocks_per_key_head;
    const int vh0 = kh * group + (blockIdx.y % blocks_per_key_head) * per_block;
    const int lo = max(0, s * C - off);
    const int n = min(rows, (s + 1) * C - off) - lo;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gq = lane >> 2, tq = lane & 3;
    const int br = tid / 16, bc = tid % 16;  // place in a 16 x 16 block
    const size_t row_len = (size_t)key_heads * KD;

    // k and q rows of the sub-chunk (zeros past n): thread tid copies the 16 bytes at column kc of
    // rows kr + r for r = 0, KR, 2 KR, ... (fixed slots: a pointer step a copy where a loop over e = tid, tid + THREADS, ...
    // redid the row arithmetic)
    constexpr int KR = THREADS / (KD / 4), VR = THREADS / (VD / 4);  // rows one pass of copies covers
    static_assert(THREADS % (KD / 4) == 0 && THREADS % (VD / 4) == 0, "copy split: 16-byte pieces of a row divide the threads");
    const int kr = tid / (KD / 4), kc = 4 * (tid % (KD / 4));
    auto copy_k = [&](bool with_q) {
        const size_t k_at = (size_t)(lo + kr) * row_len + (size_t)kh * KD + kc;
#pragma unroll
        for (int r = 0; r < C; r += KR) {
            if (KR <= C || kr < C) {
                const bool live = kr + r < n;
                copy16(ks + (kr + r) * L::LK + kc, live ? k + k_at + r * row_len : k, live);
                if (with_q) copy16(qs + (kr + r) * L::LQ + kc, live ? q + k_at + r * row_len : q, live);
            }
        }
    };
    copy_k(true);
    commit();
    wait_groups<0>();
    // k as the pairs `split` makes, for the Gram products: tf32(k) in place, tf32(k - tf32(k)) in the
    // A and T buffers (free until the first head). Each thread converts the 16 bytes it copied.
    // W multiplies k itself, so the first head copies it again.
#pragma unroll
    for (int r = 0; r < C; r += KR) {
        if (KR <= C || kr < C) split4_in_place<SPLIT>(ks + (kr + r) * L::LK + kc, kl + (kr + r) * L::LK + kc);
    }
    __syncthreads();

    // Gram matrices k k^T and q k^T, kept in registers: warp w owns rows 16 (w % 4).., n-tiles w / 4 + 2 j.
    // A tile right of the diagonal's 16-row block (j > w % 4) is all zeros in A and M: its products
    // are not made (one straight-line loop for each m-tile)
    const int gr = 16 * (warp % 4) + gq;
    float acc_k[C / 16][4], acc_q[C / 16][4];
#pragma unroll
    for (int j = 0; j < C / 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_k[j][e] = acc_q[j][e] = 0.f;
    switch (warp % 4) {
        case 0: gram<KD, L::LK, L::LQ, SPLIT, 1>(acc_k, acc_q, ks, kl, qs, gr, warp, gq, tq); break;
        case 1: gram<KD, L::LK, L::LQ, SPLIT, 2>(acc_k, acc_q, ks, kl, qs, gr, warp, gq, tq); break;
        case 2: gram<KD, L::LK, L::LQ, SPLIT, 3>(acc_k, acc_q, ks, kl, qs, gr, warp, gq, tq); break;
        default: gram<KD, L::LK, L::LQ, SPLIT, 4>(acc_k, acc_q, ks, kl, qs, gr, warp, gq, tq);
    }

    for (int vi = 0; vi < per_block; ++vi) {
        const int hv = vh0 + vi;
        __syncthreads();  // q rows read; the previous head's buffers free
        // v rows into the q buffer (zeros past n), landing while A and T are made
        {
            const int vr = tid / (VD / 4), vc = 4 * (tid % (VD / 4));
            const float* v = mixed + (size_t)(lo + vr) * channels + v0 + (size_t)hv * VD + vc;
#pragma unroll
            for (int r = 0; r < C; r += VR) {
                if (VR <= C || vr < C) {
                    const bool live = vr + r < n;
                    copy16(qs + (vr + r) * L::LQ + vc, live ? v + (size_t)r * channels : mixed, live);
                }
            }
        }
        if (vi == 0) copy_k(false);  // k itself again, for W
        commit();
        if (warp == 0) {  // c = inclusive cumsum of g: pairs per lane, then a shuffle scan over lanes
            const bool live0 = 2 * lane < n, live1 = 2 * lane + 1 < n;
            const float x0 = live0 ? g[(size_t)(lo + 2 * lane) * value_heads + hv] : 0.f;
            const float x1 = live1 ? g[(size_t)(lo + 2 * lane + 1) * value_heads + hv] : 0.f;
            float incl = __fadd_rn(x0, x1);
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const float y = __shfl_up_sync(FULL_MASK, incl, d);
                if (lane >= d) incl = __fadd_rn(y, incl);
            }
            float excl = __shfl_up_sync(FULL_MASK, incl, 1);
            if (lane == 0) excl = 0.f;
            cs[2 * lane] = __fadd_rn(excl, x0);
            cs[2 * lane + 1] = __fadd_rn(__fadd_rn(excl, x0), x1);
        } else if (warp == 1) {
            for (int i = lane; i < C; i += 32) bs[i] = i < n ? beta[(size_t)(lo + i) * value_heads + hv] : 0.f;
        }
        __syncthreads();
        const float c_last = cs[n - 1];
        float* dv = dv_out + ((size_t)s * value_heads + hv) * 2 * C;
        if (tid < C) {
            const float ci = cs[tid];
            const bool live = tid < n;
            sc[tid] = __fmul_rn(bs[tid], expf(ci));
            dv[tid] = live ? expf(ci) : 0.f;
            dv[C + tid] = live ? expf(__fsub_rn(c_last, ci)) : 0.f;
        }
        // A = strict_lower(beta_i (k_i . k_j) e^(c_i - c_j)) into shared memory and
        // M = lower_incl((q_i . k_j) e^(c_i - c_j)) to scratch, from the Gram fragments
        float* m = m_out + ((size_t)s * value_heads + hv) * C * C;
        const int col0 = 8 * (warp / 4) + 2 * tq;  // this thread's first column at j = 0
        float* a0 = as + gr * L::LC + col0;         // (shared-memory offsets from bases: immediates)
        const float* cj0 = cs + col0;
#pragma unroll
        for (int j = 0; j < C / 16; ++j) {
            const int col = col0 + 16 * j;
            float mv[4] = {0.f, 0.f, 0.f, 0.f};
            if (j <= warp % 4) {  // else M's zeros (A's entries there are never read)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = gr + 8 * (e / 2), jj = col + e % 2;
                    const float ex = expf(__fsub_rn(cs[i], cj0[16 * j + e % 2]));  // made for all (no branch)
                    const float decay = jj <= i ? ex : 0.f;
                    a0[8 * (e / 2) * L::LC + 16 * j + e % 2] =
                        jj < i ? __fmul_rn(__fmul_rn(bs[i], acc_k[j][e]), decay) : 0.f;
                    mv[e] = operand<SPLIT>(jj <= i ? __fmul_rn(acc_q[j][e], decay) : 0.f);
                }
            }
            *reinterpret_cast<float2*>(m + gr * C + col) = make_float2(mv[0], mv[1]);
            *reinterpret_cast<float2*>(m + (gr + 8) * C + col) = make_float2(mv[2], mv[3]);
        }
        // T's blocks above the diagonal are zeros (W and U multiply them)
#pragma unroll
        for (int bi = 0; bi < 3; ++bi)
#pragma unroll
            for (int bj = bi + 1; bj < 4; ++bj) ts[br * L::LC + bc + 16 * bi * L::LC + 16 * bj] = 0.f;
        __syncthreads();

        // T = (I + A)^-1. Diagonal 16 x 16 blocks: one column per thread, forward substitution
        // (entries above the diagonal are zeros, so the sum may start at 0).
        if (tid < C) {
            const int base = 16 * (tid / 16), col = tid % 16;
            const float* ad = as + base * (L::LC + 1);
            float* td = ts + base * (L::LC + 1) + col;
            float tc[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                float acc = 0.f;
#pragma unroll
                for (int mm = 0; mm < i; ++mm) acc = __fmaf_rn(ad[i * L::LC + mm], tc[mm], acc);
                tc[i] = i < col ? 0.f : (i == col ? 1.f : -acc);
                td[i * L::LC] = tc[i];
            }
        }
        __syncthreads();
        // Block rows in order: X_{bi,bj} = sum_{bk in [bj, bi)} A_{bi,bk} T_{bk,bj} (each chain over bk,
        // then the block's columns, in order), then T_{bi,bj} = -T_{bi,bi} X_{bi,bj}. Thread (br, bc)
        // makes element (br, bc) of every block of the row: a row of A (or T) it reads, 16 floats a
        // block, serves every bj. X goes to A's block (bj, bi) above the diagonal, which nothing reads.
        {
            const float* arow = as + br * L::LC;  // bases: every offset below is an immediate
            const float* tcol = ts + bc;
            float* xo = as + br * L::LC + bc;
            float* to = ts + br * L::LC + bc;
#pragma unroll
            for (int bi = 1; bi < 4; ++bi) {
                float x[3] = {0.f, 0.f, 0.f};
#pragma unroll
                for (int bk = 0; bk < bi; ++bk) {
                    float a[16];
#pragma unroll
                    for (int mm = 0; mm < 16; mm += 4)
                        *reinterpret_cast<float4*>(a + mm) =
                            *reinterpret_cast<const float4*>(arow + 16 * bi * L::LC + 16 * bk + mm);
#pragma unroll
                    for (int bj = 0; bj <= bk; ++bj)
#pragma unroll
                        for (int mm = 0; mm < 16; ++mm)
                            x[bj] = __fmaf_rn(a[mm], tcol[(16 * bk + mm) * L::LC + 16 * bj], x[bj]);
                }
#pragma unroll
                for (int bj = 0; bj < bi; ++bj) xo[16 * bj * L::LC + 16 * bi] = x[bj];
                __syncthreads();
                float t[16];
#pragma unroll
                for (int mm = 0; mm < 16; mm += 4)
                    *reinterpret_cast<float4*>(t + mm) =
                        *reinterpret_cast<const float4*>(ts + br * L::LC + 16 * bi * L::LC + 16 * bi + mm);
#pragma unroll
                for (int bj = 0; bj < bi; ++bj) {
                    float acc = 0.f;
#pragma unroll
                    for (int mm = 0; mm < 16; ++mm)
                        acc = __fmaf_rn(t[mm], as[bc + (16 * bj + mm) * L::LC + 16 * bi], acc);
                    to[16 * bi * L::LC + 16 * bj] = -acc;
                }
                if (bi == 3) wait_groups<0>();  // this thread's k (first head) and v rows are in
                __syncthreads();
            }
        }

        // T as the pairs `split` makes (tf32(T) in place; SPLIT 3: tf32(T - tf32(T)) in A's buffer,
        // free now), made once here instead of by each warp that reads a fragment
        for (int e = tid; e < C * C / 4; e += THREADS) {
            const int i = e / (C / 4), c4 = (e % (C / 4)) * 4;
            split4_in_place<SPLIT>(ts + i * L::LC + c4, as + i * L::LC + c4);
        }
        __syncthreads();

        // W = T (beta e^c k) and U = T (beta v): warp w makes all 4 m-tiles of n-tiles w + 8 j, so
        // each B element is converted once
        const size_t head = (size_t)s * value_heads + hv;
        product_t<KD, L::LK, SPLIT, true>(w_out + head * C * KD, ts, as, ks, sc, warp, gq, tq);
        product_t<VD, L::LQ, SPLIT, false>(u_out + head * C * VD, ts, as, qs, bs, warp, gq, tq);
    }
}

// Shared-memory layout of phase 2 (floats).
template <int KD, int BV>
struct WalkSmem {
    static constexpr int LW = KD + 4;  // W and q rows (A fragments: 4 mod 32)
    static constexpr int LK = KD + 8;  // k rows, read transposed (banks 8t + g)
    static constexpr int LM = C + 4;   // M rows
    static constexpr int LS = BV + 8;  // S and V' rows, read as B fragments (banks 8t + g)
    static constexpr int W = 0;
    static constexpr int Q = W + C * LW;
    static constexpr int K = Q + C * LW;
    static constexpr int M = K + C * LK;
    static constexpr int S = M + C * LM;   // tf32(S)
    static constexpr int SL = S + KD * LS; // SPLIT 3: its low part, tf32(S - tf32(S))
    static constexpr int V = SL + KD * LS; // tf32(V'), then (SPLIT 3) its low part
    static constexpr int VL = V + C * LS;
    static constexpr int DV = VL + C * LS; // e^c, e^(c_last - c)
    static constexpr int FLOATS = DV + 2 * C;
};

// acc[nt] += (rows pr, pr + 8 of a) S for the NT n-tiles of S, over the key dim in order: the W S
// or q S of a walk step (a: the W or q rows in shared memory; S stored split, read as B).
template <int KD, int BV, int SPLIT, bool A_TF32>
__device__ __forceinline__ void times_state(float (&acc)[BV / 8][4], const float* a, const float* ss, const float* sl,
                                            int pr, int tq, int gq) {
    using L = WalkSmem<KD, BV>;
    // this thread's element of each fragment at k0 = 0, so that a k-step adds one offset and every
    // element is an immediate from it (indices (k0 + tq) L::LS + 8 nt + gq cost an add and a
    // multiply each in SASS)
    const float* ar = a + pr * L::LW + tq;
    const float* bh = ss + tq * L::LS + gq;
    const float* bl = sl + tq * L::LS + gq;
#pragma unroll 4
    for (int k0 = 0; k0 < KD; k0 += 8) {
        const float af[4] = {ar[k0], ar[8 * L::LW + k0], ar[k0 + 4], ar[8 * L::LW + k0 + 4]};
        const float* bhk = bh + k0 * L::LS;
        const float* blk = bl + k0 * L::LS;
#pragma unroll
        for (int nt = 0; nt < BV / 8; ++nt) {
            const float h[2] = {bhk[8 * nt], bhk[4 * L::LS + 8 * nt]};
            const float l[2] = {blk[8 * nt], blk[4 * L::LS + 8 * nt]};
            mma_split_b<SPLIT, A_TF32>(acc[nt], af, h, l);
        }
    }
}

// The walk's copies into shared memory (`walk` and delta_wgmma.cu's walk, whose layouts L share
// the row strides LW (W, q), LK (k) and LM (M)). Copy slots, the same every step: a thread copies
// the 16 bytes at column cc of rows cr + RS r of W, q and k, and at column mc of rows mr + MS r of
// M (the same elements a loop over e = tid, tid + THREADS, ... copies). Fixed slots cost a pointer
// add a copy where the loop redid the division and the row arithmetic for each (~34 SASS
// instructions a copy). Stage A: W and q rows of sub-chunk s; stage B: k rows, M, e^c /
// e^(c_last - c). Each commits one cp.async group.
template <int KD, int THREADS, class L>
struct WalkCopies {
    static constexpr int RS = THREADS / (KD / 4);  // W / q / k rows one pass of 16-byte copies covers
    static constexpr int MS = THREADS / (C / 4);   // M rows one pass covers
    static_assert(THREADS % (KD / 4) == 0 && C % RS == 0 && C % MS == 0 && THREADS >= 2 * C / 4, "copy split");
    const float *q, *k, *w_in, *m_in, *dv_in;
    int rows, off, value_heads, hv, tid, cr, cc, mr, mc;
    size_t row_len, qk_at, pass_len;

    __device__ __forceinline__ WalkCopies(const float* q_, const float* k_, const float* w_in_, const float* m_in_,
                                          const float* dv_in_, int rows_, int off_, int key_heads, int value_heads_,
                                          int hv_, int kh) {
        q = q_;
        k = k_;
        w_in = w_in_;
        m_in = m_in_;
        dv_in = dv_in_;
        rows = rows_;
        off = off_;
        value_heads = value_heads_;
        hv = hv_;
        tid = threadIdx.x;
        cr = tid / (KD / 4);
        cc = 4 * (tid % (KD / 4));
        mr = tid / (C / 4);
        mc = 4 * (tid % (C / 4));
        row_len = (size_t)key_heads * KD;
        qk_at = (size_t)cr * row_len + (size_t)kh * KD + cc;  // plus lo rows: a q / k slot
        pass_len = (size_t)RS * row_len;
    }

    __device__ __forceinline__ void stage_a(int s, float* ws, float* qs) const {
        const int lo = max(0, s * C - off), n = min(rows, (s + 1) * C - off) - lo;
        const float* w = w_in + ((size_t)s * value_heads + hv) * C * KD + cr * KD + cc;
        const size_t at = (size_t)lo * row_len + qk_at;
#pragma unroll
        for (int r = 0; r < C / RS; ++r) {
            copy16(ws + (cr + RS * r) * L::LW + cc, w + RS * r * KD, true);
            const bool live = cr + RS * r < n;
            copy16(qs + (cr + RS * r) * L::LW + cc, live ? q + at + r * pass_len : q, live);
        }
        commit();
    }

    __device__ __forceinline__ void stage_b(int s, float* kt, float* ms, float* dv) const {
        const int lo = max(0, s * C - off), n = min(rows, (s + 1) * C - off) - lo;
        const size_t at = (size_t)lo * row_len + qk_at;
#pragma unroll
        for (int r = 0; r < C / RS; ++r) {
            const bool live = cr + RS * r < n;
            copy16(kt + (cr + RS * r) * L::LK + cc, live ? k + at + r * pass_len : k, live);
        }
        const float* m = m_in + ((size_t)s * value_heads + hv) * C * C + mr * C + mc;
#pragma unroll
        for (int r = 0; r < C / MS; ++r) copy16(ms + (mr + MS * r) * L::LM + mc, m + MS * r * C, true);
        if (tid < 2 * C / 4) copy16(dv + 4 * tid, dv_in + ((size_t)s * value_heads + hv) * 2 * C + 4 * tid, true);
        commit();
    }
};

// Phase 2: one CTA of WARPS (4 or 8) warps per (BV state columns, value head) walks the sub-chunks.
// Sub-chunk rows: warp w works on m-tile w % 4 and all NT n-tiles of V' and O. With 8 warps, warps
// 0-3 make W S and V' = U - W S, and warps 4-7 make q S and O = e^c (q S) + M V' (each A fragment
// of W, q and M converted by one warp, and M V' reading the V' fragments the state update reads
// anyway); with 4 warps, each makes both. State rows: warp w owns key m-tiles w + WARPS j. S and
// V' are B operands that every warp reads: the warp that owns an element stores its tf32 pair
// once (split_store), and the readers multiply without converting (mma_split_b). The split by
// role and the fixed copy slots took the walk from 3,603 SASS instructions a warp a step to 2,357
// (warps 0-3) and 2,610 (warps 4-7), and the 9B's 32K-row call from 6.23 to 5.92 ms on the H100,
// with the same bits (bench/RESULTS.md, session 36).
// A step has three barriers: (1) S stored and stage A (W, q rows) in, (2) W S and q S done and
// stage B (k rows, M, row factors) in, (3) V' stored. Stage A of s + 1 is issued after (2),
// when W and q are read; stage B of s after (1), when the previous step's M V' and state
// update are past reading k, M and the row factors. V' has its own buffer, so the next step
// stores S while other warps still read V': no barrier ends a step.
template <int KD, int BV, int WARPS, int SPLIT>
__device__ __forceinline__ void walk(const float* q, const float* k, const float* w_in, const float* u_in,
                                     const float* m_in, const float* dv_in, float* state, float* out, int rows,
                                     int off, int key_heads, int value_heads, int value_dim) {
    using L = WalkSmem<KD, BV>;
    constexpr int THREADS = WARPS * 32;
    constexpr int NT = BV / 8;                       // n-tiles of the CTA's columns
    constexpr int MT = KD / 16;                      // m-tiles of the state
    constexpr int SJ = (MT + WARPS - 1) / WARPS;     // state m-tiles a warp owns (at most)
    static_assert((WARPS == 4 || WARPS == 8) && KD % 16 == 0, "tile split");
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
    const int pr = 16 * (warp % 4) + gq;  // this thread's first sub-chunk row of V' and O
    const bool makes_v = WARPS == 4 || warp < 4, makes_o = WARPS == 4 || warp >= 4;  // warp-uniform
    const int subchunks = (off + rows + C - 1) / C;
    state += (size_t)hv * KD * value_dim;  // this value head's [KD, value_dim] state

    float sacc[SJ][NT][4];
#pragma unroll
    for (int j = 0; j < SJ; ++j) {
        const int mt = warp + WARPS * j;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            if (mt < MT) {
                const float* src = state + (size_t)(16 * mt + gq) * value_dim + col0 + 8 * nt + 2 * tq;
                const float2 a = *reinterpret_cast<const float2*>(src);
                const float2 b = *reinterpret_cast<const float2*>(src + 8 * value_dim);
                sacc[j][nt][0] = a.x;
                sacc[j][nt][1] = a.y;
                sacc[j][nt][2] = b.x;
                sacc[j][nt][3] = b.y;
            } else {
                sacc[j][nt][0] = sacc[j][nt][1] = sacc[j][nt][2] = sacc[j][nt][3] = 0.f;
            }
        }
    }

    const WalkCopies<KD, THREADS, L> copies(q, k, w_in, m_in, dv_in, rows, off, key_heads, value_heads, hv, kh);

    copies.stage_a(0, ws, qs);
    for (int s = 0; s < subchunks; ++s) {
        const int lo = max(0, s * C - off), n = min(rows, (s + 1) * C - off) - lo;
        // the state at the sub-chunk start, as B fragments for everyone
#pragma unroll
        for (int j = 0; j < SJ; ++j) {
            const int mt = warp + WARPS * j;
            if (mt < MT) {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int at = (16 * mt + gq) * L::LS + 8 * nt + 2 * tq;
                    split_store<SPLIT>(ss + at, sl + at, sacc[j][nt][0]);
                    split_store<SPLIT>(ss + at + 1, sl + at + 1, sacc[j][nt][1]);
                    split_store<SPLIT>(ss + at + 8 * L::LS, sl + at + 8 * L::LS, sacc[j][nt][2]);
                    split_store<SPLIT>(ss + at + 8 * L::LS + 1, sl + at + 8 * L::LS + 1, sacc[j][nt][3]);
                }
            }
        }
        float uf[NT][4];
        if (makes_v) {
            const float* u = u_in + ((size_t)s * value_heads + hv) * C * value_dim + col0;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int col = 8 * nt + 2 * tq;
                const float2 a = *reinterpret_cast<const float2*>(u + (size_t)pr * value_dim + col);
                const float2 b = *reinterpret_cast<const float2*>(u + (size_t)(pr + 8) * value_dim + col);
                uf[nt][0] = a.x;
                uf[nt][1] = a.y;
                uf[nt][2] = b.x;
                uf[nt][3] = b.y;
            }
        }
        wait_groups<0>();  // stage A of s is in (the only copies in flight)
        __syncthreads();  // S stored; the previous step's k, M, V' and row factors read
        copies.stage_b(s, kt, ms, dv);

        // W S (p) and q S (z); with 8 warps a warp makes one of them, in `acc`
        float acc[NT][4], acc2[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nt][e] = acc2[nt][e] = 0.f;
        if (WARPS == 4) {
            times_state<KD, BV, SPLIT, true>(acc, ws, ss, sl, pr, tq, gq);
            times_state<KD, BV, SPLIT, false>(acc2, qs, ss, sl, pr, tq, gq);
        } else if (SPLIT == 3) {  // W and q converted alike: one loop for both roles
            times_state<KD, BV, SPLIT, false>(acc, makes_v ? ws : qs, ss, sl, pr, tq, gq);
        } else if (makes_v) {
            times_state<KD, BV, SPLIT, true>(acc, ws, ss, sl, pr, tq, gq);
        } else {
            times_state<KD, BV, SPLIT, false>(acc, qs, ss, sl, pr, tq, gq);
        }
        float(&p)[NT][4] = acc;
        float(&z)[NT][4] = WARPS == 4 ? acc2 : acc;
        wait_groups<0>();  // stage B of s is in
        __syncthreads();  // W, q and S buffers read
        if (s + 1 < subchunks) copies.stage_a(s + 1, ws, qs);

        // V' = U - W S (into shared memory); O = e^c (q S)
        if (makes_v) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int at = pr * L::LS + 8 * nt + 2 * tq;
                split_store<SPLIT>(vn + at, vl + at, __fsub_rn(uf[nt][0], p[nt][0]));
                split_store<SPLIT>(vn + at + 1, vl + at + 1, __fsub_rn(uf[nt][1], p[nt][1]));
                split_store<SPLIT>(vn + at + 8 * L::LS, vl + at + 8 * L::LS, __fsub_rn(uf[nt][2], p[nt][2]));
                split_store<SPLIT>(vn + at + 8 * L::LS + 1, vl + at + 8 * L::LS + 1, __fsub_rn(uf[nt][3], p[nt][3]));
            }
        }
        if (makes_o) {
            const float e0 = dv[pr], e1 = dv[pr + 8];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                z[nt][0] = __fmul_rn(z[nt][0], e0);
                z[nt][1] = __fmul_rn(z[nt][1], e0);
                z[nt][2] = __fmul_rn(z[nt][2], e1);
                z[nt][3] = __fmul_rn(z[nt][3], e1);
            }
        }
        __syncthreads();  // V' stored

        // S = e^(c_last) S + (k e^(c_last - c))^T V' and O += M V' in one pass over V': the
        // V' fragments of every n-tile serve the state update and M V'. Each O and state
        // element keeps its chain: the same products in the same k order.
        const float decay = dv[n - 1];
#pragma unroll
        for (int j = 0; j < SJ; ++j)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) sacc[j][nt][e] = __fmul_rn(sacc[j][nt][e], decay);
#pragma unroll
        for (int k0 = 0; k0 < C; k0 += 8) {
            float bh[NT][2], bl[NT][2];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int at = (k0 + tq) * L::LS + 8 * nt + gq;
                bh[nt][0] = vn[at];
                bh[nt][1] = vn[at + 4 * L::LS];
                bl[nt][0] = vl[at];
                bl[nt][1] = vl[at + 4 * L::LS];
            }
            if (makes_o) {
                float am[4];
                a_fragment(am, ms, L::LM, pr, k0, tq);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mma_split_b<SPLIT, true>(z[nt], am, bh[nt], bl[nt]);
            }
            const float d0 = dv[C + k0 + tq], d1 = dv[C + k0 + tq + 4];
#pragma unroll
            for (int j = 0; j < SJ; ++j) {
                const int m0 = 16 * (warp + WARPS * j) + gq;
                if (m0 < KD) {
                    const float a[4] = {__fmul_rn(kt[(k0 + tq) * L::LK + m0], d0),
                                        __fmul_rn(kt[(k0 + tq) * L::LK + m0 + 8], d0),
                                        __fmul_rn(kt[(k0 + tq + 4) * L::LK + m0], d1),
                                        __fmul_rn(kt[(k0 + tq + 4) * L::LK + m0 + 8], d1)};
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) mma_split_b<SPLIT>(sacc[j][nt], a, bh[nt], bl[nt]);
                }
            }
        }
        if (makes_o) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int col = col0 + 8 * nt + 2 * tq;
                if (pr < n)
                    *reinterpret_cast<float2*>(out + ((size_t)(lo + pr) * value_heads + hv) * value_dim + col) =
                        make_float2(z[nt][0], z[nt][1]);
                if (pr + 8 < n)
                    *reinterpret_cast<float2*>(out + ((size_t)(lo + pr + 8) * value_heads + hv) * value_dim + col) =
                        make_float2(z[nt][2], z[nt][3]);
            }
        }
    }

#pragma unroll
    for (int j = 0; j < SJ; ++j) {
        const int mt = warp + WARPS * j;
        if (mt < MT) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                float* dst = state + (size_t)(16 * mt + gq) * value_dim + col0 + 8 * nt + 2 * tq;
                *reinterpret_cast<float2*>(dst) = make_float2(sacc[j][nt][0], sacc[j][nt][1]);
                *reinterpret_cast<float2*>(dst + 8 * value_dim) = make_float2(sacc[j][nt][2], sacc[j][nt][3]);
            }
        }
    }
}

}  // namespace delta

// Entry points (numba's ABI: status return, result pointer first; pointers and counts as int64).
// delta_mma.py appends the instantiations it needs (DELTA_PREPARE / DELTA_WALK lines) to this
// source, one (KD, VD, ...) set per compile.
#define DELTA_PREPARE(KD, VD, SPLIT)                                                                            \
    extern "C" __device__ int delta_prepare_##KD##_##VD##_##SPLIT(                                              \
        int* result, long long q, long long k, long long mixed, long long g, long long beta, long long w,       \
        long long u, long long m, long long dv, long long rows, long long off, long long key_heads,             \
        long long value_heads, long long channels, long long v0, long long per_block) {                         \
        delta::prepare<KD, VD, SPLIT>(                                                                          \
            reinterpret_cast<const float*>(q), reinterpret_cast<const float*>(k),                               \
            reinterpret_cast<const float*>(mixed), reinterpret_cast<const float*>(g),                           \
            reinterpret_cast<const float*>(beta), reinterpret_cast<float*>(w), reinterpret_cast<float*>(u),     \
            reinterpret_cast<float*>(m), reinterpret_cast<float*>(dv), (int)rows, (int)off, (int)key_heads,     \
            (int)value_heads, (int)channels, (int)v0, (int)per_block);                                          \
        *result = 0;                                                                                            \
        return 0;                                                                                               \
    }

#define DELTA_WALK(KD, BV, WARPS, SPLIT)                                                                         \
    extern "C" __device__ int delta_walk_##KD##_##BV##_##WARPS##_##SPLIT(                                       \
        int* result, long long q, long long k, long long w, long long u, long long m, long long dv,             \
        long long state, long long out, long long rows, long long off, long long key_heads,                     \
        long long value_heads, long long value_dim) {                                                           \
        delta::walk<KD, BV, WARPS, SPLIT>(                                                                      \
            reinterpret_cast<const float*>(q), reinterpret_cast<const float*>(k),                               \
            reinterpret_cast<const float*>(w), reinterpret_cast<const float*>(u),                               \
            reinterpret_cast<const float*>(m), reinterpret_cast<const float*>(dv),                              \
            reinterpret_cast<float*>(state), reinterpret_cast<float*>(out), (int)rows, (int)off,                \
            (int)key_heads, (int)value_heads, (int)value_dim);                                                  \
        *result = 0;                                                                                            \
        return 0;                                                                                               \
    }
