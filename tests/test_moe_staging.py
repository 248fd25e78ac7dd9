"""Expert staging: copies exactly the experts the router chose, merges adjacent ones,
evicts least-recently-used experts never needed by the current step, and rejects
caches and files that cannot work, with the numbers and the tensor named."""
from __future__ import annotations

import json
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from flare.core.errors import ModelError
from flare.models.moe_lm import ExpertCacheError, ExpertStager, MoeLM, SeqChunk, encode, get_config
from flare.models.moe_lm import weights as moe_weights
from flare.plugins.export.serving.batch import pow2_chunks
from flare.models.moe_lm.numpy_reference import forward
from flare.models.moe_lm.staging import slots_for_budget

CFG = get_config("tiny")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return moe_weights.ensure(CFG, 0, tmp_path_factory.mktemp("moe_weights"))


class FakeCtx:
    """Records write_rows calls like a PreparedGraph would receive them."""

    def __init__(self):
        self.writes = []

    def write_rows(self, name, row, array):
        self.writes.append((name, row, array.shape[0]))


def _stager(slots=4):
    source = {moe_weights.expert_name(i, p): np.arange(CFG.n_experts, dtype=np.float32)[:, None, None]
              * np.ones((1, 2, 2), np.float32) for i in range(CFG.n_layers) for p in moe_weights.EXPERT_PARTS}
    return ExpertStager(CFG, source, slots, trace=True)


def _node(layer=0):
    return SimpleNamespace(params={"args": {"layer": layer}})


def test_adjacent_experts_are_merged_into_one_copy():
    st, ctx = _stager(slots=4), FakeCtx()
    slots = st(_node(), np.array([[3, 4], [5, 9]], np.int32), ctx=ctx)
    rec = st.records[-1]
    assert rec.staged == (3, 4, 5, 9)
    assert rec.runs == ((3, 0, 3), (9, 3, 1))          # experts 3..5 -> slots 0..2 in one copy
    assert st.stats.copies == 2 and len(ctx.writes) == 2 * 3  # one write per tensor (gate, up, down) per copy
    assert ("L0.experts.gate", 0, 3) in ctx.writes
    resident = st.resident(0)
    assert [[resident[e] for e in row] for row in [[3, 4], [5, 9]]] == slots.tolist()


def test_lru_eviction_never_evicts_what_the_step_needs():
    st, ctx = _stager(slots=4), FakeCtx()
    st(_node(), np.array([[0, 1], [2, 3]], np.int32), ctx=ctx)   # fills all slots
    st(_node(), np.array([[0, 1]], np.int32), ctx=ctx)           # 0, 1 most recent
    st(_node(), np.array([[1, 7], [8, 0]], np.int32), ctx=ctx)   # evicts 2 and 3 (LRU), never 0/1
    rec = st.records[-1]
    assert rec.staged == (7, 8) and set(rec.evicted) == {2, 3}
    assert set(st.resident(0)) == {0, 1, 7, 8}
    assert st.stats.hits == 2 + 2 and st.stats.experts_staged == 4 + 2
    with pytest.raises(ExpertCacheError, match="5 distinct experts.*4 slot"):
        st(_node(), np.array([[0, 1], [2, 3], [4, 4]], np.int32), ctx=ctx)


def test_padding_tokens_stage_nothing():
    st, ctx = _stager(slots=4), FakeCtx()
    rows = np.array([0, CFG.scratch_row], np.int32)
    st(_node(), np.array([[5, 6], [11, 12]], np.int32), rows, ctx=ctx)
    assert st.records[-1].staged == (5, 6)


