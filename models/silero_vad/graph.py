"""Silero VAD (16 kHz) as Flare graphs, matching the ONNX model op for op.

The ONNX 16 kHz branch computes, per 576-sample window (64 context + 512 new):
reflect-pad 64 on the right, STFT as a conv1d with a fixed [258, 1, 256] basis
(stride 128), magnitude sqrt(re^2 + im^2), four conv1d(k=3, pad=1)+ReLU layers
(strides 1, 2, 2, 1) down to [128, 1], one PyTorch LSTMCell step (hidden 128),
ReLU, a 1x1 conv and a sigmoid.

Three entry points share weights and state (see `ENTRIES`):
- `stream`: one 512-sample chunk; the 64-sample context and the LSTM h/c live
  in state tensors, so a caller just feeds chunks and resets between files.
- `frontend`: all windows of a file at once -> LSTM input projections
  (x @ W_ih^T + b_ih + b_hh) [N, 512]. Everything that does not depend on the
  recurrence is batched here; that is where the time goes.
- `recur`: T steps of the recurrence only (h @ W_hh^T + gates), then the head
  batched over the T hidden states. State carries h/c from block to block.

The LSTM's gate rows are reordered once at load time from PyTorch's (i, f, g, o)
to (i, f, o, g) so one sigmoid covers three gates and one tanh the fourth.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from flare.graph import GraphBuilder, Tensor

from .numpy_reference import CHUNK, CONTEXT, HIDDEN, WINDOW
from .scope import Scope

# State names carry their stage prefix, so a placement callback keeps each
# state on the device of the nodes that read it.
STATE_CONTEXT = "frontend/context"   # [1, 64]: last 64 samples of the previous window
STATE_H = "lstm/h"                   # [1, 128]
STATE_C = "lstm/c"                   # [1, 128]
GATES = 4 * HIDDEN


def prepare_weights(raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ONNX-named tensors -> the layouts the graph uses (done once, on the host)."""
    order = np.concatenate([np.arange(0, 2 * HIDDEN), np.arange(3 * HIDDEN, 4 * HIDDEN),
                            np.arange(2 * HIDDEN, 3 * HIDDEN)])  # i f g o -> i f o g
    w = {
        "frontend/stft.basis": raw["stft.basis"],
        "frontend/lstm.w_ih": raw["lstm.w_ih"][order],   # the input projection is batched with the frontend
        "frontend/lstm.bias": (raw["lstm.b_ih"] + raw["lstm.b_hh"])[order],
        "lstm/w_hh": raw["lstm.w_hh"][order],
        "head/w": raw["head.w"].reshape(HIDDEN, 1),
        "head/b": raw["head.b"].reshape(1),
    }
    for i in range(4):
        w[f"frontend/enc{i}.w"] = raw[f"enc{i}.w"]
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
    """windows [B, 576] -> LSTM input projections [B, 512] (gate order i, f, o, g).

    Nodes are named `frontend/...` (weights `frontend/...` too) for placement."""
    b = Scope(b, "frontend")
    batch = windows.shape[0]
    x = b.pad(windows, pads=((0, 0), (0, CONTEXT)), mode="reflect")          # [B, 640]
    x = b.reshape(x, shape=(batch, 1, WINDOW + CONTEXT))
    spec = b.conv1d(x, w["frontend/stft.basis"], stride=CONTEXT * 2)               # [B, 258, 4]
    half = spec.shape[1] // 2
    re = b.slice(spec, axis=1, start=0, stop=half)
    im = b.slice(spec, axis=1, start=half, stop=2 * half)
    h = b.sqrt(b.add(b.sqr(re), b.sqr(im)))                                   # [B, 129, 4]
    for i, (stride,) in enumerate(_ENCODER):
        h = b.conv1d(h, w[f"frontend/enc{i}.w"], stride=stride, padding=1)
        h = b.relu(b.add(h, w[f"frontend/enc{i}.b"]))
    feats = b.reshape(h, shape=(batch, HIDDEN))                               # [B, 128, 1] -> [B, 128]
    return b.add(b.matmul(feats, w["frontend/lstm.w_ih"], transpose_b=True), w["frontend/lstm.bias"])


