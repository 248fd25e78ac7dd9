"""One exit-code convention for every `flare` command (core, plugin and model commands):
0 ok, 2 bad usage or bad input (one `error:` line naming what and where), 1 a failure of
the run itself. `scripts/hostile_inputs.py` runs the full hostile-input table as subprocesses."""
from __future__ import annotations

import pytest

from flare.core.cli import main, report_error
from flare.core.errors import RUN_FAILED, USAGE, AllocationError, CoreFormatError, InputError, exit_code


@pytest.mark.parametrize("argv, what", [
    (["run", "silero-vad", "/no/such/file.wav"], "no such file"),
    (["run", "silero-vad", "--threshold", "nan"], "threshold=nan"),
    (["run", "minilm-l6", "--backends", "vulkn"], "unknown backend 'vulkn'"),
    (["run", "moe-lm", "--prompt", "Hi", "--backends", ","], "--backends ','"),
    (["run", "no-such-model"], "unknown model 'no-such-model'"),
    (["run", "/no/such/dir.core", "--check"], "no such core directory"),
    (["describe", "silero-vad", "--backends", "cpu,,cpu"], "--backends 'cpu,,cpu'"),
    (["bench", "only-one.toml"], "two configuration files"),
    (["export", "no-such-model", "-o", "/tmp/never.core"], "no-such-model"),
])
def test_bad_usage_or_input_exits_2_with_one_line(capsys, argv, what):
    assert main(argv) == USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and what in err[0], err


def test_argparse_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run"])
    assert info.value.code == USAGE
    assert main(["run", "silero-vad", "--mode", "sideways"]) == USAGE


def test_a_failed_run_exits_1(capsys, monkeypatch):
    monkeypatch.setenv("FLARE_CPU_MEMORY_LIMIT", "1KiB")   # a real out-of-memory on the CPU device
    assert main(["run", "silero-vad"]) == RUN_FAILED
    err = capsys.readouterr().err
    assert "AllocationError" in err and "bytes free" in err


def test_codes_per_error_class_and_internal_errors_are_one_line(capsys):
    assert exit_code(InputError("x")) == exit_code(CoreFormatError("x", "f")) == USAGE
    assert exit_code(AllocationError("cpu:0", 10, 5)) == exit_code(RuntimeError("bug")) == RUN_FAILED
    assert exit_code(FileNotFoundError("x")) == USAGE
    assert report_error(TypeError("unsupported\nformat")) == RUN_FAILED
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error, TypeError: unsupported format" in err
