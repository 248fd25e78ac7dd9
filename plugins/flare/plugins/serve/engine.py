"""What the serving loop asks of the model: run a program on chunks, move KV blocks; the same on every rank.

The loop (rank 0) decides; this engine maps a step to the smallest captured
program of a kind that holds it, pads it (`token_lm_inputs`), runs it and
returns logits. Kinds `prefill` and `mixed` give one logit row per chunk (its
last token, through `out_rows`); `decode`, `draft` and `verify` give a row for
every token, which speculative verification needs.

The prefix cache keeps KV blocks in buffers of its own, allocated on the KV
state's device through the ledger (one buffer per device per block, every
state's rows in it): `save_block` copies a sequence's rows into
a new block, `load_block` copies a block into a sequence's rows, `drop_block`
frees it. Under MPI every rank holds the same KV (attention is replicated;
only experts are split), so rank 0 broadcasts each operation as JSON before
doing it and the other ranks replay it (`follow`) on their own buffers; between
steps they sleep-poll a non-blocking broadcast rather than spin in MPI.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from flare.core.backend import Binding, Buffer
from flare.core.dtypes import to_numpy
from flare.core.errors import InputError
from flare.core.graph import contiguous_strides
from flare.plugins.export.serving.batch import Chunk, token_lm_inputs
from flare.plugins.export.ranks import bcast_json
from flare.plugins.export.serving.engine import Bucket, Engine

EVERY_ROW = frozenset({"decode", "draft", "verify"})   # kinds without out_rows: logits of every token
BLOCK_TAG = "prefix-cache"
ALIGN = 256          # byte alignment of each state's rows inside a block's buffer
SPARE_BLOCKS = 1     # dropped blocks whose memory is kept for the next: a full cache evicts one block to store one


@dataclass(eq=False)
class BlockMemory:
    """One block's buffers (one per device, in the ledger under BLOCK_TAG) and how its parts are
    copied, worked out once per buffer: `host` pairs each KV state's host rows with its part of the
    block as (rows, bytes per row) uint8 views, where the host addresses both (a save or load is one
    slice copy per state); `device` lists the parts that go through the device's read and write."""

    tokens: int
    buffers: list[Buffer] = field(default_factory=list)
    host: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)      # (state rows, block part)
    device: list[tuple[Buffer, str, str, int, tuple[int, ...], str]] = field(default_factory=list)
    # (buffer, device, state, byte offset, shape of the part, dtype)

    def release(self) -> None:
        self.host.clear()
        self.device.clear()
        for buf in self.buffers:
            buf.release()
        self.buffers.clear()


