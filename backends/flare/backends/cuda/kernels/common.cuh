// common.cuh: what every Flare CUDA kernel shares.
//
// One argument block (KArgs) for every kernel, passed by value: Python fills a
// ctypes mirror of it (flare.backends.cuda.args), so there is exactly one layout
// to keep in step, and a CUDA-graph rebind only has to rewrite addresses in it.
//
// Tensors are described as (base address, element offset, shape[4], strides[4],
// dtype): rank < 4 is padded on the left with size-1 axes; inputs may be strided
// or broadcast views (stride 0); outputs are written contiguously.
//
// f16 is a storage dtype: the NVRTC shipped on PyPI has no cuda_fp16.h, so a
// half is handled as its 16 bits and converted with the PTX `cvt` instructions
// that __half2float/__float2half_rn compile to.
//
// The same sources compile on the host with FLARE_EMULATE defined (emulate.h in
// the testing plugin flare.backends.cuda_emu): a block's threads run there
// as cooperative fibers, so __shared__ memory, __syncthreads and warp shuffles
// (__shfl_xor_sync/__shfl_down_sync/__shfl_sync) are checked on any machine.
// Kernels use only those intrinsics (anything else needs an emulation first).
#pragma once

typedef long long i64;

#ifdef FLARE_EMULATE
#include "emulate.h"
#else
#define FLARE_DEVICE __device__ __forceinline__
__device__ __forceinline__ float flare_h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short flare_f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#define FLARE_NEG_INF __int_as_float(0xff800000)
#define FLARE_NAN __int_as_float(0x7fffffff)
#endif

enum { DT_F32 = 0, DT_F16 = 1, DT_I32 = 2, DT_I64 = 3 };

struct TensorDesc {
    unsigned long long ptr;  // base address of the buffer
    i64 offset;              // element offset of element [0,0,0,0]
    i64 shape[4];
    i64 stride[4];           // in elements; 0 on broadcast axes
    int dtype;               // DT_*
    int ndim;                // rank before padding (informational)
};

#define FLARE_MAX_TENSORS 6
#define FLARE_MAX_INTS 8
#define FLARE_MAX_FLOATS 4

struct KArgs {
    TensorDesc t[FLARE_MAX_TENSORS];
    i64 n;                    // work items (threads that do something)
    i64 i[FLARE_MAX_INTS];    // integer parameters (meaning per kernel)
    float f[FLARE_MAX_FLOATS];// float parameters (meaning per kernel)
};

static_assert(sizeof(TensorDesc) == 88, "TensorDesc layout changed: update flare/backends/cuda/args.py");
static_assert(sizeof(KArgs) == 616, "KArgs layout changed: update flare/backends/cuda/args.py");

