"""CUDA kernels for ggml's block-quantized weights (quant.cuh, dequant.cu, matmul_q.cu).

Checked on the `emulated` device (the real CudaDevice over the host stand-in driver, the
kernel sources compiled as C++) and, where there is one, on a GPU (`gpu`). The reference is
the registry's: `gguf.quants` (llama.cpp's own Python code) dequantizes, NumPy multiplies in
float64. Tolerances:
- dequantize, get_rows: bit for bit (compared as uint32), on blocks of random bytes whose
  scales span the whole finite float16 range (subnormals, negatives), so that a rounding
  in another order or an FMA contraction would show.
- products of the float kernels (the tiled ones, and the matrix-vector ones under the
  `naive` tuning): rtol 1e-4, atol 1e-4 with outputs of order 1..10 and K up to 1280 — they
  dequantize exactly and accumulate in float32, so only the summation order differs from
  the reference, as for the float matmul kernels (conformance ACCUM).
- products of the default matrix-vector kernels (`flare_mvq8_*`: x rounded to 8 bits per
  32 values, integer dot products, as ggml's mmvq): the same 1e-4 against the reference
  evaluated on x rounded as the kernel rounds it (`eight_bit`: the product is linear in x, so
  this isolates the kernel's arithmetic), and against the unrounded reference the hard bound
  of that rounding, sum_l |w_l| * d_l / 2 (test_eight_bit_error_is_the_rounding_of_x). The
  conformance suite holds them to QUANT_DOT.
The conformance suite runs the same ops on `cuda-emu` and through the stand-in libcuda
(tests/test_cuda_conformance_emulated.py, tests/test_cuda_fake_driver.py).
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

pytest.importorskip("cuda.bindings", reason="cuda-bindings is not installed (pip install flare-runtime[cuda])")
pytest.importorskip("gguf", reason="the reference dequantization is gguf.quants")

from flare.core.backend import SplitProgram  # noqa: E402
from flare.core.dtypes import QUANT_TYPES, to_numpy  # noqa: E402
from flare.core.graph import GraphBuilder  # noqa: E402
from flare.core.ledger import LEDGER  # noqa: E402
from flare.core.reference import evaluate  # noqa: E402
import flare.plugins.testing.conformance.cases  # noqa: E402,F401  (first: quant_cases imported alone is circular)
from flare.plugins.testing.conformance.quant_cases import quant_blocks  # noqa: E402

from flare.backends.cuda import lowering  # noqa: E402
from flare.backends.cuda_emu.devices import KINDS, bind_graph, device_for_test  # noqa: E402

TYPES = tuple(QUANT_TYPES)  # q4_0, q4_1, q8_0, q4_k, q6_k
PRODUCT_TOL = (1e-4, 1e-4)


@pytest.fixture(scope="module", params=KINDS)
def device(request):
    dev = device_for_test(request, request.param)
    yield dev
    dev.close()
    assert not any({**dev.live_objects(), **dev.cache_objects()}.values()), dev.live_objects()


def hostile_blocks(rng: np.random.Generator, dtype: str, *shape: int) -> np.ndarray:
    """Blocks of random bytes whose float16 fields (d, m, dmin) are random finite values of any
    magnitude and sign, subnormals included (no inf/NaN: their payloads are not a contract)."""
    t = QUANT_TYPES[dtype]
    n = int(np.prod(shape))
    blocks = rng.integers(0, 256, size=(n, t.block_bytes), dtype=np.uint8).view(t.numpy).reshape(n)
    for field in ("d", "m", "dmin"):
        if field in t.numpy.names:
            bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # exponent all ones (inf/NaN) -> a finite value
            blocks[field] = bits.view(np.float16)
    return blocks.reshape(shape)


def run(dev, graph, inputs, tuning=None, kernels=None):
    """Every storage tensor in its own buffer, the whole graph as one split; the outputs,
    with the kernels launched added to `kernels`. Checks that nothing is left allocated."""
    before = LEDGER.snapshot().count(dev.name)
    bufs, bindings = bind_graph(dev, graph)
    try:
        for name, arr in inputs.items():
            dev.write(bindings[graph.inputs[name].id], arr)
        split = dev.compile(SplitProgram(dev, graph.nodes, bindings, tuning or {}))
        if kernels is not None:
            kernels.update(launch.kernel for launch in split.plan)
        split.run()
        outs = {name: dev.read(bindings[t.id]) for name, t in graph.outputs.items()}
        split.release()
        return outs
    finally:
        for buf in bufs.values():
            buf.release()
        assert LEDGER.snapshot().count(dev.name) == before


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def eight_bit(x: np.ndarray) -> np.ndarray:
    """x as matmul_q.cu's 8-bit kernels see it: per 32 values along the last axis, the scale
    d = max|x| / 127 and q = roundf(x / d) (halves away from zero), in float32; back as q * d."""
    xs = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    d = np.abs(xs).max(-1, keepdims=True) / np.float32(127)
    r = xs / np.where(d > 0, d, np.float32(1))
    q = np.where(d > 0, np.sign(r) * np.floor(np.abs(r) + np.float32(0.5)), np.float32(0))
    return (q.astype(np.float64) * d).reshape(x.shape)


# a row length that crosses matmul_q.cu's 1024-weight staging chunk mid-row: 40 blocks of 32,
# or 5 super-blocks of 256
K = 1280


# ---- exact: dequantize and get_rows ------------------------------------------------------------

@pytest.mark.parametrize("dtype", TYPES)
def test_dequantize_is_bit_exact(device, dtype):
    rng = np.random.default_rng(1)
    b = GraphBuilder()
    b.output("rank3", b.dequantize(b.weight("w3", hostile_blocks(rng, dtype, 2, 3, 5))))
    b.output("rank1", b.dequantize(b.weight("w1", hostile_blocks(rng, dtype, 3))))
    graph = b.build()
    want, _ = evaluate(graph, {})
    got = run(device, graph, {})
    for name in want:
        assert got[name].shape == want[name].shape
        np.testing.assert_array_equal(_bits(got[name]), _bits(want[name]), err_msg=f"{dtype} {name}")


@pytest.mark.parametrize("dtype", TYPES)
def test_get_rows_of_a_quantized_table_is_bit_exact(device, dtype):
    """Only the selected rows are unpacked: any index dtype, rank-1..3 indices, negative ones
    counting from the end, repeated rows."""
    rng = np.random.default_rng(2)
    b = GraphBuilder()
    table = b.weight("table", hostile_blocks(rng, dtype, 11, 2))
    idx3 = np.array([[[0, 10, -1], [3, 3, -11]]], np.int64)
    idx1 = np.array([7, 0, 7], np.int32)
    b.output("i64", b.get_rows(table, b.input("idx3", idx3.shape, "i64")))
    b.output("i32", b.get_rows(table, b.input("idx1", idx1.shape, "i32")))
    graph = b.build()
    inputs = {"idx3": idx3, "idx1": idx1}
    want, _ = evaluate(graph, inputs)
    used: set[str] = set()
    got = run(device, graph, inputs, kernels=used)
    assert used == {"flare_get_rows_q"}
    for name in want:
        np.testing.assert_array_equal(_bits(got[name]), _bits(want[name]), err_msg=f"{dtype} {name}")


def test_quantized_weights_at_offsets_that_are_not_whole_blocks(device):
    """A slot aligned for floats (an arena, an expert cache) is rarely a whole number of 18-,
    34- or 210-byte blocks from the buffer's start: the kernels still read the right blocks.
    An odd byte offset (the blocks' float16 fields would be misaligned) is refused."""
    from flare.core.backend import Binding

    rng = np.random.default_rng(7)
    blocks = quant_blocks(rng, "q6_k", 3, 512)
    x = _f32(rng, 2, 512)
    b = GraphBuilder()
    w = b.weight("w", blocks)
    b.output("deq", b.dequantize(w))
    b.output("y", b.matmul(b.input("x", x.shape), w, transpose_b=True))
    graph = b.build()
    want = evaluate(graph, {"x": eight_bit(x).astype(np.float32)})[0]
    dev = device
    buffers, bindings = bind_graph(dev, graph)
    slot = dev.alloc(256 + blocks.nbytes, "slot")
    try:
        bindings[w.id] = Binding(slot, 256, w.shape, w.strides, w.dtype)  # 256 = 1 block + 46 bytes
        dev.write(bindings[w.id], blocks)
        dev.write(bindings[graph.inputs["x"].id], x)
        split = dev.compile(SplitProgram(dev, graph.nodes, bindings, {}))
        split.run()
        got = {name: dev.read(bindings[t.id]) for name, t in graph.outputs.items()}
        split.release()
        np.testing.assert_array_equal(_bits(got["deq"]), _bits(want["deq"]))
        np.testing.assert_allclose(got["y"], want["y"], *PRODUCT_TOL)
        bindings[w.id] = Binding(slot, 255, w.shape, w.strides, w.dtype)
        with pytest.raises(ValueError, match="odd"):
            dev.compile(SplitProgram(dev, graph.nodes, bindings, {}))
    finally:
        slot.release()
        for buf in buffers.values():
            buf.release()


def test_dequantize_kernels_round_every_operation_once():
    """ggml's dequantization is a product and a sum (or difference) rounded separately; an FMA
    contraction (one rounding) gives other bits on a GPU, which the emulator, computing on the
    host, would not show. The PTX of dequant.cu must hold no fma, only rounded mul/add/sub."""
    from flare.backends.cuda.compiler import CompilerUnavailable, default_compiler, kernel_sources

    try:
        ptx = default_compiler().compile(kernel_sources()["dequant"], 90, "ptx").image.decode()
    except CompilerUnavailable as exc:
        pytest.skip(str(exc))
    assert "fma" not in ptx
    assert re.search(r"\bmul\.rn\.f32\b", ptx) and re.search(r"\b(add|sub)\.rn\.f32\b", ptx)


# ---- products: matmul / linear / mul_mat_id ----------------------------------------------------

def _f32(rng, *shape):
    return rng.uniform(-2.0, 2.0, shape).astype(np.float32)


@pytest.mark.parametrize("variant", [None, "naive", "t32", "t64", "t128"])
@pytest.mark.parametrize("dtype", TYPES)
def test_quantized_matmul(device, dtype, variant):
    """Decode rows (matrix-vector kernels: one row, four rows, one of them all zeros), a prefill
    block (tiled kernel: odd M and N across tile edges), batches broadcast over a 2-D weight, K
    crossing a staging chunk mid-row; each variant's kernels for this type are the ones launched."""
    rng = np.random.default_rng(3)
    k = K
    b = GraphBuilder()
    w = b.weight("w", quant_blocks(rng, dtype, 70, k))
    inputs = {"one": _f32(rng, 1, k), "four": _f32(rng, 4, k), "many": _f32(rng, 37, k),
              "batch": _f32(rng, 2, 3, 5, k)}
    inputs["four"][2] = 0.0  # an all-zero row: scale 0 in the 8-bit path, outputs exactly 0
    for name, arr in inputs.items():
        b.output(name, b.matmul(b.input(name, arr.shape), w, transpose_b=True))
    graph = b.build()
    want, _ = evaluate(graph, inputs)
    if variant is None:  # the decode rows take the 8-bit kernel
        want.update(evaluate(graph, {**inputs, **{n: eight_bit(inputs[n]).astype(np.float32) for n in ("one", "four")}})[0])
    used: set[str] = set()
    got = run(device, graph, inputs, tuning={"matmul": variant} if variant else None, kernels=used)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], *PRODUCT_TOL, err_msg=f"{dtype} {name}")
    assert not got["four"][2].any()
    if variant is None:
        assert used == {f"flare_mvq8_{dtype}", f"flare_mmq_s_{dtype}"}, used
    elif variant == "naive":
        assert used == {f"flare_mvq_{dtype}", f"flare_mmq_s_{dtype}"}, used
    else:
        assert used == {f"flare_mmq_{lowering.MM_TILES[variant]}_{dtype}"}, used


