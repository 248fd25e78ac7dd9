"""Winograd (Toom-Cook) F(4, K) transforms of the conv1d command's Winograd path (conv1d_wino.h).

A stride-1 convolution with K = 3, 5 or 7 taps computes 4 outputs of one channel pair from
alpha = 4 + K - 1 products instead of 4 * K: the input tile d (alpha samples, dilation apart)
and the taps g go through BT and G, are multiplied pointwise (summed over input channels: a
product per transform point, a GEMM), and AT maps the alpha sums back to 4 outputs:
y = AT [(G g) * (BT d)]. The 4 * K / alpha fewer multiplies (2x, 2.5x, 2.8x) are the point:
Piper's HiFi-GAN decoder is ~85% such convolutions, at the core's peak in the direct kernel.

The matrices are built here exactly (fractions), from the interpolation points below; the
points are the usual small ones, whose float32 error stays within a few times the direct
sum's (measured over 64 input channels: median 4e-7, 6e-7 and 3e-6 of the output's size for
K 3, 5, 7, against 1.5e-7). The C kernel has AT and BT as constants (so its transforms fold
their zeros and ones at compile time), written from these by `c_tables()` (printed by
`python -m flare.backends.cpu.native.winograd`); a test checks that the compiled tables equal
these. G is applied once per weight, here (`transform_weight`).
"""
from __future__ import annotations

import os
from fractions import Fraction
from functools import lru_cache

import numpy as np

from ..lowering import CONV1D_WINO, K as KINDS

M = 4  # outputs per tile (WINO_M in conv1d_wino.h)
TAPS = (2, 3, 5, 7)  # kernel sizes the path takes
_H = Fraction(1, 2)
POINTS = {  # finite interpolation points (alpha - 1 of them; the last point is infinity)
    2: (0, 1, -1, 2),
    3: (0, 1, -1, 2, -2),
    5: (0, 1, -1, 2, -2, _H, -_H),
    7: (0, 1, -1, 2, -2, _H, -_H, Fraction(3, 2), Fraction(-3, 2)),
}


def alpha(k: int) -> int:
    """Transform points of F(4, k)."""
    return M + k - 1


def _solve(rows: list[list[Fraction]], rhs: list[Fraction]) -> list[Fraction]:
    """The exact solution of a consistent (possibly overdetermined) linear system."""
    n = len(rows[0])
    a = [list(r) + [b] for r, b in zip(rows, rhs)]
    piv_cols, r = [], 0
    for col in range(n):
        p = next((i for i in range(r, len(a)) if a[i][col] != 0), None)
        if p is None:
            continue
        a[r], a[p] = a[p], a[r]
        a[r] = [v / a[r][col] for v in a[r]]
        for i in range(len(a)):
            if i != r and a[i][col] != 0:
                f = a[i][col]
                a[i] = [vi - f * vr for vi, vr in zip(a[i], a[r])]
        piv_cols.append(col)
        r += 1
    if any(all(v == 0 for v in row[:-1]) and row[-1] != 0 for row in a):
        raise ArithmeticError("inconsistent Winograd system")
    x = [Fraction(0)] * n
    for i, col in enumerate(piv_cols):
        x[col] = a[i][-1]
    return x


@lru_cache(maxsize=None)
def matrices(k: int) -> tuple[tuple, tuple, tuple]:
    """(AT [4][alpha], G [alpha][k], BT [alpha][alpha]) of F(4, k), exact."""
    pts = [Fraction(p) for p in POINTS[k]]
    a = alpha(k)
    at = [[p ** i for p in pts] + [Fraction(int(i == M - 1))] for i in range(M)]
    g = []
    for p in pts:
        den = Fraction(1)
        for q in pts:
            if q != p:
                den *= p - q
        g.append([p ** j / den for j in range(k)])
    g.append([Fraction(int(j == k - 1)) for j in range(k)])
    # BT from the identity sum_xi AT[i][xi] G[xi][j] BT[xi][n] = [n == i + j], one column n at a time
    rows = [[at[i][x] * g[x][j] for x in range(a)] for i in range(M) for j in range(k)]
    cols = [_solve(rows, [Fraction(int(n == i + j)) for i in range(M) for j in range(k)]) for n in range(a)]
    bt = [[cols[n][x] for n in range(a)] for x in range(a)]
    return tuple(map(tuple, at)), tuple(map(tuple, g)), tuple(map(tuple, bt))


