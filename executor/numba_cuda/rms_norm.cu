// The residual add and zero-centred RMSNorm of one row a CTA, with the row in registers
// (Qwen3.5's Qwen3_5RMSNorm in transformers: x * rsqrt(mean(x^2) + eps) * (1 + weight)),
// written for warmstate's exactness rules.
//
// Called from a numba kernel (norms.py) through numba-cuda's `link=`: the entry points are
// `extern "C" __device__` with numba's calling convention (int status return, first argument
// a pointer to the result), compiled by NVRTC.
//
// Why: numba's kernel (norms._add_rms_norm_kernel) reads a row in rounds of a few loads,
// writes x back, then reads it again for the output. A short chunk's norm is a chain of those
// memory latencies (27B, 51 rows: 13 us a call, 129 calls a forward: 1.7 ms, H200 CUPTI,
// bench/RESULTS.md session 20). Here every load of a thread's part of the row is in flight at
// once (VEC float4 of x and of delta), the row stays in registers for the output, and the
// reduction is one pass of warp shuffles and one of shared memory.
//
// Exactness (DESIGN "invariant grid"): a row's bits depend on its own values, the weight,
// THREADS and nothing else. Thread t holds float4s t, t + THREADS, ... of the row; it sums
// their squares in that order (x, y, z, w of each, one fused multiply-add each), the warp
// adds lanes by xor-16, 8, 4, 2, 1 shuffles, and every thread adds the warps' sums in warp
// order from shared memory. No bit depends on how many rows the chunk has.
//
// Shapes (row-major, C-contiguous, 16-byte aligned rows): x f32 [rows, dim] (x += delta in
// place when has_delta); delta f32 [rows, dim]; weight f32 [dim]; out bf16 bits [rows, dim];
// dim a multiple of 4 and at most 4 * VEC * THREADS.

typedef unsigned short bf16_t;
typedef unsigned int u32;

// Two floats to packed bf16 (lo in the low half), round to nearest even: one cvt.
__device__ __forceinline__ u32 norm_pack2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

template <int THREADS, int VEC>
__device__ __forceinline__ void add_rms_norm_row(float* x, const float* delta, int has_delta, const float* weight,
                                                 float eps, bf16_t* out, int dim) {
    constexpr int WARPS = THREADS / 32;
    __shared__ float warp_sums[WARPS];
    const int row = blockIdx.x, t = threadIdx.x;
    const int quads = dim / 4;
    float4* xr = reinterpret_cast<float4*>(x + (size_t)row * dim);
    float4 v[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
        const int i = t + k * THREADS;
        v[k] = i < quads ? xr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    if (has_delta) {
        const float4* dr = reinterpret_cast<const float4*>(delta + (size_t)row * dim);
        float4 d[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            const int i = t + k * THREADS;
            d[k] = i < quads ? dr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            v[k].x = __fadd_rn(v[k].x, d[k].x);
            v[k].y = __fadd_rn(v[k].y, d[k].y);
            v[k].z = __fadd_rn(v[k].z, d[k].z);
            v[k].w = __fadd_rn(v[k].w, d[k].w);
            if (t + k * THREADS < quads) xr[t + k * THREADS] = v[k];
        }
    }
    float ssq = 0.0f;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {  // elements past the row are zeros: they add exact zeros
        ssq = __fmaf_rn(v[k].x, v[k].x, ssq);
        ssq = __fmaf_rn(v[k].y, v[k].y, ssq);
        ssq = __fmaf_rn(v[k].z, v[k].z, ssq);
        ssq = __fmaf_rn(v[k].w, v[k].w, ssq);
    }
#pragma unroll
    for (int step = 16; step > 0; step /= 2) ssq = __fadd_rn(ssq, __shfl_xor_sync(0xffffffffu, ssq, step));
    if (t % 32 == 0) warp_sums[t / 32] = ssq;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total = __fadd_rn(total, warp_sums[w]);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, (float)dim), eps)));
    const float4* wr = reinterpret_cast<const float4*>(weight);
    uint2* orow = reinterpret_cast<uint2*>(out + (size_t)row * dim);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
        const int i = t + k * THREADS;
        if (i >= quads) continue;
        const float4 w = wr[i];
        const float a = __fmul_rn(__fmul_rn(v[k].x, inv), __fadd_rn(1.0f, w.x));
        const float b = __fmul_rn(__fmul_rn(v[k].y, inv), __fadd_rn(1.0f, w.y));
        const float c = __fmul_rn(__fmul_rn(v[k].z, inv), __fadd_rn(1.0f, w.z));
        const float e = __fmul_rn(__fmul_rn(v[k].w, inv), __fadd_rn(1.0f, w.w));
        orow[i] = make_uint2(norm_pack2(a, b), norm_pack2(c, e));
    }
}

// Entry points: numba's ABI (status return, result pointer first); pointers and counts as
// int64, eps as float32.
#define NORM_ENTRY(THREADS, VEC)                                                                                 \
    extern "C" __device__ int add_rms_norm_##THREADS##_##VEC(int* result, long long x, long long delta,          \
                                                            long long has_delta, long long weight, float eps,    \
                                                            long long out, long long dim) {                      \
        add_rms_norm_row<THREADS, VEC>(reinterpret_cast<float*>(x), reinterpret_cast<const float*>(delta),       \
                                       (int)has_delta, reinterpret_cast<const float*>(weight), eps,              \
                                       reinterpret_cast<bf16_t*>(out), (int)dim);                                \
        *result = 0;                                                                                             \
        return 0;                                                                                                \
    }

NORM_ENTRY(256, 1)
NORM_ENTRY(256, 2)
NORM_ENTRY(256, 3)
NORM_ENTRY(256, 4)
NORM_ENTRY(256, 5)
NORM_ENTRY(256, 6)
NORM_ENTRY(256, 7)
NORM_ENTRY(256, 8)
NORM_ENTRY(1024, 1)
NORM_ENTRY(1024, 2)
