"""Plugins: registration hooks, broken and duplicate plugins, autoload switch,
observer wrappers, and a third-party backend installed as its own distribution."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from flare.core.errors import PluginError
from flare.core.plugin_manager import PluginManager, hookimpl
from flare.core.specs import BackendSpec, ModelSpec
from flare.backends.cpu.backend import CpuBackend
from flare.core.session import Session


class DupPlugin:
    @hookimpl
    def flare_backends(self):
        return [BackendSpec("cpu", CpuBackend)]


class RaisingPlugin:
    @hookimpl
    def flare_models(self):
        raise RuntimeError("weights server unreachable")


class GoodModels:
    @hookimpl
    def flare_models(self):
        return [ModelSpec("toy", "a toy", graph=lambda options: None), "not a spec"]


def test_duplicate_backend_name_is_an_error():
    pm = PluginManager(autoload=False, groups=("flare.backends",))
    pm.register(DupPlugin(), name="dup")
    with pytest.raises(PluginError, match="'cpu' registered twice"):
        pm.backends()


def test_broken_plugins_are_reported_and_skipped():
    pm = PluginManager(autoload=False, groups=("flare.backends",))
    pm.register(RaisingPlugin(), name="raising")
    pm.register(GoodModels(), name="good")
    assert list(pm.models()) == ["toy"]
    errors = {b.name: b.error for b in pm.broken}
    assert "weights server unreachable" in errors["raising"]
    assert "returned str" in errors["good"]


def _install_probe_distribution(root: Path) -> str:
    """A real (if tiny) installed distribution on `root`: a dist-info folder with an entry
    point in `flare.models` naming a module beside it. Returns the module's name."""
    (root / "flare_autoload_probe.py").write_text(textwrap.dedent('''
        from flare.core.plugin_manager import hookimpl

        @hookimpl
        def flare_models():
            return []
    '''))
    info = root / "flare_autoload_probe-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flare-autoload-probe\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[flare.models]\nautoload-probe = flare_autoload_probe\n")
    return "flare_autoload_probe"


def test_autoload_can_be_disabled(monkeypatch, tmp_path):
    """With autoload on, another distribution's entry point is loaded; with
    FLARE_DISABLE_PLUGIN_AUTOLOAD=1 only Flare's own plugins are."""
    module = _install_probe_distribution(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("FLARE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    loaded = {name for name, _ in PluginManager().pm.list_name_plugin()}
    assert module in loaded, "the third-party entry point must load when autoload is on"
    monkeypatch.setenv("FLARE_DISABLE_PLUGIN_AUTOLOAD", "1")
    names = {name for name, _ in PluginManager().pm.list_name_plugin()}
    assert "flare.backends.cpu.plugin" in names and "flare.models.moe_lm.plugin" in names
    assert module not in names, "autoload disabled, yet a third-party plugin was loaded"


class Counter:
    """An observer plugin: counts every lifecycle step it is told about."""

    def __init__(self):
        self.seen: list[tuple] = []

    @hookimpl
    def flare_graph_prepared(self, graph, entry, shapes, replan, seconds):
        self.seen.append(("replan" if replan else "prepare", entry, tuple(shapes["x"])))

    @hookimpl
    def flare_graph_executed(self, graph, entry, seconds):
        assert seconds >= 0
        self.seen.append(("execute", entry))

    @hookimpl
    def flare_graph_reset(self, graph):
        self.seen.append(("reset",))

    @hookimpl
    def flare_graph_released(self, graph):
        self.seen.append(("release", graph.name))


def test_observer_plugin_counts_every_lifecycle_step():
    counter = Counter()
    pm = PluginManager(autoload=False, groups=("flare.backends",))
    pm.register(counter)

    def build(b, shapes):
        b.output("y", b.relu(b.input("x", shapes["x"])))

    with Session(["cpu"], plugins=pm) as sess:
        pg = sess.prepare({"full": build}, {"full": {"x": (3,)}}, name="traced")
        out = pg.execute("full", x=np.array([-1, 0, 2], np.float32))
        pg.execute("full", x=np.zeros(5, np.float32))            # new shape: a re-plan inside execute
        pg.execute("full", x=np.zeros(3, np.float32))            # cached plan: no prepare event
        pg.reset()
        pg.prepare("full", {"x": (7,)})
        pg.release()
        pg.release()                                             # idempotent: no second event
    np.testing.assert_array_equal(out["y"], [0, 0, 2])
    assert counter.seen == [("prepare", "full", (3,)), ("execute", "full"), ("replan", "full", (5,)),
                            ("execute", "full"), ("execute", "full"), ("reset",), ("prepare", "full", (7,)),
                            ("release", "traced")]
    assert pg.stats["plans_built"] == 3 and pg.stats["executes"] == 3


def test_misspelled_hookimpl_fails_loudly():
    class Typo:
        @hookimpl
        def flare_model(self):
            return []

    pm = PluginManager(autoload=False, groups=("flare.backends",))
    with pytest.raises(PluginError, match="'typo' implements unknown hook 'flare_model'.*did you mean 'flare_models'"):
        pm.register(Typo(), name="typo")
    assert not pm.pm.is_registered(Typo)


THIRD_PARTY = {
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "flare-backend-mirror"
        version = "0.3.0"
        dependencies = ["flare-runtime"]
        [project.entry-points."flare.backends"]
        mirror = "flare_mirror"
        [tool.setuptools]
        py-modules = ["flare_mirror"]
    """,
    "flare_mirror.py": '''
        """A third-party backend: Flare's CPU kernels behind a device of its own name."""
        from flare.core.backend import ProbeResult
        from flare.backends.cpu.backend import CpuBackend
        from flare.backends.cpu.device import CpuDevice
        from flare.core.plugin_manager import hookimpl
        from flare.core.specs import BackendSpec

        class MirrorDevice(CpuDevice):
            backend = "mirror"

        class MirrorBackend(CpuBackend):
            name = "mirror"

            @classmethod
            def probe(cls):
                return ProbeResult(True, "mirror of the CPU kernels", ("mirror:0",))

            @classmethod
            def open_devices(cls, config=None):
                return [MirrorDevice(f"mirror:{i}") for i in range(int((config or {}).get("count", 1)))]

        @hookimpl
        def flare_backends():
            return [BackendSpec("mirror", MirrorBackend, version="0.3.0", priority=5)]
    ''',
}


@pytest.mark.slow
def test_third_party_backend_distribution(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    for name, text in THIRD_PARTY.items():
        (src / name).write_text(textwrap.dedent(text))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(src)], check=True)
    # Installed into a directory of its own on PYTHONPATH, run by this very interpreter: a
    # `venv --system-site-packages` made from inside a venv would see the base interpreter's
    # packages, not this environment's (where flare itself may be an editable install).
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    *map(str, dist.glob("*.whl"))], check=True)
    py = sys.executable
    env = {k: v for k, v in os.environ.items() if k != "FLARE_DISABLE_PLUGIN_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    listing = subprocess.run([py, "-m", "flare.core.cli", "backends", "--json"], capture_output=True, text=True,
                             check=True, env=env)
    backends = {b["name"]: b for b in json.loads(listing.stdout)["backends"]}
    assert backends["mirror"]["usable"] and backends["mirror"]["version"] == "0.3.0"
    suite = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "flare.plugins.testing.conformance",
                            "--backends=mirror", "--require-backends"], capture_output=True, text=True,
                           env=env, cwd=tmp_path)
    assert suite.returncode == 0, suite.stdout[-3000:] + suite.stderr[-2000:]
    assert " passed" in suite.stdout and "skipped" not in suite.stdout.splitlines()[-1]
