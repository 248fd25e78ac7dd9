"""Attention over the KV window: a step's mask and keys/values cover only KV rows [0, W), the
smallest power-of-two bucket (>= MIN_WINDOW) holding every row the step's tokens see, instead of every
row of the cache (max_seqs x max_ctx + 1). The window's layout (`kv_window`, `token_lm_inputs`),
and the GGUF graph run with it on every backend against the same step over all KV rows."""
from __future__ import annotations

import numpy as np
import pytest

from flare.core.errors import InputError
from flare.models.gguf.model import GgufLM, serving_contract
from flare.plugins.export.schema import Serving
from flare.plugins.export.serving.batch import MASK_NEG, MIN_WINDOW, Chunk, kv_window, token_lm_inputs

pytestmark = pytest.mark.usefixtures("gguf_plugin")

SERVING = Serving("token-lm/1", 4, 128, 8, 300, 2, 2, ())      # 4 slots x 128 positions: 513 KV rows


@pytest.mark.parametrize("chunks, window", [
    ([Chunk(0, 0, (1,))], 64),                         # at least the smallest bucket
    ([Chunk(0, 63, (1,))], 64),                        # row 63 is the window's last
    ([Chunk(0, 63, (1, 2))], 128),                     # row 64 needs the next bucket
    ([Chunk(0, 5, (1,)), Chunk(1, 5, (1,))], 256),     # slot 1 starts at row 128
    ([Chunk(3, 127, (1,))], 512),                      # the last position: every row but the scratch
])
def test_the_window_is_the_smallest_power_of_two_bucket_holding_every_seen_row(chunks, window):
    assert kv_window(SERVING, chunks, min_window=64) == window
    assert kv_window(SERVING, chunks) == max(window, MIN_WINDOW)


def test_the_window_never_exceeds_the_kv_rows():
    small = Serving("token-lm/1", 1, 48, 8, 300, 2, 2, ())         # 49 KV rows: below the smallest bucket
    assert kv_window(small, [Chunk(0, 0, (1,))]) == 49


def test_a_windowed_mask_is_the_full_masks_first_columns():
    chunks = [Chunk(1, 3, (7, 8, 9)), Chunk(0, 10, (4,))]
    full = token_lm_inputs(SERVING, chunks, tokens=4, batch=2)
    win = token_lm_inputs(SERVING, chunks, tokens=4, batch=2, window=256)
    assert win["mask"].shape == (4, 256)
    np.testing.assert_array_equal(win["mask"], full["mask"][:, :256])
    assert not (full["mask"][:, 256:] == 0).any()      # nothing the window leaves out was visible
    for name in ("tokens", "pos", "kv_rows", "out_rows"):
        np.testing.assert_array_equal(win[name], full[name])


def test_padding_attends_to_row_zero_when_the_scratch_row_is_outside_the_window():
    """Padding tokens still write the scratch row; their (never read) attention needs some row."""
    inputs = token_lm_inputs(SERVING, [Chunk(0, 0, (5,))], tokens=4, batch=None, window=64)   # any width
    assert list(inputs["kv_rows"][1:]) == [SERVING.scratch_row] * 3
    assert (inputs["mask"][1:, 0] == 0).all() and (inputs["mask"][1:, 1:] == MASK_NEG).all()
    full = token_lm_inputs(SERVING, [Chunk(0, 0, (5,))], tokens=4, batch=None)
    assert (full["mask"][1:, SERVING.scratch_row] == 0).all() and (full["mask"][1:, 0] == MASK_NEG).all()


@pytest.mark.parametrize("window", [0, 64, 514])
def test_a_window_that_does_not_hold_the_step_is_refused(window):
    with pytest.raises(InputError, match="window"):
        token_lm_inputs(SERVING, [Chunk(1, 0, (5,))], tokens=1, batch=None, window=window)


STEPS = [   # (chunks, entry): slots 0 and 2 hold 20 and 7 tokens of context
    ([Chunk(0, 20, (5,)), Chunk(2, 7, (9,))], "decode"),     # window 512 of 513
    ([Chunk(0, 20, (5, 6, 7))], "prefill"),                   # window 128
    ([Chunk(1, 0, (5, 6, 7, 8)), Chunk(0, 20, (3,))], "mixed"),   # window 256
]


