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
        self.helper_fails = False

    def write_rows(self, name, row, array):
        if threading.current_thread() is not threading.main_thread():
            if self.helper_fails:
                raise OSError("the expert file went away")
            if self.gate is not None:
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
    st.take_back = False             # settle waits for the whole job: counts independent of timing
    ctx = ArrayCtx(6)
    hidden = np.random.default_rng(5).standard_normal((2, D)).astype(np.float32)
    st(_node(0), np.array([[0, 1], [2, 3]], np.int32), np.array([0, 1], np.int32), hidden, ctx=ctx)
    want = _guess(routers, 1, hidden, 2)
    st.drain()
    assert set(st.records[-1].prefetched) == want
    assert set(st.resident(1)) == want and st.stats.prefetched == len(want)
    assert ctx.writers == {"test-moe-expert-prefetch", "MainThread"}   # the guess was copied by the helper
    _check_cache(st, src, ctx)
    st.close()
    assert st._helper is None


def _read_only(a):
    a = np.array(a)
    a.flags.writeable = False
    return a


def test_borrowed_inputs_are_not_kept_and_slots_fill_out():
    """The stager borrows its inputs (`borrows_inputs`: the host step hands it read-only views of
    the graph's memory, reused after the call) and fills the node's output (`fills_output`):
    the slots land in `out`, which it returns; its prefetch job works on its own copy of the
    residual stream, so the graph overwriting the view after the call changes no guess."""
    assert ExpertStager.borrows_inputs and ExpertStager.fills_output
    st, src, routers = _stager(slots=6, prefetch=2)
    st.take_back = False
    ctx = ArrayCtx(6)
    hidden = np.random.default_rng(6).standard_normal((2, D)).astype(np.float32)
    view = hidden.copy()                              # the graph's memory, as the host step lends it
    lent = view.view()
    lent.flags.writeable = False
    ids = _read_only([[0, 1], [2, 3]])
    out = np.full((2, 2), -7, np.int32)
    overwritten = threading.Event()
    plan = st._plan
    st._plan = lambda layer, h: (overwritten.wait(5), plan(layer, h))[1]   # the helper guesses late
    got = st(_node(0), ids, _read_only(np.array([0, 1], np.int32)), lent, ctx=ctx, out=out)
    view[...] = 1e3                                   # the execute reuses the memory after the call
    overwritten.set()
    assert got is out
    resident = st.resident(0)
    assert out.tolist() == [[resident[0], resident[1]], [resident[2], resident[3]]]
    assert set(st.records[-1].prefetched) == _guess(routers, 1, hidden, 2)   # guessed from the copy
    _check_cache(st, src, ctx)
    wide = np.zeros((2, 2), np.int64)                # an output of another dtype: a new array instead
    again = st(_node(0), ids, None, None, ctx=ctx, out=wide)
    assert again is not wide and again.tolist() == out.tolist() and not wide.any()
    st.close()


def test_unfinished_prefetch_is_dropped_whole_by_drain():
    st, src, _ = _stager(slots=6, prefetch=2)
    ctx = ArrayCtx(6)
    ctx.gate = threading.Event()
    hidden = np.random.default_rng(5).standard_normal((2, D)).astype(np.float32)
    st(_node(0), np.array([[0, 1], [2, 3]], np.int32), None, hidden, ctx=ctx)
    threading.Timer(0.1, ctx.gate.set).start()
    st.drain()                       # nothing needed: what the helper had not started is dropped
    assert len(st.resident(1)) == st.stats.prefetched <= 4
    _check_cache(st, src, ctx)
    st.close()


def test_padding_rows_take_no_part_in_the_guess():
    st, _, routers = _stager(slots=6, prefetch=1)
    st.take_back = False
    ctx = ArrayCtx(6)
    hidden = np.random.default_rng(6).standard_normal((2, D)).astype(np.float32)
    st(_node(0), np.array([[0, 1], [2, 3]], np.int32), np.array([0, 99], np.int32), hidden, ctx=ctx)
    st.drain()
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
    job = st._job
    with job.cond:                                     # the helper is stuck in its first run's write
        assert job.cond.wait_for(lambda: job.busy, timeout=10)
    guessed = sorted(job.guessed)
    assert len(guessed) == 2
    needed = [guessed[-1], next(e for e in range(E) if e not in guessed)]
    threading.Timer(0.2, ctx.gate.set).start()         # let the run in flight finish a little later
    slots = st(_node(1), np.array([needed], np.int32), None, hidden, ctx=ctx)
    res = st.resident(1)
    assert slots.tolist() == [[res[needed[0]], res[needed[1]]]]
    assert set(res) >= set(needed)
    if len(job.runs) == 2:                             # guessed[0] in flight, guessed[1] taken back and
        assert guessed[0] in res                       # copied by the staging call, which needs it
        assert st.stats.prefetched == 1 and st.stats.experts_staged == 2 + 2
    _check_cache(st, src, ctx)
    s = st.stats
    assert s.selected == 4 and s.hits + s.experts_staged == 4
    st.close()


