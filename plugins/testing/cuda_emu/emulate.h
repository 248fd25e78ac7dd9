// emulate.h: host definitions that let the kernel sources compile as C++.
//
// Included by common.cuh when FLARE_EMULATE is defined (never by NVRTC). Each
// FLARE_KERNEL becomes an extern "C" function that runs every thread of the
// grid one after another, so kernel logic can be checked against NumPy on a
// machine without a GPU (flare.backends.cuda.emulator). Faithful only because
// kernels use no shared memory, barriers or warp intrinsics.
#pragma once
#include <cmath>
#include <cstring>

using std::isnan;

#define FLARE_DEVICE static inline
#define __device__
#define __forceinline__ inline

struct flare_uint3 { unsigned x, y, z; };
static flare_uint3 blockIdx, threadIdx, blockDim, gridDim;

static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

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

struct KArgs;
template <typename Body>
static void flare_emu_run(Body body, const KArgs& args, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned by, unsigned bz) {
    gridDim = {gx, gy, gz};
    blockDim = {bx, by, bz};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx = {x, y, z};
                for (unsigned tz = 0; tz < bz; ++tz)
                    for (unsigned ty = 0; ty < by; ++ty)
                        for (unsigned tx = 0; tx < bx; ++tx) {
                            threadIdx = {tx, ty, tz};
                            body(args);
                        }
            }
}
