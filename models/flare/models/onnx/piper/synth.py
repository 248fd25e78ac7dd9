"""Piper synthesis on a Flare Session: phoneme ids -> the voice's ONNX model -> audio.

One `OnnxRunner` per voice; each sentence is one call (its length is the
model's input shape, and the audio length depends on the predicted durations:
the importer splits the graph at those host steps). Noise scales of 0 make
the output deterministic (what the tests compare with onnxruntime).

Lengths are padded to a bucket (`LENGTH_BUCKET`): the ids are padded with the pad
id 0 while `input_lengths` stays the real length, and the model masks every
position past it (VITS: `x_mask` on the encoder's attention scores and
convolutions, the durations multiplied by it, so padded phonemes last 0 frames
and the audio is the same length). Why: the encoder and duration predictor
segments then see a few shapes, not one per sentence length, so a new sentence
reuses their plans (onnxruntime on the padded ids: within 2.4e-5 of the
unpadded waveform; the tests compare Flare's padded run with onnxruntime's
unpadded one within 1e-3).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flare.core.errors import InputError

from ..loader import load_model
from ..runner import OnnxRunner
from .phonemes import phonemize, sentences, to_ids
from .voice import Voice


LENGTH_BUCKET = 16  # ids are padded to a multiple of this (1: never padded)


def padded(ids: np.ndarray, bucket: int) -> np.ndarray:
    """`ids` ([1, T]) padded with the pad id 0 to a multiple of `bucket` (itself when it is one)."""
    length = ids.shape[1]
    want = -(-length // bucket) * bucket
    if want == length:
        return ids
    out = np.zeros((ids.shape[0], want), ids.dtype)
    out[:, :length] = ids
    return out


class Piper:
    def __init__(self, session: Any, voice: Voice, *, noise_scale: float | None = None,
                 length_scale: float | None = None, noise_w: float | None = None,
                 bucket: int = LENGTH_BUCKET):
        if bucket < 1:
            raise InputError(f"piper: length bucket {bucket} (must be >= 1)")
        self.voice = voice
        self.bucket = bucket
        self.scales = np.array([voice.noise_scale if noise_scale is None else noise_scale,
                                voice.length_scale if length_scale is None else length_scale,
                                voice.noise_w if noise_w is None else noise_w], np.float32)
        self.runner = OnnxRunner(load_model(voice.model_path), session)

    def ids(self, sentence: str) -> np.ndarray:
        return np.array([to_ids(phonemize(sentence, self.voice.espeak_voice), self.voice.phoneme_id_map)], np.int64)

    def synthesize_ids(self, ids: np.ndarray) -> np.ndarray:
        feeds = {"input": padded(ids, self.bucket), "input_lengths": np.array([ids.shape[1]], np.int64),
                 "scales": self.scales}
        return self.runner.run(feeds)["output"].reshape(-1)

    def synthesize(self, text: str) -> np.ndarray:
        """Float audio of all sentences of `text`, one after the other."""
        return np.concatenate([self.synthesize_ids(self.ids(s)) for s in sentences(text)])

    def release(self) -> None:
        self.runner.release()

    def __enter__(self) -> "Piper":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def to_int16(audio: np.ndarray) -> np.ndarray:
    """Piper's conversion: scaled so the loudest sample is full scale (never divided by ~0)."""
    peak = max(0.01, float(np.max(np.abs(audio))) if audio.size else 0.0)
    return np.clip(audio * (32767.0 / peak), -32768, 32767).astype(np.int16)


def write_wav(path: str, audio: np.ndarray, rate: int) -> None:
    """16-bit mono WAV, written to a temporary name and renamed (nothing half-written)."""
    import os
    import wave

    tmp = path + ".partial"
    try:
        with wave.open(tmp, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes(to_int16(audio).tobytes())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
