"""What the serving loop asks of the model: run a program on chunks, move KV blocks; the same on every rank.

The loop (rank 0) decides; this engine maps a step to the smallest captured
program of a kind that holds it, pads it (`token_lm_inputs`), runs it and
returns logits. Kinds `prefill` and `mixed` give one logit row per chunk (its
last token, through `out_rows`); `decode`, `draft` and `verify` give a row for
every token, which speculative verification needs.

The prefix cache keeps KV blocks in memory of its own on the KV state's
device, through the ledger (`block_memory.BlockArena`: slabs, each block every
state's rows back to back): `save_block` copies a sequence's rows into a new
block, `load_block` copies a block into a sequence's rows, `drop_block` gives
its memory back for the next block. Under MPI every rank holds the same KV (attention is replicated;
only experts are split), so rank 0 broadcasts each operation as JSON before
doing it and the other ranks replay it (`follow`) on their own buffers; between
steps they sleep-poll a non-blocking broadcast rather than spin in MPI.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from flare.core.backend import Binding, Buffer
from flare.core.dtypes import to_numpy
from flare.core.errors import InputError
from flare.core.graph import contiguous_strides
from flare.plugins.export.serving.batch import Chunk, token_lm_inputs
from flare.plugins.export.ranks import bcast_json
from flare.plugins.export.serving.engine import Bucket, Engine

from .block_memory import ALIGN, BlockArena, BlockMemory, Part, part_bytes

EVERY_ROW = frozenset({"decode", "draft", "verify"})   # kinds without out_rows: logits of every token


class StepEngine(Engine):
    """`flare run`'s engine (buckets by kind) plus logits of every token, KV-block copies and its own
    rank protocol (a message per step or copy), on a CoreRuntime (`core`, `graph`, `execute`)."""

    def __init__(self, runtime: Any, comm: Any = None):
        super().__init__(runtime, comm if comm is not None and comm.Get_size() > 1 else None)
        # the KV states: every state indexed by KV row (token-lm/1 writes row seq * max_ctx + pos)
        self.kv = {n: info for n, info in runtime.graph.states().items() if info[1][0] == self.serving.kv_rows}
        self.blocks: dict[int, BlockMemory] = {}
        self._src: dict[str, np.ndarray | None] | None = None   # KV state -> its host rows (`_sources`)
        self.arena = BlockArena(runtime.graph.devices, self._sources)   # the blocks' memory
        self._layouts: dict[int, dict[str, list[Part]]] = {}

    def run(self, kind: str, chunks: Sequence[Chunk]) -> tuple[np.ndarray, Bucket]:
        """Logits: a row per chunk (`prefill`, `mixed`) or per token (`decode`, `draft`, `verify`)."""
        self._tell({"op": "run", "kind": kind, "chunks": [c.to_list() for c in chunks]})
        return self._run(kind, chunks)

    def _run(self, kind: str, chunks: Sequence[Chunk]) -> tuple[np.ndarray, Bucket]:
        n = sum(len(c.tokens) for c in chunks)
        b = self.bucket(kind, n, len(chunks))
        every = kind in EVERY_ROW
        inputs = token_lm_inputs(self.serving, chunks, tokens=b.tokens, batch=None if every else b.batch,
                                 window=self.window(b, chunks))
        logits = self.runtime.execute(b.program, **inputs)["logits"]
        self.steps += 1
        return logits[: n if every else len(chunks)], b

    # ------------------------------------------------------------ KV blocks
    # A block holds every KV state's rows back to back (each part on an ALIGN-byte boundary), in one
    # slab buffer per device (`block_memory`: slabs carved as first needed, a dropped block's memory
    # reused). Where the host addresses both the states and the block (a CPU
    # device), storing or loading a block is one slice copy per state between views made once (the
    # states' `host_rows`, the block's parts when it is carved): ~0.1-0.3 ms a SmolLM2 block, where
    # `read_rows` / `write_rows` spent ~2 ms on a lock, checks and new views per state.
    def _layout(self, tokens: int) -> dict[str, list[Part]]:
        """Per device: (state, byte offset, shape of `tokens` rows, dtype) of each part of a block
        (computed once per block size: every save and load of a block walks it)."""
        known = self._layouts.get(tokens)
        if known is not None:
            return known
        out: dict[str, list[Part]] = self._layouts.setdefault(tokens, {})
        ends: dict[str, int] = {}
        for name, (dev, shape, dtype) in self.kv.items():
            off = -(-ends.get(dev, 0) // ALIGN) * ALIGN
            rows = (tokens, *shape[1:])
            out.setdefault(dev, []).append((name, off, rows, dtype))
            ends[dev] = off + math.prod(rows) * to_numpy(dtype).itemsize
        return out

    def block_bytes(self, tokens: int) -> int:
        return sum(part_bytes(parts) for parts in self._layout(tokens).values())

    def _sources(self) -> dict[str, np.ndarray | None]:
        """Each KV state's host rows (`PreparedGraph.host_rows`; None: not in host memory), resolved once."""
        if self._src is None:
            self._src = {name: self.runtime.graph.host_rows(name) for name in self.kv}
        return self._src

    def save_block(self, bid: int, seq: int, start: int, tokens: int) -> None:
        """Copy KV rows of positions [start, start+tokens) of slot `seq` into a new block `bid`."""
        self._tell({"op": "save", "bid": bid, "seq": seq, "start": start, "tokens": tokens,
                    "limit": self.arena.limit})
        self._save(bid, seq, start, tokens)

    def _save(self, bid: int, seq: int, start: int, tokens: int) -> None:
        if bid in self.blocks:
            raise InputError(f"prefix-cache block {bid} exists already")
        graph, row = self.runtime.graph, seq * self.serving.max_ctx + start
        end = self._rows(row, tokens)
        mem = self.arena.take(tokens, self._layout(tokens))
        try:
            for state_rows, part in mem.host:
                np.copyto(part, state_rows[row: end])
            for buf, dev, name, off, rows, dtype in mem.device:
                graph.devices[dev].write(self._binding(buf, rows, dtype, off), graph.read_rows(name, row, tokens))
        except BaseException:
            self.arena.give_back(mem)
            raise
        self.blocks[bid] = mem

    def _rows(self, row: int, tokens: int) -> int:
        """The end of KV rows [row, row + tokens), checked once (the slice copies check nothing)."""
        if row < 0 or tokens < 1 or row + tokens > self.serving.kv_rows:
            raise InputError(f"prefix-cache block rows [{row}, {row + tokens}) are outside the KV "
                             f"cache's {self.serving.kv_rows} rows")
        return row + tokens

    def load_block(self, bid: int, seq: int, start: int) -> None:
        """Copy block `bid` into the KV rows of slot `seq` from position `start`."""
        self._tell({"op": "load", "bid": bid, "seq": seq, "start": start})
        self._load(bid, seq, start)

    def _load(self, bid: int, seq: int, start: int) -> None:
        graph, row = self.runtime.graph, seq * self.serving.max_ctx + start
        mem = self.blocks[bid]
        end = self._rows(row, mem.tokens)
        for state_rows, part in mem.host:
            np.copyto(state_rows[row: end], part)
        for buf, dev, name, off, rows, dtype in mem.device:
            graph.write_rows(name, row, graph.devices[dev].read(self._binding(buf, rows, dtype, off)))

    def drop_block(self, bid: int) -> None:
        self._tell({"op": "drop", "bid": bid})
        self._drop(bid)

    def _drop(self, bid: int) -> None:
        mem = self.blocks.pop(bid, None)
        if mem is not None:
            self.arena.give_back(mem)

    @staticmethod
    def _binding(buf: Buffer, shape: tuple[int, ...], dtype: str, offset: int = 0) -> Binding:
        return Binding(buf, offset, tuple(shape), contiguous_strides(shape), dtype)

    def close(self) -> None:
        """Free every block's memory (the arena's slabs), forget the states' host views (rank 0 tells
        the others with `stop`); before the runtime is released."""
        self.blocks.clear()
        self.arena.close()
        self._src = None

    # ---------------------------------------------------------------- ranks
    def _tell(self, msg: dict[str, Any]) -> None:
        if self.comm is not None:
            bcast_json(self.comm, msg)

    def _hear(self) -> dict[str, Any]:
        """Rank 0's next message (a waiting rank sleeps between polls: `bcast_json`)."""
        return bcast_json(self.comm, None)

    def stop(self) -> None:
        """Rank 0: tell the other ranks the server is done; free this rank's blocks."""
        self._tell({"op": "stop"})
        self.close()

    def follow(self) -> int:
        """Ranks > 0: replay rank 0's operations until it stops; returns the number of steps."""
        try:
            while True:
                msg = self._hear()
                op = msg["op"]
                if op == "stop":
                    return self.steps
                if op == "run":
                    self._run(msg["kind"], [Chunk.from_list(c) for c in msg["chunks"]])
                elif op == "save":
                    self.arena.limit = msg["limit"]
                    self._save(msg["bid"], msg["seq"], msg["start"], msg["tokens"])
                elif op == "load":
                    self._load(msg["bid"], msg["seq"], msg["start"])
                elif op == "drop":
                    self._drop(msg["bid"])
        finally:
            self.close()