@pytest.mark.parametrize("dtype", TYPES)
def test_eight_bit_error_is_the_rounding_of_x(device, dtype):
    """Against the unrounded reference the 8-bit kernel's error is bounded by what rounding x
    can cost, sum_l |w_l| * d_l / 2 (d_l: the scale of x_l's block of 32), plus float slack,
    and is not zero (the activations really are rounded)."""
    from flare.core.ops.quant import dequantize_reference

    rng = np.random.default_rng(6)
    k = K
    blocks = quant_blocks(rng, dtype, 21, k)
    x = _f32(rng, 3, k)
    b = GraphBuilder()
    b.output("y", b.matmul(b.input("x", x.shape), b.weight("w", blocks), transpose_b=True))
    used: set[str] = set()
    got = run(device, b.build(), {"x": x}, kernels=used)["y"].astype(np.float64)
    assert used == {f"flare_mvq8_{dtype}"}
    wf = dequantize_reference(blocks, dtype).astype(np.float64)
    half_step = np.repeat(np.abs(x.reshape(3, -1, 32)).max(-1) / 127 / 2, 32, axis=-1)
    bound = half_step @ np.abs(wf).T + 1e-4 * (1 + np.abs(x.astype(np.float64)) @ np.abs(wf).T)
    err = np.abs(got - x.astype(np.float64) @ wf.T)
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 1e-4