#ifdef FLARE_EMULATE
#define FLARE_KERNEL(name)                                                             \
    static void name##_body(const KArgs& A);                                           \
    extern "C" const char* name(const KArgs* args, unsigned gx, unsigned gy, unsigned gz, \
                                unsigned bx, unsigned by, unsigned bz) {               \
        return flare_emu_run(name##_body, *args, gx, gy, gz, bx, by, bz);              \
    }                                                                                  \
    static void name##_body(const KArgs& A)
#else
#define FLARE_KERNEL(name) extern "C" __global__ void name(const KArgs A)
#endif

// ---- indexing ---------------------------------------------------------------

FLARE_DEVICE i64 flare_thread_index() {
    return (i64)blockIdx.x * (i64)blockDim.x + (i64)threadIdx.x;
}

// coordinates of linear (row-major) index e in `shape`
FLARE_DEVICE void flare_unravel(const i64* shape, i64 e, i64* c) {
    for (int k = 3; k >= 0; --k) {
        i64 s = shape[k];
        c[k] = e % s;
        e /= s;
    }
}

// element offset (from the buffer base) of coordinates c
FLARE_DEVICE i64 flare_at(const TensorDesc& d, const i64* c) {
    return d.offset + c[0] * d.stride[0] + c[1] * d.stride[1] + c[2] * d.stride[2] + c[3] * d.stride[3];
}

// element offset of the e-th element (row-major over d.shape) of a strided tensor
FLARE_DEVICE i64 flare_linear(const TensorDesc& d, i64 e) {
    i64 c[4];
    flare_unravel(d.shape, e, c);
    return flare_at(d, c);
}

// ---- typed loads and stores ---------------------------------------------------

FLARE_DEVICE bool flare_is_int(const TensorDesc& d) { return d.dtype == DT_I32 || d.dtype == DT_I64; }

FLARE_DEVICE float flare_load(const TensorDesc& d, i64 off) {
    switch (d.dtype) {
        case DT_F32: return ((const float*)d.ptr)[off];
        case DT_F16: return flare_h2f(((const unsigned short*)d.ptr)[off]);
        case DT_I32: return (float)((const int*)d.ptr)[off];
        default: return (float)((const i64*)d.ptr)[off];
    }
}

FLARE_DEVICE i64 flare_load_int(const TensorDesc& d, i64 off) {
    switch (d.dtype) {
        case DT_I32: return (i64)((const int*)d.ptr)[off];
        case DT_I64: return ((const i64*)d.ptr)[off];
        case DT_F16: return (i64)flare_h2f(((const unsigned short*)d.ptr)[off]);
        default: return (i64)((const float*)d.ptr)[off];
    }
}

FLARE_DEVICE void flare_store(const TensorDesc& d, i64 off, float v) {
    switch (d.dtype) {
        case DT_F32: ((float*)d.ptr)[off] = v; break;
        case DT_F16: ((unsigned short*)d.ptr)[off] = flare_f2h(v); break;
        case DT_I32: ((int*)d.ptr)[off] = (int)v; break;
        default: ((i64*)d.ptr)[off] = (i64)v; break;
    }
}

FLARE_DEVICE void flare_store_int(const TensorDesc& d, i64 off, i64 v) {
    switch (d.dtype) {
        case DT_I32: ((int*)d.ptr)[off] = (int)v; break;
        case DT_I64: ((i64*)d.ptr)[off] = v; break;
        case DT_F16: ((unsigned short*)d.ptr)[off] = flare_f2h((float)v); break;
        default: ((float*)d.ptr)[off] = (float)v; break;
    }
}

// copy one element between any two dtypes: int->int exact, float->int truncates
// toward zero, anything->float rounds to nearest
FLARE_DEVICE void flare_copy_elem(const TensorDesc& src, i64 soff, const TensorDesc& dst, i64 doff) {
    if (flare_is_int(src)) {
        flare_store_int(dst, doff, flare_load_int(src, soff));
    } else if (flare_is_int(dst)) {
        flare_store_int(dst, doff, (i64)flare_load(src, soff));
    } else {
        flare_store(dst, doff, flare_load(src, soff));
    }
}

// ---- activations (shared by the unary kernel and the fused matmul epilogue) ---------------

FLARE_DEVICE float flare_gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
FLARE_DEVICE float flare_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// fused epilogue activation codes: keep in step with lowering.py (EPILOGUE_ACTS)
enum { ACT_NONE = 0, ACT_GELU, ACT_RELU, ACT_SIGMOID };
FLARE_DEVICE float flare_activation(int act, float x) {
    switch (act) {
        case ACT_GELU: return flare_gelu(x);
        case ACT_RELU: return x > 0.0f ? x : 0.0f;
        case ACT_SIGMOID: return flare_sigmoid(x);
        default: return x;
    }
}

// The fused matmul epilogue (op `linear`): act(v + bias[n]) + residual[b0, b1, m, n].
// i[4] = ACT_*, i[5] bit 0: bias in t4 (a row of N), bit 1: residual in t5 (the output's
// [B0,B1,M,N] layout, any strides). A plain matmul has i[4] = i[5] = 0.
FLARE_DEVICE float flare_epilogue(const KArgs& A, float v, i64 b0, i64 b1, i64 m, i64 n) {
    const int flags = (int)A.i[5];
    if (flags & 1) v += flare_load(A.t[4], A.t[4].offset + n * A.t[4].stride[3]);
    v = flare_activation((int)A.i[4], v);
    if (flags & 2) {
        const TensorDesc& r = A.t[5];
        v += flare_load(r, r.offset + b0 * r.stride[0] + b1 * r.stride[1] + m * r.stride[2] + n * r.stride[3]);
    }
    return v;
}

// ---- block-wide helpers (one block per row) ------------------------------------------
// Block sizes are multiples of 32 (lowering.row_block), so every warp is full.

FLARE_DEVICE float flare_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Order of (value, index) pairs for argmax and top_k: the larger value first, ties by the
// lower index; NaN before every number when `nan_first` (NumPy's argmax: the first NaN
// wins) or after them (top_k = a stable argsort of -x); index < 0 is an empty slot, last.
FLARE_DEVICE bool flare_ranks_before(float av, i64 ai, float bv, i64 bi, bool nan_first) {
    if (ai < 0) return false;
    if (bi < 0) return true;
    const bool an = isnan(av), bn = isnan(bv);
    if (an && bn) return ai < bi;
    if (an || bn) return nan_first ? an : bn;
    return av > bv || (av == bv && ai < bi);
}

// max that propagates NaN (as NumPy's max does)
FLARE_DEVICE float flare_nanmax(float a, float b) { return (isnan(a) || a > b) ? a : b; }

FLARE_DEVICE float flare_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = flare_nanmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum (op 0) or NaN-propagating max (op 1) of one value per thread, returned to every
// thread. `scratch` is 32 floats of __shared__ memory; it may be reused after return.
FLARE_DEVICE float flare_block_reduce(float v, int op, float* scratch) {
    const unsigned tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    const unsigned nwarps = (blockDim.x + 31u) >> 5;
    v = op == 0 ? flare_warp_sum(v) : flare_warp_max(v);
    if (nwarps == 1) return v;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float w = lane < nwarps ? scratch[lane] : (op == 0 ? 0.0f : FLARE_NEG_INF);
    return op == 0 ? flare_warp_sum(w) : flare_warp_max(w);
}

FLARE_DEVICE float flare_block_sum(float v, float* scratch) { return flare_block_reduce(v, 0, scratch); }
FLARE_DEVICE float flare_block_max(float v, float* scratch) { return flare_block_reduce(v, 1, scratch); }
