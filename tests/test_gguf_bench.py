"""The `gguf` bench workload on a tiny file: prefill and decode counts, the same greedy logits
in both configurations. No test asserts a time."""
from __future__ import annotations

import pytest

from flare.models.gguf.testing import TinySpec, write_tiny
from flare.plugins.bench import parse_config, run_bench


@pytest.fixture(autouse=True, scope="module")
def _registered():
    from flare.core.plugin_manager import get_plugin_manager
    from flare.models.gguf import plugin

    pm = get_plugin_manager()
    if "gguf" not in pm.models():
        pm.register(plugin, name="flare.models.gguf.plugin")


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
