"""The native CPU executor on several threads: same results as one thread, under concurrency.

Tolerance. The C kernels split only by output ranges (rows, columns in blocks of the
microkernels' own widths, heads, batches) at fixed boundaries, so every output element is
computed by the same code in the same order on any thread count: those outputs must equal
the one-thread outputs bit for bit (`assert_array_equal`). The exception is a BLAS product
split into blocks (sgemm: conv1d's GEMM per column block; activation-activation products only under
FLARE_CPU_MATMUL=fastest, the default routes are exact): OpenBLAS
chooses its kernel by the product's size (it has a separate small-matrix path), so a block
may round differently in the last bits. Outputs that pass through such a split (`BLAS_SPLIT`)
are compared to 1e-5 relative and absolute (f32 rounding of a sum of ~100 products of O(1)
terms is ~1e-6; 1e-5 leaves room, and still fails on any wrong row, column or chunk).
Shapes are chosen just above the split thresholds of kernels.c's plan() so that every kind
of split runs, and small enough to keep the file at a few seconds.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from flare.backends.cpu import native
from flare.core.ledger import LEDGER
from flare.core.session import Session
from flare.plugins.testing.conformance.quant_cases import quant_blocks
from flare.plugins.testing.references import lstm_f64
from flare.plugins.testing.threads import run_threads

needs_native = pytest.mark.skipif(native.load() is None, reason=f"native executor unavailable: {native.REASON}")
pytestmark = needs_native

RNG = np.random.default_rng(7)
D, HEADS, FF, VOCAB = 96, 4, 192, 50
W = {
    "emb": RNG.standard_normal((VOCAB, D)).astype(np.float32),
    "wq": (RNG.standard_normal((D, D)) / 10).astype(np.float32),
    "wk": (RNG.standard_normal((D, D)) / 10).astype(np.float32),
    "w1": (RNG.standard_normal((FF, D)) / 10).astype(np.float32),
    "b1": RNG.standard_normal(FF).astype(np.float32),
    "w2": (RNG.standard_normal((D, FF)) / 10).astype(np.float32),
    "g": RNG.standard_normal(D).astype(np.float32),
    "whh": (RNG.standard_normal((4 * 64, 64)) / 8).astype(np.float32),
    "conv": (RNG.standard_normal((24, 8, 5)) / 4).astype(np.float32),
    "experts": (RNG.standard_normal((4, 48, D)) / 10).astype(np.float32),
    "wide": (RNG.standard_normal((1536, D)) / 10).astype(np.float32),
    # one-row products split when they read enough weight (MIN_SPLIT_STREAM), not by their flops
    "mid": (RNG.standard_normal((384, D)) / 10).astype(np.float32),
    # a decode step's experts: one token's slots, a thread each (mul_mat_id_slots)
    "experts_wide": (RNG.standard_normal((4, 768, D)) / 10).astype(np.float32),
    # block-quantized weights (native/quant.c): K = 256 so the k-quants fit
    "q4_1": quant_blocks(RNG, "q4_1", 64, 256), "q8_0": quant_blocks(RNG, "q8_0", VOCAB, 256),
    "q4_k": quant_blocks(RNG, "q4_k", 96, 256), "q6_k": quant_blocks(RNG, "q6_k", 4 * 40, 256).reshape(4, 40, 1),
}


def block(b, shapes):
    """Embedding, rope, attention, a gelu MLP (linear fused), norms, elementwise, LSTM, conv1d, experts."""
    ids = b.input("ids", shapes["ids"], "i32")
    pos = b.input("pos", shapes["pos"], "i32")
    x = b.get_rows(b.weight("emb", W["emb"]), ids)                       # [T, D]
    t = shapes["ids"][0]
    q = b.matmul(x, b.weight("wq", W["wq"]), transpose_b=True)
    k = b.matmul(x, b.weight("wk", W["wk"]), transpose_b=True)
    q = b.rope(b.reshape(q, shape=(t, HEADS, D // HEADS)), pos)
    k = b.rope(b.reshape(k, shape=(t, HEADS, D // HEADS)), pos)
    qh, kh = b.permute(q, axes=(1, 0, 2)), b.permute(k, axes=(1, 0, 2))         # [H, T, Dh]
    att = b.softmax(b.matmul(qh, kh, transpose_b=True), scale=0.3)     # [H, T, T]
    ctx = b.reshape(b.contiguous(b.permute(b.matmul(att, kh), axes=(1, 0, 2))), shape=(t, D))
    h = b.layer_norm(b.add(x, ctx))
    f = b.gelu(b.add(b.matmul(h, b.weight("w1", W["w1"]), transpose_b=True), b.weight("b1", W["b1"])))
    y = b.rms_norm(b.add(b.matmul(f, b.weight("w2", W["w2"]), transpose_b=True), h))
    y = b.mul(y, b.weight("g", W["g"]))
    b.output("y", b.tanh(b.scale(y, scale=0.5, bias=0.1)))
    b.output("sum", b.sum(y, axis=-1))
    # one row at a time (decode-like): an M = 1 product (BLAS sgemv split by columns)
    b.output("row", b.matmul(b.slice(h, axis=0, start=0, stop=1), b.weight("wide", W["wide"]), transpose_b=True))
    b.output("row_mid", b.matmul(b.slice(h, axis=0, start=0, stop=1), b.weight("mid", W["mid"]), transpose_b=True))
    b.output("gram", b.matmul(h, h, transpose_b=True))                      # BLAS sgemm split by rows
    # LSTM (packed W_hh, split by columns and hidden units), conv1d (column blocks: im2col and GEMM each)
    xs = b.input("xs", shapes["xs"])
    b.output("lstm", b.lstm(xs, b.weight("whh", W["whh"]), b.input("h0", shapes["h0"]), b.input("c0", shapes["c0"])))
    b.output("conv", b.relu(b.conv1d(b.input("audio", shapes["audio"]), b.weight("conv", W["conv"]), padding=2)))
    sel = b.input("sel", shapes["sel"], "i32")
    b.output("experts", b.mul_mat_id(b.weight("experts", W["experts"]), h, sel))
    b.output("experts_row", b.mul_mat_id(b.weight("experts_wide", W["experts_wide"]), b.slice(h, axis=0, start=0, stop=1),
                                         b.slice(sel, axis=0, start=0, stop=1)))
    b.output("big", b.sigmoid(b.input("flat", shapes["flat"])))                # one long row: split by columns
    # reflect pad on outer and inner axes, big enough to split by output rows
    b.output("padded", b.pad(b.input("padin", shapes["padin"]), pads=PADS, mode="reflect"))
    # quantized: prefill-sized and one-row products, an embedding lookup, experts
    xq = b.get_rows(b.weight("q8_0", W["q8_0"]), ids)                                    # [T, 256]
    b.output("q_prefill", b.matmul(xq, b.weight("q4_1", W["q4_1"]), transpose_b=True))
    b.output("q_row", b.matmul(b.slice(xq, axis=0, start=0, stop=1), b.weight("q4_k", W["q4_k"]), transpose_b=True))
    b.output("q_experts", b.mul_mat_id(b.weight("q6_k", W["q6_k"]), b.slice(xq, axis=0, start=0, stop=8),
                                       b.slice(sel, axis=0, start=0, stop=8)))


T = 200
PADS = ((1, 1), (2, 0), (64, 63))
SHAPES = {"padin": (4, 24, 700), "ids": (T,), "pos": (T,), "xs": (6, 2, 256), "h0": (2, 64), "c0": (2, 64), "audio": (2, 8, 300),
          "sel": (T, 2), "flat": (70000,)}


def inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"ids": rng.integers(0, VOCAB, T).astype(np.int32), "pos": np.arange(T, dtype=np.int32) + seed,
            "xs": rng.standard_normal((6, 2, 256)).astype(np.float32),
            "h0": rng.standard_normal((2, 64)).astype(np.float32), "c0": rng.standard_normal((2, 64)).astype(np.float32),
            "audio": rng.standard_normal((2, 8, 300)).astype(np.float32),
            "sel": rng.integers(0, 4, (T, 2)).astype(np.int32),
            "flat": rng.standard_normal(70000).astype(np.float32),
            "padin": rng.standard_normal((4, 24, 700)).astype(np.float32)}


BLAS_SPLIT = ("conv",)   # "gram" (h h^T) was a split sgemm; it runs idot now (batch-invariant routes): exact


def assert_same(got: np.ndarray, want: np.ndarray, name: str, where: str = "") -> None:
    if name in BLAS_SPLIT:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{name} {where}")
    else:
        np.testing.assert_array_equal(got, want, err_msg=f"{name} {where}")


def _session(threads: int) -> Session:
    return Session(["cpu"], config={"cpu": {"threads": threads}})


def _reference(seeds) -> dict[int, dict[str, np.ndarray]]:
    with _session(1) as sess:
        pg = sess.prepare({"full": block}, {"full": SHAPES})
        out = {s: {k: v.copy() for k, v in pg.execute("full", **inputs(s)).items()} for s in seeds}
        pg.release()
    return out


def test_every_thread_count_gives_the_one_thread_result():
    ref = _reference([0])
    for threads in (2, 3, 4):
        with _session(threads) as sess:
            pg = sess.prepare({"full": block}, {"full": SHAPES})
            info = pg.describe()["entries"]["full"]
            splits = [s for s in info["split_list"] if s.get("executor") == "native"]
            assert splits and all(s["threads"] == threads for s in splits)
            assert sum(s["split_commands"] for s in splits) >= 15, info  # the split kernels really run split
            before = sess.devices[0].pool.regions()
            got = pg.execute("full", **inputs(0))
            assert sess.devices[0].pool.regions() > before            # ... on the pool's threads
            for name, want in ref[0].items():
                assert_same(got[name], want, name, f"at {threads} threads")
            pg.release()


def test_a_split_reflect_pad_is_numpys():
    with _session(2) as sess:
        pg = sess.prepare({"full": block}, {"full": SHAPES})
        x = inputs(3)
        np.testing.assert_array_equal(pg.execute("full", **x)["padded"], np.pad(x["padin"], PADS, mode="reflect"))
        pg.release()


@pytest.mark.parametrize("hidden", [64, 100])
def test_lstm_steps_split_by_hidden_units(hidden):
    """The LSTM's one phase per step (each chunk: its units' four gate columns, then their cells;
    h_{t-1} read from the output; blocks of 16 units, or one chunk a step when H is not a multiple
    of 16), with W_hh packed (a weight) and through wdot (an input), gives the one-thread bits at
    2 and 3 threads, and the float64 reference within 1e-5."""
    rng = np.random.default_rng(hidden)
    steps, batch = 20, 8   # a step over the split threshold, the list over MIN_POOL_WORK
    x = rng.standard_normal((steps, batch, 4 * hidden)).astype(np.float32)
    w = (rng.standard_normal((4 * hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
    h0, c0 = rng.standard_normal((2, batch, hidden)).astype(np.float32)

    def entry(b, shapes):
        xi, hi, ci = b.input("x", x.shape), b.input("h0", h0.shape), b.input("c0", c0.shape)
        b.output("packed", b.lstm(xi, b.weight("w", w), hi, ci))
        b.output("wdot", b.lstm(xi, b.input("w_in", w.shape), hi, ci))

    got = {}
    for threads in (1, 2, 3):
        with _session(threads) as sess:
            pg = sess.prepare({"full": entry}, {"full": {"x": x.shape, "h0": h0.shape, "c0": c0.shape, "w_in": w.shape}})
            if threads > 1:
                splits = [sp for sp in pg.describe()["entries"]["full"]["split_list"] if sp.get("executor") == "native"]
                assert sum(sp["split_commands"] for sp in splits) == 2
            got[threads] = {k: v.copy() for k, v in pg.execute("full", x=x, h0=h0, c0=c0, w_in=w).items()}
            pg.release()
    want = lstm_f64(x, w, h0, c0)
    for name in ("packed", "wdot"):
        np.testing.assert_allclose(got[1][name], want, rtol=1e-5, atol=1e-5, err_msg=name)
        for threads in (2, 3):
            np.testing.assert_array_equal(got[threads][name], got[1][name], err_msg=f"{name} at {threads} threads")


def test_concurrent_executes_on_sessions_of_different_threads():
    """Four sessions (1-4 threads), two graphs on the 3-thread one (so its pool is sometimes busy
    and a caller runs alone), six Python threads executing at random: every output as at one thread."""
    seeds = list(range(4))
    ref = _reference(seeds)
    before = LEDGER.snapshot().count()
    sessions = [_session(n) for n in (1, 2, 3, 4)]
    try:
        graphs = [s.prepare({"full": block}, {"full": SHAPES}) for s in sessions]
        graphs.append(sessions[2].prepare({"full": block}, {"full": SHAPES}))  # a second workspace on cpu 3

        def worker(k: int) -> None:
            rng = np.random.default_rng(k)
            for _ in range(6):
                pg = graphs[int(rng.integers(len(graphs)))]
                seed = int(rng.integers(len(seeds)))
                got = pg.execute("full", **inputs(seed))
                for name, want in ref[seed].items():
                    assert_same(got[name], want, name)

        errors = run_threads(worker, 6)
        assert not errors, errors[0]
        for pg in graphs:
            pg.release()
    finally:
        for s in sessions:
            s.close()
    assert LEDGER.snapshot().count() == before


def test_pool_workers_start_and_stop_with_the_session():
    """threads - 1 native workers per CPU device (named flare-cpu), joined by close()."""
    def workers() -> int:
        n = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    n += f.read().strip() == "flare-cpu"
            except OSError:  # a thread that just ended
                pass
        return n

    def settles_at(want: int) -> bool:
        # pthread_join returns when the kernel clears the thread's tid, a moment before its
        # /proc/self/task entry goes: a joined worker may still be listed for a few ms
        deadline = time.monotonic() + 5
        while workers() != want and time.monotonic() < deadline:
            time.sleep(0.01)
        return workers() == want

    start = workers()
    sess = _session(4)
    assert workers() == start + 3           # named by the creating thread before flare_pool_new returns
    one = _session(1)            # one thread: no pool, no workers
    assert workers() == start + 3
    one.close()
    sess.close()
    assert settles_at(start), (workers(), start)


def test_a_bad_index_in_a_split_list_is_the_same_typed_error():
    """An expert id out of range fails the command on thread 0 after the others waited for it:
    IndexError naming the node, no hang, and the graph still runs afterwards."""
    for threads in (1, 3):
        with _session(threads) as sess:
            pg = sess.prepare({"full": block}, {"full": SHAPES})
            bad = inputs(0)
            bad["sel"][5, 1] = 9
            with pytest.raises(IndexError, match="mul_mat_id"):
                pg.execute("full", **bad)
            bad = inputs(0)
            bad["ids"][3] = VOCAB + 2
            with pytest.raises(IndexError, match="get_rows"):
                pg.execute("full", **bad)
            assert pg.execute("full", **inputs(1))["y"].shape == (T, D)
            pg.release()


SMALL_VOCAB = 6


def between_splits(b, shapes):
    """Split products around a run of small commands that do not split (one step of the walk,
    run by one thread): a lookup in a 6-row table, an add, a scale, a tanh."""
    x = b.input("x", shapes["x"])                                                        # [T, D]
    h = b.matmul(x, b.weight("w1", W["w1"]), transpose_b=True)                           # split
    small = b.get_rows(b.weight("table", W["emb"][:SMALL_VOCAB, :8]), b.input("ids", shapes["ids"], "i32"))
    tail = b.tanh(b.scale(b.add(small, b.weight("bias8", W["b1"][:8])), scale=0.5, bias=0.1))  # unsplit run
    b.output("tail", tail)
    b.output("y", b.matmul(h, b.weight("w2", W["w2"]), transpose_b=True))                # split


def test_a_run_of_unsplit_commands_between_split_ones():
    """The walk runs consecutive unsplit commands as one step: outputs as at one thread, and a bad
    index in the middle of such a run is IndexError naming that node (the run stops there)."""
    shapes = {"x": (T, D), "ids": (4,)}
    rng = np.random.default_rng(3)
    feed = {"x": rng.standard_normal((T, D)).astype(np.float32), "ids": np.array([0, 5, 2, 1], np.int32)}
    with _session(1) as sess:
        pg = sess.prepare({"full": between_splits}, {"full": shapes})
        want = {k: v.copy() for k, v in pg.execute("full", **feed).items()}
        pg.release()
    for threads in (2, 3):
        with _session(threads) as sess:
            pg = sess.prepare({"full": between_splits}, {"full": shapes})
            split = pg.describe()["entries"]["full"]["split_list"][0]
            assert split["split_commands"] >= 2, split                # the products around the run split
            before = sess.devices[0].pool.regions()
            got = pg.execute("full", **feed)
            assert sess.devices[0].pool.regions() > before
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} at {threads} threads")
            with pytest.raises(IndexError, match="get_rows"):
                pg.execute("full", x=feed["x"], ids=np.array([0, SMALL_VOCAB, 1, 2], np.int32))
            got = pg.execute("full", **feed)                            # and it still runs afterwards
            np.testing.assert_array_equal(got["tail"], want["tail"])
            pg.release()


def test_a_forked_child_runs_the_lists_on_its_own_thread():
    """A child forked after the pool started has none of its workers: it must not wait for them."""
    import signal
    import time

    ref = _reference([2])
    with _session(2) as sess:
        pg = sess.prepare({"full": block}, {"full": SHAPES})
        pg.execute("full", **inputs(0))
        pid = os.fork()
        if pid == 0:  # the child: run, compare, leave without running any Python teardown
            ok = False
            try:
                got = pg.execute("full", **inputs(2))
                ok = all(np.allclose(got[k], v, rtol=1e-5, atol=1e-5) if k in BLAS_SPLIT else np.array_equal(got[k], v)
                         for k, v in ref[2].items())
            finally:
                os._exit(0 if ok else 1)
        deadline = time.monotonic() + 120
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung in a command list")
            time.sleep(0.05)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        pg.release()


def test_pool_for_covers_the_range_once_in_grain_multiples():
    """flare_pool_for, the entry other C kernels use: every index once, boundaries at multiples
    of the grain, on more than one thread when the pool has them."""
    nat = native.load()
    ffi, lib = nat.ffi, nat.lib
    seen: list[tuple[int, int, int]] = []

    @ffi.callback("void(void *, int64_t, int64_t)")
    def task(ctx, begin, end):  # runs on the pool's threads (cffi takes the GIL)
        seen.append((threading.get_ident(), begin, end))

    for threads, n, grain in ((1, 100, 7), (3, 1000, 7), (4, 5, 16)):
        with _session(threads) as sess:
            seen.clear()
            lib.flare_pool_for(sess.devices[0].pool.ptr, n, grain, task, ffi.NULL)
            ranges = sorted((b, e) for _, b, e in seen)
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(e == b2 for (_, e), (b2, _) in zip(ranges, ranges[1:]))
            assert all(b % grain == 0 for b, _ in ranges)
            if threads == 1 or n <= grain:
                assert ranges == [(0, n)]


def test_closing_the_session_under_running_lists():
    """close() while threads execute split lists: each execute finishes with the right outputs
    or raises ReleasedError; the workers are joined only after the lists in flight."""
    import time

    from flare.core.errors import ReleasedError

    ref = _reference([3])
    sess = _session(3)
    pg = sess.prepare({"full": block}, {"full": SHAPES})
    outcomes: list[str] = []

    def worker() -> None:
        while True:
            try:
                got = pg.execute("full", **inputs(3))
            except ReleasedError:
                outcomes.append("released")
                return
            for name, want in ref[3].items():
                assert_same(got[name], want, name)
            outcomes.append("ok")

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    while len(outcomes) < 2:
        time.sleep(0.01)
    sess.close()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert outcomes.count("released") == 3 and "ok" in outcomes


def one_row_products(b, shapes):
    """A decode step's shapes: one row against weights of 384 x 96 (144 KiB: split by columns, the
    product is bound by reading it) and 96 x 96 (36 KiB: one chunk), and one token's experts."""
    h = b.input("h", shapes["h"])
    b.output("wide", b.matmul(h, b.weight("mid", W["mid"]), transpose_b=True))
    b.output("narrow", b.matmul(h, b.weight("wq", W["wq"]), transpose_b=True))
    b.output("experts", b.mul_mat_id(b.weight("experts_wide", W["experts_wide"]), h, b.input("sel", shapes["sel"], "i32")))


