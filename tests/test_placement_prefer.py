"""Placement callbacks that can ask and prefer: `devices.can_run(node, name)` answers whether
a device supports a node, and `Prefer(name)` is a wish the scheduler overrules (recording
the fallback) where that device cannot run the node; a plain name still insists.

The scenario of issue 23: a model's head put on a device that lacks `argmax`. The device is
a CPU device whose `supports` refuses argmax, registered as backend `noargmax` through a
plugin manager of its own (so nothing else of the installation changes)."""
from __future__ import annotations

import numpy as np
import pytest

from flare.backends.cpu.backend import CpuBackend
from flare.backends.cpu.device import CpuDevice
from flare.core import PlacementDevices, Prefer
from flare.core.backend import ProbeResult
from flare.core.errors import PlacementError
from flare.core.plugin_manager import PluginManager, hookimpl
from flare.core.session import Session
from flare.core.specs import BackendSpec, ModelGraph, ModelSpec

W = np.random.default_rng(5).uniform(-1, 1, (6, 4)).astype(np.float32)


class NoArgmaxDevice(CpuDevice):
    backend = "noargmax"

    def supports(self, node) -> bool:
        return node.op != "argmax" and super().supports(node)


class NoArgmaxBackend(CpuBackend):
    name = "noargmax"

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, "the CPU without argmax", ("noargmax:0",))

    @classmethod
    def open_devices(cls, config=None):
        return [NoArgmaxDevice("noargmax:0")]


def classify(b, shapes):
    """body: a matmul; head: softmax and argmax (the model's head, routed by name)."""
    x = b.input("x", shapes["x"])
    with b.scope("body"):
        h = b.matmul(x, b.weight("w", W), transpose_b=True)
    with b.scope("head"):
        p = b.softmax(h)
        b.output("label", b.argmax(p))
    b.output("p", p)


def head_prefers_last(tensor, devices):
    return Prefer(devices[-1]) if tensor.name.startswith("head/") else None


def head_insists_last(tensor, devices):
    return devices[-1] if tensor.name.startswith("head/") else None


class Plugin:
    @hookimpl
    def flare_backends(self):
        return [BackendSpec("noargmax", NoArgmaxBackend)]

    @hookimpl
    def flare_models(self):
        return [ModelSpec("classifier", "a head on the last device", placement=head_prefers_last,
                          graph=lambda options: ModelGraph({"full": classify}, {"full": {"x": (3, 4)}}))]


@pytest.fixture()
def plugins() -> PluginManager:
    pm = PluginManager(autoload=False, groups=("flare.backends",))
    pm.register(Plugin(), name="noargmax-test")
    return pm


def _where(pg, entry="full") -> dict[str, str]:
    plan = pg.current_plan(entry)
    return {n.name: plan.schedule.device_of[n.id] for n in plan.graph.nodes}


def test_a_preferred_head_falls_back_and_says_so(plugins):
    x = np.random.default_rng(1).uniform(-1, 1, (3, 4)).astype(np.float32)
    with Session(["cpu", "noargmax"], plugins=plugins) as sess, sess.prepare_model("classifier") as pg:
        where = _where(pg)
        assert where["head/softmax_1"] == "noargmax:0"            # the preference held where it could
        assert where["head/argmax_2"] == "cpu:0"                  # and fell back where it could not
        info = pg.describe()["entries"]["full"]
        assert info["placement_fallbacks"] == [
            "head/argmax_2 (argmax): preferred noargmax:0, runs on cpu:0 (noargmax:0 does not support argmax)"]
        out = pg.execute("full", x=x)
    logits = x.astype(np.float64) @ W.T.astype(np.float64)
    np.testing.assert_array_equal(out["label"], logits.argmax(-1).astype(np.int32))


def test_insisting_on_a_device_that_cannot_run_the_node_is_an_error(plugins):
    with Session(["cpu", "noargmax"], plugins=plugins) as sess:
        with pytest.raises(PlacementError, match="'head/argmax_2' \\(argmax\\) on noargmax:0, which does not support it"):
            sess.prepare({"full": classify}, {"full": {"x": (3, 4)}}, placement=head_insists_last)


def test_strict_mode_refuses_an_overruled_preference(plugins):
    with Session(["cpu", "noargmax"], plugins=plugins) as sess:
        with pytest.raises(PlacementError, match="strict placement.*head/argmax_2 \\(argmax\\): preferred noargmax:0"):
            sess.prepare_model("classifier", strict=True)


def test_a_callback_can_ask_whether_a_device_runs_a_node(plugins):
    asked: list[tuple[str, bool]] = []

    def placement(tensor, devices):
        assert isinstance(devices, PlacementDevices) and list(devices) == ["cpu:0", "noargmax:0"]
        if tensor.op in ("softmax", "argmax"):
            ok = devices.can_run(tensor, "noargmax")        # a backend name means its first device
            asked.append((tensor.op, ok))
            return "noargmax:0" if ok else devices[0]
        return None

    with Session(["cpu", "noargmax"], plugins=plugins) as sess, \
            sess.prepare({"full": classify}, {"full": {"x": (3, 4)}}, placement=placement) as pg:
        assert _where(pg)["head/argmax_2"] == "cpu:0" and pg.describe()["entries"]["full"]["placement_fallbacks"] == []
    assert ("softmax", True) in asked and ("argmax", False) in asked
