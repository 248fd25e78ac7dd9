"""Allocation planning: liveness-based offsets in one arena per device (gallocr-style).

Input is a list of `Interval`s — one per tensor that needs arena memory on a
device — with the time it is produced and the time of its last use, plus
optional in-place parents. Times come from the schedule (node order; copies
just before their split). The planner walks time forward: at each time it first
places the tensors produced then (best fit among free blocks; an in-place
tensor takes its parent's block), *then* frees the tensors whose last use was
that time — so a node's output never overlaps an input it is still reading.

Blocks are carved from chunks no larger than the buffer type's maximum size
(ggml's multi-chunk arenas); offsets and sizes are aligned. Graph outputs live
to the end. `reserve()` is the dry run: it returns chunk sizes without
allocating anything.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, NamedTuple

from .errors import AllocationError
from .ops import OPS

if TYPE_CHECKING:
    from .backend import Device
    from .partition import Schedule

END = 1 << 62


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass
class Interval:
    """A tensor's need for arena memory: [start, end] in schedule time, inclusive."""

    key: int
    nbytes: int
    start: int
    end: int
    inplace_of: int | None = None  # key of a tensor whose block this one may take over


class Placement(NamedTuple):
    """Where one tensor lives: chunk index, byte offset, bytes. A named tuple (immutable, as the
    frozen dataclass it was): a new plan makes one per tensor, ~3x cheaper to make."""

    chunk: int
    offset: int
    nbytes: int


@dataclass
class DevicePlan:
    """Where each tensor lives in the device's arena, and how big each chunk is."""

    device: str
    chunks: list[int]
    placements: dict[int, Placement]
    lower_bound: int = 0   # max over time of live aligned bytes (no reuse tricks)
    naive: int = 0         # one buffer per tensor
    inplace: int = 0       # tensors that took over a parent's block

    @property
    def total(self) -> int:
        return sum(self.chunks)


@dataclass
class _Chunk:
    size: int = 0
    free: list[tuple[int, int]] = field(default_factory=list)  # (offset, size), sorted, merged

    def take(self, offset: int, size: int) -> None:
        free = self.free
        i = bisect.bisect_left(free, (offset,))
        if i == len(free) or free[i][0] != offset:
            raise AssertionError("planner: block not free")
        s = free[i][1]
        free[i:i + 1] = [] if s == size else [(offset + size, s - size)]

    def give(self, offset: int, size: int) -> None:
        """Return a block, merged with the free blocks it touches (the list stays sorted and
        merged: no two free blocks touch), by bisection rather than a sort per free."""
        free = self.free
        i = bisect.bisect_left(free, (offset,))
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:
            i -= 1
            offset, size = free[i][0], free[i][1] + size
            del free[i]
        if i < len(free) and offset + size == free[i][0]:
            size += free[i][1]
            del free[i]
        free.insert(i, (offset, size))


class _Allocator:
    """Best fit over free blocks; otherwise grow a chunk at its end; otherwise a new chunk."""

    def __init__(self, device: str, alignment: int, max_size: int):
        self.device = device
        self.max_size = max_size
        self.chunks: list[_Chunk] = []

    def alloc(self, size: int) -> tuple[int, int]:
        if size > self.max_size:
            raise AllocationError(self.device, size, None,  # plan_schedule adds the device's free bytes
                                  f"one tensor is larger than the device's largest buffer ({self.max_size} bytes)")
        best = None  # (waste, chunk, offset)
        for ci, chunk in enumerate(self.chunks):
            for o, s in chunk.free:
                if s >= size and (best is None or s - size < best[0]):
                    best = (s - size, ci, o)
        if best is not None:
            _, ci, o = best
            self.chunks[ci].take(o, size)
            return ci, o
        for ci, chunk in enumerate(self.chunks):
            tail = chunk.free[-1] if chunk.free and sum(chunk.free[-1]) == chunk.size else None
            start = tail[0] if tail else chunk.size
            if start + size <= self.max_size:
                if tail:
                    chunk.free.pop()
                chunk.size = max(chunk.size, start + size)
                return ci, start
        self.chunks.append(_Chunk(size=size))
        return len(self.chunks) - 1, 0

    def free(self, chunk: int, offset: int, size: int) -> None:
        self.chunks[chunk].give(offset, size)


