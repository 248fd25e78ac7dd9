"""Expert parallelism: each MPI rank holds and computes a slice of every layer's experts.

The rewrite works on a program's serialized graph, so it needs nothing from
the model but the pattern every MoE layer of Flare has: `mul_mat_id` nodes
sharing one ids tensor (the router's top-k), expert weights `[E, N, K]`, and
a chain of `mul`/`reshape`/`contiguous` from the last expert matmul to a
`sum` over the k axis (the gate-weighted combine). For rank r of n:

- each expert weight becomes its slice `[start, stop)` plus one all-zero
  "dummy" expert at the end;
- a `host` node maps global ids to local ones, and every choice of an expert
  this rank does not hold to the dummy, whose output is exactly zero;
- a `host` node after the combine sums the ranks' partial results
  (allgather, then a sum in rank order, so every rank gets the same bytes).

Why outputs equal the one-rank run: the CPU `mul_mat_id` multiplies each
expert's rows as one group, and a held expert's group has exactly the rows
it has in the one-rank graph; the other choices contribute exact zeros. With
top-k <= 2 the final sum adds the same two non-zero terms, so the result is
bitwise identical (with larger k it is equal up to summation order).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from flare.core.errors import CoreFormatError

LOCAL_IDS = "flare.ep.local_ids"
ALLREDUCE = "flare.ep.allreduce"
LINEAR = ("mul", "reshape", "contiguous")


@dataclass(frozen=True)
class Partition:
    """This process's place among `size` ranks."""

    rank: int = 0
    size: int = 1

    def experts(self, n: int) -> tuple[int, int]:
        """The contiguous expert range [start, stop) of this rank (sizes differ by at most one)."""
        return self.rank * n // self.size, (self.rank + 1) * n // self.size


@dataclass(frozen=True)
class ExpertSlice:
    """A local weight: rows [start, stop) of the global `source` weight, plus a zero row."""

    source: str
    start: int
    stop: int


def local_name(name: str, part: Partition) -> str:
    return f"{name}@ep{part.rank}of{part.size}"


def rewrite(graph: Mapping[str, Any], part: Partition) -> tuple[dict[str, Any], dict[str, ExpertSlice]]:
    """The rank-local graph and its local expert weights (name -> slice). Identity for one rank."""
    if part.size <= 1:
        return dict(graph), {}
    g = copy.deepcopy(dict(graph))
    tensors: list[dict[str, Any]] = g["tensors"]
    by_id = {t["id"]: t for t in tensors}
    consumers: dict[int, list[dict[str, Any]]] = {t["id"]: [] for t in tensors}
    for t in tensors:
        for s in t.get("srcs", []):
            consumers[s].append(t)
    groups: dict[int, list[dict[str, Any]]] = {}
    for t in tensors:
        if t.get("op") == "mul_mat_id":
            groups.setdefault(t["srcs"][2], []).append(t)
    next_id = max(by_id) + 1
    slices: dict[str, ExpertSlice] = {}
    after: dict[int, dict[str, Any]] = {}   # tensor id -> host node to insert right after it
    renamed: dict[int, int] = {}            # combine id -> allreduce id (for its other readers)
    done: set[int] = set()
    for ids_id, matmuls in groups.items():
        ids = by_id[ids_id]
        weights = [by_id[m["srcs"][0]] for m in matmuls]
        n_experts = {w["shape"][0] for w in weights}
        if any(w.get("role") != "weight" for w in weights) or len(n_experts) != 1:
            raise CoreFormatError(f"expert matmuls reading {ids['name']!r} need weight experts of one count",
                                  "expert-parallel")
        (n,) = n_experts
        start, stop = part.experts(n)
        combine = _find_combine(matmuls[-1], consumers)
        for w in weights:
            if w["id"] in done:
                continue  # one weight read by several expert matmuls
            done.add(w["id"])
            slices[local_name(w["name"], part)] = ExpertSlice(w["name"], start, stop)
            w["name"] = local_name(w["name"], part)
            w["shape"] = [stop - start + 1, *w["shape"][1:]]
        local = {"id": next_id, "name": f"{ids['name']}.ep_local", "shape": list(ids["shape"]), "dtype": "i32",
                 "op": "host", "srcs": [ids_id],
                 "params": {"callback": LOCAL_IDS, "shape": list(ids["shape"]), "dtype": "i32",
                            "args": {"start": start, "stop": stop}}}
        reduce = {"id": next_id + 1, "name": f"{combine['name']}.ep_allreduce", "shape": list(combine["shape"]),
                  "dtype": combine["dtype"], "op": "host", "srcs": [combine["id"]],
                  "params": {"callback": ALLREDUCE, "shape": list(combine["shape"]), "dtype": combine["dtype"],
                             "args": {}}}
        next_id += 2
        for m in matmuls:
            m["srcs"][2] = local["id"]
        after[ids_id] = local
        after[combine["id"]] = reduce
        renamed[combine["id"]] = reduce["id"]
    out: list[dict[str, Any]] = []
    for t in tensors:   # the inserted host nodes are not in `tensors`: they keep reading the combine
        if "op" in t:
            t["srcs"] = [renamed.get(s, s) for s in t["srcs"]]
        out.append(t)
        if t["id"] in after:
            out.append(after[t["id"]])
    g["tensors"] = out
    g["outputs"] = {k: renamed.get(v, v) for k, v in g["outputs"].items()}
    return g, slices


def _find_combine(last: dict[str, Any], consumers: Mapping[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Follow single readers from the last expert matmul through linear ops to the k-axis sum."""
    node = last
    rank = len(last["shape"])
    while True:
        readers = consumers.get(node["id"], [])
        if len(readers) != 1:
            break
        nxt = readers[0]
        op = nxt.get("op")
        if op == "sum":
            axis = nxt.get("params", {}).get("axis")
            axes = axis if isinstance(axis, list) else [axis]
            if len(axes) == 1 and isinstance(axes[0], int) and axes[0] % rank == 1 \
                    and not nxt["params"].get("keepdims", False):
                return nxt
            break
        if op not in LINEAR:
            break
        node = nxt
    raise CoreFormatError(f"expert parallelism: no gate-weighted sum over the k axis after {last['name']!r} "
                          "(the pattern mul_mat_id -> mul/reshape -> sum(axis=1))", "expert-parallel")


def local_ids(node: Any, ids: np.ndarray, ctx: Any = None) -> np.ndarray:
    """Global expert ids -> this rank's slots; experts held elsewhere -> the zero dummy slot."""
    a = node.params["args"]
    start, stop = int(a["start"]), int(a["stop"])
    out = ids.astype(np.int32) - np.int32(start)
    out[(ids < start) | (ids >= stop)] = stop - start
    return out


def make_allreduce(comm: Any) -> Callable[..., np.ndarray]:
    """A host callback summing every rank's partial combine, in rank order (same bytes on every rank).
    Buffer-based Allgather: nothing is pickled."""
    size = comm.Get_size()

    def allreduce(node: Any, x: np.ndarray, ctx: Any = None) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        buf = np.empty((size, *x.shape), np.float32)
        comm.Allgather(x, buf)
        acc = buf[0].copy()
        for r in range(1, size):
            acc += buf[r]
        return acc

    return allreduce


def slice_loader(source: Callable[[], np.ndarray], s: ExpertSlice) -> Callable[[], np.ndarray]:
    """Loader of a local expert weight: the rank's rows of the global weight and a zero expert."""
    def load() -> np.ndarray:
        full = source()
        part = np.asarray(full[s.start: s.stop])
        return np.concatenate([part, np.zeros((1, *full.shape[1:]), full.dtype)], axis=0)
    return load
