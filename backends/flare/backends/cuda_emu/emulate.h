// emulate.h: host definitions that let Flare's CUDA kernel sources compile as C++.
//
// Included by common.cuh when FLARE_EMULATE is defined (never by NVRTC). Each
// FLARE_KERNEL becomes an extern "C" function (returning nullptr or an error
// message) that runs the grid's blocks one
// after another, and the threads of a block as cooperative fibers (ucontext):
// a thread runs until it reaches __syncthreads(), a warp shuffle or __syncwarp(),
// or returns; when every live thread of the block (or of the warp) has arrived,
// they continue. So __shared__ memory (a static local: one copy, shared by the
// block's fibers, as blocks run one at a time), barriers and warp shuffles behave
// as on a GPU, and a kernel whose threads would deadlock (some wait at a block
// barrier, others of the same warp in a shuffle) is reported instead of hanging.
// Threads that have returned count as arrived, as on GPUs since Volta.
//
// Not emulated: memory ordering between threads without a barrier (fibers never
// run concurrently, so a missing barrier can go unnoticed here when the thread
// that writes happens to run first; the scheduler runs fibers in REVERSE thread
// order to make the usual bug, reading a neighbour's value before the barrier,
// read stale data), and the GPU's arithmetic (host float math, no FMA contraction
// guarantees).
#pragma once
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>
#include <csetjmp>
#include <ucontext.h>

using std::isnan;

#define FLARE_DEVICE static inline
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__ __restrict
#define __launch_bounds__(...)

struct flare_uint3 { unsigned x, y, z; };
static flare_uint3 blockIdx, threadIdx, blockDim, gridDim;
static const int warpSize = 32;

struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// single roundings (quant.cuh: bit-exact dequantization); the host build is ISO C++17
// (-std=c++17 implies -ffp-contract=off), so these are never contracted into an FMA either
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
// four signed 8-bit products summed into c (matmul_q.cu's integer dot products)
static inline int __dp4a(int a, int b, int c) {
    for (int k = 0; k < 32; k += 8) c += (int)(signed char)(a >> k) * (int)(signed char)(b >> k);
    return c;
}

static inline float flare_h2f(unsigned short h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}
static inline unsigned short flare_f2h(float f) {
    _Float16 v = (_Float16)f;  // round to nearest even, like cvt.rn.f16.f32
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}
#define FLARE_NEG_INF (-INFINITY)
#define FLARE_NAN NAN

// ---- the fiber scheduler --------------------------------------------------------

enum FlareWait { FW_RUNNING = 0, FW_BLOCK, FW_WARP, FW_DONE };

struct FlareFiber {
    ucontext_t ctx;     // only to enter the fiber the first time (makecontext gives it its stack)
    jmp_buf env;        // every later switch: _setjmp/_longjmp, which (unlike swapcontext) make
    bool started;       // no signal-mask system call

    std::vector<char> stack;
    flare_uint3 tid;
    int wait;
};

struct FlareEmu {
    ucontext_t sched;
    jmp_buf sched_env;
    std::vector<FlareFiber> fibers;
    int current = -1;
    unsigned nthreads = 0;
    // warp shuffles: each lane publishes a value, then reads its source lane's
    unsigned long long lanes[1024];
    char error[512] = {0};
    std::mutex lock;  // one launch at a time: blockIdx/threadIdx and __shared__ are process-wide
};
static FlareEmu flare_emu;
static const size_t FLARE_STACK = 128 * 1024;

static inline unsigned flare_linear_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

static inline void flare_yield(int why) {
    FlareFiber& f = flare_emu.fibers[flare_emu.current];
    f.wait = why;
    if (_setjmp(f.env) == 0) _longjmp(flare_emu.sched_env, 1);
    threadIdx = f.tid;  // resumed by the scheduler
}

static inline void __syncthreads() { flare_yield(FW_BLOCK); }
static inline void __syncwarp(unsigned = 0xffffffffu) { flare_yield(FW_WARP); }

template <typename T>
static inline T flare_shfl(T v, int src_lane) {
    static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
    const unsigned me = flare_linear_tid();
    const unsigned base = me & ~31u;
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    flare_emu.lanes[me] = bits;
    flare_yield(FW_WARP);  // every lane has published
    unsigned src = base + ((unsigned)src_lane & 31u);
    T out = v;
    if (src < flare_emu.nthreads) std::memcpy(&out, &flare_emu.lanes[src], sizeof(T));
    flare_yield(FW_WARP);  // every lane has read before the slots are reused
    return out;
}
template <typename T> static inline T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
    return flare_shfl(v, (int)((flare_linear_tid() & 31u) ^ (unsigned)mask));
}
template <typename T> static inline T __shfl_down_sync(unsigned, T v, int delta, int = 32) {
    const int lane = (int)(flare_linear_tid() & 31u);
    const T got = flare_shfl(v, lane + delta < 32 ? lane + delta : lane);
    return got;
}
template <typename T> static inline T __shfl_sync(unsigned, T v, int src, int = 32) { return flare_shfl(v, src); }

