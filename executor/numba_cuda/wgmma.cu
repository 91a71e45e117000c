// The warpgroup-MMA (wgmma, sm_90a) helpers both NVRTC-built walks use: prefill attention's
// (flash_wgmma.cu, after flash_attention.cu) and the delta rule's (delta_wgmma.cu, after
// delta_mma.cu); each source goes after the text that defines u32 (attention_wgmma.source,
// delta_wgmma.source).

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Shared-memory writes of the generic proxy (st.shared, cp.async) made visible to wgmma's reads
// (the async proxy) after the next barrier.
__device__ __forceinline__ void wg_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Registers an in-flight wgmma writes (its accumulator) or reads (an A fragment), pinned after its
// wait: else the compiler may read an accumulator, or reuse an A register, before the wgmma is done.
template <int N>
__device__ __forceinline__ void wg_keep(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void wg_keep(u32* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// The host emulator of the delta rule's tests stands in for everything above and runs what follows.

// A shared-memory matrix descriptor without swizzle (PTX ISA, "Matrix Descriptor Format"): start
// address, leading and stride byte offsets, each >> 4.
__device__ __forceinline__ unsigned long long wg_desc(u32 addr, u32 lbo, u32 sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32);
}
