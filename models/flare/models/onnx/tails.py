"""Tails: the segments after a checkpoint, re-derived for a new length read there instead of walked.

Why: a new Piper sentence of a seen length bucket replays its encoder and duration predictor,
reads the audio length F (the durations' sum) at a host step, and then walked the ~400 ONNX
nodes of the flow and decoder again to lower one segment of ~650 Flare ops (~50 ms of Python
a sentence, most of what a new sentence costs beyond a seen one). That segment is the same
ops for every F; only shapes, the parameters computed from them (reshape targets, slice ends)
and a few computed constants (Range's ramp, ConstantOfShape's fill) follow F.

How: every traced call whose last checkpoint is followed by exactly one read of a single
integer (F) and then only segments is a *sample* of that checkpoint's tail (keyed by the
input shapes, the checkpoint, the segments before it and the constants live there). Two
samples at different F are fitted (`fit`): the same tensors, ops, sources, names and dtypes;
every integer of a shape or parameter that differs is `a*F + b` with integers a, b; every
other value equal; a computed constant that differs is a fill of one value or a ramp (start +
step * k) in both. `CONFIRMATIONS` later walked samples must then be predicted exactly (the
same structure keys, feed and output shapes) before the template is used. A later call that
gives up its replay at that checkpoint (`Resume`) runs the template at its own F instead of
the walk: every op node is made again through the op's own rule (`GraphBuilder.op`: the
checks and the shape rule), and a shape differing from the fitted one, or a feed of another
shape, falls back to the walk. A template that mispredicts a walked sample is dropped.

Limits: a value computed from F that is equal at both samples and at every confirming one
is taken for a constant (a parameter like min(F, 4096), a bool F > 100 folded into a
weight); `CONFIRMATIONS` walks guard against that, the op rules against shapes. Not
thread-safe: the runner's lock covers it.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from numbers import Integral, Real
from typing import Any, Mapping, NamedTuple

import numpy as np

from flare.core.graph import INPUT, WEIGHT, GraphBuilder

from .replay import Recording, Resume, _src_sig
from .values import Val, from_flare_array, to_flare_array

CONFIRMATIONS = 1   # walked samples a fitted template must predict exactly before it is used
KEYS_KEPT = 32      # checkpoints whose samples and templates are kept (least recently used dropped)


class NoFit(Exception):
    """Two samples differ in a way `fit` does not model (or a template does not apply)."""


class Lin(NamedTuple):
    """An integer `a * F + b` of the length F read at the checkpoint."""

    a: int
    b: int


def _has_lin(p: Any) -> bool:
    if type(p) is Lin:
        return True
    if isinstance(p, (list, tuple)):
        return any(_has_lin(x) for x in p)
    if isinstance(p, dict):
        return any(_has_lin(x) for x in p.values())
    return False


def fit(x: Any, y: Any, f1: int, f2: int) -> Any:
    """A pattern giving `x` at F = f1 and `y` at F = f2: the value itself where equal,
    `Lin` for integers that differ by a multiple of f2 - f1; NoFit otherwise."""
    if isinstance(x, bool) or isinstance(y, bool) or x is None or y is None or isinstance(x, str):
        if type(x) is type(y) and x == y:
            return x
        raise NoFit(f"{x!r} / {y!r}")
    if isinstance(x, Integral) and isinstance(y, Integral):
        if x == y:
            return x
        num, den = int(y) - int(x), f2 - f1
        if num % den:
            raise NoFit(f"{x} / {y} is not affine in F ({f1} / {f2})")
        a = num // den
        return Lin(a, int(x) - a * f1)
    if isinstance(x, Real) and isinstance(y, Real):
        if x == y or (x != x and y != y):
            return x
        raise NoFit(f"{x!r} / {y!r}")
    if isinstance(x, (list, tuple)) and type(x) is type(y) and len(x) == len(y):
        parts = [fit(a, b, f1, f2) for a, b in zip(x, y)]
        return type(x)(parts) if any(_has_lin(p) for p in parts) else x
    if isinstance(x, dict) and isinstance(y, dict) and list(x) == list(y):
        parts = {k: fit(x[k], y[k], f1, f2) for k in x}
        return parts if any(_has_lin(p) for p in parts.values()) else x
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        if isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and _same(x, y):
            return x
        raise NoFit("arrays differ")
    if type(x) is type(y) and x == y:
        return x
    raise NoFit(f"{x!r} / {y!r}")


def subst(p: Any, f: int) -> Any:
    """The value of pattern `p` at F = f (containers without a `Lin` come back as they are)."""
    return _subst(p, f) if _has_lin(p) else p


def _subst(p: Any, f: int) -> Any:
    # `p` holds a Lin somewhere: containers are rebuilt whole (a parameter's lists are short)
    if type(p) is Lin:
        return p.a * f + p.b
    if isinstance(p, (list, tuple)):
        return type(p)(_subst(x, f) for x in p)
    if isinstance(p, dict):
        return {k: _subst(v, f) for k, v in p.items()}
    return p


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


def _equal(x: Any, y: Any) -> bool:
    """Equality of sources and output descriptions (tuples holding arrays among other values)."""
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and _same(x, y)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return list(x) == list(y) and all(_equal(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y


def _pattern_array(arr: np.ndarray) -> tuple | None:
    """("fill", value) or ("ramp", start, step) of an array's flat elements, else None."""
    flat = np.asarray(arr).reshape(-1)
    if flat.size == 0:
        return None
    if np.all(flat == flat[0]):
        return ("fill", flat[0].item())
    if flat.size > 1 and np.issubdtype(flat.dtype, np.number):
        start, step = flat[0].item(), (flat[1] - flat[0]).item()
        if _same(_make_array(("ramp", start, step), flat.shape, flat.dtype), flat):
            return ("ramp", start, step)
    return None


