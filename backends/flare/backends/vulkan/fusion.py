"""Chaining consecutive elementwise dispatches into one (`shaders/eltwise_chain.comp`).

A split lowers node by node; runs of `eltwise` dispatches (binary, scale, unary) that all
read and write f32 and produce one output shape become one dispatch whose invocation e
computes element e of every node in order, keeping earlier results in registers. Fewer
dispatches and barriers (a silero LSTM step: 9 dispatches -> 4), the same numbers: each
node still rounds to f32 and still stores its output, so nothing outside the chain changes.

Correctness rests on one rule: inside a chain, memory at element e is touched only by
invocation e. So an operand is taken from a register when it is exactly an earlier node's
output (same buffer, offset, shape, strides); any other read that overlaps an earlier
output, or a write that overlaps an earlier read or write other than the same element
(same descriptor), ends the chain there. This needs no knowledge of other consumers.
"""
from __future__ import annotations

from typing import Any

from .lowering import Dispatch, TensorArg, f32_bits, u32

MAX_OPS = 8
N_SLOTS = 16
N_BUFFERS = 6
SCALE_MODE = 10
PARAM_MODES = (SCALE_MODE, 20)  # modes whose two factors are params (scale; leaky_relu)


def _key(a: TensorArg) -> tuple:
    return (id(a.binding.buffer), a.elem_offset, tuple(a.shape), tuple(a.strides))


def _span(a: TensorArg) -> tuple[int, int, int]:
    lo, hi = a.byte_range()
    return id(a.binding.buffer), lo, hi


def _overlap(x: tuple[int, int, int], y: tuple[int, int, int]) -> bool:
    return x[0] == y[0] and x[1] < y[2] and y[1] < x[2]


def _chainable(d: Dispatch) -> bool:
    return d.shader == "eltwise" and all(a.binding.dtype == "f32" for a in d.args)


class _Chain:
    def __init__(self, first: Dispatch):
        self.ops: list[tuple[Dispatch, list[int | tuple[str, int]], int]] = []
        self.slots: list[TensorArg] = []
        self.buffers: list[Any] = []
        self.reads: list[tuple] = []     # (span, key) of slot reads
        self.outs: list[tuple] = []      # (span, key) of outputs, in node order
        self.shape = tuple(first.args[2].shape)
        self.name = first.node

    def _slot(self, a: TensorArg) -> int | None:
        for i, s in enumerate(self.slots):
            if _key(s) == _key(a):
                return i
        if len(self.slots) == N_SLOTS:
            return None
        buf = a.binding.buffer
        if buf not in self.buffers:
            if len(self.buffers) == N_BUFFERS:
                return None
            self.buffers.append(buf)
        self.slots.append(a)
        return len(self.slots) - 1

    def add(self, d: Dispatch) -> bool:
        """Append `d` if the rule of the module docstring allows; False (chain unchanged) if not."""
        if len(self.ops) == MAX_OPS or tuple(d.args[2].shape) != self.shape:
            return False
        binary = d.spec[0] < SCALE_MODE
        srcs = d.args[:2] if binary else d.args[:1]
        refs: list[Any] = []
        new_reads = []
        for a in srcs:
            k = _key(a)
            producer = next((j for j in range(len(self.outs) - 1, -1, -1) if self.outs[j][1] == k), None)
            if producer is not None:
                refs.append(("reg", producer))
                continue
            span = _span(a)
            if any(_overlap(span, o[0]) for o in self.outs):
                return False  # reads an earlier output at other elements
            refs.append(a)
            new_reads.append((span, k))
        out = d.args[2]
        ospan, okey = _span(out), _key(out)
        for span, k in self.reads + new_reads + self.outs:
            if _overlap(ospan, span) and k != okey:
                return False  # would overwrite elements other invocations read or wrote
        saved = (list(self.slots), list(self.buffers))
        idx = []
        for r in refs + [out]:
            if isinstance(r, tuple):
                idx.append(r)
                continue
            s = self._slot(r)
            if s is None:
                self.slots, self.buffers = saved
                return False
            idx.append(s)
        self.ops.append((d, idx[:-1], idx[-1]))
        self.reads += new_reads
        self.outs.append((ospan, okey))
        return True

    def dispatch(self) -> Dispatch:
        """One eltwise_chain dispatch: the program as specialization constants, scales as params."""
        spec = [0, 0, 0, 0, 0, len(self.ops)]
        params = []
        for d, refs, out in self.ops:
            enc = [N_SLOTS + r[1] if isinstance(r, tuple) else r for r in refs]
            spec += [d.spec[0], enc[0], enc[-1], out]
            params += [d.params[0], d.params[1]] if d.spec[0] in PARAM_MODES else [f32_bits(1.0), 0]
        spec += [0, 0, 0, 0] * (MAX_OPS - len(self.ops))
        slots = self.slots + [self.slots[0]] * (N_SLOTS - len(self.slots))
        spec += [self.buffers.index(s.binding.buffer) for s in slots]
        outs = {out for _, _, out in self.ops}
        first = self.ops[0][0]
        return Dispatch(f"{self.name}+{len(self.ops) - 1}", "eltwise_chain", tuple(spec), slots, [u32(p) for p in params],
                        first.groups, writes=sorted(outs),
                        buffers=self.buffers + [self.buffers[0]] * (N_BUFFERS - len(self.buffers)))


def chain_elementwise(dispatches: list[Dispatch], max_storage_buffers: int = N_BUFFERS + 1) -> list[Dispatch]:
    """The dispatches with every run of two or more chainable elementwise dispatches merged
    (unchanged on a device with fewer storage-buffer bindings per stage than the chain's 7)."""
    if max_storage_buffers < N_BUFFERS + 1:
        return list(dispatches)
    out: list[Dispatch] = []
    chain: _Chain | None = None

    def close() -> None:
        if chain is None:
            return
        if len(chain.ops) == 1:
            out.append(chain.ops[0][0])
        else:
            out.append(chain.dispatch())

    for d in dispatches:
        if _chainable(d):
            if chain is not None and chain.add(d):
                continue
            close()
            chain = _Chain(d)
            if not chain.add(d):  # cannot even start one (too many buffers): leave it alone
                out.append(d)
                chain = None
            continue
        close()
        chain = None
        out.append(d)
    close()
    return out
