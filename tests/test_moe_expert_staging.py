"""flare.core.expert_staging.ExpertStager on its own: eviction by use counts, prefetch guesses,
taking back unstarted prefetch copies, and that the cache always holds what the stager thinks.

A fake context stands in for the prepared graph's `write_rows` only (it writes real NumPy
arrays, so the tests check bytes, not calls); the models' own tests run the stager inside
real prepared graphs (tests/test_moe_staging.py, tests/test_gguf_files.py)."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from flare.core.errors import ModelError
from flare.core.expert_staging import AGE_EVERY, ExpertCacheError, ExpertStager

E, D, LAYERS = 16, 8, 3


class ArrayCtx:
    """The caches as arrays; write_rows copies like PreparedGraph.write_rows; `gate` (an Event)
    can hold the prefetch thread's writes back to test the take-back path."""

    def __init__(self, slots: int):
        self.caches = {f"L{i}.{p}": np.zeros((slots, 2, D), np.float32) for i in range(LAYERS) for p in "gud"}
        self.writers: set[str] = set()
        self.gate: threading.Event | None = None

    def write_rows(self, name, row, array):
        if self.gate is not None and threading.current_thread() is not threading.main_thread():
            self.gate.wait(5)
        self.writers.add(threading.current_thread().name)
        self.caches[name][row: row + len(array)] = array


def _source():
    rng = np.random.default_rng(0)
    return {f"L{i}.{p}": rng.standard_normal((E, 2, D)).astype(np.float32) for i in range(LAYERS) for p in "gud"}


def _routers():
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((E, D)).astype(np.float32), None, (1 + rng.random(D)).astype(np.float32))
            for _ in range(LAYERS)]


def _stager(slots=6, prefetch=0, trace=True):
    src, routers = _source(), _routers()
    st = ExpertStager(label="test-moe", n_layers=LAYERS, n_experts=E, slots=slots, scratch_row=99,
                      tensors=lambda i: [f"L{i}.{p}" for p in "gud"], source=src.__getitem__, trace=trace,
                      prefetch=prefetch, router=routers.__getitem__)
    return st, src, routers


def _node(layer):
    return SimpleNamespace(params={"args": {"layer": layer}})


def _check_cache(st, src, ctx):
    """Every slot the stager believes filled holds exactly that expert's rows."""
    for layer in range(LAYERS):
        for expert, slot in st.resident(layer).items():
            for p in "gud":
                np.testing.assert_array_equal(ctx.caches[f"L{layer}.{p}"][slot], src[f"L{layer}.{p}"][expert])


def test_eviction_keeps_often_used_experts_over_recent_rare_ones():
    st, src, _ = _stager(slots=4)
    ctx = ArrayCtx(4)
    for _ in range(3):
        st(_node(0), np.array([[0, 1]], np.int32), ctx=ctx)      # 0 and 1: used three times
    st(_node(0), np.array([[2, 3]], np.int32), ctx=ctx)          # cache full: 0 1 2 3
    st(_node(0), np.array([[4, 5]], np.int32), ctx=ctx)          # LRU would evict 0 and 1; counts evict 2 and 3
    assert set(st.records[-1].evicted) == {2, 3}
    assert set(st.resident(0)) == {0, 1, 4, 5}
    slots = st(_node(0), np.array([[0, 5], [4, 1]], np.int32), ctx=ctx)
    assert st.records[-1].staged == ()                            # all hits
    res = st.resident(0)
    assert slots.tolist() == [[res[0], res[5]], [res[4], res[1]]]
    _check_cache(st, src, ctx)


def test_use_counts_age_so_old_favourites_can_leave():
    st, _, _ = _stager(slots=2)
    ctx = ArrayCtx(2)
    for _ in range(4):
        st(_node(0), np.array([[0]], np.int32), ctx=ctx)
    for _ in range(AGE_EVERY * 3):                                # 1 and 2 take turns for a long time
        st(_node(0), np.array([[1 + st.stats.calls % 2]], np.int32), ctx=ctx)
    assert 0 not in st.resident(0)                                # 0's four old uses were halved away


def test_bad_ids_and_too_many_experts_are_typed_errors():
    st, _, _ = _stager(slots=2)
    ctx = ArrayCtx(2)
    with pytest.raises(ExpertCacheError, match="test-moe: layer 1: a step selects 3 distinct experts.*2 slot"):
        st(_node(1), np.array([[0, 1], [2, 2]], np.int32), ctx=ctx)
    with pytest.raises(ExpertCacheError, match="out of range"):
        st(_node(1), np.array([[0, E]], np.int32), ctx=ctx)
    assert isinstance(ExpertCacheError("x"), ModelError)
    with pytest.raises(ModelError, match="prefetch needs the router"):
        ExpertStager(label="m", n_layers=1, n_experts=2, slots=2, scratch_row=0, tensors=lambda i: ["a"],
                     source={"a": np.zeros((2, 1))}.__getitem__, prefetch=1)


