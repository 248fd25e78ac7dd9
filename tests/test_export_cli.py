"""`flare export` and `flare run NAME.core` through the real command line (in process)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from flare.core.cli import main


def test_export_then_run(tmp_path: Path, capsys) -> None:
    core = tmp_path / "moe.core"
    assert main(["export", "moe-lm", "-o", str(core), "--tuning", "quick", "--quiet"]) == 0
    assert (core / "manifest.json").is_file()
    assert main(["export", "moe-lm", "-o", str(core), "--quiet"]) == 2            # exists: typed error, exit 2
    assert "exists (use --force" in capsys.readouterr().err
    capsys.readouterr()
    for flags, mixed in (([], True), (["--mixed-prefill"], True), (["--no-mixed-prefill"], False)):
        assert main(["run", str(core), *flags, "--check", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["load"]["mixed_prefill"] is mixed
        assert report["ranks"][0]["options"]["mixed_prefill"] is (None if not flags else mixed)
    assert main(["run", str(core), "--prompt", "Hi", "--max-new-tokens", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["completed"] == 1 and len(report["per_request"][0]["tokens"]) == 3


def test_mixed_flags_are_mutually_exclusive(tmp_path: Path, capsys) -> None:
    from flare.plugins.export.serve import parser

    with pytest.raises(SystemExit):
        parser().parse_args(["--mixed-prefill", "--no-mixed-prefill"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_requests_from_stdin(tmp_path: Path, monkeypatch, capsys) -> None:
    from flare.plugins.export import export_core
    from flare.plugins.export.testing import ToyLM

    core = export_core(ToyLM(), tmp_path / "toy.core", progress=False)
    monkeypatch.setattr("sys.stdin", io.StringIO('{"id": "x", "prompt": "hey", "max_new_tokens": 2}\n'))
    assert main(["run", str(core), "--no-mixed-prefill", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in report["per_request"]] == ["x"] and report["steps"]["mixed"] == 0


def test_bad_core_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    (tmp_path / "bad.core").mkdir()
    (tmp_path / "bad.core" / "manifest.json").write_text('{"format": "flare-core", "format_version": 7}')
    assert main(["run", str(tmp_path / "bad.core"), "--check"]) == 2
    assert "CoreFormatError: manifest.format_version" in capsys.readouterr().err