class StepEngine(Engine):
    """`flare run`'s engine (buckets by kind) plus logits of every token, KV-block copies and its own
    rank protocol (a message per step or copy), on a CoreRuntime (`core`, `graph`, `execute`)."""

    def __init__(self, runtime: Any, comm: Any = None):
        super().__init__(runtime, comm if comm is not None and comm.Get_size() > 1 else None)
        # the KV states: every state indexed by KV row (token-lm/1 writes row seq * max_ctx + pos)
        self.kv = {n: info for n, info in runtime.graph.states().items() if info[1][0] == self.serving.kv_rows}
        self.blocks: dict[int, BlockMemory] = {}
        self._spare: dict[int, list[BlockMemory]] = {}      # block size -> dropped blocks' memory, reused first
        self._src: dict[str, np.ndarray | None] | None = None   # KV state -> its host rows (`_sources`)
        self._layouts: dict[int, dict[str, list[tuple[str, int, tuple[int, ...], str]]]] = {}

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
    # A block is one buffer per device holding every KV state's rows back to back (each part starting on
    # an ALIGN-byte boundary): one allocation instead of one per state (60 on SmolLM2). Where the host
    # addresses both the states and the block (a CPU device), storing or loading a block is one slice
    # copy per state between views made once (the states' `host_rows`, the block's parts when its
    # buffer is allocated): ~0.1 ms a SmolLM2 block instead of ~2 ms through `read_rows_into` /
    # `write_rows`, whose lock, checks and new views per state cost more than the 12 KB they copy.
    # A dropped block's buffers and views are kept (up to SPARE_BLOCKS) for the next block: when the
    # cache is full, each new block follows an eviction, and reuses it instead of allocating.
    def _layout(self, tokens: int) -> dict[str, list[tuple[str, int, tuple[int, ...], str]]]:
        """Per device: (state, byte offset, shape of `tokens` rows, dtype) of each part of a block
        (computed once per block size: every save and load of a block walks it)."""
        known = self._layouts.get(tokens)
        if known is not None:
            return known
        out: dict[str, list[tuple[str, int, tuple[int, ...], str]]] = self._layouts.setdefault(tokens, {})
        ends: dict[str, int] = {}
        for name, (dev, shape, dtype) in self.kv.items():
            off = -(-ends.get(dev, 0) // ALIGN) * ALIGN
            rows = (tokens, *shape[1:])
            out.setdefault(dev, []).append((name, off, rows, dtype))
            ends[dev] = off + int(np.prod(rows)) * to_numpy(dtype).itemsize
        return out

    def _part_bytes(self, parts: list[tuple[str, int, tuple[int, ...], str]]) -> int:
        _, off, rows, dtype = parts[-1]
        return -(-(off + int(np.prod(rows)) * to_numpy(dtype).itemsize) // 4) * 4    # whole 4-byte words

    def block_bytes(self, tokens: int) -> int:
        return sum(self._part_bytes(parts) for parts in self._layout(tokens).values())

    def _sources(self) -> dict[str, np.ndarray | None]:
        """Each KV state's host rows (`PreparedGraph.host_rows`; None: not in host memory), resolved once."""
        if self._src is None:
            self._src = {name: self.runtime.graph.host_rows(name) for name in self.kv}
        return self._src

    def _new_block(self, tokens: int) -> BlockMemory:
        """A block's memory: a dropped block's (`_spare`), else new buffers through the ledger."""
        spare = self._spare.get(tokens)
        if spare:
            return spare.pop()
        graph, src = self.runtime.graph, self._sources()
        mem = BlockMemory(tokens)
        try:
            for dev, parts in self._layout(tokens).items():
                device = graph.devices[dev]
                buf = device.alloc(self._part_bytes(parts), tag=BLOCK_TAG)
                mem.buffers.append(buf)
                raw = self._host_bytes(device, buf)
                for name, off, rows, dtype in parts:
                    host = src[name]
                    nbytes = math.prod(rows) * to_numpy(dtype).itemsize
                    if raw is not None and host is not None and tokens * host.shape[1] == nbytes:
                        mem.host.append((host, raw[off: off + nbytes].reshape(tokens, host.shape[1])))
                    else:
                        mem.device.append((buf, dev, name, off, rows, dtype))
        except BaseException:
            mem.release()
            raise
        return mem

    def save_block(self, bid: int, seq: int, start: int, tokens: int) -> None:
        """Copy KV rows of positions [start, start+tokens) of slot `seq` into a new block `bid`."""
        self._tell({"op": "save", "bid": bid, "seq": seq, "start": start, "tokens": tokens})
        self._save(bid, seq, start, tokens)

    def _save(self, bid: int, seq: int, start: int, tokens: int) -> None:
        if bid in self.blocks:
            raise InputError(f"prefix-cache block {bid} exists already")
        graph, row = self.runtime.graph, seq * self.serving.max_ctx + start
        end = row + tokens
        mem = self._new_block(tokens)
        try:
            for state_rows, part in mem.host:
                np.copyto(part, state_rows[row: end])
            for buf, dev, name, off, rows, dtype in mem.device:
                graph.devices[dev].write(self._binding(buf, rows, dtype, off), graph.read_rows(name, row, tokens))
        except BaseException:
            mem.release()
            raise
        self.blocks[bid] = mem

    def load_block(self, bid: int, seq: int, start: int) -> None:
        """Copy block `bid` into the KV rows of slot `seq` from position `start`."""
        self._tell({"op": "load", "bid": bid, "seq": seq, "start": start})
        self._load(bid, seq, start)

    def _load(self, bid: int, seq: int, start: int) -> None:
        graph, row = self.runtime.graph, seq * self.serving.max_ctx + start
        mem = self.blocks[bid]
        end = row + mem.tokens
        for state_rows, part in mem.host:
            np.copyto(state_rows[row: end], part)
        for buf, dev, name, off, rows, dtype in mem.device:
            graph.write_rows(name, row, graph.devices[dev].read(self._binding(buf, rows, dtype, off)))

    def drop_block(self, bid: int) -> None:
        self._tell({"op": "drop", "bid": bid})
        self._drop(bid)

    def _drop(self, bid: int) -> None:
        mem = self.blocks.pop(bid, None)
        if mem is None:
            return
        spare = self._spare.setdefault(mem.tokens, [])
        if len(spare) < SPARE_BLOCKS:
            spare.append(mem)
        else:
            mem.release()

    @staticmethod
    def _host_bytes(device: Any, buf: Buffer) -> np.ndarray | None:
        """The block buffer's bytes as a host array (one view for all its parts), or None where the host
        does not address the device's memory (the parts then go through `write`)."""
        words = buf.nbytes // 4              # parts start on ALIGN-byte boundaries: whole 4-byte words
        view = device.host_view(Binding(buf, 0, (words,), (1,), "f32")) if words else None
        return None if view is None else view.view(np.uint8)

    @staticmethod
    def _binding(buf: Buffer, shape: tuple[int, ...], dtype: str, offset: int = 0) -> Binding:
        return Binding(buf, offset, tuple(shape), contiguous_strides(shape), dtype)

    def close(self) -> None:
        """Free every block and spare block, forget the states' host views (rank 0 tells the others
        with `stop`); before the runtime is released."""
        for mem in [*self.blocks.values(), *(m for spare in self._spare.values() for m in spare)]:
            mem.release()
        self.blocks.clear()
        self._spare.clear()
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
                    self._save(msg["bid"], msg["seq"], msg["start"], msg["tokens"])
                elif op == "load":
                    self._load(msg["bid"], msg["seq"], msg["start"])
                elif op == "drop":
                    self._drop(msg["bid"])
        finally:
            self.close()
