"""Tails: the segments after a checkpoint, re-derived for a new length read there instead of walked.

Why: a new Piper sentence of a seen length bucket replays its encoder and duration predictor,
reads the audio length F (the durations' sum) at a host step, and then walked the ~400 ONNX
nodes of the flow and decoder again to lower one segment of ~650 Flare ops (~50 ms of Python
a sentence, most of what a new sentence costs beyond a seen one). That segment is the same
ops for every F; only shapes, the parameters computed from them (reshape targets, slice ends)
and a few computed constants (Range's ramp, ConstantOfShape's fill) follow F.

How: every traced call whose last checkpoint is followed by exactly one read of a single
integer (F) and then only segments is a *sample* of that checkpoint's tail (keyed by the
inputs' names, ranks and dtypes, the checkpoint's node and event index, and the values live
there: ranks, dtypes, sources, the constants' bytes). The samples are fitted (`Template`): the
same tensors, ops, sources, names and dtypes in each; every integer of a shape, parameter or
source that differs is an exact integer combination of the monomials of the lengths, (1, F),
or (1, F, T, F*T) where one input dim T varies too (Piper's length bucket: the encoder's
outputs the tail reads are [1, 192, T], the alignment [F, T]); every other value equal; a
computed constant that differs is a fill of one value or a ramp (start + step * k) in each.
The first independent samples determine the coefficients (`Solver`), and `CONFIRMATIONS`
more must give their values exactly; the template is then built at the latest sample's
lengths through the op rules and must make what its walk made (the same structure keys, feed
and output sources). A later call that gives up its replay at that checkpoint (`Resume`) runs
the template at its own F and T instead of the walk: every op node is made again through the
op's own rule (`GraphBuilder.op`: the checks and the shape rule), and a shape differing from
the fitted one, or a feed of another shape, falls back to the walk. A template that
mispredicts a later walked sample is fitted again.

Why the data itself cannot change a tail: a walk is a function of the shapes, the constants
and the values it reads (`Tracer.c`); a sample's tail read nothing but F, so at the same
lengths and live constants every call's walk reads nothing else and lowers the same ops (the
random draws it feeds are drawn afresh at the new shape, as a replay draws them).

Limits: a value computed from the lengths that the samples all give as the fitted form (a
parameter like min(F, 4096) while every sample was below it, a bool F > 100 folded into a
weight) is taken for that form; the confirming samples guard against that, the op rules
against wrong shapes. Not thread-safe: the runner's lock covers it.
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from fractions import Fraction
from numbers import Integral, Real
from typing import Any, Mapping, NamedTuple

import numpy as np

from flare.core.graph import INPUT, WEIGHT, GraphBuilder

from .replay import Recording, Resume, _same, _src_sig
from .values import Val, from_flare_array, to_flare_array

CONFIRMATIONS = 1   # samples beyond those that determine a fit, which it must also give exactly
SAMPLES_KEPT = 8    # walked samples kept per checkpoint
KEYS_KEPT = 32      # checkpoints whose samples and templates are kept (least recently used dropped)


class NoFit(Exception):
    """Samples differ in a way `fit` does not model (or a template does not apply)."""


class Lin(NamedTuple):
    """An integer sum(c * m) over the monomials of the lengths: (1, F), or (1, F, T, F*T) where
    one input dim T varies too (`monomials`)."""

    coeffs: tuple


def monomials(f: int, t: int | None) -> tuple:
    return (1, f) if t is None else (1, f, t, f * t)


class Solver:
    """Exact integer fits of values over the samples' monomial rows: the first rows that are
    independent determine the coefficients (in fractions; integers required), every row
    must then give its value."""

    def __init__(self, rows: list[tuple]):
        self.rows = rows
        ncols = len(rows[0])
        picked: list[int] = []
        basis: list[list] = []  # reduced rows of those picked (Gaussian elimination)
        for i, row in enumerate(rows):
            v = [Fraction(x) for x in row]
            for b in basis:
                lead = next(k for k, x in enumerate(b) if x)
                if v[lead]:
                    factor = v[lead] / b[lead]
                    v = [x - factor * y for x, y in zip(v, b)]
            if any(v):
                basis.append(v)
                picked.append(i)
            if len(picked) == ncols:
                break
        if len(picked) < ncols:
            raise NoFit(f"{len(rows)} samples do not determine {ncols} coefficients")
        m = [[Fraction(x) for x in rows[i]] + [Fraction(int(k == c)) for k in range(ncols)]
             for c, i in enumerate(picked)]
        for c in range(ncols):  # Gauss-Jordan: the picked rows' inverse
            p = next(r for r in range(c, ncols) if m[r][c])
            m[c], m[p] = m[p], m[c]
            m[c] = [x / m[c][c] for x in m[c]]
            for r in range(ncols):
                if r != c and m[r][c]:
                    m[r] = [x - m[r][c] * y for x, y in zip(m[r], m[c])]
        self.picked = picked
        # the inverse over a common denominator: solving is integer arithmetic (a fit solves thousands)
        inverse = [row[ncols:] for row in m]
        self.denominator = math.lcm(*(x.denominator for row in inverse for x in row))
        self.inverse = [[int(x * self.denominator) for x in row] for row in inverse]

    def solve(self, values: list[int]) -> Any:
        first = values[0]
        if all(v == first for v in values):
            return first
        d = self.denominator
        nums = [sum(row[c] * int(values[i]) for c, i in enumerate(self.picked)) for row in self.inverse]
        if any(n % d for n in nums):
            raise NoFit(f"{values} is no integer combination of the lengths")
        coeffs = tuple(n // d for n in nums)
        for row, v in zip(self.rows, values):
            if sum(c * m for c, m in zip(coeffs, row)) != v:
                raise NoFit(f"{values} does not follow the lengths")
        return Lin(coeffs)


def _has_lin(p: Any) -> bool:
    if type(p) is Lin:
        return True
    if isinstance(p, (list, tuple)):
        return any(_has_lin(x) for x in p)
    if isinstance(p, dict):
        return any(_has_lin(x) for x in p.values())
    return False


def fit(xs: list, solver: Solver) -> Any:
    """A pattern giving xs[i] at sample i: the value itself where all are equal, `Lin` for
    integers that follow the lengths exactly; NoFit otherwise."""
    x = xs[0]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        if all(type(y) is type(x) and y == x for y in xs):
            return x
        raise NoFit(f"{xs!r}")
    if isinstance(x, Integral):
        if not all(isinstance(y, Integral) and not isinstance(y, bool) for y in xs):
            raise NoFit(f"{xs!r}")
        return solver.solve(xs)
    if isinstance(x, Real):
        if all(isinstance(y, Real) and (y == x or (x != x and y != y)) for y in xs):
            return x
        raise NoFit(f"{xs!r}")
    if isinstance(x, (list, tuple)):
        if not all(type(y) is type(x) and len(y) == len(x) for y in xs):
            raise NoFit("containers differ")
        parts = [fit([y[k] for y in xs], solver) for k in range(len(x))]
        return type(x)(parts) if any(_has_lin(p) for p in parts) else x
    if isinstance(x, dict):
        if not all(isinstance(y, dict) and list(y) == list(x) for y in xs):
            raise NoFit("dicts differ")
        parts = {k: fit([y[k] for y in xs], solver) for k in x}
        return parts if any(_has_lin(p) for p in parts.values()) else x
    if isinstance(x, np.ndarray):
        if all(isinstance(y, np.ndarray) and _same(x, y) for y in xs):
            return x
        raise NoFit("arrays differ")
    if all(type(y) is type(x) and y == x for y in xs):
        return x
    raise NoFit(f"{xs!r}")


def subst(p: Any, mono: tuple) -> Any:
    """The value of pattern `p` at the lengths of `mono` (`monomials`); containers without a
    `Lin` come back as they are."""
    return _subst(p, mono) if _has_lin(p) else p


def _subst(p: Any, mono: tuple) -> Any:
    # `p` holds a Lin somewhere: containers are rebuilt whole (a parameter's lists are short)
    if type(p) is Lin:
        return sum(c * m for c, m in zip(p.coeffs, mono))
    if isinstance(p, (list, tuple)):
        return type(p)(_subst(x, mono) for x in p)
    if isinstance(p, dict):
        return {k: _subst(v, mono) for k, v in p.items()}
    return p


def compiled(p: Any) -> Any:
    """`lambda mono: _subst(p, mono)` as one Python expression (`build` evaluates ~650 shapes
    and parameter sets a call: the generic walk over the pattern was most of its time)."""
    consts: list = []

    def expr(q: Any) -> str:
        if type(q) is Lin:
            terms = [f"{c}*m[{k}]" for k, c in enumerate(q.coeffs) if c]
            return "(" + (" + ".join(terms) or "0") + ")"
        if _has_lin(q) and type(q) in (list, tuple, dict):
            if type(q) is dict:
                consts.extend(q)
                keys = range(len(consts) - len(q), len(consts))
                return "{" + ", ".join(f"K[{i}]: {expr(v)}" for i, v in zip(keys, q.values())) + "}"
            inner = ", ".join(expr(x) for x in q)
            return f"[{inner}]" if type(q) is list else f"({inner},)"
        consts.append(q)
        return f"K[{len(consts) - 1}]"

    text = expr(p)
    return eval(f"lambda m: {text}", {"K": consts})  # noqa: S307 (made here from ints and indices only)


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
    dims: tuple           # every dim of the call's inputs, in `Recordings.key` order
    j: int                # event index of the checkpoint (the read is event j)
    obs_src: tuple
    obs_value: np.ndarray
    segs: list            # ("seg", Segment, ordinal, {feed: source}, summary)
    outputs: dict         # name -> (source, shape, dtype)
    host_steps: int


def input_dims(inputs_key: tuple) -> tuple:
    return tuple(d for _, shape, _ in inputs_key for d in shape)


def tail_key(inputs_key: tuple, rec: Recording, j: int) -> tuple | None:
    """What a tail depends on besides the lengths: the inputs' names, ranks and dtypes, the
    checkpoint (its node and event index, the values live there: ranks, dtypes, sources, the
    constants' bytes)."""
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
        live.append((name, len(shape), np.dtype(dtype).str, fixed, runtime, part))
    inputs = tuple((n, len(shape), dtype) for n, shape, dtype in inputs_key)
    return (inputs, cp.position, j, tuple(live))


def sample_of(inputs_key: tuple, rec: Recording) -> tuple[int, Sample] | None:
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
    return j, Sample(int(value.reshape(-1)[0]), input_dims(inputs_key), j, tail[0][1], value, list(tail[1:]),
                     dict(rec.outputs), rec.host_steps - rec.checkpoints[j].host_steps)


class _SegTemplate(NamedTuple):
    ordinal: int
    specs: list           # per tensor: (role, name, dtype, op, src indices, params, params at given
    #                       monomials (`compiled`) or None, shape, the same of the shape, weight)
    outputs: dict         # output name -> tensor index
    feeds: dict           # feed name -> source pattern
    summary: dict


class Template:
    """A tail fitted from samples; `build(mono)` gives its segments at the lengths of `mono`."""

    def __init__(self, samples: list[Sample]):
        a = samples[0]
        varying = [k for k in range(len(a.dims)) if any(s.dims[k] != a.dims[k] for s in samples)]
        if len(varying) > 1:
            raise NoFit("more than one input dim varies")
        self.t_axis = varying[0] if varying else None
        self.fixed = {k: d for k, d in enumerate(a.dims) if k != self.t_axis}
        rows = [monomials(s.f, None if self.t_axis is None else s.dims[self.t_axis]) for s in samples]
        if len(set(rows)) < len(rows[0]) + CONFIRMATIONS:
            raise NoFit("too few samples")
        solver = Solver(rows)
        for s in samples[1:]:
            if len(s.segs) != len(a.segs) or _src_sig(s.obs_src) != _src_sig(a.obs_src) \
                    or s.obs_src[:3] != a.obs_src[:3] or s.obs_value.dtype != a.obs_value.dtype \
                    or s.obs_value.shape != a.obs_value.shape or s.j != a.j or s.host_steps != a.host_steps \
                    or list(s.outputs) != list(a.outputs):
                raise NoFit("samples of another form")
        self.j, self.obs_src, self.host_steps = a.j, a.obs_src, a.host_steps
        self.obs_dtype, self.obs_shape = a.obs_value.dtype, a.obs_value.shape
        self.segs = [self._fit_seg([s.segs[k] for s in samples], solver) for k in range(len(a.segs))]
        self.outputs = {n: fit([s.outputs[n] for s in samples], solver) for n in a.outputs}

    def monomials(self, f: int, dims: tuple) -> tuple | None:
        """The monomials of a call's lengths, or None where a dim the samples shared differs."""
        if len(dims) != len(self.fixed) + (self.t_axis is not None) or \
                any(dims[k] != d for k, d in self.fixed.items()):
            return None
        return monomials(f, None if self.t_axis is None else dims[self.t_axis])

    @staticmethod
    def _fit_seg(evs: list, solver: Solver) -> _SegTemplate:
        segs = [ev[1] for ev in evs]
        x, fx, ordinal, summary = segs[0], evs[0][3], evs[0][2], evs[0][4]
        for ev in evs[1:]:
            if ev[2] != ordinal or len(ev[1].tensors) != len(x.tensors) or list(ev[1].feeds) != list(x.feeds) \
                    or list(ev[3]) != list(fx) or list(ev[1].outputs) != list(x.outputs):
                raise NoFit("segments of another structure")
        indices = [{t.id: i for i, t in enumerate(seg.tensors)} for seg in segs]
        specs = []
        for k, tx in enumerate(x.tensors):
            ts = [seg.tensors[k] for seg in segs]
            srcs = [indices[0][s.id] for s in tx.srcs]
            for t, index in zip(ts[1:], indices[1:]):
                if (t.role, t.op, t.dtype) != (tx.role, tx.op, tx.dtype) or [index[s.id] for s in t.srcs] != srcs:
                    raise NoFit(f"tensor {tx.name!r} differs")
            weight = None
            if tx.role == WEIGHT and any(t.name != tx.name for t in ts):
                arrays = [np.asarray(t.data) for t in ts]
                kind = _pattern_array(arrays[0])
                if not all(t.name.startswith("c:") for t in ts) or kind is None or \
                        any(a.dtype != arrays[0].dtype or _pattern_array(a) != kind for a in arrays[1:]):
                    raise NoFit(f"weight {tx.name!r} differs and is no fill or ramp")
                weight = ("make", kind, arrays[0].dtype)
            elif tx.role == WEIGHT:
                weight = ("data", tx.data)
            elif any(t.name != tx.name for t in ts):
                raise NoFit(f"tensor {tx.name!r} differs")
            params = fit([t.params for t in ts], solver) if tx.op is not None else None
            shape = fit([t.shape for t in ts], solver)
            # a pattern without a Lin is kept as None beside its value: `build` substitutes only what follows
            specs.append((tx.role, tx.name, tx.dtype, tx.op, srcs, params,
                          compiled(params) if _has_lin(params) else None,
                          shape, compiled(shape) if _has_lin(shape) else None, weight))
        outputs = {n: indices[0][t.id] for n, t in x.outputs.items()}
        for seg, index in zip(segs[1:], indices[1:]):
            if outputs != {n: index[t.id] for n, t in seg.outputs.items()}:
                raise NoFit("outputs differ")
        feeds = {}
        for n, sa in fx.items():
            srcs = [ev[3][n] for ev in evs]
            if any(s[0] != sa[0] for s in srcs):
                raise NoFit(f"feed {n!r} from another source")
            if sa[0] == "random":
                if any(s[1] != sa[1] or s[5] != sa[5] or len(s[4]) != len(sa[4]) for s in srcs):
                    raise NoFit(f"feed {n!r}")
                ins = [None if u is None else (u.name, fit([s[4][k].shape for s in srcs], solver), u.dtype)
                       for k, u in enumerate(sa[4])]
                feeds[n] = ("random", sa[1], sa[2], sa[3], ins, sa[5])
            else:
                feeds[n] = fit(srcs, solver)
        return _SegTemplate(ordinal, specs, outputs, feeds, summary)

    def build(self, mono: tuple) -> list[tuple]:
        """The segments at these lengths: (Segment without feeds, ordinal, feed source patterns
        there, summary). NoFit where an op's rule gives another shape than the fitted one."""
        from .runner import Segment

        out = []
        for st in self.segs:
            b = GraphBuilder()
            made = []
            digests: dict[str, str] = {}
            for role, name, dtype, op, srcs, params, lin_params, shape, lin_shape, weight in st.specs:
                if lin_shape is not None:
                    shape = lin_shape(mono)
                if op is not None:
                    n = len(b._tensors)
                    t = b.op(op, *[made[i] for i in srcs], name=name,
                             **(params if lin_params is None else lin_params(mono)))
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
                if src[0] == "random":  # the draw's input at these lengths (a random step reads its shape, dtype)
                    ins = [None if u is None else Val(u[0], tuple(subst(u[1], mono)), u[2]) for u in src[4]]
                    feeds[n] = ("random", src[1], src[2], src[3], ins, src[5])
                else:
                    feeds[n] = subst(src, mono)
            out.append((seg, st.ordinal, feeds, st.summary))
        return out

    def predicts(self, s: Sample) -> bool:
        """Whether the template at s's lengths is what the walk made (structure keys, feeds, outputs)."""
        mono = self.monomials(s.f, s.dims)
        if mono is None:
            return False
        try:
            built = self.build(mono)
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
        return _equal({n: subst(p, mono) for n, p in self.outputs.items()}, s.outputs)


class Tails:
    """Samples and templates by checkpoint (`tail_key`); see the module docstring."""

    def __init__(self) -> None:
        self.samples: OrderedDict[tuple, list[Sample]] = OrderedDict()
        self.templates: dict[tuple, Template] = {}

    def learn(self, inputs_key: tuple, rec: Recording) -> None:
        """Take a traced call's tail as a sample (before `Recordings.add` slims its segments),
        and fit the checkpoint's samples again."""
        found = sample_of(inputs_key, rec)
        if found is None:
            return
        j, s = found
        key = tail_key(inputs_key, rec, j)
        if key is None:
            return
        samples = [x for x in self.samples.pop(key, []) if (x.f, x.dims) != (s.f, s.dims)] + [s]
        del samples[:-SAMPLES_KEPT]
        self.samples[key] = samples
        while len(self.samples) > KEYS_KEPT:
            old, _ = self.samples.popitem(last=False)
            self.templates.pop(old, None)
        tpl = self.templates.pop(key, None)
        if tpl is not None and tpl.predicts(s):
            self.templates[key] = tpl
            return
        try:
            tpl = Template(samples)
        except NoFit:
            return
        if tpl.predicts(s):  # the op rules at the latest sample's lengths give what its walk made
            self.templates[key] = tpl

    def run(self, runner: Any, inputs_key: tuple, resume: Resume) -> tuple[dict[str, np.ndarray], Recording] | None:
        """The call's outputs from a confirmed template at this checkpoint and its recording (a
        later call of the same sentence replays it), or None (walk)."""
        j = len(resume.events)
        rec = Recording()
        rec.resumed(resume)
        key = tail_key(inputs_key, rec, j)
        tpl = self.templates.get(key) if key is not None else None
        if tpl is None:
            return None
        value = np.asarray(resume.value(tpl.obs_src))
        if value.dtype != tpl.obs_dtype or value.shape != tpl.obs_shape:
            return None
        mono = tpl.monomials(int(value.reshape(-1)[0]), input_dims(inputs_key))
        if mono is None:
            return None
        try:
            built = tpl.build(mono)
        except NoFit:
            return None
        self.samples.move_to_end(key)
        rec.observed(tpl.obs_src, value)
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
            src, shape, dtype = subst(p, mono)
            rec.outputs[n] = (src, shape, dtype)
            out[n] = np.asarray(resolve(src)).reshape(shape).astype(dtype, copy=False)
        rec.host_steps = resume.checkpoint.host_steps + tpl.host_steps
        runner.last_segments = summaries
        runner.stats["host_steps"] += tpl.host_steps
        runner.stats["templated"] = runner.stats.get("templated", 0) + 1
        return out, rec
