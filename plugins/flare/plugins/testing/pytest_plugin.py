"""pytest plugin (entry point `pytest11: flare`): the test suite as a backend matrix.

- `--backends=cpu,vulkan` selects backends (default: every installed one);
- a `backend` fixture is parametrized over them (ids `test_x[cpu]`), and skips
  with the backend's own reason when it cannot run here;
- `--require-backends[=NAMES]` turns those skips into failures, for all
  selected backends or only NAMES (for GPU machines and CI, where a silently
  skipped backend would be a false green);
- the matrix cannot lie: a name in `--backends` that is not an installed
  backend, or a `--require-backends` name that `--backends` does not select,
  is a usage error (pytest exits 4) instead of a green run that tested nothing;
- the report header lists each backend's status.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

_STATUS: dict[str, tuple[bool, str]] = {}


@dataclass
class BackendUnderTest:
    """What a test gets from the `backend` fixture."""

    name: str
    usable: bool
    reason: str

    def session(self, *extra: str, **kwargs: Any):
        """A new Session on this backend (plus `extra` devices after it)."""
        from flare.core.session import Session

        return Session([self.name, *extra], **kwargs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("flare", "Flare backend matrix")
    group.addoption("--backends", default=None,
                    help="comma-separated backends to run backend tests on (default: all installed)")
    group.addoption("--require-backends", nargs="?", const="*", default=None, metavar="NAMES",
                    help="fail instead of skip when a backend cannot run here: all selected backends, "
                         "or only the comma-separated NAMES (e.g. --require-backends=cpu,vulkan)")


def pytest_configure(config: pytest.Config) -> None:
    """Register the `slow` mark; refuse a matrix that would pass without testing what it names."""
    config.addinivalue_line("markers", "slow: builds and installs distributions (about a minute); "
                                       "deselect with -m 'not slow'")
    opt = config.getoption("--backends", default=None)
    required = config.getoption("--require-backends", default=None)
    if opt is None and required is None:
        return
    from flare.core.plugin_manager import get_plugin_manager

    installed = list(get_plugin_manager().backends())
    if opt is not None:
        names = [b.strip() for b in opt.split(",")]
        if not any(names) or "" in names:
            raise pytest.UsageError(f"--backends={opt!r}: expected comma-separated backend names "
                                    f"(installed: {', '.join(installed)})")
        unknown = [n for n in names if n not in installed]
        if unknown:
            raise pytest.UsageError(f"--backends: unknown backend(s) {', '.join(map(repr, unknown))}; "
                                    f"installed: {', '.join(installed)}")
    if required not in (None, "*"):
        names = [b.strip() for b in required.split(",")]
        selected = _selected(config)
        if not any(names) or "" in names:
            raise pytest.UsageError(f"--require-backends={required!r}: expected comma-separated backend names")
        missing = [n for n in names if n not in selected]
        if missing:
            raise pytest.UsageError(f"--require-backends names {', '.join(map(repr, missing))}, which "
                                    f"--backends does not select ({', '.join(selected)}): the requirement "
                                    f"could never be checked")


def _selected(config: pytest.Config) -> list[str]:
    from flare.core.plugin_manager import get_plugin_manager

    opt = config.getoption("--backends")
    installed = list(get_plugin_manager().backends())
    if not opt:
        return installed
    return [b.strip() for b in opt.split(",") if b.strip()]


def _required(config: pytest.Config, name: str) -> bool:
    opt = config.getoption("--require-backends")
    if not opt:
        return False
    return opt == "*" or name in [b.strip() for b in opt.split(",")]


def _status(name: str) -> tuple[bool, str]:
    if name not in _STATUS:
        from flare.core.plugin_manager import get_plugin_manager

        specs = get_plugin_manager().backends()
        if name not in specs:
            _STATUS[name] = (False, f"backend {name!r} is not installed (installed: {', '.join(specs)})")
        else:
            try:
                probe = specs[name].backend.probe()
                _STATUS[name] = (probe.usable, probe.reason)
            except Exception as exc:  # a probe must not crash the test run
                _STATUS[name] = (False, f"probe raised {type(exc).__name__}: {exc}")
    return _STATUS[name]


def pytest_report_header(config: pytest.Config) -> list[str]:
    from flare.core.plugin_manager import get_plugin_manager

    lines = []
    pm = get_plugin_manager()
    for name in _selected(config):
        usable, reason = _status(name)
        lines.append(f"flare backend {name}: {'usable' if usable else 'UNUSABLE'} - {reason}")
    for broken in pm.broken:
        lines.append(f"flare plugin {broken.name}: BROKEN - {broken.error}")
    return lines


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        names = _selected(metafunc.config)
        metafunc.parametrize("backend", names, ids=names, indirect=True, scope="session")


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> BackendUnderTest:
    name = request.param
    usable, reason = _status(name)
    if not usable:
        message = f"backend {name} unusable here: {reason}"
        if _required(request.config, name):
            pytest.fail(message + " (--require-backends)", pytrace=False)
        pytest.skip(message)
    return BackendUnderTest(name, usable, reason)


@pytest.fixture(scope="session")
def backend_session(backend: BackendUnderTest):
    """One Session per backend shared by the op tests (opening devices is slow on lavapipe)."""
    sess = backend.session()
    yield sess
    sess.close()
