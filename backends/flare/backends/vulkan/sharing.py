"""Fewer lane-matmul pipelines per split: a small dispatch drops layout bits to share a variant.

Why: on lavapipe every distinct pipeline is compiled by LLVM once per machine (at prepare, see
`prime.py`), and the `matmul_lanes.comp` variants are the expensive ones: 1.2-2.3 CPU seconds
each, most of a cold `flare run silero-vad --backends vulkan`. Its MODE bits A_VEC (1), B_VEC (2),
CONV_VEC (8), B_NVEC (16) and K_QUADS (32) are fast paths only: with any of them clear the
kernel is still correct for every operand (strided scalar loads, the K % 4 tail loop compiled
in) and sums in the same order (four k at a time, in k order), so results are bit-identical.
CONV (4) changes what b is, and the other constants (dtypes, lane block, epilogue) change
what is computed: those must match.

So within one split, a `matmul_lanes` dispatch whose MODE is a superset of another dispatch's
(same other constants, same CONV) takes that other MODE, the one with the fewest bits: the
silero frontend's STFT conv (MODE 45, four taps per load) runs on the encoder convs' variant
(37) and its pipelines drop from 4 lane variants to 3. Only dispatches of at most
`MAX_SHARED_FMAS` multiply-adds give their bits up: there the slower loads cost milliseconds
per execute against seconds of compile once (silero's biggest, the STFT at the 2048-window
bucket, is 0.54 G); a big GEMM keeps its fastest layout whatever else the split holds.

Then the epilogue: lane dispatches that differ only in EPI (the fused `linear`'s bias,
residual, activation: constant 8) all take `EPI_RUNTIME` and pass their code as parameter 4,
when the split has two or more codes: MiniLM's bias, bias + residual and bias + gelu layers run
one variant instead of three (each 0.9-1.3 s of LLVM; the runtime one about as much as the
gelu one). The code is then a uniform branch per stored output, next to the K loop's
thousands of loads. A split with one code keeps it a constant (nothing more to compile).
"""
from __future__ import annotations

import math
from dataclasses import replace

from .lowering import Dispatch

SHADER = "matmul_lanes"
OPTIONAL_BITS = 1 | 2 | 8 | 16 | 32  # fast paths; everything else in MODE (CONV) is meaning
MAX_SHARED_FMAS = 1 << 30
EPI_RUNTIME = 255  # matmul_lanes.comp: the epilogue code is parameter 4
N_CONV_PARAMS = 4  # conv1d's kernel size, stride, padding, dilation come first


def fmas(d: Dispatch) -> int:
    """Multiply-adds of a lane-matmul dispatch: output elements x K (a's last axis)."""
    return math.prod(d.args[2].shape) * d.args[0].shape[-1]


def share_lane_variants(dispatches: list[Dispatch], max_fmas: int = MAX_SHARED_FMAS) -> list[Dispatch]:
    """The split's dispatches with small lane matmuls moved onto a variant with fewer MODE bits
    that the split already uses, where one exists (see the module docstring); others unchanged."""
    modes: dict[tuple[int, ...], set[int]] = {}
    for d in dispatches:
        if d.shader == SHADER:
            modes.setdefault(d.spec[1:], set()).add(d.spec[0])
    out = []
    for d in dispatches:
        if d.shader == SHADER and fmas(d) <= max_fmas:
            mode = d.spec[0]
            below = [m for m in modes[d.spec[1:]]
                     if m & ~mode == 0 and (m & ~OPTIONAL_BITS) == (mode & ~OPTIONAL_BITS)]
            best = min(below, key=lambda m: (bin(m).count("1"), m))  # `mode` itself is among them
            if best != mode:
                d = replace(d, spec=(best,) + d.spec[1:])
        out.append(d)
    return _share_epilogues(out)


def _share_epilogues(dispatches: list[Dispatch]) -> list[Dispatch]:
    """Lane dispatches alike but for their epilogue code (last constant) onto EPI_RUNTIME,
    the code passed as parameter 4, where the split has more than one code for them."""
    codes: dict[tuple[int, ...], set[int]] = {}
    for d in dispatches:
        if d.shader == SHADER:
            codes.setdefault(d.spec[:-1], set()).add(d.spec[-1])
    out = []
    for d in dispatches:
        if d.shader == SHADER and len(codes[d.spec[:-1]]) > 1:
            params = list(d.params) + [0] * (N_CONV_PARAMS - len(d.params))
            d = replace(d, spec=d.spec[:-1] + (EPI_RUNTIME,), params=params + [d.spec[-1]])
        out.append(d)
    return out
