"""`export_core`: build every program of a model, find its kernels, tune, write a core atomically.

Steps (with a progress bar): capture each program's graph for its bucket and
serialize it; ask each export backend's device which of the program's
kernels it runs (`supports`); time the variants of tunable kernels on the
programs' own shapes; write programs, weights, catalog and — last — the
manifest with every file's checksum into a temporary sibling directory;
load that directory back with the real loader; and only then rename it to
the target. A failure anywhere leaves no directory behind.
"""
from __future__ import annotations

import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Mapping, Sequence

from flare.core import __version__
from flare.core.errors import FlareError, InputError
from flare.core.graph import Graph, GraphBuilder
from flare.core.ops import OPS
from flare.core.serialize import graph_to_dict
from flare.core.session import Session

from . import tuning as tuning_mod
from .adapters import ExportAdapter, ProgramSpec, get_adapter
from .files import CoreExistsError, atomic_directory, sha256_file, write_json
from .loader import load_core
from .schema import (FORMAT_VERSION, Bucket, Catalog, FileEntry, Kernel, Manifest, Program, Speculative,
                     TuningEntry, catalog_to_dict, manifest_to_dict)

WEIGHTS = "weights.safetensors"
CATALOG = "catalog.json"


def _progress(enabled: bool):
    if not enabled:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=False)


class _Steps:
    """A progress task, or nothing when the bar is off."""

    def __init__(self, progress: Any, description: str, total: int):
        self.progress = progress
        self.task = progress.add_task(description, total=total) if progress is not None else None

    def advance(self, note: str | None = None) -> None:
        if self.task is not None:
            self.progress.advance(self.task)
            if note:
                self.progress.update(self.task, description=note[:34])


def _kernels(graph: Graph, devices: Mapping[str, Any]) -> dict[str, list[str]]:
    """backend -> ops of `graph` that backend's device runs (views and host nodes need none)."""
    out: dict[str, set[str]] = {b: set() for b in devices}
    for node in graph.nodes:
        if OPS[node.op].view is not None or node.op == "host":
            continue
        for backend, dev in devices.items():
            if dev.supports(node):
                out[backend].add(node.op)
    return {b: sorted(ops) for b, ops in out.items()}


