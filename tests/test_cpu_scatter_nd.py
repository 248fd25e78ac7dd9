"""The CPU scatter_nd kernel's fast path (distinct index tuples, plain replacement: one fancy-index
assignment) against the reference's in-order loop, which repeats and reductions still take.
Exact: both only copy values."""
from __future__ import annotations

import numpy as np
import pytest

from flare.backends.cpu import kernels_indexing  # noqa: F401  (registers scatter_nd)
from flare.backends.cpu.kernels import KERNELS
from flare.core.ops.indexing import scatter_nd_ref


def _both(data, idx, upd, mode="none"):
    p = {"mode": mode}
    out = np.full_like(data, np.nan)
    KERNELS["scatter_nd"](out, [data, idx, upd], p)
    return out, scatter_nd_ref([data, idx, upd], p)


@pytest.mark.parametrize("idx,mode", [
    ([[0], [3], [-1]], "none"),             # whole rows, a negative index wrapped
    ([[1, 2], [0, 0], [3, -2]], "none"),    # single elements by 2-tuples
    ([[2], [0], [2]], "none"),              # a repeated tuple: the last update wins (the reference's loop)
    ([[1], [1]], "add"),                    # a reduction: the loop
])
def test_scatter_nd_kernel_equals_reference(idx, mode):
    rng = np.random.default_rng(4)
    data = rng.standard_normal((5, 4)).astype(np.float32)
    idx = np.array(idx, np.int64)
    upd = rng.standard_normal((len(idx), *data.shape[idx.shape[-1]:])).astype(np.float32)
    got, want = _both(data, idx, upd, mode)
    np.testing.assert_array_equal(got, want)


def test_scatter_nd_kernel_refuses_an_index_outside_the_data():
    data = np.zeros((3, 2), np.float32)
    with pytest.raises(IndexError):
        _both(data, np.array([[3]], np.int64), np.ones((1, 2), np.float32))
