"""Every CUDA kernel and its lowering, checked against the NumPy references.

Two devices: `gpu` (skipped with the probe's reason where there is none) and
`emulated`, the real CudaDevice over a host stand-in driver with the kernel
sources compiled as C++ (flare.backends.cuda_emu.emulator). The emulated run uses
exactly the launch plans a GPU captures and replays, so kernel logic, argument
layout, strides/broadcast and dtypes are checked on any machine; the GPU run
adds the real driver and the GPU's arithmetic.
"""
from __future__ import annotations

import re
from typing import Callable

import numpy as np
import pytest

from flare.core.backend import Binding, SplitProgram
from flare.core.dtypes import itemsize, to_numpy
from flare.core.graph import GraphBuilder
from flare.core.ledger import LEDGER

from flare.backends.cuda import lowering
from flare.backends.cuda.compiler import kernel_sources
from flare.backends.cuda_emu.devices import KINDS, bind_graph, device_for_test, open_device


@pytest.fixture(scope="module", params=KINDS)
def device(request):
    dev = device_for_test(request, request.param)
    yield dev
    dev.close()
    assert not any({**dev.live_objects(), **dev.cache_objects()}.values()), dev.live_objects()


def run_graph(dev, graph, inputs, state=None, tuning=None, kernels=None):
    """Bind every storage tensor to its own buffer, run the whole graph as one split
    (with `tuning`; the kernels launched are added to the set `kernels`)."""
    before = LEDGER.snapshot().count(dev.name)
    bufs, bindings = bind_graph(dev, graph)
    try:
        for name, arr in inputs.items():
            dev.write(bindings[graph.inputs[name].id], arr)
        for name, t in graph.states.items():
            init = (state or {}).get(name)
            dev.write(bindings[t.id], np.zeros(t.shape, to_numpy(t.dtype)) if init is None else init)
        split = dev.compile(SplitProgram(dev, graph.nodes, bindings, tuning or {}))
        if kernels is not None:
            kernels.update(launch.kernel for launch in split.plan)
        split.run()
        outs = {name: dev.read(bindings[t.id]) for name, t in graph.outputs.items()}
        states = {name: dev.read(bindings[t.id]) for name, t in graph.states.items()}
        split.release()
        return outs, states
    finally:
        for buf in bufs.values():
            buf.release()
        assert LEDGER.snapshot().count(dev.name) == before


def check(dev, graph, inputs, state=None, rtol=2e-5, atol=2e-5, tuning=None, kernels=None):
    from flare.core.reference import evaluate

    want_out, want_state = evaluate(graph, inputs, state)
    got_out, got_state = run_graph(dev, graph, inputs, state, tuning, kernels)
    for name in want_out:
        _same(name, got_out[name], want_out[name], rtol, atol)
    for name in want_state:
        _same(name, got_state[name], want_state[name], rtol, atol)


def _same(name, got, want, rtol, atol):
    assert got.shape == want.shape, name
    assert got.dtype == want.dtype, name
    if np.issubdtype(got.dtype, np.integer):
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        tol = max(rtol, 1e-3) if got.dtype == np.float16 else rtol
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=atol, err_msg=name)


RNG = np.random.default_rng(1234)


def f32(*shape, lo=-2.0, hi=2.0):
    return RNG.uniform(lo, hi, shape).astype(np.float32)


# Each case builds a graph and returns its inputs (and optional initial state).
Case = Callable[[GraphBuilder], tuple]
CASES: dict[str, Case] = {}


def case(name):
    def deco(fn):
        CASES[name] = fn
        return fn
    return deco


for _op in ("relu", "gelu", "silu", "sigmoid", "tanh", "exp", "sqrt", "neg", "sqr"):
    def _unary(b, op=_op):
        x = b.input("x", (3, 4, 5))
        src = b.permute(x, axes=(2, 0, 1))  # a strided view as input
        b.output("y", b.op(op, src))
        return {"x": f32(3, 4, 5, lo=0.01 if op == "sqrt" else -3.0, hi=3.0)}
    case(f"unary-{_op}")(_unary)


@case("scale")
def _scale(b):
    b.output("y", b.scale(b.input("x", (7,)), scale=-1.5, bias=0.25))
    return {"x": f32(7)}


@case("leaky_relu")
def _leaky_relu(b):
    src = b.permute(b.input("x", (3, 4, 5)), axes=(2, 0, 1))  # the fused op over a strided view
    b.output("y", b.op("leaky_relu", src, alpha=0.1))
    return {"x": f32(3, 4, 5, lo=-3.0, hi=3.0)}