def export_core(
    model: str | ExportAdapter,
    out: str | os.PathLike,
    *,
    tuning: str = "quick",
    backends: Sequence[str] = ("cpu",),
    options: Mapping[str, Any] | None = None,
    mixed: bool | None = None,
    mixed_default: bool | None = None,
    force: bool = False,
    progress: bool = True,
    draft_layers: int | None = None,
    max_draft: int = 4,
) -> Path:
    """Export `model` to the core directory `out`; returns its path.

    mixed: export mixed programs (default: when the model supports them; True on a model without
    support is an error). mixed_default: what `flare run` does without --[no-]mixed-prefill
    (default: on when mixed programs were exported). backends: devices to plan and tune for
    (cpu is always included: it is the fallback of every other backend). draft_layers: layers of the
    self-draft for speculative decoding (None: the model's default; 0: no draft programs; the model's
    layer count: the model drafting for itself, the ideal case); max_draft: most proposals a verify
    program checks per sequence.
    """
    if tuning not in tuning_mod.MODES:
        raise InputError(f"--tuning must be one of {', '.join(tuning_mod.MODES)}, not {tuning!r}")
    adapter = model if isinstance(model, ExportAdapter) else get_adapter(model, options)
    supported, why = adapter.mixed_support()
    if mixed and not supported:
        raise InputError(f"cannot export mixed programs for {adapter.name}: {why}")
    with_mixed = supported if mixed is None else bool(mixed)
    if mixed_default and not with_mixed:
        raise InputError("mixed prefill cannot be the default of a core without mixed programs")
    default = with_mixed if mixed_default is None else bool(mixed_default)
    backends = list(dict.fromkeys([*backends, "cpu"]))
    serving = adapter.serving()
    specs = adapter.programs(with_mixed)
    default_layers, draft_why = adapter.draft_support()
    layers = default_layers if draft_layers is None else int(draft_layers)
    if layers and not default_layers:
        raise FlareError(f"cannot export draft programs for {adapter.name}: {draft_why}")
    if layers and not 1 <= max_draft <= 64:
        raise FlareError(f"max_draft must be in 1..64, not {max_draft}")
    if layers:
        specs += adapter.draft_programs(layers, max_draft)
        if layers != default_layers:
            draft_why = f"draft of {layers} layers (the model's default: {default_layers})"
        speculative = Speculative(True, draft_why, layers, max_draft)
    else:
        speculative = Speculative(False, draft_why if not default_layers else "export without draft programs")
    out = Path(out)
    if out.exists() and not force:   # before any work; atomic_directory checks again at the end
        raise CoreExistsError(f"{out} exists (use --force to replace it)")
    with _progress(progress) as bar, Session(backends) as sess:
        devices = {d.backend: d for d in sess.devices}
        built: list[tuple[ProgramSpec, Graph, dict[str, Any]]] = []
        steps = _Steps(bar, "capturing programs", len(specs))
        for spec in specs:
            b = GraphBuilder()
            spec.build(b, spec.shapes)
            graph = b.build()
            built.append((spec, graph, graph_to_dict(graph)))
            steps.advance(f"captured {spec.name}")
        kernels = {name: _kernels(g, devices) for (s, g, _) in built for name in [s.name]}
        wanted = {b: tuning_mod.collect(((s.tokens, g) for s, g, _ in built), dev) for b, dev in devices.items()}
        jobs = [(b, k, t, shapes) for b, table in wanted.items() for (k, t), shapes in sorted(table.items())]
        steps = _Steps(bar, f"tuning ({tuning})", len(jobs))
        entries: dict[str, TuningEntry] = {}
        for b, k, t, shapes in jobs:
            e = tuning_mod.measure(sess, devices[b], k, t, shapes, tuning)
            entries[e.key] = e
            steps.advance(f"tuned {e.key}")
        programs = []
        for spec, graph, _ in built:
            keys = [tuning_mod.tuning_key(b, k, spec.tokens) for b in devices for k in kernels[spec.name][b]
                    if tuning_mod.tuning_key(b, k, spec.tokens) in entries]
            programs.append(Program(spec.name, spec.kind, Bucket(spec.tokens, spec.batch), f"programs/{spec.name}.json",
                                    {b: tuple(ks) for b, ks in kernels[spec.name].items()}, tuple(keys),
                                    tuple(sorted(graph.weights))))
        table = {b: {k: Kernel(b, k, tuning_mod.variants(devices[b], k), tuning_mod.variants(devices[b], k)[0])
                     for k in sorted({k for p in programs for k in p.kernels[b]})} for b in devices}
        catalog = Catalog(FORMAT_VERSION, tuple(devices), tuple(programs), table, tuning, entries,
                          supported, why, speculative)
        steps = _Steps(bar, "writing core", len(built) + 3)
        with atomic_directory(out, overwrite=force) as tmp:
            for spec, _, data in built:
                write_json(tmp / "programs" / f"{spec.name}.json", data)
                steps.advance()
            adapter.write_weights(tmp / WEIGHTS)
            steps.advance("wrote weights")
            write_json(tmp / CATALOG, catalog_to_dict(catalog))
            files = {}
            for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
                rel = path.relative_to(tmp).as_posix()
                files[rel] = FileEntry(rel, sha256_file(path), path.stat().st_size)
            steps.advance("checksummed files")
            created = {"flare_version": __version__, "tuning": tuning, "backends": list(devices),
                       "unix_time": int(time.time()), "mixed_exported": with_mixed}
            manifest = Manifest(FORMAT_VERSION, adapter.name, adapter.name, adapter.config(), files, CATALOG, WEIGHTS,
                                default, serving, created)
            write_json(tmp / "manifest.json", manifest_to_dict(manifest))
            load_core(tmp)  # the reader must accept what the writer wrote, before anyone can see it
            steps.advance("verified")
    return out


def cached_core(model: str, name: str, options: Mapping[str, Any] | None = None) -> Path:
    """A core exported once into the cache directory (`bench/cores/NAME`) and reused after (benchmarks)."""
    from flare.core.cache import cache_dir

    path = cache_dir("bench", "cores") / name
    if not path.exists():
        export_core(model, path, options=options, progress=False)
    return path
