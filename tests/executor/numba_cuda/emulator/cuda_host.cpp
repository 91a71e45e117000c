// The fiber scheduler of cuda_host.h: runs every runnable thread of a block until it blocks at
// a barrier, then releases a barrier once every thread (block) or lane (warp) waits at it.
#include "cuda_host.h"

Fiber* g_fiber;
ucontext_t g_scheduler;
Dim3 blockIdx;
float* g_smem;
int g_async = 1;
unsigned g_exchange[64][32][8];
unsigned delta::g_wg_a[2][delta::WGMMA_MAX][128][4];
unsigned long long delta::g_wg_op[2][delta::WGMMA_MAX][128];
int delta::g_wg_count[2][128];
size_t delta::g_smem_bytes = (size_t)-1;

static const std::function<void()>* g_body;

static void fiber_entry() {
    (*g_body)();
    g_fiber->state = DONE;
    swapcontext(&g_fiber->ctx, &g_scheduler);
}

static std::vector<int> run_order(int threads, int mode) {
    static unsigned seed = 12345;
    std::vector<int> order(threads);
    for (int i = 0; i < threads; ++i) order[i] = mode == 1 ? threads - 1 - i : i;
    if (mode == 2)
        for (int i = threads - 1; i > 0; --i) {
            seed = seed * 1103515245u + 12345u;
            std::swap(order[i], order[(seed >> 8) % (i + 1)]);
        }
    return order;
}

void run_block(int threads, Dim3 bid, float* smem, const std::function<void()>& fn) {
    static const int mode = std::getenv("DELTA_HOST_ORDER") ? std::atoi(std::getenv("DELTA_HOST_ORDER")) : 0;
    blockIdx = bid;
    g_smem = smem;
    g_body = &fn;
    std::vector<Fiber> fibers(threads);
    for (int i = 0; i < threads; ++i) {
        Fiber& f = fibers[i];
        f.tid = i;
        f.state = RUN;
        f.stack.resize(256 * 1024);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_entry, 0);
    }
    const int warps = threads / 32;
    for (;;) {
        bool ran = false;
        if (mode >= 3) {  // one warp at a time (first or last with a runnable lane) runs ahead
            for (int w = 0; w < warps; ++w) {  // to its next __syncthreads: collectives released at once
                int waiting = 0;
                for (int l = 0; l < 32; ++l) waiting += fibers[32 * w + l].state == WAIT_WARP;
                if (waiting == 32)
                    for (int l = 0; l < 32; ++l) fibers[32 * w + l].state = RUN;
            }
            for (int k = 0; k < warps && !ran; ++k) {
                const int w = mode == 3 ? k : warps - 1 - k;
                for (int l = 0; l < 32; ++l) {
                    Fiber& f = fibers[32 * w + l];
                    if (f.state == RUN) {
                        g_fiber = &f;
                        swapcontext(&g_scheduler, &f.ctx);
                        ran = true;
                    }
                }
            }
        } else {
            for (int i : run_order(threads, mode)) {
                Fiber& f = fibers[i];
                if (f.state == RUN) {
                    g_fiber = &f;
                    swapcontext(&g_scheduler, &f.ctx);
                    ran = true;
                }
            }
        }
        if (ran) continue;
        int done = 0, at_block = 0;
        for (const Fiber& f : fibers) {
            done += f.state == DONE;
            at_block += f.state == WAIT_BLOCK;
        }
        if (done == threads) break;
        bool released = false;
        for (int w = 0; w < warps; ++w) {  // warp collectives first: a warp whose lanes all wait
            int waiting = 0;
            for (int l = 0; l < 32; ++l) waiting += fibers[32 * w + l].state == WAIT_WARP;
            if (waiting == 32) {
                for (int l = 0; l < 32; ++l) fibers[32 * w + l].state = RUN;
                released = true;
            }
        }
        for (int wg = 0; wg < threads / 128; ++wg) {  // warpgroup collectives: all 128 threads wait
            int waiting = 0;
            for (int i = 0; i < 128; ++i) waiting += fibers[128 * wg + i].state == WAIT_GROUP;
            if (waiting == 128) {
                for (int i = 0; i < 128; ++i) fibers[128 * wg + i].state = RUN;
                released = true;
            }
        }
        if (!released && at_block + done == threads) {
            if (done) {
                std::fprintf(stderr, "__syncthreads reached after %d threads exited\n", done);
                std::abort();
            }
            for (Fiber& f : fibers) f.state = RUN;
            released = true;
        }
        if (!released) {
            std::fprintf(stderr, "deadlock: a barrier not every thread reaches\n");
            std::abort();
        }
    }
    for (const Fiber& f : fibers) {
        if (!f.groups.empty() || !f.open.empty()) {
            std::fprintf(stderr, "thread %d ended with cp.async copies in flight\n", f.tid);
            std::abort();
        }
        if (!f.wgmma.empty()) {
            std::fprintf(stderr, "thread %d ended with wgmma in flight\n", f.tid);
            std::abort();
        }
    }
}
