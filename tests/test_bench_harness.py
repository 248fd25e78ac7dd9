"""flare bench harness: A B B A order, output checks, JSON schema, CLI. No test asserts a time."""
from __future__ import annotations

import json

import numpy as np
import pytest

from flare.plugins.bench import BenchConfigError, parse_config, run_bench
from flare.plugins.bench import testing as fake

from flare.plugins.bench.compare import compare_outputs
from flare.plugins.bench.order import abba, pairs
from flare.plugins.bench.report import SCHEMA, to_json
from flare.core.cli import main

fake.register()   # the bench-fake workload


def cfg(name: str, **options):
    top = {k: options.pop(k) for k in ("peer", "prepared", "workspace_sharing") if k in options}
    return parse_config({"model": "bench-fake", **top, "options": options}, name=name, known_backends=["cpu"])


@pytest.fixture(autouse=True)
def clear_log():
    fake.LOG.clear()
    yield
    fake.LOG.clear()


# -- order -------------------------------------------------------------------------
def test_abba_blocks_and_pairs():
    assert [s.key for s in abba(2)] == list("ABBAABBA")
    assert [(s.block, s.position, s.index) for s in abba(1)] == [(0, 0, 0), (0, 1, 1), (0, 2, 2), (0, 3, 3)]
    assert pairs(2) == [(0, 1), (3, 2), (4, 5), (7, 6)]
    with pytest.raises(ValueError):
        abba(0)


def test_runs_follow_a_b_b_a_after_priming_each_once():
    result = run_bench(cfg("a"), cfg("b", peer="other"), blocks=2, requests=3)
    assert fake.LOG == ["a", "b"] + ["a", "b", "b", "a"] * 2
    assert [r.slot.key for r in result.runs] == list("ABBAABBA")
    assert all(len(r.latencies_s) == 3 for r in result.runs)
    assert [(p.a_run, p.b_run) for p in result.pairs] == [(0, 1), (3, 2), (4, 5), (7, 6)]


def test_progress_is_reported_for_every_request():
    seen = []
    run_bench(cfg("a"), cfg("b"), blocks=1, requests=2, warmup=0,
              progress=lambda slot, done, total, phase: seen.append((slot.key, done, phase)))
    runs = [s for s in seen if s[2] != "prime"]
    assert runs[:4] == [("A", 0, "open"), ("A", 1, "run"), ("A", 2, "run"), ("A", 2, "done")]
    assert sum(1 for s in runs if s[2] == "run") == 8


# -- outputs -----------------------------------------------------------------------
def test_identical_outputs_are_detected():
    result = run_bench(cfg("a"), cfg("b", peer="other"), blocks=1, requests=3)
    assert result.outputs.identical and result.outputs.verdict == "identical" and result.ok
    assert all(s.deterministic for s in result.summaries.values())


def test_a_changed_output_fails_the_comparison():
    result = run_bench(cfg("a"), cfg("b", scale=1.5), blocks=1, requests=3)
    out = result.outputs
    assert not out.identical and not out.within_tolerance and out.verdict == "DIFFERENT"
    assert out.first_mismatch == 1 and out.max_abs_diff == pytest.approx(1.0)  # request 0 is 0 * scale
    assert not result.ok


def test_small_differences_are_within_the_stated_tolerance():
    result = run_bench(cfg("a"), cfg("b", scale=1.0002), blocks=1, requests=3)
    assert not result.outputs.identical and result.outputs.within_tolerance and result.ok
    assert result.outputs.tolerance == fake.FakeWorkload.tolerance
    assert "<= tolerance 0.001" in result.outputs.summary()


def test_a_nondeterministic_configuration_is_reported():
    result = run_bench(cfg("a"), cfg("b", drift=0.5), blocks=1, requests=2)
    assert result.summaries["A"].deterministic and not result.summaries["B"].deterministic
    assert not result.ok


def test_compare_outputs_edge_cases():
    a = [np.array([1.0, np.nan]), np.zeros(3)]
    assert compare_outputs(a, [np.array([1.0, np.nan]), np.zeros(3)], 0.0).identical
    one_nan = compare_outputs(a, [np.array([1.0, 2.0]), np.zeros(3)], 1e9)
    assert not one_nan.within_tolerance and one_nan.first_mismatch == 0
    shape = compare_outputs(a, [np.array([1.0, np.nan]), np.zeros(4)], 1.0)
    assert not shape.within_tolerance and "shape" in shape.detail
    count = compare_outputs(a, a[:1], 1.0)
    assert not count.within_tolerance and "2 outputs vs 1" in count.detail


