// gemm_stream.py's launch of gemm_stream.cu on the host emulator (cuda_host.h), with the PTX
// helpers that source takes from inline assembly emulated here: cp.async of 16 bytes (the
// destination reads as bf16 NaN until its wait), ldmatrix .x4 (a warp collective: each lane
// gives one row address; matrix i's row j comes from lane 8i + j; lane l receives elements
// 2(l%4), 2(l%4)+1 of row l/4 of each matrix), and mma.sync.m16n8k16 bf16 with fp32
// accumulation from the PTX ISA fragment tables ("Matrix fragments for mma.m16n8k16",
// .bf16): a0 (g, 2t..2t+1), a1 (g+8, ..), a2 (g, 2t+8..), a3 (g+8, 2t+8..); b0 (k 2t..2t+1,
// n g), b1 (k 2t+8.., n g); d0..d3 (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1). Products
// are exact, summed in double with the accumulator (not the tensor cores' order: bits are
// compared only between emulated runs). `gemm_stream_kernels.inc` is gemm_stream.cu's device
// code, made by test_gemm_stream_emulated.py.
//
// usage: gemm_stream_host DIR WARPS NW MT KT STAGES M N K
//   DIR holds x.bin (bf16 bits [M, K]) and w.bin (bf16 bits [N, K]) and receives y.bin
//   (f32 [M, N]). Inputs and shared memory sit between guard zones of bf16 NaN (an mma that
//   reads one aborts), the output starts as NaN between guard zones; the runner aborts on an
//   overwritten guard or an output element left unwritten.
#include <string>

#include "cuda_host.h"

inline u32 gs_smem_addr(const void* p) {
    const long off = (const char*)p - (const char*)g_smem;
    if (off < 0 || off % 16) {
        std::fprintf(stderr, "shared address %ld outside the buffer or not 16-byte aligned\n", off);
        std::abort();
    }
    return (u32)off;
}

// live = false: 16 zero bytes land (cp.async's src-size 0), the source is not read.
inline void gs_copy16(u32 dst, const void* src, bool live) {
    char* d = (char*)g_smem + dst;
    if ((size_t)src % 16) {
        std::fprintf(stderr, "cp.async source not 16-byte aligned\n");
        std::abort();
    }
    if (!g_async) {
        if (live) std::memcpy(d, src, 16);
        else std::memset(d, 0, 16);
        return;
    }
    std::memset(d, 0xff, 16);  // in flight: bf16 NaN until the wait
    g_fiber->open.push_back({(float*)d, (const float*)src, live});
}

inline void gs_commit() {
    if (g_async) {
        g_fiber->groups.push_back(g_fiber->open);
        g_fiber->open.clear();
    }
}

template <int N>
inline void gs_wait() {
    auto& groups = g_fiber->groups;
    while ((int)groups.size() > N) {
        for (const Copy& c : groups.front()) {
            if (c.live) std::memcpy(c.dst, c.src, 16);
            else std::memset(c.dst, 0, 16);
        }
        groups.erase(groups.begin());
    }
}

inline void gs_ldsm4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    const int w = g_fiber->tid / 32, l = g_fiber->tid % 32;
    if (addr % 16) {
        std::fprintf(stderr, "ldmatrix row address %u not 16-byte aligned\n", addr);
        std::abort();
    }
    g_exchange[w][l][0] = addr;
    warp_barrier();
    u32 r[4];
    for (int i = 0; i < 4; ++i) {
        const char* row = (const char*)g_smem + g_exchange[w][8 * i + l / 4][0];
        std::memcpy(&r[i], row + 4 * (l % 4), 4);
    }
    warp_barrier();
    r0 = r[0];
    r1 = r[1];
    r2 = r[2];
    r3 = r[3];
}

