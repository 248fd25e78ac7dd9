"""Tuning: for each kernel with variants, measure them on the shapes the programs use; keep the best.

Variants are alternative implementations of one kernel with identical
results up to rounding (a matmul strategy on the CPU, say). Entries are per
(backend, kernel, step tokens): decode and prefill programs of the same token
count share an entry, a mixed program of a larger bucket has its own — so
pruning mixed programs drops exactly the entries only they needed.
`quick` times each variant a few times on up to three representative shapes;
`audit` times every distinct shape more often. Times are the best of the
repeats (the least disturbed by other load on a shared machine).

The choice is recorded in the catalog and, at load time, handed per program to
the prepared graph (`Session.prepare(tuning={program: {"cpu.matmul": variant}})`),
which gives each split its backend's choices; the CPU device then binds that
variant (for `packed`, storing the constant weight transposed once in a buffer
of the split). Backends without a kernel's variants run their one
implementation, so a choice never changes what is computed beyond rounding.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from flare.errors import FlareError
from flare.graph import Graph, Tensor

from .schema import TuningEntry

MODES = {"quick": {"repeats": 3, "shapes": 3}, "audit": {"repeats": 10, "shapes": None}}


@dataclass(frozen=True)
class Shape:
    """What a variant is timed on: source shapes and the node's params."""

    srcs: tuple[tuple[int, ...], ...]
    out: tuple[int, ...]
    params: tuple[tuple[str, Any], ...]

    @property
    def work(self) -> int:
        return int(np.prod(self.out, dtype=np.int64)) * int(self.srcs[0][-1] if self.srcs else 1)


Variant = Callable[[np.ndarray, Sequence[np.ndarray], Mapping[str, Any]], None]


@dataclass(frozen=True)
class Tunable:
    """A kernel of a backend with several implementations, timed on host arrays."""

    backend: str
    kernel: str
    variants: dict[str, Variant]
    inputs: Callable[[Shape, np.random.Generator], list[np.ndarray]]
    prepare: Callable[[str, list[np.ndarray], Mapping[str, Any]], list[np.ndarray]] = lambda v, x, p: x


# ------------------------------------------------------------------ CPU variants
# The variants are the CPU backend's own kernels (flare.backends.cpu.kernels.VARIANTS):
# what is timed here is exactly what a prepared graph runs when a core selects it.
def _mm_pack(variant, x, p):
    """`packed`: a constant right operand stored pre-transposed (the CPU device does it at compile)."""
    if variant == "packed":
        b = x[1]
        return [x[0], np.ascontiguousarray(np.swapaxes(b, -1, -2)) if p.get("transpose_b") else b]
    return x


def _mm_inputs(s: Shape, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.standard_normal(sh, dtype=np.float32) for sh in s.srcs]


def _mmid_inputs(s: Shape, rng: np.random.Generator) -> list[np.ndarray]:
    w = rng.standard_normal(s.srcs[0], dtype=np.float32)
    v = rng.standard_normal(s.srcs[1], dtype=np.float32)
    ids = rng.integers(0, s.srcs[0][0], size=s.srcs[2]).astype(np.int32)
    return [w, v, ids]


def _with_defaults(kernel: str, fn):
    """Kernels read their op's params with defaults filled in, as the builder gives them."""
    from flare.ops import OPS

    defaults = OPS[kernel].defaults
    return lambda out, x, p: fn(out, x, {**defaults, **p})


def _cpu_tunable(kernel: str, inputs, prepare=lambda v, x, p: x) -> Tunable:
    from flare.backends.cpu.kernels import VARIANTS

    return Tunable("cpu", kernel, {name: _with_defaults(kernel, fn) for name, fn in VARIANTS[kernel].items()},
                   inputs, prepare)


TUNABLES: dict[tuple[str, str], Tunable] = {
    ("cpu", "matmul"): _cpu_tunable("matmul", _mm_inputs, _mm_pack),
    ("cpu", "mul_mat_id"): _cpu_tunable("mul_mat_id", _mmid_inputs),
}


def variants(backend: str, kernel: str) -> tuple[str, ...]:
    """The variant names of a kernel; ("default",) when it has only one implementation."""
    t = TUNABLES.get((backend, kernel))
    return tuple(t.variants) if t else ("default",)


def tuning_key(backend: str, kernel: str, tokens: int) -> str:
    return f"{backend}.{kernel}.t{tokens}"


def node_shape(node: Tensor) -> Shape:
    params = tuple(sorted((k, v) for k, v in node.params.items() if isinstance(v, (int, float, bool, str))))
    return Shape(tuple(s.shape for s in node.srcs), node.shape, params)


def collect(graphs: Iterable[tuple[int, Graph]], backend: str) -> dict[tuple[str, int], list[Shape]]:
    """(kernel, tokens) -> distinct node shapes of tunable kernels in programs of `tokens` tokens."""
    out: dict[tuple[str, int], list[Shape]] = {}
    for tokens, graph in graphs:
        for node in graph.nodes:
            if (backend, node.op) in TUNABLES:
                shapes = out.setdefault((node.op, tokens), [])
                s = node_shape(node)
                if s not in shapes:
                    shapes.append(s)
    return out


def measure(backend: str, kernel: str, tokens: int, shapes: Sequence[Shape], mode: str,
            seed: int = 0) -> TuningEntry:
    """Time every variant on `shapes`; the choice is the least total of best-of-repeats times."""
    tunable = TUNABLES[(backend, kernel)]
    cfg = MODES[mode]
    chosen = sorted(shapes, key=lambda s: -s.work)[: cfg["shapes"]] if cfg["shapes"] else list(shapes)
    rng = np.random.default_rng(seed)
    cases = [(s, tunable.inputs(s, rng)) for s in chosen]
    seconds: dict[str, float] = {}
    reference = [_run(tunable, next(iter(tunable.variants)), s, x) for s, x in cases]
    for name, fn in tunable.variants.items():
        for (s, arrays), ref in zip(cases, reference):   # a variant must compute the same thing
            got = _run(tunable, name, s, arrays)
            if not np.allclose(got, ref, rtol=1e-4, atol=1e-4):
                raise FlareError(f"tuning: variant {name!r} of {backend}/{kernel} disagrees with "
                                     f"{next(iter(tunable.variants))!r} on {s}")
        total = 0.0
        for s, arrays in cases:
            params = dict(s.params)
            x = tunable.prepare(name, arrays, params)
            out = np.empty(s.out, np.float32)
            fn(out, x, params)  # warm-up (and first-touch of `out`)
            best = float("inf")
            for _ in range(cfg["repeats"]):
                t0 = time.perf_counter()
                fn(out, x, params)
                best = min(best, time.perf_counter() - t0)
            total += best
        seconds[name] = round(total, 9)
    choice = min(seconds, key=lambda v: (seconds[v], list(tunable.variants).index(v)))
    return TuningEntry(tuning_key(backend, kernel, tokens), backend, kernel, tokens, choice, seconds, cfg["repeats"])


def _run(tunable: Tunable, variant: str, s: Shape, arrays: list[np.ndarray]) -> np.ndarray:
    params = dict(s.params)
    out = np.empty(s.out, np.float32)
    tunable.variants[variant](out, tunable.prepare(variant, arrays, params), params)
    return out
