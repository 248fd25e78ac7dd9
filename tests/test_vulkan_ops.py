"""Every op of docs/ops.md on the Vulkan backend against a NumPy reference written here from
the doc's semantics (not from flare.core.ops, so the two references check each other).

Each graph runs on two devices: mapped memory (lavapipe's default) and forced staging
(device memory the host cannot see, as on a discrete GPU). All tensors of a graph sit
in one arena buffer at aligned offsets, so barriers must tell regions of one buffer apart.

Tolerances, |got - ref| <= atol + rtol*|ref| against a float64 reference:
- ELT (rtol 1e-5, atol 1e-6): elementwise ops, one f32 rounding plus a few ulp of the
  device's exp/sqrt and of our erfc (1.2e-7 relative);
- ACC (rtol 1e-4, atol 1e-5): reductions, matmul, softmax, norms, conv1d, mul_mat_id,
  rope: f32 sums in a different order than NumPy's pairwise float64 sum, error growing
  with the length of the sum (<= 64 here) times f32 eps; rope's angle is an f32 product;
- EXACT: data movement, indexing, argmax/top_k, casts (bit-for-bit).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from flare.core.graph import GraphBuilder
from flare.core.ledger import LEDGER

from flare.backends.vulkan import VulkanBackend
from flare.backends.vulkan.testing import MEMORY_KINDS, HandBound, memory_kind_device
from flare.plugins.testing.references import lstm_f64

PROBE = VulkanBackend.probe()
pytestmark = pytest.mark.skipif(not PROBE.usable, reason=f"Vulkan unusable here: {PROBE.reason}")

ELT = (1e-5, 1e-6)
ACC = (1e-4, 1e-5)
EXACT = (0.0, 0.0)
RNG = np.random.default_rng(1234)


dev = pytest.fixture(scope="module", params=MEMORY_KINDS)(memory_kind_device)  # mapped and staged memory


def f32(*shape, lo=-2.0, hi=2.0):
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def run(dev, build, inputs, *, gap=1, alias=None, states=None):
    """Build with `build(b) -> out tensor`, bind by hand, run twice, return the output."""
    b = GraphBuilder()
    b.output("out", build(b))
    graph = b.build()
    before = LEDGER.snapshot().count(dev.name)
    with HandBound(dev, graph, gap=gap, alias=alias) as hb:
        got = hb.run(inputs, states)["out"]
        hb.split.run()  # replaying the recorded command buffer gives the same bytes
        np.testing.assert_array_equal(hb.outputs()["out"], got)
    assert LEDGER.snapshot().count(dev.name) == before
    return got


def check(got, want, tol, dtype=None):
    want = np.asarray(want)
    if dtype is not None:
        assert got.dtype == np.dtype(dtype), (got.dtype, dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    rtol, atol = tol
    if rtol == 0 and atol == 0:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol)


# -- references from docs/ops.md --------------------------------------------------------------
_erf = np.vectorize(math.erf)
UNARY_REF = {
    "relu": lambda x: np.maximum(x, 0), "gelu": lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
    "silu": lambda x: x / (1 + np.exp(-x)), "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "tanh": np.tanh,
    "exp": np.exp, "sqrt": np.sqrt, "neg": lambda x: -x, "sqr": lambda x: x * x,
}
BINARY_REF = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}


def rope_ref(x, pos, base=10000.0, neox=True):
    n, h, d = x.shape
    x = x.astype(np.float64)
    out = x.copy()
    i = np.arange(d // 2)
    theta = pos.astype(np.float64)[:, None] * base ** (-2.0 * i / d)  # [N, D/2]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    ia, ib = (i, i + d // 2) if neox else (2 * i, 2 * i + 1)
    out[..., ia] = x[..., ia] * c - x[..., ib] * s
    out[..., ib] = x[..., ia] * s + x[..., ib] * c
    return out


def conv1d_ref(x, w, stride=1, padding=0, dilation=1):
    B, C, L = x.shape
    O, _, K = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (padding, padding)))
    lout = (L + 2 * padding - dilation * (K - 1) - 1) // stride + 1
    out = np.zeros((B, O, lout))
    for l in range(lout):
        for k in range(K):
            out[:, :, l] += xp[:, :, l * stride + k * dilation] @ w[:, :, k].astype(np.float64).T
    return out


# -- elementwise --------------------------------------------------------------------------------
@pytest.mark.parametrize("op", sorted(UNARY_REF))
def test_unary(dev, op):
    x = f32(3, 5, 7, lo=0.0 if op == "sqrt" else -4.0, hi=4.0)
    x.flat[:4] = [0.0, 1e-4, -1e-3, 0.25] if op != "sqrt" else [0.0, 1e-4, 1e-3, 0.25]  # near-zero: tanh/gelu cancellation
    got = run(dev, lambda b: b.op(op, b.input("x", x.shape)), {"x": x})
    check(got, UNARY_REF[op](x.astype(np.float64)), EXACT if op in ("relu", "neg") else ELT, "float32")


@pytest.mark.parametrize("op", sorted(BINARY_REF))
@pytest.mark.parametrize("sa,sb", [((4, 6), (4, 6)), ((2, 4, 6), (6,)), ((3, 1, 5), (1, 4, 1)), ((5,), (2, 3, 1, 5))])
def test_binary_broadcast(dev, op, sa, sb):
    a = f32(*sa)
    c = f32(*sb, lo=0.5, hi=2.0) if op == "div" else f32(*sb)
    got = run(dev, lambda b: b.op(op, b.input("a", sa), b.input("b", sb)), {"a": a, "b": c})
    check(got, BINARY_REF[op](a.astype(np.float64), c.astype(np.float64)), ELT, "float32")


def test_scale(dev):
    x = f32(4, 9)
    got = run(dev, lambda b: b.scale(b.input("x", x.shape), scale=0.75, bias=-0.25), {"x": x})
    check(got, x.astype(np.float64) * 0.75 - 0.25, ELT)


def test_strided_inputs(dev):
    """A transposed view plus a stepped slice: both inputs strided, output contiguous."""
    a, c = f32(6, 4), f32(4, 13)
    got = run(dev, lambda b: b.add(b.transpose(b.input("a", (6, 4))), b.slice(b.input("b", (4, 13)), axis=1, start=1, stop=13, step=2)),
              {"a": a, "b": c})
    check(got, a.T.astype(np.float64) + c[:, 1:13:2], ELT)


def test_in_place_outputs(dev):
    """Outputs bound onto their input's memory, as the planner does for in-place ops."""
    x = f32(3, 40)
    def build(b):
        h = b.scale(b.input("x", x.shape), scale=2.0, name="s")
        h = b.softmax(h, name="sm")
        return b.rms_norm(h, name="rn")
    got = run(dev, build, {"x": x}, alias={"sm": "s", "rn": "s"})
    z = x.astype(np.float64) * 2
    e = np.exp(z - z.max(-1, keepdims=True))
    sm = e / e.sum(-1, keepdims=True)
    check(got, sm / np.sqrt((sm ** 2).mean(-1, keepdims=True) + 1e-6), ACC)