for _op in ("add", "sub", "mul", "div"):
    def _binary(b, op=_op):
        x, y = b.input("x", (2, 3, 4)), b.input("y", (3, 1))
        b.output("full", b.op(op, x, y))
        b.output("both", b.op(op, b.input("r", (1, 4)), b.input("c", (3, 1))))
        return {"x": f32(2, 3, 4), "y": f32(3, 1, lo=0.5, hi=2.0), "r": f32(1, 4), "c": f32(3, 1, lo=0.5, hi=2.0)}
    case(f"binary-{_op}")(_binary)


@case("matmul")
def _matmul(b):
    b.output("plain", b.matmul(b.input("a", (2, 3, 4)), b.weight("w", f32(4, 5))))
    b.output("bcast", b.matmul(b.input("p", (2, 1, 3, 4)), b.input("q", (5, 4, 6))))
    wt = b.weight("wt", f32(6, 4).astype(np.float16))
    b.output("tb16", b.matmul(b.transpose(b.input("s", (4, 3))), wt, transpose_b=True))
    return {"a": f32(2, 3, 4), "p": f32(2, 1, 3, 4), "q": f32(5, 4, 6), "s": f32(4, 3)}


@case("norms")
def _norms(b):
    x = b.permute(b.input("x", (6, 2, 3)), axes=(1, 2, 0))
    b.output("ln", b.layer_norm(x))
    b.output("rms", b.rms_norm(x, eps=1e-5))
    return {"x": f32(6, 2, 3)}


@case("softmax")
def _softmax(b):
    x = b.input("x", (2, 3, 5))
    b.output("plain", b.softmax(x))
    b.output("masked", b.softmax(x, b.input("m", (3, 5)), scale=0.7))
    b.output("bcast", b.softmax(x, b.input("mr", (1, 5))))
    m = np.triu(np.full((3, 5), -np.inf, np.float32), 1)
    return {"x": f32(2, 3, 5), "m": m, "mr": f32(1, 5)}


@case("get_rows")
def _get_rows(b):
    b.output("f32", b.get_rows(b.weight("t", f32(5, 3)), b.input("i", (2, 2), "i32")))
    b.output("f16", b.get_rows(b.weight("h", f32(5, 3).astype(np.float16)), b.input("j", (4,), "i64")))
    return {"i": np.array([[0, 4], [2, 2]], np.int32), "j": np.array([1, 0, 4, 3], np.int64)}


@case("rope")
def _rope(b):
    x, pos = b.input("x", (4, 2, 8)), b.input("pos", (4,), "i32")
    b.output("neox", b.rope(x, pos))
    b.output("pairs", b.rope(x, pos, neox=False, base=500.0))
    return {"x": f32(4, 2, 8), "pos": np.array([0, 1, 17, 3001], np.int32)}


@case("conv1d")
def _conv1d(b):
    x = b.input("x", (2, 3, 11))
    b.output("y", b.conv1d(x, b.weight("w", f32(4, 3, 3)), stride=2, padding=1, dilation=2))
    b.output("h", b.conv1d(x, b.weight("wh", f32(2, 3, 1).astype(np.float16))))
    return {"x": f32(2, 3, 11)}


@case("pad")
def _pad(b):
    x = b.input("x", (2, 3, 4))
    b.output("const", b.pad(x, pads=((0, 1), (2, 0), (1, 3)), value=-1.0))
    b.output("reflect", b.pad(x, pads=((1, 1), (2, 2), (3, 3)), mode="reflect"))
    return {"x": f32(2, 3, 4)}


@case("concat")
def _concat(b):
    b.output("f", b.concat(b.input("a", (2, 3)), b.input("b", (2, 5)), axis=-1))
    b.output("i", b.concat(b.input("c", (1, 2), "i32"), b.input("d", (3, 2), "i32"), axis=0))
    return {"a": f32(2, 3), "b": f32(2, 5), "c": np.array([[1, 2]], np.int32),
            "d": np.arange(6, dtype=np.int32).reshape(3, 2)}


@case("views")
def _views(b):
    x = b.input("x", (4, 6))
    v = b.slice(b.transpose(x), axis=0, start=1, stop=6, step=2)   # [3, 4], strided
    r = b.reshape(b.input("y", (2, 3, 4)), shape=(6, 4))
    b.output("v", b.contiguous(v))
    b.output("r", b.add(r, b.permute(b.reshape(x, shape=(6, 4)), axes=(0, 1))))
    return {"x": f32(4, 6), "y": f32(2, 3, 4)}


