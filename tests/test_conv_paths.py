"""The fast paths of 1-D convolutions, against the NumPy references (float64 inside).

- the native `conv1d` command at sizes that take several column blocks (each block's im2col
  rows and GEMM; kernels.c / native/conv1d.h), on 1 and 2 threads, batch > 1, stride 1 (a
  memcpy per row) and 2 (a gather), padding and dilation: the conformance cases are too small
  to leave the one-block path;
- conv2d over H = 1 (how imported graphs run Conv1d) on that command, asymmetric pads;
- the tiled kernels per ISA and the Winograd path (conv1d_wino.h), with the fused residual;
- the importer's strided 1-D ConvTranspose as one convolution per output phase, against
  onnx's reference evaluator (pads, output_padding, bias, kernels shorter and longer than the
  stride).

Tolerance: rtol/atol 1e-4 (ACCUM, as the conformance suite): f32 sums of up to ~100 products
of O(1) terms against a float64 reference.
"""
from __future__ import annotations

import numpy as np
import pytest

from flare.backends.cpu import native
from flare.core.ops import OPS
from flare.core.session import Session

TOL = dict(rtol=1e-4, atol=1e-4)
needs_native = pytest.mark.skipif(native.load() is None, reason=f"native executor unavailable: {native.REASON}")


def _run(op: str, x: np.ndarray, w: np.ndarray, params: dict, threads: int = 1):
    def entry(b, shapes):
        b.output("y", b.op(op, b.input("x", x.shape), b.weight("w", w), **params))

    with Session(["cpu"], config={"cpu": {"threads": threads}}) as sess:
        pg = sess.prepare({"full": entry}, {"full": {"x": x.shape}})
        got = pg.execute("full", x=x)["y"].copy()
        splits = [p.describe() for p in pg.current_plan("full").programs if p is not None]
        pg.release()
    assert not [n for d in splits for n in d.get("numpy_nodes", [])], "ran on NumPy instead of C"
    full = {**OPS[op].defaults, **params}
    return got, OPS[op].reference([x, w], full)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("stride", [1, 2])
def test_conv1d_many_column_blocks(threads, stride):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 180_000 * stride // 2)).astype(np.float32)  # ck * Lout > 4 blocks' worth
    w = (rng.standard_normal((3, 4, 3)) / 3).astype(np.float32)
    got, want = _run("conv1d", x, w, dict(stride=stride, padding=2, dilation=2), threads)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOL)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k,stride,padding,dilation,length", [
    (3, 1, 1, 1, 4), (3, 2, 1, 1, 4), (3, 1, 2, 1, 3), (3, 1, 0, 1, 9), (3, 2, 3, 1, 2),   # K 3: conv1d_im2col3
    (3, 1, 2, 2, 6), (5, 1, 2, 1, 7), (256, 128, 0, 1, 640)])                              # per tap / one copy
def test_conv1d_row_layout(threads, k, stride, padding, dilation, length):
    """Short outputs (Lout <= 64) take conv1d.h's row layout: im2col rows per output position
    (K 3 with dilation 1 in conv1d_im2col3, taps off either end of x included; a window wholly
    inside x at unit steps as one copy, silero-vad's STFT), one product, then the transpose out.
    Many batch rows, so the phases split on 2 threads."""
    rng = np.random.default_rng(k * 100 + length)
    cin = 1 if k == 256 else 7
    x = rng.standard_normal((300, cin, length)).astype(np.float32)
    w = (rng.standard_normal((5, cin, k)) / 3).astype(np.float32)
    got, want = _run("conv1d", x, w, dict(stride=stride, padding=padding, dilation=dilation), threads)
    assert got.shape == want.shape and got.shape[2] <= 64
    np.testing.assert_allclose(got, want, **TOL)