# -- linear algebra ------------------------------------------------------------------------------
@pytest.mark.parametrize("sa,sb,tb", [((5, 16), (16, 7), False), ((2, 3, 5, 33), (2, 3, 7, 33), True),
                                      ((3, 4, 8), (8, 6), False), ((2, 1, 17, 9), (4, 9, 18), False)])
def test_matmul(dev, sa, sb, tb):
    a, w = f32(*sa), f32(*sb)
    got = run(dev, lambda b: b.matmul(b.input("a", sa), b.input("w", sb), transpose_b=tb), {"a": a, "w": w})
    w64 = np.swapaxes(w, -1, -2) if tb else w
    check(got, np.matmul(a.astype(np.float64), w64.astype(np.float64)), ACC, "float32")


def test_matmul_transposed_view_and_f16_weight(dev):
    a = f32(16, 5)
    w = f32(6, 16).astype(np.float16)
    got = run(dev, lambda b: b.matmul(b.transpose(b.input("a", a.shape)), b.weight("w", w), transpose_b=True), {"a": a})
    check(got, a.T.astype(np.float64) @ w.T.astype(np.float64), ACC)


@pytest.mark.parametrize("xshape", [(4, 8), (4, 2, 8)])
@pytest.mark.parametrize("wdt", [np.float32, np.float16])
def test_mul_mat_id(dev, xshape, wdt):
    w = f32(5, 6, 8).astype(wdt)
    x = f32(*xshape)
    ids = RNG.integers(0, 5, (4, 2)).astype(np.int32)
    got = run(dev, lambda b: b.mul_mat_id(b.weight("w", w), b.input("x", x.shape), b.input("ids", ids.shape, "i32")),
              {"x": x, "ids": ids})
    want = np.zeros((4, 2, 6))
    for t in range(4):
        for j in range(2):
            xv = x[t] if x.ndim == 2 else x[t, j]
            want[t, j] = w[ids[t, j]].astype(np.float64) @ xv.astype(np.float64)
    check(got, want, ACC)