def test_a_failed_background_copy_surfaces_and_forgets_the_layer():
    st, src, _ = _stager(slots=6, prefetch=2)
    st.take_back = False
    ctx = ArrayCtx(6)
    ctx.helper_fails = True
    hidden = np.random.default_rng(8).standard_normal((1, D)).astype(np.float32)
    st(_node(0), np.array([[0, 1]], np.int32), None, hidden, ctx=ctx)
    with pytest.raises(OSError, match="went away"):
        st(_node(1), np.array([[2, 3]], np.int32), None, hidden, ctx=ctx)
    assert st.resident(1) == {}                        # nothing claimed that may not be there
    ctx.helper_fails = False
    st(_node(1), np.array([[2, 3]], np.int32), None, None, ctx=ctx)
    _check_cache(st, src, ctx)
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


def test_prefetch_layer_guesses_layer_0_from_given_or_computed_embeddings():
    st, src, routers = _stager(slots=6, prefetch=2)
    st.take_back = False
    ctx = ArrayCtx(6)
    emb = np.random.default_rng(9).standard_normal((3, D)).astype(np.float32)
    st.prefetch_layer(0, lambda: emb, ctx)             # computed on the helper thread
    assert set(st.resident(0)) == _guess(routers, 0, emb, 2) and st.stats.prefetched > 0
    slots = st(_node(0), np.array([[0, 1]], np.int32), ctx=ctx)
    assert slots.tolist() == [[st.resident(0)[0], st.resident(0)[1]]]
    _check_cache(st, src, ctx)
    plain, _, _ = _stager(slots=6, prefetch=0)
    plain.prefetch_layer(0, emb, ctx)                  # no prefetch: nothing happens
    assert plain.resident(0) == {} and plain._helper is None
    st.close()


def test_row_writer_and_hold_of_a_prepared_graph(tmp_path):
    """The lock-free writer the helper uses writes the same bytes as write_rows; it is refused for
    a tensor that is not a state/cache; hold() is the graph's re-entrant lock around an execute."""
    from flare.core.errors import InputError
    from flare.models.moe_lm import MoeLM, encode
    from flare.models.moe_lm import weights as moe_weights
    from flare.models.moe_lm.config import get_config

    cfg = get_config("tiny")
    path = moe_weights.ensure(cfg, 0, tmp_path)
    with MoeLM.load("tiny", experts="offload", weights_path=path) as model:
        g = model.graph
        rows = np.arange(2 * cfg.d_ff * cfg.d_model, dtype=np.float32).reshape(2, cfg.d_ff, cfg.d_model)
        g.row_writer("L1.experts.up")(3, rows)
        np.testing.assert_array_equal(g.read_rows("L1.experts.up", 3, 2), rows)
        with pytest.raises(InputError, match="no state or cache tensor 'L1.wq'"):
            g.row_writer("L1.wq")
        with g.hold():
            model.generate(encode("held"), 2)          # execute re-enters the held lock
    with pytest.raises(Exception, match="released"):
        g.row_writer("L1.experts.up")


def test_threads_sharing_a_model_with_prefetch_get_their_sequential_tokens(tmp_path):
    """Two threads generate on their own sequence slots of one offload model with prefetch (one
    stager, one helper): each gets exactly the tokens and logits a sequential run gives."""
    from concurrent.futures import ThreadPoolExecutor

    from flare.models.moe_lm import MoeLM, encode
    from flare.models.moe_lm import weights as moe_weights
    from flare.models.moe_lm.config import get_config

    cfg = get_config("tiny")
    path = moe_weights.ensure(cfg, 0, tmp_path)
    prompts = {0: encode("first thread's prompt"), 1: encode("and the second one, longer than that")}
    with MoeLM.load("tiny", experts="resident", weights_path=path) as ref_model:
        want = {s: ref_model.generate(p, 6, seq=s, stop_at_eos=False) for s, p in prompts.items()}
    with MoeLM.load("tiny", experts="offload", weights_path=path, prefetch=2) as model:
        def work(seq):
            out = []
            for _ in range(3):
                out.append(model.generate(prompts[seq], 6, seq=seq, stop_at_eos=False))
            return out
        with ThreadPoolExecutor(2) as pool:
            got = dict(zip(prompts, pool.map(work, prompts)))
    for seq, runs in got.items():
        for tokens, logits in runs:
            assert tokens == want[seq][0]
            for a, b in zip(logits, want[seq][1]):
                np.testing.assert_array_equal(a, b)


def test_a_stager_dropped_without_close_is_collected_and_stops_its_helper():
    import gc
    import weakref

    st, _, _ = _stager(slots=6, prefetch=2)
    st.take_back = False
    ctx = ArrayCtx(6)
    st(_node(0), np.array([[0, 1]], np.int32), None, np.ones((1, D), np.float32), ctx=ctx)
    st.drain()
    helper, gone = st._helper, weakref.ref(st)
    assert helper is not None and helper.is_alive()
    del st
    gc.collect()
    assert gone() is None                  # the helper thread kept no reference to it
    helper.join(5)
    assert not helper.is_alive()           # and its finalizer stopped the thread


