"""moe-lm end to end: resident vs offload are bitwise identical on the CPU, the graph
matches an independent NumPy forward, mixed batches, Vulkan within tolerance, CLI."""
from __future__ import annotations

import io

import numpy as np
import pytest

from flare.core.errors import ModelError
from flare.models.moe_lm import MoeLM, Sampling, SeqChunk, encode, get_config, make_inputs
from flare.models.moe_lm import weights as moe_weights
from flare.models.moe_lm.numpy_reference import forward

PROMPTS = ["Hello, world", "a", "Mixture of experts route tokens to a few experts each.", "xyz 123"]
SAMPLINGS = [Sampling(greedy=True), Sampling(greedy=False, seed=1), Sampling(greedy=False, seed=7, top_k=20),
             Sampling(greedy=False, seed=3, temperature=0.7, top_p=0.9)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return moe_weights.ensure(get_config("tiny"), 0, tmp_path_factory.mktemp("moe_weights"))


@pytest.fixture(scope="module")
def resident(tiny_path):
    m = MoeLM.load("tiny", weights_path=tiny_path)
    yield m
    m.release()


@pytest.fixture(scope="module")
def offload(tiny_path):
    m = MoeLM.load("tiny", experts="offload", weights_path=tiny_path)
    yield m
    m.release()


def _run(model, prompt, sampling, n=10):
    ids, logits = model.generate(encode(prompt), n, sampling, stop_at_eos=False)
    return ids, np.stack(logits)


def _same(a, b):
    assert a[0] == b[0]
    assert a[1].dtype == np.float32 and np.array_equal(a[1], b[1])  # bitwise, not approximately


def test_resident_and_offload_bitwise_equal_over_prompts_and_seeds(resident, offload):
    assert offload.slots < offload.cfg.n_experts  # the cache really is smaller: experts get evicted
    for prompt in PROMPTS:
        for sampling in SAMPLINGS:
            _same(_run(resident, prompt, sampling), _run(offload, prompt, sampling))
    assert offload.stager.stats.evictions > 0


def test_repeated_requests_and_short_after_long_are_identical(resident, offload, tiny_path):
    long_prompt = "A long request fills many KV rows and evicts many experts of both layers."
    short = "hi"
    for model in (resident, offload):
        first = _run(model, short, Sampling(greedy=False, seed=5))
        again = _run(model, short, Sampling(greedy=False, seed=5))
        _same(first, again)
        _run(model, long_prompt, Sampling(), n=20)
        _same(first, _run(model, short, Sampling(greedy=False, seed=5)))  # no reset in between
    fresh = MoeLM.load("tiny", experts="offload", weights_path=tiny_path, expert_source="host")
    try:
        _same(_run(fresh, short, Sampling(greedy=False, seed=5)), _run(resident, short, Sampling(greedy=False, seed=5)))
    finally:
        fresh.release()


def test_matches_numpy_reference(resident, offload):
    weights = resident.weight_file.as_dict()
    for prompt in PROMPTS[:3]:
        p = encode(prompt)
        for model in (resident, offload):
            ids, logits = model.generate(p, 8, Sampling(), stop_at_eos=False)
            ref, _ = forward(model.cfg, weights, p + ids)
            want = ref[len(p) - 1: len(p) - 1 + len(ids)]
            np.testing.assert_allclose(np.stack(logits), want, rtol=0, atol=1e-4)


def test_mixed_batch_prefill_and_decode_in_one_step(resident, offload):
    """One step carries a prefill chunk of sequence 0 and decode tokens of sequences 1 and 2."""
    cfg = resident.cfg
    weights = resident.weight_file.as_dict()
    a, b, c = encode("mixed prefill"), encode("abc"), encode("xy")
    results = []
    for model in (resident, offload):
        model.prefill(0, a[:5])
        model.prefill(1, b)
        model.prefill(2, c)
        out = model.step([SeqChunk(0, 5, a[5:7]), SeqChunk(1, len(b), [66]), SeqChunk(2, len(c), [67])])
        assert out.shape == (3, cfg.vocab)
        assert model.graph.current_plan("mixed").shapes["tokens"] == (4,)
        results.append(out)
        for row, seq in zip(out, (a[:7], b + [66], c + [67])):
            np.testing.assert_allclose(row, forward(cfg, weights, seq)[0][-1], atol=1e-4)
        # a padded step (a captured shape) gives the same logits within float error
        model.prefill(3, a[:5])
        padded = model.step([SeqChunk(3, 5, a[5:7])], pad_to=4)
        np.testing.assert_allclose(padded[0], out[0], atol=1e-5)
        # decode tokens padded to a captured batch of 4 (the decode entry outputs every row)
        dec = model.step([SeqChunk(1, len(b) + 1, [70]), SeqChunk(2, len(c) + 1, [71])], pad_to=4, entry="decode")
        assert dec.shape == (2, cfg.vocab)
        np.testing.assert_allclose(dec[1], forward(cfg, weights, c + [67, 71])[0][-1], atol=1e-4)
    assert np.array_equal(results[0], results[1])


def test_entries_share_one_allocation_and_kv_state(resident):
    g = resident.graph
    assert set(g._current) >= {"prefill", "decode"}
    names = set(g.states())
    assert {f"L{i}.k_cache" for i in range(resident.cfg.n_layers)} <= names
    before = g.persistent_bytes()
    resident.generate(encode("share"), 3)
    assert g.persistent_bytes() == before


def test_context_overflow_and_bad_tokens_are_model_errors(resident):
    with pytest.raises(ModelError, match="context"):
        resident.generate([1] * resident.cfg.max_ctx, 4)
    with pytest.raises(ModelError, match="vocabulary"):
        resident.step([SeqChunk(0, 0, [9999])])
    with pytest.raises(ModelError, match="sequence slot"):
        resident.step([SeqChunk(resident.cfg.max_seqs, 0, [1])])


def test_vulkan_matches_cpu_within_tolerance(tiny_path, resident):
    from flare.core.errors import BackendUnavailable
    from flare.core.session import Session

    try:
        session = Session(["vulkan", "cpu"])
    except BackendUnavailable as exc:
        pytest.skip(f"vulkan not usable here: {exc}")
    tol = 1e-4  # f32 kernels with different summation order than NumPy/OpenBLAS
    try:
        cpu = _run(resident, PROMPTS[0], Sampling(), n=6)
        got = {}
        for mode in ("resident", "offload"):
            model = MoeLM.load("tiny", experts=mode, weights_path=tiny_path, session=session)
            try:
                got[mode] = _run(model, PROMPTS[0], Sampling(), n=6)
            finally:
                model.release()
            assert got[mode][0] == cpu[0]
            np.testing.assert_allclose(got[mode][1], cpu[1], rtol=0, atol=tol)
        np.testing.assert_allclose(got["offload"][1], got["resident"][1], rtol=0, atol=tol)
    finally:
        session.close()


def test_cli_streams_tokens(monkeypatch, tmp_path):
    from flare.models.moe_lm.cli import run

    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))  # weights are generated there
    out, err = io.StringIO(), io.StringIO()
    chunks = []

    class Stream(io.StringIO):
        def write(self, s):
            chunks.append(s)
            return super().write(s)

    stream = Stream()
    rc = run(["--prompt", "Hi", "--max-new-tokens", "6", "--greedy", "--experts", "offload", "--stats"],
             stdout=stream, stderr=err)
    assert rc == 0, err.getvalue()
    assert len(chunks) >= 2 and '"experts": "offload"' in err.getvalue()
    rc = run(["--prompt", "Hi", "--experts", "offload", "--expert-cache-mb", "0.05"], stdout=out, stderr=err)
    assert rc == 2 and "ExpertCacheError" in err.getvalue() and "MiB" in err.getvalue()  # an option too small


