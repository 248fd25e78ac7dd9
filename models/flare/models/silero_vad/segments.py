"""Speech segments from per-chunk probabilities: silero's `get_speech_timestamps` rules.

A line-for-line reimplementation of `get_speech_timestamps_from_probs` in
silero-vad 6.x `utils_vad.py` (which we cannot import: it imports torch), with
the same defaults: threshold 0.5, negative threshold threshold-0.15, min
speech 250 ms, min silence 100 ms, speech pad 30 ms, no maximum length. The
test suite runs silero's own function (extracted from its source) on the same
probabilities and requires identical results.

Segments are computed in samples; `Segment` adds seconds and the mean speech
probability of the chunks the segment covers.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

SAMPLE_RATE = 16000
WINDOW = 512


@dataclass(frozen=True)
class VadParams:
    """The knobs of get_speech_timestamps, with silero's defaults."""

    threshold: float = 0.5
    min_speech_duration_ms: int = 250
    max_speech_duration_s: float = float("inf")
    min_silence_duration_ms: int = 100
    speech_pad_ms: int = 30
    neg_threshold: float | None = None
    min_silence_at_max_speech: int = 98
    use_max_poss_sil_at_max_speech: bool = True

    def __post_init__(self) -> None:
        """Refuse values that would make nonsense segments (NaN thresholds, negative padding)."""
        import math

        from flare.core.errors import InputError

        def bad(name: str, value: object, want: str) -> InputError:
            return InputError(f"VAD parameter {name}={value!r}: must be {want}")

        for name in ("threshold", "neg_threshold"):
            v = getattr(self, name)
            if v is None and name == "neg_threshold":
                continue
            if not isinstance(v, (int, float)) or not math.isfinite(v) or not 0.0 <= v <= 1.0:
                raise bad(name, v, "a probability in [0, 1]")
        for name, hi in (("min_speech_duration_ms", 3_600_000), ("min_silence_duration_ms", 3_600_000),
                         ("speech_pad_ms", 60_000), ("min_silence_at_max_speech", 3_600_000)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
                raise bad(name, v, f"an integer in [0, {hi}]")
        m = self.max_speech_duration_s
        if not isinstance(m, (int, float)) or math.isnan(m) or m <= 0:
            raise bad("max_speech_duration_s", m, "positive (inf for no limit)")


@dataclass(frozen=True)
class Segment:
    """One stretch of speech: [start, end) in samples and seconds, mean probability."""

    start_sample: int
    end_sample: int
    start: float
    end: float
    probability: float

    def to_dict(self) -> dict:
        return asdict(self)


def speech_timestamps(probs: Sequence[float], audio_length_samples: int | None = None,
                      params: VadParams = VadParams(), sampling_rate: int = SAMPLE_RATE) -> list[dict]:
    """Silero's segmentation: list of {'start', 'end'} in samples (16 kHz, 512-sample chunks)."""
    window = WINDOW if sampling_rate == 16000 else 256
    if audio_length_samples is None:
        audio_length_samples = len(probs) * window
    threshold = params.threshold
    min_speech_samples = sampling_rate * params.min_speech_duration_ms / 1000
    speech_pad_samples = sampling_rate * params.speech_pad_ms / 1000
    max_speech_samples = sampling_rate * params.max_speech_duration_s - window - 2 * speech_pad_samples
    min_silence_samples = sampling_rate * params.min_silence_duration_ms / 1000
    min_silence_samples_at_max_speech = sampling_rate * params.min_silence_at_max_speech / 1000
    neg_threshold = params.neg_threshold
    if neg_threshold is None:
        neg_threshold = max(threshold - 0.15, 0.01)
    use_max_poss = params.use_max_poss_sil_at_max_speech

    triggered = False
    speeches: list[dict] = []
    current: dict = {}
    temp_end = 0
    prev_end = next_start = 0
    possible_ends: list[tuple[int, int]] = []

    for i, prob in enumerate(probs):
        cur = window * i
        if prob >= threshold and temp_end:
            sil_dur = cur - temp_end
            if sil_dur > min_silence_samples_at_max_speech:
                possible_ends.append((temp_end, sil_dur))
            temp_end = 0
            if next_start < prev_end:
                next_start = cur
        if prob >= threshold and not triggered:
            triggered = True
            current["start"] = cur
            continue
        if triggered and cur - current["start"] > max_speech_samples:
            if use_max_poss and possible_ends:
                prev_end, dur = max(possible_ends, key=lambda x: x[1])
                current["end"] = prev_end
                speeches.append(current)
                current = {}
                next_start = prev_end + dur
                if next_start < prev_end + cur:
                    current["start"] = next_start
                else:
                    triggered = False
                prev_end = next_start = temp_end = 0
                possible_ends = []
            else:
                if prev_end:
                    current["end"] = prev_end
                    speeches.append(current)
                    current = {}
                    if next_start < prev_end:
                        triggered = False
                    else:
                        current["start"] = next_start
                    prev_end = next_start = temp_end = 0
                    possible_ends = []
                else:
                    current["end"] = cur
                    speeches.append(current)
                    current = {}
                    prev_end = next_start = temp_end = 0
                    triggered = False
                    possible_ends = []
                    continue
        if prob < neg_threshold and triggered:
            if not temp_end:
                temp_end = cur
            sil_dur_now = cur - temp_end
            if not use_max_poss and sil_dur_now > min_silence_samples_at_max_speech:
                prev_end = temp_end
            if sil_dur_now < min_silence_samples:
                continue
            current["end"] = temp_end
            if current["end"] - current["start"] > min_speech_samples:
                speeches.append(current)
            current = {}
            prev_end = next_start = temp_end = 0
            triggered = False
            possible_ends = []
            continue

    if current and audio_length_samples - current["start"] > min_speech_samples:
        current["end"] = audio_length_samples
        speeches.append(current)

    for i, speech in enumerate(speeches):
        if i == 0:
            speech["start"] = int(max(0, speech["start"] - speech_pad_samples))
        if i != len(speeches) - 1:
            silence = speeches[i + 1]["start"] - speech["end"]
            if silence < 2 * speech_pad_samples:
                speech["end"] += int(silence // 2)
                speeches[i + 1]["start"] = int(max(0, speeches[i + 1]["start"] - silence // 2))
            else:
                speech["end"] = int(min(audio_length_samples, speech["end"] + speech_pad_samples))
                speeches[i + 1]["start"] = int(max(0, speeches[i + 1]["start"] - speech_pad_samples))
        else:
            speech["end"] = int(min(audio_length_samples, speech["end"] + speech_pad_samples))
    return speeches


def segments(probs: Sequence[float], audio_length_samples: int, params: VadParams = VadParams(),
             sampling_rate: int = SAMPLE_RATE) -> list[Segment]:
    """Segments with seconds (rounded to ms) and the mean probability of covered chunks."""
    probs = np.asarray(probs, dtype=np.float64)
    out = []
    for s in speech_timestamps(probs, audio_length_samples, params, sampling_rate):
        first = s["start"] // WINDOW
        last = max(first + 1, -(-s["end"] // WINDOW))
        covered = probs[first:last]
        out.append(Segment(int(s["start"]), int(s["end"]), round(s["start"] / sampling_rate, 3),
                           round(s["end"] / sampling_rate, 3),
                           round(float(covered.mean()) if covered.size else 0.0, 4)))
    return out
