// delta_mma.py's launches of delta_mma.cu, chunk by chunk, on the host emulator (cuda_host.h).
// `delta_mma_kernels.inc` is delta_mma.cu's device code, made by test_delta_mma_emulated.py.
//
// usage: delta_mma_host DIR KD VD BV WARPS SPLIT PER_BLOCK START_ROW ANCHOR CUT1 CUT2 ...
//        delta_mma_host --sizes   (each build's KD VD BV WARPS and shared floats of both phases; then
//                                   "wgmma BV FLOATS" of delta_wgmma.cu's walk at BV 32 and 64)
//   DIR holds q, k, mixed, g, beta, state (.bin, f32, as delta_mma takes them; dims.bin: rows,
//   key_heads, value_heads, v0) and receives out.bin and state_out.bin. Cuts are relative rows,
//   the last one the row count. ANCHOR 1 anchors sub-chunks at absolute multiples of 64 (as the
//   kernels are launched), 0 at each chunk's start (the planted break). Every scratch buffer and
//   shared memory starts as NaN and sits between guard zones; the runner aborts on an overwritten
//   guard or a scratch element the first phase left unwritten. The state lives in slot 1 of 3.
//   DELTA_HOST_WGMMA=1 runs phase 2 on delta_wgmma.cu's walk (KD 128, BV 32 or 64, WARPS 8, SPLIT 3).
#include <string>

#include "delta_mma_kernels.inc"

static const unsigned GUARD_BITS = 0x7fc0dead;  // a NaN
static const size_t GUARD = 1024;

struct Buffer {
    std::vector<float> data;
    size_t n;
    float* p;
    Buffer(size_t n_, float fill) : data(n_ + 2 * GUARD), n(n_) {
        float guard;
        std::memcpy(&guard, &GUARD_BITS, 4);
        std::fill(data.begin(), data.end(), guard);
        p = data.data() + GUARD;
        std::fill(p, p + n, fill);
    }
    void check(const char* name) const {
        for (size_t i = 0; i < GUARD; ++i) {
            unsigned lo, hi;
            std::memcpy(&lo, &data[i], 4);
            std::memcpy(&hi, &data[GUARD + n + i], 4);
            if (lo != GUARD_BITS || hi != GUARD_BITS) {
                std::fprintf(stderr, "%s: write outside the buffer\n", name);
                std::abort();
            }
        }
    }
    void all_written(const char* name) const {
        for (size_t i = 0; i < n; ++i)
            if (std::isnan(p[i])) {
                std::fprintf(stderr, "%s: element %zu unwritten\n", name, i);
                std::abort();
            }
    }
};

static std::vector<float> load(const std::string& path, size_t n) {
    std::vector<float> v(n);
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f || std::fread(v.data(), 4, n, f) != n) {
        std::fprintf(stderr, "cannot read %zu floats from %s\n", n, path.c_str());
        std::abort();
    }
    std::fclose(f);
    return v;
}

static void save(const std::string& path, const float* p, size_t n) {
    FILE* f = std::fopen(path.c_str(), "wb");
    std::fwrite(p, 4, n, f);
    std::fclose(f);
}

