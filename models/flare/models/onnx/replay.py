"""Record a call's trace and replay it for a later call, skipping the Python walk over the nodes.

Why: tracing Piper's 2,755 nodes costs about as much CPU as onnxruntime's whole run, and a
trace is a pure function of what it looked at: the input shapes and dtypes, and the values
it *read* from the data (`Tracer.c` on a runtime value: a Reshape target computed on the
device, an If condition, the durations that set the audio length). Everything else it fed to
a segment came from a model input, a segment's output, a host step over values it read
(NonZero...), or a random draw. So a recording is the list of segments executed (with where
each feed comes from) and of the values read (with where each came from); a later call with
the same input shapes and dtypes replays it: it runs the same segments on the new data and
checks every value read against the recorded one. On the first difference it switches to
another recording with the same history that read that value, or gives up, and the runner
traces the call (recording it too). Giving up after some segments ran wastes nothing: a
segment has no side effects, and the trace that follows takes their results (`runner.reuse`)
where it closes a segment of the same structure and place on equal feeds (a new sentence of
a length seen before: its encoder ran in the replay, up to the durations that differ). The
feeds are only equal if the trace draws what the replay drew (Piper's duration predictor takes a
RandomNormalLike draw, scaled by noise_w): the trace adopts the replay's draw of each random node
(`runner.reuse_draws`) instead of drawing again, else it ran Piper's encoder a second time.

Giving up does not mean walking the nodes again from the start: a recording keeps a
*checkpoint* at each segment it closed at the top level (`Checkpoint`: the node whose host
step closed it, the live values with their sources, the op counters). A replay that
diverges resumes the trace at the last checkpoint it reached (`Resume`): the live values
are the replay's own arrays (segment outputs, inputs, draws), and the walk starts at that
node. Piper: a new sentence whose padded length was seen before replays its encoder and
duration predictor and walks only the nodes from the durations on (the decoder).

A recording is only kept when every feed, read value and output had a known source (a value
from anywhere else, e.g. a branch output copied by a lowering, makes the trace unreplayable;
the runner then just traces). Not thread-safe: the runner's lock covers it.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from .values import from_flare_array, to_flare_array


class NeedsTrace(Exception):
    """Raised by the runner for a recorded segment it cannot run without its tensors."""


DETERMINISTIC_HOST_STEPS = frozenset({"NonZero", "Unique", "Compress", "NonMaxSuppression"})
RANDOM_HOST_STEPS = frozenset({"RandomNormalLike", "RandomUniformLike"})
RECORDINGS_PER_SHAPE, SHAPES_KEPT = 16, 32  # a recording holds slim segments (Segment.slim) and read values: bounded


class Checkpoint(NamedTuple):
    """The trace's state where a top-level node's host step closed a segment: what a resumed
    trace needs to walk on from that node (`position`) as if the nodes before it had run."""

    position: int                 # the node whose lowering closed the segment: walked again
    ordinal: int                  # the next segment's ordinal
    count: int                    # op and anonymous-constant counters at that node's start
    anon: int
    host_steps: int               # host steps before it
    values: tuple                 # (name, shape, dtype, source, fixed, runtime) of each live value


class Resume(NamedTuple):
    """A replay that gave up at a checkpoint: the events before it and the values of this call."""

    checkpoint: Checkpoint
    events: list
    sigs: list
    value: Callable[[tuple], Any]  # a source -> this call's array (the replay's resolver)
    summaries: list


class Recording:
    """Events of one traced call: ("seg", segment, ordinal, {feed: source}, summary) and
    ("obs", source, value); the outputs' sources; `sigs` says what each event was, to match
    histories."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.sigs: list[tuple] = []
        self.outputs: dict[str, tuple] = {}
        self.host_steps = 0
        self.valid = True
        self._src: dict[int, tuple] = {}      # id(const array) -> source
        self._keep: list[Any] = []           # keeps those arrays alive (ids stay unique)
        self.feeds: dict[str, tuple] = {}     # feed sources of the segment being traced
        self.checkpoints: dict[int, Checkpoint] = {}  # event count when taken -> checkpoint

    # -- while tracing ------------------------------------------------------------------
    def mark(self, value: Any, src: tuple) -> None:
        if value is None:
            return
        if id(value) in self._src and self._src[id(value)][:2] != src[:2]:
            self.valid = False               # one array for two sources (e.g. an input passed twice)
        self._src[id(value)] = src
        self._keep.append(value)

    def known_source(self, v: Any) -> tuple | None:
        """v's source without judging the recording (None: unknown, or no value yet)."""
        if v.const is None:
            return None
        src = self._src.get(id(v.const))
        return src if src is not None or v.runtime else ("const", v.const)

    def checkpoint(self, cp: Checkpoint) -> None:
        self.checkpoints[len(self.events)] = cp

    def resumed(self, resume: Resume) -> None:
        """Start this recording with the events a replay ran before `resume`'s checkpoint, and
        that checkpoint (the resumed walk does not close a segment there again: without it, a
        later replay of this recording diverging at the same read traced the whole call)."""
        self.events = list(resume.events)
        self.sigs = list(resume.sigs)
        self.checkpoints[len(self.events)] = resume.checkpoint

    def source(self, v: Any) -> tuple | None:
        if v.const is None:
            return None
        src = self._src.get(id(v.const))
        if src is None and not v.runtime:
            src = ("const", v.const)          # the file's, or folded from shapes: the same for these shapes
        if src is None:
            self.valid = False
        return src

    def feed(self, leaf_name: str, v: Any) -> None:
        src = self.source(v)
        if src is not None:
            self.feeds[leaf_name] = src

    def segment(self, seg: Any, ordinal: int, summary: dict, wanted: list[tuple[str, Any]]) -> int:
        index = len(self.events)
        self.events.append(("seg", seg, ordinal, self.feeds, summary))
        self.sigs.append(("seg", seg.key, ordinal))
        self.feeds = {}
        return index

    def closed(self, index: int, wanted: list[tuple[str, Any]]) -> None:
        """The segment at `index` ran: its outputs' arrays are values of known source."""
        for out, v in wanted:
            self.mark(v.const, ("out", index, out, v.shape, v.dtype))

    def observe(self, v: Any) -> None:
        if not v.runtime:
            return                            # not data: the same for these input shapes
        src = self.source(v)
        if src is not None:
            self.observed(src, v.const)

    def observed(self, src: tuple, value: Any) -> None:
        """A read of the value from `src` (copied): an event, and its signature a replay must match."""
        value = np.array(value, copy=True)
        self.events.append(("obs", src, value))
        self.sigs.append(("obs", _src_sig(src), value.dtype.str, value.shape, value.tobytes()))

    def host_step(self, node: Any, fn: Callable, ins: list, outs: list) -> None:
        if node.op_type in DETERMINISTIC_HOST_STEPS:
            for o in outs:                    # a function of values it read (observed)
                if o is not None:
                    self.mark(o.const, ("const", o.const))
        elif node.op_type in RANDOM_HOST_STEPS:
            for k, o in enumerate(outs):
                if o is not None:
                    self.mark(o.const, ("random", id(node), fn, node, list(ins), k))
        # anything else stays unknown: fed or read, it makes the recording invalid

    def finish(self, env: Mapping[str, Any], names: list[str]) -> None:
        for n in names:
            src = self.source(env[n])
            if src is None:
                return
            self.outputs[n] = (src, env[n].shape, env[n].dtype)
        self._src = {}
        self._keep = []


