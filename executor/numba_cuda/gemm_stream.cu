// Short-chunk GEMM on the tensor cores: Y[M, N] (fp32) = X[M, K] W[N, K]^T (bf16 in, fp32
// accumulate) for M <= 16 * MT rows, streaming each weight row once.
//
// Why: at M = 51 cuBLASLt's bit-equal algorithms stream the weights at 1.1-5.5x their
// bandwidth floor for Qwen3.5's narrow shapes (27B down_proj 5120 x 17408: 75-84 us against
// 41.5 us; bench/RESULTS.md, session 11). Here a CTA owns NT = WARPS * NW output columns and
// every row: it streams W[n0 : n0 + NT, :] through shared memory in K tiles of KT with
// cp.async (STAGES deep), X's matching tile beside it (from L2), and each warp multiplies all
// rows by its NW columns (mma.sync.m16n8k16, bf16 in, fp32 accumulate; fragments through
// ldmatrix).
//
// Bits: every output element is one fp32 accumulator that takes the k16 products of
// k = 0, 16, 32, ... in ascending order, a chain that depends neither on M nor on the
// columns, warps or tiles beside it (rows of one mma never mix). On the H200 that chain is
// bit-equal to cuBLASLt's pinned algorithms for the 2B and 27B shapes (the 9B ones with the
// first version) at 9 row counts from 1 to 64 (bench/gemm_short.py); the backend does not use
// this kernel (slower: gemm_stream.py).
//
// Shapes (row-major, C-contiguous): x bf16 bits [m, k] and w bf16 bits [n, k], 16-byte
// aligned; y f32 [m, n], 8-byte aligned; k a multiple of KT, n a multiple of 8 (the n-tile),
// 1 <= m <= 16 * MT. Rows of the last m-tile past m and columns past n are zero-filled in
// shared memory (never read from global memory, never stored). Dynamic shared memory:
// STAGES * (16 * MT + NT) * (KT + 8) bf16.

typedef unsigned short bf16_t;
typedef unsigned int u32;

// PTX helpers (the host emulator of tests/executor/numba_cuda/emulator replaces this part)
__device__ __forceinline__ u32 gs_smem_addr(const void* p) {
    u32 addr;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(p));
    return addr;
}

// 16 bytes global -> shared, or 16 zero bytes when !live (no global read).
__device__ __forceinline__ void gs_copy16(u32 dst, const void* src, bool live) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(live ? 16 : 0));
}

__device__ __forceinline__ void gs_commit() { asm volatile("cp.async.commit_group;" ::); }

template <int N>
__device__ __forceinline__ void gs_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ void gs_ldsm4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void gs_mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One K tile (columns [kt * KT, kt * KT + KT)) of the CTA's MT * 16 rows of x and NT rows of w
// into stage buffers xs [MT * 16, LDS] and ws [NT, LDS] (rows past m or n zero-filled, nothing
// read for them); one commit group.
template <int MT, int NT, int KT, int THREADS>
__device__ __forceinline__ void gs_load(bf16_t* xs, bf16_t* ws, const bf16_t* x, const bf16_t* w, int m, int n, int k,
                                        int n0, int kt) {
    constexpr int LDS = KT + 8;
    constexpr int PIECES = KT / 8;  // 16-byte pieces a row
    const size_t col = (size_t)kt * KT;
#pragma unroll
    for (int c = threadIdx.x; c < MT * 16 * PIECES; c += THREADS) {
        const int r = c / PIECES, p = c % PIECES;
        const bool live = r < m;
        gs_copy16(gs_smem_addr(xs + r * LDS + p * 8), x + (live ? (size_t)r * k + col + p * 8 : 0), live);
    }
#pragma unroll
    for (int c = threadIdx.x; c < NT * PIECES; c += THREADS) {
        const int r = c / PIECES, p = c % PIECES;
        const bool live = n0 + r < n;
        gs_copy16(gs_smem_addr(ws + r * LDS + p * 8), w + (live ? (size_t)(n0 + r) * k + col + p * 8 : 0), live);
    }
    gs_commit();
}

