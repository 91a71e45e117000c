// A one-thread kernel that keeps the GPU busy while the server waits for work (keep_warm.py):
// it polls a flag in host memory (mapped, pinned) and returns when the host sets it, or after
// max_ns nanoseconds of the GPU's global timer, whichever comes first.
//
// Called from a numba kernel through numba-cuda's `link=` (numba's calling convention: int
// status return, first argument a pointer to the result). The flag is read through a volatile
// pointer, so every iteration loads it again over the bus; __nanosleep keeps the thread's
// issue rate negligible (one load every ~2 us).

extern "C" __device__ int keep_warm_spin(int* result, long long flag_ptr, long long max_ns) {
    const volatile int* flag = reinterpret_cast<const volatile int*>(flag_ptr);
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    while (*flag == 0) {
        __nanosleep(2000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if ((long long)(now - start) >= max_ns) break;
    }
    *result = 0;
    return 0;
}
