"""How the ONNX runner keeps its prepared graphs (runner.py's docstring): the segments at one
place of the trace share one PreparedGraph with a plan per input shape; a segment whose input
shapes were seen there with another structure runs on a graph of its own; computed constants
are weights named by their content, so a shared graph never reads another shape's constant;
a family is replaced after FAMILY_PLANS shapes; release() returns every buffer. And how it
replays a recorded trace (replay.py): new data through the recorded segments, every value the
trace read checked, another recording or a new trace when one differs.
Results are checked against onnx's reference evaluator (exact ops, or f32 sums of a few terms:
1e-6)."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from flare.core.ledger import LEDGER  # noqa: E402
from flare.core.session import Session  # noqa: E402
from flare.models.onnx import runner as runner_mod  # noqa: E402
from flare.models.onnx.loader import load_model  # noqa: E402
from flare.models.onnx.runner import OnnxRunner  # noqa: E402
from flare.plugins.testing.threads import run_threads  # noqa: E402


def _save(tmp_path, name, nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, name, inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return model, str(path)


def _ramp_model(tmp_path):
    """y = x + Range(0, L) * 0.5 (L = x's length, folded from its shape: a computed constant whose
    value depends on the input shape), then NonZero(y > 1) -> Gather: a host step, so two segments."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Range", ["zero", "n", "one"], ["r"]),
        helper.make_node("Cast", ["r"], ["rf"], to=f),
        helper.make_node("Mul", ["rf", "half"], ["ramp"]),
        helper.make_node("Add", ["x", "ramp"], ["y"]),
        helper.make_node("Greater", ["y", "onef"], ["g"]),
        helper.make_node("NonZero", ["g"], ["nz"]),
        helper.make_node("Squeeze", ["nz", "zero1"], ["idx"]),
        helper.make_node("Gather", ["y", "idx"], ["z"], axis=0),
    ]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.array([0], np.int64), "zero1"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half"),
             numpy_helper.from_array(np.array(1.0, np.float32), "onef")]
    return _save(tmp_path, "ramp", nodes, [helper.make_tensor_value_info("x", f, ["L"])],
                 [helper.make_tensor_value_info("z", f, ["K"])], inits)


def _check(model, runner, x):
    want = ReferenceEvaluator(model).run(None, {"x": x})
    got = runner.run({"x": x})
    for name, w in zip([o.name for o in model.graph.output], want):
        np.testing.assert_allclose(got[name], w, rtol=1e-6, atol=1e-6)


def test_shapes_share_a_family_graph_and_its_weights(tmp_path):
    model, path = _ramp_model(tmp_path)
    rng = np.random.default_rng(1)
    before = LEDGER.snapshot().count()
    with Session(["cpu"]) as sess:
        runner = OnnxRunner(load_model(path), sess)
        for n in (6, 9, 6, 4, 9):
            _check(model, runner, rng.uniform(-1, 2, n).astype(np.float32))
        # two places in the trace (before and after NonZero): two graphs, not one per shape
        assert len(runner.prepared_graphs()) == 2
        # ... sharing one workspace, counted once
        assert runner.describe()["workspace_bytes"]["cpu:0"] == runner.workspace.nbytes("cpu:0") > 0
        # new plans only for new input shapes: 6, 9, 4 before NonZero; after it, one per (L, K) seen
        assert runner.stats["prepared"] <= 3 + 5
        runner.release()
        runner.release()  # idempotent
        assert LEDGER.snapshot().count() == before
        _check(model, runner, rng.uniform(-1, 2, 5).astype(np.float32))  # usable again: prepares anew
        runner.release()
    assert LEDGER.snapshot().count() == before