# -- report ------------------------------------------------------------------------
def test_json_schema():
    result = run_bench(cfg("a"), cfg("b", scale=1.5), blocks=1, requests=2)
    doc = json.loads(json.dumps(to_json(result)))
    assert doc["schema"] == SCHEMA and doc["model"] == "bench-fake"
    assert set(doc) >= {"metric", "order", "blocks", "warmup", "requests", "configs", "runs", "summary", "pairs",
                        "ratio", "outputs", "ok", "headline", "machine"}
    assert doc["order"] == list("ABBA") and doc["ok"] is False
    assert doc["metric"] == {"name": "items/s", "work_unit": "items", "lower_is_better": False}
    assert set(doc["configs"]) == {"A", "B"} and doc["configs"]["B"]["options"]["scale"] == 1.5
    run = doc["runs"][0]
    assert set(run) >= {"config", "block", "position", "index", "latencies_s", "total_s", "work", "metric",
                        "setup_s", "memory", "vs_first_run"}
    assert set(run["memory"]) >= {"ledger_peak_bytes", "peak_rss_bytes", "rss_growth_bytes", "rss_scope"}
    assert set(doc["summary"]["A"]) >= {"metric", "latency_median_s", "latency_p90_s", "ledger_peak_bytes",
                                        "peak_rss_bytes", "deterministic", "memory_plan"}
    assert set(doc["pairs"][0]) == {"block", "a_run", "b_run", "metric", "ledger_peak", "rss_growth"}
    assert set(doc["ratio"]["metric"]) == {"median", "min", "max", "pairs", "of"}
    assert doc["pairs"][0]["ledger_peak"] is None   # 0 / 0: no device memory on either side
    assert doc["outputs"]["verdict"] == "DIFFERENT" and doc["outputs"]["first_mismatch"] == 1


# -- command line ------------------------------------------------------------------
def write_pair(tmp_path, b_extra: str = ""):
    a = tmp_path / "a.toml"
    b = tmp_path / "b.toml"
    a.write_text('model = "bench-fake"\n')
    b.write_text('model = "bench-fake"\npeer = "other"\n' + b_extra)
    return a, b


def test_cli_writes_table_json_and_png(tmp_path, capsys):
    a, b = write_pair(tmp_path)
    out_json, out_png = tmp_path / "out" / "r.json", tmp_path / "r.png"
    rc = main(["bench", str(a), str(b), "--blocks", "1", "--requests", "2", "--json", str(out_json),
               "--plot", str(out_png), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "items/s" in text and "->" in text and "B/A" in text and "identical" in text
    assert json.loads(out_json.read_text())["schema"] == SCHEMA
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_exit_1_when_outputs_differ(tmp_path, capsys):
    a, b = write_pair(tmp_path, "[options]\nscale = 2.0\n")
    assert main(["bench", str(a), str(b), "--blocks", "1", "--requests", "2", "--no-progress"]) == 1
    assert "DIFFERENT" in capsys.readouterr().err


def test_cli_bad_config_is_one_line_naming_file_and_key(tmp_path, capsys):
    a, b = write_pair(tmp_path, "[options]\nscael = 2.0\n")
    assert main(["bench", str(a), str(b), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "BenchConfigError" in err and "b.toml" in err and "options.scael" in err and "scale" in err


def test_cli_needs_two_configs_and_sane_counts(tmp_path, capsys):
    a, b = write_pair(tmp_path)
    assert main(["bench", str(a)]) == 2
    assert main(["bench", str(a), str(b), "--blocks", "0"]) == 2
    assert "--blocks must be at least 1" in capsys.readouterr().err


def test_cli_lists_models_and_options(capsys):
    assert main(["bench", "--list-options"]) == 0
    assert "silero-vad" in capsys.readouterr().out
    assert main(["bench", "--list-options", "minilm-l6"]) == 0
    out = capsys.readouterr().out
    assert "batch" in out and "peer numpy" in out


def test_parse_config_in_code_has_no_path():
    with pytest.raises(BenchConfigError) as info:
        parse_config({"model": "bench-fake", "options": {"mode": 3}}, known_backends=["cpu"])
    assert info.value.path is None and str(info.value).startswith("key 'options.mode'")


def test_default_warmup_serves_every_request_once_per_run():
    phases = []
    result = run_bench(cfg("a"), cfg("b"), blocks=1, requests=3,
                       progress=lambda slot, done, total, phase: phases.append(phase))
    assert result.warmup == 3 and phases.count("warmup") == 4 * 3
