"""`flare bench` on a model that registers only a ModelSpec: the generic graph workload
prepares it through `Session.prepare_model`, so its placement callback applies."""
from __future__ import annotations

import numpy as np

from flare.core.plugin_manager import get_plugin_manager, hookimpl
from flare.plugins.bench import parse_config, run_bench
from flare.plugins.bench.workload import forget_workloads
from flare.core.specs import ModelGraph, ModelSpec

W = np.random.default_rng(3).standard_normal((8, 8)).astype(np.float32)


def _graph(options):
    def full(b, shapes):
        x = b.input("x", shapes["x"])
        h = b.relu(b.matmul(x, b.weight("head.w", W), transpose_b=True), name="head.relu")
        b.output("y", b.softmax(b.matmul(h, b.weight("tail.w", W), transpose_b=True), name="tail.softmax"))

    return ModelGraph({"full": full}, {"full": {"x": (4, 8)}})


def _placement(tensor, devices):
    """head.* on the first device, tail.* on the last."""
    if tensor.name.startswith("head."):
        return devices[0]
    if tensor.name.startswith("tail."):
        return devices[-1]
    return None


class PlacedToy:
    @hookimpl
    def flare_models(self):
        return [ModelSpec("placed-toy", "two layers, one per device", graph=_graph, placement=_placement)]


def test_generic_workload_honours_the_registered_placement():
    pm = get_plugin_manager()
    plugin = PlacedToy()
    pm.register(plugin, name="placed-toy-plugin")
    forget_workloads()
    try:
        a = parse_config({"model": "placed-toy", "backends": ["cpu:0"]}, name="one")
        b = parse_config({"model": "placed-toy", "backends": ["cpu:0", "cpu:1"]}, name="two")
        result = run_bench(a, b, blocks=1, requests=2, warmup=0)
        assert result.ok, result.outputs.summary()
        assert result.metric.name == "executes/s"
        one, two = (result.summaries[k].memory_plan for k in result.summaries)
        assert one["entries"]["full"]["splits"] == 1 and set(one["persistent_bytes"]) == {"cpu:0"}
        # the placement callback put head.w on cpu:0 and tail.w on cpu:1: two splits, weights on both
        assert two["entries"]["full"]["splits"] == 2 and set(two["persistent_bytes"]) == {"cpu:0", "cpu:1"}
    finally:
        pm.pm.unregister(plugin)
        pm._models = None
        forget_workloads()


def _sized_graph(options):
    """`width` (a model option) decides the weight's size; unknown options are the model's error."""
    from flare.core.errors import ModelError

    unknown = set(options) - {"width"}
    if unknown:
        raise ModelError(f"sized-toy: unknown options {sorted(unknown)}")
    n = int(options.get("width", 8))

    def full(b, shapes):
        x = b.input("x", shapes["x"])
        b.output("y", b.matmul(x, b.weight("w", np.ones((n, 8), np.float32)), transpose_b=True))

    return ModelGraph({"full": full}, {"full": {"x": (2, 8)}})


class SizedToy:
    @hookimpl
    def flare_models(self):
        return [ModelSpec("sized-toy", "a model option decides a weight's size", graph=_sized_graph)]


def test_generic_workload_hands_options_to_the_model():
    import pytest

    from flare.core.errors import ModelError

    pm = get_plugin_manager()
    plugin = SizedToy()
    pm.register(plugin, name="sized-toy-plugin")
    forget_workloads()
    try:
        a = parse_config({"model": "sized-toy", "options": {"width": 16}}, name="wide")
        assert a.options == {"width": 16}
        result = run_bench(a, a, blocks=1, requests=1, warmup=0)
        plan = result.summaries["A"].memory_plan
        assert plan["persistent_bytes"]["cpu:0"] >= 16 * 8 * 4        # the 16-row weight, not the 8-row default
        bad = parse_config({"model": "sized-toy", "options": {"depth": 2}}, name="bad")
        with pytest.raises(ModelError, match="unknown options \\['depth'\\]"):
            run_bench(bad, bad, blocks=1, requests=1, warmup=0)
    finally:
        pm.pm.unregister(plugin)
        pm._models = None
        forget_workloads()