def _guess(routers, layer, hidden, n):
    weight, _, norm = routers[layer]
    x = hidden / np.sqrt(np.mean(hidden * hidden, axis=-1, keepdims=True) + 1e-6)
    logits = (x * norm) @ weight.T
    return set(np.argsort(-logits, axis=-1)[:, :n].ravel().tolist())


def test_prefetch_copies_the_next_layers_guess_with_its_own_norm():
    st, src, routers = _stager(slots=6, prefetch=2)
    ctx = ArrayCtx(6)
    hidden = np.random.default_rng(5).standard_normal((2, D)).astype(np.float32)
    st(_node(0), np.array([[0, 1], [2, 3]], np.int32), np.array([0, 1], np.int32), hidden, ctx=ctx)
    want = _guess(routers, 1, hidden, 2)
    assert set(st.records[-1].prefetched) == want
    st.drain()                       # no staging call follows: unstarted guesses are dropped, not half-kept
    assert set(st.resident(1)) <= want
    assert st.stats.prefetched == len(st.resident(1))
    _check_cache(st, src, ctx)
    st.close()
    assert st._pool is None


def test_padding_rows_take_no_part_in_the_guess():
    st, _, routers = _stager(slots=6, prefetch=1)
    ctx = ArrayCtx(6)
    hidden = np.random.default_rng(6).standard_normal((2, D)).astype(np.float32)
    st(_node(0), np.array([[0, 1], [2, 3]], np.int32), np.array([0, 99], np.int32), hidden, ctx=ctx)
    assert st.records[-1].selected == (0, 1)
    assert set(st.records[-1].prefetched) == _guess(routers, 1, hidden[:1], 1)
    st.close()


def test_unstarted_prefetch_copies_are_taken_back_by_the_staging_call():
    """The helper thread is held back: the next staging call copies the guessed experts it needs
    itself, frees the slots of the wrong guesses, and the cache holds exactly what it should."""
    st, src, routers = _stager(slots=6, prefetch=2)
    ctx = ArrayCtx(6)
    ctx.gate = threading.Event()                       # the helper blocks in its first write
    hidden = np.random.default_rng(7).standard_normal((1, D)).astype(np.float32)
    st(_node(0), np.array([[0, 1]], np.int32), None, hidden, ctx=ctx)
    guessed = sorted(st.records[-1].prefetched)
    assert len(guessed) == 2
    needed = [guessed[0], next(e for e in range(E) if e not in guessed)]
    threading.Timer(0.2, ctx.gate.set).start()         # let the run in flight finish a little later
    slots = st(_node(1), np.array([needed], np.int32), None, hidden, ctx=ctx)
    res = st.resident(1)
    assert slots.tolist() == [[res[needed[0]], res[needed[1]]]]
    assert set(res) >= set(needed)
    _check_cache(st, src, ctx)
    s = st.stats
    assert s.selected == 4 and s.hits + s.experts_staged == 4
    st.close()


def test_prefetch_outputs_equal_no_prefetch_over_many_steps():
    """Random routing over many steps and layers: with prefetch (whatever the helper manages in
    time) the returned slots always point at the right experts, like without prefetch."""
    rng = np.random.default_rng(11)
    plain, src, _ = _stager(slots=5, prefetch=0, trace=False)
    ahead, _, _ = _stager(slots=5, prefetch=2, trace=False)
    c1, c2 = ArrayCtx(5), ArrayCtx(5)
    for step in range(60):
        t = 1 + step % 2
        hidden = rng.standard_normal((t, D)).astype(np.float32)
        for layer in range(LAYERS):
            ids = rng.choice(E, size=(t, 2), replace=False if t == 1 else True).astype(np.int32)
            a = plain(_node(layer), ids, None, hidden, ctx=c1)
            b = ahead(_node(layer), ids, None, hidden, ctx=c2)
            for p in "gud":
                np.testing.assert_array_equal(c1.caches[f"L{layer}.{p}"][a], c2.caches[f"L{layer}.{p}"][b])
                np.testing.assert_array_equal(c2.caches[f"L{layer}.{p}"][b], src[f"L{layer}.{p}"][ids])
    ahead.close()
    assert ahead.stats.prefetched + ahead.stats.experts_staged > 0
