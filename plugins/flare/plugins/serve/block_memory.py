"""Memory of the prefix cache's KV blocks: carved from slabs as first needed, reused after eviction.

A cache that never hits still stores every prompt's blocks, so what a block
costs to store is what the cache costs at a 0% hit rate. On a CPU device the
copy itself is cheap (one slice per KV state: `BlockMemory.host`); what is
left is the memory. Blocks are carved from slabs of up to SLAB_BYTES, one
buffer per device (one trip through the ledger, tag `prefix-cache`, for up to
11 SmolLM2 blocks; a block allocated on its own measured ~0.3 ms more), with
each block's views made when its slab is. Nothing is reserved up front (a cache
that is never filled costs nothing; an up-front, touched reservation of the
whole budget was tried and did not pay), and slabs never hold more blocks than
the cache's budget (`limit`). A new slab's host memory is faulted in when it
is carved (`prefault`: its whole 2 MiB pages advised as transparent huge pages,
then the kernel populates the range in one call), not a 4 KiB page at a time
by the block copies: those faults were what the cache cost at a 0% hit rate over
HTTP (a server that has not filled its budget stores every block in fresh
memory). Here, 11 720 KiB blocks copied into a fresh 8 MiB mapping: 4.5-5.0 ms
of faults and copies in small pages, 1.0-1.1 ms with huge pages faulted by the
copies, 0.2 ms populate + 0.2 ms copies with both; in `flare serve smollm2` at a
0% hit rate `store` took 2.2 ms a request in fresh small pages and 0.6 ms with
a full cache's recycled memory (`gc`-free thread CPU, 33-43 requests). Where
the kernel refuses the advice (no THP, before Linux 5.14's MADV_POPULATE_WRITE)
the memory is faulted by the copies as before. A dropped block's memory goes to
a free list that the next block takes first: a full cache evicts one block to
store one, with no allocation and no fault (~0.15 ms a block, all of it
copies). Slabs are released by `close()` only (their blocks are the cache's
budget, which a serving process keeps).

Only the serving loop's thread uses an arena (like everything of the step engine);
`nbytes` may be read from any thread (/metrics): a sum over a list that thread
only appends to or replaces, so a reader sees some recent total.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from flare.core.backend import Binding, Buffer
from flare.core.dtypes import to_numpy

ALIGN = 256                 # byte alignment of each part (and each block) inside a slab
SLAB_BYTES = 8 << 20        # most bytes a slab holds (per device): 11 SmolLM2 blocks
BLOCK_TAG = "prefix-cache"
HUGE_PAGE = 2 << 20         # x86-64 / arm64 transparent huge page
MADV_POPULATE_WRITE = 23    # Linux >= 5.14 (Python 3.11's mmap module does not name it)

Part = tuple[str, int, tuple[int, ...], str]          # (state, byte offset in the block, shape of its rows, dtype)


@dataclass(eq=False)
class BlockMemory:
    """One block's place in the slabs and how its parts are copied, worked out once when it is carved:
    `host` pairs each KV state's host rows with its part of the block as (rows, bytes per row) uint8
    views, where the host addresses both (a save or load is one slice copy per state); `device` lists
    the parts that go through the device's read and write."""

    tokens: int
    host: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)      # (state rows, block part)
    device: list[tuple[Buffer, str, str, int, tuple[int, ...], str]] = field(default_factory=list)
    # (slab buffer, device, state, byte offset in the slab, shape of the part, dtype)