@pytest.mark.parametrize("kw", [dict(padding=1), dict(stride=2, dilation=2, padding=2), dict()])
def test_conv1d(dev, kw):
    x, w = f32(2, 3, 21), f32(4, 3, 3)
    got = run(dev, lambda b: b.conv1d(b.input("x", x.shape), b.weight("w", w), **kw), {"x": x})
    check(got, conv1d_ref(x, w, **kw), ACC)


def test_conv1d_taps_four_at_a_time(dev):
    """An STFT-like conv (taps a multiple of 4, stride and padding multiples of 4): on a CPU
    driver the taps are read as vec4 (matmul_lanes.comp CONV_VEC), quads in the padding and
    past the end included."""
    x, w = f32(3, 2, 52), f32(9, 2, 16)
    got = run(dev, lambda b: b.conv1d(b.input("x", x.shape), b.weight("w", w), stride=8, padding=4), {"x": x})
    check(got, conv1d_ref(x, w, stride=8, padding=4), ACC)


@pytest.mark.parametrize("T,B,H", [(1, 1, 128), (23, 2, 19)])
def test_lstm(dev, T, B, H):
    x, w = f32(T, B, 4 * H), f32(4 * H, H, lo=-0.3, hi=0.3)
    h0, c0 = f32(B, H, lo=-1, hi=1), f32(B, H, lo=-1, hi=1)
    got = run(dev, lambda b: b.lstm(b.input("x", x.shape), b.weight("w", w), b.input("h0", h0.shape),
                                    b.input("c0", c0.shape)), {"x": x, "h0": h0, "c0": c0})
    check(got, lstm_f64(x, w, h0, c0), ACC)


# -- rows: norms, softmax, rope -----------------------------------------------------------------------
def test_layer_norm_rms_norm(dev):
    x = f32(3, 4, 37, lo=-3, hi=5)
    x64 = x.astype(np.float64)
    got = run(dev, lambda b: b.layer_norm(b.input("x", x.shape), eps=1e-5), {"x": x})
    check(got, (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5), ACC)
    got = run(dev, lambda b: b.rms_norm(b.input("x", x.shape), eps=1e-6), {"x": x})
    check(got, x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6), ACC)


def test_softmax_scale_and_broadcast_mask(dev):
    x = f32(2, 4, 150)  # rows longer than the workgroup
    m = np.where(RNG.random((1, 4, 150)) < 0.3, -1e9, 0.0).astype(np.float32)
    got = run(dev, lambda b: b.softmax(b.input("x", x.shape), b.input("m", m.shape), scale=0.5), {"x": x, "m": m})
    z = x.astype(np.float64) * 0.5 + m
    e = np.exp(z - z.max(-1, keepdims=True))
    check(got, e / e.sum(-1, keepdims=True), ACC)


@pytest.mark.parametrize("neox,base", [(True, 10000.0), (False, 500.0)])
def test_rope(dev, neox, base):
    x = f32(5, 3, 8)
    pos = np.array([0, 1, 2, 7, 30], np.int32)
    got = run(dev, lambda b: b.rope(b.input("x", x.shape), b.input("pos", (5,), "i32"), neox=neox, base=base),
              {"x": x, "pos": pos})
    check(got, rope_ref(x, pos, base, neox), ACC)


# -- reductions, selection -----------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("axis,keep", [(-1, False), (1, True), (0, False)])
def test_reduce(dev, op, axis, keep):
    x = f32(3, 4, 300)
    got = run(dev, lambda b: b.op(op, b.input("x", x.shape), axis=axis, keepdims=keep), {"x": x})
    check(got, getattr(np, op)(x.astype(np.float64), axis=axis, keepdims=keep), ACC)


def test_argmax_first_on_ties(dev):
    x = np.round(f32(4, 200), 1)  # many ties
    x[1, :] = 0.5
    got = run(dev, lambda b: b.argmax(b.input("x", x.shape)), {"x": x})
    check(got, np.argmax(x, axis=-1), EXACT, "int32")