def _make_array(kind: tuple, shape: tuple, dtype: np.dtype) -> np.ndarray:
    if kind[0] == "fill":
        return np.full(shape, kind[1], dtype)
    n = int(np.prod(shape, dtype=np.int64))
    return (np.arange(n, dtype=dtype) * np.asarray(kind[2], dtype) + np.asarray(kind[1], dtype)).reshape(shape)


def _digest_name(arr: np.ndarray) -> str:
    from .runner import array_digest

    return f"c:{array_digest(arr)}"


class Sample(NamedTuple):
    """A walked tail: F, where F was read, and the events after it (segments with their tensors)."""

    f: int
    j: int                # event index of the checkpoint (the read is event j)
    obs_src: tuple
    obs_value: np.ndarray
    segs: list            # ("seg", Segment, ordinal, {feed: source}, summary)
    outputs: dict         # name -> (source, shape, dtype)
    host_steps: int


def tail_key(inputs_key: tuple, rec: Recording, j: int) -> tuple | None:
    """What a tail depends on besides F: the input shapes, the checkpoint (its node, the
    segments before it, the values live there with the constants' bytes)."""
    cp = rec.checkpoints.get(j)
    if cp is None:
        return None
    live = []
    for name, shape, dtype, src, fixed, runtime in cp.values:
        if src[0] == "const":
            a = np.ascontiguousarray(src[1])
            part = (a.dtype.str, a.shape, hashlib.blake2b(a.view(np.uint8).data if a.size else b"").hexdigest())
        else:
            part = _src_sig(src)
        live.append((name, shape, np.dtype(dtype).str, fixed, runtime, part))
    segs = tuple(s for s in rec.sigs[:j] if s[0] == "seg")
    return (inputs_key, cp.position, j, segs, tuple(live))


