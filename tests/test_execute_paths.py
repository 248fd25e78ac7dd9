"""The per-step paths of `PreparedGraph.execute`, on every backend: the current plan's input
check (a call that differs from it in any way takes the full, typed validation), host nodes
resolved at bind time (a callback's inputs are its own copies, its result is cast and written)
and the `token-lm/1` step inputs built as lists (the same arrays as element by element)."""
from __future__ import annotations

import numpy as np
import pytest

from flare.core.errors import InputError
from flare.plugins.export.schema import Serving
from flare.plugins.export.serving.batch import MASK_NEG, Chunk, token_lm_inputs
from flare.plugins.testing.threads import run_threads

N = 6


def _entry(b, shapes):
    x = b.input("x", shapes["x"])
    ids = b.input("ids", shapes["ids"], "i32")
    y = b.add(x, x)
    z = b.host(y, ids, callback="keep", shape=shapes["x"], dtype="f32")
    b.output("out", b.add(z, x))


@pytest.fixture
def graph(backend):
    kept: list[np.ndarray] = []

    def keep(node, y, ids, *, ctx):
        kept.append(y)
        return (y * 10.0).astype(np.float64) + ids[: y.shape[0]].astype(np.float64)   # cast to f32 on write

    sess = backend.fallback_session()
    g = sess.prepare({"main": _entry}, {"main": {"x": (N,), "ids": (N,)}}, name="paths", callbacks={"keep": keep})
    yield g, kept
    g.release()
    sess.close()


def test_host_node_inputs_are_the_callbacks_own(graph):
    g, kept = graph
    x1 = np.arange(N, dtype=np.float32)
    ids = np.arange(N, dtype=np.int32)
    out1 = g.execute("main", x=x1, ids=ids)["out"]
    np.testing.assert_allclose(out1, 2 * x1 * 10 + ids + x1, rtol=1e-6)
    x2 = -x1 - 1
    out2 = g.execute("main", x=x2, ids=ids)["out"]
    np.testing.assert_allclose(out2, 2 * x2 * 10 + ids + x2, rtol=1e-6)
    # the first call's input still holds its values: a copy, not a view of the arena
    np.testing.assert_array_equal(kept[0], 2 * x1)
    np.testing.assert_array_equal(kept[1], 2 * x2)
    out1[:] = 7.0                                            # outputs are fresh copies too
    np.testing.assert_allclose(g.execute("main", x=x2, ids=ids)["out"], out2, rtol=1e-6)


class _Borrower:
    """A host callback that borrows its inputs (read-only views on a CPU device) and, when
    `fill` is set, writes its result into `out` (returning `out`, or a new array when `fill` is
    "return": the host step then writes that one as usual)."""

    borrows_inputs = True

    def __init__(self, fill: str = ""):
        self.fills_output = bool(fill)
        self.fill = fill
        self.seen: list[tuple[bool, bool]] = []       # (input writeable, got out=)

    def __call__(self, node, y, ids, *, ctx, out=None):
        self.seen.append((y.flags.writeable, out is not None))
        result = y * 10.0 + ids[: y.shape[0]]
        if out is not None and self.fill == "out":
            out[...] = result
            return out
        return result


@pytest.mark.parametrize("fill", ["", "out", "return"])
def test_borrowing_host_callbacks_get_views_and_may_fill_the_output(backend, fill):
    """`borrows_inputs`: on a CPU device the callback reads the graph's memory through read-only
    views (no copies); `fills_output`: it gets `out=` and may return it, written in place. Results
    equal the copying path's on every backend (elsewhere the inputs are read back as usual)."""
    cb = _Borrower(fill)
    sess = backend.fallback_session()
    g = sess.prepare({"main": _entry}, {"main": {"x": (N,), "ids": (N,)}}, name="borrow", callbacks={"keep": cb})
    try:
        ids = np.arange(N, dtype=np.int32)
        for k in range(3):
            x = np.arange(N, dtype=np.float32) - k
            np.testing.assert_allclose(g.execute("main", x=x, ids=ids)["out"], 2 * x * 10 + ids + x, rtol=1e-6)
        on_cpu = g.describe()["entries"]["main"]["split_list"][0]["device"].startswith("cpu")
        assert cb.seen == [(not on_cpu, on_cpu and bool(fill))] * 3
    finally:
        g.release()
        sess.close()


