"""The builder's node memo (`OpDef.node`): a node built again on sources of the same shapes,
dtypes and strides with the same typed parameters skips the checks, and must come out exactly
as the full path makes it; anything the checks would refuse is still refused."""
import numpy as np
import pytest

from flare.core.errors import GraphError, ShapeError
from flare.core.graph import GraphBuilder, Tensor
from flare.core.ops import OPS
from flare.core.ops.registry import NODE_MEMO_MAX


def _fields(t: Tensor) -> tuple:
    return (t.shape, t.dtype, t.op, t.params, t.strides, t.offset, t.role,
            None if t.view_of is None else t.view_of.name)


def _full(op: str, srcs: list, **params) -> Tensor:
    """The node as the full path makes it (no memo)."""
    opdef = OPS[op]
    return opdef.make("full", srcs, opdef.with_defaults("full", params), 0)


@pytest.mark.parametrize("op, params", [
    ("add", {}), ("scale", {"scale": 2.0}), ("sum", {"axis": 1}), ("sum", {"axis": 1, "keepdims": True}),
    ("reshape", {"shape": [6, 4]}), ("slice", {"axis": 1, "start": 1, "stop": 4, "step": 2}),
    ("permute", {"axes": [1, 0]}), ("concat", {"axis": 0}),
])
def test_a_remembered_node_equals_the_full_path(op, params):
    b = GraphBuilder()
    x = b.input("x", (4, 6))
    srcs = [x, b.input("y", (4, 6))][:OPS[op].n_srcs[1]]
    first = b.op(op, *srcs, **params)
    again = b.op(op, *srcs, **params)  # a memo hit
    assert _fields(first) == _fields(again) == _fields(_full(op, srcs, **params))
    assert again.srcs == tuple(srcs) and again.params is not first.params


def test_a_view_of_a_view_takes_its_own_offset_and_strides():
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    a = b.slice(x, axis=1, start=2, stop=8)
    c = b.slice(x, axis=1, start=2, stop=8)
    assert a.strides == c.strides and a.offset == c.offset == 2
    inner = b.slice(x, axis=0, start=1, stop=4)  # offset 8, same strides as x: a different source offset
    d = b.slice(inner, axis=1, start=2, stop=8)
    assert d.offset == 8 + 2 and d.view_of is inner
    e = b.permute(a, axes=[1, 0])  # source strides (8, 1) with shape (4, 6): not contiguous
    f = b.permute(b.contiguous(a), axes=[1, 0])
    assert e.strides == (1, 8) and f.strides == (1, 6)


def test_typed_params_are_not_confused_by_equal_values():
    b = GraphBuilder()
    x = b.input("x", (4, 6))
    b.sum(x, axis=1, keepdims=True)
    with pytest.raises(GraphError, match="keepdims=1 must be true or false"):
        b.sum(x, axis=1, keepdims=1)   # 1 == True, but not a bool
    b.sum(x, axis=1)
    with pytest.raises(GraphError, match="axis=1.0 must be an integer"):
        b.sum(x, axis=1.0)             # 1.0 == 1, but not an integer
    b.reshape(x, shape=[6, 4])
    with pytest.raises(GraphError, match="must be a list of 1..4 integers"):
        b.reshape(x, shape=[6.0, 4])
    b.permute(x, axes=[1, 0])
    with pytest.raises(GraphError, match="axes=\\[True, False\\] must be a list of integers"):
        b.permute(x, axes=[True, False])  # [1, 0] == [True, False]


def test_refusals_are_never_remembered():
    b = GraphBuilder()
    x, y = b.input("x", (2, 3)), b.input("y", (4, 5))
    for _ in range(2):
        with pytest.raises(ShapeError, match="do not broadcast"):
            b.add(x, y)


def test_a_dim_param_stays_a_dim():
    b = GraphBuilder()
    x = b.input("x", (4, 6))
    w = b.dim("w", x, 1)
    b.slice(x, axis=1, start=0, stop=6)  # the same value as a plain int first
    t = b.slice(x, axis=1, start=0, stop=w)
    assert type(t.params["stop"]).__name__ == "Dim"


def test_writes_into_state_are_checked_every_time():
    b = GraphBuilder()
    state = b.state("s", (4, 3))
    rows, idx = b.input("rows", (2, 3)), b.input("idx", (2,), "i32")
    b.set_rows(state, idx, rows)
    fake = b.input("not_state", (4, 3))  # same shape and dtype, but not state
    with pytest.raises(ShapeError, match="must write into a contiguous state tensor"):
        b.set_rows(fake, idx, rows)


def test_the_memo_is_bounded():
    b = GraphBuilder()
    x = b.input("x", (1, NODE_MEMO_MAX + 8))
    for stop in range(1, NODE_MEMO_MAX + 8):
        b.slice(x, axis=1, start=0, stop=stop)
    assert len(OPS["slice"]._memo) <= NODE_MEMO_MAX


def test_a_graph_built_twice_computes_the_same():
    from flare.core.reference import evaluate

    def build() -> tuple:
        b = GraphBuilder()
        x = b.input("x", (2, 3, 4))
        y = b.permute(b.reshape(b.relu(x), shape=[6, 4]), axes=[1, 0])
        b.output("y", b.scale(b.slice(y, axis=1, start=1, stop=5), scale=3.0))
        return b.build()

    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    first, second = (evaluate(build(), {"x": x})[0]["y"] for _ in range(2))
    want = 3.0 * np.maximum(x, 0).reshape(6, 4).T[:, 1:5]
    np.testing.assert_array_equal(first, want)
    np.testing.assert_array_equal(second, want)


def test_builders_on_several_threads_share_the_memo():
    """The memo is process-wide: threads building at once (and clearing it when full) each get
    the nodes the full path makes."""
    import threading

    from flare.core.ops import registry

    def build(out: list, sizes: range) -> None:
        b = GraphBuilder()
        x = b.input("x", (4, 64))
        for stop in sizes:
            s = b.slice(x, axis=1, start=1, stop=stop)
            out.append(_fields(b.scale(b.contiguous(s), scale=float(stop))))

    want: list = []
    build(want, range(2, 64))
    old = registry.NODE_MEMO_MAX
    registry.NODE_MEMO_MAX = 16  # clears often while the others read and write
    try:
        results = [[] for _ in range(6)]
        threads = [threading.Thread(target=build, args=(r, range(2, 64))) for r in results]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        registry.NODE_MEMO_MAX = old
    assert all(r == want for r in results)
