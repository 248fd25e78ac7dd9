"""Invalid cores: every defect is a CoreFormatError naming the field, and loading changes no file.

Each case copies a valid toy core, edits manifest or catalog (re-computing
checksums where the point is a deeper defect than a checksum mismatch),
and checks the error's field. `test_fuzz_manifest_and_catalog` lets
hypothesis mutate both files freely.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flare.core.errors import CoreFormatError
from flare.plugins.export import LoadOptions, export_core, load_core
from flare.plugins.export.files import sha256_file, tree_digest
from flare.plugins.export.testing import ToyLM


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    return export_core(ToyLM(), tmp_path_factory.mktemp("golden") / "toy.core", progress=False)


def _copy(golden: Path, dest: Path) -> Path:
    shutil.copytree(golden, dest)
    return dest


def _edit(core: Path, name: str, fn: Callable[[Any], Any], rehash: bool = True) -> None:
    path = core / name
    data = fn(json.loads(path.read_text()))
    path.write_text(json.dumps(data))
    if rehash and name != "manifest.json":
        _rehash(core)


def _rehash(core: Path) -> None:
    m = json.loads((core / "manifest.json").read_text())
    for rel, e in m["files"].items():
        p = core / rel
        if p.is_file():
            e["sha256"], e["bytes"] = sha256_file(p), p.stat().st_size
    (core / "manifest.json").write_text(json.dumps(m))


def _prog(cat: dict, name: str) -> dict:
    return next(p for p in cat["programs"] if p["name"] == name)


def _set(path: list, value: Any) -> Callable[[Any], Any]:
    def fn(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return d
    return fn


def _catalog(fn: Callable[[dict], None]) -> Callable[[Any], Any]:
    def wrap(cat):
        fn(cat)
        return cat
    return wrap


CASES = [
    # (id, file, edit, field the error must name)
    ("format", "manifest.json", _set(["format"], "other"), "manifest.format"),
    ("version", "manifest.json", _set(["format_version"], 99), "manifest.format_version"),
    ("model-missing", "manifest.json", lambda m: {k: v for k, v in m.items() if k != "model"}, "manifest.model"),
    ("serving-type", "manifest.json", _set(["serving", "max_seqs"], "4"), "manifest.serving.max_seqs"),
    ("default-type", "manifest.json", _set(["defaults", "mixed_prefill"], 1), "manifest.defaults.mixed_prefill"),
    ("sha-format", "manifest.json", _set(["files", "catalog.json", "sha256"], "abc"), "manifest.files['catalog.json'].sha256"),
    ("path-escape", "manifest.json", _set(["files", "../outside.json"], {"sha256": "0" * 64, "bytes": 1}),
     "manifest.files['../outside.json']"),
    ("absolute-path", "manifest.json", _set(["catalog"], "/etc/passwd"), "manifest.catalog"),
    ("catalog-unlisted", "manifest.json", _set(["catalog"], "programs/decode-t1-b1.json"), "catalog.format_version"),
    ("catalog-version", "catalog.json", _set(["format_version"], 2), "catalog.format_version"),
    ("duplicate-program", "catalog.json",
     _catalog(lambda c: _prog(c, "decode-t2-b2").__setitem__("name", "decode-t1-b1")), "catalog.programs[4].name"),
    ("unknown-kind", "catalog.json", _catalog(lambda c: _prog(c, "decode-t1-b1").__setitem__("kind", "both")),
     "catalog.programs[3].kind"),
    ("missing-kernel", "catalog.json", _catalog(lambda c: c["kernels"]["cpu"].pop("scale")),
     "catalog.programs[6].kernels.cpu[3]"),
    ("missing-tuning", "catalog.json", _catalog(lambda c: c["tuning"]["entries"].pop("cpu.matmul.t4")),
     "catalog.programs[2].tuning[0]"),
    ("tuning-bad-choice", "catalog.json",
     _catalog(lambda c: c["tuning"]["entries"]["cpu.matmul.t1"].__setitem__("choice", "magic")),
     "catalog.tuning.entries['cpu.matmul.t1'].choice"),
    ("missing-weight", "catalog.json", _catalog(lambda c: _prog(c, "decode-t1-b1")["weights"].append("ghost")),
     "catalog.programs[3].weights[2]"),
    ("graph-unlisted", "catalog.json", _catalog(lambda c: _prog(c, "decode-t1-b1").__setitem__("graph", "x.json")),
     "catalog.programs[3].graph"),
    ("coverage", "catalog.json",
     _catalog(lambda c: c.__setitem__("programs", [p for p in c["programs"] if p["name"] != "decode-t4-b4"])),
     "catalog.programs"),
    ("bucket-vs-graph", "catalog.json",
     _catalog(lambda c: _prog(c, "decode-t2-b2").__setitem__("bucket", {"tokens": 4, "batch": 4})),
     "catalog.programs[4].graph"),
    ("batch-over-range", "catalog.json",
     _catalog(lambda c: _prog(c, "mixed-t7-b4").__setitem__("bucket", {"tokens": 7, "batch": 5})),
     "catalog.programs[7].bucket.batch"),
    ("mixed-flag", "catalog.json", _set(["mixed", "supported"], False), "catalog.mixed.supported"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_invalid_core_names_the_field(golden: Path, tmp_path: Path, case) -> None:
    _, name, edit, field = case
    core = _copy(golden, tmp_path / "c.core")
    _edit(core, name, edit)
    before = tree_digest(core)
    with pytest.raises(CoreFormatError) as info:
        load_core(core, LoadOptions(mixed_prefill=True))
    assert info.value.field == field, str(info.value)
    assert tree_digest(core) == before


def test_checksum_mismatch(golden: Path, tmp_path: Path) -> None:
    core = _copy(golden, tmp_path / "c.core")
    _edit(core, "catalog.json", _set(["tuning", "mode"], "audit"), rehash=False)
    with pytest.raises(CoreFormatError) as info:
        load_core(core)
    assert info.value.field == "manifest.files['catalog.json'].bytes" or info.value.field.endswith(".sha256")


def test_tampered_graph_and_weights(golden: Path, tmp_path: Path) -> None:
    core = _copy(golden, tmp_path / "c.core")
    with open(core / "weights.safetensors", "r+b") as fh:   # same size, different bytes
        fh.seek(-4, os.SEEK_END)
        fh.write(b"\0\0\0\0")
    with pytest.raises(CoreFormatError, match="sha256") as info:
        load_core(core)
    assert info.value.field == "manifest.files['weights.safetensors'].sha256"
    core2 = _copy(golden, tmp_path / "d.core")
    graph = core2 / "programs" / "decode-t1-b1.json"
    g = json.loads(graph.read_text())
    g["tensors"][-1]["op"] = "no_such_op"
    graph.write_text(json.dumps(g))
    _rehash(core2)
    with pytest.raises(CoreFormatError, match="unknown op") as info:
        load_core(core2)
    assert info.value.field.startswith("programs/decode-t1-b1.json.tensors[")


def test_symlink_out_of_the_core_is_refused(golden: Path, tmp_path: Path) -> None:
    core = _copy(golden, tmp_path / "c.core")
    outside = tmp_path / "elsewhere.json"
    shutil.move(core / "programs" / "decode-t1-b1.json", outside)
    os.symlink(outside, core / "programs" / "decode-t1-b1.json")
    with pytest.raises(CoreFormatError, match="outside the core") as info:
        load_core(core)
    assert info.value.field == "manifest.files['programs/decode-t1-b1.json']"


def test_not_a_core(tmp_path: Path) -> None:
    with pytest.raises(CoreFormatError, match="missing") as info:
        load_core(tmp_path)
    assert info.value.field == "manifest"
    (tmp_path / "manifest.json").write_bytes(b"\x80not json")
    with pytest.raises(CoreFormatError, match="JSON"):
        load_core(tmp_path)


# ---------------------------------------------------------------- fuzzing
JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                    max_leaves=6)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


FUZZED = ["manifest.json", "catalog.json", "programs/decode-t2-b2.json", "programs/mixed-t7-b4.json"]


@st.composite
def mutation(draw):
    target = draw(st.sampled_from(FUZZED))
    kind = draw(st.sampled_from(["replace", "delete", "insert", "swap-type"]))
    pick = draw(st.integers(0, 10_000))
    value = draw(JSON)
    rehash = draw(st.booleans())
    return target, kind, pick, value, rehash


def _mutate(data: Any, kind: str, pick: int, value: Any) -> Any:
    paths = _paths(data)
    path = paths[pick % len(paths)]
    if not path:
        return value if kind in ("replace", "swap-type") else data
    parent = data
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if kind == "delete":
        del parent[key]
    elif kind == "insert" and isinstance(parent, dict):
        parent[f"{key}_x"] = value
    elif kind == "insert":
        parent.insert(key, value)
    elif kind == "swap-type":
        old = parent[key]
        parent[key] = str(old) if not isinstance(old, str) else [old]
    else:
        parent[key] = value
    return data


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(mutation(), min_size=1, max_size=3), mixed=st.sampled_from([None, True, False]))
def test_fuzz_manifest_and_catalog(golden: Path, tmp_path: Path, mutations, mixed) -> None:
    """Any mutation of manifest, catalog or a program graph: it loads, or raises a CoreFormatError
    naming a field; no file changes."""
    core = tmp_path / f"fuzz-{os.urandom(4).hex()}.core"
    _copy(golden, core)
    originals = {n: json.loads((golden / n).read_text()) for n in FUZZED}
    for target, kind, pick, value, rehash in mutations:
        data = _mutate(copy.deepcopy(originals[target]), kind, pick, value)
        originals[target] = data
        (core / target).write_text(json.dumps(data))
        if rehash and target != "manifest.json" and isinstance(originals["manifest.json"], dict):
            try:
                _rehash(core)
            except (KeyError, TypeError, AttributeError, ValueError):
                pass  # the manifest is already too broken to re-hash: loading must still fail cleanly
    before = tree_digest(core)
    try:
        load_core(core, LoadOptions(mixed_prefill=mixed))
    except CoreFormatError as exc:
        assert exc.field, f"error names no field: {exc}"
    assert tree_digest(core) == before
    shutil.rmtree(core)
