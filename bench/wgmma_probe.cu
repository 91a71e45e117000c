// bench/wgmma_probe.py's kernels (issue 5): is wgmma (sm_90a) reachable from our toolchain, which
// shared-memory descriptor layout it reads, are its fp32 sums bit-equal to chained mma.sync
// m16n8k16's, and what each reaches on a loop whose operands never leave the SM. One 64 x 64 x 64
// product a case: A [64, 64] and B row-major bf16, C f32. Shared-memory operands are core matrices
// of 8 rows x 16 bytes (PTX ISA, "Shared Memory Matrix Layout", no swizzle).

// Appended to bench/flash_wgmma.py's source (flash_attention.cu's helpers: smem_addr, pack2, mma;
// executor/numba_cuda/wgmma.cu's: wg_desc, wg_fence, wg_commit, wg_wait0, wg_keep, wg_proxy_fence).
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
// @WGMMA_FUNCTIONS@


// A [64, 64] row-major (K contiguous) into core matrices (8 rows x 16 B) at
// (row / 8) * 1024 B + (k / 8) * 128 B. B_k [64 (n), 64 (k)] K-major the same way; B_mn
// [64 (k), 64 (n)] row-major (N contiguous): core (k / 8, n / 8) at (k / 8) * 1024 + (n / 8) * 128,
// inside (k % 8) * 16 B + (n % 8) * 2 B.
__device__ __forceinline__ int core_off(int r, int c) { return (r / 8) * 512 + (c / 8) * 64 + (r % 8) * 8 + (c % 8); }

extern "C" __global__ void __launch_bounds__(128) gemm_ss(const bf16_t* A, const bf16_t* B, float* C, int lbo_a,
                                                          int sbo_a, int lbo_b, int sbo_b, int b_mn) {
    __shared__ __align__(128) bf16_t sa[64 * 64];
    __shared__ __align__(128) bf16_t sb[64 * 64];
    const int tid = threadIdx.x;
    for (int e = tid; e < 64 * 64; e += 128) {
        const int r = e / 64, c = e % 64;
        sa[core_off(r, c)] = A[e];
        sb[core_off(r, c)] = B[e];  // B_k: r = n, c = k; B_mn: r = k, c = n
    }
    wg_proxy_fence();
    __syncthreads();
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.0f;
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        const unsigned long long da = wg_desc(smem_addr(sa) + ks * 256, lbo_a, sbo_a);
        if (b_mn) {
            const unsigned long long db = wg_desc(smem_addr(sb) + ks * 2048, lbo_b, sbo_b);
            wgmma_ss_n64_t1(d, da, db);
        } else {
            const unsigned long long db = wg_desc(smem_addr(sb) + ks * 256, lbo_b, sbo_b);
            wgmma_ss_n64_t0(d, da, db);
        }
    }
    wg_commit();
    wg_wait0();
    wg_keep<32>(d);
    const int w = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const int n8 = i / 4, r = (i % 4) / 2, e = i % 2;
        C[(16 * w + g + 8 * r) * 64 + 8 * n8 + 2 * t + e] = d[i];
    }
}

// A from registers (the P of P V): warp w's rows 16w.., mma.sync's A fragment layout.
extern "C" __global__ void __launch_bounds__(128) gemm_rs(const bf16_t* A, const bf16_t* B, float* C, int lbo_b,
                                                          int sbo_b, int b_mn) {
    __shared__ __align__(128) bf16_t sb[64 * 64];
    const int tid = threadIdx.x;
    for (int e = tid; e < 64 * 64; e += 128) sb[core_off(e / 64, e % 64)] = B[e];
    wg_proxy_fence();
    __syncthreads();
    const int w = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const u32* A32 = reinterpret_cast<const u32*>(A);  // [64, 32] pairs
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.0f;
    u32 a[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        const int r0 = 16 * w + g, c0 = 16 * ks + 2 * t;
        a[ks][0] = A32[(r0 * 64 + c0) / 2];
        a[ks][1] = A32[((r0 + 8) * 64 + c0) / 2];
        a[ks][2] = A32[(r0 * 64 + c0 + 8) / 2];
        a[ks][3] = A32[((r0 + 8) * 64 + c0 + 8) / 2];
    }
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        if (b_mn) {
            wgmma_rs_n64_t1(d, a[ks], wg_desc(smem_addr(sb) + ks * 2048, lbo_b, sbo_b));
        } else {
            wgmma_rs_n64_t0(d, a[ks], wg_desc(smem_addr(sb) + ks * 256, lbo_b, sbo_b));
        }
    }
    wg_commit();
    wg_wait0();
    wg_keep<32>(d);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const int n8 = i / 4, r = (i % 4) / 2, e = i % 2;
        C[(16 * w + g + 8 * r) * 64 + 8 * n8 + 2 * t + e] = d[i];
    }
}