def test_inputs_that_differ_from_the_plan_take_the_typed_checks(graph):
    g, _ = graph
    x = np.ones(N, np.float32)
    ids = np.zeros(N, np.int32)
    g.execute("main", x=x, ids=ids)                          # the fast path's plan is current
    with pytest.raises(InputError, match="dtype"):
        g.execute("main", x=x.astype(np.float64), ids=ids)
    with pytest.raises(InputError, match="missing inputs"):
        g.execute("main", x=x, other=ids)                    # same count, another name
    with pytest.raises(InputError, match="not a numpy array"):
        g.execute("main", x=list(x), ids=ids)
    with pytest.raises(InputError, match="rank"):
        g.execute("main", x=x[None], ids=ids)
    with pytest.raises(InputError, match="unknown entry"):
        g.execute("nope", x=x, ids=ids)
    wide = np.ones(N + 2, np.float32)                        # a new shape: a new plan, then back
    np.testing.assert_allclose(g.execute("main", x=wide, ids=np.zeros(N + 2, np.int32))["out"], 21.0)
    np.testing.assert_allclose(g.execute("main", x=x, ids=ids)["out"], 21.0)
    assert g.stats["plans_built"] == 2


def _token_lm_elementwise(serving, chunks, tokens, batch):
    """token_lm_inputs as it was written before (NumPy element by element): the reference."""
    toks = np.full(tokens, serving.pad, np.int32)
    pos = np.zeros(tokens, np.int32)
    rows = np.full(tokens, serving.scratch_row, np.int32)
    mask = np.full((tokens, serving.kv_rows), MASK_NEG, np.float32)
    last, at = [], 0
    for c in chunks:
        k = len(c.tokens)
        toks[at: at + k] = c.tokens
        pos[at: at + k] = np.arange(c.start, c.start + k)
        base = c.seq * serving.max_ctx
        rows[at: at + k] = base + pos[at: at + k]
        for i in range(k):
            mask[at + i, base: base + c.start + i + 1] = 0.0
        at += k
        last.append(at - 1)
    mask[at:, serving.scratch_row] = 0.0
    out = {"tokens": toks, "pos": pos, "kv_rows": rows, "mask": mask}
    if batch is not None:
        out["out_rows"] = np.asarray(last + [last[-1]] * (batch - len(last)), np.int32)
    return out


@pytest.mark.parametrize("case", range(12))
def test_token_lm_inputs_match_the_elementwise_layout(case):
    rng = np.random.default_rng(case)
    serving = Serving("token-lm/1", 4, 16, 8, 100, 0, 1)
    seqs = rng.permutation(4)[: rng.integers(1, 5)]
    chunks = []
    for s in seqs:
        k = int(rng.integers(1, 5))
        start = int(rng.integers(0, 16 - k + 1))
        chunks.append(Chunk(int(s), start, tuple(int(t) for t in rng.integers(0, 100, k))))
    n = sum(len(c.tokens) for c in chunks)
    tokens = n + int(rng.integers(0, 3))                      # sometimes padded
    batch = None if case % 3 == 0 else len(chunks) + int(rng.integers(0, 2))
    got = token_lm_inputs(serving, chunks, tokens=tokens, batch=batch)
    want = _token_lm_elementwise(serving, chunks, tokens, batch)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        assert got[name].flags.c_contiguous, name


def _cache_entry(b, shapes):
    table = b.cache("table", (5, 2, 3))
    x = b.input("x", shapes["x"])
    b.output("out", b.add(b.reshape(table, shape=(30,)), x))