def lstm_step(b: GraphBuilder | Scope, w: _Weights, xp: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """One recurrence step from a precomputed input projection xp [1, 512]."""
    gates = b.add(xp, b.matmul(h, w["lstm/w_hh"], transpose_b=True))
    sig = b.sigmoid(b.slice(gates, axis=1, start=0, stop=3 * HIDDEN))
    g = b.tanh(b.slice(gates, axis=1, start=3 * HIDDEN, stop=GATES))
    i = b.slice(sig, axis=1, start=0, stop=HIDDEN)
    f = b.slice(sig, axis=1, start=HIDDEN, stop=2 * HIDDEN)
    o = b.slice(sig, axis=1, start=2 * HIDDEN, stop=3 * HIDDEN)
    c_new = b.add(b.mul(f, c), b.mul(i, g))
    h_new = b.mul(o, b.tanh(c_new))
    return h_new, c_new


def head(b: GraphBuilder, w: _Weights, hs: Tensor) -> Tensor:
    """Hidden states [T, 128] -> speech probabilities [T, 1] (nodes named `head/...`)."""
    b = Scope(b, "head")
    logits = b.add(b.matmul(b.relu(hs), w["head/w"]), w["head/b"])
    return b.sigmoid(logits)


def concat_tree(b: GraphBuilder | Scope, parts: list[Tensor], axis: int) -> Tensor:
    """Concatenate many tensors pairwise (log depth, O(n log n) copying, not O(n^2))."""
    while len(parts) > 1:
        nxt = [b.concat(parts[k], parts[k + 1], axis=axis) for k in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return parts[0]


# -- entry points -------------------------------------------------------------
def build_stream(b: GraphBuilder, weights: Mapping[str, np.ndarray], shapes: Mapping[str, tuple]) -> None:
    """`stream`: input chunk [1, 512] -> prob [1, 1]; context, h and c in state."""
    w = _Weights(b, weights)
    chunk = b.input("chunk", shapes.get("chunk", (1, CHUNK)))
    ctx = b.state(STATE_CONTEXT, (1, CONTEXT))
    h = b.state(STATE_H, (1, HIDDEN))
    c = b.state(STATE_C, (1, HIDDEN))
    window = Scope(b, "frontend").concat(ctx, chunk, axis=1)                  # [1, 576]
    xp = frontend(b, w, window)
    st = Scope(b, "state")
    # The context write reads `window` (a copy), so it may come right away; placed
    # here it joins the frontend's split instead of forming one of its own.
    st.copy_into(ctx, st.slice(window, axis=1, start=CHUNK, stop=WINDOW))
    h_new, c_new = lstm_step(Scope(b, "lstm"), w, xp, h, c)
    prob = head(b, w, h_new)
    st.copy_into(h, h_new)
    st.copy_into(c, c_new)
    b.output("prob", prob)


def build_frontend(b: GraphBuilder, weights: Mapping[str, np.ndarray], shapes: Mapping[str, tuple]) -> None:
    """`frontend`: windows [N, 576] -> xproj [N, 512]; stateless."""
    w = _Weights(b, weights)
    windows = b.input("windows", shapes["windows"])
    b.output("xproj", frontend(b, w, windows))


def build_recur(b: GraphBuilder, weights: Mapping[str, np.ndarray], shapes: Mapping[str, tuple]) -> None:
    """`recur`: xproj [T, 512] -> probs [T, 1]; h and c carried in state."""
    w = _Weights(b, weights)
    xproj = b.input("xproj", shapes["xproj"])
    steps = xproj.shape[0]
    h = b.state(STATE_H, (1, HIDDEN))
    c = b.state(STATE_C, (1, HIDDEN))
    lstm = Scope(b, "lstm")
    h_t, c_t, hs = h, c, []
    for t in range(steps):
        h_t, c_t = lstm_step(lstm, w, lstm.slice(xproj, axis=0, start=t, stop=t + 1), h_t, c_t)
        hs.append(h_t)
    b.output("probs", head(b, w, concat_tree(lstm, hs, axis=0)))
    st = Scope(b, "state")
    st.copy_into(h, h_t)
    st.copy_into(c, c_t)


ENTRIES = {"stream": build_stream, "frontend": build_frontend, "recur": build_recur}
