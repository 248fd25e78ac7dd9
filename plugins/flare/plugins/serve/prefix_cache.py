"""Prefix cache: KV blocks of prompts already seen, reused by requests that start the same way.

Block-granular: a block is `block_tokens` consecutive prompt tokens at a
block-aligned position, named by a hash chain (its tokens and its parent's
name), so a block is reused only under exactly the same prefix. The KV rows
themselves live in memory the step engine carves from slabs it allocates
through the ledger on the KV state's device (`StepEngine.save_block`,
`block_memory`), so the cache's bytes show up in the ledger and in `/metrics`
like any other allocation; an evicted block's memory is the next block's.
A prompt stores its blocks up to the last multiple of `align` in it
(`storable`): reuse ends on such a boundary, so a block past it could never be
copied back on its own, and a later prompt that extends this one prefills it
anyway and stores it then.

Reference counts: a block is held by each running request that reused or
wrote it and by each child block; only unheld blocks can be evicted, least
recently used first, when a new block would pass the byte budget (a chain is
evicted from its tail, never leaving an orphan). A block the device cannot
allocate is simply not cached: the cache is an optimisation, never a failure. A request always prefills at
least its last prompt token itself (its logits are needed), so at most
`len(prompt) - 1` tokens, rounded down to whole blocks, come from the cache,
and further down to a multiple of the core's prefill chunk (`align`).
Output is identical to a cold run: a reused block holds the very KV rows a
cold prefill of the same tokens at the same positions writes, and the rest of
the prompt is read in the same chunks as a cold run reads it. The alignment
matters for quantized models: the CPU's integer kernels round activations to
8 bits, which turns the ~1e-6 difference between a 16- and a 32-token chunk's
float sums into logits ~0.5 apart on SmolLM2, enough to change a greedy token.
"""
from __future__ import annotations

import hashlib
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from flare.core.errors import AllocationError


@dataclass(eq=False)
class Block:
    bid: int
    key: bytes
    parent: "Block | None"
    refs: int = 0          # running requests holding it + child blocks


class PrefixCache:
    """The index (rank 0 only); KV bytes are moved by `engine` (every rank)."""

    def __init__(self, engine: Any, budget_bytes: int, block_tokens: int = 16, align: int | None = None):
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        # reuse ends on a multiple of the prefill chunk (default: the core's), so the prompt's remaining
        # chunks are the very chunks a cold run computes: bit-identical logits, not just close ones
        self.align = engine.serving.max_prefill_tokens if align is None else int(align)
        self.engine = engine
        self.block_tokens = block_tokens
        self.block_bytes = engine.block_bytes(block_tokens)
        self.max_blocks = budget_bytes // self.block_bytes if self.block_bytes else 0
        engine.arena.limit = self.max_blocks       # its slabs never hold more blocks than the budget
        self.budget_bytes = budget_bytes
        self._index: dict[bytes, Block] = {}
        self._free: OrderedDict[int, Block] = OrderedDict()   # unheld blocks, least recently used first
        self._ids = itertools.count(1)
        self.hits = self.lookups = self.reused_tokens = self.evictions = self.failed_saves = 0

    @staticmethod
    def _key(parent: Block | None, tokens: Sequence[int]) -> bytes:
        h = hashlib.sha256(parent.key if parent else b"root")
        h.update(np.asarray(tokens, np.int64).tobytes())
        return h.digest()

    @property
    def blocks(self) -> int:
        return len(self._index)

    @property
    def bytes(self) -> int:
        return len(self._index) * self.block_bytes

    # ------------------------------------------------------------- holding
    def _hold(self, b: Block) -> None:
        b.refs += 1
        self._free.pop(b.bid, None)

    def _unhold(self, b: Block) -> None:
        b.refs -= 1
        if b.refs == 0:
            self._free[b.bid] = b

    def release(self, held: Sequence[Block]) -> None:
        """A request is done with the blocks it held."""
        for b in held:
            self._unhold(b)

    # --------------------------------------------------------------- reuse
    def reuse(self, slot: int, prompt: Sequence[int]) -> tuple[int, list[Block]]:
        """Copy the longest cached prefix of `prompt` (whole blocks, at most len-1 tokens) into `slot`'s
        KV rows. Returns (tokens reused, blocks now held by the request)."""
        self.lookups += 1
        n, held, parent = self.block_tokens, [], None
        for start in range(0, len(prompt) - 1 - n + 1, n):
            b = self._index.get(self._key(parent, prompt[start: start + n]))
            if b is None:
                break
            self._hold(b)
            held.append(b)
            parent = b
        while self.align and held and (len(held) * n) % self.align:   # the rest starts on a chunk boundary
            self._unhold(held.pop())
        for i, b in enumerate(held):
            self.engine.load_block(b.bid, slot, i * n)
        if held:
            self.hits += 1
            self.reused_tokens += len(held) * n
        return len(held) * n, held

    def store(self, slot: int, prompt: Sequence[int], held: list[Block]) -> None:
        """After `slot` has read all of `prompt`: save its blocks not cached yet up to `storable`
        (evicting unheld blocks past the budget) and hold them for the request. `held` grows in place."""
        n = self.block_tokens
        parent = held[-1] if held else None
        for start in range(len(held) * n, self.storable(len(prompt)), n):
            key = self._key(parent, prompt[start: start + n])
            b = self._index.get(key)
            if b is None:
                if not self._make_room():
                    return
                b = Block(next(self._ids), key, parent)
                try:
                    self.engine.save_block(b.bid, slot, start, n)
                except AllocationError:      # the device is full: serve on without caching this prompt
                    self.failed_saves += 1
                    return
                self._index[key] = b
                if parent is not None:
                    parent.refs += 1            # a child holds its parent
            self._hold(b)
            held.append(b)
            parent = b

    def storable(self, prompt_tokens: int) -> int:
        """Where the blocks worth storing of a prompt of `prompt_tokens` end: its whole blocks, down to
        a multiple of `align`. A block past the last such boundary can never be copied back on its
        own (a reuse ends on one); a later prompt that extends this one prefills it anyway (its reuse
        stops at the boundary too) and stores it then, so storing it now is work a 0% hit rate pays
        for nothing."""
        n = self.block_tokens
        step = math.lcm(n, self.align) if self.align else n
        return prompt_tokens // step * step

    def _make_room(self) -> bool:
        while len(self._index) >= self.max_blocks:
            if not self._free:
                return False
            _, victim = self._free.popitem(last=False)
            self._evict(victim)
        return True

    def _evict(self, b: Block) -> None:
        del self._index[b.key]
        self.engine.drop_block(b.bid)
        self.evictions += 1
        if b.parent is not None:
            self._unhold(b.parent)

    def clear(self) -> None:
        """Drop every block (held or not): the server is shutting down."""
        for b in list(self._index.values()):
            self.engine.drop_block(b.bid)
        self._index.clear()
        self._free.clear()

    def stats(self) -> dict[str, int]:
        return {"blocks": self.blocks, "bytes": self.bytes, "memory_bytes": self.engine.arena.nbytes,
                "budget_bytes": self.budget_bytes,
                "lookups": self.lookups, "hits": self.hits, "reused_tokens": self.reused_tokens,
                "evictions": self.evictions, "failed_saves": self.failed_saves}
