"""minilm-l6: the sentence-transformers quickstart similarity table, batching, padding, memory, placement."""
from __future__ import annotations

import json

import numpy as np
import pytest

from flare.core.ledger import LEDGER
from flare.models.minilm import numpy_reference as R
from flare.models.minilm.runner import MiniLM, split_placement
from flare.models.minilm.tokenize import encode, pad_batch
from flare.models.minilm.weights import all_weights, load_config
from flare.core.session import Session

QUICKSTART = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
EXPECTED = np.array([[1.0, 0.6660, 0.1046], [0.6660, 1.0, 0.1411], [0.1046, 0.1411, 1.0]])
LONG = ("Flare runs model compute graphs on several kinds of hardware through plugins, and its core "
        "owns the lifecycle of a graph: prepare, execute, reset and release, on CPU, Vulkan and CUDA.")


@pytest.fixture
def devices(backend) -> list[str]:
    """Devices to run on: one per backend of the suite's matrix (`--backends=...`)."""
    return [backend.name]


@pytest.fixture
def model(devices):
    with Session(devices) as session, MiniLM(session) as m:
        yield m


def test_quickstart_similarity_table(model):
    emb = model.embed(QUICKSTART)
    sim = emb @ emb.T
    np.testing.assert_allclose(sim, EXPECTED, atol=5e-5)          # equal to 4 decimals
    np.testing.assert_array_equal(np.round(sim.astype(np.float64), 4), EXPECTED)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-6)


def test_graph_equals_numpy_reference_with_padding(model):
    sentences = [QUICKSTART[1], LONG, "Hi"]   # three lengths: padding matters for two of them
    tokens = encode(sentences)
    batch = pad_batch(tokens)
    want = R.encode(all_weights(), batch.ids, batch.lengths, load_config())
    np.testing.assert_allclose(model.embed(sentences), want, atol=2e-5)


def test_batched_equals_one_at_a_time(model):
    sentences = QUICKSTART
    batched = model.embed(sentences)
    single = np.concatenate([model.embed([s]) for s in sentences])
    np.testing.assert_allclose(batched, single, atol=1e-5)


def test_padding_is_masked(model):
    tokens = encode(["It's so sunny outside!"])
    results = []
    for length in (len(tokens[0]), 32, 64):
        b = pad_batch(tokens, length)
        results.append(model.pg.execute("embed", ids=b.ids, mask=b.mask)["embeddings"][0])
    np.testing.assert_allclose(results[1], results[0], atol=1e-5)
    np.testing.assert_allclose(results[2], results[0], atol=1e-5)


def test_tokenizer_truncates_at_max_seq_length_and_adds_special_tokens():
    (ids,) = encode(["word " * 400])
    assert len(ids) == 256 and ids[0] == 101 and ids[-1] == 102
    assert encode(["Hello"])[0] == [101, 7592, 102]


def test_workspace_reused_no_ledger_growth(devices):
    base = LEDGER.live_bytes()
    with Session(devices) as session:
        ws = session.workspace()
        m = MiniLM(session, workspace=ws, max_batch=2)
        long_batch = [LONG] * 2
        m.embed(long_batch)
        m.embed(QUICKSTART)
        m.embed(["short"])   # every shape once: a plan may own device resources of its own
        peak = LEDGER.live_bytes()
        for _ in range(2):  # repeated requests, short after long
            sim = m.similarity(QUICKSTART)
            m.embed(long_batch)
            m.embed(["short"])
            assert LEDGER.live_bytes() == peak
        np.testing.assert_allclose(sim, EXPECTED, atol=5e-5)
        m.release()
    assert LEDGER.live_bytes() == base


