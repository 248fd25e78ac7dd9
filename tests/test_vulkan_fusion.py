"""Chained elementwise dispatches (backends/flare/backends/vulkan/fusion.py, shaders/eltwise_chain.comp).

Each graph runs on lavapipe, mapped and with forced staging, bound by hand into one arena
(so chains must tell regions of one buffer apart), and is compared with the NumPy
reference (flare.core.reference) at rtol 1e-5, atol 1e-6 (one f32 rounding per node, a few ulp
of exp/tanh: the same tolerance as the unchained kernels), and bit for bit with the
unchained split. The dispatch counts show where chains form and where the rule of
fusion.py must break them: a read of an earlier output at other elements (a slice, a
broadcast), an in-place alias, more nodes than one chain holds.
"""
from __future__ import annotations

import numpy as np
import pytest

from flare.core.backend import SplitProgram
from flare.core.graph import GraphBuilder
from flare.core.ledger import LEDGER
from flare.core.reference import evaluate

from flare.backends.vulkan import VulkanBackend, fusion
from flare.backends.vulkan.testing import MEMORY_KINDS, HandBound, memory_kind_device

PROBE = VulkanBackend.probe()
pytestmark = pytest.mark.skipif(not PROBE.usable, reason=f"Vulkan unusable here: {PROBE.reason}")
RNG = np.random.default_rng(7)


dev = pytest.fixture(scope="module", params=MEMORY_KINDS)(memory_kind_device)  # mapped and staged memory


def f32(*shape):
    return RNG.uniform(-2, 2, shape).astype(np.float32)


def run(dev, build, inputs, alias=None, monkeypatch=None):
    """(output, dispatch count) with chaining, checked against the reference and the unchained run."""
    b = GraphBuilder()
    b.output("out", build(b))
    graph = b.build()
    want = evaluate(graph, inputs)[0]["out"]
    before = LEDGER.snapshot().count(dev.name)
    results = []
    for chained in (True, False):
        with HandBound(dev, graph, gap=1, alias=alias) as hb:
            hb.write_leaves(inputs)
            if not chained:
                monkeypatch.setattr(fusion, "chain_elementwise", lambda d, limit: d)
            split = dev.compile(SplitProgram(dev, graph.nodes, hb.bindings))
            try:
                split.run()
                results.append((hb.outputs()["out"], split.stats["dispatches"]))
            finally:
                split.release()
                monkeypatch.undo()
    assert LEDGER.snapshot().count(dev.name) == before
    (got, n), (plain, _) = results
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got, plain)
    return got, n


def test_lstm_cell_tail_is_one_dispatch(dev, monkeypatch):
    """sigmoid/tanh of gate slices then the cell update: the [1, 128] tail chains."""
    x = {"g": f32(1, 512), "c": f32(1, 128)}

    def build(b):
        g, c = b.input("g", (1, 512)), b.input("c", (1, 128))
        sig = b.sigmoid(b.slice(g, axis=1, start=0, stop=384))
        gg = b.tanh(b.slice(g, axis=1, start=384, stop=512))
        i, f, o = (b.slice(sig, axis=1, start=k * 128, stop=(k + 1) * 128) for k in range(3))
        c2 = b.add(b.mul(f, c), b.mul(i, gg))
        return b.mul(o, b.tanh(c2))
    _, n = run(dev, build, x, monkeypatch=monkeypatch)
    assert n == 2  # sigmoid [1, 384]; then tanh, mul, mul, add, tanh, mul in one chain


def test_broadcast_and_scale_chain(dev, monkeypatch):
    x = {"a": f32(3, 5, 7), "bias": f32(7)}
    _, n = run(dev, lambda b: b.gelu(b.scale(b.add(b.input("a", (3, 5, 7)), b.input("bias", (7,))), scale=0.5, bias=0.1)),
               x, monkeypatch=monkeypatch)
    assert n == 1


def test_reading_an_earlier_output_at_other_elements_breaks_the_chain(dev, monkeypatch):
    """y = exp(x); z = y[::-1-like shifted slice] + y: element e of z needs element e+1 of y."""
    x = {"x": f32(1, 9)}

    def build(b):
        y = b.exp(b.input("x", (1, 9)))
        return b.add(b.slice(y, axis=1, start=1, stop=9), b.slice(y, axis=1, start=0, stop=8))
    _, n = run(dev, build, x, monkeypatch=monkeypatch)
    assert n == 2


def test_broadcast_read_of_an_earlier_output_breaks_the_chain(dev, monkeypatch):
    x = {"r": f32(1, 6), "m": f32(4, 6)}

    def build(b):
        r = b.tanh(b.input("r", (1, 6)))              # [1, 6], read broadcast over 4 rows below
        return b.mul(b.add(b.input("m", (4, 6)), r), r)
    _, n = run(dev, build, x, monkeypatch=monkeypatch)
    assert n == 2  # tanh alone (other shape), then add+mul chained reading r from memory


def test_in_place_alias_chains_and_stays_correct(dev, monkeypatch):
    """Outputs bound onto inputs of the same elements (as the planner does in place) chain."""
    x = {"a": f32(4, 33), "b": f32(4, 33)}

    def build(b):
        bb = b.input("b", (4, 33))
        t = b.op("tanh", b.input("a", (4, 33)), name="t")
        u = b.op("mul", t, bb, name="u")                     # over t (its only reader)
        return b.op("sigmoid", b.op("add", u, bb, name="s"), name="g")  # s over t, g over a
    _, n = run(dev, build, x, alias={"u": "t", "s": "t", "g": "a"}, monkeypatch=monkeypatch)
    assert n == 1


def test_overlapping_write_at_other_elements_breaks_the_chain(dev, monkeypatch):
    """An output placed over memory an earlier node of the chain read at other elements."""
    x = {"a": f32(1, 16)}

    def build(b):
        a = b.input("a", (1, 16))
        r = b.op("exp", b.slice(a, axis=1, start=4, stop=12), name="r")    # r[e] reads a[4 + e]
        return b.op("neg", r, name="n")                                      # n[e] written over a[e]
    _, n = run(dev, build, x, alias={"n": "a"}, monkeypatch=monkeypatch)
    assert n == 2


def test_long_chains_split_at_the_node_limit(dev, monkeypatch):
    x = {"x": f32(2, 50)}

    def build(b):
        h = b.input("x", (2, 50))
        for _ in range(fusion.MAX_OPS + 3):
            h = b.scale(b.tanh(h), scale=1.5)
        return h
    _, n = run(dev, build, x, monkeypatch=monkeypatch)
    assert n == -(-2 * (fusion.MAX_OPS + 3) // fusion.MAX_OPS)


def test_no_chains_on_a_device_with_few_storage_buffer_bindings(dev):
    b = GraphBuilder()
    b.output("out", b.tanh(b.exp(b.input("x", (2, 3)))))
    g = b.build()
    with HandBound(dev, g) as hb:
        from flare.backends.vulkan import lowering as kernels
        ds = [d for n in g.nodes for d in kernels.lower(n, SplitProgram(dev, g.nodes, hb.bindings), dev)]
        assert len(fusion.chain_elementwise(ds, 4)) == 2
        assert len(fusion.chain_elementwise(ds)) == 1
