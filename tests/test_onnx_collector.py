"""The runner keeps the collector's full passes off its plans (collector.py): a traced call
freezes what it left alive, cycles among frozen objects are reclaimed once the frozen count
has doubled, and `freeze_gc=False` leaves the collector alone. Runs on the CPU only: what is
tested is Python's collector, not a backend."""
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


@pytest.fixture(autouse=True)
def _unfrozen():
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
    policy = collector.FreezePolicy()
    policy.after_trace()                 # past RECLAIM_AT (0) and twice the base (0): a reclaim, then frozen
    assert policy.reclaims == 1 and policy.base > 0 and gc.get_freeze_count() > 0
    garbage = _Node()
    gone = weakref.ref(garbage)
    gc.freeze()                          # a cycle alive at a freeze ...
    del garbage
    gc.collect()
    assert gone() is not None            # ... is skipped by full collections while frozen
    policy.base = policy.frozen + 10_000  # not doubled yet: no reclaim
    policy.after_trace()
    assert policy.reclaims == 1 and gone() is not None
    policy.base = 0                       # doubled: unfrozen, collected, frozen again
    policy.after_trace()
    assert policy.reclaims == 2 and gone() is None
    assert gc.get_freeze_count() > 0