inline double bf16_half(u32 v, int hi) {
    const u32 bits = hi ? (v & 0xffff0000u) : (v << 16);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline void gs_mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const int w = g_fiber->tid / 32, l = g_fiber->tid % 32;
    unsigned* mine = g_exchange[w][l];
    const u32 ops[6] = {a0, a1, a2, a3, b0, b1};
    for (int i = 0; i < 6; ++i) {
        for (int h = 0; h < 2; ++h) {
            const u32 half = (ops[i] >> (16 * h)) & 0xffffu;
            if ((half & 0x7f80u) == 0x7f80u && (half & 0x7fu)) {
                std::fprintf(stderr, "mma operand %d of lane %d is NaN: a read of memory not yet written\n", i, l);
                std::abort();
            }
        }
        mine[i] = ops[i];
    }
    warp_barrier();
    double a[16][16], b[16][8];
    for (int x = 0; x < 32; ++x) {
        const int g = x / 4, t = x % 4;
        const unsigned* o = g_exchange[w][x];
        for (int h = 0; h < 2; ++h) {
            a[g][2 * t + h] = bf16_half(o[0], h);
            a[g + 8][2 * t + h] = bf16_half(o[1], h);
            a[g][2 * t + 8 + h] = bf16_half(o[2], h);
            a[g + 8][2 * t + 8 + h] = bf16_half(o[3], h);
            b[2 * t + h][g] = bf16_half(o[4], h);
            b[2 * t + 8 + h][g] = bf16_half(o[5], h);
        }
    }
    const int g = l / 4, t = l % 4;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    float out[4];
    for (int i = 0; i < 4; ++i) {
        double s = d[i];
        for (int k = 0; k < 16; ++k) s += a[rows[i]][k] * b[k][cols[i]];
        out[i] = (float)s;
    }
    warp_barrier();
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

#include "gemm_stream_kernels.inc"

static const size_t GUARD = 4096;  // bytes each side

// Bytes between guard zones of 0xff (bf16 and f32 NaN).
struct Buffer {
    std::vector<unsigned char> data;
    size_t n;
    unsigned char* p;
    explicit Buffer(size_t n_) : data(n_ + 2 * GUARD + 16, 0xff), n(n_) {
        p = data.data() + GUARD;
        p += (16 - (size_t)p % 16) % 16;
    }
    void check(const char* name) const {
        for (const unsigned char* q = data.data(); q < p; ++q)
            if (*q != 0xff) { std::fprintf(stderr, "%s: write before the buffer\n", name); std::abort(); }
        for (const unsigned char* q = p + n; q < data.data() + data.size(); ++q)
            if (*q != 0xff) { std::fprintf(stderr, "%s: write past the buffer\n", name); std::abort(); }
    }
};

static void load(const std::string& path, unsigned char* p, size_t n) {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f || std::fread(p, 1, n, f) != n) {
        std::fprintf(stderr, "cannot read %zu bytes from %s\n", n, path.c_str());
        std::abort();
    }
    std::fclose(f);
}

template <int WARPS, int NW, int MT, int KT, int STAGES>
int run(const std::string& dir, int m, int n, int k) {
    constexpr int NT = WARPS * NW;
    Buffer x((size_t)m * k * 2), w((size_t)n * k * 2), y((size_t)m * n * 4);
    load(dir + "/x.bin", x.p, x.n);
    load(dir + "/w.bin", w.p, w.n);
    const size_t shared = (size_t)STAGES * (MT * 16 + NT) * (KT + 8) * 2;
    for (int bx = 0; bx < (n + NT - 1) / NT; ++bx) {
        Buffer smem(shared);
        run_block(WARPS * 32, Dim3{bx, 0, 0}, (float*)smem.p, [&] {
            gemm_stream<WARPS, NW, MT, KT, STAGES>((const bf16_t*)x.p, (const bf16_t*)w.p, (float*)y.p, m, n, k);
        });
        smem.check("shared memory");
    }
    x.check("x");
    w.check("w");
    y.check("y");
    const float* out = (const float*)y.p;
    for (size_t i = 0; i < (size_t)m * n; ++i)
        if (std::isnan(out[i])) {
            std::fprintf(stderr, "y: element %zu unwritten\n", i);
            std::abort();
        }
    FILE* f = std::fopen((dir + "/y.bin").c_str(), "wb");
    std::fwrite(y.p, 1, y.n, f);
    std::fclose(f);
    return 0;
}

int main(int argc, char** argv) {
    if (argc != 10) {
        std::fprintf(stderr, "usage: %s DIR WARPS NW MT KT STAGES M N K\n", argv[0]);
        return 2;
    }
    const int warps = std::atoi(argv[2]), nw = std::atoi(argv[3]), mt = std::atoi(argv[4]), kt = std::atoi(argv[5]),
              stages = std::atoi(argv[6]), m = std::atoi(argv[7]), n = std::atoi(argv[8]), k = std::atoi(argv[9]);
    const char* eager = std::getenv("DELTA_HOST_EAGER");
    if (eager && std::strcmp(eager, "1") == 0) g_async = 0;
#define CASE(WARPS, NW, KT, STAGES)                                                                  \
    if (warps == WARPS && nw == NW && kt == KT && stages == STAGES) {                                \
        if (mt == 1) return run<WARPS, NW, 1, KT, STAGES>(argv[1], m, n, k);                         \
        if (mt == 2) return run<WARPS, NW, 2, KT, STAGES>(argv[1], m, n, k);                         \
        if (mt == 3) return run<WARPS, NW, 3, KT, STAGES>(argv[1], m, n, k);                         \
        if (mt == 4) return run<WARPS, NW, 4, KT, STAGES>(argv[1], m, n, k);                         \
    }
    CASE(4, 16, 32, 4)
    CASE(4, 16, 64, 4)
    CASE(4, 16, 128, 3)
    CASE(4, 8, 128, 4)
    CASE(2, 16, 128, 4)
    CASE(8, 16, 128, 3)
    CASE(8, 32, 64, 3)
#undef CASE
    std::fprintf(stderr, "no instantiation for WARPS %d NW %d MT %d KT %d STAGES %d\n", warps, nw, mt, kt, stages);
    return 2;
}
