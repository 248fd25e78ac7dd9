"""The fused ops of flare.core.ops.fused on Vulkan: chains built unfused and merged by the fusion
pass (flare.core.fusion), shaped so every kernel path of the fused lowering runs: the tiled matmul (batch stacked into rows, or
batched on the z grid when the residual's batches are not stacked rows), the matvec kernel
(few rows; few columns, operands swapped), the row kernel for norm_affine, and attention.comp
(one workgroup per query row, the scores in shared memory). Odd sizes
(not multiples of any tile), strided operands; mapped memory and forced staging.

References are written here in float64 from docs/ops.md (gelu with math.erf), so they check
flare.core.ops' own. Tolerance ACC (rtol 1e-4, atol 1e-5), as for matmul and norms in
test_vulkan_ops.py: f32 sums of <= 45 terms in another order than NumPy's; the epilogue adds
one rounding per step and gelu's erfc has 1.2e-7 relative error.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from flare.core.fusion import fuse
from flare.core.graph import GraphBuilder
from flare.core.ledger import LEDGER

from flare.backends.vulkan import VulkanBackend
from flare.backends.vulkan.testing import MEMORY_KINDS, HandBound, memory_kind_device

PROBE = VulkanBackend.probe()
pytestmark = pytest.mark.skipif(not PROBE.usable, reason=f"Vulkan unusable here: {PROBE.reason}")

ACC = (1e-4, 1e-5)
RNG = np.random.default_rng(4321)
_erf = np.vectorize(math.erf)
ACT_REF = {"none": lambda x: x, "relu": lambda x: np.maximum(x, 0.0), "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
           "gelu": lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2)))}


dev = pytest.fixture(scope="module", params=MEMORY_KINDS)(memory_kind_device)  # mapped and staged memory


def f32(*shape):
    return RNG.uniform(-2.0, 2.0, shape).astype(np.float32)


def run(dev, build, inputs, op):
    """Build, fuse where the device supports it (it must), run twice; (output, dispatch count)."""
    b = GraphBuilder()
    b.output("out", build(b))
    graph = b.build()
    done = fuse(graph, lambda node, chain: dev.supports(node))
    assert [f.op for f in done] == [op], f"Vulkan must implement {op}"
    before = LEDGER.snapshot().count(dev.name)
    with HandBound(dev, graph, gap=1) as hb:
        got = hb.run(inputs)["out"]
        hb.split.run()
        np.testing.assert_array_equal(hb.outputs()["out"], got)
        dispatches = hb.split.stats["dispatches"]
    assert LEDGER.snapshot().count(dev.name) == before
    return got, dispatches


def linear_ref(a, w, bias, res, act, transpose_b):
    a64, w64 = a.astype(np.float64), w.astype(np.float64)
    y = a64 @ (np.swapaxes(w64, -1, -2) if transpose_b else w64)
    if bias is not None:
        y = y + bias
    y = ACT_REF[act](y)
    return y if res is None else y + res


# (a shape, w shape, transpose_b, act, bias, residual) — which kernel each reaches:
LINEAR_CASES = {
    "tiled_stacked_gelu": ((2, 37, 29), (45, 29), True, "gelu", True, True),
    "tiled_batched_relu": ((3, 19, 21), (3, 21, 23), False, "relu", True, True),
    "tiled_residual_only": ((7, 40), (40, 33), False, "none", False, True),
    "matvec_rows_sigmoid": ((3, 40), (33, 40), True, "sigmoid", True, False),
    "matvec_swapped_cols": ((2, 37, 24), (24, 3), False, "none", True, True),
}


@pytest.mark.parametrize("case", sorted(LINEAR_CASES))
def test_linear(dev, case):
    sa, sw, tb, act, has_bias, has_res = LINEAR_CASES[case]
    a, w = f32(*sa), f32(*sw)
    n = sw[-2] if tb else sw[-1]
    out_shape = sa[:-1] + (n,)
    bias = f32(n) if has_bias else None
    res = f32(*out_shape) if has_res else None
    inputs = {"a": a, "w": w, **({"bias": bias} if has_bias else {}), **({"res": res} if has_res else {})}

    def build(b):
        y = b.matmul(b.input("a", a.shape), b.input("w", w.shape), transpose_b=tb)
        y = b.add(y, b.input("bias", bias.shape)) if has_bias else y
        y = b.op(act, y) if act != "none" else y
        return b.add(b.input("res", res.shape), y) if has_res else y

    got, dispatches = run(dev, build, inputs, "linear")
    assert got.shape == out_shape
    np.testing.assert_allclose(got, linear_ref(a, w, bias, res, act, tb), rtol=ACC[0], atol=ACC[1])
    assert dispatches == 1  # the epilogue runs in the matmul's store


def test_linear_strided_residual_is_not_stacked(dev):
    """A shared weight would stack the batch into rows, but the residual (a transposed view)
    is not laid out as stacked rows: the batched tile runs, still one dispatch."""
    a, w, r = f32(2, 9, 16), f32(16, 20), f32(2, 20, 9)
    got, dispatches = run(dev, lambda b: b.add(b.gelu(b.matmul(b.input("a", a.shape), b.input("w", w.shape))),
                                               b.permute(b.input("r", r.shape), axes=(0, 2, 1))),
                          {"a": a, "w": w, "r": r}, "linear")
    np.testing.assert_allclose(got, linear_ref(a, w, None, np.swapaxes(r, 1, 2), "gelu", False), rtol=ACC[0], atol=ACC[1])
    assert dispatches == 1


@pytest.mark.parametrize("norm,has_beta,shape", [("layer", True, (5, 3, 33)), ("rms", False, (7, 130)),
                                                 ("layer", False, (1, 1)), ("rms", True, (4, 2, 257))])
def test_norm_affine(dev, norm, has_beta, shape):
    x, g, beta = f32(*shape), f32(shape[-1]), f32(shape[-1])
    inputs = {"x": x, "g": g, **({"beta": beta} if has_beta else {})}

    def build(b):
        y = b.mul(b.op(f"{norm}_norm", b.input("x", x.shape), eps=1e-5), b.input("g", g.shape))
        return b.add(y, b.input("beta", beta.shape)) if has_beta else y

    got, dispatches = run(dev, build, inputs, "norm_affine")
    x64 = x.astype(np.float64)
    mean = x64.mean(-1, keepdims=True) if norm == "layer" else 0.0
    want = (x64 - mean) / np.sqrt(((x64 - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * g
    np.testing.assert_allclose(got, want + (beta if has_beta else 0.0), rtol=ACC[0], atol=ACC[1])
    assert dispatches == 1


def test_norm_affine_of_a_strided_view(dev):
    x, g = f32(24, 6), f32(6)
    got, _ = run(dev, lambda b: b.mul(b.rms_norm(b.transpose(b.input("x", (6, 24))), eps=1e-6), b.input("g", (6,))),
                 {"x": x.T.copy(), "g": g}, "norm_affine")
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(got, x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * g, rtol=ACC[0], atol=ACC[1])


def attention_ref(q, k, v, mask, scale):
    s = q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2) * scale
    s = s + mask if mask is not None else s
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v.astype(np.float64)


@pytest.mark.parametrize("qs,ks,vs,ms", [((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6), (2, 1, 1, 7)),
                                         ((1, 4, 33, 13), (1, 4, 41, 13), (1, 4, 41, 9), None),
                                         ((3, 2, 17), (1, 45, 17), (1, 45, 19), (2, 45))])
def test_attention(dev, qs, ks, vs, ms):
    """Masked and unmasked, a key/value head shared by every batch (stride 0), odd sizes."""
    q, k, v = f32(*qs), f32(*ks), f32(*vs)
    mask = None if ms is None else np.where(RNG.random(ms) < 0.3, -1e9, 0.0).astype(np.float32)
    inputs = {"q": q, "k": k, "v": v, **({"m": mask} if mask is not None else {})}

    def build(b):
        s = b.matmul(b.input("q", qs), b.input("k", ks), transpose_b=True)
        p = b.softmax(s, b.input("m", ms), scale=0.35) if mask is not None else b.softmax(s, scale=0.35)
        return b.matmul(p, b.input("v", vs))

    got, dispatches = run(dev, build, inputs, "attention")
    np.testing.assert_allclose(got, attention_ref(q, k, v, mask, 0.35), rtol=ACC[0], atol=ACC[1])
    assert dispatches == 1


def test_attention_of_head_views(dev):
    """q, k, v as permuted views of [L, H, D] projections, as a model's heads are."""
    q, k, v = f32(6, 2, 8), f32(11, 2, 8), f32(11, 2, 8)
    heads = lambda b, n, x: b.permute(b.input(n, x.shape), axes=(1, 0, 2))  # noqa: E731
    got, _ = run(dev, lambda b: b.matmul(b.softmax(b.matmul(heads(b, "q", q), heads(b, "k", k), transpose_b=True),
                                                   scale=0.5), heads(b, "v", v)), {"q": q, "k": k, "v": v}, "attention")
    t = lambda x: np.transpose(x, (1, 0, 2))  # noqa: E731
    np.testing.assert_allclose(got, attention_ref(t(q), t(k), t(v), None, 0.5), rtol=ACC[0], atol=ACC[1])


@pytest.mark.parametrize("profile,keys,fused", [("cpu", 48, True), ("cpu", 49, False), ("gpu", 300, True),
                                                ("gpu", 513, False)])
def test_attention_key_limits(profile, keys, fused):
    """Longer rows of keys than the profile's limit keep the chain unfused (lowering.py says why)."""
    (device,) = VulkanBackend.open_devices({"kernel_profile": profile})
    try:
        q, k, v = f32(2, 5, 8), f32(2, keys, 8), f32(2, keys, 3)
        b = GraphBuilder()
        b.output("out", b.matmul(b.softmax(b.matmul(b.input("q", q.shape), b.input("k", k.shape), transpose_b=True),
                                           scale=0.3), b.input("v", v.shape)))
        graph = b.build()
        assert [f.op for f in fuse(graph, lambda node, chain: device.supports(node))] == (["attention"] if fused else [])
        if fused:
            with HandBound(device, graph, gap=1) as hb:
                got = hb.run({"q": q, "k": k, "v": v})["out"]
            np.testing.assert_allclose(got, attention_ref(q, k, v, None, 0.3), rtol=ACC[0], atol=ACC[1])
    finally:
        device.close()