template <int WARPS, int NW, int MT, int KT, int STAGES>
__device__ __forceinline__ void gemm_stream(const bf16_t* x, const bf16_t* w, float* y, int m, int n, int k) {
    constexpr int NT = WARPS * NW;
    constexpr int LDS = KT + 8;  // shared row stride (elements): 16-byte rows, ldmatrix conflict-free
    constexpr int THREADS = WARPS * 32;
    constexpr int XS = MT * 16 * LDS, WS = NT * LDS;
    constexpr int NTILES = NW / 8;
    extern __shared__ __align__(16) bf16_t smem[];  // STAGES * (XS + WS) elements (gemm_stream.Variant.shared_bytes)

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * NT;
    const int ktiles = k / KT;

    float acc[MT][NTILES][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NTILES; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    // ldmatrix lane addresses (elements within a stage's buffer): A (x, row-major) as the
    // four 8x8 matrices rows 0-7 / 8-15 x k 0-7 / 8-15; B (w, [n][k]) matrix j = lane / 8
    // covers k 8j..8j+7 of the tile's first two k16 steps for the n-tile's 8 rows.
    const int a_off = (lane % 16) * LDS + (lane / 16) * 8;
    const int b_off = (warp * NW + (lane & 7)) * LDS + (lane >> 3) * 8;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ktiles) {
            gs_load<MT, NT, KT, THREADS>(smem + s * (XS + WS), smem + s * (XS + WS) + XS, x, w, m, n, k, n0, s);
        } else {
            gs_commit();
        }
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        gs_wait<STAGES - 2>();
        __syncthreads();  // tile kt is in for every thread; every warp is done with tile kt - 1
        {
            const int next = kt + STAGES - 1;
            bf16_t* buf = smem + (next % STAGES) * (XS + WS);
            if (next < ktiles) {
                gs_load<MT, NT, KT, THREADS>(buf, buf + XS, x, w, m, n, k, n0, next);
            } else {
                gs_commit();
            }
        }
        const bf16_t* xs = smem + (kt % STAGES) * (XS + WS);
        const u32 xa = gs_smem_addr(xs) + 2u * a_off;
        const u32 wb = gs_smem_addr(xs + XS) + 2u * b_off;
#pragma unroll
        for (int kk = 0; kk < KT / 32; ++kk) {  // two k16 steps at a time (one B ldmatrix.x4)
            u32 b[NTILES][4];
#pragma unroll
            for (int j = 0; j < NTILES; ++j)
                gs_ldsm4(b[j][0], b[j][1], b[j][2], b[j][3], wb + 2u * (j * 8 * LDS + kk * 32));
#pragma unroll
            for (int step = 0; step < 2; ++step) {
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    u32 a0, a1, a2, a3;
                    gs_ldsm4(a0, a1, a2, a3, xa + 2u * (i * 16 * LDS + kk * 32 + step * 16));
#pragma unroll
                    for (int j = 0; j < NTILES; ++j) gs_mma(acc[i][j], a0, a1, a2, a3, b[j][2 * step], b[j][2 * step + 1]);
                }
            }
        }
    }
    gs_wait<0>();

#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int j = 0; j < NTILES; ++j) {
            const int col = n0 + warp * NW + j * 8 + 2 * t;
            if (col >= n) continue;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = i * 16 + g + 8 * h;
                if (row < m) {
                    *reinterpret_cast<float2*>(y + (size_t)row * n + col) = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                }
            }
        }
    }
}

// Entry points: numba's ABI (status return, result pointer first); pointers and sizes as int64.
#define GEMM_STREAM_ENTRY(WARPS, NW, MT, KT, STAGES)                                                              \
    extern "C" __device__ int gemm_stream_##WARPS##_##NW##_##MT##_##KT##_##STAGES(                                \
        int* result, long long x, long long w, long long y, long long m, long long n, long long k) {             \
        gemm_stream<WARPS, NW, MT, KT, STAGES>(reinterpret_cast<const bf16_t*>(x), reinterpret_cast<const bf16_t*>(w), \
                                               reinterpret_cast<float*>(y), (int)m, (int)n, (int)k);             \
        *result = 0;                                                                                             \
        return 0;                                                                                                \
    }
