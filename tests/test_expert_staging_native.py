"""The C staging step (backends/flare/backends/cpu/native/staging.c) against the Python one it
replaces for host-memory caches: the same routing through both gives the same slots, the same
copies and evictions (records), the same counters, the same cache bytes, and the same tokens.

The Python path (`ExpertStager(native=False)`) is the reference: it is what other devices and
prefetch use, and tests/test_moe_expert_staging.py checks its policy on its own. The same C step
also runs as a `stage_experts` command inside the CPU split (no host node, `in_walk`): the tests
at the end compare it with the host node and the Python step (tokens, counters, slots, cache
bytes) and check that its errors are the stager's and leave the graph usable."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from flare.core.expert_staging import AGE_EVERY, ExpertCacheError, ExpertStager
from flare.models.moe_lm import MoeLM, encode, get_config
from flare.models.moe_lm import weights as moe_weights

E, LAYERS, ROW = 24, 2, (3, 5)
COUNTERS = ("calls", "selected", "hits", "experts_staged", "copies", "writes", "bytes_staged", "evictions")


@pytest.fixture(scope="module")
def cpu_device():
    from flare.backends.cpu.device import CpuDevice
    dev = CpuDevice("cpu-staging-test", threads=1)
    if dev.native is None:
        pytest.skip(f"no native CPU executor: {dev.native_reason}")
    yield dev
    dev.close()


class HostCtx:
    """Caches as host arrays, reached the way a CPU PreparedGraph offers them: `row_byte_target`
    (the C step's path, with the real CPU device) and `write_rows` (the Python path's)."""

    def __init__(self, slots: int, device=None):
        self.caches = {f"L{i}.{p}": np.zeros((slots, *ROW), np.float32) for i in range(LAYERS) for p in "gud"}
        self.device = device

    def row_byte_target(self, name, like=None):
        view = self.caches[name].reshape(self.caches[name].shape[0], -1).view(np.uint8)
        return self.device, lambda: view

    def write_rows(self, name, row, array):
        self.caches[name][row: row + len(array)] = array


def _source():
    rng = np.random.default_rng(3)
    return {f"L{i}.{p}": rng.standard_normal((E, *ROW)).astype(np.float32) for i in range(LAYERS) for p in "gud"}


def _stager(src, slots, native):
    return ExpertStager(label="test-moe", n_layers=LAYERS, n_experts=E, slots=slots, scratch_row=99,
                        tensors=lambda i: [f"L{i}.{p}" for p in "gud"], source=src.__getitem__, trace=True,
                        native=native)


def _node(layer):
    return SimpleNamespace(params={"args": {"layer": layer}})


def _routing(steps, seed=7):
    """Skewed routing (popular experts, as a trained router has), prefill-like and decode-like
    steps, some with padding rows (kv row 99)."""
    rng = np.random.default_rng(seed)
    p = rng.random(E) ** 3
    p /= p.sum()
    out = []
    for n in range(steps):
        tokens = 4 if n % 5 == 0 else 1
        ids = np.stack([rng.choice(E, 2, replace=False, p=p) for _ in range(tokens)]).astype(np.int32)
        rows = np.arange(tokens, dtype=np.int32)
        if tokens > 1 and n % 3 == 0:
            rows[-1] = 99                                  # a padding row: stages nothing
        out.append((n % LAYERS, ids, rows))
    return out


def test_c_step_equals_python_step_over_a_long_skewed_routing(cpu_device):
    src = _source()
    slots = 8                                          # a 4-token step needs up to 8
    native, ref = _stager(src, slots, True), _stager(src, slots, False)
    nctx, rctx = HostCtx(slots, cpu_device), HostCtx(slots)
    for n, (layer, ids, rows) in enumerate(_routing(3 * AGE_EVERY * LAYERS)):   # past several halvings
        out = np.full(ids.shape, -7, np.int32)
        got = native(_node(layer), ids, rows, ctx=nctx, out=out)
        want = ref(_node(layer), ids, rows, ctx=rctx)
        assert got is out, "the slots are written into the node's output"
        valid = rows != 99
        np.testing.assert_array_equal(got[valid], want[valid], err_msg=f"step {n}")
        assert native.records[-1] == ref.records[-1], f"step {n}"
    assert native._native_layers[0] is not None and ref._native_layers[0] is None   # each took its own path
    for name in COUNTERS:
        if name != "writes":      # the reference writes a run at a time (write_rows); host caches: one per tensor and call
            assert getattr(native.stats, name) == getattr(ref.stats, name), name
    assert native.stats.writes == 3 * sum(1 for rec in native.records if rec.runs)
    assert native.stats.evictions > 50 and native.stats.hits > 50                   # the routing exercised both
    for layer in range(LAYERS):
        assert native.resident(layer) == ref.resident(layer)
        for expert, slot in native.resident(layer).items():                          # the bytes are the experts'
            for p in "gud":
                np.testing.assert_array_equal(nctx.caches[f"L{layer}.{p}"][slot], src[f"L{layer}.{p}"][expert])


def test_c_step_errors_are_the_stagers_and_change_nothing(cpu_device):
    src = _source()
    st = _stager(src, 2, True)
    ctx = HostCtx(2, cpu_device)
    st(_node(1), np.array([[0, 1]], np.int32), ctx=ctx)
    with pytest.raises(ExpertCacheError, match="test-moe: layer 1: a step selects 3 distinct experts for 2 token.*2 slot"):
        st(_node(1), np.array([[0, 1], [2, 2]], np.int32), ctx=ctx)
    with pytest.raises(ExpertCacheError, match="out of range 0..23"):
        st(_node(1), np.array([[0, E]], np.int32), ctx=ctx)
    with pytest.raises(ExpertCacheError, match="out of range"):
        st(_node(1), np.array([[-1, 0]], np.int64), ctx=ctx)       # other int dtypes are checked, then cast
    assert st.resident(1) == {0: 0, 1: 1} and st.stats.calls == 1
    slots = st(_node(1), np.array([[1, 0]], np.int64), ctx=ctx)
    assert slots.tolist() == [[1, 0]] and st.records[-1].staged == ()


def test_a_layer_switching_paths_starts_over_with_the_same_outputs(cpu_device):
    src = _source()
    st = _stager(src, 4, True)
    ctx = HostCtx(4, cpu_device)
    st(_node(0), np.array([[3, 4]], np.int32), ctx=ctx)
    st.native = False                                  # the Python path now: the C records mean nothing to it
    st(_node(0), np.array([[3, 5]], np.int32), ctx=ctx)
    assert st.records[-1].staged == (3, 5) and st.resident(0) == {3: 0, 5: 1}
    st.native = True
    st(_node(0), np.array([[5, 6]], np.int32), ctx=ctx)
    assert st.records[-1].staged == (5, 6)
    for expert, slot in st.resident(0).items():
        np.testing.assert_array_equal(ctx.caches["L0.g"][slot], src["L0.g"][expert])


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return moe_weights.ensure(get_config("tiny"), 0, tmp_path_factory.mktemp("moe_weights"))


def test_moe_lm_tokens_and_staging_equal_with_and_without_the_c_step(tiny_path):
    """In a real prepared graph on the CPU device: C step and Python step, and resident experts."""
    prompt = encode("Which experts does the router pick, and which ones does the cache keep?")
    runs = {}
    for label, experts, native in (("c", "offload", True), ("python", "offload", False), ("resident", "resident", True)):
        model = MoeLM.load("tiny", experts=experts, weights_path=tiny_path, trace=True,
                           **({"cache_mb": 0.8} if experts == "offload" else {}))
        try:
            if model.stager is not None:
                model.stager.native = native
            ids, _ = model.generate(prompt, 16, stop_at_eos=False)
            st = model.stager
            runs[label] = (ids, None if st is None else (list(st.records), {n: getattr(st.stats, n) for n in COUNTERS},
                                                         [st._native_layers[i] is not None for i in range(2)]))
        finally:
            model.release()
    assert runs["c"][0] == runs["python"][0] == runs["resident"][0]
    (c_records, c_stats, c_used), (p_records, p_stats, p_used) = runs["c"][1], runs["python"][1]
    assert c_used == [True, True] and p_used == [False, False]
    assert c_records == p_records and c_stats == p_stats
    assert c_stats["evictions"] > 0


@pytest.mark.usefixtures("gguf_plugin")
def test_gguf_quantized_experts_from_the_file_equal_with_and_without_the_c_step(tmp_path):
    """Q4_0 experts staged from the memory-mapped GGUF file: the C step copies the same bytes into
    the same slots as the Python step (tokens, bitwise logits, counters, what each slot holds)."""
    from flare.models.gguf.model import GgufLM, Sampling
    from flare.models.gguf.testing import TinySpec, write_tiny

    path = write_tiny(tmp_path / "moe.gguf", TinySpec(n_experts=16, top_k=2, qtype="q4_0", n_layers=3, d_ff=256, seed=3))
    out = {}
    # the C step inside the native walk, behind the host node, and the Python step
    for label, native, in_walk in (("walk", True, True), ("host", True, False), ("python", False, False)):
        with GgufLM.load(str(path), max_ctx=64, prefill_chunk=4, experts="offload") as lm:
            st = lm.stager
            st.native, st.in_walk = native, in_walk
            ids = lm.model.tokenizer().chat_ids("Tell me about experts")
            tokens, logits = lm.generate(ids, 6, Sampling(greedy=True), stop_at_eos=False)
            used = [st._native_layers[i] is not None for i in range(st.n_layers)]
            hosts = sum(1 for plan in lm.graph.plans.all() for s in plan.schedule.splits if s.host)
            out[label] = (tokens, np.stack(logits), {n: getattr(st.stats, n) for n in COUNTERS},
                          [st.resident(i) for i in range(st.n_layers)], used, hosts)
    assert out["walk"][4] == out["host"][4] == [True] * 3 and out["python"][4] == [False] * 3
    assert out["walk"][5] == 0 and out["host"][5] > 0 and out["python"][5] > 0
    for other in ("host", "python"):
        assert out["walk"][0] == out[other][0]
        np.testing.assert_array_equal(out["walk"][1], out[other][1])
        assert out["walk"][2] == out[other][2] and out["walk"][3] == out[other][3]
    assert out["walk"][2]["evictions"] > 0


def test_a_cpu_device_without_its_native_executor_keeps_the_python_step():
    from flare.backends.cpu.device import CpuDevice

    dev = CpuDevice("cpu-numpy-test", native=False)
    try:
        src = _source()
        st = _stager(src, 4, True)
        ctx = HostCtx(4, dev)
        slots = st(_node(0), np.array([[3, 4]], np.int32), ctx=ctx)
        assert st._native_layers[0] is None and st.records[-1].staged == (3, 4)
        for expert, slot in zip((3, 4), slots[0].tolist()):
            np.testing.assert_array_equal(ctx.caches["L0.u"][slot], src["L0.u"][expert])
    finally:
        dev.close()


def test_a_new_ctx_keeps_the_records_as_the_python_step_does(cpu_device):
    """A stager called with another ctx (without `invalidate`) keeps what it believes resident on
    both paths alike; `invalidate` forgets it on both."""
    src = _source()
    got = {}
    for native in (True, False):
        st = _stager(src, 4, native)
        st(_node(0), np.array([[3, 4]], np.int32), ctx=HostCtx(4, cpu_device))
        st(_node(0), np.array([[4, 5]], np.int32), ctx=HostCtx(4, cpu_device))
        kept = st.records[-1].staged
        st.invalidate()
        st(_node(0), np.array([[4, 5]], np.int32), ctx=HostCtx(4, cpu_device))
        got[native] = (kept, st.records[-1].staged, st._native_layers[0] is not None)
    assert got[True] == ((5,), (4, 5), True) and got[False] == ((5,), (4, 5), False)


# -- the step inside the CPU command list (no host split) ------------------------------------

def _moe_run(tiny_path, prompt, *, experts="offload", native=True, in_walk=True):
    model = MoeLM.load("tiny", experts=experts, weights_path=tiny_path,
                       **({"cache_mb": 0.8} if experts == "offload" else {}))
    st = model.stager
    if st is not None:
        st.native, st.in_walk = native, in_walk
    return model


def _host_splits(model):
    return sum(1 for plan in model.graph.plans.all() for s in plan.schedule.splits if s.host)


def test_moe_lm_in_walk_staging_equals_host_node_python_and_resident(tiny_path):
    """The staging command inside the native walk, the host node (C step) and the Python step give
    the same tokens as resident experts, and the same slots, counters and cache contents."""
    prompt = encode("Which experts does the router pick, and which ones does the cache keep?")
    runs = {}
    for label, kw in (("walk", {}), ("host", {"in_walk": False}), ("python", {"native": False}),
                      ("resident", {"experts": "resident"})):
        model = _moe_run(tiny_path, prompt, **kw)
        try:
            ids, _ = model.generate(prompt, 16, stop_at_eos=False)
            st = model.stager
            runs[label] = (ids, _host_splits(model), None if st is None else (
                {n: getattr(st.stats, n) for n in COUNTERS}, [st.resident(i) for i in range(2)],
                [np.array(model.graph.state(n)) for i in range(2) for n in st._names[i]]))
        finally:
            model.release()
    assert runs["walk"][0] == runs["host"][0] == runs["python"][0] == runs["resident"][0]
    assert runs["walk"][1] == 0 and runs["host"][1] > 0 and runs["python"][1] > 0
    walk, host, python = runs["walk"][2], runs["host"][2], runs["python"][2]
    assert walk[0] == host[0] == python[0] and walk[0]["evictions"] > 0 and walk[0]["calls"] > 0
    assert walk[1] == host[1] == python[1]
    for a, b, c in zip(walk[2], host[2], python[2]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_in_walk_staging_slots_and_cache_bytes_match_the_host_step(tiny_path):
    """Every slot the in-walk command gives (read back from the staged graph's cache tensors)
    holds its expert's bytes from the source, as the host step's do."""
    prompt = encode("Cache bytes, slot by slot, after a few steps of routing.")
    model = _moe_run(tiny_path, prompt)
    try:
        model.generate(prompt, 8, stop_at_eos=False)
        st = model.stager
        assert _host_splits(model) == 0 and st.stats.calls > 0
        for layer in range(st.n_layers):
            for name, src in zip(st._names[layer], st._sources[layer]):
                _, target = model.graph.row_byte_target(name, src)
                rows = target()
                for expert, slot in st.resident(layer).items():
                    np.testing.assert_array_equal(rows[slot], np.asarray(src[expert]).reshape(-1).view(np.uint8))
    finally:
        model.release()


@pytest.mark.parametrize("in_walk", [True, False])
def test_a_staging_error_inside_the_walk_is_the_stagers_and_leaves_the_graph_usable(tiny_path, in_walk):
    """A step selecting more experts than the cache has slots fails with ExpertCacheError from the
    native walk (as from the host node), changes no staging record, and the graph then gives the
    same tokens as a fresh one."""
    prompt = encode("A long prompt chunk that selects far more experts than the cache holds, surely.")
    fresh = _moe_run(tiny_path, prompt, in_walk=in_walk)
    try:
        want, _ = fresh.generate(prompt, 8, stop_at_eos=False)
    finally:
        fresh.release()
    model = _moe_run(tiny_path, prompt, in_walk=in_walk)
    try:
        st = model.stager
        model.generate(prompt[:6], 2, stop_at_eos=False)
        before = ({n: getattr(st.stats, n) for n in COUNTERS}, [st.resident(i) for i in range(2)])
        model.reset()
        slots, chunk = model.slots, model.prefill_chunk
        model.slots, model.prefill_chunk = 10 ** 6, 32      # past the model's own check: the stager's
        with pytest.raises(ExpertCacheError, match=r"layer 0: a step selects \d+ distinct experts for 32 token"):
            model.prefill(0, prompt[:32])
        assert ({n: getattr(st.stats, n) for n in COUNTERS}, [st.resident(i) for i in range(2)]) == before
        model.slots, model.prefill_chunk = slots, chunk
        assert (_host_splits(model) == 0) == in_walk
        model.reset()
        got, _ = model.generate(prompt, 8, stop_at_eos=False)
        assert got == want
    finally:
        model.release()


def test_a_trace_or_prefetch_keeps_the_host_node(tiny_path):
    """Records (trace) and prefetch are the host path's: such a stager keeps its host split."""
    prompt = encode("traced")
    model = MoeLM.load("tiny", experts="offload", weights_path=tiny_path, cache_mb=0.8, trace=True)
    try:
        model.generate(prompt, 2, stop_at_eos=False)
        assert _host_splits(model) > 0 and model.stager.records
    finally:
        model.release()


def test_a_host_node_left_in_the_split_without_a_command_calls_the_stager(tiny_path, monkeypatch):
    """Where the partitioner left the node in the CPU split but the stager offers no command at
    compile time, the split calls the callback as a step of its own: same tokens, same counters."""
    prompt = encode("No command: the callback runs inside the split.")
    runs = {}
    for label in ("walk", "step"):
        model = _moe_run(tiny_path, prompt)
        try:
            if label == "step":
                monkeypatch.setattr(model.stager, "walk_command", lambda *a, **k: None)
                model.graph.replan()
            ids, _ = model.generate(prompt, 8, stop_at_eos=False)
            split_info = [p.describe() for plan in model.graph.plans.all() for p in plan.programs if p is not None]
            runs[label] = (ids, {n: getattr(model.stager.stats, n) for n in COUNTERS}, _host_splits(model),
                           sum(len(i.get("numpy_nodes", [])) for i in split_info))
        finally:
            model.release()
    assert runs["walk"][0] == runs["step"][0] and runs["walk"][1] == runs["step"][1]
    assert runs["walk"][2] == runs["step"][2] == 0
    assert runs["walk"][3] == 0 and runs["step"][3] > 0
