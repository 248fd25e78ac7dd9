"""The native CPU executor's block-quantized kernels (native/quant.c) on every instruction set.

quant.c picks its dot products at run time (portable C, AVX2, AVX-512 VNNI); the
conformance suite only sees the best one this CPU has. Here every quantized case
runs under each ISA the CPU offers, against the gguf.quants reference (QUANT_DOT,
see quant_cases.py), and the integer-exact parts are checked directly: the
dequantization is bit for bit gguf's, and the ISAs agree to float rounding (their
integer sums are equal; only the order of the float accumulation differs).
"""
from __future__ import annotations

import numpy as np
import pytest

from flare.backends.cpu import native
from flare.core.dtypes import QUANT_TYPES
from flare.core.ops.quant import dequantize_reference
from flare.plugins.testing.conformance.cases import CASES, case_entry, case_expected
from flare.plugins.testing.conformance.quant_cases import quant_blocks
from flare.core.session import Session

NATIVE = native.load()
pytestmark = pytest.mark.skipif(NATIVE is None, reason=f"native CPU executor unavailable: {native.REASON}")
ISAS = {"plain C": 1, "AVX2": 2, "AVX-512 VNNI": 3}
# the decode- and prefill-shaped products (dequantize and get_rows take no ISA-specific code)
QUANT_CASE_IDS = [c for c in CASES if any(c.id in (f"matvec_{t}", f"matmul_{t}_tiles") for t in QUANT_TYPES)]


@pytest.fixture(params=list(ISAS), ids=list(ISAS))
def isa(request):
    want = ISAS[request.param]
    if NATIVE.lib.flare_quant_isa(want) != want:
        NATIVE.lib.flare_quant_isa(0)
        pytest.skip(f"this CPU lacks {request.param}")
    yield want
    NATIVE.lib.flare_quant_isa(0)


@pytest.mark.parametrize("activations", ["integer", "float"])
@pytest.mark.parametrize("case", QUANT_CASE_IDS, ids=[c.id for c in QUANT_CASE_IDS])
def test_quantized_case_on_each_isa(isa, case, activations, monkeypatch):
    """Both activation paths (integer dots, the default; float), forced for every shape."""
    monkeypatch.setenv("FLARE_CPU_QUANT_ACTIVATIONS", activations)
    inputs, want = case_expected(case)
    with Session(["cpu"]) as sess:
        pg = sess.prepare({"full": case_entry(case)}, {"full": {k: v.shape for k, v in inputs.items()}})
        got = pg.execute("full", **inputs)["out"]
        splits = [p.describe() for p in pg.current_plan("full").programs if p is not None]
        pg.release()
    assert not [n for d in splits for n in d["numpy_nodes"]], "the quantized node fell back to NumPy"
    np.testing.assert_allclose(got, want, rtol=case.tol[0], atol=case.tol[1])