template <int KD, int VD, int BV, int WARPS, int SPLIT>
int run(int argc, char** argv) {
    const std::string dir = argv[1];
    const int per_block = std::atoi(argv[7]), start_row = std::atoi(argv[8]), anchor = std::atoi(argv[9]);
    const char* wgmma_env = std::getenv("DELTA_HOST_WGMMA");  // 1: phase 2 on delta_wgmma.cu's walk
    const bool wgmma = wgmma_env && std::strcmp(wgmma_env, "1") == 0;
    std::vector<int> cuts{0};
    for (int i = 10; i < argc; ++i) cuts.push_back(std::atoi(argv[i]));
    const auto dims = load(dir + "/dims.bin", 4);
    const int rows_all = (int)dims[0], key_heads = (int)dims[1], value_heads = (int)dims[2], v0 = (int)dims[3];
    const int channels = v0 + value_heads * VD, group = value_heads / key_heads, c = delta::C;
    const auto q = load(dir + "/q.bin", (size_t)rows_all * key_heads * KD);
    const auto k = load(dir + "/k.bin", (size_t)rows_all * key_heads * KD);
    const auto mixed = load(dir + "/mixed.bin", (size_t)rows_all * channels);
    const auto g = load(dir + "/g.bin", (size_t)rows_all * value_heads);
    const auto beta = load(dir + "/beta.bin", (size_t)rows_all * value_heads);
    const size_t slot_floats = (size_t)value_heads * KD * VD;
    const auto state0 = load(dir + "/state.bin", 3 * slot_floats);
    Buffer states(state0.size(), 0.f);
    std::memcpy(states.p, state0.data(), state0.size() * 4);
    std::vector<float> out_all((size_t)rows_all * value_heads * VD, NAN);
    for (size_t ci = 0; ci + 1 < cuts.size(); ++ci) {
        const int a = cuts[ci], rows = cuts[ci + 1] - a, off = anchor ? (start_row + a) % c : 0;
        const int subchunks = (off + rows + c - 1) / c;
        Buffer bq((size_t)rows * key_heads * KD, 0), bk((size_t)rows * key_heads * KD, 0);
        Buffer bm((size_t)rows * channels, 0), bg((size_t)rows * value_heads, 0), bb((size_t)rows * value_heads, 0);
        Buffer out((size_t)rows * value_heads * VD, NAN);
        std::memcpy(bq.p, &q[(size_t)a * key_heads * KD], bq.n * 4);
        std::memcpy(bk.p, &k[(size_t)a * key_heads * KD], bk.n * 4);
        std::memcpy(bm.p, &mixed[(size_t)a * channels], bm.n * 4);
        std::memcpy(bg.p, &g[(size_t)a * value_heads], bg.n * 4);
        std::memcpy(bb.p, &beta[(size_t)a * value_heads], bb.n * 4);
        Buffer w((size_t)subchunks * value_heads * c * KD, NAN), u((size_t)subchunks * value_heads * c * VD, NAN);
        Buffer m((size_t)subchunks * value_heads * c * c, NAN), dv((size_t)subchunks * value_heads * 2 * c, NAN);
        for (int by = 0; by < key_heads * (group / per_block); ++by)
            for (int bx = 0; bx < subchunks; ++bx) {
                Buffer smem(delta::PrepareSmem<KD, VD>::FLOATS, NAN);
                run_block(256, Dim3{bx, by, 0}, smem.p, [&] {
                    delta::prepare<KD, VD, SPLIT>(bq.p, bk.p, bm.p, bg.p, bb.p, w.p, u.p, m.p, dv.p, rows, off,
                                                  key_heads, value_heads, channels, v0, per_block);
                });
                smem.check("prepare shared memory");
            }
        w.all_written("w");
        u.all_written("u");
        m.all_written("m");
        dv.all_written("dv");
        float* state = states.p + slot_floats;  // slot 1
        for (int by = 0; by < value_heads; ++by)
            for (int bx = 0; bx < VD / BV; ++bx) {
                if constexpr (KD == 128 && (BV == 32 || BV == 64) && WARPS == 8 && SPLIT == 3) {
                    if (wgmma) {  // delta_wgmma.cu's walk
                        Buffer smem(delta::WgWalkSmem<KD, BV>::FLOATS, NAN);
                        delta::g_smem_bytes = smem.n * 4;
                        run_block(256, Dim3{bx, by, 0}, smem.p, [&] {
                            delta::walk_wgmma<KD, BV>(bq.p, bk.p, w.p, u.p, m.p, dv.p, state, out.p, rows, off,
                                                      key_heads, value_heads, VD);
                        });
                        smem.check("wgmma walk shared memory");
                        continue;
                    }
                }
                if (wgmma) {
                    std::fprintf(stderr, "no wgmma walk for KD %d BV %d WARPS %d SPLIT %d\n", KD, BV, WARPS, SPLIT);
                    std::abort();
                }
                Buffer smem(delta::WalkSmem<KD, BV>::FLOATS, NAN);
                run_block(WARPS * 32, Dim3{bx, by, 0}, smem.p, [&] {
                    delta::walk<KD, BV, WARPS, SPLIT>(bq.p, bk.p, w.p, u.p, m.p, dv.p, state, out.p, rows, off,
                                                      key_heads, value_heads, VD);
                });
                smem.check("walk shared memory");
            }
        for (const Buffer* b : {&bq, &bk, &bm, &bg, &bb, &out, &w, &u, &m, &dv}) b->check("global buffer");
        out.all_written("out");
        std::memcpy(&out_all[(size_t)a * value_heads * VD], out.p, out.n * 4);
    }
    states.check("states");
    save(dir + "/out.bin", out_all.data(), out_all.size());
    save(dir + "/state_out.bin", states.p, states.n);
    return 0;
}

template <int KD, int VD, int BV, int WARPS, int SPLIT>
int sizes() {
    std::printf("%d %d %d %d %d %d\n", KD, VD, BV, WARPS, delta::PrepareSmem<KD, VD>::FLOATS,
                delta::WalkSmem<KD, BV>::FLOATS);
    return 0;
}

int main(int argc, char** argv) {
    const bool list = argc == 2 && std::strcmp(argv[1], "--sizes") == 0;
    if (!list && argc < 11) {
        std::fprintf(stderr, "usage: %s DIR KD VD BV WARPS SPLIT PER_BLOCK START_ROW ANCHOR CUTS...\n", argv[0]);
        return 2;
    }
    const int kd = list ? 0 : std::atoi(argv[2]), vd = list ? 0 : std::atoi(argv[3]), bv = list ? 0 : std::atoi(argv[4]),
              warps = list ? 0 : std::atoi(argv[5]), split = list ? 0 : std::atoi(argv[6]);
    const char* eager = std::getenv("DELTA_HOST_EAGER");
    if (eager && std::strcmp(eager, "1") == 0) g_async = 0;
#define CASE(KD, VD, BV, WARPS, SPLIT)                                                             \
    if (list) sizes<KD, VD, BV, WARPS, SPLIT>();                                                   \
    else if (kd == KD && vd == VD && bv == BV && warps == WARPS && split == SPLIT) return run<KD, VD, BV, WARPS, SPLIT>(argc, argv);
    CASE(16, 8, 8, 4, 1)
    CASE(16, 8, 8, 4, 3)
    CASE(32, 32, 32, 8, 1)
    CASE(32, 32, 32, 8, 3)
    CASE(128, 128, 32, 8, 1)
    CASE(128, 128, 32, 8, 3)
    CASE(128, 128, 32, 4, 3)
    CASE(128, 128, 64, 8, 3)
#undef CASE
    if (list) {  // delta_wgmma.cu's walk: "wgmma BV FLOATS"
        std::printf("wgmma 32 %d\nwgmma 64 %d\n", delta::WgWalkSmem<128, 32>::FLOATS, delta::WgWalkSmem<128, 64>::FLOATS);
        return 0;
    }
    std::fprintf(stderr, "no instantiation for KD %d VD %d BV %d WARPS %d SPLIT %d\n", kd, vd, bv, warps, split);
    return 2;
}