@case("reductions")
def _reductions(b):
    x = b.input("x", (3, 4, 5))
    for op in ("sum", "mean", "max"):
        b.output(op, b.op(op, x, axis=1))
        b.output(op + "-keep", b.op(op, b.transpose(x), axis=-1, keepdims=True))
    b.output("argmax", b.argmax(b.input("t", (2, 5))))
    b.output("argmax0", b.argmax(x, axis=0))
    return {"x": f32(3, 4, 5), "t": np.array([[1, 3, 3, 0, 3], [-1, -1, -2, -1, -5]], np.float32)}


@case("top_k")
def _top_k(b):
    b.output("k", b.top_k(b.input("x", (3, 6)), k=4))
    b.output("strided", b.top_k(b.transpose(b.input("y", (5, 2))), k=2))
    x = np.array([[1, 5, 5, 2, 5, 0], [0, 0, 0, 0, 0, 0], [-1, 3, 2, 9, 8, 9]], np.float32)
    return {"x": x, "y": f32(5, 2)}


@case("gather")
def _gather(b):
    b.output("g", b.gather(b.input("x", (2, 3, 5)), b.input("i", (2, 3, 2), "i32")))
    return {"x": f32(2, 3, 5), "i": RNG.integers(0, 5, (2, 3, 2)).astype(np.int32)}


@case("mul_mat_id")
def _mul_mat_id(b):
    w = b.weight("w", f32(4, 3, 5))
    w16 = b.weight("w16", f32(4, 3, 5).astype(np.float16))
    ids = b.input("ids", (2, 2), "i32")
    b.output("x2", b.mul_mat_id(w, b.input("x", (2, 5)), ids))
    b.output("x3", b.mul_mat_id(w16, b.input("x3", (2, 2, 5)), ids))
    return {"ids": np.array([[3, 0], [1, 1]], np.int32), "x": f32(2, 5), "x3": f32(2, 2, 5)}


@case("set_rows")
def _set_rows(b):
    cache = b.state("kv", (5, 3), "f16")
    acc = b.state("acc", (5, 3))
    idx = b.input("idx", (2,), "i32")
    src = b.input("src", (2, 3))
    w1 = b.set_rows(cache, idx, src)
    w2 = b.set_rows(acc, idx, src)
    b.output("after", b.add(b.cast(w1, dtype="f32"), w2))
    return {"idx": np.array([4, 1], np.int32), "src": f32(2, 3)}, {"acc": f32(5, 3)}


@case("copy_into")
def _copy_into(b):
    st = b.state("s", (2, 6), "f16")
    w = b.copy_into(st, b.transpose(b.input("x", (2, 2))), offset=5)
    b.output("s", b.cast(w, dtype="f32"))
    return {"x": f32(2, 2)}, {"s": f32(2, 6).astype(np.float16)}


@case("cast")
def _cast(b):
    x = b.input("x", (2, 5))
    b.output("i32", b.cast(x, dtype="i32"))
    b.output("f16", b.cast(x, dtype="f16"))
    b.output("i64", b.cast(x, dtype="i64"))
    i = b.input("i", (3,), "i64")
    b.output("back", b.cast(i, dtype="f32"))
    b.output("narrow", b.cast(i, dtype="i32"))
    b.output("h2f", b.cast(b.cast(x, dtype="f16"), dtype="f32"))
    return {"x": np.array([[-2.7, -0.5, 0.0, 0.5, 2.7], [1e3, -1e3, 3.3, 65504, -7.9]], np.float32),
            "i": np.array([-3, 0, 1 << 20], np.int64)}


def _lstm_graph(b, steps, batch, hidden):
    """lstm with every operand a strided view (x [B, T, 4H] permuted, W_hh and h0 stored
    transposed, c0 a column slice): the conformance cases use contiguous W_hh, h0, c0."""
    x = b.permute(b.input("x", (batch, steps, 4 * hidden)), axes=(1, 0, 2))
    w = b.transpose(b.input("wt", (hidden, 4 * hidden)))
    h0 = b.transpose(b.input("h0t", (hidden, batch)))
    c0 = b.slice(b.input("c0w", (batch, hidden + 3)), axis=1, start=2, stop=hidden + 2)
    b.output("out", b.lstm(x, w, h0, c0))