def transform_weight(w: np.ndarray) -> np.ndarray:
    """U [alpha, Cin, Cout] = G w, per (ci, co), for w [Cout, Cin, K] (in float64, then float32):
    the weight the Winograd path multiplies by, made once per constant weight."""
    cout, cin, k = w.shape
    g = np.array(matrices(k)[1], dtype=np.float64)
    return np.ascontiguousarray(np.einsum("xk,oik->xio", g, w.astype(np.float64)).astype(np.float32))


def c_tables() -> str:
    """The C tables of AT and BT (conv1d_wino.h's WINO_AT<K> / WINO_BT<K>), as this file makes them."""
    out = []
    for k in TAPS:
        at, _, bt = matrices(k)
        for name, mat in (("AT", at), ("BT", bt)):
            body = ",\n    ".join("{" + ", ".join(f"{float(v)!r}f" for v in row) + "}" for row in mat)
            out.append(f"static const float WINO_{name}{k}[{len(mat)}][{len(mat[0])}] = {{\n    {body}}};")
    return "\n".join(out)


WINO_MIN_LOUT = 128  # shorter outputs keep the tiled kernel (a block is 64-288 outputs)


def winograd_takes(c: dict, w: np.ndarray, lib) -> bool:
    """Whether conv1d command c (weight w, a constant [Cout, Cin, (1,) K] f32) takes the Winograd
    path: stride 1, K in TAPS, 16k channels in and out (whole vectors on every ISA), the
    column-block layout (conv1d.h: ip[6] = 0) over x's rows of unit stride, at least
    WINO_MIN_LOUT outputs, and a CPU kernel for it (`flare_conv1d_wino`: AVX2 + FMA or AVX-512,
    as chosen by flare_conv1d_isa). FLARE_CPU_WINOGRAD=0 turns it off (for A/B timing)."""
    if c["kind"] != KINDS["conv1d"] or os.environ.get("FLARE_CPU_WINOGRAD", "1") == "0":
        return False
    stride, _, _, cin, k, _, rows = c["ip"][:7]
    cout, lout = c["ne"][2], c["ne"][3]
    return (stride == 1 and k in TAPS and cin % 16 == 0 and cout % 16 == 0 and not rows and lout >= WINO_MIN_LOUT
            and c["ss"][0][3] == 1 and w.dtype == np.float32 and w.flags.c_contiguous
            and w.shape[0] == cout and w.size == cout * cin * k and bool(lib.flare_conv1d_wino()))


def transform_weight_of(w: np.ndarray) -> np.ndarray:
    """transform_weight for the [Cout, Cin, 1, K] weight of a conv2d over one row, or [Cout, Cin, K]."""
    return transform_weight(w.reshape(w.shape[0], w.shape[1], w.shape[-1]))


def use_winograd(c: dict, u: np.ndarray, lib, threads: int) -> None:
    """Point conv1d command c at its transformed weight u, give it one scratch slot per thread
    (ip[7]; conv1d.h deals its blocks to them) and size its scratch for the path."""
    b, cout, lout = c["ne"][1], c["ne"][2], c["ne"][3]
    _, _, dil, cin, k = c["ip"][:5]
    slots = max(1, int(threads))
    c["src"][1] = u
    c["ip"][7] = slots
    c["flags"] = int(c["flags"]) | CONV1D_WINO
    c["scratch"] = max(int(c["scratch"]), int(lib.flare_conv1d_wino_scratch(b, cin, cout, k, dil, lout, slots)))


if __name__ == "__main__":
    print(c_tables())
