"""GraphWorkspace: arenas shared by prepared graphs that never run at once.

An encoder and a decoder, the `prefill` and `decode` entry points of one model,
or a short request after a long one all bind into the same chunk buffers, so
memory is the *largest* need, not the sum. When a graph needs more, the
workspace grows and bumps `generation`; every graph bound to an older
generation re-binds (and drops captures that point at the old memory) before
its next execute.

Growth is transactional: the new, larger chunks are allocated first and the
pending prepare binds to them; if anything in that prepare fails, they are
released and the old arena stays exactly as it was. Only when the prepare
succeeds are the old chunks released and the new ones installed.

`headroom` (default 1: exactly the largest need): a chunk that must grow is
allocated at `headroom` times the need (within the device's largest buffer),
for graphs whose shapes keep growing a little (a plan per sentence length):
each growth makes every graph on the workspace re-bind (re-compile its native
command lists), so growing by steps costs fewer re-binds than growing to each
new maximum.

Graphs on one workspace share arena bytes, so they must not run at the same
time: each holds `lock` (re-entrant) while it prepares, executes or resets,
and attach/detach/grow/free take it too.
"""
from __future__ import annotations

import threading
from typing import Mapping, Sequence

from .backend import Buffer, Device
from .errors import InputError, ReleasedError


class GraphWorkspace:
    """Per-device arenas (lists of chunk buffers) with a generation counter."""

    def __init__(self, name: str = "workspace", headroom: float = 1.0):
        if not 1.0 <= headroom <= 4.0:
            raise InputError(f"workspace {name!r}: headroom {headroom} must be in [1, 4]")
        self.name = name
        self.headroom = headroom
        self.generation = 0
        self._arenas: dict[str, list[Buffer]] = {}
        self._users = 0
        self.released = False
        self.lock = threading.RLock()

    # -- sizing ----------------------------------------------------------------
    def chunk_sizes(self, device: str) -> list[int]:
        return [b.nbytes for b in self._arenas.get(device, [])]

    def nbytes(self, device: str | None = None) -> int:
        return sum(sum(self.chunk_sizes(d)) for d in self._arenas if device is None or d == device)

    def fits(self, device: Device, chunks: Sequence[int]) -> bool:
        have = self.chunk_sizes(device.name)
        return len(have) >= len(chunks) and all(h >= n for h, n in zip(have, chunks))

    def grow(self, needs: Mapping[Device, Sequence[int]]) -> "Growth":
        """Allocate (but do not yet install) arenas big enough for `needs`.

        Returns a `Growth` to bind against; `commit()` installs it (releasing
        the old chunks, bumping the generation), `abort()` releases what it
        allocated. If an allocation fails here, nothing from this call stays
        allocated and the AllocationError propagates.
        """
        with self.lock:
            return self._grow(needs)

    def _grow(self, needs: Mapping[Device, Sequence[int]]) -> "Growth":
        if self.released:
            raise ReleasedError(f"workspace {self.name!r} was released")
        growth = Growth(self)
        try:
            for device, chunks in needs.items():
                if self.fits(device, chunks):
                    continue
                have = self.chunk_sizes(device.name)
                n = max(len(have), len(chunks))
                want = [max((have + [0] * n)[i], (list(chunks) + [0] * n)[i]) for i in range(n)]
                if self.headroom > 1.0:
                    limit = device.buffer_type().max_size
                    want = [w if i < len(have) and have[i] >= w else max(w, min(int(w * self.headroom), limit))
                            for i, w in enumerate(want)]
                bufs = growth.buffers.setdefault(device.name, [])
                for i, size in enumerate(want):
                    bufs.append(device.alloc(size, tag=f"{self.name}:arena[{i}]"))
        except BaseException:
            growth.abort()
            raise
        return growth

    def chunk(self, device: str, index: int) -> Buffer:
        return self._arenas[device][index]

    def _install(self, growth: "Growth") -> None:
        for name, bufs in growth.buffers.items():
            for buf in self._arenas.get(name, []):
                buf.release()
            self._arenas[name] = bufs
        if growth.buffers:
            self.generation += 1

    # -- users and release -------------------------------------------------------
    def attach(self) -> None:
        """A prepared graph now refers to this workspace."""
        with self.lock:
            if self.released:
                raise ReleasedError(f"workspace {self.name!r} was released")
            self._users += 1

    @property
    def users(self) -> int:
        """How many prepared graphs are attached."""
        return self._users

    def detach(self) -> None:
        """A prepared graph let go; the last one to leave frees the arenas."""
        with self.lock:
            self._users = max(0, self._users - 1)
            if self._users == 0:
                self.free()

    def free(self) -> None:
        """Release every arena now (graphs still attached will re-grow on next use)."""
        with self.lock:
            for bufs in self._arenas.values():
                for buf in bufs:
                    buf.release()
            if self._arenas:
                self.generation += 1
            self._arenas.clear()

    def release(self) -> None:
        """Free the arenas and refuse further use."""
        with self.lock:
            self.free()
            self.released = True

    def __repr__(self) -> str:
        sizes = {d: self.chunk_sizes(d) for d in self._arenas}
        return f"GraphWorkspace({self.name!r}, gen={self.generation}, users={self._users}, arenas={sizes})"


class Growth:
    """Arena chunks allocated for a pending prepare, installed only on success."""

    def __init__(self, workspace: GraphWorkspace):
        self.workspace = workspace
        self.buffers: dict[str, list[Buffer]] = {}
        self.done = False

    def chunk(self, device: str, index: int) -> Buffer:
        """The chunk a pending plan binds to: the new one if this device grows."""
        if device in self.buffers:
            return self.buffers[device][index]
        return self.workspace.chunk(device, index)

    def commit(self) -> None:
        if not self.done:
            self.done = True
            self.workspace._install(self)

    def abort(self) -> None:
        if not self.done:
            self.done = True
            for bufs in self.buffers.values():
                for buf in bufs:
                    buf.release()
            self.buffers.clear()
