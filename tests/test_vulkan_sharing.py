"""A split's small lane matmuls share one variant (`flare.backends.vulkan.sharing`): fewer
pipelines to compile at a cold start, the same numbers (bit for bit) and still correct."""
from __future__ import annotations

import numpy as np
import pytest

from flare.core.fusion import fuse
from flare.core.graph import GraphBuilder

from flare.backends.vulkan import VulkanBackend
from flare.backends.vulkan import sharing
from flare.backends.vulkan.lowering import Dispatch, TensorArg
from flare.backends.vulkan.testing import HandBound

PROBE = VulkanBackend.probe()
needs_vulkan = pytest.mark.skipif(not PROBE.usable, reason=f"Vulkan unusable here: {PROBE.reason}")
RNG = np.random.default_rng(2424)
# an STFT-like conv (taps, stride, padding multiples of 4: CONV_VEC) and an odd one (K = 9)
XV, WV = RNG.uniform(-1, 1, (2, 1, 64)).astype(np.float32), RNG.uniform(-1, 1, (6, 1, 16)).astype(np.float32)
XO, WO = RNG.uniform(-1, 1, (2, 3, 9)).astype(np.float32), RNG.uniform(-1, 1, (5, 3, 3)).astype(np.float32)
ACC = 1e-5  # f32 sums of at most 16 products of values in [-1, 1] against a float64 reference


def conv1d_ref(x, w, stride=1, padding=0):
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (padding, padding)))
    ks = w.shape[2]
    cols = np.stack([x[:, :, t:t + ks] for t in range(0, x.shape[2] - ks + 1, stride)], axis=2)  # [B, C, L, ks]
    return np.einsum("bclk,ock->bol", cols, w.astype(np.float64))


def _graph(both: bool):
    b = GraphBuilder()
    b.output("v", b.conv1d(b.input("xv", XV.shape), b.weight("wv", WV), stride=8, padding=4))
    if both:
        b.output("o", b.conv1d(b.input("xo", XO.shape), b.weight("wo", WO), padding=1))
    return b.build()


@pytest.fixture
def cpu_profile_device(tmp_path, monkeypatch):
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    (dev,) = VulkanBackend.open_devices({"kernel_profile": "cpu", "prime": "0", "pipeline_cache": "0"})
    yield dev
    dev.close()


@needs_vulkan
def test_small_convs_share_one_lane_variant_with_the_same_results(cpu_profile_device):
    dev = cpu_profile_device
    with HandBound(dev, _graph(False)) as alone:
        split = alone.compile()
        (d,) = [d for d in split.dispatches if d.shader == "matmul_lanes"]
        assert d.spec[0] & 8  # alone, the conv reads its taps four at a time
        lone = alone.run({"xv": XV})["v"]
    with HandBound(dev, _graph(True)) as hb:
        split = hb.compile()
        lanes = [d for d in split.dispatches if d.shader == "matmul_lanes"]
        assert len(lanes) == 2 and len({d.spec for d in lanes}) == 1 and not lanes[0].spec[0] & 8
        assert split.describe()["pipelines"] == len({(d.shader, d.spec) for d in split.dispatches})
        out = hb.run({"xv": XV, "xo": XO})
    np.testing.assert_array_equal(out["v"], lone)  # same sums in the same order, slower loads only
    np.testing.assert_allclose(out["v"], conv1d_ref(XV, WV, 8, 4), rtol=0, atol=ACC)
    np.testing.assert_allclose(out["o"], conv1d_ref(XO, WO, 1, 1), rtol=0, atol=ACC)


def _fake(mode: int, shape=(1, 1, 4, 4), k: int = 8, epi: int = 0) -> Dispatch:
    """A matmul_lanes dispatch as sharing.py sees it: spec and operand shapes only."""
    a = TensorArg(None, (1, 1, shape[2], k), (0, 0, k, 1), 0)  # no buffer: sharing reads shapes only
    o = TensorArg(None, shape, (0, 0, shape[3], 1), 0)
    return Dispatch("n", "matmul_lanes", (mode, 0, 0, 0, 0, 8, 16, 16, epi), [a, a, o], [], (1, 1, 1))


def test_sharing_rules():
    big = _fake(45, (1, 1, 64, 64), k=64)
    out = sharing.share_lane_variants([_fake(37), _fake(45), _fake(4), _fake(35), big, _fake(47, epi=1)],
                                      max_fmas=64 * 64 * 63)
    modes = [d.spec[0] for d in out]
    # 37 and 45 carry CONV (4): both move onto 4, the fewest bits; 35 (no CONV) has nothing below
    # it; the big dispatch keeps its fast layout; another epilogue is another kernel
    assert modes == [4, 4, 4, 35, 45, 47]
    assert [d.spec[1:] for d in out] == [d.spec[1:] for d in
                                         [_fake(0), _fake(0), _fake(0), _fake(0), big, _fake(0, epi=1)]]
    assert sharing.share_lane_variants([]) == []


# outputs of at most 32 x 32: the small lane block (l8), quick to compile where CI has no Mesa cache
W1 = RNG.uniform(-1, 1, (24, 16)).astype(np.float32)
W2 = RNG.uniform(-1, 1, (24, 24)).astype(np.float32)
B1, B2 = RNG.uniform(-1, 1, 24).astype(np.float32), RNG.uniform(-1, 1, 24).astype(np.float32)
XL = RNG.uniform(-1, 1, (30, 16)).astype(np.float32)


def _linears(which: str):
    """Fused `linear` layers, MiniLM-like: bias + gelu, then bias + residual ("both"), or one."""
    b = GraphBuilder()
    x = b.input("x", XL.shape)
    h = b.gelu(b.add(b.matmul(x, b.weight("w1", W1), transpose_b=True), b.weight("b1", B1)))
    if which == "both":
        h = b.add(b.add(b.matmul(h, b.weight("w2", W2), transpose_b=True), b.weight("b2", B2)), h)
    b.output("y", h)
    graph = b.build()
    fuse(graph, lambda node, chain: True)  # matmul + add (+ gelu, + add) -> linear, as a session does
    return graph


def _gelu(v):
    from math import erf
    return v * 0.5 * (1 + np.vectorize(erf)(v / np.sqrt(2)))


@needs_vulkan
def test_epilogues_of_a_split_share_one_runtime_variant(cpu_profile_device):
    dev = cpu_profile_device
    with HandBound(dev, _linears("one")) as one:
        (d,) = [d for d in one.compile().dispatches if d.shader == "matmul_lanes"]
        assert d.spec[-1] not in (0, sharing.EPI_RUNTIME)  # one code: it stays a constant
        first = one.run({"x": XL})["y"]
    with HandBound(dev, _linears("both")) as hb:
        split = hb.compile()
        lanes = [d for d in split.dispatches if d.shader == "matmul_lanes"]
        assert len(lanes) == 2 and {d.spec[-1] for d in lanes} == {sharing.EPI_RUNTIME}
        assert len({d.spec for d in lanes}) == 1 and len({d.params[-1] for d in lanes}) == 2
        y = hb.run({"x": XL})["y"]
    h = _gelu(XL.astype(np.float64) @ W1.T.astype(np.float64) + B1)
    np.testing.assert_allclose(first, h, rtol=0, atol=1e-5)
    # second layer: f32 sums of 24 products of |h| < 3 and |w| < 1, plus bias and residual
    np.testing.assert_allclose(y, h @ W2.T.astype(np.float64) + B2 + h, rtol=0, atol=1e-4)