@pytest.mark.parametrize("dtype", ("q4_1", "q6_k"))
def test_fused_linear_with_quantized_weights(device, dtype):
    """act(x @ w.T + bias) + residual (the fused `linear`) on both quantized kernels."""
    from flare.core.fusion import fuse

    rng = np.random.default_rng(4)
    k = 512
    b = GraphBuilder()
    w = b.weight("w", quant_blocks(rng, dtype, 45, k))
    bias = b.weight("bias", _f32(rng, 45))
    inputs = {"dec": _f32(rng, 2, k), "pre": _f32(rng, 19, k), "res": _f32(rng, 19, 45)}
    b.output("dec", b.gelu(b.add(b.matmul(b.input("dec", (2, k)), w, transpose_b=True), bias)))
    pre = b.matmul(b.input("pre", (19, k)), w, transpose_b=True)
    b.output("pre", b.add(b.input("res", (19, 45)), b.relu(b.add(pre, bias))))
    graph = b.build()
    want = {"dec": evaluate(graph, {**inputs, "dec": eight_bit(inputs["dec"]).astype(np.float32)})[0]["dec"],
            "pre": evaluate(graph, inputs)[0]["pre"]}  # decode rows: the 8-bit kernel
    done = fuse(graph, lambda node, chain: device.supports(node))
    assert [f.op for f in done] == ["linear", "linear"], done
    used: set[str] = set()
    got = run(device, graph, inputs, kernels=used)
    assert used == {f"flare_mvq8_{dtype}", f"flare_mmq_s_{dtype}"}, used
    for name in want:
        np.testing.assert_allclose(got[name], want[name], *PRODUCT_TOL, err_msg=f"{dtype} {name}")