def test_write_rows_writes_whole_rows_and_refuses_the_rest(backend):
    """write_rows (expert staging, KV reuse): on a CPU device one slice assignment into a view
    resolved once, elsewhere the device's write; the same rows, casts and typed errors either way."""
    sess = backend.fallback_session()
    g = sess.prepare({"main": _cache_entry}, {"main": {"x": (30,)}}, name="rows")
    try:
        want = np.zeros((5, 2, 3), np.float32)
        rows = np.arange(12, dtype=np.float64).reshape(2, 6)          # float64: cast to the tensor's f32
        g.write_rows("table", 1, rows)
        want[1:3] = rows.reshape(2, 2, 3)
        strided = np.arange(24, dtype=np.float32).reshape(2, 12)[:, ::2]   # not contiguous
        g.write_rows("table", 3, strided)
        want[3:5] = strided.reshape(2, 2, 3)
        np.testing.assert_array_equal(g.state("table"), want)
        np.testing.assert_array_equal(g.read_rows("table", 1, 2), want[1:3])
        host = g.host_rows("table")      # a prefix cache's copies: (rows, bytes per row) in host memory, or None
        if backend.name == "cpu":
            assert host is not None and host.dtype == np.uint8 and host.shape == (5, 24)
            np.testing.assert_array_equal(host.view(np.float32).reshape(5, 2, 3), want)
        else:
            assert host is None
        with pytest.raises(InputError, match="no state or cache tensor"):
            g.host_rows("nope")
        np.testing.assert_array_equal(g.execute("main", x=np.ones(30, np.float32))["out"], want.reshape(30) + 1)
        for row, arr in ((4, np.ones((2, 6), np.float32)), (-1, np.ones(6, np.float32)), (0, np.ones(5, np.float32))):
            with pytest.raises(InputError, match="does not fit"):
                g.write_rows("table", row, arr)
        np.testing.assert_array_equal(g.state("table"), want)      # nothing half-written
        g.reset()                                                  # a cache survives reset
        np.testing.assert_array_equal(g.state("table"), want)
    finally:
        g.release()
        sess.close()


def test_row_byte_writer_copies_bytes_of_whole_rows_and_refuses_the_rest(backend):
    """The stager's copy path: rows given as their bytes land like write_rows' typed rows; wrong
    widths, dtypes and rows outside the tensor are InputErrors that write nothing; a writer kept
    past release() refuses instead of writing freed memory; off the CPU there is none."""
    sess = backend.fallback_session()
    g = sess.prepare({"main": _cache_entry}, {"main": {"x": (30,)}}, name="bytes")
    try:
        if backend.name != "cpu":
            with pytest.raises(InputError, match="not in host memory"):
                g.row_byte_writer("table")
            return
        rows = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
        with pytest.raises(InputError, match="are not 'table'"):
            g.row_byte_writer("table", like=rows.astype(np.float64))
        write = g.row_byte_writer("table", like=rows)
        write(2, rows.reshape(2, -1).view(np.uint8))
        want = np.zeros((5, 2, 3), np.float32)
        want[2:4] = rows
        for row, data in ((4, rows.reshape(2, -1).view(np.uint8)), (-1, rows[:1].reshape(1, -1).view(np.uint8)),
                          (0, np.zeros((1, 23), np.uint8)), (0, rows.reshape(2, -1)), (0, np.uint8(1))):
            with pytest.raises(InputError, match="do not fit"):
                write(row, data)
        np.testing.assert_array_equal(g.state("table"), want)
    finally:
        g.release()
        sess.close()
    if backend.name == "cpu":
        with pytest.raises(InputError, match="released"):
            write(0, rows[:1].reshape(1, -1).view(np.uint8))


def test_threads_sharing_a_graph_with_a_host_node_get_their_own_outputs(graph):
    """Executes serialise on the graph's lock, so the views a plan keeps (inputs, outputs, the
    host node's) are used by one call at a time: every thread gets its own inputs' result."""
    g, kept = graph
    ids = np.arange(N, dtype=np.int32)

    def worker(k: int) -> None:
        for j in range(15):
            x = np.full(N, k * 100 + j, np.float32)
            np.testing.assert_allclose(g.execute("main", x=x, ids=ids)["out"], 21 * x + ids, rtol=1e-6)

    errors = run_threads(worker, 4)
    assert not errors, errors[0]
    assert len(kept) == 60
