"""Ranks on MPI: options forwarded to every rank, agreed selection, expert parallelism (real mpirun).

Skipped (with the reason) where mpirun or mpi4py is missing. About 4 s: three
short mpirun launches of two ranks each.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flare.plugins.export import export_core
from flare.plugins.export.ranks import mpirun_command
from flare.plugins.export.testing import ToyLM

pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (apt install openmpi-bin)"),
]
try:
    import mpi4py  # noqa: F401
except ImportError:  # pragma: no cover
    pytestmark.append(pytest.mark.skip(reason="mpi4py not installed (pip install mpi4py)"))

ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "OMPI_MCA_rmaps_base_oversubscribe": "1", "FLARE_DISABLE_PLUGIN_AUTOLOAD": "1",
       "COLUMNS": "1000"}  # one error per line
MAIN = "import sys; from flare.core.cli import main; sys.exit(main(sys.argv[1:]))"
REQUESTS = "\n".join(json.dumps(r) for r in [
    {"id": "a", "prompt": "Hello world", "max_new_tokens": 8},
    {"id": "b", "prompt": "The quick brown fox", "max_new_tokens": 6},
    {"id": "c", "prompt": "abc", "max_new_tokens": 10},
]) + "\n"


@pytest.fixture(scope="module")
def cores(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ranks")
    (d / "requests.jsonl").write_text(REQUESTS)
    return {"moe": export_core("moe-lm", d / "moe.core", progress=False),
            "nomixed": export_core(ToyLM(mixed=False), d / "nomixed.core", progress=False),
            "requests": d / "requests.jsonl"}


def _flare(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", MAIN, *argv], env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def test_two_ranks_forward_flags_and_match_one_rank(cores) -> None:
    from flare.plugins.export.serve import main

    out = _flare("run", str(cores["moe"]), "--ranks", "2", "--no-mixed-prefill", "--requests",
                 str(cores["requests"]), "--json")
    assert out.returncode == 0, out.stderr
    multi = json.loads(out.stdout)
    buf = io.StringIO()
    assert main(str(cores["moe"]), ["--no-mixed-prefill", "--requests", str(cores["requests"]), "--json"],
                stdout=buf) == 0
    single = json.loads(buf.getvalue())
    ranks = multi["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:     # every rank got --no-mixed-prefill and selected the same programs
        assert r["options"]["mixed_prefill"] is False and r["mixed_prefill"] is False
        assert r["digest"] == single["load"]["digest"]
        assert not any(p.startswith("mixed") for p in r["programs"])
        assert r["local_experts"] == 8                           # 16 experts of tiny, split in two
        assert r["launches"] == multi["launches_by_program"]     # every rank ran every step
    # expert parallelism: bitwise the same logits (and tokens) as one rank
    assert multi["logits_sha256"] == single["logits_sha256"]
    assert [r["tokens"] for r in multi["per_request"]] == [r["tokens"] for r in single["per_request"]]
    one = single["memory"]["cpu:0"]["persistent_bytes"]
    assert all(r["memory"]["cpu:0"]["persistent_bytes"] < 0.8 * one for r in ranks)


def test_rank_zero_reads_the_command_line(cores) -> None:
    """Started by hand with different flags per rank (MPMD): rank 0's options win everywhere."""
    cmd = mpirun_command(1, ["run", str(cores["moe"]), "--no-mixed-prefill", "--check", "--json"])
    rank1 = cmd[cmd.index(sys.executable):]
    rank1[rank1.index("--no-mixed-prefill")] = "--mixed-prefill"
    out = subprocess.run(cmd + [":", "-n", "1", *rank1], env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [(r["rank"], r["options"]["mixed_prefill"], r["mixed_prefill"]) for r in report["ranks"]] == [
        (0, False, False), (1, False, False)]
    assert len({r["digest"] for r in report["ranks"]}) == 1


def test_all_ranks_stop_with_the_same_error(cores) -> None:
    out = _flare("run", str(cores["nomixed"]), "--ranks", "2", "--mixed-prefill", "--check")
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 2 and lines[0] == lines[1], out.stderr
    assert lines[0].startswith("error: RankError: rank 0 of 2 stopped: SelectionError: options.mixed_prefill: "
                               "--mixed-prefill was asked for, but the core has no mixed programs: toy-lm was built "
                               "with mixed=False"), lines[0]
