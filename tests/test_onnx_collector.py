"""The runner keeps the collector's full passes off its plans (collector.py): a traced call
freezes what it left alive, cycles among frozen objects are reclaimed once the frozen count
(process-wide, over every runner) has doubled (longer after reclaims that found nothing), and
`freeze_gc=False` leaves the collector alone. Runs on the CPU only: what is tested is Python's collector, not a backend."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from flare.core.session import Session  # noqa: E402
from flare.models.onnx import collector  # noqa: E402
from flare.models.onnx.loader import load_model  # noqa: E402
from flare.models.onnx.runner import OnnxRunner  # noqa: E402
from flare.plugins.testing.threads import run_threads  # noqa: E402


@pytest.fixture(autouse=True)
def _unfrozen(monkeypatch):
    monkeypatch.setattr(collector, "COUNTS", collector.Counts())
    gc.unfreeze()
    yield
    gc.unfreeze()


def _relu_model(tmp_path) -> str:
    f = TensorProto.FLOAT
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", f, ["L"])],
                              [helper.make_tensor_value_info("y", f, ["L"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "relu.onnx"
    onnx.save(model, str(path))
    return str(path)


def _young_ids() -> set[int]:
    return {id(o) for o in gc.get_objects()}  # the permanent generation is not listed


class _Node:
    def __init__(self):
        self.me = self  # a cycle: freed only by the collector


@pytest.mark.parametrize("freeze", [True, False])
def test_a_traced_call_freezes_its_plans_unless_told_not_to(tmp_path, freeze):
    x = np.array([-1.0, 2.0, -3.0], np.float32)
    with Session(["cpu"]) as sess:
        runner = OnnxRunner(load_model(_relu_model(tmp_path)), sess, freeze_gc=freeze)
        np.testing.assert_array_equal(runner.run({"x": x})["y"], np.maximum(x, 0))
        pg = runner.prepared_graphs()[0]
        assert (gc.get_freeze_count() > 0) is freeze
        assert (id(pg) not in _young_ids()) is freeze
        assert gc.isenabled()
        np.testing.assert_array_equal(runner.run({"x": x})["y"], np.maximum(x, 0))  # frozen plans still run
        runner.release()


def test_frozen_cycles_are_reclaimed_once_the_frozen_count_doubles(monkeypatch):
    monkeypatch.setattr(collector, "RECLAIM_AT", 0)
    counts = collector.COUNTS
    collector.FreezePolicy().after_trace()   # past RECLAIM_AT (0) and twice the base (0): a reclaim
    assert counts.reclaims == 1 and counts.base > 0 and gc.get_freeze_count() > 0
    garbage = _Node()
    gone = weakref.ref(garbage)
    gc.freeze()                              # a cycle alive at a freeze ...
    del garbage
    gc.collect()
    assert gone() is not None                # ... is skipped by full collections while frozen
    counts.base = counts.frozen + 10_000     # not doubled yet: no reclaim
    collector.FreezePolicy().after_trace()   # (another runner's policy: the counts are shared)
    assert counts.reclaims == 1 and gone() is not None
    counts.base = 0                          # doubled: unfrozen, collected, frozen again
    collector.FreezePolicy().after_trace()
    assert counts.reclaims == 2 and gone() is None
    assert gc.get_freeze_count() > 0


def test_barren_reclaims_wait_longer_and_garbage_resets_the_wait(monkeypatch):
    """A reclaim that collects (almost) nothing doubles the growth the next one waits for (up
    to MAX_GROWTH); one that collects garbage sets it back to 2."""
    monkeypatch.setattr(collector, "RECLAIM_AT", 0)
    counts = collector.COUNTS
    gc.collect()
    collector.reclaim()                      # nothing to collect: wait for 4x
    assert counts.growth == 4 and counts.reclaims == 1
    collector.reclaim()
    collector.reclaim()
    collector.reclaim()
    assert counts.growth == collector.MAX_GROWTH == 16
    counts.frozen = 3 * counts.base          # past 2x, under 16x: no reclaim
    collector.FreezePolicy().after_trace()
    assert counts.reclaims == 4
    monkeypatch.setattr(collector, "BARREN", 1e-9)  # any garbage at all is worth it
    junk = [_Node() for _ in range(10)]
    gc.freeze()                              # cycles alive at a freeze, then dropped: frozen garbage
    del junk
    counts.frozen = counts.growth * counts.base + 1
    collector.FreezePolicy().after_trace()   # past 16x: a reclaim, which finds the cycles
    assert counts.reclaims == 5 and counts.growth == 2


def test_runners_on_threads_freeze_one_at_a_time(tmp_path):
    """Two runners (one per thread, as runner.py says) tracing at once: both right, the counts
    kept under the module's lock."""
    path = _relu_model(tmp_path)
    with Session(["cpu"]) as sess:
        runners = [OnnxRunner(load_model(path), sess) for _ in range(2)]

        def work(i):
            rng = np.random.default_rng(i)
            for n in range(1, 13):  # a new length each call: a trace and a freeze each
                x = rng.standard_normal(n).astype(np.float32)
                np.testing.assert_array_equal(runners[i].run({"x": x})["y"], np.maximum(x, 0))

        errors = run_threads(work, len(runners))
        for r in runners:
            r.release()
    assert not errors
    assert collector.COUNTS.frozen > 0 and gc.get_freeze_count() > 0