def part_bytes(parts: list[Part]) -> int:
    """Bytes of one block's parts on one device, up to a multiple of ALIGN (blocks sit back to back)."""
    _, off, rows, dtype = parts[-1]
    return -(-(off + math.prod(rows) * to_numpy(dtype).itemsize) // ALIGN) * ALIGN


class BlockArena:
    """Hands out `BlockMemory` (see the module docstring). `sources()` gives each KV state's host rows
    (None where the host does not address it), `limit` the most blocks the cache will ever hold."""

    def __init__(self, devices: Mapping[str, Any], sources: Callable[[], Mapping[str, np.ndarray | None]]):
        self.devices = devices
        self.sources = sources
        self.limit = 1 << 30
        self.carved = 0                                    # blocks carved from slabs so far
        self._slabs: list[Buffer] = []
        self._free: dict[int, list[BlockMemory]] = {}      # block size -> dropped blocks' memory
        self._fresh: dict[int, list[BlockMemory]] = {}     # block size -> carved, never used yet

    def take(self, tokens: int, layout: Mapping[str, list[Part]]) -> BlockMemory:
        """Memory for a block of `tokens` rows: a dropped block's, else the next of a slab (a new slab
        when none is left; AllocationError if the device refuses it)."""
        for pool in (self._free, self._fresh):
            blocks = pool.get(tokens)
            if blocks:
                return blocks.pop()
        blocks = self._slab(tokens, layout)
        self._fresh[tokens] = blocks
        return blocks.pop()

    def give_back(self, mem: BlockMemory) -> None:
        """A dropped block's memory, for the next block of its size."""
        self._free.setdefault(mem.tokens, []).append(mem)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._slabs)

    def close(self) -> None:
        """Release every slab (the blocks' views go first: nothing refers to a slab after)."""
        self._free.clear()
        self._fresh.clear()
        slabs, self._slabs = self._slabs, []
        for buf in slabs:
            buf.release()

    def _slab(self, tokens: int, layout: Mapping[str, list[Part]]) -> list[BlockMemory]:
        strides = {dev: part_bytes(parts) for dev, parts in layout.items()}
        count = max(1, min(self.limit - self.carved, SLAB_BYTES // max(1, max(strides.values()))))
        blocks = [BlockMemory(tokens) for _ in range(count)]
        src, bufs = self.sources(), []
        try:
            for dev, parts in layout.items():
                device, stride = self.devices[dev], strides[dev]
                buf = device.alloc(stride * count, tag=BLOCK_TAG)
                bufs.append(buf)
                raw = host_bytes(device, buf)
                if raw is not None:
                    prefault(raw)
                for i, mem in enumerate(blocks):
                    for name, off, rows, dtype in parts:
                        at, host = i * stride + off, src.get(name)
                        nbytes = math.prod(rows) * to_numpy(dtype).itemsize
                        if raw is not None and host is not None and tokens * host.shape[1] == nbytes:
                            mem.host.append((host, raw[at: at + nbytes].reshape(tokens, host.shape[1])))
                        else:
                            mem.device.append((buf, dev, name, at, rows, dtype))
        except BaseException:
            for buf in bufs:
                buf.release()
            raise
        self._slabs.extend(bufs)
        self.carved += count
        return blocks[::-1]          # taken from the end: the slab's first block first


def host_bytes(device: Any, buf: Buffer) -> np.ndarray | None:
    """A buffer's bytes as one host array, or None where the host does not address the device's memory."""
    words = buf.nbytes // 4              # slabs hold whole ALIGN-byte blocks: whole 4-byte words
    view = device.host_view(Binding(buf, 0, (words,), (1,), "f32")) if words else None
    return None if view is None else view.view(np.uint8)


def _libc() -> Any:
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc


_LIBC = _libc()


def _advise(start: int, end: int, advice: int) -> bool:
    """madvise(2) on [start, end) of this process's memory (page-aligned by the caller); False where
    the kernel refuses it or there is no libc to ask."""
    return _LIBC is not None and end > start and _LIBC.madvise(start, end - start, advice) == 0


def prefault(raw: np.ndarray) -> bool:
    """Fault a new slab's host memory in now, in as few faults as the kernel allows: its whole
    2 MiB pages advised as transparent huge pages (MADV_HUGEPAGE), then the whole range populated
    for writing (MADV_POPULATE_WRITE), instead of one fault per 4 KiB page inside the first copy
    of each block (see the module docstring for the figures). Only the buffer's own whole pages
    are advised: the bytes around it (another allocation's) are never touched. Returns whether the
    range was populated; False (the copies fault it in, as before) is never an error."""
    if _LIBC is None or raw.nbytes == 0:
        return False
    page = mmap.PAGESIZE
    lo, hi = raw.ctypes.data, raw.ctypes.data + raw.nbytes
    huge_lo, huge_hi = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        _advise(huge_lo, huge_hi, mmap.MADV_HUGEPAGE)
    return _advise(-(-lo // page) * page, hi // page * page, MADV_POPULATE_WRITE)