def test_same_shapes_other_structure_get_a_graph_of_their_own(tmp_path):
    """If on a computed condition: the branch after it has the same input shapes either way."""
    f = TensorProto.FLOAT
    then_g = helper.make_graph([helper.make_node("Relu", ["x"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", f, ["L"])])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", f, ["L"])])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zerof"], ["c"]),
        helper.make_node("If", ["c"], ["b"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Mul", ["b", "x"], ["y"]),
    ]
    model, path = _save(tmp_path, "branch", nodes, [helper.make_tensor_value_info("x", f, ["L"])],
                        [helper.make_tensor_value_info("y", f, ["L"])],
                        [numpy_helper.from_array(np.array(0.0, np.float32), "zerof")])
    pos = np.array([1.0, -0.5, 2.0], np.float32)
    before = LEDGER.snapshot().count()
    with Session(["cpu"]) as sess:
        runner = OnnxRunner(load_model(path), sess)
        for x in (pos, -pos, pos, -pos):
            _check(model, runner, x)
        assert len(runner._plans) == 1  # the second structure's graph, outside the family
        assert runner.stats["replayed"] == 2  # the condition read back picks the recording of its branch
        assert runner.stats["resumed"] == 1   # -pos: the trace resumed at the If (its checkpoint)
        runner.release()
    assert LEDGER.snapshot().count() == before


def test_a_full_family_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_mod, "FAMILY_PLANS", 2)
    model, path = _ramp_model(tmp_path)
    rng = np.random.default_rng(2)
    before = LEDGER.snapshot().count()
    with Session(["cpu"]) as sess:
        runner = OnnxRunner(load_model(path), sess)
        first = None
        xs = {n: rng.uniform(-1, 2, n).astype(np.float32) for n in (5, 6, 7)}
        for n in (5, 6, 7, 5):
            _check(model, runner, xs[n])
            graphs = runner.prepared_graphs()
            first = first or graphs[0]
            assert len(graphs) == 2
        assert first not in runner.prepared_graphs()  # the first family's graph was released and replaced
        # the recording of the first call keeps no tensors (Segment.slim) and its plan went with the
        # old family: the same call again was traced, not replayed (and is right: _check)
        assert runner.stats["replayed"] == 0
        _check(model, runner, xs[5])
        assert runner.stats["replayed"] == 1          # ... and recorded again: the same x replays
        runner.release()
    assert LEDGER.snapshot().count() == before


def test_a_family_keeps_its_least_recently_used_plans_only(tmp_path, monkeypatch):
    """PLANS_KEPT bounds the plans (host objects, compiled programs) of a family graph; a call
    whose plan was dropped is planned again: traced (its recording has no tensors), and right."""
    monkeypatch.setattr(runner_mod, "PLANS_KEPT", 2)
    model, path = _ramp_model(tmp_path)
    rng = np.random.default_rng(3)
    xs = {n: rng.uniform(-1, 2, n).astype(np.float32) for n in (5, 6, 7)}
    with Session(["cpu"]) as sess:
        runner = OnnxRunner(load_model(path), sess)
        for n in (5, 6, 7):
            _check(model, runner, xs[n])
        assert all(len(list(pg.plans.all())) <= 2 for pg in runner.prepared_graphs())
        _check(model, runner, xs[7])                  # kept: replayed
        assert runner.stats["replayed"] == 1
        _check(model, runner, xs[5])                  # dropped: planned again, not replayed
        assert runner.stats["replayed"] == 1
        assert all(len(list(pg.plans.all())) <= 2 for pg in runner.prepared_graphs())
        runner.release()


def test_the_fold_memo_keeps_small_outputs_within_its_byte_bound(tmp_path, monkeypatch):
    """Folds of computed constants are remembered by value only for small outputs, and the memo
    is cleared past FOLD_MEMO_TOTAL bytes (it held ~6 MB per new Piper sentence: whole-length
    ConstantOfShape outputs); results stay right either way."""
    model, path = _ramp_model(tmp_path)
    with Session(["cpu"]) as sess:
        runner = OnnxRunner(load_model(path), sess)
        _check(model, runner, np.linspace(-1, 3, 6).astype(np.float32))
        ranges = [key for key in runner._folded_by_value if key[0] == ("Range", ("zero", "n", "one"), ("r",))]
        assert ranges and runner._folded_by_value_bytes >= 48     # Range(0, 6) as int64 remembered
        monkeypatch.setattr(runner_mod, "FOLD_MEMO_OUT_BYTES", 8)   # Range(0, 7) as int64: 56 bytes
        monkeypatch.setattr(runner_mod, "FOLD_MEMO_TOTAL", 64)
        for n in (7, 8, 9):
            _check(model, runner, np.linspace(-1, 3, n).astype(np.float32))
            assert 0 < runner._folded_by_value_bytes <= 64
            assert all(sum(v.const.nbytes for v in outs) <= 8 for outs in runner._folded_by_value.values())
        runner.release()


def _ramp2_model(tmp_path):
    """`_ramp_model` whose ramp is read after its NonZero too (Gather by idx, added to z): ramp2."""
    f = TensorProto.FLOAT
    base, _ = _ramp_model(tmp_path)
    nodes = list(base.graph.node) + [helper.make_node("Gather", ["ramp", "idx"], ["rz"], axis=0),
                                     helper.make_node("Add", ["z", "rz"], ["w"])]
    return _save(tmp_path, "ramp2", nodes, list(base.graph.input),
                 [helper.make_tensor_value_info("w", f, ["K"])], list(base.graph.initializer))


@pytest.mark.parametrize("limit, resumed", [(1 << 20, 1), (8, 0)])
def test_a_checkpoint_keeps_computed_constants_up_to_a_bound(tmp_path, monkeypatch, limit, resumed):
    """The ramp (a constant computed from x's length) is read after NonZero too, so the NonZero
    checkpoint keeps it; past CHECKPOINT_BYTES the checkpoint is not taken and a replay that
    diverges there traces the call whole. Right either way."""
    monkeypatch.setattr(runner_mod, "CHECKPOINT_BYTES", limit)
    model, path = _ramp2_model(tmp_path)
    ramp = np.arange(6, dtype=np.float32) * 0.5
    keep_odd = np.where(np.arange(6) % 2 == 1, 1.5, 0.0).astype(np.float32) - ramp + 0.25
    keep_first = np.where(np.arange(6) < 2, 1.5, 0.0).astype(np.float32) - ramp + 0.25
    with Session(["cpu"]) as sess:
        runner = OnnxRunner(load_model(path), sess)
        _check(model, runner, keep_odd)
        _check(model, runner, keep_first)                     # diverges at NonZero's input
        assert runner.stats.get("resumed", 0) == resumed
        _check(model, runner, keep_first + 0.5)               # its recording replays either way
        assert runner.stats["replayed"] == 1
        runner.release()


def test_a_checkpoint_keeps_the_values_live_at_its_node(tmp_path):
    """What a checkpoint at NonZero (node 7 of ramp2) keeps: the values made before it that it or a
    later node reads, in walk order (`OnnxRunner.live_at`, computed once per position): not x (last
    read by the Add), not the file's initializers, not what only earlier nodes read."""
    model, path = _ramp2_model(tmp_path)
    with Session(["cpu"]) as sess:
        runner = OnnxRunner(load_model(path), sess)
        assert [n.op_type for n in runner.walk_plan()[0]].index("NonZero") == 7
        assert runner.live_at(7) == ("ramp", "y", "g")
        assert runner.live_at(0) == ("x",)
        assert runner.live_at(7) is runner.live_at(7)     # once per position
        ramp = np.arange(6, dtype=np.float32) * 0.5
        _check(model, runner, np.where(np.arange(6) % 2 == 1, 1.5, 0.0).astype(np.float32) - ramp + 0.25)
        _check(model, runner, np.where(np.arange(6) < 2, 1.5, 0.0).astype(np.float32) - ramp + 0.25)
        assert runner.stats["resumed"] == 1               # resumed from that checkpoint, right
        runner.release()


def test_replay_feeds_new_data_and_checks_what_the_trace_read(tmp_path):
    model, path = _ramp_model(tmp_path)
    ramp = np.arange(6, dtype=np.float32) * 0.5
    keep_odd = np.where(np.arange(6) % 2 == 1, 1.5, 0.0).astype(np.float32) - ramp + 0.25  # y > 1 at odd places
    keep_first = np.where(np.arange(6) < 2, 1.5, 0.0).astype(np.float32) - ramp + 0.25
    with Session(["cpu"]) as sess:
        runner = OnnxRunner(load_model(path), sess)
        _check(model, runner, keep_odd)                       # traced, recorded
        assert runner.stats["replayed"] == 0
        _check(model, runner, keep_odd + 0.125)               # same places kept, other values: replayed
        assert runner.stats["replayed"] == 1
        assert runner.stats.get("reused", 0) == 0
        segments = runner.stats["segments_run"]
        _check(model, runner, keep_first)                     # NonZero reads other places: traced again,
        assert runner.stats["replayed"] == 1                  # ... resumed at NonZero (the checkpoint of
        assert runner.stats["resumed"] == 1                   # the segment it closed), after the first
        assert runner.stats["segments_run"] == segments + 2   # segment the replay ran: not run again
        assert runner.stats.get("reused", 0) == 0
        assert runner.reuse == {} and runner.resume is None
        _check(model, runner, keep_odd - 0.0625)              # the first recording, found by what was read
        _check(model, runner, keep_first + 0.5)
        assert runner.stats["replayed"] == 3
        _check(model, runner, np.linspace(-1, 3, 7).astype(np.float32))  # another shape: traced
        assert runner.stats["replayed"] == 3
        assert runner.stats["resumed"] == 1
        runner.release()


def test_random_draws_are_drawn_again_on_replay(tmp_path):
    """y = x + 0 * RandomNormalLike(x): each call draws (a host step); the replay draws too."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("RandomNormalLike", ["x"], ["r"]), helper.make_node("Mul", ["r", "zerof"], ["z"]),
             helper.make_node("Add", ["x", "z"], ["y"])]
    model, path = _save(tmp_path, "noise", nodes, [helper.make_tensor_value_info("x", f, ["L"])],
                        [helper.make_tensor_value_info("y", f, ["L"])],
                        [numpy_helper.from_array(np.array(0.0, np.float32), "zerof")])
    draws = []
    from flare.models.onnx.lowering import HOST_STEPS
    original = HOST_STEPS["RandomNormalLike"]

    def spy(tr, node, ins):
        outs = original(tr, node, ins)
        draws.append(outs[0].const)
        return outs

    HOST_STEPS["RandomNormalLike"] = spy
    try:
        with Session(["cpu"]) as sess:
            runner = OnnxRunner(load_model(path), sess)
            for k in range(3):
                x = np.full(5, float(k), np.float32)
                np.testing.assert_array_equal(runner.run({"x": x})["y"], x)
            assert runner.stats["replayed"] == 2
            runner.release()
    finally:
        HOST_STEPS["RandomNormalLike"] = original
    assert len(draws) == 3 and not np.array_equal(draws[0], draws[1])


def test_threads_sharing_a_runner_take_turns(tmp_path):
    """A runner is for one call at a time (its lock): traces, recordings, replays and family
    graphs stay consistent when threads share it anyway."""
    model, path = _ramp_model(tmp_path)
    ref = ReferenceEvaluator(model)
    with Session(["cpu"]) as sess:
        runner = OnnxRunner(load_model(path), sess)

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(6):
                x = rng.uniform(-1, 2, int(rng.integers(4, 7))).astype(np.float32)
                np.testing.assert_allclose(runner.run({"x": x})["z"], ref.run(None, {"x": x})[0],
                                           rtol=1e-6, atol=1e-6)

        errors = run_threads(work, 4)
        runner.release()
    assert not errors, errors[0]


def test_a_trace_after_a_failed_replay_takes_its_draws_and_reuses_its_segments(tmp_path, monkeypatch):
    """y = x + 0 * RandomNormalLike(x), then NonZero(y > 1) -> Gather. With no checkpoint taken,
    a replay that diverges at NonZero is traced whole; the segment the replay ran (y, fed the
    draw) is reused by the trace instead of run again, because the trace adopts the replay's draw
    (`runner.reuse_draws`) rather than drawing another (a different feed would not match)."""
    from flare.models.onnx.replay import Recording
    monkeypatch.setattr(Recording, "checkpoint", lambda self, cp: None)  # as where a replay diverges before any
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("RandomNormalLike", ["x"], ["r"]),
        helper.make_node("Mul", ["r", "zerof"], ["noise"]),
        helper.make_node("Add", ["x", "noise"], ["y"]),
        helper.make_node("Greater", ["y", "onef"], ["g"]),
        helper.make_node("NonZero", ["g"], ["nz"]),
        helper.make_node("Squeeze", ["nz", "zero1"], ["idx"]),
        helper.make_node("Gather", ["y", "idx"], ["z"], axis=0),
    ]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "zero1"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zerof"),
             numpy_helper.from_array(np.array(1.0, np.float32), "onef")]
    model, path = _save(tmp_path, "noisy_nonzero", nodes, [helper.make_tensor_value_info("x", f, ["L"])],
                        [helper.make_tensor_value_info("z", f, ["K"])], inits)
    keep_odd = np.where(np.arange(6) % 2 == 1, 1.5, 0.0).astype(np.float32)
    keep_first = np.where(np.arange(6) < 2, 1.5, 0.0).astype(np.float32)
    with Session(["cpu"]) as sess:
        runner = OnnxRunner(load_model(path), sess)
        _check(model, runner, keep_odd)                       # traced: two segments
        segments = runner.stats["segments_run"]
        _check(model, runner, keep_first)                     # replay runs the first, diverges at NonZero
        assert runner.stats.get("resumed", 0) == 0 and runner.stats["replayed"] == 0
        assert runner.stats.get("reused", 0) == 1             # the trace took the replay's first segment
        assert runner.stats["segments_run"] == segments + 3   # replay 1 + trace 2 (one of them reused)
        assert runner.reuse == {} and runner.reuse_draws == {}
        _check(model, runner, keep_first + 0.5)               # its recording replays
        assert runner.stats["replayed"] == 1
        runner.release()


def test_structure_rows_serialize_by_value_and_fall_back_to_repr():
    """The structure key's bytes (`_serialized`): equal rows made of distinct objects give the same
    bytes (marshal format 2 writes no back-references), unequal rows differ (1 vs True vs 1.0,
    a tuple vs a list), and a value marshal cannot take (a NumPy scalar) keeps the repr form."""
    ser = runner_mod._serialized
    name = "".join(["dec/", "conv"])                   # not the interned literal
    a = [("op", name, (1, 4), "f32", "add", [0, 1], {"k": (3, 3)}, None)] * 2
    b = [("op", "dec/conv", (1, 4), "f32", "add", [0, 1], {"k": (3, 3)}, None),
         ("op", "dec/conv", (1, 4), "f32", "add", [0, 1], {"k": (3, 3)}, None)]
    assert ser(a) == ser(b) and ser(a)[:1] == b"m"
    forms = [ser([("op", "n", (1,), "f32", "add", [0], {"k": v}, None)]) for v in (1, True, 1.0, (1,), [1])]
    assert len(set(forms)) == len(forms)
    for odd in (np.int64(1), np.float64(1.0), np.arange(2, dtype=np.int32), b"\x01", [1, np.int64(2)]):
        row = [("op", "n", (1,), "f32", "add", [0], {"k": odd}, None)]
        assert ser(row) == b"r" + repr(row).encode()
