"""Cross-checks of a parsed core: files against checksums, catalog against itself and the weights.

`flare.plugins.export.schema` checks each field on its own; this module checks what
fields say about each other: every file the manifest lists exists inside the
core with its size and sha256; every path the catalog uses is one of them;
every kernel, tuning entry and weight a program names exists; tuning choices
are variants of their kernel; buckets fit and cover the serving range; and a
program's graph agrees with its bucket and the batch contract. All failures
are `CoreFormatError` naming the field.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from flare.core.errors import CoreFormatError
from flare.core.graph import Graph
from flare.core.ops import OPS

from .files import inside, sha256_file
from .schema import DRAFT, EVERY_ROW, MIXED, SPECULATIVE, VERIFY, Catalog, Manifest, Program, Serving


def check_files(root: Path, manifest: Manifest) -> dict[str, Path]:
    """Resolve, size-check and checksum every listed file; returns path -> absolute Path."""
    out: dict[str, Path] = {}
    for rel, entry in manifest.files.items():
        f = f"manifest.files[{rel!r}]"
        path = inside(root, rel, f)
        if rel == "manifest.json":
            raise CoreFormatError("the manifest cannot list itself", f)
        if not path.is_file():
            raise CoreFormatError("file is missing (or not a regular file)", f)
        size = path.stat().st_size
        if size != entry.bytes:
            raise CoreFormatError(f"file has {size} bytes, the manifest says {entry.bytes}", f"{f}.bytes")
        if sha256_file(path) != entry.sha256:
            raise CoreFormatError("sha256 does not match the file (modified or corrupt)", f"{f}.sha256")
        out[rel] = path
    for key in ("catalog", "weights"):
        rel = getattr(manifest, key)
        inside(root, rel, f"manifest.{key}")
        if rel not in manifest.files:
            raise CoreFormatError(f"{rel!r} is not among the checksummed files", f"manifest.{key}")
    return out


def check_catalog(manifest: Manifest, catalog: Catalog, weights: Mapping[str, Mapping[str, Any]]) -> None:
    """References between programs, kernels, tuning entries, files and weights; bucket coverage."""
    serving = manifest.serving
    for backend in catalog.kernels:
        if backend not in catalog.backends:
            raise CoreFormatError(f"backend {backend!r} is not in catalog.backends", f"catalog.kernels.{backend}")
    for key, e in catalog.tuning.items():
        f = f"catalog.tuning.entries[{key!r}]"
        table = catalog.kernels.get(e.backend)
        if table is None:
            raise CoreFormatError(f"backend {e.backend!r} has no kernel table", f"{f}.backend")
        kernel = table.get(e.kernel)
        if kernel is None:
            raise CoreFormatError(f"kernel {e.kernel!r} is not in catalog.kernels.{e.backend}", f"{f}.kernel")
        if e.choice not in kernel.variants:
            raise CoreFormatError(f"{e.choice!r} is not a variant of {e.backend}/{e.kernel} {list(kernel.variants)}",
                                  f"{f}.choice")
        for variant in e.seconds:
            if variant not in kernel.variants:
                raise CoreFormatError(f"{variant!r} is not a variant of {e.backend}/{e.kernel}", f"{f}.seconds")
    for i, p in enumerate(catalog.programs):
        _check_program(manifest, catalog, weights, p, f"catalog.programs[{i}]")
    mixed = [p for p in catalog.programs if p.kind == MIXED]
    if mixed and not catalog.mixed_supported:
        raise CoreFormatError(f"says mixed programs are unsupported but lists {mixed[0].name!r}", "catalog.mixed.supported")
    if manifest.mixed_prefill_default and not mixed:
        raise CoreFormatError("is true but the catalog has no mixed program", "manifest.defaults.mixed_prefill")
    _check_speculative(catalog)
    _check_coverage(serving, catalog)


def _check_speculative(catalog: Catalog) -> None:
    """Draft and verify programs come together, only when `catalog.speculative` says so, and every
    backend with a draft program can verify K proposals of one sequence."""
    spec = catalog.speculative
    kinds = {p.kind for p in catalog.programs}
    listed = [p for p in catalog.programs if p.kind in SPECULATIVE]
    if listed and not spec.supported:
        raise CoreFormatError(f"says speculative decoding is unsupported but lists {listed[0].name!r}",
                              "catalog.speculative.supported")
    if spec.supported and not {DRAFT, VERIFY} <= kinds:
        raise CoreFormatError("says speculative decoding is supported but lacks draft or verify programs",
                              "catalog.speculative.supported")
    for backend in catalog.backends:
        progs = [p for p in catalog.programs if backend in p.kernels]
        if any(p.kind == DRAFT for p in progs):
            most = max((p.bucket.tokens for p in progs if p.kind == VERIFY), default=0)
            if most < spec.max_draft + 1:
                raise CoreFormatError(f"verify programs for {backend} hold {most} tokens; max_draft "
                                      f"{spec.max_draft} needs {spec.max_draft + 1}", "catalog.speculative.max_draft")


def _check_program(manifest: Manifest, catalog: Catalog, weights: Mapping[str, Any], p: Program, f: str) -> None:
    if p.graph not in manifest.files:
        raise CoreFormatError(f"{p.graph!r} is not among the checksummed files", f"{f}.graph")
    if not p.kernels:
        raise CoreFormatError("lists no backend", f"{f}.kernels")
    for backend, names in p.kernels.items():
        if backend not in catalog.backends:
            raise CoreFormatError(f"backend {backend!r} is not in catalog.backends", f"{f}.kernels.{backend}")
        table = catalog.kernels.get(backend, {})
        for j, k in enumerate(names):
            if k not in table:
                raise CoreFormatError(f"kernel {k!r} is not in catalog.kernels.{backend}", f"{f}.kernels.{backend}[{j}]")
    for j, key in enumerate(p.tuning):
        entry = catalog.tuning.get(key)
        if entry is None:
            raise CoreFormatError(f"tuning entry {key!r} is not in catalog.tuning.entries", f"{f}.tuning[{j}]")
        if entry.kernel not in p.kernels.get(entry.backend, ()):
            raise CoreFormatError(f"tuning entry {key!r} tunes {entry.backend}/{entry.kernel}, which the program does "
                                  "not use", f"{f}.tuning[{j}]")
    for j, w in enumerate(p.weights):
        if w not in weights:
            raise CoreFormatError(f"weight {w!r} is not in {manifest.weights}", f"{f}.weights[{j}]")
    if p.bucket.batch > manifest.serving.max_seqs:
        raise CoreFormatError(f"batch {p.bucket.batch} exceeds serving.max_seqs {manifest.serving.max_seqs}",
                              f"{f}.bucket.batch")


def _check_coverage(serving: Serving, catalog: Catalog) -> None:
    """Every prefill chunk up to max_prefill_tokens and every decode batch up to max_seqs has a
    program on every backend (padding fills the rest of a bucket)."""
    for backend in catalog.backends:
        progs = [p for p in catalog.programs if backend in p.kernels]
        prefill = max((p.bucket.tokens for p in progs if p.kind == "prefill"), default=0)
        decode = max((p.bucket.batch for p in progs if p.kind == "decode"), default=0)
        if prefill < serving.max_prefill_tokens:
            raise CoreFormatError(f"prefill programs for {backend} reach {prefill} tokens; the serving range needs "
                                  f"{serving.max_prefill_tokens} (manifest.serving.max_prefill_tokens)", "catalog.programs")
        if decode < serving.max_seqs:
            raise CoreFormatError(f"decode programs for {backend} reach batch {decode}; the serving range needs "
                                  f"{serving.max_seqs} (manifest.serving.max_seqs)", "catalog.programs")


def check_graph(p: Program, graph: Graph, weights: Mapping[str, Mapping[str, Any]], serving: Serving, f: str) -> None:
    """A program's graph against its catalog entry, the weights file and the token-lm contract."""
    for name, t in graph.weights.items():
        info = weights.get(name)
        if name not in p.weights:
            raise CoreFormatError(f"graph reads weight {name!r}, which the program does not list", f"{f}.weights")
        if info is None or tuple(info["shape"]) != t.shape or info["dtype"] != t.dtype:
            have = f"{info['dtype']} {list(info['shape'])}" if info else "nothing"
            raise CoreFormatError(f"graph weight {name!r} is {t.dtype} {list(t.shape)}, the weights file has {have}",
                                  f"{f}.graph")
    used = {n.op for n in graph.nodes if OPS[n.op].view is None and n.op != "host"}
    listed = set().union(*p.kernels.values())
    missing = sorted(used - listed)
    if missing:
        raise CoreFormatError(f"graph uses ops {missing} with no kernel listed for any backend", f"{f}.kernels")
    T, B = p.bucket.tokens, p.bucket.batch
    want = {"tokens": ((T,), "i32"), "pos": ((T,), "i32"), "kv_rows": ((T,), "i32"),
            "mask": ((T, serving.kv_rows), "f32")}
    if p.kind not in EVERY_ROW:
        want["out_rows"] = ((B,), "i32")
    have = {n: (t.shape, t.dtype) for n, t in graph.inputs.items()}
    if have != want:
        raise CoreFormatError(f"graph inputs {have} do not match the {serving.contract} contract for bucket "
                              f"(tokens={T}, batch={B}): {want}", f"{f}.graph")
    logits = graph.outputs.get("logits")
    rows = T if p.kind in EVERY_ROW else B
    if logits is None or logits.shape != (rows, serving.vocab):
        got = list(logits.shape) if logits is not None else None
        raise CoreFormatError(f"output 'logits' must be [{rows}, {serving.vocab}], got {got}", f"{f}.graph")
