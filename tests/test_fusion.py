"""The fusion pass (flare.core.fusion): random fusable chains give what the unfused graph gives,
and chains that must not fuse (shared intermediates, outputs, unsupported) are left alone."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flare.backends.cpu import native
from flare.core.fusion import fuse
from flare.core.graph import GraphBuilder
from flare.core.reference import evaluate
from flare.core.session import Session

needs_native = pytest.mark.skipif(native.load() is None, reason=f"native CPU executor unavailable: {native.REASON}")
# matmul tolerance of the conformance suite (ACCUM); the epilogue adds one f32 rounding per step
TOL = dict(rtol=1e-4, atol=1e-5)


@st.composite
def linear_chains(draw):
    batch = draw(st.sampled_from([(), (2,), (2, 3)]))
    m, k, n = draw(st.integers(1, 24)), draw(st.integers(1, 80)), draw(st.integers(1, 90))
    return {"batch": batch, "m": m, "k": k, "n": n, "tb": draw(st.booleans()), "bias": draw(st.booleans()),
            "act": draw(st.sampled_from(["none", "gelu", "relu", "sigmoid"])),
            "residual": draw(st.sampled_from([None, "left", "right"])), "seed": draw(st.integers(0, 2**16))}


def _linear_graph(c):
    rng = np.random.default_rng(c["seed"])
    a = rng.uniform(-1, 1, (*c["batch"], c["m"], c["k"])).astype(np.float32)
    w = rng.uniform(-1, 1, (c["n"], c["k"]) if c["tb"] else (c["k"], c["n"])).astype(np.float32)
    bias = rng.uniform(-1, 1, (c["n"],)).astype(np.float32)
    res = rng.uniform(-1, 1, (*c["batch"], c["m"], c["n"])).astype(np.float32)

    def build(b, shapes=None):
        y = b.matmul(b.input("a", a.shape), b.weight("w", w), transpose_b=c["tb"])
        if c["bias"]:
            y = b.add(y, b.weight("bias", bias))
        if c["act"] != "none":
            y = b.op(c["act"], y)
        if c["residual"]:
            r = b.input("res", res.shape)
            y = b.add(r, y) if c["residual"] == "left" else b.add(y, r)
        b.output("y", y)

    inputs = {"a": a, **({"res": res} if c["residual"] else {})}
    steps = int(c["bias"]) + int(c["act"] != "none") + int(bool(c["residual"]))
    return build, inputs, steps


def _run(build, inputs):
    b = GraphBuilder()
    build(b)
    want = evaluate(b.build(), inputs)[0]["y"]
    with Session(["cpu"]) as sess:
        pg = sess.prepare({"f": build}, {"f": {k: v.shape for k, v in inputs.items()}})
        got = pg.execute("f", **inputs)["y"]
        fusions = pg.describe()["entries"]["f"]["fusions"]
        pg.release()
    return got, want, fusions


@needs_native
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(linear_chains())
def test_random_linear_chains_match_unfused(c):
    build, inputs, steps = _linear_graph(c)
    got, want, fusions = _run(build, inputs)
    assert len(fusions) == (1 if steps else 0)
    np.testing.assert_allclose(got, want, **TOL)


@needs_native
@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.sampled_from(["layer_norm", "rms_norm"]), st.booleans(), st.integers(1, 6), st.integers(2, 100),
       st.integers(0, 2**16))
def test_random_norm_chains_match_unfused(norm, beta, rows, d, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, (rows, d)).astype(np.float32)
    g, bt = rng.uniform(-1, 1, (2, d)).astype(np.float32)

    def build(b, shapes=None):
        y = b.mul(b.op(norm, b.input("x", x.shape), eps=1e-5), b.weight("g", g))
        if beta:
            y = b.add(y, b.weight("beta", bt))
        b.output("y", y)

    got, want, fusions = _run(build, {"x": x})
    assert len(fusions) == 1 and fusions[0].startswith("norm_affine")
    np.testing.assert_allclose(got, want, **TOL)


def _graph(shared: bool, output: bool):
    b = GraphBuilder()
    mm = b.matmul(b.input("a", (4, 8)), b.weight("w", np.ones((8, 8), np.float32)))
    y = b.add(mm, b.weight("bias", np.ones(8, np.float32)))
    b.output("y", y)
    if shared:
        b.output("z", b.relu(mm))
    if output:
        b.output("mm", mm)
    return b.build()


@pytest.mark.parametrize("shared,output", [(True, False), (False, True)])
def test_intermediates_read_elsewhere_are_not_fused(shared, output):
    graph = _graph(shared, output)
    assert fuse(graph, lambda n, chain: True) == []
    assert [n.op for n in graph.nodes].count("matmul") == 1


def test_unsupported_fused_op_keeps_the_chain():
    graph = _graph(False, False)
    seen = []
    assert fuse(graph, lambda n, chain: seen.append(n.op) or False) == []
    assert seen == ["linear"] and [n.op for n in graph.nodes] == ["matmul", "add"]


def test_fused_node_keeps_name_and_readers():
    graph = _graph(False, False)
    [f] = fuse(graph, lambda n, chain: True)
    assert [n.op for n in graph.nodes] == ["linear"] and graph.outputs["y"].op == "linear"
    assert f.node == graph.outputs["y"].name and len(f.replaced) == 2


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.sampled_from([(1,), (2,), (2, 3)]), st.integers(1, 12), st.integers(1, 20), st.integers(1, 40),
       st.integers(1, 40), st.sampled_from([None, "row", "full"]), st.integers(0, 2**16))
def test_random_attention_chains_fuse_to_their_reference(batch, length, lk, d, dv, mask, seed):
    """The pass finds q k^T -> softmax -> . v and the fused op means the same (reference
    evaluation of the rewritten graph); the CPU declines the op, so a CPU run keeps the chain."""
    rng = np.random.default_rng(seed)
    q = rng.uniform(-1, 1, (*batch, length, d)).astype(np.float32)
    k = rng.uniform(-1, 1, (*batch, lk, d)).astype(np.float32)
    v = rng.uniform(-1, 1, (*batch, lk, dv)).astype(np.float32)
    mshape = {"row": (lk,), "full": (*batch, length, lk)}.get(mask)
    m = np.where(rng.random(mshape) < 0.3, -1e9, 0.0).astype(np.float32) if mask else None
    if m is not None:
        m[..., 0] = 0.0  # a fully masked row is uniform in f32 but not in the f64 reference

    def build(b, shapes=None):
        s = b.matmul(b.input("q", q.shape), b.input("k", k.shape), transpose_b=True)
        p = b.softmax(s, b.input("m", m.shape), scale=0.3) if m is not None else b.softmax(s, scale=0.3)
        b.output("y", b.matmul(p, b.input("v", v.shape)))

    inputs = {"q": q, "k": k, "v": v, **({"m": m} if m is not None else {})}
    b = GraphBuilder()
    build(b)
    graph = b.build()
    want = evaluate(graph, inputs)[0]["y"]
    [f] = fuse(graph, lambda n, chain: True)
    assert f.op == "attention" and [n.op for n in graph.nodes] == ["attention"]
    np.testing.assert_allclose(evaluate(graph, inputs)[0]["y"], want, rtol=1e-6, atol=1e-7)
    got, want, fusions = _run(build, inputs)
    assert fusions == []
    np.testing.assert_allclose(got, want, **TOL)


def _leaky_graph(alpha: float, beta: float, read_elsewhere: str | None):
    """scale(x, alpha) + scale(relu(x), beta), the ONNX importer's LeakyRelu when beta = 1 - alpha;
    `read_elsewhere` names a step that a second output also reads (so it must stay)."""
    b = GraphBuilder()
    x = b.input("x", (3, 50))
    r = b.relu(x)
    pos, neg = b.scale(r, scale=beta), b.scale(x, scale=alpha)
    b.output("y", b.add(neg, pos))
    if read_elsewhere:
        b.output("z", b.neg({"relu": r, "pos": pos, "neg": neg}[read_elsewhere]))
    return b.build()


@needs_native
@pytest.mark.parametrize("alpha", [0.1, 0.01, 0.2])
def test_leaky_relu_chain_fuses_to_its_reference(alpha):
    """The importer's LeakyRelu (four ops) becomes one leaky_relu node on the native CPU executor,
    x > 0 ? x : alpha*x, within the conformance suite's ARITH tolerance of the unfused graph (a
    positive x comes back exact where the chain rounds alpha*x + (1 - alpha)*x)."""
    x = np.random.default_rng(7).uniform(-3, 3, (3, 50)).astype(np.float32)

    def build(b, shapes=None):
        t = b.input("x", x.shape)
        b.output("y", b.add(b.scale(t, scale=alpha), b.scale(b.relu(t), scale=1.0 - alpha)))

    got, want, fusions = _run(build, {"x": x})
    assert len(fusions) == 1 and fusions[0].startswith("leaky_relu")
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    graph = _leaky_graph(alpha, 1.0 - alpha, None)
    [f] = fuse(graph, lambda n, chain: True)
    assert [n.op for n in graph.nodes] == ["leaky_relu"] and graph.nodes[0].params == {"alpha": alpha}
    assert len(f.replaced) == 4


@pytest.mark.parametrize("alpha,beta,shared", [(0.1, 0.8, None), (0.1, 0.9, "relu"), (0.1, 0.9, "pos"),
                                               (0.1, 0.9, "neg")])
def test_leaky_relu_lookalikes_are_not_fused(alpha, beta, shared):
    """Slopes that do not sum to 1 (not a LeakyRelu), or a step read elsewhere, keep the chain."""
    graph = _leaky_graph(alpha, beta, shared)
    assert fuse(graph, lambda n, chain: True) == []
    assert "leaky_relu" not in [n.op for n in graph.nodes]
