"""The step policy of the one serving loop: what the next step runs (`flare serve` and `flare run NAME.core`).

Each step is one of:
- `mixed`: one sequence's prefill chunk plus one decode token of every
  sequence already decoding (when the core's mixed programs are selected);
- `prefill`: a chunk of the oldest sequence still reading its prompt;
- `decode`: one token of every decoding sequence (least recently served
  first when a step cannot hold them all, so none starves).

Without mixed programs, prefill and decode steps alternate whenever both
have work, so neither starves: a prompt advances by at least one chunk every
other step and every decoding sequence gets a token every other step.
Prompts are served oldest first.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence, TypeVar

from flare.plugins.export.serving.batch import Chunk
from flare.plugins.export.serving.engine import Engine


class Planned(Protocol):
    """What the step policy reads of a sequence (the loop's `_Seq`)."""

    slot: int
    fed: int                      # prompt tokens already in the KV cache
    served: int                   # the last step that fed it
    tokens: list[int]

    @property
    def req(self) -> Any: ...     # has `.prompt`
    @property
    def prefilling(self) -> bool: ...
    @property
    def position(self) -> int: ...


S = TypeVar("S", bound=Planned)


def plan_step(engine: Engine, running: Sequence[S], last: str | None, use_mixed: bool) -> tuple[str, list[tuple[S, Chunk]]]:
    """The next step: its kind and a chunk for each sequence it feeds (see the module docstring)."""
    prefilling = [s for s in running if s.prefilling]
    # least recently served first: when a step cannot hold every decoding sequence, none starves
    decoding = sorted((s for s in running if not s.prefilling), key=lambda s: s.served)
    cap = engine.serving.max_prefill_tokens
    if use_mixed and prefilling and decoding:
        t_max, b_max = engine.limit("mixed")
        dec = decoding[: b_max - 1]
        p = prefilling[0]
        n = min(len(p.req.prompt) - p.fed, cap, t_max - len(dec))
        return "mixed", [(p, _prefill_chunk(p, n))] + [(s, _decode_chunk(s)) for s in dec]
    if prefilling and (not decoding or last != "prefill"):
        p = prefilling[0]
        n = min(len(p.req.prompt) - p.fed, cap, engine.limit("prefill")[0])
        return "prefill", [(p, _prefill_chunk(p, n))]
    t_max, b_max = engine.limit("decode")
    return "decode", [(s, _decode_chunk(s)) for s in decoding[: min(t_max, b_max)]]


def _prefill_chunk(s: Planned, n: int) -> Chunk:
    return Chunk(s.slot, s.fed, tuple(s.req.prompt[s.fed: s.fed + n]))


def _decode_chunk(s: Planned) -> Chunk:
    return Chunk(s.slot, s.position, (s.tokens[-1],))
