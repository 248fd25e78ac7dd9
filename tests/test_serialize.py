"""Graph (de)serialization: round trip, typed errors naming the field, fuzzed input."""
import copy
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flare.core.errors import CoreFormatError
from flare.core.graph import GraphBuilder
from flare.core.reference import evaluate
from flare.core.serialize import builder_from_dict, graph_from_dict, graph_to_dict
from flare.core.session import Session

W = np.random.default_rng(5).uniform(-1, 1, (6, 4)).astype(np.float32)


def sample_graph():
    b = GraphBuilder()
    x = b.input("x", (3, 4))
    h = b.gelu(b.matmul(x, b.weight("w", W), transpose_b=True))
    v = b.slice(b.transpose(h), axis=0, start=1, stop=5)
    b.output("y", b.softmax(b.contiguous(v), scale=0.5))
    b.output("p", b.pad(x, pads=((1, 1), (0, 2)), mode="constant"))
    return b.build()


def test_round_trip_through_json_gives_the_same_results():
    g = sample_graph()
    data = json.loads(json.dumps(graph_to_dict(g)))
    g2 = graph_from_dict(data, {"w": W})
    x = np.random.default_rng(1).uniform(-1, 1, (3, 4)).astype(np.float32)
    a, _ = evaluate(g, {"x": x})
    b, _ = evaluate(g2, {"x": x})
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    with Session(["cpu"]) as sess, sess.prepare({"full": builder_from_dict(data, {"w": W})}, {"full": {"x": (3, 4)}}) as pg:
        got = pg.execute("full", x=x)
    for k in a:
        np.testing.assert_allclose(got[k], a[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path,value,field", [
    (("tensors", 1, "op"), "frob", "tensors[1].op"),
    (("tensors", 2, "srcs"), [99], "tensors[2].srcs"),
    (("tensors", 0, "shape"), [3, -4], "tensors[0].shape"),
    (("tensors", 0, "dtype"), "f64", "tensors[0].dtype"),
    (("format",), 7, "graph.format"),
    (("outputs",), {"y": 12345}, "outputs.y"),
    (("tensors", 2, "shape"), [9, 9], "tensors[2]"),
])
def test_malformed_fields_are_named(path, value, field):
    data = graph_to_dict(sample_graph())
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(CoreFormatError) as err:
        graph_from_dict(data, {"w": W})
    assert field in str(err.value)


def test_missing_weight_is_named():
    with pytest.raises(CoreFormatError, match="weight 'w' is missing"):
        graph_from_dict(graph_to_dict(sample_graph()), {})


def _mutations():
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.text(max_size=4), st.lists(st.integers(-2, 9), max_size=5))
    return st.lists(st.tuples(st.integers(0, 200), st.sampled_from(["id", "name", "shape", "dtype", "role", "op", "srcs", "params", "outputs"]), scalars), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(_mutations())
def test_fuzzed_graphs_give_only_typed_errors(mutations):
    data = graph_to_dict(sample_graph())
    for index, key, value in mutations:
        if key == "outputs":
            data["outputs"] = value if not isinstance(value, list) else {"y": value}
            continue
        item = data["tensors"][index % len(data["tensors"])]
        item[key] = value
    try:
        graph_from_dict(copy.deepcopy(data), {"w": W})
    except CoreFormatError:
        pass