def test_both_models_share_one_workspace(devices):
    from flare.models.silero_vad.runner import SileroVad

    base = LEDGER.live_bytes()
    audio = (0.1 * np.sin(np.arange(16000) * 0.05)).astype(np.float32)
    with Session(devices) as session:
        ws = session.workspace()
        with MiniLM(session, workspace=ws) as m, SileroVad(session, workspace=ws, max_batch=32) as vad:
            m.embed(QUICKSTART)
            vad.probs_offline(audio)
            peak = LEDGER.live_bytes()
            for _ in range(2):
                m.embed(QUICKSTART)
                vad.probs_offline(audio)
                vad.probs_streaming(audio[:2048])
                assert LEDGER.live_bytes() == peak
    assert LEDGER.live_bytes() == base


def test_encoder_and_head_on_two_devices_equal_one_device():
    with Session(["cpu"]) as one, MiniLM(one) as single:
        want = single.embed(QUICKSTART + [LONG])
    with Session(["cpu:0", "cpu:1"]) as two, MiniLM(two, placement=split_placement) as split:
        got = split.embed(QUICKSTART + [LONG])
        sched = split.pg.current_plan("embed").schedule
    assert [s.device for s in sched.splits] == ["cpu:0", "cpu:1"]
    assert all(n.name.startswith("head/") for n in sched.splits[1].nodes)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_plugin_registered_and_cli(capsys):
    from flare.core.plugin_manager import PluginManager

    spec = PluginManager().models()["minilm-l6"]
    assert set(spec.graph({}).entries) == {"embed", "embed_packed"}
    with Session(["cpu"]) as session:
        batch = pad_batch(encode(QUICKSTART))
        emb = session.prepare_model("minilm-l6").execute("embed", ids=batch.ids, mask=batch.mask)["embeddings"]
        np.testing.assert_allclose(emb @ emb.T, EXPECTED, atol=5e-5)
    assert spec.run(["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sentences"] == QUICKSTART and out["dim"] == 384
    np.testing.assert_allclose(out["similarity"], EXPECTED, atol=5e-5)
    assert spec.run(["Hello there", "General Kenobi"]) == 0
    assert "Cosine similarity" in capsys.readouterr().out


def test_text_that_is_not_utf8_is_refused_not_replaced():
    """The decision (docs/design.md, "Input boundaries"): invalid bytes are an InputError
    naming the sentence and byte, from bytes and from surrogate-escaped command-line text."""
    from flare.core.errors import InputError
    from flare.models.minilm.tokenize import check_text

    assert check_text(["ok", b"caf\xc3\xa9"]) == ["ok", "café"]
    with pytest.raises(InputError, match=r"sentence 2: not UTF-8 \(byte 0xe9 at offset 3\)"):
        check_text(["ok", b"caf\xe9"])
    with pytest.raises(InputError, match=r"sentence 1: not UTF-8 \(byte 0xff at character 1\)"):
        check_text([b"x\xff".decode("utf-8", "surrogateescape")])


def test_token_layout():
    from flare.models.minilm.runner import token_layout

    tokens, spread = token_layout((3, 1, 2), 4, 4)
    assert tokens.tolist() == [0, 1, 2, 4, 8, 9, 0, 0]          # rounded up to 8 with fillers at 0
    assert spread.tolist() == [[0, 1, 2, 0], [3, 0, 0, 0], [4, 5, 0, 0]]
    assert len(token_layout((4, 4), 4, 16)[0]) == 8             # never more than the padded layout


def test_token_packed_entry_equals_padded(devices):
    """embed_packed (dense layers on real tokens only) gives the padded entry's embeddings."""
    from flare.models.minilm.runner import token_layout

    batch = pad_batch(encode([LONG, "short", QUICKSTART[0]]), 48)
    tokens, spread = token_layout(batch.lengths, 48, 16)
    with Session(devices) as session, MiniLM(session) as m:
        padded = m.pg.execute("embed", ids=batch.ids, mask=batch.mask)["embeddings"].copy()
        packed = m.pg.execute("embed_packed", ids=batch.ids, mask=batch.mask, tokens=tokens,
                              spread=spread)["embeddings"]
    np.testing.assert_allclose(packed, padded, atol=2e-6)
