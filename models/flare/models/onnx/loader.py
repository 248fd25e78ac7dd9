"""Read and validate an ONNX file: protobuf, IR version, opsets, references, weights.

Weights are the file's initializers (and `Constant` nodes), read with
`onnx.numpy_helper` — raw tensor data, never a pickle. External data must lie
inside the model's folder (no absolute paths, no `..` escaping it) and hold at
least the bytes its shape needs. Every problem is an `OnnxError` naming the
file and the node or tensor, found here at load time rather than mid-run.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import OnnxError

MIN_IR_VERSION = 3
DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclass
class OnnxModel:
    """A parsed, checked model: the graph proto, its weights, the default-domain opset."""

    proto: Any                       # onnx.ModelProto (external data already resolved)
    path: str
    opset: int
    initializers: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def graph(self):
        return self.proto.graph

    @property
    def input_names(self) -> list[str]:
        """Graph inputs the caller gives (initializers listed as inputs are defaults, not inputs)."""
        return [i.name for i in self.graph.input if i.name not in self.initializers]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.graph.output]

    def input_info(self) -> dict[str, tuple[list[int | str | None], Any]]:
        """name -> (dims: int, a symbolic name, or None; numpy dtype or None)."""
        from .values import np_dtype_of

        out = {}
        for v in self.graph.input:
            if v.name in self.initializers:
                continue
            tt = v.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
            out[v.name] = (dims, np_dtype_of(tt.elem_type, v.name, strict=False))
        return out


def load_model(path: str | os.PathLike, *, check: bool = True) -> OnnxModel:
    """Parse `path` and validate it; an `OnnxError` names what is wrong and where."""
    import onnx

    path = str(path)
    where = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as exc:
        raise OnnxError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        proto = onnx.ModelProto()
        proto.ParseFromString(blob)
    except Exception as exc:  # protobuf's DecodeError and friends: a truncated or non-ONNX file
        raise OnnxError(f"{where}: not a readable ONNX protobuf (truncated or corrupt?): {type(exc).__name__}") from None
    del blob  # the file's bytes are the proto now: not a third copy of the weights while they are read
    return from_proto(proto, path, check=check)


def from_proto(proto: Any, path: str = "<memory>", *, check: bool = True) -> OnnxModel:
    """Validate an in-memory ModelProto (external data resolved against `path`'s folder)."""
    where = os.path.basename(path)
    if not proto.HasField("graph") or not proto.graph.node and not proto.graph.output:
        raise OnnxError(f"{where}: no graph in the file (truncated, or not an ONNX model)")
    if proto.ir_version < MIN_IR_VERSION:
        raise OnnxError(f"{where}: IR version {proto.ir_version} is not supported (need >= {MIN_IR_VERSION})")
    import onnx

    if proto.ir_version > onnx.IR_VERSION:
        raise OnnxError(f"{where}: IR version {proto.ir_version} is newer than this onnx package knows "
                        f"({onnx.IR_VERSION})")
    opset = 0
    for imp in proto.opset_import:
        if imp.domain in DEFAULT_DOMAINS:
            opset = int(imp.version)
    if opset == 0 and any(n.domain in DEFAULT_DOMAINS for n in proto.graph.node):
        raise OnnxError(f"{where}: no opset for the default ONNX domain in opset_import")
    base = Path(path).resolve().parent if path != "<memory>" else None
    _check_references(proto.graph, where)
    initializers = {}
    for t in proto.graph.initializer:
        initializers[t.name] = read_tensor(t, base, where)
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS:
            for a in node.attribute:
                if a.name == "value" and a.HasField("t"):
                    read_tensor(a.t, base, where, owner=f"node {node.name or node.output[0]!r}")
    if check:
        _check_with_onnx(proto, where)
    return OnnxModel(proto, path, opset, initializers)


def _check_references(graph: Any, where: str) -> None:
    """Every node input is a graph input, an initializer or an earlier node's output."""
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    for i, node in enumerate(graph.node):
        label = node.name or f"#{i} ({node.op_type})"
        for name in node.input:
            if name not in known:
                raise OnnxError(f"{where}: node {label!r} names input {name!r}, which no earlier node, "
                                f"initializer or graph input provides")
        known.update(node.output)
    for out in graph.output:
        if out.name not in known:
            raise OnnxError(f"{where}: graph output {out.name!r} is produced by no node")


def read_tensor(t: Any, base: Path | None, where: str, owner: str | None = None) -> np.ndarray:
    """A TensorProto as an array; external data read from inside the model's folder only."""
    from onnx import TensorProto, numpy_helper

    label = owner or f"initializer {t.name!r}"
    if t.data_location == TensorProto.EXTERNAL:
        return _read_external(t, base, where, label)
    dims = tuple(int(d) for d in t.dims)
    if any(d < 0 for d in dims):
        raise OnnxError(f"{where}: {label} has negative dims {dims}")
    try:
        arr = numpy_helper.to_array(t)
    except Exception as exc:
        raise OnnxError(f"{where}: {label} cannot be read: {type(exc).__name__}: {exc}") from None
    if arr.shape != dims:
        raise OnnxError(f"{where}: {label} holds {arr.size} elements, its shape {dims} needs "
                        f"{int(np.prod(dims, dtype=np.int64))}")
    return arr


def _read_external(t: Any, base: Path | None, where: str, label: str) -> np.ndarray:
    from onnx import helper

    info = {e.key: e.value for e in t.external_data}
    loc = info.get("location", "")
    if base is None:
        raise OnnxError(f"{where}: {label} uses external data but the model was not loaded from a file")
    if not loc or os.path.isabs(loc):
        raise OnnxError(f"{where}: {label} external data location {loc!r} must be a relative path inside the model's folder")
    target = (base / loc).resolve()
    if base not in target.parents:
        raise OnnxError(f"{where}: {label} external data {loc!r} points outside the model's folder")
    if not target.is_file():
        raise OnnxError(f"{where}: {label} external data file {loc!r} does not exist")
    dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
    dims = tuple(int(d) for d in t.dims)
    need = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    offset = int(info.get("offset", 0) or 0)
    length = int(info.get("length", need) or need)
    size = target.stat().st_size
    if offset < 0 or length < need or offset + need > size:
        raise OnnxError(f"{where}: {label} external data {loc!r} holds {max(0, min(length, size - offset))} "
                        f"bytes, its shape {dims} needs {need}")
    with open(target, "rb") as f:
        f.seek(offset)
        raw = f.read(need)
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(dims).astype(dtype)


def _without_initializers(proto: Any) -> Any:
    """The model with each initializer declared as a graph input instead (name, type, shape),
    for onnx.checker: it serializes what it checks into C++ (two more copies of the weights:
    Piper's 63 MB file raised the peak RSS by ~70 MB), and `read_tensor` has checked every
    initializer's data against its shape already."""
    import onnx

    def copy_fields(src: Any, dst: Any, skip: tuple[str, ...]) -> None:
        for field, value in src.ListFields():
            if field.name in skip:
                continue
            if hasattr(value, "extend"):         # a repeated field
                getattr(dst, field.name).extend(value)
            elif hasattr(value, "CopyFrom"):     # a message
                getattr(dst, field.name).CopyFrom(value)
            else:
                setattr(dst, field.name, value)

    graph = proto.graph
    light = onnx.ModelProto()
    copy_fields(proto, light, ("graph",))
    copy_fields(graph, light.graph, ("initializer", "sparse_initializer"))
    declared = {v.name for v in graph.input}
    for t in list(graph.initializer) + [s.values for s in graph.sparse_initializer]:
        if t.name not in declared:
            light.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return light


def _check_with_onnx(proto: Any, where: str) -> None:
    """onnx.checker on the model (skipped for external weights: read_tensor checked those)."""
    import onnx

    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
        return
    try:
        onnx.checker.check_model(_without_initializers(proto), full_check=False)
    except onnx.checker.ValidationError as exc:
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        raise OnnxError(f"{where}: {lines[0] if lines else type(exc).__name__}") from None