def _src_sig(src: tuple) -> tuple:
    return src[:3] if src[0] in ("out",) else src[:2] if src[0] == "input" else (src[0],)


class Recordings:
    """Recordings by input shapes and dtypes (a few per shape: sentences of one length)."""

    def __init__(self) -> None:
        self.by_shape: OrderedDict[tuple, list[Recording]] = OrderedDict()

    @staticmethod
    def key(inputs: Mapping[str, np.ndarray]) -> tuple:
        return tuple(sorted((n, a.shape, a.dtype.str) for n, a in inputs.items()))

    def add(self, key: tuple, rec: Recording) -> None:
        if not rec.valid or len(rec.outputs) == 0:
            return
        rec.events = [("seg", ev[1].slim(), *ev[2:]) if ev[0] == "seg" else ev for ev in rec.events]
        recs = self.by_shape.setdefault(key, [])
        recs.append(rec)
        del recs[:-RECORDINGS_PER_SHAPE]
        self.by_shape.move_to_end(key)
        while len(self.by_shape) > SHAPES_KEPT:
            self.by_shape.popitem(last=False)

    def replay(self, runner: Any, key: tuple, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The call's outputs by replaying a recording, or None (trace it)."""
        cands = self.by_shape.get(key)
        if not cands:
            return None
        self.by_shape.move_to_end(key)
        rec = cands[-1]
        results: dict[int, Mapping[str, np.ndarray]] = {}
        draws: dict[int, list] = {}
        summaries = []

        ran: dict[tuple, tuple] = {}      # (segment key, ordinal) -> (feeds, results): see `runner.reuse`

        def give_up(at: int) -> None:
            """Trace from the last checkpoint before event `at` (the segments so far are reused)."""
            runner.reuse = ran
            runner.reuse_draws = draws        # the trace draws what the replay drew: its feeds then match `ran`'s
            marks = [j for j in rec.checkpoints if j <= at]
            if marks:
                j = max(marks)
                runner.resume = Resume(rec.checkpoints[j], rec.events[:j], rec.sigs[:j], value,
                                       summaries[:sum(1 for ev in rec.events[:j] if ev[0] == "seg")])

        def value(src: tuple) -> Any:
            kind = src[0]
            if kind == "input":
                return inputs[src[1]]
            if kind == "out":
                return from_flare_array(results[src[1]][src[2]], src[3], src[4])
            if kind == "const":
                return src[1]
            if kind == "random":
                if src[1] not in draws:
                    draws[src[1]] = [o.const if o is not None else None for o in src[2](None, src[3], src[4])]
                return draws[src[1]][src[5]]
            raise AssertionError(kind)

        i = 0
        while i < len(rec.events):
            ev = rec.events[i]
            if ev[0] == "seg":
                _, seg, ordinal, feed_src, summary = ev
                feeds = {}
                for name, want in seg.feeds.items():
                    arr = to_flare_array(value(feed_src[name]), f"value {name!r}")
                    if arr.shape != want.shape or arr.dtype != want.dtype:
                        give_up(i)
                        return None
                    feeds[name] = arr
                try:
                    results[i] = runner.execute_segment(seg.with_feeds(feeds), ordinal)
                except NeedsTrace:            # its plan was evicted: trace (the segments so far are reused)
                    give_up(i)
                    return None
                ran[(seg.key, ordinal)] = (feeds, results[i])
                summaries.append(summary)
                i += 1
                continue
            got = np.asarray(value(ev[1]))
            if _same(got, ev[2]):
                i += 1
                continue
            other = next((r for r in cands if r is not rec and len(r.events) > i and r.sigs[:i] == rec.sigs[:i]
                          and r.events[i][0] == "obs" and _same(got, r.events[i][2])), None)
            if other is None:
                give_up(i)                    # the trace resumes, or runs these segments again
                return None
            rec = other
            i += 1
        runner.last_segments = summaries
        runner.stats["host_steps"] += rec.host_steps
        runner.stats["replayed"] = runner.stats.get("replayed", 0) + 1
        out = {}
        for n, (src, shape, dtype) in rec.outputs.items():
            out[n] = np.asarray(value(src)).reshape(shape).astype(dtype, copy=False)
        return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)