def test_windowed_attention_gives_the_logits_of_attention_over_every_row(backend, tiny_gguf):
    """The GGUF graph with a mask of W columns slices keys and values to W rows; the rows it
    drops are masked (weight exactly 0) in the full step, so logits agree. Tolerance: the
    kernels sum over W instead of 513 keys; exact on every backend here (measured), but a
    backend may order a longer reduction differently (OpenBLAS's sgemv does at SmolLM2's
    sizes), so float32 rounding of logits ~50 in size is allowed: atol 1e-4."""
    with backend.session("cpu") as sess, GgufLM.load(str(tiny_gguf), session=sess, max_seqs=4, max_ctx=128,
                                                     prefill_chunk=8) as lm:
        rng = np.random.default_rng(0)
        lm.prefill(0, rng.integers(0, lm.cfg.vocab, 20).tolist())
        lm.prefill(2, rng.integers(0, lm.cfg.vocab, 7).tolist())
        serving = serving_contract(lm.cfg)
        for chunks, entry in STEPS:
            n = sum(len(c.tokens) for c in chunks)
            batch = None if entry == "decode" else len(chunks)
            window = kv_window(serving, chunks)
            assert window < serving.kv_rows
            win = lm.step(chunks, entry=entry)              # prepares the entry if needed; the window
            assert lm.graph.current_plan(entry).shapes["mask"] == (n, window)
            full = lm.graph.execute(entry, **token_lm_inputs(serving, chunks, tokens=n, batch=batch))["logits"]
            np.testing.assert_allclose(win, full, rtol=0, atol=1e-4, err_msg=f"{entry} window {window}")


def test_steps_run_the_window_and_keep_a_plan_per_bucket(tiny_gguf):
    """GgufLM.step picks the window itself; a longer context moves to the next bucket's plan
    and a shorter one reuses the cached plan."""
    with GgufLM.load(str(tiny_gguf), max_seqs=4, max_ctx=128, prefill_chunk=8) as lm:
        lm.prefill(0, list(range(10, 70)))                 # positions 0..59
        lm.decode([0], [5], [60])
        assert lm.graph.current_plan("decode").shapes["mask"] == (1, MIN_WINDOW)
        lm.decode([0, 1], [5, 6], [61, 0])                 # slot 1's row 128 is seen
        assert lm.graph.current_plan("decode").shapes["mask"] == (2, 256)
        plan = lm.graph.current_plan("decode")
        lm.decode([0], [5], [62])
        lm.decode([0, 1], [7, 8], [63, 1])
        assert lm.graph.current_plan("decode") is plan


def test_an_exported_core_runs_its_programs_over_the_window(tiny_gguf, tmp_path):
    """The exported programs declare the mask at every KV row with the dim `window`; the serving
    engine sends the step's window and the core's loader replays the program at that width.
    Same logits as the program run over every row (see the tolerance above)."""
    from flare.models.gguf.export import GgufAdapter
    from flare.plugins.export import export_core, load_core
    from flare.plugins.export.runtime import CoreRuntime
    from flare.plugins.export.serving.engine import Engine, windowed_programs

    adapter = GgufAdapter(path=str(tiny_gguf), max_ctx=64, max_seqs=4, prefill_chunk=4)
    core = load_core(export_core(adapter, tmp_path / "tiny.core", progress=False, draft_layers=0))
    assert windowed_programs(core) == frozenset(core.programs)
    with CoreRuntime(core) as rt:
        engine = Engine(rt)
        serving = engine.serving                                     # 257 KV rows
        for chunks, kind in [([Chunk(0, 0, (1, 40, 41, 42))], "prefill"), ([Chunk(0, 4, (43,))], "decode"),
                             ([Chunk(0, 5, (44,)), Chunk(2, 0, (45,))], "decode")]:
            got, b = engine.run(kind, chunks)
            window = kv_window(serving, chunks)
            assert window < serving.kv_rows
            assert rt.graph.current_plan(b.program).shapes["mask"] == (b.tokens, window)
            full = token_lm_inputs(serving, chunks, tokens=b.tokens, batch=None if kind == "decode" else b.batch)
            want = rt.execute(b.program, **full)["logits"][: len(chunks)]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4, err_msg=f"{kind} window {window}")
        from flare.plugins.serve.engine import StepEngine     # flare serve's engine: the same windows

        chunks = [Chunk(0, 6, (46, 47))]
        got, b = StepEngine(rt).run("prefill", chunks)
        assert rt.graph.current_plan(b.program).shapes["mask"] == (b.tokens, kv_window(serving, chunks))
