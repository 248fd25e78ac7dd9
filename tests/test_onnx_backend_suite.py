"""ONNX's own backend test suite (onnx.backend.test.BackendTest) inside the backend matrix.

One test per suite test (its CPU variant: the suite's device names know only
CPU and CUDA), run once per selected Flare backend: the `backend` fixture
picks the Flare devices (`vulkan` runs as `vulkan,cpu`, so ops Vulkan lacks
are placed on the CPU by the scheduler). On the CPU the whole suite runs; on
other backends a bounded subset of common ops (`suite.DEVICE_SUBSET`), since
lavapipe is slow. Tests listed in backend_test_exclusions.txt are skipped
with their reason; every other test must pass with the suite's own
comparison and tolerances. The tally: scripts/onnx_scoreboard.py.
"""
from __future__ import annotations

import warnings

import pytest

pytest.importorskip("onnx")

from flare.models.onnx import suite  # noqa: E402
from flare.models.onnx.backend import FlareBackend  # noqa: E402

MatrixBackend = FlareBackend.for_devices(["cpu"])
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    BACKEND_TEST = suite.build(MatrixBackend)
ITEMS = suite.items(BACKEND_TEST)
RULES = suite.load_exclusions()


@pytest.fixture(scope="module", autouse=True)
def _close_sessions():
    yield
    MatrixBackend.close()


def test_exclusions_name_real_tests_and_give_reasons():
    names = {i.name for i in ITEMS}
    for pattern, reason in RULES:
        assert reason and not reason.startswith("fails:"), pattern.pattern
        assert any(pattern.search(n) for n in names), f"exclusion {pattern.pattern!r} matches no suite test"


@pytest.mark.parametrize("item", ITEMS, ids=[i.name for i in ITEMS])
def test_onnx_backend(backend, item):
    reason = suite.excluded(item.name, RULES)
    if reason:
        pytest.skip(f"excluded: {reason}")
    devices = [backend.name]
    if backend.name != "cpu":
        if not suite.DEVICE_SUBSET.search(item.name) or item.kind != "node":
            pytest.skip(f"not in the bounded {backend.name} subset (suite.DEVICE_SUBSET)")
        devices.append("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with MatrixBackend.using(devices):
            suite.run_item(BACKEND_TEST, item)


def test_write_exclusions_groups_failures_by_reason(tmp_path):
    path = tmp_path / "exclusions.txt"
    failures = [("test_a", "UnsupportedOpError: <memory>: unsupported ONNX op(s): Foo (node '#0')"),
                ("test_b", "UnsupportedOpError: <memory>: unsupported ONNX op(s): Foo (node 'n')"),
                ("test_c", "AssertionError: Not equal to tolerance rtol=0.001, atol=1e-07"),
                ("test_d.x", "OnnxError: <memory>: node '#0 (Cast)' (Cast): cast to float8_e8m0fnu is not supported")]
    suite.write_exclusions(failures, path)
    rules = suite.load_exclusions(path)
    assert suite.excluded("test_a", rules) == suite.excluded("test_b", rules) == "no lowering for Foo"
    assert "tolerance" in suite.excluded("test_c", rules)
    assert suite.excluded("test_d.x", rules).startswith("dtype float8_e8m0fnu")
    assert suite.excluded("test_dxx", rules) is None  # names are escaped, not patterns
    assert suite.excluded("test_resnet50", rules)  # the real models' line is always there
    assert [p.name for p in tmp_path.iterdir()] == ["exclusions.txt"]  # no temporary file left behind
