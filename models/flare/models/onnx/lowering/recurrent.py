"""LSTM onto Flare's lstm recurrence; RNN and GRU unrolled over the bound sequence length."""
from __future__ import annotations

import numpy as np

from ..errors import OnnxError
from .base import F32, _need, cval, lowers


_LSTM_GATES = [0, 2, 3, 1]  # ONNX blocks i, o, f, c -> Flare's (PyTorch's) i, f, g(c), o


def _time_major(tr, node, x, seq_lens, layout: int):
    """x as [steps, batch, input] (ONNX layout 1 is batch-major), with its step and batch counts;
    sequence_lens, when given, must cover every step (shorter sequences are not supported)."""
    t = tr.t(x)
    if layout:
        t = tr.op("contiguous", tr.op("permute", t, axes=[1, 0, 2]))
    steps, batch = (x.shape[1], x.shape[0]) if layout else (x.shape[0], x.shape[1])
    if seq_lens is not None and np.any(np.asarray(tr.c(seq_lens)) != steps):
        raise OnnxError(f"{node.op_type} sequence_lens shorter than the sequence are not supported")
    return t, steps, batch


@lowers("LSTM")
def _lstm(tr, node, ins, attrs):
    """ONNX LSTM onto Flare's `lstm` recurrence: gates reordered, the input projection (plus
    both biases) one matmul, reverse directions on a flipped sequence. Default activations,
    no peepholes, no clip, full-length sequences."""
    x, w, r = (_need(v, n) for v, n in zip(ins[:3], ("X", "W", "R")))

    def opt(i):
        return ins[i] if len(ins) > i and ins[i] is not None else None

    b, seq_lens, h0, c0, peep = opt(3), opt(4), opt(5), opt(6), opt(7)
    if attrs.get("activations") not in (None, [b"Sigmoid", b"Tanh", b"Tanh"], ["Sigmoid", "Tanh", "Tanh"]):
        raise OnnxError(f"LSTM activations {attrs['activations']} (only the defaults)")
    if "clip" in attrs or attrs.get("input_forget", 0):
        raise OnnxError("LSTM clip / input_forget are not supported")
    if peep is not None and np.any(tr.c(peep)):
        raise OnnxError("LSTM peepholes are not supported")
    layout = int(attrs.get("layout", 0))
    t, steps, batch = _time_major(tr, node, x, seq_lens, layout)
    direction = attrs.get("direction", "forward")
    dirs = 2 if direction == "bidirectional" else 1
    hidden = r.shape[-1]
    wv, rv = np.asarray(tr.c(w), np.float32), np.asarray(tr.c(r), np.float32)
    bv = np.asarray(tr.c(b), np.float32) if b is not None else np.zeros((dirs, 8 * hidden), np.float32)

    def gates(m):
        return np.concatenate([m[k * hidden:(k + 1) * hidden] for k in _LSTM_GATES], axis=0)

    def state(v, d):
        if v is None:
            return tr.t(cval(np.zeros((batch, hidden), np.float32)))
        s = tr.t(v)
        if layout:
            s = tr.op("contiguous", tr.op("permute", s, axes=[1, 0, 2]))
        return tr.op("contiguous", tr.op("reshape", tr.op("slice", s, axis=0, start=d, stop=d + 1),
                                         shape=[batch, hidden]))

    ys, hs, cs = [], [], []
    for d in range(dirs):
        reverse = direction == "reverse" or d == 1
        seq = tr.op("flip", t, axis=0) if reverse else t
        proj = tr.op("matmul", seq, tr.t(cval(gates(wv[d]))), transpose_b=True)
        proj = tr.op("add", proj, tr.t(cval(gates(bv[d, :4 * hidden]) + gates(bv[d, 4 * hidden:]))))
        out = tr.op("lstm", proj, tr.t(cval(gates(rv[d]))), state(h0, d), state(c0, d))  # [T, B, 2H]
        y = tr.op("slice", out, axis=2, start=0, stop=hidden)
        last_h = tr.op("slice", y, axis=0, start=steps - 1, stop=steps)
        last_c = tr.op("slice", tr.op("slice", out, axis=2, start=hidden, stop=2 * hidden), axis=0,
                       start=steps - 1, stop=steps)
        if reverse:
            y = tr.op("flip", y, axis=0)
        ys.append(tr.op("reshape", tr.op("contiguous", y), shape=[steps, 1, batch, hidden]))
        hs.append(tr.op("contiguous", last_h))
        cs.append(tr.op("contiguous", last_c))
    y = ys[0] if dirs == 1 else tr.op("concat", ys[0], ys[1], axis=1)
    yh = hs[0] if dirs == 1 else tr.op("concat", hs[0], hs[1], axis=0)
    yc = cs[0] if dirs == 1 else tr.op("concat", cs[0], cs[1], axis=0)
    if layout:
        return [tr.val(tr.op("contiguous", tr.op("permute", y, axes=[2, 0, 1, 3])), (batch, steps, dirs, hidden), F32),
                tr.val(tr.op("contiguous", tr.op("permute", yh, axes=[1, 0, 2])), (batch, dirs, hidden), F32),
                tr.val(tr.op("contiguous", tr.op("permute", yc, axes=[1, 0, 2])), (batch, dirs, hidden), F32)]
    return [tr.val(y, (steps, dirs, batch, hidden), F32), tr.val(yh, (dirs, batch, hidden), F32),
            tr.val(yc, (dirs, batch, hidden), F32)]