def _qmatmul(dtype: str, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    ffi, lib = NATIVE.ffi, NATIVE.lib
    t = QUANT_TYPES[dtype]
    k = w.shape[1] * t.block_size
    rb = lib.flare_qact_row_bytes(t.ggml_type, k)
    xq = np.zeros((x.shape[0], rb), np.uint8)
    for j in range(x.shape[0]):
        lib.flare_qact_quantize_row(t.ggml_type, ffi.cast("float *", x[j].ctypes.data), ffi.from_buffer(xq[j]), k)
    y = np.zeros((x.shape[0], w.shape[0]), np.float32)
    lib.flare_qmatmul_rows(t.ggml_type, ffi.from_buffer(w), w.strides[0], k, ffi.from_buffer(xq), rb, x.shape[0],
                           ffi.cast("float *", y.ctypes.data), w.shape[0], 0, w.shape[0])
    return y


@pytest.mark.parametrize("dtype", list(QUANT_TYPES))
def test_isas_agree_and_dequantization_is_exact(dtype):
    t = QUANT_TYPES[dtype]
    rng = np.random.default_rng(7)
    w = quant_blocks(rng, dtype, 11, 4 * t.block_size)
    x = rng.uniform(-2, 2, (3, 4 * t.block_size)).astype(np.float32)
    results = {}
    for name, want in ISAS.items():
        if NATIVE.lib.flare_quant_isa(want) == want:
            results[name] = _qmatmul(dtype, w, x)
    NATIVE.lib.flare_quant_isa(0)
    first = next(iter(results.values()))
    for name, y in results.items():
        np.testing.assert_allclose(y, first, rtol=1e-5, atol=1e-5, err_msg=f"{name} differs from plain C")
    rows = np.empty((w.shape[0], w.shape[1] * t.block_size), np.float32)
    for r in range(w.shape[0]):
        NATIVE.lib.flare_dequantize_row(t.ggml_type, NATIVE.ffi.from_buffer(w[r]),
                                        NATIVE.ffi.cast("float *", rows[r].ctypes.data), rows.shape[1])
    np.testing.assert_array_equal(rows.view(np.uint32), dequantize_reference(w, dtype).view(np.uint32))


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q8_0"])
def test_16_bit_activations_keep_the_float_result(dtype):
    """The 32-weight types round activations to 16 bits per block (quant.h): each moves by at
    most max|x_block| / 65534. Over 16 blocks of these weights (outputs up to ~13) every ISA is
    within ~1.4e-4 of the float64 product; 8-bit activations (ggml's scheme, simulated in NumPy
    on the same data) are 0.03..0.05 off. Bound: 1e-3 + 2e-5 relative."""
    t = QUANT_TYPES[dtype]
    rng = np.random.default_rng(11)
    w = quant_blocks(rng, dtype, 13, 16 * t.block_size)
    x = rng.uniform(-2, 2, (5, 16 * t.block_size)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize_reference(w, dtype).astype(np.float64).T
    for name, isa in ISAS.items():
        if NATIVE.lib.flare_quant_isa(isa) == isa:
            np.testing.assert_allclose(_qmatmul(dtype, w, x), want, rtol=2e-5, atol=1e-3, err_msg=name)
    NATIVE.lib.flare_quant_isa(0)


@pytest.mark.parametrize("dtype", list(QUANT_TYPES))
def test_many_rows_give_the_bits_of_one_row(dtype):
    """Prefill-sized products take four activation rows per unpacked weight block (quant.c);
    each row's result must be the bits the one-row (decode) product gives, so a token's logits
    do not depend on how many tokens were fed with it. On every ISA."""
    t = QUANT_TYPES[dtype]
    rng = np.random.default_rng(5)
    w = quant_blocks(rng, dtype, 9, 2 * t.block_size)
    x = rng.uniform(-2, 2, (7, 2 * t.block_size)).astype(np.float32)   # 4 + 3: the tail too
    for name, isa in ISAS.items():
        if NATIVE.lib.flare_quant_isa(isa) == isa:
            many = _qmatmul(dtype, w, x)
            one = np.concatenate([_qmatmul(dtype, w, x[j:j + 1]) for j in range(x.shape[0])])
            np.testing.assert_array_equal(many.view(np.uint32), one.view(np.uint32), err_msg=name)
    NATIVE.lib.flare_quant_isa(0)


@pytest.mark.parametrize("dtype", list(QUANT_TYPES))
def test_integer_sums_do_not_overflow(dtype):
    """The worst case of the integer products: every weight and scale at its largest (all bits
    set; q6_k scales 127) against activations that all round to the largest step. A 32-bit sum
    that wrapped would be far off."""
    t = QUANT_TYPES[dtype]
    w = np.full((3, 2 * t.block_bytes), 0xFF, np.uint8).reshape(-1).view(t.numpy).reshape(3, 2)
    for field in ("d", "dmin"):
        if field in t.numpy.names:
            w[field] = np.float16(1e-3)
    if "m" in t.numpy.names:
        w["m"] = np.float16(1e-3)
    if dtype == "q6_k":
        w["scales"] = 127
    x = np.ones((2, 2 * t.block_size), np.float32)
    want = x.astype(np.float64) @ dequantize_reference(w, dtype).astype(np.float64).T
    for name, isa in ISAS.items():
        if NATIVE.lib.flare_quant_isa(isa) == isa:
            np.testing.assert_allclose(_qmatmul(dtype, w, x), want, rtol=1e-4, err_msg=name)
    NATIVE.lib.flare_quant_isa(0)
