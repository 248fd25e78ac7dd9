"""Graph IR: builder rules, typed errors naming the node, validation of foreign graphs."""
import numpy as np
import pytest

from flare.core.errors import DTypeError, GraphError, ShapeError
from flare.core.graph import Graph, GraphBuilder, Tensor
from flare.core.reference import evaluate


def test_shape_mismatch_names_the_node():
    b = GraphBuilder()
    a, c = b.input("a", (2, 3)), b.input("c", (4, 5))
    with pytest.raises(ShapeError, match="bad_matmul") as err:
        b.matmul(a, c, name="bad_matmul")
    assert err.value.node == "bad_matmul"
    with pytest.raises(ShapeError, match="do not broadcast"):
        b.add(a, c)


def test_dtype_error_and_unknown_op():
    b = GraphBuilder()
    idx = b.input("idx", (3,), "i32")
    with pytest.raises(DTypeError, match="idx"):
        b.relu(idx)
    with pytest.raises(GraphError, match="unknown op 'frobnicate'"):
        b.op("frobnicate", idx)
    with pytest.raises(AttributeError):
        b.frobnicate  # noqa: B018
    with pytest.raises(GraphError, match="unknown params"):
        b.softmax(b.input("x", (2, 2)), temperature=2.0)
    with pytest.raises(GraphError, match="name used twice"):
        b.input("idx", (1,))


def test_cycle_in_a_foreign_graph_is_reported():
    a = Tensor(1, "a", (2,), "f32", role="input")
    x = Tensor(2, "x", (2,), "f32", op="relu")
    y = Tensor(3, "y", (2,), "f32", op="relu", srcs=(x,))
    x.srcs = (y,)  # x <- y <- x
    g = Graph([a, x, y], {"y": y})
    with pytest.raises(GraphError, match="cycle"):
        g.validate()


def test_views_alias_and_outputs_own_memory():
    b = GraphBuilder()
    x = b.input("x", (4, 6))
    t = b.transpose(x)
    s = b.slice(t, axis=0, start=1, stop=5, step=2)
    assert t.storage is x and s.storage is x
    assert s.shape == (2, 4) and s.strides == (2, 6) and s.offset == 1
    out = b.output("s", s)
    assert out.op == "contiguous" and out.storage is out
    arr = np.arange(24, dtype=np.float32).reshape(4, 6)
    got, _ = evaluate(b.build(), {"x": arr})
    np.testing.assert_array_equal(got["s"], arr.T[1:5:2])


def test_reshape_of_strided_view_inserts_contiguous():
    b = GraphBuilder()
    t = b.transpose(b.input("x", (3, 4)))
    r = b.reshape(t, shape=(12,))
    assert r.srcs[0].op == "contiguous"


def test_writes_into_state_are_seen_by_later_readers():
    b = GraphBuilder()
    st = b.state("st", (2, 2))
    w = b.set_rows(st, b.input("i", (1,), "i32"), b.input("v", (1, 2)))
    b.output("after", b.add(w, b.input("z", (2, 2))))
    out, state = evaluate(b.build(), {"i": np.array([1], np.int32), "v": np.ones((1, 2), np.float32),
                                      "z": np.zeros((2, 2), np.float32)})
    np.testing.assert_array_equal(out["after"], [[0, 0], [1, 1]])
    np.testing.assert_array_equal(state["st"], [[0, 0], [1, 1]])


def test_set_rows_refuses_non_state_destination():
    b = GraphBuilder()
    with pytest.raises(ShapeError, match="state"):
        b.set_rows(b.input("d", (4, 2)), b.input("i", (1,), "i32"), b.input("v", (1, 2)))


def test_scope_prefixes_op_nodes_including_inserted_ones():
    b = GraphBuilder()
    x = b.input("x", (2, 3))
    with b.scope("enc"):
        t = b.transpose(x)
        r = b.reshape(t, shape=(6,))   # inserts a contiguous inside the scope
        with b.scope("inner"):
            y = b.relu(r, name="act")
    assert t.name.startswith("enc/") and r.srcs[0].name.startswith("enc/contiguous")
    assert y.name == "enc/inner/act" and x.name == "x"


def test_copy_node_rebuilds_a_checked_graph_and_refuses_other_sources():
    """copy_node (a traced graph built again for a plan) makes what `op` made: same shapes,
    strides, views and results; a source of another shape is refused, naming the node."""
    b = GraphBuilder()
    x, w = b.input("x", (2, 6)), b.weight("w", np.arange(6, dtype=np.float32).reshape(1, 6))
    y = b.add(x, w, name="y")
    t = b.permute(b.reshape(y, shape=[2, 2, 3], name="r"), axes=[0, 2, 1], name="p")
    b.output("out", b.relu(t, name="act"))
    first = b.build()

    c = GraphBuilder()
    made = {}
    for node in first.tensors:
        if node.op is None:
            made[node.id] = (c.input(node.name, node.shape) if node.name == "x" else c.weight(node.name, node.data))
        else:
            made[node.id] = c.copy_node(node, [made[s.id] for s in node.srcs])
    c.output("out", made[first.outputs["out"].id])
    second = c.build()
    second.validate()
    assert [(n.op, n.shape, n.strides, n.offset, n.view_of is not None) for n in second.tensors] == \
        [(n.op, n.shape, n.strides, n.offset, n.view_of is not None) for n in first.tensors]
    assert made[t.id].view_of is made[t.srcs[0].id]
    feed = {"x": np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32)}
    np.testing.assert_array_equal(evaluate(second, feed)[0]["out"], evaluate(first, feed)[0]["out"])

    d = GraphBuilder()
    with pytest.raises(ShapeError, match="y"):
        d.copy_node(y, [d.input("x", (3, 6)), d.weight("w", w.data)])
    with pytest.raises(GraphError, match="leaves"):
        d.copy_node(x, [])
