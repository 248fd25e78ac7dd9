"""Block-quantized weights on Vulkan (quant.glsl and its four shaders), on lavapipe.

Every kernel path for every block type (q4_0, q4_1, q8_0, q4_k, q6_k), under both kernel
profiles (`cpu`: matmul_q_lanes.comp; `gpu`: matmul_q.comp, the weights dequantized into a
shared-memory tile) and with mapped memory and forced staging:
- dequant.comp (dequantize, get_rows of a quantized table): bit for bit against the
  reference (`gguf.quants`), on fully random blocks (scales that are subnormal, infinite or
  NaN included), blocks at byte offsets that are not 4-aligned, negative indices. NaN positions must agree; their payloads may differ, every other bit may not.
- matvec_q.comp (few rows; mul_mat_id's experts) and the tiled kernels: against the
  reference's float64 product of the dequantized weights with tolerance ACC (rtol 1e-4,
  atol 1e-4): f32 sums of at most 768 terms of order 0.3 in another order than NumPy's (and,
  in matvec_q, each sub-block's integer-weighted sum scaled once), a few ulps of the f32
  result, far inside ACC. Odd sizes (tiles and the NR group cut off), batched and broadcast
  weights, strided activations, the fused `linear` epilogue.
- the tuned variants, each buffer and split released (ledger).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from flare.core.backend import SplitProgram
from flare.core.dtypes import QUANT_TYPES
from flare.core.fusion import fuse
from flare.core.graph import GraphBuilder
from flare.core.ledger import LEDGER
from flare.core.reference import evaluate
from flare.plugins.testing.conformance import cases as _cases  # noqa: F401  (quant_cases imports
from flare.plugins.testing.conformance.quant_cases import quant_blocks  # its helpers from there)

from flare.backends.vulkan import VulkanBackend, variants
from flare.backends.vulkan.testing import MEMORY_KINDS, HandBound

PROBE = VulkanBackend.probe()
pytestmark = pytest.mark.skipif(not PROBE.usable, reason=f"Vulkan unusable here: {PROBE.reason}")

TYPES = sorted(QUANT_TYPES)
ACC = (1e-4, 1e-4)
RNG = np.random.default_rng(2020)
TILED = {"cpu": "matmul_q_lanes", "gpu": "matmul_q"}


@pytest.fixture(scope="module", params=[(p, m) for p in ("cpu", "gpu") for m in MEMORY_KINDS],
                ids=lambda pm: f"{pm[0]}-{pm[1]}")
def dev(request):
    profile, memory = request.param
    (device,) = VulkanBackend.open_devices({"kernel_profile": profile, "force_staging": memory == "staged"})
    try:
        assert device.kernel_profile == profile and device.mapped == (memory == "mapped")
        yield device
    finally:
        device.close()


def f32(*shape):
    return RNG.uniform(-2.0, 2.0, shape).astype(np.float32)


def k_of(dt: str, blocks: int) -> int:
    return blocks * QUANT_TYPES[dt].block_size


def random_blocks(dt: str, *shape: int) -> np.ndarray:
    """Blocks of fully random bytes: every scale bit pattern, NaN and inf included."""
    t = QUANT_TYPES[dt]
    n = int(np.prod(shape))
    return RNG.integers(0, 256, size=(n, t.block_bytes), dtype=np.uint8).view(t.numpy).reshape(shape)


def run(dev, build, inputs, *, tuning=None, fused=None):
    """Build (fused where the device takes it), run on `dev`, compare with a second run;
    (output, reference output, shaders dispatched). Checks nothing stays allocated."""
    b = GraphBuilder()
    b.output("out", build(b))
    graph = b.build()
    want = evaluate(graph, inputs)[0]["out"]
    if fused is not None:
        assert [f.op for f in fuse(graph, lambda node, chain: dev.supports(node))] == [fused]
    assert all(dev.supports(n) for n in graph.nodes), [n.op for n in graph.nodes if not dev.supports(n)]
    before = LEDGER.snapshot().count(dev.name)
    with HandBound(dev, graph, gap=1) as hb:
        if tuning:
            hb.split = dev.compile(SplitProgram(dev, graph.nodes, hb.bindings, tuning=tuning))
        got = hb.run(inputs)["out"]
        hb.split.run()
        np.testing.assert_array_equal(hb.outputs()["out"], got)
        shaders = [d.shader for d in hb.split.dispatches]
    assert LEDGER.snapshot().count(dev.name) == before
    return got, want, shaders


def assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("dt", TYPES)
def test_dequantize_is_bit_exact(dev, dt):
    w = random_blocks(dt, 2, 3, 3)
    with np.errstate(all="ignore"):
        got, want, shaders = run(dev, lambda b: b.dequantize(b.weight("w", w)), {})
    assert shaders == ["dequant"]
    assert_bits_equal(got, want)


@pytest.mark.parametrize("dt", TYPES)
def test_weights_at_any_even_byte_offset(dev, dt):
    """A planner's arena places a weight at its own alignment, not at a multiple of 18, 34 or
    210 bytes: the descriptor's offset is then in bytes. The weight is moved 2 and 6 bytes into
    its region (so its blocks start at 2 mod 4) and read by each kernel."""
    k = k_of(dt, 3 if QUANT_TYPES[dt].block_size == 32 else 2)
    w = quant_blocks(RNG, dt, 35, k)
    a = f32(37, k)
    b = GraphBuilder()
    x, wt = b.input("a", a.shape), b.weight("w", w)
    b.output("deq", b.dequantize(wt))
    b.output("vec", b.matmul(b.slice(x, axis=0, start=0, stop=2), wt, transpose_b=True))
    b.output("mm", b.matmul(x, wt, transpose_b=True))
    graph = b.build()
    want = evaluate(graph, {"a": a})[0]
    for shift in (2, 6):
        with HandBound(dev, graph, gap=1) as hb:
            wid = next(t.id for t in graph.tensors if t.name == "w")
            hb.bindings[wid] = replace(hb.bindings[wid], offset=hb.bindings[wid].offset + shift)
            got = hb.run({"a": a})
            assert sorted(d.shader for d in hb.split.dispatches) == sorted(["dequant", "matvec_q", TILED[dev.kernel_profile]])
        assert_bits_equal(got["deq"], want["deq"])
        for name in ("vec", "mm"):
            np.testing.assert_allclose(got[name], want[name], rtol=ACC[0], atol=ACC[1], err_msg=f"{name} +{shift}")


@pytest.mark.parametrize("dt", TYPES)
def test_get_rows_is_bit_exact(dev, dt):
    table = random_blocks(dt, 7, 2)
    idx = np.array([[[0, -1, 3], [6, 2, -7]]], np.int32)
    for idt in ("i32", "i64"):
        with np.errstate(all="ignore"):
            got, want, shaders = run(dev, lambda b: b.get_rows(b.weight("t", table), b.input("i", idx.shape, idt)),
                                     {"i": idx.astype(idt.replace("i", "int"))})
        assert shaders == ["dequant"] and got.shape == (1, 2, 3, k_of(dt, 2))
        assert_bits_equal(got, want)


@pytest.mark.parametrize("dt", TYPES)
def test_matvec(dev, dt):
    """Few rows: matvec_q.comp. 13 outputs (the last NR group cut off), 1 and 3 rows, strided
    activations (no vec4 loads), a batched weight."""
    k = k_of(dt, 3 if QUANT_TYPES[dt].block_size == 32 else 2)
    w = quant_blocks(RNG, dt, 13, k)
    wb = quant_blocks(RNG, dt, 2 * 11, k).reshape(2, 11, -1)
    cases = [
        (lambda b: b.matmul(b.input("a", (1, k)), b.weight("w", w), transpose_b=True), {"a": f32(1, k)}),
        (lambda b: b.matmul(b.input("a", (3, k)), b.weight("w", w), transpose_b=True), {"a": f32(3, k)}),
        (lambda b: b.matmul(b.transpose(b.input("a", (k, 2))), b.weight("w", w), transpose_b=True), {"a": f32(k, 2)}),
        (lambda b: b.matmul(b.input("a", (2, 1, k)), b.weight("wb", wb), transpose_b=True), {"a": f32(2, 1, k)}),
    ]
    for build, inputs in cases:
        got, want, shaders = run(dev, build, inputs)
        assert shaders == ["matvec_q"]
        np.testing.assert_allclose(got, want, rtol=ACC[0], atol=ACC[1])


@pytest.mark.parametrize("dt", TYPES)
def test_matmul_tiles(dev, dt):
    """Prefill-sized: the profile's tiled kernel. 37 x 70 (no tile multiple), a batch of rows
    over a shared weight (stacked into one product), a batched weight, a small output."""
    k = k_of(dt, 3 if QUANT_TYPES[dt].block_size == 32 else 2)
    w = quant_blocks(RNG, dt, 70, k)
    wb = quant_blocks(RNG, dt, 2 * 9, k).reshape(2, 9, -1)
    cases = [
        (lambda b: b.matmul(b.input("a", (37, k)), b.weight("w", w), transpose_b=True), {"a": f32(37, k)}),
        (lambda b: b.matmul(b.input("a", (2, 19, k)), b.weight("w", w), transpose_b=True), {"a": f32(2, 19, k)}),
        (lambda b: b.matmul(b.input("a", (2, 21, k)), b.weight("wb", wb), transpose_b=True), {"a": f32(2, 21, k)}),
        (lambda b: b.matmul(b.transpose(b.input("a", (k, 6))), b.weight("wb", wb[0]), transpose_b=True),
         {"a": f32(k, 6)}),
    ]
    for build, inputs in cases:
        got, want, shaders = run(dev, build, inputs)
        assert shaders == [TILED[dev.kernel_profile]]
        np.testing.assert_allclose(got, want, rtol=ACC[0], atol=ACC[1])


def mapped_only(dev) -> None:
    """Kernels read and write device buffers the same way whatever the memory kind; cases that
    only add pipelines (each an LLVM compile of up to half a minute on lavapipe without Mesa's
    shader cache) run on mapped memory only."""
    if not dev.mapped:
        pytest.skip("no memory-kind dependence; the mapped run covers it")


@pytest.mark.parametrize("dt", ["q6_k"])
def test_tuned_variants(dev, dt):
    """Every matmul variant a tuning profile may name runs with quantized weights; a tile whose
    k-step would cross a q6_k scale (t64r8k32, BK 32 > 16) falls back to t16."""
    mapped_only(dev)
    k = k_of(dt, 2)
    w = quant_blocks(RNG, dt, 45, k)
    a = f32(40, k)
    for name in variants.names("matmul"):
        got, want, shaders = run(dev, lambda b: b.matmul(b.input("a", a.shape), b.weight("w", w), transpose_b=True),
                                 {"a": a}, tuning={"matmul": name})
        v = variants.MATMUL[name]
        assert shaders == ["matmul_q_lanes" if isinstance(v, variants.Lanes) else "matmul_q"], name
        np.testing.assert_allclose(got, want, rtol=ACC[0], atol=ACC[1], err_msg=name)
    fallback = variants.pick_quant("matmul", {"matmul": "t64r8k32"}, dev, (64, 64), 16)
    assert fallback == variants.MATMUL["t16"]


LINEAR_CASES = [(2, dt, "gelu") for dt in TYPES] + [(20, "q4_0", "relu"), (20, "q4_k", "relu")]  # 20 x 23: the small tile


@pytest.mark.parametrize("rows,dt,act", LINEAR_CASES)
def test_linear(dev, rows, dt, act):
    """matmul + bias, activation, + residual fuse into one `linear` dispatch with a quantized
    weight: the matvec kernel for every type, the tiled one for a legacy type and a k-quant."""
    mapped_only(dev)
    k = k_of(dt, 2)
    w = quant_blocks(RNG, dt, 23, k)
    inputs = {"a": f32(rows, k), "bias": f32(23), "res": f32(rows, 23)}

    def build(b):
        y = b.matmul(b.input("a", (rows, k)), b.weight("w", w), transpose_b=True)
        return b.add(b.input("res", (rows, 23)), b.op(act, b.add(y, b.input("bias", (23,)))))

    got, want, shaders = run(dev, build, inputs, fused="linear")
    assert shaders == ["matvec_q" if rows <= 4 else TILED[dev.kernel_profile]]
    np.testing.assert_allclose(got, want, rtol=ACC[0], atol=ACC[1])


@pytest.mark.parametrize("dt", TYPES)
def test_mul_mat_id(dev, dt):
    """Quantized experts: matvec_q.comp with ids, also past the pair count where float
    weights switch to the tiled kernel, and with per-slot activations [T, k, K]."""
    k = k_of(dt, 2)
    w = quant_blocks(RNG, dt, 4 * 6, k).reshape(4, 6, -1)
    ids = RNG.integers(0, 4, (20, 2)).astype(np.int32)
    for xs in ((20, k), (20, 2, k)):
        got, want, shaders = run(dev, lambda b: b.mul_mat_id(b.weight("w", w), b.input("x", xs),
                                                             b.input("ids", ids.shape, "i32")),
                                 {"x": f32(*xs), "ids": ids})
        assert shaders == ["matvec_q"] and got.shape == (20, 2, 6)
        np.testing.assert_allclose(got, want, rtol=ACC[0], atol=ACC[1])


def test_supports_quantized_sources_only_where_a_kernel_reads_them():
    """supports() takes block-quantized weights in the positions the kernels read (and the core
    allows), and leaves quantized matvec / mul_mat_id to another device where the compute stage
    lacks subgroup arithmetic (matvec_q reduces with subgroupAdd)."""
    (device,) = VulkanBackend.open_devices({})
    try:
        w = quant_blocks(RNG, "q4_1", 6, 64)
        b = GraphBuilder()
        x = b.input("x", (2, 64))
        nodes = [b.matmul(x, b.weight("w", w), transpose_b=True), b.dequantize(b.weight("w", w)),
                 b.get_rows(b.weight("w", w), b.input("i", (3,), "i32")),
                 b.mul_mat_id(b.weight("e", w.reshape(2, 3, 2)), x, b.input("ids", (2, 1), "i32"))]
        assert all(device.supports(n) for n in nodes)
        info = device.info
        try:
            device.info = replace(info, subgroup_ops=info.subgroup_ops & ~0x4)
            assert not device.supports(nodes[0]) and not device.supports(nodes[3])
            assert device.supports(nodes[1]) and device.supports(nodes[2])
        finally:
            device.info = info
    finally:
        device.close()
