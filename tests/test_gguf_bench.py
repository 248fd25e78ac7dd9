"""The `gguf` bench workload on a tiny file: prefill and decode counts, the same greedy logits
in both configurations. No test asserts a time."""
from __future__ import annotations

import pytest

from flare.models.gguf.testing import TinySpec, write_tiny
from flare.plugins.bench import parse_config, run_bench

pytestmark = pytest.mark.usefixtures("gguf_plugin")


@pytest.mark.parametrize("count, work", [("prefill", 12), ("decode", 3), ("all", 15)])
def test_gguf_workload_counts_and_agrees(count, work, tmp_path):
    path = write_tiny(tmp_path / "tiny.gguf", TinySpec(qtype="q4_0"))
    opts = {"target": str(path), "prompt_tokens": 12, "new_tokens": 3, "prefill_chunk": 8, "max_ctx": 32,
            "count": count}
    a = parse_config({"model": "gguf", "options": opts}, name="a", known_backends=["cpu"])
    b = parse_config({"model": "gguf", "options": {**opts, "prefill_chunk": 4}}, name="b", known_backends=["cpu"])
    result = run_bench(a, b, blocks=1, requests=1, warmup=0)
    assert result.ok, result.outputs       # chunks of 8 vs 4: the same logits within the workload tolerance
    assert [r.work for r in result.requests] == [work]
    for summary in result.summaries.values():       # the request's phases, timed inside it, as extras
        assert set(summary.extras) == {"prefill ms", "decode ms/token"}
        assert all(v > 0 for v in summary.extras.values()), summary.extras


def test_moe_experts_resident_vs_staged_with_prefetch_agree_in_fewer_bytes(tmp_path, monkeypatch):
    """The MoE staging benchmark's pair on a tiny MoE file: `bench-moe` resolves to a file written
    once into the cache folder; resident and staged (with prefetch) experts give identical logits,
    and the staged run's peak device bytes are below the resident one's."""
    from flare.models.gguf import testing

    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(testing, "BENCH_MOE", TinySpec(n_experts=16, top_k=2, qtype="q4_0", n_layers=3, d_ff=256,
                                                       seed=3))
    path = testing.ensure_bench_moe()
    assert path.parent == tmp_path / "cache" / "gguf" and testing.ensure_bench_moe() == path
    assert [p.name for p in path.parent.iterdir()] == [path.name]            # no temp file left behind
    opts = {"target": "bench-moe", "prompt_tokens": 8, "new_tokens": 4, "prefill_chunk": 4, "max_ctx": 32,
            "count": "decode"}
    a = parse_config({"model": "gguf", "threads": 1, "options": {**opts, "experts": "resident"}}, name="a",
                     known_backends=["cpu"])
    b = parse_config({"model": "gguf", "threads": 1, "options": {**opts, "experts": "offload", "prefetch": 2}},
                     name="b", known_backends=["cpu"])
    result = run_bench(a, b, blocks=1, requests=1, warmup=0)
    assert result.ok and result.outputs.identical, result.outputs
    peaks = [sum(result.summaries[k].ledger_peak_bytes.values()) for k in result.summaries]
    assert peaks[1] < peaks[0], peaks
