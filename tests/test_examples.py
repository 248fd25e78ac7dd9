"""The plugin-author examples in `examples/`, as their authors' users would meet them:
each is built as its own distribution, installed into a fresh venv next to the Flare
under test, and must pass its own tests there (the backend also the shipped conformance
suite); a third-party model's placement must show in `flare describe`, `flare run` and
`flare bench`.

One venv serves every test here (module fixture). It has no pip and no Flare of its own:
a `.pth` file adds the site directories of the interpreter running these tests, so
the venv imports exactly this Flare (an editable checkout or an installed wheel) whether
pytest runs from the system Python or from inside another venv.
"""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

import flare.core

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PACKAGES = {"flare-backend-mirror": "flare_mirror", "flare-model-tiny": "flare_tiny_moe"}
pytestmark = pytest.mark.slow


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def _venv_seeing_this_flare(path: Path) -> Path:
    """A fresh venv from the base interpreter whose imports fall back to this process's site dirs."""
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(path)],
                   check=True)
    py = path / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    line = "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in _site_dirs())
    (Path(purelib) / "_flare_under_test.pth").write_text(line + "\n")
    return py


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory):
    """(python, env, copies of the examples): both examples built as wheels and installed."""
    root = tmp_path_factory.mktemp("examples")
    src = root / "src"
    for name in PACKAGES:   # build from copies: a build writes build/ and *.egg-info beside the sources
        shutil.copytree(EXAMPLES / name, src / name,
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache"))
    dist = root / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), *(str(src / name) for name in PACKAGES)], check=True, cwd=root)
    py = _venv_seeing_this_flare(root / "venv")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", *map(str, dist.glob("*.whl"))],
                   check=True, cwd=root)
    env = {k: v for k, v in os.environ.items() if k != "FLARE_DISABLE_PLUGIN_AUTOLOAD"}
    where = subprocess.run([str(py), "-c", "import flare.core, flare_mirror, flare_tiny_moe as m; "
                            "print(flare.core.__file__); print(m.__file__)"],
                           check=True, capture_output=True, text=True, env=env, cwd=root).stdout.split()
    assert where[0] == flare.core.__file__, "the venv must import the Flare under test"
    assert str(root / "venv") in where[1], "the example must be imported from its installed wheel"
    return py, env, src


def _flare(venv, *args: str, rc: int = 0) -> subprocess.CompletedProcess:
    py, env, src = venv
    done = subprocess.run([str(py), "-m", "flare.core.cli", *args], capture_output=True, text=True, env=env, cwd=src)
    assert done.returncode == rc, done.stderr[-2000:]
    return done


def test_examples_pass_their_own_tests_and_the_conformance_suite(venv):
    py, env, src = venv
    suite = subprocess.run([str(py), "-m", "pytest", "-p", "no:cacheprovider", "-rfEs", "--pyargs",
                            "flare.plugins.testing.conformance", *(str(src / name / "tests") for name in PACKAGES),
                            "--backends=mirror", "--require-backends"],
                           capture_output=True, text=True, env=env, cwd=src)
    assert suite.returncode == 0, suite.stdout[-4000:] + suite.stderr[-2000:]
    summary = suite.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary
    for ran in ("test_ops.py", "test_lifecycle.py", "test_mirror.py", "test_tiny_moe.py"):
        assert ran in suite.stdout, f"{ran} did not run:\n{suite.stdout[-2000:]}"


def test_installed_plugins_are_listed(venv):
    backends = {b["name"]: b for b in json.loads(_flare(venv, "backends", "--json").stdout)["backends"]}
    assert backends["mirror"]["usable"] and backends["mirror"]["version"] == "0.1.0"
    models = {m["name"]: m for m in json.loads(_flare(venv, "models", "--json").stdout)}
    assert models["tiny-moe"]["placement"] and models["tiny-moe"]["stage_experts"] and not models["tiny-moe"]["run"]


def _expert_splits_on_cpu1(splits: list[dict]) -> None:
    devices = [s["device"] for s in splits]
    assert set(devices) == {"cpu:0", "cpu:1"}, devices
    assert devices[0] == "cpu:0" and devices[-1] == "cpu:0" and "cpu:1" in devices[1:-1], devices


def test_third_party_placement_shows_in_describe_and_run(venv):
    """tiny-moe registers only a ModelSpec (no run job, no code passing callbacks): its placement
    callback (experts on the last device) is what `flare describe` and `flare run` show."""
    info = json.loads(_flare(venv, "describe", "tiny-moe", "--backends", "cpu:0,cpu:1", "--json").stdout)
    entry = info["entries"]["forward"]
    _expert_splits_on_cpu1(entry["split_list"])
    assert [s["host"] for s in entry["split_list"]].count(True) == 1      # the stage_experts node
    assert entry["copies"] >= 2 and info["persistent_bytes"]["cpu:1"] > 0
    report = json.loads(_flare(venv, "run", "tiny-moe", "--backends", "cpu:0,cpu:1", "--json").stdout)
    run = report["entries"]["forward"]
    _expert_splits_on_cpu1(run["splits"])
    assert [s["device"] for s in run["splits"]] == [s["device"] for s in entry["split_list"]]
    assert run["outputs"]["y"]["shape"] == [4, 16]
    one = json.loads(_flare(venv, "describe", "tiny-moe", "--json").stdout)["entries"]["forward"]
    assert {s["device"] for s in one["split_list"]} == {"cpu:0"}           # one device: nothing to split


def test_third_party_placement_shows_in_bench(venv):
    """`flare bench` benchmarks a model without a workload of its own through prepare_model,
    so the registered placement splits B's graph over both devices (A has one)."""
    py, env, src = venv
    for name, devices in (("one", '["cpu:0"]'), ("two", '["cpu:0", "cpu:1"]')):
        (src / f"{name}.toml").write_text(f'name = "{name}"\nmodel = "tiny-moe"\nbackends = {devices}\n')
    _flare(venv, "bench", "one.toml", "two.toml", "--blocks", "1", "--requests", "2", "--warmup", "0",
           "--no-progress", "--json", "bench.json")
    result = json.loads((src / "bench.json").read_text())
    assert result["ok"] and result["model"] == "tiny-moe"
    plans = {k: result["summary"][k]["memory_plan"] for k in ("A", "B")}
    assert plans["A"]["entries"]["forward"]["splits"] == 3 and set(plans["A"]["persistent_bytes"]) == {"cpu:0"}
    assert plans["B"]["entries"]["forward"]["splits"] == 4 and plans["B"]["persistent_bytes"]["cpu:1"] > 0


def test_model_options_reach_the_spec_and_a_model_error_is_one_line(venv):
    report = json.loads(_flare(venv, "run", "tiny-moe", "--backends", "cpu:0,cpu:1", "--option", "experts=resident",
                               "--json").stdout)
    splits = report["entries"]["forward"]["splits"]
    assert [(s["device"], s["host"]) for s in splits] == [("cpu:0", False), ("cpu:1", False), ("cpu:0", False)]
    bad = _flare(venv, "describe", "tiny-moe", "--option", "slots=2", rc=2)
    assert bad.stderr.startswith("error: ExpertCacheError: tiny-moe: slots=2 cannot hold") and bad.stderr.count("\n") == 1
