"""The pytest plugin's backend matrix cannot report green for what it did not test."""
from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

TEST = """
def test_uses_backend(backend):
    assert backend.usable
"""


@pytest.mark.parametrize("args, message", [
    (["--backends=vulkn"], "unknown backend(s) 'vulkn'"),
    (["--backends=cpu,", "-q"], "expected comma-separated backend names"),
    (["--backends=cpu", "--require-backends=cuda"], "--require-backends names 'cuda', which --backends does not select"),
])
def test_a_matrix_that_cannot_be_checked_is_a_usage_error(pytester, args, message):
    pytester.makepyfile(TEST)
    result = pytester.runpytest_inprocess(*args, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str() + result.stdout.str()


def test_selected_and_required_backend_runs_and_slow_is_registered(pytester):
    # pytester's directory has no pyproject.toml: the `slow` mark must come from flare's plugin
    pytester.makepyfile(TEST + "\nimport pytest\n@pytest.mark.slow\ndef test_slow():\n    pass\n")
    result = pytester.runpytest_inprocess("--backends=cpu", "--require-backends=cpu", "--strict-markers",
                                          "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