def plan_device(device: str, intervals: list[Interval], alignment: int, max_size: int) -> DevicePlan:
    """Assign an arena offset to every interval of one device.

    Two strategies, the smaller arena wins: walking time forward with best fit
    (ggml's gallocr; also the only one that splits into several chunks), and
    placing the largest tensors first at the lowest offset free over their
    lifetime ("greedy by size", as TFLite's arena planner does), which
    fragments less when big and small tensors interleave."""
    walked = _plan_walking(device, intervals, alignment, max_size)
    if len(walked.chunks) > 1 or not intervals:
        return walked
    greedy = _plan_greedy_by_size(intervals, alignment)
    if greedy is None:
        return walked
    placements, total, inplace = greedy
    if total >= walked.total or total > max_size:
        return walked
    return DevicePlan(device, [total], placements, walked.lower_bound, walked.naive, inplace)


def _plan_greedy_by_size(intervals: list[Interval], alignment: int):
    """Largest first, each at the best-fitting gap among blocks live at the same time.

    In-place children share their parent's block (one block spans the chain).
    Returns (placements, arena size, in-place count)."""
    by_key = {iv.key: iv for iv in intervals}
    sizes = {iv.key: align_up(max(iv.nbytes, 1), alignment) for iv in intervals}
    root: dict[int, int] = {}
    taken: set[int] = set()
    for iv in sorted(intervals, key=lambda iv: iv.start):
        parent = iv.inplace_of
        if (parent in by_key and parent not in taken and by_key[parent].end == iv.start
                and sizes[parent] == sizes[iv.key]):
            root[iv.key] = root.get(parent, parent)
            taken.add(parent)
        else:
            root[iv.key] = iv.key
    blocks: dict[int, list[int]] = {}
    for key, r in root.items():
        span = blocks.setdefault(r, [by_key[key].start, by_key[key].end])
        span[0] = min(span[0], by_key[key].start)
        span[1] = max(span[1], by_key[key].end)
    # blocks placed so far, kept in (offset, end) order: those live at the same time as the next
    # block are then met in the order the gap search walks them (no sort per block)
    placed: list[tuple[int, int, int, int]] = []   # (offset, offset + size, start, end)
    offset_of: dict[int, int] = {}
    total = 0
    for r in sorted(blocks, key=lambda r: (-sizes[r], blocks[r][0])):
        start, end = blocks[r]
        size = sizes[r]
        best_gap, best_at, cursor = -1, 0, 0
        for lo, hi in [(lo, hi) for lo, hi, s0, e0 in placed if s0 <= end and start <= e0]:
            gap = lo - cursor
            if gap >= size and (best_gap < 0 or gap < best_gap):
                best_gap, best_at = gap, cursor
            if hi > cursor:
                cursor = hi
        offset = best_at if best_gap >= 0 else cursor
        bisect.insort(placed, (offset, offset + size, start, end))
        offset_of[r] = offset
        total = max(total, offset + size)
    placements = {key: Placement(0, offset_of[r], by_key[key].nbytes) for key, r in root.items()}
    return placements, total, sum(1 for key, r in root.items() if key != r)


def _plan_walking(device: str, intervals: list[Interval], alignment: int, max_size: int) -> DevicePlan:
    """Walk time forward: place what is produced, then free what died (best fit)."""
    by_key = {iv.key: iv for iv in intervals}
    sizes = {iv.key: align_up(max(iv.nbytes, 1), alignment) for iv in intervals}
    starts: dict[int, list[Interval]] = {}
    for iv in intervals:
        if iv.end < iv.start:
            raise ValueError(f"planner: interval {iv.key} ends before it starts")
        starts.setdefault(iv.start, []).append(iv)
    alloc = _Allocator(device, alignment, max_size)
    placed: dict[int, Placement] = {}
    block_of: dict[int, int] = {}        # tensor key -> root key of the block it lives in
    block_end: dict[int, int] = {}       # root key -> last time the block is needed
    free_at: dict[int, set[int]] = {}    # time -> roots to free after that time's allocations
    inplace = 0
    times = sorted(set(starts) | {iv.end for iv in intervals if iv.end < END})
    for t in times:
        for iv in starts.get(t, []):
            parent = iv.inplace_of
            root = block_of.get(parent) if parent is not None else None
            if (root is not None and by_key[parent].end == t and block_end[root] == t
                    and sizes[root] == sizes[iv.key]):
                free_at[t].discard(root)
                block_of[iv.key] = root
                block_end[root] = iv.end
                if iv.end < END:
                    free_at.setdefault(iv.end, set()).add(root)
                placed[iv.key] = Placement(placed[root].chunk, placed[root].offset, iv.nbytes)
                inplace += 1
                continue
            ci, off = alloc.alloc(sizes[iv.key])
            placed[iv.key] = Placement(ci, off, iv.nbytes)
            block_of[iv.key] = iv.key
            block_end[iv.key] = iv.end
            if iv.end < END:
                free_at.setdefault(iv.end, set()).add(iv.key)
        for root in sorted(free_at.pop(t, ())):
            p = placed[root]
            alloc.free(p.chunk, p.offset, sizes[root])
    return DevicePlan(
        device=device,
        chunks=[c.size for c in alloc.chunks],
        placements=placed,
        lower_bound=liveness_lower_bound(intervals, alignment),
        naive=sum(sizes.values()),
        inplace=inplace,
    )