@pytest.mark.parametrize("steps,batch,hidden", [(7, 3, 40), (2, 2, 70)])
def test_lstm_strided_operands_and_saturated_gates(device, steps, batch, hidden):
    """lstm.cu with strided W_hh/h0/c0, several units per warp (H > 8 warps), and inputs
    whose pre-activations reach +-60: sigmoid and tanh must saturate to exact 0/1/+-1,
    never NaN (expf overflows to inf there)."""
    b = GraphBuilder()
    _lstm_graph(b, steps, batch, hidden)
    x = f32(batch, steps, 4 * hidden)
    x[:, ::2] *= 30.0  # every other step saturates most gates
    inputs = {"x": x, "wt": f32(hidden, 4 * hidden, lo=-1.0, hi=1.0) / np.float32(np.sqrt(hidden)),
              "h0t": f32(hidden, batch, lo=-1.0, hi=1.0), "c0w": f32(batch, hidden + 3, lo=-1.0, hi=1.0)}
    kernels: set[str] = set()
    check(device, b.build(), inputs, rtol=1e-4, atol=1e-5, kernels=kernels)
    assert kernels == {"flare_lstm"}


def _fake_binding(shape, dtype="f32"):
    """A contiguous binding at a made-up address: enough for lowering (no device, no memory)."""
    from types import SimpleNamespace

    strides, acc = [], 1
    for d in reversed(shape):
        strides.insert(0, acc)
        acc *= d
    return SimpleNamespace(shape=tuple(shape), strides=tuple(strides), dtype=dtype, offset=0,
                           buffer=SimpleNamespace(handle=4096), itemsize=4)