def test_staging_copies_only_the_routers_choices(tiny_path):
    """Every staging call copies exactly (router's choices for the step) - (already resident)."""
    model = MoeLM.load("tiny", experts="offload", weights_path=tiny_path, trace=True)
    try:
        prompt = encode("Which experts does the router pick?")
        ids, _ = model.generate(prompt, 12, stop_at_eos=False)
        _, routes = forward(CFG, model.weight_file.as_dict(), prompt + ids)
        # token ranges of each step: prefill chunks, then one token per decode step
        steps, at = [], 0
        for size in pow2_chunks(len(prompt), model.prefill_chunk):
            steps.append(range(at, at + size))
            at += size
        steps += [range(len(prompt) + j, len(prompt) + j + 1) for j in range(len(ids) - 1)]
        records = model.stager.records
        assert len(records) == len(steps) * CFG.n_layers
        resident = [set() for _ in range(CFG.n_layers)]
        copies = 0
        for n, rec in enumerate(records):
            step, layer = steps[n // CFG.n_layers], n % CFG.n_layers
            chosen = set(routes[layer][list(step)].ravel().tolist())
            assert set(rec.selected) == chosen, f"step {n // CFG.n_layers} layer {layer}"
            assert set(rec.staged) == chosen - resident[layer]
            assert sum(count for _, _, count in rec.runs) == len(rec.staged)
            resident[layer] = (resident[layer] - set(rec.evicted)) | set(rec.staged)
            assert len(resident[layer]) <= model.slots
            copies += len(rec.runs)
        st = model.stager.stats
        # caches in host memory: one write per tensor for all of a staging call's runs
        assert st.copies == copies and st.writes == 3 * sum(1 for rec in records if rec.runs)
        assert st.bytes_staged == st.experts_staged * CFG.expert_bytes
        print(f"\nstaging: {st.calls} calls, {st.selected} experts selected, {st.experts_staged} staged in "
              f"{st.copies} copies, hit rate {st.hit_rate:.2f}")
    finally:
        model.release()


def test_reset_keeps_expert_cache_and_outputs(tiny_path):
    model = MoeLM.load("tiny", experts="offload", weights_path=tiny_path)
    try:
        first = model.generate(encode("reset"), 5)
        cache = model.graph.state("L0.experts.gate")
        assert np.abs(model.graph.state("L0.k_cache")).sum() > 0
        model.reset()
        assert np.array_equal(model.graph.state("L0.experts.gate"), cache)  # role cache: kept
        assert not model.graph.state("L0.k_cache").any()                    # role state: zeroed
        for expert, slot in model.stager.resident(0).items():               # and it holds what staging thinks
            assert np.array_equal(cache[slot], model.weight_file.tensor("L0.experts.gate")[expert])
        again = model.generate(encode("reset"), 5)
        assert first[0] == again[0] and all(np.array_equal(a, b) for a, b in zip(first[1], again[1]))
    finally:
        model.release()


def test_cache_too_small_is_rejected_at_prepare_with_numbers(tiny_path):
    with pytest.raises(ExpertCacheError) as err:
        MoeLM.load("tiny", experts="offload", cache_mb=0.2, weights_path=tiny_path)
    msg = str(err.value)
    assert "holds 2 expert(s) per layer" in msg and "need 8 experts" in msg and "0.75 MiB" in msg
    # a smaller prefill chunk needs fewer slots: the same budget then works for one sequence
    assert slots_for_budget(CFG.replace(max_seqs=1), 0.2, 1) == 2
    model = MoeLM.load("tiny", experts="offload", cache_mb=0.75, weights_path=tiny_path)
    try:
        assert model.slots == 8
        with pytest.raises(ExpertCacheError, match="8 slot"):
            model.step([SeqChunk(0, 0, encode("too many tokens")[:5])])  # 5 tokens x top-2 > 8 slots
    finally:
        model.release()


def _rewrite(path, out, edit_header=None, truncate=0):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8: 8 + n])
    if edit_header:
        edit_header(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data = struct.pack("<Q", len(text)) + text + raw[8 + n:]
    out.write_bytes(data[: len(data) - truncate] if truncate else data)
    return out


def test_bad_weight_files_are_model_errors_naming_the_tensor(tiny_path, tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        MoeLM.load("tiny", experts="offload", weights_path=tmp_path / "nope.safetensors")
    bad = _rewrite(tiny_path, tmp_path / "trunc.safetensors", truncate=1000)
    with open(tiny_path, "rb") as fh:
        header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    with pytest.raises(ModelError, match=rf"'{last}' ends at byte \d+ but .*truncated"):
        MoeLM.load("tiny", experts="offload", weights_path=bad)

    def shape(h):
        h["L0.experts.up"]["shape"] = [CFG.n_experts, CFG.d_ff * 2, CFG.d_model // 2]
    with pytest.raises(ModelError, match=r"'L0\.experts\.up'.*shape"):
        MoeLM.load("tiny", weights_path=_rewrite(tiny_path, tmp_path / "shape.safetensors", shape))

    def dtype(h):
        h["L1.experts.gate"]["dtype"] = "F16"
    with pytest.raises(ModelError, match=r"'L1\.experts\.gate'.*dtype F16"):
        MoeLM.load("tiny", weights_path=_rewrite(tiny_path, tmp_path / "dtype.safetensors", dtype))

    def missing(h):
        del h["L0.router"]
    with pytest.raises(ModelError, match=r"'L0\.router' is missing"):
        MoeLM.load("tiny", weights_path=_rewrite(tiny_path, tmp_path / "missing.safetensors", missing))
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ModelError, match="too short"):
        MoeLM.load("tiny", weights_path=tmp_path / "short.safetensors")


def test_weights_are_deterministic(tmp_path):
    a = dict(moe_weights.generate(CFG, 3))
    b = dict(moe_weights.generate(CFG, 3))
    c = dict(moe_weights.generate(CFG, 4))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["L0.experts.gate"], c["L0.experts.gate"])
    path = moe_weights.write(CFG, tmp_path / "w.safetensors", 3)
    wf = moe_weights.WeightFile(path, CFG)
    assert all(np.array_equal(wf.tensor(k), a[k]) for k in a)
    wf.close()


def test_prefetch_changes_timing_not_outputs(tiny_path):
    plain = MoeLM.load("tiny", experts="offload", weights_path=tiny_path)
    ahead = MoeLM.load("tiny", experts="offload", weights_path=tiny_path, prefetch=2, trace=True)
    ahead.stager.take_back = False   # wait for every guess: the counts below then do not depend on timing
    try:
        for prompt in ("prefetch the next layer", "b"):
            a = plain.generate(encode(prompt), 8, stop_at_eos=False)
            b = ahead.generate(encode(prompt), 8, stop_at_eos=False)
            assert a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))
        st = ahead.stager.stats
        assert st.prefetched > 0 and 0 < st.prefetch_hits <= st.prefetched
        assert all(r.prefetched == () for r in ahead.stager.records if r.layer == CFG.n_layers - 1)
    finally:
        plain.release()
        ahead.release()
    assert ahead.stager._helper is None  # the prefetch thread is gone with the model


def test_prefetch_refuses_device_caches(tiny_path):
    from flare.core.errors import BackendUnavailable
    from flare.core.session import Session

    try:
        session = Session(["vulkan", "cpu"])
    except BackendUnavailable as exc:
        pytest.skip(f"vulkan not usable here: {exc}")
    try:
        with pytest.raises(ModelError, match="prefetch needs the expert caches on a CPU device"):
            MoeLM.load("tiny", experts="offload", weights_path=tiny_path, session=session, prefetch=2)
        model = MoeLM.load("tiny", experts="offload", weights_path=tiny_path, session=session, prefetch=2,
                           expert_device="cpu")  # experts on the host device: allowed
        model.generate(encode("x"), 2)
        model.release()
    finally:
        session.close()
