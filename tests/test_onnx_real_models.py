"""Real models through the ONNX importer: silero-vad from the ONNX file its wheel ships, and
all-MiniLM-L6-v2 from the project's own ONNX export, against onnxruntime and against the
hand-written Flare plugins of the same models."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from flare.models.onnx.loader import load_model  # noqa: E402
from flare.models.onnx.runner import OnnxRunner  # noqa: E402


def _devices(backend):
    return [] if backend.name == "cpu" else ["cpu"]


@pytest.fixture(scope="module")
def silero():
    from flare.models.silero_vad.audio import load_audio
    from flare.models.silero_vad.cli import SAMPLE
    from flare.models.silero_vad.numpy_reference import windows
    from flare.models.silero_vad.weights import onnx_path

    path = str(onnx_path())
    win = windows(load_audio(SAMPLE))
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    state = np.zeros((2, 1, 128), np.float32)
    probs = []
    for w in win:
        p, state = ref.run(None, {"input": w[None], "state": state, "sr": np.array(16000, np.int64)})
        probs.append(float(p[0, 0]))
    return path, win, np.array(probs, np.float32), load_audio(SAMPLE)


def _importer_probs(runner, win):
    state = np.zeros((2, 1, 128), np.float32)
    out = np.empty(len(win), np.float32)
    for i, w in enumerate(win):
        res = runner.run({"input": w[None], "state": state, "sr": np.array(16000, np.int64)})
        out[i], state = res["output"][0, 0], res["stateN"]
    return out


def test_silero_vad_onnx_probabilities_and_segments(backend, silero):
    """Probabilities within 1e-4 of onnxruntime (f32 convolutions and an LSTM over 128 units:
    measured ~1e-7); on the CPU over the whole shipped sample, with the same speech segments
    as the hand-written silero-vad plugin; elsewhere over the first 40 chunks (lavapipe is slow)."""
    from flare.models.silero_vad.runner import SileroVad
    from flare.models.silero_vad.segments import segments

    path, win, want, audio = silero
    if backend.name != "cpu":
        win, want = win[:40], want[:40]
    with backend.session(*_devices(backend)) as sess:
        runner = OnnxRunner(load_model(path), sess)
        got = _importer_probs(runner, win)
        assert runner.stats["prepared"] == 2  # the sample-rate test and the network, prepared once
        runner.release()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
        if backend.name == "cpu":
            with SileroVad(sess) as vad:
                hand = vad.detect(audio)
            assert segments(got, audio.size) == hand
            assert hand  # the sample has speech: the comparison is not vacuous


def test_minilm_onnx_export_equals_the_hand_written_plugin(backend):
    from flare.core.session import Session
    from flare.models.minilm import onnx_export
    from flare.models.minilm.runner import MiniLM
    from flare.models.minilm.tokenize import encode, pad_batch

    sentences = ["The weather is lovely today.", "It's so sunny outside!", "A longer sentence with padding rows."]
    tokens = encode(sentences)
    batch = pad_batch(tokens)
    lengths = np.array([len(t) for t in tokens])
    mask = (np.arange(batch.ids.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
    with backend.session(*_devices(backend)) as sess:
        runner = OnnxRunner(load_model(onnx_export.cached_path()), sess)
        got = runner.run({"input_ids": batch.ids.astype(np.int64), "attention_mask": mask})["embeddings"]
        runner.release()
    with Session(["cpu"]) as sess, MiniLM(sess) as model:
        want = model.embed_tokens(tokens)
    # both f32 over the same weights; unit-length embeddings, 6 layers of 384-wide matmuls
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