def test_one_row_products_split_by_the_bytes_they_read():
    """kernels.c plan() (flare_cmd_mode, what bench/native_profile.py reports): at 2 threads a one-row
    product that reads >= 128 KiB of weight splits, a smaller one does not, and one token's
    mul_mat_id splits by its slots; each output as at one thread, bit for bit."""
    nat = native.load()
    from flare.backends.cpu.split import CommandList

    rng = np.random.default_rng(11)
    feed = {"h": rng.standard_normal((1, D)).astype(np.float32), "sel": np.array([[3, 1]], np.int32)}
    shapes = {"h": (1, D), "sel": (1, 2)}
    outs = {}
    for threads in (1, 2):
        with _session(threads) as sess:
            pg = sess.prepare({"full": one_row_products}, {"full": shapes})
            outs[threads] = {k: v.copy() for k, v in pg.execute("full", **feed).items()}
            lists = [s for p in pg.current_plan("full").programs for s in getattr(p, "_steps", [])
                     if isinstance(s, CommandList)]
            work = nat.ffi.new("int64_t *")
            modes = {cl._names[i]: int(nat.lib.flare_cmd_mode(cl._arr + i, 2, work))
                     for cl in lists for i in range(cl._n)}
            pg.release()
    by_kind = {name.split("/")[-1].rsplit("_", 1)[0]: m for name, m in modes.items()}
    assert sorted(m for n, m in modes.items() if "matmul" in n) == [0, 2], modes   # narrow serial, wide split
    assert by_kind.get("mul_mat_id") == 2, modes
    for name in outs[1]:
        np.testing.assert_array_equal(outs[2][name], outs[1][name], err_msg=name)
    want = feed["h"] @ W["mid"].T
    np.testing.assert_allclose(outs[1]["wide"], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[1]["experts"][0, 1], W["experts_wide"][1] @ feed["h"][0], rtol=1e-5, atol=1e-5)