def test_models_with_prefetch_leave_no_thread_behind_after_many_loads(tmp_path):
    """Load, generate and release an offload model with prefetch several times: the tokens equal
    the resident model's every time, and the helper thread is gone after each release."""
    import os

    from flare.models.moe_lm import MoeLM, encode
    from flare.models.moe_lm import weights as moe_weights
    from flare.models.moe_lm.config import get_config

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    cfg = get_config("tiny")
    path = moe_weights.ensure(cfg, 0, tmp_path)
    with MoeLM.load("tiny", experts="resident", weights_path=path) as ref_model:
        want = ref_model.generate(encode("many loads"), 6, stop_at_eos=False)[0]
    before = threads()
    for _ in range(5):
        model = MoeLM.load("tiny", experts="offload", weights_path=path, prefetch=2)
        model.stager.take_back = False            # every guess copied: the helper surely ran
        assert model.generate(encode("many loads"), 6, stop_at_eos=False)[0] == want
        assert model.stager._helper is not None and model.stager.stats.prefetched > 0
        model.release()
        assert threads() == before and model.stager._helper is None


def test_run_writer_copies_every_run_and_refuses_what_does_not_fit(tmp_path):
    """row_byte_run_writer (a staging call's copies, one call per tensor) writes the bytes of each
    (first, row, count) run, checks every run against both the cache and the source, and fails
    once the graph is released instead of writing freed memory."""
    from flare.core.errors import InputError
    from flare.models.moe_lm import MoeLM
    from flare.models.moe_lm import weights as moe_weights
    from flare.models.moe_lm.config import get_config

    cfg = get_config("tiny")
    path = moe_weights.ensure(cfg, 0, tmp_path)
    with MoeLM.load("tiny", experts="offload", weights_path=path) as model:
        g = model.graph
        name = "L1.experts.up"
        src = np.arange(5 * cfg.d_ff * cfg.d_model, dtype=np.float32).reshape(5, cfg.d_ff, cfg.d_model) + 0.5
        write = g.row_byte_run_writer(name, src)
        src_bytes = src.reshape(5, -1).view(np.uint8)
        write([(0, 6, 2), (4, 1, 1)], src_bytes)
        np.testing.assert_array_equal(g.read_rows(name, 6, 2), src[0:2])
        np.testing.assert_array_equal(g.read_rows(name, 1, 1), src[4:5])
        slots = g.state(name).shape[0]
        before = g.state(name)
        for runs in ([(0, slots - 1, 2)], [(4, 0, 2)], [(-1, 0, 1)], [(0, -1, 1)]):
            with pytest.raises(InputError, match="do not fit"):
                write(runs, src_bytes)
        with pytest.raises(InputError, match="are not rows of"):
            write([(0, 0, 1)], src_bytes[:, :-4])
        np.testing.assert_array_equal(g.state(name), before)      # nothing half-written
        with pytest.raises(InputError, match="are not"):
            g.row_byte_run_writer(name, src[:, :, :-1])
    with pytest.raises(InputError, match="released"):
        write([(0, 0, 1)], src_bytes)


def _reference_victims(cache, count, keep):
    """The eviction order as first written (a scan of every slot and a full sort per call): the
    lean path (an empty-slot count, min for one victim) must pick exactly the same slots."""
    out = [s for s, e in enumerate(cache.expert_in) if e is None][:count]
    if len(out) < count:
        order = sorted((e for e in cache.slot_of if e not in keep), key=lambda e: (cache.uses[e], cache.last[e], e))
        out += [cache.slot_of[e] for e in order[: count - len(out)]]
    return out


def test_lean_victim_choice_equals_the_full_sort_with_prefetch_freeing_slots():
    """Random steps (1-4 tokens) with prefetch guesses whose unused slots are freed again: before
    every staging call the victims equal the reference's for every count, and the empty-slot count
    matches the slots that hold nothing."""
    st, src, _ = _stager(slots=6, prefetch=2)          # settling may free wrong guesses' slots
    ctx = ArrayCtx(6)
    rng = np.random.default_rng(7)
    for step in range(300):
        layer = step % LAYERS
        t = int(rng.integers(1, 4))
        ids = rng.choice(E, size=(t, 2), replace=False).astype(np.int32) if t * 2 <= E else None
        st.drain()
        cache = st._layers[layer]
        keep = set(ids.ravel().tolist())
        assert cache.empty == cache.expert_in.count(None)
        for count in range(1, 4):
            assert cache.victims(count, keep) == _reference_victims(cache, count, keep)
        hidden = rng.standard_normal((t, D)).astype(np.float32)
        st(_node(layer), ids, np.zeros(t, np.int32), hidden, ctx=ctx)
    st.drain()
    _check_cache(st, src, ctx)
    cache = st._layers[0]
    assert cache.empty == 0 or None in cache.expert_in
    cache.take(4)                                      # a freed slot is taken before any eviction
    assert cache.empty == cache.expert_in.count(None) >= 1
    assert cache.victims(1, set()) == _reference_victims(cache, 1, set()) == [cache.expert_in.index(None)]
    st.close()
