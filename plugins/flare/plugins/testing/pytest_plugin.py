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
- the report header lists each backend's status;
- a partial backend is tested as one: op tests skip the nodes its `supports`
  refuses, lifecycle tests open it with the CPU behind it (`fallback_session`),
  and the end of the run prints a coverage summary per backend (ops supported,
  op cases passed / failed / skipped, ops the lifecycle graphs ran on the CPU
  fallback), collected from what the conformance tests record (`record_op`,
  `record_fallback`).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

import pytest

_STATUS: dict[str, tuple[bool, str]] = {}
# the device a partial backend's lifecycle tests put behind it: nodes it refuses run here
FALLBACK = "cpu"
OP_KEY = "flare_conformance_op"          # user property: (backend, op, as_chain) of an op/fused-chain case
FALLBACK_KEY = "flare_conformance_fallback"   # user property: (backend, ops run on the fallback)
# backend -> op -> outcome -> count, and backend -> ops the lifecycle graphs ran on the fallback
_COVERAGE: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
_FALLBACK_OPS: dict[str, set[str]] = defaultdict(set)
_CHAINS: dict[str, set[str]] = defaultdict(set)   # backend -> fused ops it refused whose chains passed unfused


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

    def fallback_session(self, **kwargs: Any):
        """This backend's first device, then a CPU device for the nodes it refuses.

        A partial backend (one whose `supports` refuses some ops) runs a whole
        graph this way, as users run it (`Session(["mine", "cpu"])`); for the
        CPU backend itself it is a session on one CPU device."""
        return self.session(*([] if self.name == FALLBACK else [FALLBACK]), **kwargs)


def record_op(request: pytest.FixtureRequest, backend: str, op: str, as_chain: bool = False) -> None:
    """Count this test's outcome (passed / failed / skipped) for `op` on `backend` in the coverage summary.

    `as_chain`: `op` is a fused op the backend refuses, so the case ran its chain
    unfused; it then counts for the chain's ops, not as support of `op`."""
    request.node.user_properties.append((OP_KEY, (backend, op, as_chain)))


def record_fallback(request: pytest.FixtureRequest, backend: str, ops: Iterable[str]) -> None:
    """Note ops a lifecycle graph ran on the CPU fallback instead of `backend` (coverage summary)."""
    request.node.user_properties.append((FALLBACK_KEY, (backend, tuple(sorted(set(ops))))))


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


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Tally the outcome of tests that called `record_op` / `record_fallback` (the call phase:
    a case refused by `supports` skips there, an unusable backend skips in setup and is not counted)."""
    if report.when != "call":
        return
    for key, value in report.user_properties:
        if key == OP_KEY:
            backend, op, as_chain = value
            if as_chain and report.outcome != "failed":
                _CHAINS[backend].add(op)
            else:
                _COVERAGE[backend][op][report.outcome] += 1
        elif key == FALLBACK_KEY and report.passed:
            backend, ops = value
            _FALLBACK_OPS[backend].update(ops)


def coverage_lines() -> list[str]:
    """The coverage summary: per backend, ops supported and case outcomes (also for tests of the plugin)."""
    lines = []
    for backend in sorted(set(_COVERAGE) | set(_FALLBACK_OPS) | set(_CHAINS)):
        ops = dict(_COVERAGE.get(backend, {}))
        for op in _CHAINS.get(backend, ()):
            ops.setdefault(op, {})
        totals = {k: sum(o.get(k, 0) for o in ops.values()) for k in ("passed", "failed", "skipped")}
        supported = sorted(op for op, o in ops.items() if o.get("passed", 0) + o.get("failed", 0))
        refused = sorted(op for op in ops if op not in supported and op not in _CHAINS.get(backend, ()))
        # "skipped" appears only when something was: a run that skipped nothing reads so at a glance
        refused_cases = f", {totals['skipped']} skipped (refused by supports)" if totals["skipped"] else ""
        lines.append(f"{backend}: {len(supported)} of {len(ops)} ops supported; op cases: {totals['passed']} passed, "
                     f"{totals['failed']} failed{refused_cases}")
        if supported:
            lines.append(f"  supported: {', '.join(supported)}")
        if refused:
            lines.append(f"  refused (skipped, or run on the {FALLBACK} fallback): {', '.join(refused)}")
        chains = sorted(_CHAINS.get(backend, ()))
        if chains:
            lines.append(f"  fused ops refused, their chains ran unfused: {', '.join(chains)}")
        if backend != FALLBACK and backend in _FALLBACK_OPS:
            fell = sorted(_FALLBACK_OPS[backend])
            lines.append(f"  lifecycle graphs ran on the {FALLBACK} fallback: {', '.join(fell) if fell else 'nothing'}")
    return lines


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    lines = coverage_lines()
    if lines:
        terminalreporter.write_sep("=", "flare conformance coverage")
        for line in lines:
            terminalreporter.write_line(line)
