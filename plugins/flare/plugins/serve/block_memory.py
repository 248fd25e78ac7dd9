"""Memory of the prefix cache's KV blocks: carved from slabs as first needed, reused after eviction.

A cache that never hits still stores every prompt's blocks, so what a block
costs to store is what the cache costs at a 0% hit rate. On a CPU device the
copy itself is cheap (one slice per KV state: `BlockMemory.host`); what is
left is the memory. Blocks are carved from slabs of up to SLAB_BYTES, one
buffer per device (one trip through the ledger, tag `prefix-cache`, for up to
11 SmolLM2 blocks; a block allocated on its own measured ~0.3 ms more), with
each block's views made when its slab is. Nothing is reserved up front (a cache
that is never filled costs nothing), and slabs never hold more blocks than
the cache's budget (`limit`). Fresh memory costs its first touch, and on this
VM that cost is the host's, not the allocator's (`bench/first_touch.py`, one
process, allocators alternated, 11 blocks of 720 KiB a slab): a block's first
copy takes ~0.13-0.15 ms where the host backs the guest's pages and ~1.7-2.5 ms
where it does not (most likely a host fault per page: the VM backs memory
lazily and takes free memory back, `page_reporting_order=11` on its kernel
line; a 64 MiB mapping touched again at once cost 0.1 ms a 2 MiB page, after
5 s idle 2.5-4.9 ms, three rounds), with the same minor-fault counts (447 a
slab) in both modes; copied again, 0.02 ms. Same
allocator, same faults, ~15x the time: which mode a slab gets is the host's
doing, and it flips within one process (the bimodal ~0.4 vs ~3 ms store of a
block per run). Tried and not kept: MADV_HUGEPAGE and
MADV_POPULATE_WRITE on malloc'd slabs (1.97-2.52 ms a slab faulted by the
copies, 2.27-9.48 ms populated, 17-31 ms huge + populated; NumPy already advises
huge pages from 4 MiB up); an up-front touched reservation of the whole budget
(it moves the same touches to start-up and makes the budget resident in a server
that may never fill it); a 2 MiB-aligned mmap of whole huge pages (the lead
"0.4 vs 4.7 ms" was the host's two modes: 8 MiB slabs of 4 huge-page faults
took 0.26-0.27 ms a 512 KiB block against 0.06-0.12 for `device.alloc`'s, both
up to 1.6-2.0 ms in the slow mode). So the fresh-memory cost is one
touch of the budget per process (64 MiB: at most ~0.2 s in the slow mode), paid
while the cache fills; after that every store takes an evicted block's memory.
A dropped block's memory goes to a free list
that the next block takes first: a full cache evicts one block to store one,
with no allocation and no fault (~0.15 ms a block, all of it copies). Fewer,
larger copies were measured apart and not taken: SmolLM2's K states lie 1574592
bytes apart and its V states too (K to V 787264, V to K 787328), so two strided
copies could move a block instead of 60, 15 instead of 60 us a block (2000
alternated rounds, hot caches): ~0.1 ms of a ~135 ms request, under 0.1%. Slabs are
released by `close()` only (their blocks are the cache's budget, which a serving
process keeps).

Only the serving loop's thread uses an arena (like everything of the step engine);
`nbytes` may be read from any thread (/metrics): a sum over a list that thread
only appends to or replaces, so a reader sees some recent total.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from flare.core.backend import Binding, Buffer
from flare.core.dtypes import to_numpy

ALIGN = 256                 # byte alignment of each part (and each block) inside a slab
SLAB_BYTES = 8 << 20        # most bytes a slab holds (per device): 11 SmolLM2 blocks
BLOCK_TAG = "prefix-cache"

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