def liveness_lower_bound(intervals: list[Interval], alignment: int) -> int:
    """Max over time of the aligned bytes of simultaneously live tensors.

    A tensor whose in-place parent dies exactly when it is born is counted as
    taking over the parent's bytes (the handoff frees first); every other free
    happens after the allocations of the same time, as in the planner.
    """
    by_key = {iv.key: iv for iv in intervals}
    handoff = {iv.inplace_of for iv in intervals
               if iv.inplace_of in by_key and by_key[iv.inplace_of].end == iv.start}
    events: list[tuple[int, int, int]] = []
    for iv in intervals:
        size = align_up(max(iv.nbytes, 1), alignment)
        events.append((iv.start, 1, size))
        if iv.end < END:
            events.append((iv.end, 0 if iv.key in handoff else 2, -size))
    live = peak = 0
    for _, _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def check_no_overlap(plan: DevicePlan, intervals: list[Interval]) -> None:
    """Independent checker: no two tensors live at the same time share bytes.

    In-place pairs (a child taking its parent's block at the parent's last use)
    are allowed to touch at exactly that time. Raises AssertionError naming both.
    """
    ivs = sorted(intervals, key=lambda iv: iv.start)
    for i, a in enumerate(ivs):
        pa = plan.placements[a.key]
        for b in ivs[i + 1:]:
            if b.start > a.end:
                break
            if b.inplace_of == a.key and b.start == a.end:
                continue
            pb = plan.placements[b.key]
            if pa.chunk != pb.chunk:
                continue
            if pa.offset < pb.offset + max(pb.nbytes, 1) and pb.offset < pa.offset + max(pa.nbytes, 1):
                raise AssertionError(
                    f"tensors {a.key} [{a.start},{a.end}] and {b.key} [{b.start},{b.end}] overlap in chunk {pa.chunk}: "
                    f"[{pa.offset},+{pa.nbytes}) vs [{pb.offset},+{pb.nbytes})")


def arena_intervals(sched: "Schedule", devices: Iterable[str]) -> dict[str, list[Interval]]:
    """Liveness of every tensor needing arena memory, per device."""
    graph = sched.graph
    consumers = graph.consumers()
    last: dict[int, int] = {}
    for split in sched.splits:
        for node in split.nodes:
            t = sched.time_of[node.id]
            for src in node.srcs:
                st = src.storage
                copy = split.copy_of(st)
                if copy is not None:
                    last[copy.key] = max(last.get(copy.key, 0), t)
                    last[st.id] = max(last.get(st.id, 0), sched.split_time[split.index])
                else:
                    last[st.id] = max(last.get(st.id, 0), t)
    out: dict[str, list[Interval]] = {d: [] for d in devices}
    for split in sched.splits:
        for c in split.copies:
            ct = sched.split_time[split.index]
            out[split.device].append(Interval(c.key, c.nbytes, ct, last.get(c.key, ct)))
        for node in split.nodes:
            if OPS[node.op].writes_src0:
                continue
            t = sched.time_of[node.id]
            end = END if node.is_output else max(last.get(node.id, t), t)
            parent = None
            src0 = node.srcs[0] if node.srcs else None
            if (OPS[node.op].inplace and src0 is not None and src0.storage is src0 and src0.op is not None
                    and not src0.is_output and not node.is_output and len(consumers.get(src0.id, [])) == 1
                    and src0.shape == node.shape and src0.dtype == node.dtype
                    and sched.device_of[src0.id] == split.device and not OPS[src0.op].writes_src0):
                parent = src0.id
            out[split.device].append(Interval(node.id, node.nbytes, t, end, parent))
    return out


def plan_schedule(sched: "Schedule", devices: Mapping[str, "Device"]) -> dict[str, DevicePlan]:
    """One arena plan per device for a schedule: liveness intervals, then `plan_device`
    with the device's buffer type (alignment, maximum buffer size)."""
    plans = {}
    for dev_name, intervals in arena_intervals(sched, devices).items():
        bt = devices[dev_name].buffer_type()
        try:
            plans[dev_name] = plan_device(dev_name, intervals, bt.alignment, bt.max_size)
        except AllocationError as exc:
            if exc.free is not None:
                raise
            # the planner knows sizes, not memory: report what the device really has free
            raise AllocationError(exc.backend, exc.asked, devices[dev_name].memory().free, exc.detail) from None
    return plans
