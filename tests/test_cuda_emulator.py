"""The CUDA host emulator itself: a block's threads as fibers meeting at barriers and
shuffles, so kernels written for a GPU (shared memory, __syncthreads, warp shuffles)
are checked faithfully on a machine without one, and misuse is reported, not hidden."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytest.importorskip("cuda.bindings")
from flare.backends.cuda.args import KArgs  # noqa: E402
from flare.backends.cuda.compiler import KernelSource  # noqa: E402
from flare.backends.cuda_emu.emulator import EmulationError, build_library, host_compiler  # noqa: E402

PROBES = r'''
#include "common.cuh"

// each thread writes its id to shared memory; after the barrier it reads its mirror's
FLARE_KERNEL(probe_shared) {
    __shared__ float s[256];
    const unsigned t = threadIdx.x;
    s[t] = (float)(blockIdx.x * 1000 + t);
    __syncthreads();
    ((float*)A.t[0].ptr)[blockIdx.x * blockDim.x + t] = s[blockDim.x - 1 - t];
}

// xor and down shuffles, and a block sum through flare_block_sum
FLARE_KERNEL(probe_shuffle) {
    __shared__ float scratch[32];
    const unsigned t = threadIdx.x;
    float* out = (float*)A.t[0].ptr;
    out[3 * t] = __shfl_xor_sync(0xffffffffu, (float)t, 5);
    out[3 * t + 1] = __shfl_down_sync(0xffffffffu, (float)t, 3);
    out[3 * t + 2] = flare_block_sum((float)t, scratch);
}

// thread 0 waits at the block barrier while the rest of its warp waits in a shuffle
FLARE_KERNEL(probe_deadlock) {
    if (threadIdx.x == 0) __syncthreads();
    else ((float*)A.t[0].ptr)[0] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}
'''


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    if host_compiler() is None:
        pytest.skip("no C++ compiler")
    from flare.backends.cuda.compiler import kernel_sources

    headers = next(iter(kernel_sources().values())).headers
    return build_library(tmp_path_factory.mktemp("emu"), {"probes": KernelSource("probes", PROBES, headers)})


def _run(lib, kernel, out, grid, block):
    args = KArgs()
    args.t[0].ptr = out.ctypes.data
    lib.run(kernel, ctypes.addressof(args), grid, block)


def test_shared_memory_is_per_block_and_barriers_order_writes_before_reads(lib):
    out = np.zeros(3 * 64, np.float32)
    _run(lib, "probe_shared", out, (3, 1, 1), (64, 1, 1))
    want = np.concatenate([b * 1000 + np.arange(63, -1, -1) for b in range(3)]).astype(np.float32)
    np.testing.assert_array_equal(out, want)


def test_warp_shuffles_and_block_sum(lib):
    n = 96
    out = np.zeros(3 * n, np.float32).reshape(n, 3)
    _run(lib, "probe_shuffle", out, (1, 1, 1), (n, 1, 1))
    t = np.arange(n)
    np.testing.assert_array_equal(out[:, 0], (t & ~31) + ((t & 31) ^ 5))
    lane = t & 31
    np.testing.assert_array_equal(out[:, 1], np.where(lane + 3 < 32, t + 3, t))  # out of range: own value
    np.testing.assert_array_equal(out[:, 2], np.full(n, t.sum()))


def test_threads_stuck_at_different_barriers_are_an_error(lib):
    """Not a hang: the scheduler sees no group that can go on and reports it."""
    with pytest.raises(EmulationError, match="deadlock"):
        _run(lib, "probe_deadlock", np.zeros(1, np.float32), (1, 1, 1), (64, 1, 1))


def test_a_block_larger_than_a_gpu_allows_is_an_error(lib):
    with pytest.raises(EmulationError, match="1..1024"):
        _run(lib, "probe_shared", np.zeros(1, np.float32), (1, 1, 1), (2048, 1, 1))