def test_plugin_registers_model_spec(monkeypatch, tmp_path):
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    from flare.models.moe_lm import plugin
    from flare.core.plugin_manager import PluginManager

    pm = PluginManager(autoload=False, groups=("flare.backends",))
    pm.register(plugin, name="moe-test")
    spec = pm.models()["moe-lm"]
    assert set(spec.graph({}).entries) == {"prefill", "decode", "mixed"}
    assert spec.run is not None and spec.stage_experts is not None and spec.placement is not None
    from flare.models.moe_lm import MoeLM
    from flare.core.session import Session

    with Session(["cpu"], plugins=pm) as session:  # the runtime binds the registered staging callback
        model = MoeLM.load("tiny", experts="offload", session=session)
        # the staging step runs as a command of the CPU split (no host split) ...
        assert model.graph.describe()["entries"]["decode"]["host_splits"] == 0
        model.stager.in_walk = False        # ... or behind its host node, one per layer
        assert model.graph.describe()["entries"]["decode"]["host_splits"] == get_config("tiny").n_layers
        assert model.stager is not None and model.graph.callbacks["stage_experts"] is model.stager
        model.release()


def test_reference_evaluator_runs_the_offload_graph_with_the_stager(offload):
    """flare.core.reference.evaluate serves the host node with the same callback (its ctx offers write_rows)."""
    from flare.core.graph import GraphBuilder
    from flare.models.moe_lm.graph import STAGE_CALLBACK, GraphSpec, build_step, input_shapes
    from flare.core.reference import evaluate

    cfg = offload.cfg
    stager = type(offload.stager)(cfg, offload.stager.source, offload.slots, trace=True)
    spec = GraphSpec(cfg, offload.weight_file.as_dict(), "offload", offload.slots)
    prompt = encode("ref eval")[:4]
    b = GraphBuilder()
    build_step(b, spec, input_shapes(cfg, len(prompt), 1))
    graph = b.build()
    inputs = make_inputs(cfg, [SeqChunk(0, 0, prompt)])
    out, state = evaluate(graph, inputs, callbacks={STAGE_CALLBACK: stager})
    ref, routes = forward(cfg, offload.weight_file.as_dict(), prompt)
    np.testing.assert_allclose(out["logits"][0], ref[-1], atol=1e-4)
    for rec in stager.records:
        assert set(rec.staged) == set(routes[rec.layer].ravel().tolist())
        for expert in rec.staged:
            slot = stager.resident(rec.layer)[expert]
            assert np.array_equal(state[f"L{rec.layer}.experts.up"][slot],
                                  offload.weight_file.tensor(f"L{rec.layer}.experts.up")[expert])


def test_sampler_is_seeded_and_respects_filters():
    from flare.models.moe_lm.config import BOS, PAD, SEP
    from flare.models.moe_lm.sampling import Sampler

    rng = np.random.default_rng(0)
    logits = rng.standard_normal(260).astype(np.float32)
    logits[[BOS, PAD, SEP]] = 100.0  # never generated, however likely
    allowed = np.where(np.isin(np.arange(260), [BOS, PAD, SEP]), -np.inf, logits)
    assert Sampler(Sampling())(logits) == int(np.argmax(allowed))
    assert len({Sampler(Sampling(greedy=False, seed=4))(logits) for _ in range(3)}) == 1  # same seed, same token
    s = Sampler(Sampling(greedy=False, seed=4, top_k=3))
    picks = [s(logits) for _ in range(200)]
    assert set(picks) == set(np.argsort(-allowed)[:3].tolist())