def sample_of(rec: Recording) -> tuple[int, Sample] | None:
    """The tail after `rec`'s last checkpoint when it is one integer read and then segments."""
    if not rec.valid or not rec.checkpoints or not rec.outputs:
        return None
    j = max(rec.checkpoints)
    tail = rec.events[j:]
    if len(tail) < 2 or tail[0][0] != "obs" or any(ev[0] != "seg" or ev[1].tensors is None for ev in tail[1:]):
        return None
    value = tail[0][2]
    if value.size != 1 or not np.issubdtype(value.dtype, np.integer) or tail[0][1][0] != "out":
        return None
    for src, _, _ in rec.outputs.values():
        if src[0] != "out" or src[1] <= j:
            return None
    return j, Sample(int(value.reshape(-1)[0]), j, tail[0][1], value, list(tail[1:]), dict(rec.outputs),
                     rec.host_steps - rec.checkpoints[j].host_steps)


class _SegTemplate(NamedTuple):
    ordinal: int
    specs: list           # per tensor: (role, name, dtype, op, src indices, params, params' Lin pattern or
    #                       None, shape, shape's Lin pattern or None, weight)
    outputs: dict         # output name -> tensor index
    feeds: dict           # feed name -> source pattern
    summary: dict


class Template:
    """A tail fitted from two samples; `build(f)` gives its segments at F = f."""

    def __init__(self, a: Sample, b: Sample):
        f1, f2 = a.f, b.f
        if f1 == f2 or len(a.segs) != len(b.segs) or _src_sig(a.obs_src) != _src_sig(b.obs_src) \
                or a.obs_src[:3] != b.obs_src[:3] or a.obs_value.dtype != b.obs_value.dtype \
                or a.obs_value.shape != b.obs_value.shape or a.j != b.j or a.host_steps != b.host_steps:
            raise NoFit("samples of another form")
        self.j, self.obs_src, self.host_steps = a.j, a.obs_src, a.host_steps
        self.obs_dtype, self.obs_shape = a.obs_value.dtype, a.obs_value.shape
        self.confirmed = 0
        self.segs = [self._fit_seg(x, y, f1, f2) for x, y in zip(a.segs, b.segs)]
        if list(a.outputs) != list(b.outputs):
            raise NoFit("outputs differ")
        self.outputs = {n: fit(a.outputs[n], b.outputs[n], f1, f2) for n in a.outputs}

    @staticmethod
    def _fit_seg(x: tuple, y: tuple, f1: int, f2: int) -> _SegTemplate:
        _, sx, ordinal, fx, summary = x
        _, sy, ordinal2, fy, _ = y
        if ordinal != ordinal2 or len(sx.tensors) != len(sy.tensors) or list(sx.feeds) != list(sy.feeds) \
                or list(fx) != list(fy) or list(sx.outputs) != list(sy.outputs):
            raise NoFit("segments of another structure")
        index = {t.id: i for i, t in enumerate(sx.tensors)}
        index_y = {t.id: i for i, t in enumerate(sy.tensors)}
        specs = []
        for tx, ty in zip(sx.tensors, sy.tensors):
            srcs = [index[s.id] for s in tx.srcs]
            if (tx.role, tx.op, tx.dtype, srcs) != (ty.role, ty.op, ty.dtype, [index_y[s.id] for s in ty.srcs]):
                raise NoFit(f"tensor {tx.name!r} differs")
            weight = None
            if tx.role == WEIGHT:
                if tx.name == ty.name:
                    weight = ("data", tx.data)
                else:
                    if not (tx.name.startswith("c:") and ty.name.startswith("c:")):
                        raise NoFit(f"weight {tx.name!r} differs")
                    ax, ay = np.asarray(tx.data), np.asarray(ty.data)
                    kind = _pattern_array(ax)
                    if kind is None or kind != _pattern_array(ay) or ax.dtype != ay.dtype:
                        raise NoFit(f"weight {tx.name!r} differs and is no fill or ramp")
                    weight = ("make", kind, ax.dtype)
            elif tx.name != ty.name:
                raise NoFit(f"tensor {tx.name!r} / {ty.name!r}")
            params = fit(tx.params, ty.params, f1, f2) if tx.op is not None else None
            shape = fit(tx.shape, ty.shape, f1, f2)
            # a pattern without a Lin is kept as None beside its value: `build` substitutes only what follows F
            specs.append((tx.role, tx.name, tx.dtype, tx.op, srcs, params, params if _has_lin(params) else None,
                          shape, shape if _has_lin(shape) else None, weight))
        outputs = {n: index[t.id] for n, t in sx.outputs.items()}
        if outputs != {n: index_y[t.id] for n, t in sy.outputs.items()}:
            raise NoFit("outputs differ")
        feeds = {}
        for n in fx:
            sa, sb = fx[n], fy[n]
            if sa[0] != sb[0]:
                raise NoFit(f"feed {n!r} from another source")
            if sa[0] == "random":
                if sa[1] != sb[1] or sa[5] != sb[5] or len(sa[4]) != len(sb[4]):
                    raise NoFit(f"feed {n!r}")
                ins = [None if (u is None) else (u.name, fit(u.shape, v.shape, f1, f2), u.dtype)
                       for u, v in zip(sa[4], sb[4])]
                feeds[n] = ("random", sa[1], sa[2], sa[3], ins, sa[5])
            else:
                feeds[n] = fit(sa, sb, f1, f2)
        return _SegTemplate(ordinal, specs, outputs, feeds, summary)

    def build(self, f: int) -> list[tuple]:
        """The segments at F = f: (Segment without feeds, ordinal, feed source patterns at f, summary).
        NoFit where an op's rule gives another shape than the fitted one."""
        from .runner import Segment

        out = []
        for st in self.segs:
            b = GraphBuilder()
            made = []
            digests: dict[str, str] = {}
            for role, name, dtype, op, srcs, params, lin_params, shape, lin_shape, weight in st.specs:
                if lin_shape is not None:
                    shape = _subst(lin_shape, f)
                if op is not None:
                    n = len(b._tensors)
                    t = b.op(op, *[made[i] for i in srcs], name=name,
                             **(params if lin_params is None else _subst(lin_params, f)))
                    if len(b._tensors) != n + 1 or t.shape != shape or t.dtype != dtype:
                        raise NoFit(f"{name}: the op's rule gives {t.shape} {t.dtype}, fitted {shape} {dtype}")
                elif role == INPUT:
                    t = b.input(name, shape, dtype)
                elif role == WEIGHT:
                    if weight[0] == "data":
                        t = b.weight(name, weight[1])
                    else:
                        arr = _make_array(weight[1], shape, weight[2])
                        name = _digest_name(arr)
                        t = b.weight(name, arr)
                    digests[name] = "file" if name.startswith("v:") else name[2:]
                else:
                    raise NoFit(f"a {role} leaf")
                made.append(t)
            outputs = {n: made[i] for n, i in st.outputs.items()}
            seg = Segment(made, outputs, {}, digests)
            feeds = {}
            for n, src in st.feeds.items():
                if src[0] == "random":  # the draw's input at this F (a random step reads its shape, dtype)
                    ins = [None if u is None else Val(u[0], tuple(subst(u[1], f)), u[2]) for u in src[4]]
                    feeds[n] = ("random", src[1], src[2], src[3], ins, src[5])
                else:
                    feeds[n] = subst(src, f)
            out.append((seg, st.ordinal, feeds, st.summary))
        return out

    def predicts(self, s: Sample) -> bool:
        """Whether the template at s.f is what the walk made (structure keys, feeds, outputs)."""
        try:
            built = self.build(s.f)
        except NoFit:
            return False
        if len(built) != len(s.segs):
            return False
        for (seg, ordinal, feeds, _), ev in zip(built, s.segs):
            walked = ev[1]
            if seg.key != walked.key or ordinal != ev[2] or list(feeds) != list(ev[3]):
                return False
            for n, src in feeds.items():
                if src[0] != "random" and not _equal(src, ev[3][n]):
                    return False
        return _equal({n: subst(p, s.f) for n, p in self.outputs.items()}, s.outputs)


