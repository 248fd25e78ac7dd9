"""Silero VAD (16 kHz) as Flare graphs, matching the ONNX model op for op.

The ONNX 16 kHz branch computes, per 576-sample window (64 context + 512 new):
reflect-pad 64 on the right, STFT as a conv1d with a fixed [258, 1, 256] basis
(stride 128), magnitude sqrt(re^2 + im^2), four conv1d(k=3, pad=1)+ReLU layers
(strides 1, 2, 2, 1) down to [128, 1], one PyTorch LSTMCell step (hidden 128),
ReLU, a 1x1 conv and a sigmoid.

Two entry points share weights and state (see `ENTRIES`):
- `stream`: one 512-sample chunk; the 64-sample context and the LSTM h/c live
  in state tensors, so a caller just feeds chunks and resets between files.
- `offline`: N consecutive windows at once. Everything that does not depend on
  the recurrence (STFT, encoder, the LSTM's input projection x @ W_ih^T + b) is
  batched over all N; then one `lstm` node runs the N steps of the recurrence
  (one kernel on a GPU, one loop in C on the CPU: no host round trip per step),
  and the head is batched over the N hidden states. h/c carry over in state, so
  a long file is a few executes of one or two cached sizes.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from flare.core.graph import GraphBuilder, Tensor

from .numpy_reference import CHUNK, CONTEXT, HIDDEN, WINDOW

# State names carry their stage prefix, so a placement callback keeps each
# state on the device of the nodes that read it.
STATE_CONTEXT = "frontend/context"   # [1, 64]: last 64 samples of the previous window
STATE_H = "lstm/h"                   # [1, 128]
STATE_C = "lstm/c"                   # [1, 128]
GATES = 4 * HIDDEN


BINS = 129         # STFT frequency bins (the basis' real rows, then as many imaginary rows)
BINS_PADDED = 132  # bins as the graph carries them: the 3 extra are exact zeros (see prepare_weights)


def _pad_bins(basis: np.ndarray, enc0_w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The STFT basis [258, 1, 256] and the first encoder conv's weight [128, 129, 3] with the
    frequency bins padded to 132 by zero rows / zero input channels (padded bins have magnitude
    0 and weight 0, so every sum is the same). Why: the first conv's reduction is then 396 long
    (a multiple of 4) and its weight rows 4-aligned, the layout every other encoder conv has, so
    a Vulkan CPU driver compiles one conv kernel for the frontend instead of also a
    scalar-load, odd-K one (0.6 s more LLVM at a cold start on lavapipe); elsewhere it costs
    2% more work in the STFT and the first conv."""
    pad = BINS_PADDED - BINS
    zeros = np.zeros((pad,) + basis.shape[1:], basis.dtype)
    basis = np.concatenate([basis[:BINS], zeros, basis[BINS:], zeros])
    enc0_w = np.concatenate([enc0_w, np.zeros((enc0_w.shape[0], pad, enc0_w.shape[2]), enc0_w.dtype)], axis=1)
    return basis, enc0_w