@pytest.mark.parametrize("variant", [None, "naive"])
@pytest.mark.parametrize("dtype", TYPES)
def test_quantized_mul_mat_id(device, dtype, variant):
    """Quantized experts [E, N, nb] picked per (token, slot), x shared by the slots or one per
    slot, N not a multiple of the 16 outputs of a block, K crossing a staging chunk; 8-bit
    activations by default, float ones under `naive`."""
    rng = np.random.default_rng(5)
    k, e, n, t = K, 5, 19, 3
    ids = np.array([[4, 0], [2, 2], [1, 4]], np.int32)
    b = GraphBuilder()
    w = b.weight("w", quant_blocks(rng, dtype, e * n, k).reshape(e, n, -1))
    inputs = {"x2": _f32(rng, t, k), "x3": _f32(rng, t, 2, k), "ids": ids}
    idt = b.input("ids", ids.shape, "i32")
    b.output("shared", b.mul_mat_id(w, b.input("x2", (t, k)), idt))
    b.output("per_slot", b.mul_mat_id(w, b.input("x3", (t, 2, k)), idt))
    graph = b.build()
    seen = inputs if variant else {**inputs, "x2": eight_bit(inputs["x2"]).astype(np.float32),
                                   "x3": eight_bit(inputs["x3"]).astype(np.float32)}
    want, _ = evaluate(graph, seen)
    used: set[str] = set()
    got = run(device, graph, inputs, tuning={"mul_mat_id": variant} if variant else None, kernels=used)
    assert used == {f"flare_mvq{'' if variant else '8'}_id_{dtype}"}, used
    for name in want:
        np.testing.assert_allclose(got[name], want[name], *PRODUCT_TOL, err_msg=f"{dtype} {name}")


# ---- launch shapes and limits (pure lowering: no device) ------------------------------------------

def _binding(shape, dtype="f32"):
    from types import SimpleNamespace

    strides, acc = [], 1
    for d in reversed(shape):
        strides.insert(0, acc)
        acc *= d
    return SimpleNamespace(shape=tuple(shape), strides=tuple(strides), dtype=dtype, offset=0,
                           buffer=SimpleNamespace(handle=4096), itemsize=to_numpy(dtype).itemsize)


def _plan(node, *tensors, tuning=None):
    shapes = {t.id: _binding(t.shape, t.dtype) for t in tensors}
    return lowering.lower(node, lambda t: shapes[t.id], tuning)


