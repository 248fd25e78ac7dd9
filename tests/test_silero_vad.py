"""silero-vad: Flare's graph against onnxruntime on the wheel's own ONNX file.

Probabilities must equal onnxruntime's per chunk (same 512-sample chunking
with 64 samples of context, as silero's OnnxWrapper does) within 1e-4, on the
shipped sample and on synthetic audio; streaming must equal offline; segments
must equal silero's own segmentation code run on onnxruntime's probabilities.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import typing

import numpy as np
import pytest

from flare.models.silero_vad.audio import load_audio
from flare.core.errors import ModelError
from flare.core.ledger import LEDGER
from flare.core.ops import OPS
from flare.models.silero_vad import numpy_reference as R
from flare.models.silero_vad import weights as W
from flare.models.silero_vad.cli import SAMPLE
from flare.models.silero_vad.runner import SileroVad, split_placement
from flare.models.silero_vad.segments import VadParams, segments, speech_timestamps
from flare.core.session import Session

ort = pytest.importorskip("onnxruntime")
TOL = 1e-4


@pytest.fixture
def devices(backend) -> list[str]:
    """Devices to run on: one per backend of the suite's matrix (`--backends=...`)."""
    return [backend.name]


@pytest.fixture
def vad(devices):
    with Session(devices) as session, SileroVad(session, max_batch=256) as model:
        yield model


