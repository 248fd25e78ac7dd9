"""flare bench on an exported core: mixed prefill on vs off under one concurrent workload.

Tiny and fast: one block, one request (a workload of 4 sequences arriving at once, so
the schedule is deterministic). No test asserts a time."""
from __future__ import annotations

import pytest

from flare.plugins.bench import parse_config, run_bench
from flare.plugins.bench.errors import BenchConfigError
from flare.plugins.bench.report import to_json
from flare.plugins.export import export_core


@pytest.fixture(scope="module")
def tiny_core(tmp_path_factory):
    path = tmp_path_factory.mktemp("cores") / "tiny.core"
    export_core("moe-lm", path, options={"size": "tiny"}, progress=False)
    return path


def config(name, core, **options):
    opts = {"core": str(core), "sequences": 4, "new_tokens": 4, "gap_ms": 0.0, **options}
    return parse_config({"model": "moe-lm-serving", "options": opts}, name=name, known_backends=["cpu"])


def test_mixed_on_and_off_generate_the_same_tokens_with_fewer_launches(tiny_core):
    result = run_bench(config("on", tiny_core), config("off", tiny_core, mixed_prefill=False),
                       blocks=1, requests=1, warmup=0)
    assert result.ok and result.outputs.identical
    on, off = result.summaries["A"].extras, result.summaries["B"].extras
    assert set(on) == set(off) == {"time to first token, mean (ms)", "program launches"}
    assert on["program launches"] < off["program launches"]   # a mixed step replaces a prefill and a decode
    assert "8 programs" in result.descriptions["A"] and "6 programs" in result.descriptions["B"]
    doc = to_json(result)
    assert doc["summary"]["A"]["extras"]["program launches"] == on["program launches"]
    assert doc["runs"][0]["extras"]["program launches"] == [on["program launches"]]


def test_a_rebuilt_serving_configuration_is_refused(tiny_core):
    with pytest.raises(BenchConfigError, match="prepared"):
        parse_config({"model": "moe-lm-serving", "prepared": False, "options": {"core": str(tiny_core)}},
                     name="x", known_backends=["cpu"])