def prepare_weights(raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ONNX-named tensors -> the layouts the graph uses (done once, on the host)."""
    basis, enc0_w = _pad_bins(raw["stft.basis"], raw["enc0.w"])
    w = {
        "frontend/stft.basis": basis,
        "frontend/lstm.w_ih": raw["lstm.w_ih"],   # the input projection is batched with the frontend
        "frontend/lstm.bias": raw["lstm.b_ih"] + raw["lstm.b_hh"],
        "lstm/w_hh": raw["lstm.w_hh"],            # gate order i, f, g, o: the lstm op's
        "head/w": raw["head.w"].reshape(HIDDEN, 1),
        "head/b": raw["head.b"].reshape(1),
    }
    for i in range(4):
        w[f"frontend/enc{i}.w"] = enc0_w if i == 0 else raw[f"enc{i}.w"]
        w[f"frontend/enc{i}.b"] = raw[f"enc{i}.b"].reshape(-1, 1)  # broadcasts over time
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in w.items()}


class _Weights:
    """Declares each weight in a builder on first use (one graph = one declaration)."""

    def __init__(self, b: GraphBuilder, weights: Mapping[str, np.ndarray]):
        self._b, self._w, self._t = b, weights, {}

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._t:
            self._t[name] = self._b.weight(name, self._w[name])
        return self._t[name]


_ENCODER = ((1,), (2,), (2,), (1,))  # strides of the four conv layers


def frontend(b: GraphBuilder, w: _Weights, windows: Tensor) -> Tensor:
    """windows [B, 576] -> LSTM input projections [B, 512] (gate order i, f, g, o).

    Nodes are named `frontend/...` (weights `frontend/...` too) for placement."""
    with b.scope("frontend"):
        batch = windows.shape[0]
        x = b.pad(windows, pads=((0, 0), (0, CONTEXT)), mode="reflect")          # [B, 640]
        x = b.reshape(x, shape=(batch, 1, WINDOW + CONTEXT))
        spec = b.conv1d(x, w["frontend/stft.basis"], stride=CONTEXT * 2)          # [B, 264, 4]
        half = spec.shape[1] // 2
        re = b.slice(spec, axis=1, start=0, stop=half)
        im = b.slice(spec, axis=1, start=half, stop=2 * half)
        h = b.sqrt(b.add(b.sqr(re), b.sqr(im)))                                   # [B, 132, 4]: 3 zero bins
        for i, (stride,) in enumerate(_ENCODER):
            h = b.conv1d(h, w[f"frontend/enc{i}.w"], stride=stride, padding=1)
            h = b.relu(b.add(h, w[f"frontend/enc{i}.b"]))
        feats = b.reshape(h, shape=(batch, HIDDEN))                               # [B, 128, 1] -> [B, 128]
        return b.add(b.matmul(feats, w["frontend/lstm.w_ih"], transpose_b=True), w["frontend/lstm.bias"])


def recurrence(b: GraphBuilder, w: _Weights, xproj: Tensor, h: Tensor, c: Tensor) -> Tensor:
    """Input projections [T, 512] -> hidden states [T, 128] (a strided view of the lstm
    node's output); the last step's h and c are written back to the state tensors."""
    steps = xproj.shape[0]
    w_hh = w["lstm/w_hh"]
    with b.scope("lstm"):
        seq = b.lstm(b.reshape(xproj, shape=(steps, 1, GATES)), w_hh, h, c)      # [T, 1, 2H]
        seq = b.reshape(seq, shape=(steps, 2 * HIDDEN))                          # row t: h_t, c_t
        last = b.slice(seq, axis=0, start=steps - 1, stop=steps)
    with b.scope("state"):
        b.copy_into(h, b.slice(last, axis=1, start=0, stop=HIDDEN))
        b.copy_into(c, b.slice(last, axis=1, start=HIDDEN, stop=2 * HIDDEN))
    with b.scope("lstm"):
        return b.slice(seq, axis=1, start=0, stop=HIDDEN)


def head(b: GraphBuilder, w: _Weights, hs: Tensor) -> Tensor:
    """Hidden states [T, 128] -> speech probabilities [T, 1] (nodes named `head/...`)."""
    w_out, bias = w["head/w"], w["head/b"]
    with b.scope("head"):
        return b.sigmoid(b.add(b.matmul(b.relu(hs), w_out), bias))


# -- entry points -------------------------------------------------------------
def build_stream(b: GraphBuilder, weights: Mapping[str, np.ndarray], shapes: Mapping[str, tuple]) -> None:
    """`stream`: input chunk [1, 512] -> prob [1, 1]; context, h and c in state."""
    w = _Weights(b, weights)
    chunk = b.input("chunk", shapes.get("chunk", (1, CHUNK)))
    ctx = b.state(STATE_CONTEXT, (1, CONTEXT))
    h = b.state(STATE_H, (1, HIDDEN))
    c = b.state(STATE_C, (1, HIDDEN))
    with b.scope("frontend"):
        window = b.concat(ctx, chunk, axis=1)                                    # [1, 576]
    xp = frontend(b, w, window)
    # The context write reads `window` (a copy), so it may come right away; placed
    # here it joins the frontend's split instead of forming one of its own.
    with b.scope("state"):
        b.copy_into(ctx, b.slice(window, axis=1, start=CHUNK, stop=WINDOW))
    b.output("prob", head(b, w, recurrence(b, w, xp, h, c)))


def build_offline(b: GraphBuilder, weights: Mapping[str, np.ndarray], shapes: Mapping[str, tuple]) -> None:
    """`offline`: windows [N, 576] -> probs [N, 1]; h and c carried in state."""
    w = _Weights(b, weights)
    windows = b.input("windows", shapes["windows"])
    h = b.state(STATE_H, (1, HIDDEN))
    c = b.state(STATE_C, (1, HIDDEN))
    b.output("probs", head(b, w, recurrence(b, w, frontend(b, w, windows), h, c)))


ENTRIES = {"stream": build_stream, "offline": build_offline}