# -- references -------------------------------------------------------------------
def ort_probs(audio: np.ndarray) -> np.ndarray:
    """Silero's OnnxWrapper loop, written out: zero-padded 512-sample chunks, each
    prefixed by the previous input's last 64 samples, state carried."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(W.onnx_path()), sess_options=opts, providers=["CPUExecutionProvider"])
    state = np.zeros((2, 1, 128), np.float32)
    context = np.zeros((1, 64), np.float32)
    sr = np.array(16000, dtype=np.int64)
    out = []
    for lo in range(0, len(audio), 512):
        chunk = np.zeros((1, 512), np.float32)
        part = audio[lo:lo + 512]
        chunk[0, :len(part)] = part
        x = np.concatenate([context, chunk], axis=1)
        prob, state = sess.run(None, {"input": x, "state": state, "sr": sr})
        out.append(prob[0, 0])
        context = x[:, -64:]
    return np.array(out, np.float32)


def silero_segmenter():
    """silero's own get_speech_timestamps_from_probs, compiled from its source file
    (the module imports torch, so it cannot be imported; this function needs none)."""
    src = (W.package_dir("silero_vad") / "utils_vad.py").read_text()
    fn = next(n for n in ast.parse(src).body
              if isinstance(n, ast.FunctionDef) and n.name == "get_speech_timestamps_from_probs")
    ns = {"List": typing.List, "Callable": typing.Callable, "make_visualization": lambda *a: None}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "silero_vad/utils_vad.py", "exec"), ns)
    return ns["get_speech_timestamps_from_probs"]


def synthetic_audio(seconds: float = 4.3, seed: int = 0) -> np.ndarray:
    """Tones, a chirp, noise bursts and silence; length not a multiple of 512."""
    rng = np.random.default_rng(seed)
    n = int(16000 * seconds)
    t = np.arange(n) / 16000
    x = 0.01 * rng.standard_normal(n)
    x += 0.4 * np.sin(2 * np.pi * (150 + 400 * t) * t) * (t > 0.5) * (t < 1.8)     # chirp
    voiced = np.sign(np.sin(2 * np.pi * 120 * t)) * np.exp(-((t - 2.6) / 0.4) ** 2)  # buzz-like source
    x += 0.3 * voiced + 0.2 * rng.standard_normal(n) * ((t > 3.4) & (t < 3.9))
    return np.clip(x, -1, 1).astype(np.float32)


@pytest.fixture(scope="module")
def sample() -> np.ndarray:
    return load_audio(SAMPLE)


@pytest.fixture(scope="module")
def sample_ort(sample) -> np.ndarray:
    return ort_probs(sample)


# -- weights ------------------------------------------------------------------------
def test_weights_converted_once_into_cache_keyed_by_onnx_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    first = W.load_weights()
    files = list((tmp_path / "silero-vad").glob("silero_vad-16k-*.safetensors"))
    assert [f.name for f in files] == [f"silero_vad-16k-{W.file_sha256(W.onnx_path())[:16]}.safetensors"]
    monkeypatch.setattr(W, "extract_from_onnx", lambda path: pytest.fail("cache was not used"))
    second = W.load_weights()
    assert set(first) == set(second) == set(W.WEIGHT_NAMES)
    for k in first:
        np.testing.assert_array_equal(first[k], second[k])


def test_torn_cache_file_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    W.load_weights()
    (cached,) = (tmp_path / "silero-vad").glob("*.safetensors")
    cached.write_bytes(b"not a safetensors file")
    assert W.load_weights()["lstm.w_ih"].shape == (512, 128)


def test_weights_read_without_importing_onnx_equal_onnx_numpy_helper():
    """The converter parses the file with onnx's generated schema only (importing onnx costs a
    cold start ~0.75 s); what it reads equals onnx's own numpy_helper, bit for bit."""
    code = ("import sys; from flare.models.silero_vad import weights as W; "
            "w = W.extract_from_onnx(W.onnx_path()); "
            "assert sorted(w) == sorted(W.WEIGHT_NAMES), sorted(w); "
            "assert 'onnx' not in sys.modules, 'onnx was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    onnx = pytest.importorskip("onnx")
    from onnx import numpy_helper

    ours = W.extract_from_onnx(W.onnx_path())
    (branch,) = [a.g for n in onnx.load(str(W.onnx_path())).graph.node if n.op_type == "If"
                 for a in n.attribute if a.name == "then_branch"]
    theirs = {name: numpy_helper.to_array(n.attribute[0].t) for n in branch.node if n.op_type == "Constant"
              for suffix, name in W._NAMES.items() if n.output[0].endswith("__" + suffix)}
    assert set(theirs) == set(ours)
    for name, value in theirs.items():
        assert ours[name].dtype == np.float32 and ours[name].flags.c_contiguous
        np.testing.assert_array_equal(ours[name], value)


def test_a_file_that_is_not_the_silero_onnx_is_a_model_error(tmp_path):
    bad = tmp_path / "silero_vad.onnx"
    bad.write_bytes(b"\x08\x07 this is not a silero model")
    with pytest.raises(ModelError):
        W.extract_from_onnx(bad)


def test_numpy_reference_matches_onnxruntime():
    audio = synthetic_audio(2.0, seed=3)
    np.testing.assert_allclose(R.speech_probs(W.load_weights(), audio), ort_probs(audio), atol=TOL)


# -- Flare against onnxruntime ----------------------------------------------------------
def test_offline_matches_onnxruntime_on_the_sample_and_segments_equal_silero(vad, sample, sample_ort):
    probs = vad.probs_offline(sample)
    assert probs.shape == sample_ort.shape
    np.testing.assert_allclose(probs, sample_ort, atol=TOL)
    assert (sample_ort > 0.5).any() and (sample_ort < 0.1).any()  # the sample has speech and silence
    # segments: ours on Flare's probabilities == silero's code on onnxruntime's
    ours = segments(probs, sample.size)
    theirs = silero_segmenter()(sample_ort.tolist(), audio_length_samples=sample.size)
    assert [(s.start_sample, s.end_sample) for s in ours] == [(t["start"], t["end"]) for t in theirs]
    assert 3 <= len(ours) <= 8  # three phrases, split at the longer pauses inside them
    for s in ours:
        assert 0.5 < s.probability <= 1.0 and s.start == round(s.start_sample / 16000, 3)


def test_offline_matches_onnxruntime_on_synthetic_audio(vad):
    audio = synthetic_audio(4.3, seed=0)
    np.testing.assert_allclose(vad.probs_offline(audio), ort_probs(audio), atol=TOL)


@pytest.mark.parametrize("seed, seconds", [(1, 1.0), (2, 0.01)])
def test_offline_and_streaming_match_onnxruntime_on_short_synthetic_audio(vad, seed, seconds):
    audio = synthetic_audio(seconds, seed)
    want = ort_probs(audio)
    np.testing.assert_allclose(vad.probs_offline(audio), want, atol=TOL)
    np.testing.assert_allclose(vad.probs_streaming(audio), want, atol=TOL)


@pytest.mark.parametrize("mode", ["offline", "streaming"])
def test_one_mode_prepared_up_front_the_other_at_first_use(devices, vad, mode):
    """`modes=(...)` (what `flare run --mode` passes) prepares only that entry point; the other
    is prepared at its first execute and gives what a fully prepared model gives, bit for bit."""
    audio = synthetic_audio(1.5, 3)
    with Session(devices) as session, SileroVad(session, max_batch=256, modes=(mode,)) as lazy:
        first = "offline" if mode == "offline" else "stream"
        assert set(lazy.pg.plans.current) == {first}
        np.testing.assert_array_equal(lazy.probs_offline(audio), vad.probs_offline(audio))
        np.testing.assert_array_equal(lazy.probs_streaming(audio), vad.probs_streaming(audio))
        assert set(lazy.pg.plans.current) == {"offline", "stream"}
    with pytest.raises(ValueError, match="modes must be among"):
        SileroVad(None, modes=("batch",))  # type: ignore[arg-type]


def test_streaming_equals_offline_on_the_sample(vad, sample, sample_ort):
    # The first 160 chunks (5.1 s: silence, then speech) keep this quick on slow
    # backends; the CPU-only CLI test below streams the whole file.
    part = sample[: 512 * 160]
    streamed = vad.probs_streaming(part)
    np.testing.assert_allclose(streamed, vad.probs_offline(part), atol=1e-5)
    np.testing.assert_allclose(streamed, sample_ort[: len(streamed)], atol=TOL)


def test_state_is_reset_between_files(vad, sample):
    other = synthetic_audio(0.5, seed=7)
    fresh = vad.probs_streaming(other)
    vad.probs_streaming(sample[16000:16000 * 2])  # speech: leaves a non-zero state behind
    np.testing.assert_array_equal(vad.probs_streaming(other), fresh)
    vad.probs_offline(sample[16000:16000 * 2])
    np.testing.assert_allclose(vad.probs_offline(other), fresh, atol=1e-5)


def test_stream_chunk_keeps_context_and_state_across_executes(vad):
    audio = synthetic_audio(0.5, seed=4)[: 512 * 15]
    vad.reset()
    probs = [vad.stream_chunk(audio[i:i + 512]) for i in range(0, len(audio), 512)]
    np.testing.assert_allclose(probs, ort_probs(audio), atol=TOL)


# -- segments ----------------------------------------------------------------------------
def test_segmentation_rules_equal_silero_code():
    theirs = silero_segmenter()
    rng = np.random.default_rng(0)
    cases = [VadParams(), VadParams(threshold=0.3, min_silence_duration_ms=300),
             VadParams(max_speech_duration_s=2.0), VadParams(max_speech_duration_s=1.5, use_max_poss_sil_at_max_speech=False),
             VadParams(speech_pad_ms=200, min_speech_duration_ms=50)]
    for trial in range(30):
        # blocky random probabilities: runs of speech and silence of random lengths
        runs = rng.integers(1, 40, size=30)
        levels = rng.uniform(0, 1, size=30)
        probs = np.repeat(levels, runs)[: rng.integers(50, 600)].tolist()
        n = len(probs) * 512 - int(rng.integers(0, 512))
        for p in cases:
            kw = dict(threshold=p.threshold, min_speech_duration_ms=p.min_speech_duration_ms,
                      max_speech_duration_s=p.max_speech_duration_s, min_silence_duration_ms=p.min_silence_duration_ms,
                      speech_pad_ms=p.speech_pad_ms, use_max_poss_sil_at_max_speech=p.use_max_poss_sil_at_max_speech)
            assert speech_timestamps(probs, n, p) == theirs(probs, audio_length_samples=n, **kw), (trial, p)


# -- memory ----------------------------------------------------------------------------
def test_workspace_reused_no_ledger_growth(devices):
    long_audio = synthetic_audio(4.0, seed=5)    # 125 chunks: 4 frontend batches of 32
    short_audio = synthetic_audio(0.5, seed=6)   # 16 chunks: one batch bucket of 32
    base = LEDGER.live_bytes()
    with Session(devices) as session:
        ws = session.workspace()
        vad = SileroVad(session, workspace=ws, max_batch=32)
        want_short = vad.probs_offline(short_audio)
        vad.probs_offline(long_audio)
        vad.probs_streaming(short_audio)
        peak = LEDGER.live_bytes()
        for _ in range(2):  # repeated requests, and short after long
            np.testing.assert_allclose(vad.probs_offline(short_audio), want_short, atol=1e-6)
            vad.probs_offline(long_audio)
            vad.probs_streaming(short_audio)
            assert LEDGER.live_bytes() == peak
        vad.release()
    assert LEDGER.live_bytes() == base  # nothing leaked


# -- placement -------------------------------------------------------------------------
def test_frontend_and_head_on_two_devices_equal_one_device(sample):
    audio = sample[: 16000 * 6]
    with Session(["cpu"]) as one, SileroVad(one) as single:
        want_off, want_stream = single.probs_offline(audio), single.probs_streaming(audio)
    with Session(["cpu:0", "cpu:1"]) as two, SileroVad(two, placement=split_placement) as split:
        got_off, got_stream = split.probs_offline(audio), split.probs_streaming(audio)
        stream = split.pg.describe()["entries"]["stream"]
        offline = split.pg.current_plan("offline").schedule
    placed: dict[str, set[str]] = {}
    for n in offline.graph.nodes:  # compute nodes (a view sits with the tensor it views)
        if OPS[n.op].view is None:
            placed.setdefault(n.name.split("/")[0], set()).add(offline.device_of[n.id])
    assert set(stream["splits_per_device"]) == {"cpu:0", "cpu:1"} and stream["copies"] >= 1
    assert placed["frontend"] == {"cpu:0"} and placed["lstm"] == placed["head"] == {"cpu:1"}
    np.testing.assert_allclose(got_off, want_off, atol=1e-6)
    np.testing.assert_allclose(got_stream, want_stream, atol=1e-6)


# -- plugin and command line ---------------------------------------------------------------
def test_plugin_is_registered_and_prepares():
    from flare.core.plugin_manager import PluginManager

    spec = PluginManager().models()["silero-vad"]
    assert set(spec.graph({}).entries) == {"stream", "offline"} and spec.run is not None
    with Session(["cpu"]) as session:
        pg = session.prepare_model("silero-vad")
        out = pg.execute("stream", chunk=np.zeros((1, 512), np.float32))
        assert out["prob"].shape == (1, 1) and 0.0 <= out["prob"][0, 0] < 0.5


def test_progress_bar_path_gives_the_same_segments():
    import io

    from rich.console import Console

    from flare.models.silero_vad import cli

    audio = synthetic_audio(3.0, seed=8)
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    seen = []
    with Session(["cpu"]) as session, SileroVad(session) as model:
        for mode in ("offline", "streaming"):
            assert cli._with_progress(model, audio, mode, VadParams(), console) == model.detect(audio, mode)
        model.probs_offline(audio, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (94, 94) and "chunks" in console.file.getvalue()


def test_cli_json_on_the_shipped_sample(capsys, sample, sample_ort):
    from flare.models.silero_vad.plugin import run

    assert run(["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    theirs = silero_segmenter()(sample_ort.tolist(), audio_length_samples=sample.size, return_seconds=True,
                                time_resolution=3)
    assert out["duration"] == 18.0 and out["mode"] == "offline"
    assert [(s["start"], s["end"]) for s in out["segments"]] == [(t["start"], t["end"]) for t in theirs]


def test_cli_table_streaming_and_errors(capsys, tmp_path):
    from flare.models.silero_vad.cli import main

    assert main([str(SAMPLE), "--mode", "streaming"]) == 0   # the whole sample, chunk by chunk
    assert "5 segment(s)" in capsys.readouterr().out
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x04\x00\x00\x00WAVE")
    assert main([str(bad)]) == 2   # bad input (an AudioError): the one exit-code convention
    assert "bad.wav" in capsys.readouterr().err
