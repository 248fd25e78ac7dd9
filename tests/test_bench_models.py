"""flare bench on the real workloads, kept tiny: one block, one or two short requests.

These check that each workload kind and peer serves the same outputs (identical
or within the stated tolerance) and that the flare runner's modes (prepared,
rebuilt every request, one workspace per entry) compute the same thing. No
test asserts a time.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from flare.plugins.bench import parse_config, run_bench
from flare.models.silero_vad.bench import synthetic_audio


def config(name: str, model: str, options: dict, **top):
    return parse_config({"model": model, **top, "options": options}, name=name, known_backends=["cpu"])


SHORT_AUDIO = {"synthetic_seconds": 1.5, "max_batch": 64}


def test_silero_prepared_vs_rebuilt_without_workspace_sharing_is_identical(tmp_path):
    wav = tmp_path / "clip.wav"
    _write_wav(wav, synthetic_audio(0.7, seed=3))
    opts = {**SHORT_AUDIO, "audio": [str(wav)]}
    a = config("prepared", "silero-vad", opts)
    b = config("rebuilt", "silero-vad", opts, prepared=False, workspace_sharing=False)
    result = run_bench(a, b, blocks=1, requests=2, warmup=0)
    assert result.outputs.identical and result.ok
    assert [r.work for r in result.requests] == pytest.approx([0.7, 1.5])
    plan_a, plan_b = result.summaries["A"].memory_plan, result.summaries["B"].memory_plan
    assert set(plan_a["entries"]) == set(plan_b["entries"]) == {"stream", "offline"}
    arena = plan_a["entries"]["offline"]["arena"]["cpu:0"]
    assert arena["lower_bound"] <= arena["planned"] <= arena["naive"]
    # one workspace per entry point: the arenas add up instead of overlapping
    assert sum(plan_b["workspace_bytes"].values()) >= sum(plan_a["workspace_bytes"].values())
    assert result.summaries["A"].ledger_peak_bytes["cpu:0"] > 0


@pytest.mark.parametrize("peer", ["numpy", "onnxruntime"])
def test_silero_peers_agree_with_flare(peer):
    if peer == "onnxruntime" and importlib.util.find_spec("onnxruntime") is None:
        pytest.skip("onnxruntime is not installed")
    a = config("flare", "silero-vad", {"mode": "streaming"})
    b = config(peer, "silero-vad", {}, peer=peer)
    result = run_bench(a, b, blocks=1, requests=1, warmup=0)   # one request: the shipped 18 s sample
    assert result.outputs.within_tolerance, result.outputs.summary()
    assert result.summaries["B"].memory_plan is None and not result.summaries["B"].ledger_peak_bytes
    if peer == "numpy":   # the table says a peer's ledger peak was not measured, not "0.0 MiB"
        import io

        from rich.console import Console

        from flare.plugins.bench.report import print_report

        out = io.StringIO()
        print_report(result, Console(file=out, width=200))
        row = next(line for line in out.getvalue().splitlines() if "ledger peak cpu:0" in line)
        assert "not measured" in row and row.count("0.0") == 0, row


def test_minilm_numpy_peer_agrees_with_flare():
    opts = {"batch": 3}
    result = run_bench(config("flare", "minilm-l6", opts), config("numpy", "minilm-l6", opts, peer="numpy"),
                       blocks=1, requests=1, warmup=0)
    assert result.outputs.within_tolerance, result.outputs.summary()
    assert result.requests[0].work == 3 and result.metric.name == "sentences/s"


def test_minilm_numpy_peer_matches_the_float64_reference():
    from flare.models.minilm.bench_numpy_peer import MiniLMNumpy
    from flare.models.minilm import numpy_reference
    from flare.models.minilm.tokenize import encode, pad_batch
    from flare.models.minilm.weights import all_weights

    sentences = ["A man is eating food.", "The new movie is awesome, I loved every minute of it."]
    batch = pad_batch(encode(sentences))
    peer = MiniLMNumpy(all_weights()).encode(batch.ids, batch.lengths)
    ref = numpy_reference.encode(all_weights(), batch.ids, batch.lengths)
    np.testing.assert_allclose(peer, ref, atol=2e-6)


def test_moe_resident_vs_offload_outputs_identical():
    opts = {"size": "tiny", "prompt_tokens": 6, "new_tokens": 3}
    result = run_bench(config("resident", "moe-lm", opts), config("offload", "moe-lm", {**opts, "experts": "offload"}),
                       blocks=1, requests=1, warmup=0)
    assert result.outputs.identical and result.ok
    assert result.requests[0].work == 9 and result.metric.name == "tokens/s"
    for summary in result.summaries.values():     # decode time apart from the prompt's (bench.greedy)
        assert set(summary.extras) == {"prefill ms", "decode ms/token"}


def _write_wav(path, audio: np.ndarray, rate: int = 16000) -> None:
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())


def test_minilm_torch_peer_agrees_with_numpy_peer():
    pytest.importorskip("torch")
    opts = {"batch": 2}
    result = run_bench(config("numpy", "minilm-l6", opts, peer="numpy"), config("torch", "minilm-l6", opts, peer="torch"),
                       blocks=1, requests=1, warmup=0)
    assert result.outputs.within_tolerance, result.outputs.summary()