def test_top_k_sorted_ties_lower_index_first(dev):
    x = np.concatenate([f32(3, 12), np.array([[1, 3, 3, 0, 3, 2, 3, 1, 0, 0, 5, 3]], np.float32)])
    got = run(dev, lambda b: b.top_k(b.input("x", x.shape), k=4), {"x": x})
    check(got, np.argsort(-x, axis=-1, kind="stable")[:, :4], EXACT, "int32")


def test_gather(dev):
    x = f32(4, 9)
    idx = RNG.integers(0, 9, (4, 3)).astype(np.int32)
    got = run(dev, lambda b: b.gather(b.input("x", x.shape), b.input("idx", idx.shape, "i32")), {"x": x, "idx": idx})
    check(got, np.take_along_axis(x, idx, -1), EXACT)


@pytest.mark.parametrize("tdt", [np.float32, np.float16])
@pytest.mark.parametrize("idt", ["i32", "i64"])
def test_get_rows(dev, tdt, idt):
    table = f32(10, 7).astype(tdt)
    idx = RNG.integers(0, 10, (2, 5)).astype(np.int32 if idt == "i32" else np.int64)
    b0 = GraphBuilder()
    node = b0.get_rows(b0.weight("t", table), b0.input("i", idx.shape, idt))
    if not dev.supports(node):
        pytest.skip(f"get_rows with {idt} indices is not supported")
    got = run(dev, lambda b: b.get_rows(b.weight("t", table), b.input("i", idx.shape, idt)), {"i": idx})
    check(got, table[idx].astype(np.float32), EXACT, "float32")


def test_get_rows_strided_table(dev):
    table = f32(10, 12)
    idx = np.array([9, 0, 3, 3], np.int32)
    got = run(dev, lambda b: b.get_rows(b.slice(b.weight("t", table), axis=1, start=2, stop=11, step=3),
                                        b.input("i", (4,), "i32")), {"i": idx})
    check(got, table[:, 2:11:3][idx], EXACT)


# -- data movement -----------------------------------------------------------------------------------------
def test_pad(dev):
    x = f32(2, 5)
    got = run(dev, lambda b: b.pad(b.input("x", x.shape), pads=((1, 0), (2, 3)), value=0.5), {"x": x})
    check(got, np.pad(x, ((1, 0), (2, 3)), constant_values=0.5), EXACT)
    x = f32(2, 3, 10)
    got = run(dev, lambda b: b.pad(b.input("x", x.shape), pads=((0, 0), (1, 2), (4, 9)), mode="reflect"), {"x": x})
    check(got, np.pad(x, ((0, 0), (1, 2), (4, 9)), mode="reflect"), EXACT)


@pytest.mark.parametrize("dt", ["f32", "f16", "i32", "i64"])
def test_concat_and_contiguous_all_dtypes(dev, dt):
    npdt = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "i64": np.int64}[dt]
    a = (RNG.integers(-2**62, 2**62, (2, 3, 5)) if dt == "i64" else RNG.integers(-2**30, 2**30, (2, 3, 5))
         if dt == "i32" else f32(2, 3, 5)).astype(npdt)
    c = a[:, :1, :] + 1 if dt != "f16" else (a[:, :1, :] + 1).astype(npdt)  # odd sizes: f16 halves share words
    got = run(dev, lambda b: b.concat(b.input("a", a.shape, dt), b.input("b", c.shape, dt), axis=1), {"a": a, "b": c})
    check(got, np.concatenate([a, c], axis=1), EXACT, npdt)
    got = run(dev, lambda b: b.permute(b.input("a", a.shape, dt), axes=(2, 0, 1)), {"a": a})
    check(got, np.transpose(a, (2, 0, 1)), EXACT, npdt)


def test_views_reshape_permute_slice(dev):
    x = f32(4, 6)
    got = run(dev, lambda b: b.slice(b.permute(b.reshape(b.input("x", x.shape), shape=(2, 2, 6)), axes=(2, 0, 1)),
                                     axis=0, start=1, stop=6, step=2), {"x": x})
    check(got, np.transpose(x.reshape(2, 2, 6), (2, 0, 1))[1:6:2], EXACT)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_set_rows_writes_state(dev, dt):
    npdt = np.float32 if dt == "f32" else np.float16
    cache0 = f32(8, 5).astype(npdt)  # D odd: with f16 two rows share a word
    idx = np.array([6, 1, 3], np.int32)
    v = f32(3, 5)
    got = run(dev, lambda b: b.set_rows(b.state("cache", (8, 5), dt), b.input("idx", (3,), "i32"), b.input("v", (3, 5))),
              {"idx": idx, "v": v}, states={"cache": cache0})
    want = cache0.copy()
    want[idx] = v.astype(npdt)
    check(got, want, EXACT, npdt)