@needs_native
def test_row_layout_conv_weight_is_packed_and_thread_count_exact():
    """A constant conv weight in the row layout (more than 16 rows) is packed once as [Cout, Cin*K]
    panels (lowering.conv_prepackable) and its product is pgemm's FMA chains, so 1 and 3 threads
    give the same bits (through the BLAS row blocks they could differ in the last bits); an input
    weight keeps the BLAS product."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((64, 7, 4)).astype(np.float32)
    w = (rng.standard_normal((40, 7, 3)) / 3).astype(np.float32)
    got = {}
    for threads in (1, 3):
        def entry(b, shapes):
            xi = b.input("x", x.shape)
            b.output("packed", b.conv1d(xi, b.weight("w", w), padding=1))
            b.output("blas", b.conv1d(xi, b.input("w_in", w.shape), padding=1))

        with Session(["cpu"], config={"cpu": {"threads": threads}}) as sess:
            pg = sess.prepare({"full": entry}, {"full": {"x": x.shape, "w_in": w.shape}})
            got[threads] = {k: v.copy() for k, v in pg.execute("full", x=x, w_in=w).items()}
            info = [p.describe() for p in pg.current_plan("full").programs if p is not None]
            assert sum(d.get("prepacked_weights", 0) for d in info) == 1
            pg.release()
    want = OPS["conv1d"].reference([x, w], {**OPS["conv1d"].defaults, "padding": 1})
    for name in ("packed", "blas"):
        np.testing.assert_allclose(got[1][name], want, **TOL)
    np.testing.assert_array_equal(got[3]["packed"], got[1]["packed"])


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_pointwise_conv1d_reads_x_in_place(threads):
    """K 1, stride 1, no padding, over many column blocks: the product reads x's rows in place
    (conv1d.h's direct case, no im2col scratch)."""
    from flare.backends.cpu.lowering import conv1d_direct, conv1d_scratch

    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 8, 40_000)).astype(np.float32)   # ck * Lout = 320k: several blocks
    w = (rng.standard_normal((5, 8, 1)) / 3).astype(np.float32)
    got, want = _run("conv1d", x, w, dict(stride=1, padding=0, dilation=1), threads)
    np.testing.assert_allclose(got, want, **TOL)
    assert conv1d_direct(1, 1, 0, 40_000, 40_000, 40_000, 1) and conv1d_scratch(2, 8, 1, 40_000, 5, 1) == 0
    # not in place: a window, a stride, padding, an output longer than x, overlapping or strided rows,
    # short outputs (the row layout)
    for args in [(3, 1, 0, 99, 99, 99, 1), (1, 2, 0, 99, 50, 99, 1), (1, 1, 1, 99, 101, 99, 1),
                 (1, 1, 0, 99, 100, 99, 1), (1, 1, 0, 99, 99, 50, 1), (1, 1, 0, 99, 99, 198, 2),
                 (1, 1, 0, 64, 64, 64, 1)]:
        assert not conv1d_direct(*args), args