struct KArgs;
typedef void (*FlareBody)(const KArgs&);
static FlareBody flare_emu_body;
static const KArgs* flare_emu_args;

static void flare_fiber_main() {
    flare_emu_body(*flare_emu_args);
    flare_emu.fibers[flare_emu.current].wait = FW_DONE;
    _longjmp(flare_emu.sched_env, 1);  // never returns: its stack is reused by the next block
}

// true when every live fiber of [lo, hi) waits for `why` (the group may go on)
static bool flare_group_arrived(unsigned lo, unsigned hi, int why) {
    bool any = false;
    for (unsigned i = lo; i < hi; ++i) {
        const int w = flare_emu.fibers[i].wait;
        if (w == FW_DONE) continue;
        if (w != why) return false;
        any = true;
    }
    return any;
}

static bool flare_run_block(unsigned bx, unsigned by, unsigned bz) {
    const unsigned n = flare_emu.nthreads;
    auto& fibers = flare_emu.fibers;
    for (unsigned i = 0; i < n; ++i) {
        FlareFiber& f = fibers[i];
        f.tid = {i % bx, (i / bx) % by, i / (bx * by)};
        f.wait = FW_RUNNING;
        f.started = false;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = &flare_emu.sched;
        makecontext(&f.ctx, flare_fiber_main, 0);
    }
    unsigned done = 0;
    while (done < n) {
        // run every runnable fiber (reverse order: see the header) until it waits or ends
        for (unsigned k = n; k-- > 0;) {
            if (fibers[k].wait != FW_RUNNING) continue;
            flare_emu.current = (int)k;
            threadIdx = fibers[k].tid;
            if (_setjmp(flare_emu.sched_env) == 0) {
                if (!fibers[k].started) {
                    fibers[k].started = true;
                    setcontext(&fibers[k].ctx);
                }
                _longjmp(fibers[k].env, 1);
            }
        }
        done = 0;
        for (unsigned k = 0; k < n; ++k) done += fibers[k].wait == FW_DONE;
        if (done == n) break;
        bool released = false;
        if (flare_group_arrived(0, n, FW_BLOCK)) {
            for (unsigned k = 0; k < n; ++k)
                if (fibers[k].wait == FW_BLOCK) fibers[k].wait = FW_RUNNING;
            released = true;
        } else {
            for (unsigned lo = 0; lo < n; lo += 32) {
                const unsigned hi = lo + 32 < n ? lo + 32 : n;
                if (flare_group_arrived(lo, hi, FW_WARP)) {
                    for (unsigned k = lo; k < hi; ++k)
                        if (fibers[k].wait == FW_WARP) fibers[k].wait = FW_RUNNING;
                    released = true;
                }
            }
        }
        if (!released) {
            std::snprintf(flare_emu.error, sizeof flare_emu.error,
                          "deadlock in block (%u,%u,%u): threads wait at different barriers "
                          "(a __syncthreads or shuffle not reached by every thread)",
                          blockIdx.x, blockIdx.y, blockIdx.z);
            return false;
        }
    }
    return true;
}

// Runs one launch; returns nullptr, or what went wrong (a deadlock, a bad block size).
static const char* flare_emu_run(FlareBody body, const KArgs& args, unsigned gx, unsigned gy, unsigned gz,
                                 unsigned bx, unsigned by, unsigned bz) {
    std::lock_guard<std::mutex> hold(flare_emu.lock);
    flare_emu.error[0] = 0;
    const unsigned n = bx * by * bz;
    if (n == 0 || n > 1024) {
        std::snprintf(flare_emu.error, sizeof flare_emu.error, "block of %u threads (1..1024 allowed)", n);
        return flare_emu.error;
    }
    gridDim = {gx, gy, gz};
    blockDim = {bx, by, bz};
    flare_emu_body = body;
    flare_emu_args = &args;
    flare_emu.nthreads = n;
    if (flare_emu.fibers.size() < n) flare_emu.fibers.resize(n);
    for (unsigned i = 0; i < n; ++i)
        if (flare_emu.fibers[i].stack.size() < FLARE_STACK) flare_emu.fibers[i].stack.resize(FLARE_STACK);
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx = {x, y, z};
                if (!flare_run_block(bx, by, bz)) return flare_emu.error;
            }
    return nullptr;
}