@pytest.mark.parametrize("dt,offset", [("f32", 5), ("f16", 3)])
def test_copy_into(dev, dt, offset):
    npdt = np.float32 if dt == "f32" else np.float16
    st0 = f32(3, 5).astype(npdt)
    v = f32(2, 4).astype(npdt)
    got = run(dev, lambda b: b.copy_into(b.state("st", (3, 5), dt), b.input("v", (2, 4), dt), offset=offset),
              {"v": v}, states={"st": st0})
    want = st0.copy()
    want.flat[offset:offset + v.size] = v.ravel()
    check(got, want, EXACT, npdt)


@pytest.mark.parametrize("src,dst", [("f32", "f16"), ("f16", "f32"), ("f32", "i32"), ("i32", "f32"),
                                     ("i32", "i64"), ("i64", "i32"), ("f32", "i64"), ("i64", "f32")])
def test_cast(dev, src, dst):
    npt = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "i64": np.int64}
    if src == "f32":
        x = f32(3, 7, lo=-9, hi=9)
        if dst == "i64":
            x.flat[:4] = [3.0e9, -5.5e12, 2.5e15, -7.0e17]  # beyond i32: the two-word path, exact
    elif src == "f16":
        x = f32(3, 7).astype(np.float16)
    elif src == "i32":
        x = RNG.integers(-50, 50, (3, 7)).astype(np.int32)
    else:
        x = RNG.integers(-50, 50, (3, 7)).astype(np.int64)
        if dst == "i32":
            x.flat[:2] = [2**40 + 5, -(2**40) - 7]  # wraps like NumPy's astype
    b0 = GraphBuilder()
    if not dev.supports(b0.cast(b0.input("x", x.shape, src), dtype=dst)):
        pytest.skip(f"cast {src}->{dst} not supported")
    got = run(dev, lambda b: b.cast(b.input("x", x.shape, src), dtype=dst), {"x": x})
    check(got, x.astype(npt[dst]), EXACT, npt[dst])


def test_chain_of_fifty_nodes_with_barriers_only_where_needed(dev):
    """A long dependent chain plus independent branches: correct, and fewer barriers than dispatches."""
    x = f32(8, 16)
    w = f32(16, 16)
    def build(b):
        h = b.input("x", x.shape)
        wt = b.weight("w", w)
        for i in range(10):
            p = b.matmul(h, wt)
            q = b.tanh(p)
            r1, r2 = b.scale(q, scale=0.5), b.sqr(q)  # independent of each other
            h = b.add(r1, r2)
        return h
    b = GraphBuilder()
    b.output("out", build(b))
    g = b.build()
    with HandBound(dev, g) as hb:
        got = hb.run({"x": x})["out"]
        stats = hb.split.stats
    h = x.astype(np.float64)
    for _ in range(10):
        q = np.tanh(h @ w)
        h = 0.5 * q + q * q
    check(got, h, (1e-3, 1e-4))  # ten layers compound the per-layer 1e-4
    assert stats["dispatches"] == 20  # per block: the matmul, then tanh/scale/sqr/add chained (fusion.py)
    assert stats["barriers"] < stats["dispatches"]


def test_every_registry_op_has_a_kernel_or_is_a_view():
    from flare.core.ops import OPS
    from flare.backends.vulkan import lowering as kernels

    from flare.plugins.testing.conformance.cases_extra import importer_ops

    # host: Python; the ONNX importer's ops run on the CPU (supports() refuses them) so far
    # a fused op over an importer op (conv_add: conv2d's residual epilogue) runs where that op does
    over_importer = {"conv_add"} if "conv2d" in importer_ops() else set()
    missing = sorted(set(OPS) - set(kernels.LOWER) - {"host"} - importer_ops() - over_importer)  # fused ops too (test_vulkan_fused.py)
    assert not missing, f"ops without a Vulkan lowering: {missing}"

