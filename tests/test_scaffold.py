"""`flare new backend NAME` / `flare new model NAME` (flare.plugins.scaffold).

The skeletons are the examples renamed, so the templates must stay the examples byte
for byte (a fix to an example reaches `flare new` only through a copy, which this
checks). The slow tests write both skeletons with the `flare` command, build and
install them into a fresh venv that sees this Flare, and run their own tests there
— the backend also the shipped conformance suite under its new name.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flare.core.cli import main
from flare.core.errors import InputError
from flare.core.plugin_manager import PluginManager
from flare.plugins.scaffold import plugin as scaffold_plugin
from flare.plugins.scaffold.render import KINDS, TEMPLATES, render, write

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE_OF = {"backend": "flare-backend-mirror", "model": "flare-model-tiny"}
# `flare new` through the real CLI; an installation whose metadata predates the scaffold entry
# point (an editable install not reinstalled since) gets the plugin registered by hand first
FLARE_NEW = ("import sys\n"
             "from flare.core.plugin_manager import get_plugin_manager\n"
             "pm = get_plugin_manager()\n"
             "if 'new' not in pm.commands():\n"
             "    import flare.plugins.scaffold.plugin as p\n"
             "    pm.register(p, name='flare.plugins.scaffold.plugin')\n"
             "from flare.core.cli import main\n"
             "sys.exit(main(['new', *sys.argv[1:]]))\n")


def _example_files(kind: str) -> dict[str, str]:
    root = EXAMPLES / EXAMPLE_OF[kind]
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in p.as_posix()
            and not p.relative_to(root).as_posix().startswith("build/")}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_templates_are_the_examples(kind):
    root = TEMPLATES / KINDS[kind].template
    templates = {p.relative_to(root).as_posix()[:-5]: p.read_text(encoding="utf-8") for p in root.rglob("*.tmpl")}
    examples = _example_files(kind)
    assert sorted(templates) == sorted(examples)
    stale = [name for name in examples if templates[name] != examples[name]]
    assert not stale, f"copy examples/{EXAMPLE_OF[kind]}/ to {root}/ (as NAME.tmpl): {stale} differ"


def test_renaming_leaves_no_trace_of_the_example():
    backend = render("backend", "foo_x")
    assert "src/flare_foo_x/device.py" in backend and "tests/test_foo_x.py" in backend
    text = "\n".join(backend.values())
    assert "mirror" not in text.lower() and "class FooXDevice(Device)" in text and "FLARE_FOO_X_DEVICES" in text
    assert 'foo_x = "flare_foo_x.plugin"' in backend["pyproject.toml"]
    assert 'name = "flare-backend-foo_x"' in backend["pyproject.toml"]
    model = render("model", "my-lm")
    assert "src/flare_my_lm/model.py" in model and "tests/test_my_lm.py" in model
    text = "\n".join(model.values())
    assert "tiny" not in text.lower() and "class MyLmConfig" in text and 'name="my-lm"' in text


@pytest.mark.parametrize("kind, name", [("backend", "Foo"), ("backend", "9a"), ("backend", "a-b"), ("model", "my_lm"),
                                        ("model", "-x"), ("model", "")])
def test_bad_names_are_input_errors(kind, name, tmp_path):
    with pytest.raises(InputError, match=f"{kind} name"):
        write(kind, name, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_existing_folder_is_never_overwritten_and_nothing_is_left_behind(tmp_path, capsys):
    pm = PluginManager(autoload=False, groups=("flare.backends",))
    pm.register(scaffold_plugin, name="scaffold")
    assert "new" in pm.commands()
    (tmp_path / "flare-backend-foo").mkdir()
    with pytest.raises(InputError, match="already exists"):
        write("backend", "foo", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["flare-backend-foo"]   # no staging folder left
    assert list((tmp_path / "flare-backend-foo").iterdir()) == []


def test_a_registered_name_is_refused(tmp_path, capsys, monkeypatch):
    from flare.core import plugin_manager

    pm = PluginManager(autoload=False, groups=("flare.backends",))
    pm.register(scaffold_plugin, name="scaffold")
    monkeypatch.setattr(plugin_manager, "_MANAGER", pm)
    assert main(["new", "backend", "cpu", "-o", str(tmp_path)]) == 2
    assert "backend 'cpu' is already registered" in capsys.readouterr().err
    assert main(["new", "backend", "foo", "-o", str(tmp_path)]) == 0
    assert "pytest --pyargs flare.plugins.testing.conformance --backends=foo" in capsys.readouterr().out
    assert (tmp_path / "flare-backend-foo" / "src" / "flare_foo" / "device.py").is_file()


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """Both skeletons written by `flare new`, built as wheels, installed into a fresh venv."""
    from test_examples import _venv_seeing_this_flare

    root = tmp_path_factory.mktemp("scaffold")
    env = {k: v for k, v in os.environ.items() if k != "FLARE_DISABLE_PLUGIN_AUTOLOAD"}
    for kind, name in (("backend", "foo"), ("model", "my-lm")):
        subprocess.run([sys.executable, "-c", FLARE_NEW, kind, name, "-o", str(root)], check=True, env=env, cwd=root)
    dists = [root / "flare-backend-foo", root / "flare-model-my-lm"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(root / "dist"), *map(str, dists)], check=True, cwd=root)
    py = _venv_seeing_this_flare(root / "venv")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    *map(str, (root / "dist").glob("*.whl"))], check=True, cwd=root)
    return py, env, root


@pytest.mark.slow
def test_new_backend_installs_and_passes_its_tests_and_the_conformance_suite(venv):
    py, env, root = venv
    done = subprocess.run([str(py), "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pyargs",
                           "flare.plugins.testing.conformance", str(root / "flare-backend-foo" / "tests"),
                           "--backends=foo", "--require-backends"], capture_output=True, text=True, env=env, cwd=root)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
    import re
    assert re.search(r"^foo: (\d+) of \1 ops supported", done.stdout, re.M), done.stdout[-3000:]  # every op


@pytest.mark.slow
def test_new_model_installs_and_passes_its_tests(venv):
    py, env, root = venv
    done = subprocess.run([str(py), "-m", "pytest", "-p", "no:cacheprovider", "-q", str(root / "flare-model-my-lm" / "tests")],
                          capture_output=True, text=True, env=env, cwd=root)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.strip().splitlines()[-1]
    described = subprocess.run([str(py), "-m", "flare.core.cli", "describe", "my-lm", "--backends", "cpu:0,cpu:1",
                                "--json"], capture_output=True, text=True, env=env, cwd=root)
    assert described.returncode == 0, described.stderr
    assert '"name": "my-lm-' in described.stdout
