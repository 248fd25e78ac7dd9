"""Load a core directory: validate everything, select programs, keep only what they need.

`load_core(path, options)` reads JSON and a safetensors header only (nothing
is unpickled, no file is opened for writing), checks the manifest and the
catalog field by field, verifies every file's checksum, applies the load
options and parses the selected programs' graphs. The `LoadedCore` it returns
holds the selected programs, their kernels and tuning entries, and nothing
else of the catalog: pruning happens in memory, the files on disk stay as
they are. Every failure is a `CoreFormatError` naming the field.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flare.core.errors import CoreFormatError
from flare.core.serialize import graph_from_dict

from .files import inside, read_json, safetensors_header
from .schema import Kernel, Manifest, Program, TuningEntry, parse_catalog, parse_manifest
from .selection import LoadOptions, Selection, select
from .validate import check_catalog, check_files, check_graph

MANIFEST = "manifest.json"


@dataclass
class LoadedCore:
    """A validated core after selection: only selected programs and what they use."""

    path: Path
    manifest: Manifest
    options: LoadOptions
    selection: Selection
    digest: str
    programs: dict[str, Program]
    graphs: dict[str, dict[str, Any]]          # program -> serialized graph (validated)
    kernels: dict[str, Kernel]                 # the run backend's kernels the programs use
    tuning: dict[str, TuningEntry]
    weights: dict[str, dict[str, Any]]         # name -> safetensors header entry (selected weights)
    weights_path: Path
    catalog_counts: dict[str, int] = field(default_factory=dict)  # before pruning, for reports

    @property
    def backend(self) -> str:
        return self.selection.backend

    @property
    def mixed(self) -> bool:
        return self.selection.mixed

    def summary(self) -> dict[str, Any]:
        """What was selected and pruned (the CLI prints it; ranks compare it)."""
        s = self.selection
        return {"core": str(self.path), "model": self.manifest.model, "backend": s.backend, "mixed_prefill": s.mixed,
                "speculative": s.speculative, "reason": s.reason, "options": self.options.to_dict(), "digest": self.digest,
                "programs": list(s.programs), "excluded": dict(s.excluded), "kernels": list(s.kernels),
                "tuning": {k: e.choice for k, e in self.tuning.items()},
                "pruned_kernels": {b: list(k) for b, k in s.pruned_kernels.items()},
                "pruned_tuning": list(s.pruned_tuning), "catalog": dict(self.catalog_counts)}


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Parse manifest.json of a core directory (no checksums): for defaults and descriptions."""
    root = Path(path)
    if not root.is_dir():
        raise CoreFormatError(f"{root} is not a core directory", "path")
    return parse_manifest(read_json(root / MANIFEST, "manifest"))


def load_core(path: str | os.PathLike, options: LoadOptions | None = None) -> LoadedCore:
    """Validate, select and prune. Raises CoreFormatError (SelectionError for bad options)."""
    options = options or LoadOptions()
    root = Path(path)
    manifest = read_manifest(root)
    files = check_files(root, manifest)
    catalog = parse_catalog(read_json(files[manifest.catalog], "catalog"))
    header = safetensors_header(files[manifest.weights], f"manifest.weights ({manifest.weights})")
    check_catalog(manifest, catalog, header)
    selection = select(manifest, catalog, options)
    graphs: dict[str, dict[str, Any]] = {}
    programs: dict[str, Program] = {}
    index = {p.name: i for i, p in enumerate(catalog.programs)}
    for name in selection.programs:
        p = catalog.programs[index[name]]
        f = f"catalog.programs[{index[name]}]"
        data = read_json(inside(root, p.graph, f"{f}.graph"), f"{f}.graph ({p.graph})")
        stubs = {w: _no_data for w in p.weights}
        graph = graph_from_dict(data, stubs, where=f"{p.graph}")
        check_graph(p, graph, header, manifest.serving, f)
        graphs[name] = data
        programs[name] = p
    counts = {"programs": len(catalog.programs), "kernels": sum(len(t) for t in catalog.kernels.values()),
              "tuning": len(catalog.tuning), "weights": len(header)}
    kernels = {k: catalog.kernels[selection.backend][k] for k in selection.kernels}
    tuning = {k: catalog.tuning[k] for k in selection.tuning}
    weights = {w: header[w] for w in selection.weights}
    return LoadedCore(root, manifest, options, selection, selection.digest(manifest), programs, graphs, kernels,
                      tuning, weights, files[manifest.weights], counts)


def _no_data() -> Any:
    raise CoreFormatError("weights are read by the runtime, not by validation", "weights")
