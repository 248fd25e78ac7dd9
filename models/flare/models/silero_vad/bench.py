"""silero-vad as a benchmark workload: whole audio files in, per-chunk speech probabilities out.

A request is one 16 kHz clip (the shipped sample, WAV files, optionally each
repeated end to end, and/or deterministic synthetic audio), served from reset
state. The metric is the real-time factor: processing seconds / audio seconds.

Peers:
- `flare`: `SileroVad` on the configured devices, `mode` offline or streaming.
- `onnxruntime`: the wheel's silero_vad.onnx, one session call per 512-sample
  chunk with the 64-sample context and the LSTM state carried, exactly as
  silero's own OnnxWrapper does (the model has no batched form over time).
- `numpy`: `flare.models.silero_vad.numpy_reference` (a plain NumPy forward
  that shares only the weights with the graph).
Outputs agree within 1e-4 (the tolerance of tests/test_silero_vad.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from flare.plugins.bench.config import BenchConfig
from flare.plugins.bench.errors import BenchConfigError
from flare.plugins.bench.flare_runner import FlareRunner
from flare.plugins.bench.workload import RTF, Option, Request, Workload, cycle

SAMPLE_RATE = 16000


def sample_path() -> Path:
    """The speech sample shipped with the silero-vad plugin."""
    import flare.models.silero_vad as pkg

    return Path(pkg.__file__).resolve().parent / "data" / "speech_sample.wav"


def synthetic_audio(seconds: float, seed: int = 0) -> np.ndarray:
    """Deterministic 16 kHz test audio: a chirp, a buzz-like voiced burst, noise bursts, silence.
    Segments repeat every 4.3 s so any length has speech-like and silent parts."""
    rng = np.random.default_rng(seed)
    n = int(round(SAMPLE_RATE * seconds))
    t = (np.arange(n) / SAMPLE_RATE) % 4.3
    x = 0.01 * rng.standard_normal(n)
    x += 0.4 * np.sin(2 * np.pi * (150 + 400 * t) * t) * (t > 0.5) * (t < 1.8)
    x += 0.3 * np.sign(np.sin(2 * np.pi * 120 * t)) * np.exp(-((t - 2.6) / 0.4) ** 2)
    x += 0.2 * rng.standard_normal(n) * ((t > 3.4) & (t < 3.9))
    return np.clip(x, -1, 1).astype(np.float32)


class SileroVadWorkload(Workload):

    threads_supported = True   # `threads`: the CPU device's threads (FlareRunner)
    model = "silero-vad"
    metric = RTF
    tolerance = 1e-4
    default_requests = 8
    options = {
        "mode": Option(str, "offline", "flare: offline (batched frontend, one lstm node) or streaming (chunk by chunk)",
                       choices=("offline", "streaming")),
        "audio": Option("paths", ("sample",), "WAV files (relative to the TOML), or \"sample\" for the shipped "
                        "18 s speech sample; requests cycle through them", shapes_requests=True, keywords=("sample",)),
        "repeat": Option(int, 1, "each clip is its audio repeated this many times end to end (long files)",
                         minimum=1, shapes_requests=True),
        "synthetic_seconds": Option(float, 0.0, "add a synthetic clip of this many seconds to the pool (0: none)",
                                    minimum=0.0, shapes_requests=True),
        "max_batch": Option(int, 2048, "flare offline: most windows per execute", minimum=32),
        "threads": Option(int, 1, "onnxruntime: intra-op threads (the top-level `threads` sets it)", minimum=1),
    }

    def requests(self, config: BenchConfig, count: int) -> list[Request]:
        from flare.models.silero_vad.audio import load_audio

        clips = []
        for item in config.options["audio"]:
            path = sample_path() if item == "sample" else Path(item)
            try:
                audio = load_audio(path)
            except Exception as exc:
                raise BenchConfigError(f"cannot read {str(path)!r}: {exc}", path=config.path, key="options.audio") from exc
            clips.append((path.name, np.tile(audio, config.options["repeat"])))
        if config.options["synthetic_seconds"] > 0:
            secs = config.options["synthetic_seconds"]
            clips.append((f"synthetic {secs:g}s", synthetic_audio(secs)))
        return [Request(i, audio, audio.size / SAMPLE_RATE, label)
                for i, (label, audio) in enumerate(cycle(clips, count))]

    def open_flare(self, config: BenchConfig) -> FlareRunner:
        from flare.models.silero_vad.runner import SileroVad
        from flare.models.silero_vad.weights import load_weights

        raw = load_weights()          # read once: a rebuilt graph measures the graph's lifecycle, not file I/O
        mode, max_batch = config.options["mode"], config.options["max_batch"]

        def build(session: Any) -> SileroVad:
            return SileroVad(session, weights=raw, max_batch=max_batch)

        def infer(vad: SileroVad, request: Request) -> np.ndarray:
            return vad.speech_probs(request.payload, mode)

        return FlareRunner(config, build, infer)