@lowers("RNN", "GRU")
def _rnn_unrolled(tr, node, ins, attrs):
    """ONNX RNN and GRU unrolled over the (bound) sequence length: per step one matmul with the
    recurrent weights and the gate math as elementwise ops. Default activations, no clip,
    full-length sequences; reverse and bidirectional run the steps backwards."""
    x, w, r = (_need(v, n) for v, n in zip(ins[:3], ("X", "W", "R")))

    def opt(i):
        return ins[i] if len(ins) > i and ins[i] is not None else None

    b, seq_lens, h0 = opt(3), opt(4), opt(5)
    gru = node.op_type == "GRU"
    if attrs.get("activations") is not None or "clip" in attrs:
        raise OnnxError(f"{node.op_type} activations/clip other than the defaults")
    layout = int(attrs.get("layout", 0))
    t, steps, batch = _time_major(tr, node, x, seq_lens, layout)
    direction = attrs.get("direction", "forward")
    dirs = 2 if direction == "bidirectional" else 1
    hidden = r.shape[-1]
    gates = 3 if gru else 1
    wv, rv = np.asarray(tr.c(w), np.float32), np.asarray(tr.c(r), np.float32)
    bv = np.asarray(tr.c(b), np.float32) if b is not None else np.zeros((dirs, 2 * gates * hidden), np.float32)
    lbr = int(attrs.get("linear_before_reset", 0))
    ys, hs = [], []
    for d in range(dirs):
        reverse = direction == "reverse" or d == 1
        proj = tr.op("add", tr.op("matmul", t, tr.t(cval(wv[d])), transpose_b=True),
                     tr.t(cval(bv[d, :gates * hidden])))                      # [T, B, G*H]
        rb = bv[d, gates * hidden:]
        if h0 is None:
            h = tr.t(cval(np.zeros((batch, hidden), np.float32)))
        else:
            hsrc = tr.t(h0)
            if layout:
                hsrc = tr.op("contiguous", tr.op("permute", hsrc, axes=[1, 0, 2]))
            h = tr.op("reshape", tr.op("contiguous", tr.op("slice", hsrc, axis=0, start=d, stop=d + 1)),
                      shape=[batch, hidden])
        outs = [None] * steps
        for step in (range(steps - 1, -1, -1) if reverse else range(steps)):
            xt = tr.op("reshape", tr.op("contiguous", tr.op("slice", proj, axis=0, start=step, stop=step + 1)),
                       shape=[batch, gates * hidden])
            if not gru:
                hr = tr.op("add", tr.op("matmul", h, tr.t(cval(rv[d])), transpose_b=True), tr.t(cval(rb)))
                h = tr.op("tanh", tr.op("add", xt, hr))
            else:
                def part(v, k):
                    return tr.op("slice", v, axis=1, start=k * hidden, stop=(k + 1) * hidden)

                rz = tr.op("add", tr.op("matmul", h, tr.t(cval(rv[d][:2 * hidden])), transpose_b=True),
                           tr.t(cval(rb[:2 * hidden])))
                z = tr.op("sigmoid", tr.op("add", part(xt, 0), part(rz, 0)))
                rr = tr.op("sigmoid", tr.op("add", part(xt, 1), part(rz, 1)))
                rh_w, rh_b = tr.t(cval(rv[d][2 * hidden:])), tr.t(cval(rb[2 * hidden:]))
                if lbr:
                    hh = tr.op("mul", rr, tr.op("add", tr.op("matmul", h, rh_w, transpose_b=True), rh_b))
                else:
                    hh = tr.op("add", tr.op("matmul", tr.op("mul", rr, h), rh_w, transpose_b=True), rh_b)
                n = tr.op("tanh", tr.op("add", part(xt, 2), hh))
                h = tr.op("add", n, tr.op("mul", z, tr.op("sub", h, n)))   # (1 - z) n + z h
            outs[step] = h
        y = tr.op("reshape", outs[0], shape=[1, batch, hidden])
        for o in outs[1:]:
            y = tr.op("concat", y, tr.op("reshape", o, shape=[1, batch, hidden]), axis=0)
        ys.append(tr.op("reshape", tr.op("contiguous", y), shape=[steps, 1, batch, hidden]))
        hs.append(tr.op("reshape", outs[0 if reverse else steps - 1], shape=[1, batch, hidden]))
    y = ys[0] if dirs == 1 else tr.op("concat", ys[0], ys[1], axis=1)
    yh = hs[0] if dirs == 1 else tr.op("concat", hs[0], hs[1], axis=0)
    if layout:
        return [tr.val(tr.op("contiguous", tr.op("permute", y, axes=[2, 0, 1, 3])), (batch, steps, dirs, hidden), F32),
                tr.val(tr.op("contiguous", tr.op("permute", yh, axes=[1, 0, 2])), (batch, dirs, hidden), F32)]
    return [tr.val(y, (steps, dirs, batch, hidden), F32), tr.val(tr.op("contiguous", yh), (dirs, batch, hidden), F32)]
