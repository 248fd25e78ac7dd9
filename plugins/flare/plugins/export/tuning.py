"""Tuning: for each kernel with variants, measure them on the shapes the programs use; keep the best.

Variants are alternative implementations of one kernel with identical
results up to rounding (a matmul strategy on the CPU, a tile size on a GPU).
A device names them (`Device.kernel_variants(op)`), and a prepared graph runs
the one its tuning asks for (`Session.prepare(tuning={entry: {"cpu.matmul":
variant}})`); so tuning times each variant exactly as a program will run it:
a one-node graph of the program's own shape, prepared on that device through
the public lifecycle. No backend is imported here.

Entries are per (backend, kernel, step tokens): decode and prefill programs of
the same token count share an entry, a mixed program of a larger bucket has
its own — so pruning mixed programs drops exactly the entries only they
needed. `quick` times each variant a few times on up to three representative
shapes; `audit` times every distinct shape more often. Times are the best of
the repeats (the least disturbed by other load on a shared machine).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from flare.core.backend import Device
from flare.core.dtypes import is_quant, to_numpy
from flare.core.errors import FlareError
from flare.core.graph import WEIGHT, Graph, GraphBuilder, Tensor
from flare.core.session import Session

from .schema import TuningEntry

MODES = {"quick": {"repeats": 3, "shapes": 3}, "audit": {"repeats": 10, "shapes": None}}
ENTRY = "tune"


@dataclass(frozen=True)
class Shape:
    """What a variant is timed on: each source's shape, dtype and whether it is a constant
    weight (a variant may repack weights once), and the node's params."""

    srcs: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    weights: tuple[bool, ...]
    out: tuple[int, ...]
    params: tuple[tuple[str, Any], ...]

    @property
    def work(self) -> int:
        return int(np.prod(self.out, dtype=np.int64)) * int(self.srcs[0][-1] if self.srcs else 1)


def variants(device: Device, kernel: str) -> tuple[str, ...]:
    """The variant names of a kernel on a device; ("default",) when it has one implementation."""
    return tuple(device.kernel_variants(kernel)) or ("default",)


def tuning_key(backend: str, kernel: str, tokens: int) -> str:
    return f"{backend}.{kernel}.t{tokens}"


def node_shape(node: Tensor) -> Shape:
    params = tuple(sorted((k, v) for k, v in node.params.items() if isinstance(v, (int, float, bool, str))))
    return Shape(tuple(s.shape for s in node.srcs), tuple(s.dtype for s in node.srcs),
                 tuple(s.storage.role == WEIGHT and s.storage.op is None for s in node.srcs), node.shape, params)


def collect(graphs: Iterable[tuple[int, Graph]], device: Device) -> dict[tuple[str, int], list[Shape]]:
    """(kernel, tokens) -> distinct node shapes of the device's tunable kernels in programs of `tokens` tokens."""
    out: dict[tuple[str, int], list[Shape]] = {}
    for tokens, graph in graphs:
        for node in graph.nodes:
            if any(is_quant(src.dtype) for src in node.srcs):
                continue   # variants are float layouts; a quantized weight runs its type's own kernel
            if len(device.kernel_variants(node.op)) > 1 and device.supports(node):
                shapes = out.setdefault((node.op, tokens), [])
                s = node_shape(node)
                if s not in shapes:
                    shapes.append(s)
    return out


def _arrays(s: Shape, rng: np.random.Generator) -> list[np.ndarray]:
    """Random sources; integer sources index the first source's leading axis (expert ids, rows)."""
    out = []
    for shape, dtype in zip(s.srcs, s.dtypes):
        if dtype.startswith("i"):
            out.append(rng.integers(0, max(1, s.srcs[0][0]), size=shape).astype(to_numpy(dtype)))
        else:
            out.append(rng.standard_normal(shape, dtype=np.float32).astype(to_numpy(dtype)))
    return out


def _prepare(session: Session, device: Device, kernel: str, variant: str, s: Shape, arrays: list[np.ndarray]):
    def build(b: GraphBuilder, shapes: Any) -> None:
        srcs = [b.weight(f"w{i}", a) if is_w else b.input(f"x{i}", a.shape, dtype)
                for i, (a, is_w, dtype) in enumerate(zip(arrays, s.weights, s.dtypes))]
        b.output("out", b.op(kernel, *srcs, **dict(s.params)))

    shapes = {f"x{i}": a.shape for i, (a, is_w) in enumerate(zip(arrays, s.weights)) if not is_w}
    tuning = {ENTRY: {f"{device.backend}.{kernel}": variant}} if variant != "default" else None
    pg = session.prepare({ENTRY: build}, {ENTRY: shapes}, placement=lambda t, devices: device.name,
                         name=f"tuning:{kernel}:{variant}", tuning=tuning)
    inputs = {f"x{i}": a for i, (a, is_w) in enumerate(zip(arrays, s.weights)) if not is_w}
    return pg, inputs


def measure(session: Session, device: Device, kernel: str, tokens: int, shapes: Sequence[Shape], mode: str,
            seed: int = 0) -> TuningEntry:
    """Time every variant on `shapes`; the choice is the least total of best-of-repeats times.
    Every variant must compute what the first one does (else FlareError: a broken variant)."""
    cfg = MODES[mode]
    names = variants(device, kernel)
    chosen = sorted(shapes, key=lambda s: -s.work)[: cfg["shapes"]] if cfg["shapes"] else list(shapes)
    rng = np.random.default_rng(seed)
    cases = [(s, _arrays(s, rng)) for s in chosen]
    seconds: dict[str, float] = {}
    reference: list[np.ndarray] = []
    for name in names:
        total = 0.0
        for k, (s, arrays) in enumerate(cases):
            pg, inputs = _prepare(session, device, kernel, name, s, arrays)
            try:
                got = pg.execute(ENTRY, **inputs)["out"]     # warm-up, and the agreement check
                if len(reference) <= k:
                    reference.append(got)
                elif not np.allclose(got, reference[k], rtol=1e-4, atol=1e-4):
                    raise FlareError(f"tuning: variant {name!r} of {device.backend}/{kernel} disagrees with "
                                     f"{names[0]!r} on {s}")
                best = float("inf")
                for _ in range(cfg["repeats"]):
                    t0 = time.perf_counter()
                    pg.execute(ENTRY, **inputs)
                    best = min(best, time.perf_counter() - t0)
            finally:
                pg.release()
            total += best
        seconds[name] = round(total, 9)
    choice = min(seconds, key=lambda v: (seconds[v], names.index(v)))
    return TuningEntry(tuning_key(device.backend, kernel, tokens), device.backend, kernel, tokens, choice, seconds,
                       cfg["repeats"])