def test_lstm_launch_shape_and_limits():
    """One launch (one block per batch row, one warp per unit up to 8 warps); hidden sizes
    past lstm.cu's shared rows are declined, not failed at run time."""
    for hidden, threads in ((5, 160), (2048, 256)):
        b = GraphBuilder()
        _lstm_graph(b, 3, 4, hidden)
        graph = b.build()
        node = graph.outputs["out"]
        assert lowering.supported(node)
        plan = lowering.lower_all(graph.nodes, lambda t: _fake_binding(t.shape))
        assert [(p.kernel, p.grid, p.block) for p in plan] == [("flare_lstm", (4, 1, 1), (threads, 1, 1))]
    b = GraphBuilder()
    _lstm_graph(b, 3, 4, lowering.LSTM_MAX_HIDDEN + 1)
    assert not lowering.supported(b.build().outputs["out"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_match_reference(device, name):
    b = GraphBuilder()
    got = CASES[name](b)
    inputs, state = got if isinstance(got, tuple) else (got, None)
    check(device, b.build(), inputs, state)


def test_every_registered_op_has_a_kernel_or_is_a_view():
    from flare.core.ops import OPS
    from flare.plugins.testing.conformance.cases_extra import importer_ops

    # the ONNX importer's ops run on the CPU (supported() refuses them) so far
    missing = sorted(op for op in OPS if op != "host" and not OPS[op].fused and op not in lowering.LOWERINGS
                     and op not in importer_ops())
    assert not missing, f"ops without a CUDA lowering: {missing}"


def test_cases_cover_every_lowered_op():
    import inspect
    from pathlib import Path

    # (the block-quantized ops, e.g. dequantize, are checked in test_cuda_quant.py)
    text = inspect.getsource(__import__(__name__)) + (Path(__file__).parent / "test_cuda_quant.py").read_text()
    uncovered = [op for op in lowering.LOWERINGS if not re.search(rf"\b{op}\b", text)]
    assert not uncovered, uncovered


def test_op_codes_match_the_kernel_enums():
    sources = kernel_sources()
    def enum(text, first):
        body = re.search(rf"enum \{{\s*({first}[^}}]*)\}}", text).group(1)
        return [name.split("=")[0].strip() for name in body.split(",")]
    unary = enum(sources["elementwise"].text, "U_RELU")
    assert [f"U_{op.upper()}" for op in lowering.UNARY_CODES] == unary
    assert [lowering.UNARY_CODES[op] for op in lowering.UNARY_CODES] == list(range(len(unary)))
    binary = enum(sources["elementwise"].text, "B_ADD")
    assert [f"B_{op.upper()}" for op in lowering.BINARY_CODES] == binary
    reduce_ = enum(sources["reduce"].text, "R_SUM")
    assert [f"R_{op.upper()}" for op in lowering.REDUCE_CODES] == reduce_


def test_rebind_points_the_plan_at_new_buffers(device):
    b = GraphBuilder()
    y = b.output("y", b.relu(b.input("x", (4,))))
    g = b.build()
    x = g.inputs["x"]
    bufs = [device.alloc(16, "a"), device.alloc(16, "b"), device.alloc(16, "c"), device.alloc(16, "d")]
    try:
        def prog(xb, yb):
            return SplitProgram(device, g.nodes, {x.id: Binding(xb, 0, (4,), (1,), "f32"),
                                                  y.id: Binding(yb, 0, (4,), (1,), "f32")})
        split = device.compile(prog(bufs[0], bufs[1]))
        p1, p2 = prog(bufs[0], bufs[1]), prog(bufs[2], bufs[3])
        device.write(p2.binding(x), np.array([-1, 2, -3, 4], np.float32))
        device.write(p1.binding(y), np.full(4, 7.0, np.float32))  # fresh memory is not zeroed: mark it
        assert split.rebind(p2)  # addresses only: the exec graph is updated in place
        assert (split.updates, split.instantiations) == (1, 1)
        split.run()
        np.testing.assert_array_equal(device.read(p2.binding(y)), [0, 2, 0, 4])
        np.testing.assert_array_equal(device.read(p1.binding(y)), [7, 7, 7, 7])  # untouched
        split.release()
    finally:
        for buf in bufs:
            buf.release()


# ---- the GPU-shaped kernels: every variant, odd sizes, transposed and batched operands ----
# Sizes are not multiples of any tile (32/64/128) nor, where marked, of the float4 width,
# so every guard is exercised; K > 16 crosses several K slices of a tile. Tolerance:
# f32 sums of up to ~1100 products of O(1) values, reassociated: rtol/atol 1e-4
# (the conformance suite's ACCUM); f16 weights are exact in f32, same tolerance.

def _matmul_graph(b):
    """Every matmul layout the lowering tells apart, at odd sizes."""
    f = {}
    x = b.input("x", (37, 45))                                    # K = 45: scalar loads
    b.output("nt", b.matmul(x, b.weight("w_nt", f32(70, 45)), transpose_b=True))
    b.output("nn", b.matmul(x, b.weight("w_nn", f32(45, 70))))
    xv = b.input("xv", (33, 132))                                 # K % 4 == 0: float4 loads
    b.output("nt_vec", b.matmul(xv, b.weight("wv_nt", f32(68, 132)), transpose_b=True))
    b.output("nn_vec", b.matmul(xv, b.weight("wv_nn", f32(132, 68))))
    b.output("nt_f16", b.matmul(xv, b.weight("wh_nt", f32(29, 132).astype(np.float16)), transpose_b=True))
    b.output("nn_f16", b.matmul(x, b.weight("wh_nn", f32(45, 29).astype(np.float16))))
    xt = b.input("xt", (45, 37))                                  # a read through a transposed view
    b.output("strided", b.matmul(b.transpose(xt), b.weight("w_st", f32(70, 45)), transpose_b=True))
    p, q = b.input("p", (3, 1, 19, 24)), b.input("q", (2, 24, 35))  # batched, broadcast batch axes
    b.output("batched", b.matmul(p, q))
    b.output("batched_tb", b.matmul(p, b.input("r", (2, 35, 24)), transpose_b=True))
    for m in (1, 3):                                              # few rows: the matrix-vector kernel
        xm = b.input(f"m{m}", (2, m, 132))
        b.output(f"mv{m}", b.matmul(xm, b.weight(f"wm{m}", f32(77, 132)), transpose_b=True))
        b.output(f"mv{m}_f16", b.matmul(xm, b.weight(f"wmh{m}", f32(21, 132).astype(np.float16)),
                                        transpose_b=True))
    b.output("mv_odd", b.matmul(b.input("m0", (1, 45)), b.weight("wm0", f32(70, 45)), transpose_b=True))
    b.output("mv_long", b.matmul(b.input("ml", (4, 1100)), b.weight("wml", f32(20, 1100)), transpose_b=True))
    for name, shape in (("x", (37, 45)), ("xv", (33, 132)), ("xt", (45, 37)), ("p", (3, 1, 19, 24)),
                        ("q", (2, 24, 35)), ("r", (2, 35, 24)), ("m1", (2, 1, 132)), ("m3", (2, 3, 132)),
                        ("m0", (1, 45)), ("ml", (4, 1100))):
        f[name] = f32(*shape)
    return f


@pytest.mark.parametrize("variant", [None, "t32", "t64", "t128", "naive"])
def test_matmul_variants_match_reference(device, variant):
    b = GraphBuilder()
    inputs = _matmul_graph(b)
    used: set[str] = set()
    tuning = {"matmul": variant} if variant else None
    check(device, b.build(), inputs, rtol=1e-4, atol=1e-4, tuning=tuning, kernels=used)
    if variant is None:  # the default plan uses every specialized kernel
        assert {"flare_mv_mm", "flare_mv_mm_h", "flare_mm_s_st"} <= used, used
        assert {"nt", "nn", "nt_h", "nn_h"} <= {k.split("_", 3)[3] for k in used if k.startswith("flare_mm_")}, used
    elif variant == "naive":
        assert used == {"flare_matmul"}
    else:
        tile = lowering.MM_TILES[variant]
        assert {f"flare_mm_{tile}_{lay}" for lay in ("nt", "nn", "st", "nt_h", "nn_h")} == used, used


def test_mul_mat_id_long_rows(device):
    """K beyond one shared-memory chunk (MV_CHUNK = 1024), odd and float4 widths, f16 experts."""
    b = GraphBuilder()
    ids = b.input("ids", (3, 2), "i32")
    b.output("vec", b.mul_mat_id(b.weight("w", f32(5, 37, 1100)), b.input("x", (3, 1100)), ids))
    b.output("odd", b.mul_mat_id(b.weight("wo", f32(5, 19, 1027)), b.input("xo", (3, 2, 1027)), ids))
    b.output("f16", b.mul_mat_id(b.weight("wh", f32(5, 17, 64).astype(np.float16)), b.input("xh", (3, 64)), ids))
    inputs = {"ids": np.array([[4, 0], [2, 2], [3, 1]], np.int32), "x": f32(3, 1100), "xo": f32(3, 2, 1027),
              "xh": f32(3, 64)}
    used: set[str] = set()
    check(device, b.build(), inputs, rtol=1e-4, atol=1e-4, kernels=used)
    assert used == {"flare_mv_id", "flare_mv_id_h"}


def test_row_kernels_on_long_rows(device):
    """Rows longer than a block (several warps, several elements per thread), odd lengths."""
    b = GraphBuilder()
    x = b.input("x", (3, 1000))
    b.output("ln", b.layer_norm(x))
    b.output("rms", b.rms_norm(b.transpose(b.input("xt", (301, 2))), eps=1e-6))
    b.output("sm", b.softmax(x, b.input("m", (1, 1000)), scale=0.3))
    for op in ("sum", "mean", "max"):
        b.output(op, b.op(op, x, axis=-1))
        b.output(op + "0", b.op(op, x, axis=0))
    b.output("argmax", b.argmax(x))
    big = b.input("big", (2, 4100))  # longer than the shared-memory row cache (4096): re-read
    b.output("ln_big", b.layer_norm(big))
    b.output("sm_big", b.softmax(big, scale=2.0))
    row = f32(3, 1000)
    row[1, 777] = row[1, 5] = 9.0  # ties: the lower index wins
    inputs = {"x": row, "xt": f32(301, 2), "m": f32(1, 1000), "big": f32(2, 4100)}
    check(device, b.build(), inputs, rtol=1e-4, atol=1e-5)


def test_nan_handling_of_max_and_argmax(device):
    b = GraphBuilder()
    x = b.input("x", (2, 300))
    b.output("max", b.op("max", x, axis=-1))
    b.output("argmax", b.argmax(x))
    b.output("top_k", b.top_k(x, k=300))
    v = f32(2, 300)
    v[0, 250] = v[0, 40] = np.nan  # NumPy: max is NaN, argmax is the first NaN, top_k puts NaN last
    got, _ = run_graph(device, b.build(), {"x": v})
    np.testing.assert_array_equal(got["top_k"], np.argsort(-v, axis=-1, kind="stable").astype(np.int32))
    assert np.isnan(got["max"][0]) and not np.isnan(got["max"][1])
    np.testing.assert_array_equal(got["argmax"], np.argmax(v, axis=-1).astype(np.int32))


@pytest.mark.parametrize("n,k", [(3000, 5), (2048, 2048), (700, 64), (50, 1)])
def test_top_k_sorts_rows_in_pieces(device, n, k):
    """Rows longer than the 2048 pairs a block sorts at once go through in pieces; ties by index."""
    b = GraphBuilder()
    b.output("k", b.top_k(b.input("x", (2, n)), k=k))
    x = np.round(f32(2, n), 2)  # many ties
    used: set[str] = set()
    check(device, b.build(), {"x": x}, kernels=used)
    assert used == {"flare_top_k"}


def test_export_tuning_times_the_cuda_variants(monkeypatch):
    """The exporter's tuning (flare.plugins.export.tuning) times CUDA's kernel variants through a
    Session on cuda-emu and records a choice; every variant computes the same result."""
    from flare.core.plugin_manager import PluginManager
    from flare.plugins.export import tuning
    from flare.core.session import Session

    probe, why = open_device("emulated")
    if probe is None:
        pytest.skip(why)
    probe.close()
    monkeypatch.setenv("FLARE_CUDA_EMULATE", "1")
    with Session(["cuda-emu"], plugins=PluginManager()) as session:
        dev = session.devices[0]
        assert tuning.variants(dev, "matmul") == lowering.MM_VARIANTS
        b = GraphBuilder()
        b.output("y", b.matmul(b.input("x", (40, 24)), b.weight("w", f32(33, 24)), transpose_b=True))
        b.output("e", b.mul_mat_id(b.weight("we", f32(3, 9, 16)), b.input("v", (2, 16)), b.input("ids", (2, 2), "i32")))
        shapes = tuning.collect([(40, b.build())], dev)
        assert set(shapes) == {("matmul", 40), ("mul_mat_id", 40)}
        for (kernel, tokens), found in shapes.items():
            entry = tuning.measure(session, dev, kernel, tokens, found, "quick")
            assert set(entry.seconds) == set(dev.kernel_variants(kernel)) and entry.choice in entry.seconds


def test_matmul_plans_stay_within_grid_limits():
    """A GPU refuses grids over 65535 blocks in y or z: such matmuls take the 1-D kernel."""
    binding = _fake_binding
    b = GraphBuilder()
    x, w = b.input("x", (70000, 2, 8)), b.input("w", (70000, 8, 3))
    node = b.matmul(x, w)
    shapes = {x.id: binding((70000, 2, 8)), w.id: binding((70000, 8, 3)), node.id: binding((70000, 2, 3))}
    (launch,) = lowering.lower(node, lambda t: shapes[t.id])
    assert launch.kernel == "flare_matmul" and launch.grid[1] == launch.grid[2] == 1


@pytest.mark.parametrize("variant", [None, "t32", "t128", "naive"])
def test_conv1d_as_one_gemm(device, variant):
    """Odd channel counts and lengths, stride/dilation/padding, a strided input view, f16 weights,
    K = Cin*Kw a multiple of 4 (float4 weight rows) and not."""
    b = GraphBuilder()
    x = b.input("x", (3, 5, 37))
    b.output("odd", b.conv1d(x, b.weight("w", f32(70, 5, 3)), padding=1))
    b.output("vec", b.conv1d(x, b.weight("wv", f32(9, 5, 4)), stride=3, dilation=2, padding=3))
    b.output("f16", b.conv1d(x, b.weight("wh", f32(6, 5, 3).astype(np.float16)), stride=2))
    xt = b.permute(b.input("xt", (37, 2, 4)), axes=(1, 2, 0))  # [2, 4, 37], strided
    b.output("strided", b.conv1d(xt, b.weight("ws", f32(33, 4, 1))))
    used: set[str] = set()
    tuning = {"conv1d": variant} if variant else None
    check(device, b.build(), {"x": f32(3, 5, 37), "xt": f32(37, 2, 4)}, rtol=1e-4, atol=1e-4, tuning=tuning,
          kernels=used)
    if variant == "naive":
        assert used == {"flare_conv1d"}
    elif variant:
        assert used == {f"flare_conv_{lowering.MM_TILES[variant]}"}


def test_empty_matmuls_launch_nothing(device):
    b = GraphBuilder()
    b.output("y", b.matmul(b.input("x", (2, 8)), b.weight("w", f32(0, 8)), transpose_b=True))
    b.output("z", b.mul_mat_id(b.weight("e", f32(3, 0, 8)), b.input("v", (2, 8)), b.input("ids", (2, 1), "i32")))
    used: set[str] = set()
    check(device, b.build(), {"x": f32(2, 8), "v": f32(2, 8), "ids": np.array([[0], [2]], np.int32)}, kernels=used)
    assert not used

# ---- fused ops (flare.core.ops.fused): chains merged by the fusion pass, every kernel path of each ----

def _fused(b, ops):
    """The built graph with every chain fused (as prepare does where the device supports it)."""
    from flare.core.fusion import fuse

    graph = b.build()
    done = fuse(graph, lambda node, chain: True)
    assert sorted(f.op for f in done) == sorted(ops), done
    return graph


@pytest.mark.parametrize("variant", [None, "t64", "naive"])
def test_fused_linear_epilogues(device, variant):
    """act(a @ w + bias) + residual on the tiled, matrix-vector and generic kernels, odd sizes,
    batched, a strided residual view."""
    b = GraphBuilder()
    a = b.input("a", (2, 37, 45))
    w = b.weight("w", f32(70, 45))
    y = b.gelu(b.add(b.matmul(a, w, transpose_b=True), b.weight("bias", f32(70))))
    b.output("full", b.add(b.input("res", (2, 37, 70)), y))
    b.output("relu", b.relu(b.add(b.matmul(a, b.weight("wn", f32(45, 29))), b.weight("bn", f32(29)))))
    rt = b.transpose(b.input("rt", (70, 37)))  # residual through a transposed view
    b.output("res_only", b.add(b.matmul(b.input("a2", (37, 45)), w, transpose_b=True), rt))
    one = b.input("one", (1, 96))                 # one row: the matrix-vector kernel
    b.output("head", b.sigmoid(b.add(b.matmul(one, b.weight("wh", f32(3, 96)), transpose_b=True),
                                     b.weight("bh", f32(3)))))
    graph = _fused(b, ["linear"] * 4)
    inputs = {"a": f32(2, 37, 45), "res": f32(2, 37, 70), "rt": f32(70, 37), "a2": f32(37, 45), "one": f32(1, 96)}
    used: set[str] = set()
    check(device, graph, inputs, rtol=1e-4, atol=1e-4, tuning={"linear": variant} if variant else None,
          kernels=used)
    if variant is None:
        assert "flare_mv_mm" in used and any(k.startswith("flare_mm_") for k in used), used
    elif variant == "naive":
        assert used == {"flare_matmul"}


def test_fused_norm_affine(device):
    b = GraphBuilder()
    x = b.input("x", (3, 1000))
    b.output("layer", b.add(b.mul(b.layer_norm(x), b.weight("g", f32(1000))), b.weight("be", f32(1000))))
    b.output("rms", b.mul(b.rms_norm(b.transpose(b.input("xt", (24, 5))), eps=1e-6), b.weight("g2", f32(24))))
    graph = _fused(b, ["norm_affine"] * 2)
    check(device, graph, {"x": f32(3, 1000), "xt": f32(24, 5)}, rtol=1e-4, atol=1e-5)


def _attention_chain(b, q, k, v, mask=None, scale=1.0):
    s = b.matmul(q, k, transpose_b=True)
    return b.matmul(b.softmax(s, mask, scale=scale) if mask is not None else b.softmax(s, scale=scale), v)


def test_fused_attention(device):
    """Heads as batch, a broadcast mask, keys longer than a block, strided views of q/k/v."""
    b = GraphBuilder()
    q, k, v = b.input("q", (2, 3, 5, 8)), b.input("k", (2, 3, 300, 8)), b.input("v", (2, 3, 300, 6))
    b.output("masked", _attention_chain(b, q, k, v, b.input("m", (2, 1, 1, 300)), scale=0.35))
    heads = [b.permute(b.input(n, (7, 2, 16)), axes=(1, 0, 2)) for n in ("qh", "kh", "vh")]
    b.output("views", _attention_chain(b, *heads, scale=0.25))
    graph = _fused(b, ["attention"] * 2)
    m = np.where(RNG.random((2, 1, 1, 300)) < 0.3, -1e9, 0.0).astype(np.float32)
    inputs = {"q": f32(2, 3, 5, 8), "k": f32(2, 3, 300, 8), "v": f32(2, 3, 300, 6), "m": m,
              "qh": f32(7, 2, 16), "kh": f32(7, 2, 16), "vh": f32(7, 2, 16)}
    used: set[str] = set()
    check(device, graph, inputs, rtol=1e-4, atol=1e-5, kernels=used)
    assert used == {"flare_attention"}


def test_attention_beyond_the_shared_rows_is_left_unfused():
    from flare.core.fusion import fuse

    for keys, supported in ((5000, False), (4096, True)):
        b = GraphBuilder()
        b.output("y", _attention_chain(b, b.input("q", (2, 1, 8)), b.input("k", (2, keys, 8)),
                                       b.input("v", (2, keys, 4)), scale=0.5))
        seen = []
        fuse(b.build(), lambda node, chain: seen.append(lowering.supported(node)) or False)
        assert seen == [supported]