class Tails:
    """Samples and templates by checkpoint (`tail_key`); see the module docstring."""

    def __init__(self, confirmations: int = CONFIRMATIONS):
        self.confirmations = confirmations
        self.samples: OrderedDict[tuple, Sample] = OrderedDict()
        self.templates: dict[tuple, Template] = {}

    def learn(self, inputs_key: tuple, rec: Recording) -> None:
        """Take a traced call's tail as a sample (before `Recordings.add` slims its segments)."""
        found = sample_of(rec)
        if found is None:
            return
        j, s = found
        key = tail_key(inputs_key, rec, j)
        if key is None:
            return
        prev = self.samples.pop(key, None)
        self.samples[key] = s
        while len(self.samples) > KEYS_KEPT:
            old, _ = self.samples.popitem(last=False)
            self.templates.pop(old, None)
        tpl = self.templates.get(key)
        if tpl is not None:
            if tpl.predicts(s):
                tpl.confirmed += 1
                return
            del self.templates[key]
        if prev is not None and prev.f != s.f:
            try:
                self.templates[key] = Template(prev, s)
            except NoFit:
                pass

    def run(self, runner: Any, inputs_key: tuple, resume: Resume) -> tuple[dict[str, np.ndarray], Recording] | None:
        """The call's outputs from a confirmed template at this checkpoint and its recording (a
        later call of the same sentence replays it), or None (walk)."""
        j = len(resume.events)
        rec = Recording()
        rec.events, rec.sigs = list(resume.events), list(resume.sigs)
        rec.checkpoints = {j: resume.checkpoint}
        key = tail_key(inputs_key, rec, j)
        tpl = self.templates.get(key) if key is not None else None
        if tpl is None or tpl.confirmed < self.confirmations:
            return None
        value = np.asarray(resume.value(tpl.obs_src))
        if value.dtype != tpl.obs_dtype or value.shape != tpl.obs_shape:
            return None
        f = int(value.reshape(-1)[0])
        try:
            built = tpl.build(f)
        except NoFit:
            return None
        self.samples.move_to_end(key)
        rec.events.append(("obs", tpl.obs_src, np.array(value, copy=True)))
        rec.sigs.append(("obs", _src_sig(tpl.obs_src), value.dtype.str, value.shape, value.tobytes()))
        results: dict[int, Mapping[str, np.ndarray]] = {}

        def resolve(src: tuple) -> Any:
            if src[0] == "out" and src[1] in results:
                return from_flare_array(results[src[1]][src[2]], src[3], src[4])
            return resume.value(src)

        summaries = list(resume.summaries)
        for seg, ordinal, feed_src, summary in built:
            feeds = {}
            for t in seg.tensors:
                if t.role == INPUT:
                    arr = to_flare_array(resolve(feed_src[t.name]), f"value {t.name!r}")
                    if tuple(arr.shape) != t.shape:
                        return None  # segments have no side effects: the walk runs them again
                    feeds[t.name] = arr
            seg = seg.with_feeds(feeds)
            results[len(rec.events)] = runner.execute_segment(seg, ordinal)
            rec.events.append(("seg", seg, ordinal, feed_src, summary))
            rec.sigs.append(("seg", seg.key, ordinal))
            summaries.append(summary)
        out = {}
        for n, p in tpl.outputs.items():
            src, shape, dtype = subst(p, f)
            rec.outputs[n] = (src, shape, dtype)
            out[n] = np.asarray(resolve(src)).reshape(shape).astype(dtype, copy=False)
        rec.host_steps = resume.checkpoint.host_steps + tpl.host_steps
        runner.last_segments = summaries
        runner.stats["host_steps"] += tpl.host_steps
        runner.stats["templated"] = runner.stats.get("templated", 0) + 1
        return out, rec
