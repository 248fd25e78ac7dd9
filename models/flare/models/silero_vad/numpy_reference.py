"""Silero VAD 16 kHz forward in plain NumPy: the independent peer of the Flare graph.

It shares nothing with the graph builders except the weights, so agreement
between the two (and with onnxruntime) means something. Benchmarks use it as a
peer; tests use it to localise a mismatch (frontend vs LSTM).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

SAMPLE_RATE = 16000
CHUNK = 512      # new samples per model call at 16 kHz
CONTEXT = 64     # samples carried over from the previous chunk
WINDOW = CHUNK + CONTEXT
HIDDEN = 128


def conv1d(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, stride: int = 1, padding: int = 0) -> np.ndarray:
    """x [B, Cin, L], w [Cout, Cin, K] -> [B, Cout, Lout] (zero padding)."""
    if padding:
        x = np.pad(x, ((0, 0), (0, 0), (padding, padding)))
    k = w.shape[-1]
    cols = np.lib.stride_tricks.sliding_window_view(x, k, axis=2)[:, :, ::stride]  # [B, Cin, Lout, K]
    out = np.einsum("bclk,ock->bol", cols, w, optimize=True)
    if b is not None:
        out = out + b[None, :, None]
    return out.astype(np.float32)


def frontend(weights: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Windows x [B, 576] (context + chunk) -> encoder features [B, 128]."""
    x = np.pad(x.astype(np.float32), ((0, 0), (0, CONTEXT)), mode="reflect")            # [B, 640]
    spec = conv1d(x[:, None, :], weights["stft.basis"], stride=128)                     # [B, 258, 4]
    half = spec.shape[1] // 2
    mag = np.sqrt(spec[:, :half] ** 2 + spec[:, half:] ** 2)                             # [B, 129, 4]
    h = np.maximum(conv1d(mag, weights["enc0.w"], weights["enc0.b"], 1, 1), 0)
    h = np.maximum(conv1d(h, weights["enc1.w"], weights["enc1.b"], 2, 1), 0)
    h = np.maximum(conv1d(h, weights["enc2.w"], weights["enc2.b"], 2, 1), 0)
    h = np.maximum(conv1d(h, weights["enc3.w"], weights["enc3.b"], 1, 1), 0)             # [B, 128, 1]
    return h[:, :, 0]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def lstm_cell(weights: Mapping[str, np.ndarray], x: np.ndarray, h: np.ndarray, c: np.ndarray):
    """PyTorch LSTMCell (gate order i, f, g, o). x [B,128], h/c [B,128] -> (h, c)."""
    gates = x @ weights["lstm.w_ih"].T + weights["lstm.b_ih"] + h @ weights["lstm.w_hh"].T + weights["lstm.b_hh"]
    i, f, g, o = np.split(gates, 4, axis=1)
    c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
    h = _sigmoid(o) * np.tanh(c)
    return h.astype(np.float32), c.astype(np.float32)


def head(weights: Mapping[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    """LSTM output [B, 128] -> speech probability [B] (ReLU, 1x1 conv, sigmoid)."""
    logits = np.maximum(h, 0) @ weights["head.w"][0, :, 0] + weights["head.b"][0]
    return _sigmoid(logits)


def step(weights: Mapping[str, np.ndarray], window: np.ndarray, h: np.ndarray, c: np.ndarray):
    """One model call, as onnxruntime's: window [B, 576] -> (prob [B], h, c)."""
    h, c = lstm_cell(weights, frontend(weights, window), h, c)
    return head(weights, h), h, c


def windows(audio: np.ndarray) -> np.ndarray:
    """Audio [n] -> model windows [ceil(n/512), 576]: each chunk prefixed by the
    previous chunk's last 64 samples (zeros before the first); the last chunk is
    zero-padded, as silero's get_speech_timestamps does."""
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    n_chunks = max(1, -(-audio.size // CHUNK))
    padded = np.zeros(CONTEXT + n_chunks * CHUNK, dtype=np.float32)
    padded[CONTEXT:CONTEXT + audio.size] = audio
    view = np.lib.stride_tricks.sliding_window_view(padded, WINDOW)[::CHUNK]
    return np.ascontiguousarray(view[:n_chunks])


def speech_probs(weights: Mapping[str, np.ndarray], audio: np.ndarray) -> np.ndarray:
    """Per-chunk speech probabilities of a whole 16 kHz file (frontend batched, LSTM sequential)."""
    win = windows(audio)
    feats = frontend(weights, win)
    xproj = feats @ weights["lstm.w_ih"].T + weights["lstm.b_ih"] + weights["lstm.b_hh"]
    h = np.zeros((1, HIDDEN), np.float32)
    c = np.zeros((1, HIDDEN), np.float32)
    hs = np.empty((len(win), HIDDEN), np.float32)
    w_hh_t = weights["lstm.w_hh"].T
    for t in range(len(win)):
        gates = xproj[t:t + 1] + h @ w_hh_t
        i, f, g, o = np.split(gates, 4, axis=1)
        c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
        h = _sigmoid(o) * np.tanh(c)
        hs[t] = h[0]
    return head(weights, hs)