@needs_native
@pytest.mark.parametrize("right_pad", [0, 3])
def test_pointwise_conv2d_over_one_row_with_bias(right_pad):
    """conv2d over H = 1 with K 1 and a bias: in place without right padding; with it (the output
    longer than x) through the im2col rows, which read zeros past x's end."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 6, 1, 300)).astype(np.float32)
    w = (rng.standard_normal((4, 6, 1, 1)) / 3).astype(np.float32)
    bias = rng.standard_normal(4).astype(np.float32)
    params = dict(strides=[1, 1], dilations=[1, 1], pads=[[0, 0], [0, right_pad]])

    def entry(b, shapes):
        b.output("y", b.op("conv2d", b.input("x", x.shape), b.weight("w", w), b.weight("b", bias), **params))

    with Session(["cpu"]) as sess:
        pg = sess.prepare({"full": entry}, {"full": {"x": x.shape}})
        got = pg.execute("full", x=x)["y"].copy()
        assert not [n for p in pg.current_plan("full").programs if p is not None
                    for n in p.describe().get("numpy_nodes", [])]
        pg.release()
    want = OPS["conv2d"].reference([x, w, bias], {**OPS["conv2d"].defaults, **params})
    assert got.shape == want.shape == (1, 4, 1, 300 + right_pad)
    np.testing.assert_allclose(got, want, **TOL)


@needs_native
def test_conv2d_over_one_row_runs_native():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 6, 1, 41)).astype(np.float32)
    w = (rng.standard_normal((5, 6, 1, 7)) / 4).astype(np.float32)
    got, want = _run("conv2d", x, w, dict(strides=[1, 3], dilations=[1, 2], pads=[[0, 0], [5, 1]]))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("k,stride,pads,out_pad,bias", [
    (16, 8, (4, 4), 0, True),     # Piper's decoder: kernel 2 x stride
    (5, 2, (0, 0), 1, False),     # output_padding past the full output: zeros
    (4, 3, (2, 1), 2, True),      # kernel not a multiple of the stride, asymmetric pads
    (2, 4, (0, 0), 0, False),     # kernel shorter than the stride: phases with no taps
])
def test_strided_conv_transpose_1d_equals_onnx(tmp_path, monkeypatch, k, stride, pads, out_pad, bias):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    from flare.models.onnx.loader import load_model
    from flare.models.onnx.runner import OnnxRunner, Tracer

    ops: list[str] = []
    traced_op = Tracer.op

    def spy(self, op, *srcs, **params):
        ops.append(op)
        return traced_op(self, op, *srcs, **params)

    monkeypatch.setattr(Tracer, "op", spy)

    rng = np.random.default_rng(k * 10 + stride)
    x = rng.standard_normal((2, 3, 9)).astype(np.float32)
    w = rng.standard_normal((3, 2, k)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "W")]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(2).astype(np.float32), "B"))
    node = helper.make_node("ConvTranspose", ["x", "W"] + (["B"] if bias else []), ["y"], strides=[stride],
                            pads=list(pads), output_padding=[out_pad])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "c", "l"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    model.ir_version = 8
    path = tmp_path / "convt.onnx"
    onnx.save(model, str(path))
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    with Session(["cpu"]) as sess:
        runner = OnnxRunner(load_model(str(path)), sess)
        try:
            got = runner.run({"x": x})["y"]
        finally:
            runner.release()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOL)
    assert ops.count("conv2d") == 1 and "pad" not in ops  # one convolution, no zero upsampling


TILED_CASES = [  # (cin, cout, k, padding, dilation, length, bias): conv1d.h's tiled kernel's corners
    (32, 32, 7, 9, 3, 5000, True),     # Piper's resblock: padded, dilated, many units
    (5, 7, 3, 1, 1, 333, False),       # channels not a multiple of the 4-row tile; a partial last tile
    (200, 9, 3, 1, 1, 130, True),      # input channels in several chunks (the x window), partial tiles
    (3, 6, 5, 40, 1, 70, True),        # padding wider than a whole tile: taps wholly outside x
    (4, 5, 11, 2, 5, 130, False),      # reach (50) past both ends of one partial tile (84 columns)
    (6, 4, 1, 0, 1, 1000, True),       # pointwise
    (2, 3, 40, 20, 1, 300, True),      # more taps than the mask table (CT_KMAX): im2col + GEMM
    (24, 40, 3, 1, 1, 48, True),       # Lout 48: the row layout's size, tiled from CT_ROWS_MIN columns
]


@needs_native
@pytest.mark.parametrize("case", TILED_CASES, ids=lambda c: "x".join(map(str, c[:6])) + ("b" if c[6] else ""))
def test_conv1d_tiled_kernel_and_im2col_path(case):
    """Stride-1 convolutions past the row layout (and its outputs of 32-64 columns): the tiled
    kernels (register tiles read x's rows in place, masked loads where taps leave x), AVX-512 and
    AVX2 + FMA where the CPU has them, and the im2col + GEMM (or row layout) path they replace
    (flare_conv1d_isa), each against the float64 reference, with a bias (conv2d over H = 1, as
    imported graphs run Conv1d); the tiled kernels and 2 threads give the same bits."""
    cin, cout, k, padding, dilation, length, with_bias = case
    rng = np.random.default_rng(cin * 1000 + k)
    x = rng.standard_normal((2, cin, 1, length)).astype(np.float32)
    w = (rng.standard_normal((cout, cin, 1, k)) / np.sqrt(cin * k)).astype(np.float32)
    bias = rng.standard_normal(cout).astype(np.float32)
    params = dict(strides=[1, 1], dilations=[1, dilation], pads=[[0, 0], [padding, padding]])
    srcs = [x, w, bias] if with_bias else [x, w]
    want = OPS["conv2d"].reference(srcs, {**OPS["conv2d"].defaults, **params})
    lib = native.load().lib
    results = {}
    try:
        for isa, threads in ((0, 1), (1, 1), (1, 2), (2, 1), (2, 2)):
            if lib.flare_conv1d_isa(isa) != isa:
                continue

            def entry(b, shapes):
                args = [b.input("x", x.shape), b.weight("w", w)] + ([b.weight("b", bias)] if with_bias else [])
                b.output("y", b.op("conv2d", *args, **params))

            with Session(["cpu"], config={"cpu": {"threads": threads}}) as sess:
                pg = sess.prepare({"full": entry}, {"full": {"x": x.shape}})
                results[isa, threads] = pg.execute("full", x=x)["y"].copy()
                assert not [n for p in pg.current_plan("full").programs if p is not None
                            for n in p.describe().get("numpy_nodes", [])], "ran on NumPy instead of C"
                pg.release()
    finally:
        lib.flare_conv1d_isa(-1)
    assert results and want.shape[3] >= 32
    for got in results.values():
        np.testing.assert_allclose(got, want, **TOL)
    # each output is one FMA chain in (ci, k) order, whichever thread or tiled kernel ran it
    tiled = [results[k] for k in ((1, 1), (1, 2), (2, 1), (2, 2)) if k in results]
    for got in tiled[1:]:
        np.testing.assert_array_equal(got, tiled[0])


@needs_native
@pytest.mark.parametrize("case", [(200, 9, 3, 1, 1, 130), (32, 32, 7, 9, 3, 700), (3, 6, 5, 40, 1, 70), (24, 40, 3, 1, 1, 48)],
                         ids=lambda c: "x".join(map(str, c)))
def test_conv_add_on_every_conv1d_path(case):
    """The fused conv_add (a one-row conv2d, its reshape, + residual): the conv1d command starts
    from the residual on each path (tiled per ISA, im2col + GEMM, the row layout), input channels
    in several chunks included; against the float64 reference, 2 threads giving 1 thread's bits."""
    cin, cout, k, padding, dilation, length = case
    rng = np.random.default_rng(cin + k)
    x = rng.standard_normal((2, cin, 1, length)).astype(np.float32)
    w = (rng.standard_normal((cout, cin, 1, k)) / np.sqrt(cin * k)).astype(np.float32)
    bias = rng.standard_normal(cout).astype(np.float32)
    params = dict(dilations=[1, dilation], pads=[[0, 0], [padding, padding]])
    conv = OPS["conv2d"].reference([x, w, bias], {**OPS["conv2d"].defaults, **params})
    res = rng.standard_normal((2, cout, conv.shape[3])).astype(np.float32)
    want = conv.reshape(res.shape).astype(np.float64) + res

    def entry(b, shapes):
        y = b.op("conv2d", b.input("x", x.shape), b.weight("w", w), b.weight("b", bias), **params)
        b.output("y", b.add(b.reshape(y, shape=res.shape), b.input("r", res.shape)))

    lib = native.load().lib
    results = {}
    try:
        for isa, threads in ((0, 1), (1, 1), (2, 1), (2, 2)):
            if lib.flare_conv1d_isa(isa) != isa:
                continue
            with Session(["cpu"], config={"cpu": {"threads": threads}}) as sess:
                pg = sess.prepare({"full": entry}, {"full": {"x": x.shape, "r": res.shape}})
                assert [f for f in pg.describe()["entries"]["full"]["fusions"] if f.startswith("conv_add")]
                results[isa, threads] = pg.execute("full", x=x, r=res)["y"].copy()
                pg.release()
    finally:
        lib.flare_conv1d_isa(-1)
    for got in results.values():
        np.testing.assert_allclose(got, want, **TOL)
    if (2, 2) in results:
        np.testing.assert_array_equal(results[2, 2], results[2, 1])


@pytest.mark.parametrize("h,k,stride,dilation,pads", [
    (1, (1, 3), (1, 1), (1, 1), ((0, 0), (1, 1))),     # Piper's duration predictor (dilations 1/3/9)
    (1, (1, 3), (1, 1), (1, 9), ((0, 0), (9, 9))),
    (1, (1, 3), (1, 2), (1, 3), ((0, 0), (0, 7))),     # strided, padding on one side only
    (6, (3, 2), (2, 1), (2, 3), ((2, 1), (4, 0))),     # 2-D windows
    (1, (1, 5), (1, 1), (1, 4), ((0, 0), (20, 20))),   # taps wholly outside x for some outputs
])
def test_depthwise_conv2d_numpy_kernel(h, k, stride, dilation, pads):
    """Depthwise conv2d (one channel per group) in the CPU's NumPy kernel: a multiply-add per tap
    over the outputs whose tap lands inside x (no padded copy), against the float64 reference.
    The conformance suite has one such case; these cover strides, 2-D windows, wide padding."""
    from flare.backends.cpu import kernels_spatial  # noqa: F401  (registers conv2d)
    from flare.backends.cpu.kernels import KERNELS
    from flare.core.ops.spatial import conv2d_ref, out_size

    rng = np.random.default_rng(h * 10 + k[1])
    x = rng.standard_normal((2, 5, h, 17)).astype(np.float32)
    w = rng.standard_normal((5, 1, *k)).astype(np.float32)
    bias = rng.standard_normal(5).astype(np.float32)
    p = dict(pads=[list(pads[0]), list(pads[1])], strides=list(stride), dilations=list(dilation), groups=5)
    shape = (2, 5, out_size(h, k[0], stride[0], dilation[0], *pads[0]),
             out_size(17, k[1], stride[1], dilation[1], *pads[1]))
    got = np.full(shape, np.nan, np.float32)
    KERNELS["conv2d"](got, [x, w, bias], p)
    np.testing.assert_allclose(got, conv2d_ref([x, w, bias], p), **TOL)


WINOGRAD_CASES = [  # (cin, cout, k, padding, dilation, length, bias, residual): conv1d_wino.h's corners
    (32, 32, 7, 9, 3, 700, True, False),      # Piper's resblock: padded, dilated; several blocks
    (32, 32, 7, 36, 12, 1001, True, True),    # dilation 12 (12 phases a block); the fused residual
    (64, 48, 5, 2, 1, 130, False, False),     # the shortest output taken; Cout not a multiple of 32
    (16, 32, 3, 1, 1, 333, True, True),       # a partial last block (positions past Lout not stored)
    (64, 128, 2, 1, 1, 257, True, False),     # K 2 (the importer's ConvTranspose phases)
    (16, 16, 5, 40, 1, 200, True, False),     # padding wider than a tile: whole tiles outside x
]


@needs_native
@pytest.mark.parametrize("case", WINOGRAD_CASES, ids=lambda c: "x".join(map(str, c[:6])) + ("b" if c[6] else "")
                         + ("r" if c[7] else ""))
def test_conv1d_winograd_path(case, monkeypatch):
    """The Winograd F(4, K) path (K 2, 3, 5, 7; conv1d_wino.h, a transformed constant weight),
    against the float64 reference, with a bias and the fused residual (conv_add); 2 threads give 1
    thread's bits; FLARE_CPU_WINOGRAD=0 runs the same graph on the direct kernels. Tolerance as the
    file's: Winograd's float32 error is a few times the direct sum's (winograd.py), ~1e-6 here."""
    cin, cout, k, padding, dilation, length, with_bias, residual = case
    lib = native.load().lib
    if not lib.flare_conv1d_wino():
        pytest.skip("no AVX2 + FMA: the Winograd path needs a vector kernel")
    rng = np.random.default_rng(cin + k + length)
    x = rng.standard_normal((2, cin, 1, length)).astype(np.float32)
    w = (rng.standard_normal((cout, cin, 1, k)) / np.sqrt(cin * k)).astype(np.float32)
    bias = rng.standard_normal(cout).astype(np.float32)
    params = dict(dilations=[1, dilation], pads=[[0, 0], [padding, padding]])
    want = OPS["conv2d"].reference([x, w, bias] if with_bias else [x, w], {**OPS["conv2d"].defaults, **params})
    lout = want.shape[3]
    res = rng.standard_normal((2, cout, lout)).astype(np.float32)
    if residual:
        want = want.reshape(res.shape).astype(np.float64) + res

    def entry(b, shapes):
        args = [b.input("x", x.shape), b.weight("w", w)] + ([b.weight("b", bias)] if with_bias else [])
        y = b.op("conv2d", *args, **params)
        b.output("y", b.add(b.reshape(y, shape=res.shape), b.input("r", res.shape)) if residual else y)

    def run(threads):
        with Session(["cpu"], config={"cpu": {"threads": threads}}) as sess:
            shapes = {"x": x.shape, "r": res.shape} if residual else {"x": x.shape}
            pg = sess.prepare({"full": entry}, {"full": shapes})
            got = pg.execute("full", **({"x": x, "r": res} if residual else {"x": x}))["y"].copy()
            info = [p.describe() for p in pg.current_plan("full").programs if p is not None]
            pg.release()
        return got, sum(d.get("winograd_convs", 0) for d in info)

    one, taken = run(1)
    assert taken == 1
    np.testing.assert_allclose(one, want, **TOL)
    two, _ = run(2)
    np.testing.assert_array_equal(two, one)
    monkeypatch.setenv("FLARE_CPU_WINOGRAD", "0")
    direct, taken = run(1)
    assert taken == 0
    np.testing.assert_allclose(direct, want, **TOL)


@needs_native
def test_winograd_tables_match_their_construction():
    """The AT and BT tables compiled into conv1d.h are winograd.py's exact matrices (each entry a
    dyadic rational, so float32 holds it exactly), and those satisfy Winograd's identity: AT[(G g)
    * (BT d)] is the correlation of d with g, for random d and g, in float64."""
    from flare.backends.cpu.native import winograd

    lib, ffi = native.load().lib, native.load().ffi
    for k in winograd.TAPS:
        at, g, bt = (np.array(m, dtype=np.float64) for m in winograd.matrices(k))
        a = winograd.alpha(k)
        buf = ffi.new("float[]", winograd.M * a + a * a)
        assert lib.flare_conv1d_wino_tables(k, buf) == winograd.M * a + a * a
        got = np.frombuffer(ffi.buffer(buf), dtype=np.float32).astype(np.float64)
        np.testing.assert_array_equal(got[: winograd.M * a].reshape(winograd.M, a), at)
        np.testing.assert_array_equal(got[winograd.M * a:].reshape(a, a), bt)
        rng = np.random.default_rng(k)
        for _ in range(5):
            d, taps = rng.standard_normal(a), rng.standard_normal(k)
            np.testing.assert_allclose(at @ ((g @ taps) * (bt @ d)), np.correlate(d, taps, "valid"), atol=1e-12)
    assert lib.flare_conv1d_wino_tables(4, ffi.new("float[]", 100)) == 0


@needs_native
def test_winograd_needs_a_vector_kernel():
    """With the tiled kernels turned off (flare_conv1d_isa(0): im2col + GEMM), no command is
    compiled for the Winograd path; a plan compiled for it before still runs it (its weight is the
    transformed one), with the best kernel the CPU has."""
    lib = native.load().lib
    if not lib.flare_conv1d_wino():
        pytest.skip("no AVX2 + FMA: the Winograd path needs a vector kernel")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 32, 1, 300)).astype(np.float32)
    w = (rng.standard_normal((32, 32, 1, 3)) / 10).astype(np.float32)
    params = dict(pads=[[0, 0], [1, 1]])
    want = OPS["conv2d"].reference([x, w], {**OPS["conv2d"].defaults, **params})

    def entry(b, shapes):
        b.output("y", b.op("conv2d", b.input("x", x.shape), b.weight("w", w), **params))

    def taken(pg):
        return sum(p.describe().get("winograd_convs", 0) for p in pg.current_plan("full").programs if p is not None)

    try:
        with Session(["cpu"]) as sess:
            before = sess.prepare({"full": entry}, {"full": {"x": x.shape}})
            assert taken(before) == 1
            lib.flare_conv1d_isa(0)
            assert not lib.flare_conv1d_wino()
            np.testing.assert_allclose(before.execute("full", x=x)["y"], want, **TOL)
            after = sess.prepare({"full": entry}, {"full": {"x": x.shape}})
            assert taken(after) == 0
            np.testing.assert_allclose(after.execute("full", x=x)["y"], want, **TOL)
            before.release()
            after.release()
    finally:
        lib.flare_conv1d_isa(-1)
