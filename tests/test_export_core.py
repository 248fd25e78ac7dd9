"""Exported cores: writing, loading, program selection, pruning and tuning dependencies (CPU)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from flare.core.errors import CoreFormatError, FlareError
from flare.plugins.export import LoadOptions, SelectionError, export_core, load_core
from flare.plugins.export.files import tree_digest
from flare.plugins.export.runtime import CoreRuntime
from flare.plugins.export.testing import ToyLM


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    return export_core(ToyLM(), tmp_path_factory.mktemp("cores") / "toy.core", progress=False)


@pytest.fixture(scope="module")
def toy_no_mixed(tmp_path_factory) -> Path:
    return export_core(ToyLM(mixed=False), tmp_path_factory.mktemp("cores") / "toy-nomixed.core", progress=False)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return export_core("moe-lm", tmp_path_factory.mktemp("cores") / "moe.core", progress=False)


SEPARATE = ["prefill-t1-b1", "prefill-t2-b1", "prefill-t4-b1", "decode-t1-b1", "decode-t2-b2", "decode-t4-b4"]
MIXED = ["mixed-t5-b2", "mixed-t7-b4"]


def test_layout_and_manifest(toy: Path) -> None:
    names = sorted(p.relative_to(toy).as_posix() for p in toy.rglob("*") if p.is_file())
    assert names == sorted(["manifest.json", "catalog.json", "weights.safetensors",
                            *[f"programs/{n}.json" for n in SEPARATE + MIXED]])
    m = json.loads((toy / "manifest.json").read_text())
    assert m["format"] == "flare-core" and m["format_version"] == 1
    assert m["model"]["name"] == "toy-lm" and m["model"]["config"] == {"d": 16, "mixed": True}
    assert set(m["files"]) == set(names) - {"manifest.json"}
    assert m["defaults"]["mixed_prefill"] is True
    cat = json.loads((toy / "catalog.json").read_text())
    prog = {p["name"]: p for p in cat["programs"]}
    assert prog["mixed-t7-b4"]["kind"] == "mixed" and prog["mixed-t7-b4"]["bucket"] == {"tokens": 7, "batch": 4}
    assert "scale" in prog["mixed-t7-b4"]["kernels"]["cpu"] and "scale" not in prog["decode-t4-b4"]["kernels"]["cpu"]
    assert prog["decode-t4-b4"]["tuning"] == ["cpu.matmul.t4"] == prog["prefill-t4-b1"]["tuning"]
    entry = cat["tuning"]["entries"]["cpu.matmul.t4"]
    assert entry["choice"] in cat["kernels"]["cpu"]["matmul"]["variants"] and set(entry["seconds"]) == {
        "matmul", "packed", "einsum"}
    assert not any(n.startswith(".") for n in os.listdir(toy.parent)), "temporary directories left behind"


def test_selection_default_enabled_disabled(toy: Path) -> None:
    default = load_core(toy)
    enabled = load_core(toy, LoadOptions(mixed_prefill=True))
    disabled = load_core(toy, LoadOptions(mixed_prefill=False))
    assert default.mixed and enabled.mixed and not disabled.mixed
    assert sorted(default.programs) == sorted(enabled.programs) == sorted(SEPARATE + MIXED)
    assert sorted(disabled.programs) == sorted(SEPARATE)
    assert default.digest == enabled.digest != disabled.digest
    assert disabled.selection.excluded == {n: "mixed programs disabled" for n in MIXED}
    assert "export's default" in default.selection.reason and "--no-mixed-prefill" in disabled.selection.reason


def test_export_default_off_is_kept_and_overridable(tmp_path: Path) -> None:
    core = export_core(ToyLM(), tmp_path / "off.core", mixed_default=False, progress=False)
    assert not load_core(core).mixed
    assert load_core(core, LoadOptions(mixed_prefill=True)).mixed


def test_disabling_mixed_prunes_only_what_mixed_alone_used(toy: Path) -> None:
    on, off = load_core(toy, LoadOptions(True)), load_core(toy, LoadOptions(False))
    # the kernel only mixed programs use is gone; every kernel a separate program uses stays
    assert "scale" in on.kernels and "scale" not in off.kernels
    assert off.selection.pruned_kernels == {"cpu": ("scale",)}
    for name, p in off.programs.items():
        assert set(p.kernels["cpu"]) <= set(off.kernels), name
        assert name in off.graphs
    assert set(off.kernels) == set(on.kernels) - {"scale"}
    # separate programs and their resources are all still there, unchanged
    for name in SEPARATE:
        assert off.programs[name] == on.programs[name] and off.graphs[name] == on.graphs[name]
    assert set(off.weights) == set(on.weights) == {"emb", "out"}


def test_tuning_dependencies_retained(toy: Path) -> None:
    on, off = load_core(toy, LoadOptions(True)), load_core(toy, LoadOptions(False))
    assert set(on.tuning) == {"cpu.matmul.t1", "cpu.matmul.t2", "cpu.matmul.t4", "cpu.matmul.t5", "cpu.matmul.t7"}
    # t5 and t7 served only the mixed programs; every entry a selected program names is kept
    assert set(off.tuning) == {"cpu.matmul.t1", "cpu.matmul.t2", "cpu.matmul.t4"}
    assert off.selection.pruned_tuning == ("cpu.matmul.t5", "cpu.matmul.t7")
    for p in off.programs.values():
        assert set(p.tuning) <= set(off.tuning)
    assert all(off.tuning[k] == on.tuning[k] for k in off.tuning)


def test_explicit_enable_without_mixed_programs_is_rejected(toy_no_mixed: Path) -> None:
    assert not load_core(toy_no_mixed).mixed
    assert not load_core(toy_no_mixed, LoadOptions(False)).mixed
    with pytest.raises(SelectionError) as info:
        load_core(toy_no_mixed, LoadOptions(mixed_prefill=True))
    assert info.value.field == "options.mixed_prefill"
    assert "toy-lm was built with mixed=False" in str(info.value)   # says why
    assert isinstance(info.value, CoreFormatError)


def test_explicit_enable_without_programs_for_the_backend(toy: Path, tmp_path: Path) -> None:
    with pytest.raises(SelectionError, match="exported for cpu, not 'vulkan'"):
        load_core(toy, LoadOptions(mixed_prefill=True, backend="vulkan"))


def test_loading_modifies_no_file(toy: Path) -> None:
    before = tree_digest(toy)
    for opt in (None, True, False):
        core = load_core(toy, LoadOptions(opt))
        with CoreRuntime(core) as rt:
            rt.execute("decode-t1-b1", tokens=np.zeros(1, np.int32), pos=np.zeros(1, np.int32),
                       kv_rows=np.zeros(1, np.int32), mask=np.zeros((1, 129), np.float32))
    assert tree_digest(toy) == before


def test_failed_export_leaves_nothing(tmp_path: Path) -> None:
    class Broken(ToyLM):
        def write_weights(self, path):
            path.write_bytes(b"half")
            raise OSError("disk full")

    target = tmp_path / "broken.core"
    with pytest.raises(OSError, match="disk full"):
        export_core(Broken(), target, progress=False)
    assert os.listdir(tmp_path) == []


def test_export_refuses_to_overwrite_unless_forced(toy: Path, tmp_path: Path) -> None:
    target = export_core(ToyLM(), tmp_path / "a.core", progress=False)
    with pytest.raises(FileExistsError):
        export_core(ToyLM(), target, progress=False)
    export_core(ToyLM(mixed=False), target, force=True, progress=False)
    assert not load_core(target).mixed and sorted(os.listdir(tmp_path)) == ["a.core"]


def test_audit_tuning_measures_more(toy: Path, tmp_path: Path) -> None:
    quick = load_core(toy)
    audit = load_core(export_core(ToyLM(), tmp_path / "audit.core", tuning="audit", progress=False))
    assert set(audit.tuning) == set(quick.tuning)
    for key, e in audit.tuning.items():
        assert e.repeats > quick.tuning[key].repeats
        assert e.seconds[e.choice] == min(e.seconds.values())    # the measured best


def test_explicit_mixed_export_of_a_model_without_support(tmp_path: Path) -> None:
    with pytest.raises(FlareError, match="cannot export mixed programs"):
        export_core(ToyLM(mixed=False), tmp_path / "x.core", mixed=True, progress=False)
    assert not (tmp_path / "x.core").exists()


def test_moe_core_programs_match_the_model(moe: Path) -> None:
    """A core's programs compute what MoeLM.step computes (same graph, same weights).

    The core runs its tuned kernel variants (a packed or einsum matmul, say), so the
    logits agree up to f32 rounding, not bit for bit."""
    from flare.models.moe_lm import MoeLM, SeqChunk
    from flare.plugins.export.serving.batch import Chunk, token_lm_inputs

    core = load_core(moe)
    chunks = [SeqChunk(0, 0, [256, 72, 105, 33]), SeqChunk(1, 0, [256]), SeqChunk(2, 0, [256])]
    with MoeLM.load("tiny") as m, CoreRuntime(core) as rt:
        want = m.step([chunks[0]])
        got = rt.execute("prefill-t4-b1", **token_lm_inputs(core.manifest.serving, [Chunk(0, 0, chunks[0].tokens)],
                                                            tokens=4, batch=1))["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        want = m.step(chunks[1:], entry="mixed", pad_to=5)
        ins = token_lm_inputs(core.manifest.serving, [Chunk(c.seq, c.start, c.tokens) for c in chunks[1:]],
                              tokens=5, batch=2)
        np.testing.assert_allclose(rt.execute("mixed-t5-b2", **ins)["logits"], want, rtol=1e-5, atol=1e-5)
    assert core.manifest.model == "moe-lm" and core.manifest.config["size"] == "tiny"


def test_tuned_variants_are_what_the_cpu_device_runs(moe: Path) -> None:
    """The catalog's choices reach the CPU splits: a `packed` choice allocates the
    transposed weight in a buffer of the split (ledger tag cpu:packed), and every
    variant computes the default kernel's result up to rounding."""
    from flare.core.ledger import LEDGER

    core = load_core(moe)
    with CoreRuntime(core) as rt:
        for name in core.programs:
            plan = rt.graph.current_plan(name)
            want = rt.graph.tuning_for(name, rt.session.devices[0])
            assert want == {core.tuning[k].kernel: core.tuning[k].choice for k in core.programs[name].tuning}
            assert plan.programs, name
        packed = [r for r in LEDGER.live_records() if r.tag.startswith("cpu:packed:")]
        uses_packed = any(core.tuning[k].choice == "packed" for p in core.programs.values() for k in p.tuning)
        assert bool(packed) == uses_packed
    assert not [r for r in LEDGER.live_records() if r.tag.startswith("cpu:packed:")], "released with the splits"