// The same product by chained mma.sync m16n8k16 (k-steps in order): bit-compare with wgmma.
// B K-major [64 (n), 64 (k)].
extern "C" __global__ void __launch_bounds__(128) gemm_mma(const bf16_t* A, const bf16_t* B, float* C) {
    const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const u32* A32 = reinterpret_cast<const u32*>(A);
    const u32* B32 = reinterpret_cast<const u32*>(B);
    float d[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        const int r0 = 16 * w + g, c0 = 16 * ks + 2 * t;
        u32 a[4] = {A32[(r0 * 64 + c0) / 2], A32[((r0 + 8) * 64 + c0) / 2], A32[(r0 * 64 + c0 + 8) / 2],
                    A32[((r0 + 8) * 64 + c0 + 8) / 2]};
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            const int col = 8 * n + g;  // B fragment: b0 = B[k 2t.., n g], b1 = B[k 8+2t.., n g]
            mma(d[n], a, B32[(col * 64 + c0) / 2], B32[(col * 64 + c0 + 8) / 2]);
        }
    }
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) C[(16 * w + g + 8 * (e / 2)) * 64 + 8 * n + 2 * t + e % 2] = d[n][e];
}

// Throughput: each warpgroup issues `iters` x 4 wgmma m64n256k16 from shared memory (A its own
// 64 x 64 tile, B one 256 x 64 tile), one commit group per 4, at most one group in flight.
extern "C" __global__ void __launch_bounds__(256, 1) loop_wgmma(float* out, int iters) {
    extern __shared__ __align__(128) unsigned char smem[];
    bf16_t* sa = reinterpret_cast<bf16_t*>(smem);            // 2 x 64 x 64
    bf16_t* sb = sa + 2 * 64 * 64;                            // 256 x 64
    for (int e = threadIdx.x; e < (2 * 64 + 256) * 64; e += blockDim.x) sa[e] = (bf16_t)(0x3c00 + (e & 7));
    wg_proxy_fence();
    __syncthreads();
    const int wg = threadIdx.x / 128;
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.0f;
    const u32 a0 = smem_addr(sa + wg * 64 * 64), b0 = smem_addr(sb);
    wg_fence();
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
            wgmma_ss_n256_t0(d, wg_desc(a0 + ks * 256, 128, 1024), wg_desc(b0 + ks * 256, 128, 1024));
        wg_commit();
        wg_wait1();
    }
    wg_wait0();
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 128; ++i) s += d[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// Throughput of mma.sync m16n8k16 from registers: 8 warps, 16 independent accumulators a warp.
extern "C" __global__ void __launch_bounds__(256, 1) loop_mma(float* out, int iters) {
    u32 a[4] = {0x3c003c00u + threadIdx.x, 0x3c003c01u, 0x3c003c02u, 0x3c003c03u};
    u32 b0 = 0x3c003c00u ^ threadIdx.x, b1 = 0x3c003c05u;
    float d[16][4];
#pragma unroll
    for (int j = 0; j < 16; ++j) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.0f;
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int j = 0; j < 16; ++j) mma(d[j], a, b0, b1);
    }
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) s += d[j][0] + d[j][1] + d[j][2] + d[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// A 16-step chain on one accumulator (k = 256, S = Q K^T's shape at head_dim 256): each of the
// CTA's two warpgroups issues `iters` chains of 16 wgmma m64nNk16, A from registers (rs) or shared
// memory (ss, K-major), B K-major [N, 256], each chain waited before the next (as the flash
// walks wait for S). cycles[2 * CTA + warpgroup]: its clock cycles
// over the loop. The walk's products (`chain_walk`): S on m64n32k16 from registers, waited, then
// P V as two m64n256k16 from registers, B MN-major, left in flight (the next S waits for it), a
// block each iteration.
// The chains' operands: `elements` bf16 of shared memory and a thread's 16 A fragments, small
// finite values (their bits do not matter to a timing), the shared ones fenced for wgmma.
__device__ __forceinline__ void fill_operands(bf16_t* shared, int elements, u32 (&a)[16][4]) {
    for (int e = threadIdx.x; e < elements; e += blockDim.x) shared[e] = (bf16_t)(0x3c00 + (e & 7));
#pragma unroll
    for (int k = 0; k < 16; ++k)
#pragma unroll
        for (int i = 0; i < 4; ++i) a[k][i] = 0x3c003c00u + ((threadIdx.x + k + i) & 7);
    wg_proxy_fence();
    __syncthreads();
}

template <int N, typename Op>
__device__ __forceinline__ void chain_loop(float* out, long long* cycles, int iters, Op op) {
    extern __shared__ __align__(128) unsigned char smem[];
    bf16_t* sa = reinterpret_cast<bf16_t*>(smem);  // 2 warpgroups x 64 x 256, core layout
    bf16_t* sb = sa + 2 * 64 * 256;                 // N x 256, core layout
    u32 a[16][4];
    fill_operands(sa, (2 * 64 + N) * 256, a);
    const int wg = threadIdx.x / 128;
    float d[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
    const u32 a0 = smem_addr(sa + wg * 64 * 256), b0 = smem_addr(sb);
    const long long t0 = clock64();
    for (int it = 0; it < iters; ++it) {
        wg_fence();
#pragma unroll
        for (int k = 0; k < 16; ++k) op(d, a[k], wg_desc(a0 + k * 256, 128, 4096), wg_desc(b0 + k * 256, 128, 4096));
        wg_commit();
        wg_wait0();
        wg_keep<N / 2>(d);
    }
    const long long t1 = clock64();
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) s += d[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if (threadIdx.x % 128 == 0) cycles[2 * blockIdx.x + wg] = t1 - t0;
}

#define CHAIN_KERNEL(N, SRC, A)                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 1)                                              \
        chain_##SRC##_n##N(float* out, long long* cycles, int iters) {                                \
        chain_loop<N>(out, cycles, iters,                                                             \
                      [](float(&d)[N / 2], const u32* a, unsigned long long ad, unsigned long long bd) { \
                          wgmma_##SRC##_n##N##_t0(d, A, bd);                                          \
                      });                                                                             \
    }
CHAIN_KERNEL(32, rs, a)
CHAIN_KERNEL(32, ss, ad)
CHAIN_KERNEL(64, rs, a)
CHAIN_KERNEL(64, ss, ad)
CHAIN_KERNEL(128, rs, a)
CHAIN_KERNEL(256, rs, a)

extern "C" __global__ void __launch_bounds__(256, 1) chain_walk(float* out, long long* cycles, int iters) {
    extern __shared__ __align__(128) unsigned char smem[];
    bf16_t* sk = reinterpret_cast<bf16_t*>(smem);  // K block [32, 256] then V block, core layout
    u32 a[16][4];
    fill_operands(sk, 2 * 32 * 256, a);
    const int wg = threadIdx.x / 128;
    float s[16], o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;
    const u32 k0 = smem_addr(sk), v0 = k0 + 32 * 256 * 2;
    const long long t0 = clock64();
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < 16; ++i) s[i] = 0.0f;
        wg_fence();
#pragma unroll
        for (int k = 0; k < 16; ++k) wgmma_rs_n32_t0(s, a[k], wg_desc(k0 + k * 256, 128, 4096));
        wg_commit();
        wg_wait0();
        wg_keep<16>(s);
        wg_keep<128>(o);
        u32 p[2][4];
#pragma unroll
        for (int k = 0; k < 2; ++k)
#pragma unroll
            for (int i = 0; i < 4; ++i) p[k][i] = pack2(s[8 * k + 2 * i], s[8 * k + 2 * i + 1]);
        wg_fence();
#pragma unroll
        for (int k = 0; k < 2; ++k) wgmma_rs_n256_t1(o, p[k], wg_desc(v0 + k * 2 * 32 * 128, 32 * 128, 128));
        wg_commit();
    }
    wg_wait0();
    wg_keep<128>(o);
    const long long t1 = clock64();
    float r = 0.0f;
#pragma unroll
    for (int i = 0; i < 128; ++i) r += o[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = r;
    if (threadIdx.x % 128 == 0) cycles[2 * blockIdx.x + wg] = t1 - t0;
}