def test_quantized_launch_shapes():
    b = GraphBuilder()
    w = b.input("w", (576, 18), "q4_1")          # a SmolLM2 projection: 576 x 576 weights
    x1, x4, x5, xl = (b.input(f"x{m}", (m, 576)) for m in (1, 4, 5, 512))
    for x, kernel, grid in ((x1, "flare_mvq8_q4_1", (36, 1, 1)), (x4, "flare_mvq8_q4_1", (36, 1, 1)),
                            (x5, "flare_mmq_s_q4_1", (18, 1, 1)), (xl, "flare_mmq_l_q4_1", (5, 4, 1))):
        node = b.matmul(x, w, transpose_b=True)
        assert lowering.supported(node)
        (launch,) = _plan(node, x, w, node)
        assert (launch.kernel, launch.grid, launch.block) == (kernel, grid, (256, 1, 1))
        assert launch.args.t[1].dtype == 5 and tuple(launch.args.t[1].shape[2:]) == (576, 18)  # blocks, as stored
    node = b.matmul(x1, w, transpose_b=True)
    (launch,) = _plan(node, x1, w, node, tuning={"matmul": "naive"})  # float products
    assert launch.kernel == "flare_mvq_q4_1"
    (launch,) = _plan(node, x1, w, node, tuning={"matmul": "t64"})
    assert (launch.kernel, launch.grid) == ("flare_mmq_m_q4_1", (9, 1, 1))
    table, idx = b.input("table", (49152, 18), "q8_0"), b.input("idx", (7,), "i32")
    rows = b.get_rows(table, idx)
    (launch,) = _plan(rows, table, idx, rows)
    assert (launch.kernel, launch.n, launch.grid) == ("flare_get_rows_q", 7 * 576, (16, 1, 1))
    deq = b.dequantize(b.input("wk", (3, 2), "q6_k"))
    (launch,) = _plan(deq, deq.srcs[0], deq)
    assert (launch.kernel, launch.n) == ("flare_dequantize", 3 * 512)


def test_quantized_grid_limits():
    """Batches past grid z (or row tiles past grid y) have no quantized kernel: declined, so the
    node runs elsewhere; mul_mat_id's (token, slot) pairs continue from grid y into z."""
    b = GraphBuilder()
    w = b.input("w", (8, 1), "q4_0")
    assert lowering.supported(b.matmul(b.input("ok", (65535, 1, 32)), w, transpose_b=True))
    assert not lowering.supported(b.matmul(b.input("xb", (65536, 1, 32)), w, transpose_b=True))
    assert not lowering.supported(b.matmul(b.input("xm", (32 * 65535 + 1, 32)), w, transpose_b=True))
    we, x, ids = b.input("we", (4, 8, 1), "q4_0"), b.input("x", (70000, 32)), b.input("ids", (70000, 2), "i32")
    node = b.mul_mat_id(we, x, ids)
    assert lowering.supported(node)
    (launch,) = _plan(node, we, x, ids, node)
    assert launch.kernel == "flare_mvq8_id_q4_0" and launch.grid == (1, 65535, 3) and launch.n == 140000


# ---- NVRTC: every quantized kernel for the architectures NVRTC supports ---------------------------

def _compile_everywhere(archs):
    from flare.backends.cuda.compiler import CompilerUnavailable, default_compiler, kernel_sources

    sources = kernel_sources()
    try:
        compiler = default_compiler()
        compiler.version
    except CompilerUnavailable as exc:
        pytest.skip(str(exc))
    for arch in archs:
        for name in ("dequant", "matmul_q"):
            src = sources[name]
            assert len(src.kernels()) == {"dequant": 2, "matmul_q": 35}[name]
            ptx = compiler.compile(src, arch, "ptx")
            cubin = compiler.compile(src, arch, "cubin")
            assert ptx.ptx_target == f"sm_{arch}" and cubin.image.startswith(b"\x7fELF")
            for kernel in src.kernels():
                assert f".entry {kernel}(".encode() in ptx.image and kernel.encode() in cubin.image, (arch, kernel)


def test_quantized_kernels_compile_for_the_oldest_and_newest_arch():
    """sm_80 and sm_90 are compiled by test_cuda_compiler.py; here the ends of NVRTC's range
    (matmul_q.cu takes ~25 s per image here: every arch is FLARE_CUDA_ALL_ARCHS=1)."""
    from flare.backends.cuda.compiler import CompilerUnavailable, supported_archs

    try:
        archs = supported_archs()
    except CompilerUnavailable as exc:
        pytest.skip(str(exc))
    _compile_everywhere(sorted({min(archs), max(archs)}))


@pytest.mark.skipif(not os.environ.get("FLARE_CUDA_ALL_ARCHS"), reason="every arch takes minutes: FLARE_CUDA_ALL_ARCHS=1")
def test_quantized_kernels_compile_for_every_arch():
    from flare.backends.cuda.compiler import supported_archs

    _compile_everywhere(supported_archs())
