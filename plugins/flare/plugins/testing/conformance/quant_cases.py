"""Conformance cases for block-quantized weights (ggml's Q4_0, Q4_1, Q8_0, Q4_K, Q6_K).

The reference dequantizes with `gguf.quants` (llama.cpp's Python implementation)
and multiplies in float64. Tolerances:
- dequantize and get_rows: exact (0). Every block type is a few float32 products
  (and one difference or sum) per weight in ggml's order; a backend must give the
  same bits — without fused multiply-add contraction.
- matmul / mul_mat_id with quantized weights: QUANT_DOT, rtol 2e-2 and atol 0.1, with
  outputs of order 1-3. A backend may round the activations to 8 bits per block of 32
  or 256 before an integer dot product, as ggml does: each activation then moves by up
  to half a step (max|x_block| / 254, here 2/254), independently, so an output's error
  is a random walk over k: sigma = sqrt(k) * rms(w) * step / sqrt(12) ~ 0.012 for
  k = 512 and these weights (rms <= 0.15); the largest deviation measured on the CPU's
  integer path over every case is 0.05. atol 0.1 is 8 sigma. A float
  (dequantize-then-FMA) kernel is within ACCUM of the reference.
"""
from __future__ import annotations

import numpy as np

from flare.core.dtypes import QUANT_TYPES

QUANT_DOT = (2e-2, 1e-1)

# the scale `d` (and `dmin`) per type that keeps dequantized weights around +-0.1..0.3, so a
# dot product over k <= 512 stays of order 1
_SCALES = {"q4_0": 0.02, "q4_1": 0.02, "q8_0": 0.002, "q4_k": 2e-4, "q6_k": 1e-4}


def quant_blocks(rng: np.random.Generator, dtype: str, rows: int, k: int) -> np.ndarray:
    """[rows, k // block] random blocks of `dtype`: random bytes, scales set to sane float16s."""
    t = QUANT_TYPES[dtype]
    nb = k // t.block_size
    blocks = rng.integers(0, 256, size=(rows * nb, t.block_bytes), dtype=np.uint8).view(t.numpy).reshape(rows, nb)
    scale = _SCALES[dtype]
    for field in ("d", "dmin"):
        if field in t.numpy.names:
            blocks[field] = (rng.uniform(0.5, 1.5, (rows, nb)) * scale).astype(np.float16)
    if "m" in t.numpy.names:
        blocks["m"] = (rng.uniform(-0.15, 0.0, (rows, nb))).astype(np.float16)
    return blocks


def quant_cases() -> list:
    """The cases (cases.py appends them to CASES; imported here, not at the top, because
    cases.py imports this module while it is still being built)."""
    from .cases import EXACT, Case, _in, f32, simple

    cases: list[Case] = []
    for dt, t in QUANT_TYPES.items():
        k = 3 * t.block_size if t.block_size == 32 else 2 * t.block_size     # several blocks per row
        qb = lambda r, rows, dt=dt, k=k: quant_blocks(r, dt, rows, k)        # noqa: E731
        cases += [
            simple(f"dequantize_{dt}", "dequantize", EXACT, lambda b, r, i, qb=qb: b.dequantize(b.weight("w", qb(r, 3)))),
            simple(f"get_rows_{dt}", "get_rows", EXACT, lambda b, r, i, qb=qb: b.get_rows(
                b.weight("table", qb(r, 10)), _in(b, i, "idx", r.integers(0, 10, (2, 3)).astype(np.int32)))),
            simple(f"matvec_{dt}", "matmul", QUANT_DOT, lambda b, r, i, qb=qb, k=k: b.matmul(
                _in(b, i, "a", f32(r, 1, k)), b.weight("w", qb(r, 13)), transpose_b=True)),
            simple(f"matmul_{dt}_batched", "matmul", QUANT_DOT, lambda b, r, i, qb=qb, k=k: b.matmul(
                _in(b, i, "a", f32(r, 2, 5, k)), b.weight("w", qb(r, 9)), transpose_b=True)),
            simple(f"matmul_{dt}_tiles", "matmul", QUANT_DOT, lambda b, r, i, qb=qb, k=k: b.matmul(
                _in(b, i, "a", f32(r, 37, k)), b.weight("w", qb(r, 70)), transpose_b=True)),
            simple(f"mul_mat_id_{dt}", "mul_mat_id", QUANT_DOT, lambda b, r, i, dt=dt, k=k: b.mul_mat_id(
                b.weight("w", quant_blocks(r, dt, 4 * 6, k).reshape(4, 6, -1)), _in(b, i, "x", f32(r, 3, k)),
                _in(b, i, "ids", r.integers(0, 4, (3, 2)).astype(np.int32)))),
        ]
    return cases

