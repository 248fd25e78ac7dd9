"""`flare run MODEL.onnx` and `flare describe MODEL.onnx`.

run: inputs from `.npy` files (`--input NAME=FILE.npy`) or one JSON file
(`--inputs FILE.json`: `{"name": nested lists}` or `{"name": {"data": ..., "dtype": "int64"}}`),
outputs written as `NAME.npy` into `--output-dir` (written to a temporary
name, then renamed: nothing half-written), `--backends`, `--json`.
describe: the file (IR, opset, producer, ops), its inputs and outputs, then —
prepared on zeros of the bound input shapes — its segments, host steps and
each segment's splits and arena.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import Counter
from typing import Any

import numpy as np

from flare.core.errors import InputError
from flare.core.options import npy_inputs

from .errors import OnnxError


def _devices(text: str) -> list[str]:
    from flare.core.session import device_list

    return device_list(text, "--backends")


def load_inputs(model: Any, items: list[str], json_file: str | None, shapes: dict[str, list[int]] | None = None,
                zeros: bool = True) -> dict[str, np.ndarray]:
    """The model's inputs from --input/--inputs; zeros of the declared shape where all dims are known."""
    given: dict[str, np.ndarray] = {}
    info = model.input_info()
    if json_file:
        try:
            with open(json_file) as f:
                doc = json.load(f)
        except (OSError, ValueError) as exc:
            raise InputError(f"--inputs {json_file}: cannot read as JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise InputError(f"--inputs {json_file}: expected an object of input name -> array")
        for name, value in doc.items():
            dtype = info.get(name, (None, None))[1]
            if isinstance(value, dict):
                dtype = np.dtype(value.get("dtype", dtype or "float32"))
                value = value.get("data")
            try:
                given[name] = np.asarray(value, dtype=dtype)
            except (TypeError, ValueError) as exc:
                raise InputError(f"--inputs {json_file}: input {name!r}: {exc}") from None
    given.update(npy_inputs(items))
    for name in given:
        if name not in info:
            raise InputError(f"input {name!r}: {os.path.basename(model.path)} has no such input "
                             f"(inputs: {', '.join(info) or 'none'})")
    for name, (dims, dtype) in info.items():
        if name in given:
            continue
        bound = (shapes or {}).get(name)
        if bound is None:
            if not zeros or any(not isinstance(d, int) or d < 0 for d in dims):
                raise InputError(f"input {name!r} has dims {dims} (symbolic ones need a value): give it with "
                                 f"--input {name}=FILE.npy or --inputs FILE.json")
            bound = dims
        if dtype is None:
            raise InputError(f"input {name!r}: its element type is not supported")
        given[name] = np.zeros(bound, dtype=dtype)
    return given


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "output"


def write_outputs(outputs: dict[str, np.ndarray], folder: str) -> list[str]:
    """NAME.npy per output, each written to a temporary file and renamed."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, arr in outputs.items():
        path = os.path.join(folder, _safe_name(name) + ".npy")
        tmp = path + ".partial"
        try:
            with open(tmp, "wb") as f:
                np.save(f, arr, allow_pickle=False)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        paths.append(path)
    return paths


def run_file(path: str, argv: list[str]) -> int:
    from flare.core.session import Session

    from .loader import load_model
    from .runner import OnnxRunner

    p = argparse.ArgumentParser(prog=f"flare run {os.path.basename(path)}",
                                description="Run an ONNX model through Flare's importer.")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="an input array")
    p.add_argument("--inputs", default=None, metavar="FILE.json", help="inputs as one JSON object")
    p.add_argument("-o", "--output-dir", default=None, help="write each output as NAME.npy here")
    p.add_argument("--backends", default="cpu", help="devices in priority order, e.g. vulkan,cpu (default cpu)")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    args = p.parse_args(argv)
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such ONNX file")
    model = load_model(path)
    inputs = load_inputs(model, args.input, args.inputs)
    with Session(_devices(args.backends)) as sess:
        runner = OnnxRunner(model, sess)
        try:
            start = time.perf_counter()
            outputs = runner.run(inputs)
            seconds = time.perf_counter() - start
            segments = list(runner.last_segments)
            stats = dict(runner.stats)
        finally:
            runner.release()
    written = write_outputs(outputs, args.output_dir) if args.output_dir else []
    report = {"model": path, "backends": args.backends, "seconds": round(seconds, 4), "segments": segments,
              "host_steps": stats["host_steps"],
              "outputs": {n: {"shape": list(a.shape), "dtype": str(a.dtype),
                              "mean": float(np.mean(a)) if a.size and a.dtype.kind in "fiub" else None}
                          for n, a in outputs.items()},
              "written": written}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{os.path.basename(path)} on {args.backends}: {len(segments)} segment(s), {stats['host_steps']} host step(s), "
          f"{seconds * 1000:.1f} ms")
    for n, o in report["outputs"].items():
        mean = "" if o["mean"] is None else f", mean {o['mean']:.6g}"
        print(f"  {n}: {o['dtype']} {tuple(o['shape'])}{mean}")
    for w in written:
        print(f"  wrote {w}")
    return 0


def describe_file(path: str, args: Any) -> int:
    from flare.core.session import Session

    from .loader import load_model
    from .runner import OnnxRunner, check_supported, expand

    if not os.path.isfile(path):
        raise InputError(f"{path}: no such ONNX file")
    model = load_model(path)
    shapes = {}
    for item in getattr(args, "option", []) or []:
        name, sep, text = item.partition("=")
        try:
            dims = json.loads(text)
            assert isinstance(dims, list) and all(isinstance(d, int) and d >= 0 for d in dims)
        except (ValueError, AssertionError):
            raise InputError(f"--option {item!r}: expected INPUT=[dims] (binds an input's shape)") from None
        shapes[name] = dims
    ops = Counter(n.op_type for n in model.graph.node)
    info: dict[str, Any] = {
        "model": path, "ir_version": model.proto.ir_version, "opset": model.opset,
        "producer": f"{model.proto.producer_name} {model.proto.producer_version}".strip(),
        "nodes": len(model.graph.node), "op_types": dict(sorted(ops.items())),
        "initializers": len(model.initializers),
        "weight_bytes": int(sum(a.nbytes for a in model.initializers.values())),
        "inputs": {n: {"dims": d, "dtype": str(t)} for n, (d, t) in model.input_info().items()},
        "outputs": model.output_names,
    }
    check_supported(expand(model))
    inputs = load_inputs(model, [], None, shapes)
    with Session(_devices(args.backends)) as sess:
        runner = OnnxRunner(model, sess)
        try:
            runner.run(inputs)
            info["segments"] = runner.last_segments
            info["host_steps"] = runner.stats["host_steps"]
            info["folded_nodes"] = runner.stats["folded"]
            graphs = []
            for pg in runner.prepared_graphs():
                d = pg.describe()
                e = d["entries"]["main"]
                graphs.append({"nodes": e["nodes"], "splits": e["splits"], "copies": e["copies"],
                               "split_list": e["split_list"],
                               "arena": {dev: a["planned"] for dev, a in e["arena"].items()}})
            info["prepared"] = graphs
        finally:
            runner.release()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(f"{os.path.basename(path)}: IR {info['ir_version']}, opset {info['opset']}, {info['producer'] or 'unknown producer'}")
    print(f"  {info['nodes']} nodes, {len(ops)} op types, {info['initializers']} initializers "
          f"({info['weight_bytes'] / 1e6:.2f} MB)")
    print("  ops: " + ", ".join(f"{k} {v}" for k, v in info["op_types"].items()))
    for n, i in info["inputs"].items():
        print(f"  input {n}: {i['dtype']} {i['dims']}")
    print(f"  outputs: {', '.join(info['outputs'])}")
    print(f"  on {args.backends}: {len(info['segments'])} segment(s), {info['host_steps']} host step(s), "
          f"{info['folded_nodes']} node(s) folded at import")
    for i, g in enumerate(info["prepared"]):
        splits = ", ".join(f"{s['device']}{' (host)' if s['host'] else ''} {s['nodes']}" for s in g["split_list"])
        arena = ", ".join(f"{dev} {b} B" for dev, b in g["arena"].items() if b)
        print(f"  segment {i}: {g['nodes']} nodes; splits: {splits}; arena: {arena or '-'}")
    return 0


__all__ = ["run_file", "describe_file", "load_inputs", "write_outputs", "OnnxError"]
