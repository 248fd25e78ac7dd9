"""Dims of a graph (`GraphBuilder.dim`): an input axis a serialized graph may be replayed at a
smaller size, every op param given the `Dim` following it (an exported language model's KV
window). Round trip, replay against the NumPy reference, and what a replay refuses."""
from __future__ import annotations

import json

import numpy as np
import pytest

from flare.core.errors import CoreFormatError, GraphError, InputError
from flare.core.graph import Dim, GraphBuilder
from flare.core.serialize import builder_from_dict, graph_from_dict, graph_to_dict


def _windowed(rows: int = 8, width: int = 8):
    """out = sum over the first `width` rows of a state's 8 rows, times a mask of `width` columns."""
    b = GraphBuilder()
    state = b.state("kv", (rows, 3))
    mask = b.input("mask", (2, width))
    w = b.dim("window", mask, 1)
    assert isinstance(w, Dim) and w == width and w.dim_name == "window"
    keys = b.slice(state, axis=0, start=0, stop=w)
    b.output("out", b.matmul(mask, b.reshape(keys, shape=(-1, 3))))
    return b.build()


def test_dims_round_trip_as_references_to_the_dim():
    data = json.loads(json.dumps(graph_to_dict(_windowed())))
    assert data["dims"] == {"window": ["mask", 1]}
    assert any(t.get("params", {}).get("stop") == {"dim": "window"} for t in data["tensors"])
    again = graph_from_dict(data)
    assert again.dims == {"window": ("mask", 1)} and again.inputs["mask"].shape == (2, 8)


def test_a_replay_at_a_smaller_size_reinfers_every_shape(backend):
    data = graph_to_dict(_windowed())
    small = graph_from_dict(data, sizes={"window": 5})
    assert small.inputs["mask"].shape == (2, 5) and small.outputs["out"].shape == (2, 3)
    build = builder_from_dict(data)
    kv = np.arange(24, dtype=np.float32).reshape(8, 3)
    mask = np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)
    with backend.session("cpu") as sess:
        pg = sess.prepare({"f": build}, {"f": {"mask": (2, 8)}})
        pg.write_rows("kv", 0, kv)
        got = pg.execute("f", mask=mask)["out"]                      # a plan at width 5
        assert pg.current_plan("f").shapes["mask"] == (2, 5)
        pg.release()
    np.testing.assert_allclose(got, mask @ kv[:5], rtol=1e-5, atol=1e-5)


def test_a_replay_refuses_sizes_outside_the_dim_and_changes_of_fixed_axes():
    data = graph_to_dict(_windowed())
    with pytest.raises(InputError, match="window"):
        graph_from_dict(data, sizes={"window": 9})
    with pytest.raises(InputError, match="window"):
        graph_from_dict(data, sizes={"window": 0})
    with pytest.raises(InputError, match="no dim"):
        graph_from_dict(data, sizes={"height": 2})
    b = GraphBuilder()
    build = builder_from_dict(data)
    with pytest.raises(InputError, match="fixed"):
        build(b, {"mask": (3, 8)})                                   # axis 0 is not a dim


def test_malformed_dims_are_refused_naming_the_field():
    data = graph_to_dict(_windowed())
    bad = {**data, "dims": {"window": ["nope", 1]}}
    with pytest.raises(CoreFormatError, match="dims.window"):
        graph_from_dict(bad)
    bad = {**data, "dims": {"window": ["mask", 7]}}
    with pytest.raises(CoreFormatError, match="dims.window"):
        graph_from_dict(bad)
    bad = {**data, "dims": {}}
    with pytest.raises(CoreFormatError, match="does not declare"):
        graph_from_dict(bad)
    for dims in ([], {"window": "mask"}, {"window": ["mask", True]}, {"window": [["mask"], 1]}):
        with pytest.raises(CoreFormatError, match="dims"):
            graph_from_dict({**data, "dims": dims})
    tensors = [dict(t, params={**t["params"], "stop": {"dim": ["window"]}}) if t.get("op") == "slice" else t
               for t in data["tensors"]]
    with pytest.raises(CoreFormatError, match="params.stop"):
        graph_from_dict({**data, "tensors": tensors})


def test_only_an_input_axis_can_be_a_dim():
    b = GraphBuilder()
    state = b.state("kv", (8, 3))
    mask = b.input("mask", (2, 8))
    with pytest.raises(GraphError, match="not an input"):
        b.dim("window", state, 0)
    with pytest.raises(Exception, match="axis"):
        b.dim("window", mask, 2)
