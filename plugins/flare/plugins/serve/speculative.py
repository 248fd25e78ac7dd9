"""Speculative decoding: a draft program proposes K tokens, the full model checks them in one step.

The core's catalog holds `draft` programs (the exporter writes them: the
model's first layers and its head, a self-draft; or every layer, the ideal
case of the model drafting for itself) and `verify` programs (the full model,
logits of every token). Draft layers share the model's KV state by name, so
a draft step writes the rows its layers would write anyway; the verify step
then rewrites every layer's rows of the checked positions, and rows past the
accepted tokens are never admitted by a mask before being written again.

One round for the decoding sequences: K draft steps (one token of each
sequence per step, batched), then verify steps holding each sequence's
last token and its proposals (`1 + K` tokens per sequence, as many sequences
per step as a verify program holds). Acceptance:
- greedy: accept proposals while each equals the argmax of the full model at
  its position, then add the full model's own next token, so the output is
  token for token what plain greedy decoding gives;
- sampled: the standard rule (accept proposal x with probability
  min(1, p(x)/q(x)); on the first rejection draw from max(0, p - q)
  normalised; if all pass, draw one more from p), which keeps the full
  model's distribution.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from flare.plugins.export.serving.batch import Chunk

from .engine import StepEngine
from flare.plugins.export.serving.sampling import TokenChooser


class Speculating(Protocol):
    """What a round needs of a sequence (the loop's `_Seq`)."""

    slot: int
    tokens: list[int]
    chooser: TokenChooser

    @property
    def position(self) -> int: ...
    @property
    def budget(self) -> int: ...


@dataclass
class SpecStats:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    draft_steps: int = 0
    verify_steps: int = 0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


class Speculator:
    def __init__(self, engine: StepEngine, k: int):
        if k < 1:
            raise ValueError("speculative K must be >= 1")
        self.engine = engine
        self.k = k
        self.stats = SpecStats()
        self.max_ctx = engine.serving.max_ctx

    def _k(self, s: Speculating) -> int:
        """Proposals for `s`: at most K, never past its token budget or the context."""
        return max(0, min(self.k, s.budget - 1, self.max_ctx - 1 - s.position))

    def round(self, seqs: Sequence[Speculating]) -> dict[int, list[int]]:
        """New tokens of each sequence (by index in `seqs`): its accepted proposals and one more."""
        ks = [self._k(s) for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[np.ndarray]] = [[] for _ in seqs]
        for i in range(max(ks, default=0)):
            active = [j for j, k in enumerate(ks) if k > i]
            chunks = [Chunk(seqs[j].slot, seqs[j].position + i, (drafts[j][-1] if i else seqs[j].tokens[-1],))
                      for j in active]
            logits, _ = self._batched("draft", chunks, [1] * len(chunks))
            self.stats.draft_steps += 1
            for j, row in zip(active, logits):
                ch = seqs[j].chooser
                if ch.params.greedy:
                    tok = ch(row)
                else:
                    q = ch.probs(row)
                    qs[j].append(q)
                    tok = ch.draw(q)
                drafts[j].append(tok)
        chunks = [Chunk(s.slot, s.position, (s.tokens[-1], *drafts[j])) for j, s in enumerate(seqs)]
        rows, _ = self._batched("verify", chunks, [1 + k for k in ks])
        out: dict[int, list[int]] = {}
        at = 0
        for j, s in enumerate(seqs):
            n = 1 + ks[j]
            out[j] = self._accept(s.chooser, drafts[j], qs[j], rows[at: at + n])
            at += n
            self.stats.proposed += ks[j]
            self.stats.accepted += len(out[j]) - 1
        self.stats.rounds += 1
        return out

    def _batched(self, kind: str, chunks: list[Chunk], sizes: list[int]) -> tuple[np.ndarray, Any]:
        """Run `chunks` in as few steps of `kind` as its programs allow; logits of every token, in order."""
        t_max, b_max = self.engine.limit(kind)
        parts: list[np.ndarray] = []
        group: list[Chunk] = []
        tokens = 0
        for c, n in zip(chunks, sizes):
            if group and (tokens + n > t_max or len(group) == b_max):
                parts.append(self.engine.run(kind, group)[0])
                if kind == "verify":
                    self.stats.verify_steps += 1
                group, tokens = [], 0
            group.append(c)
            tokens += n
        if group:
            parts.append(self.engine.run(kind, group)[0])
            if kind == "verify":
                self.stats.verify_steps += 1
        return np.concatenate(parts), None

    @staticmethod
    def _accept(ch: TokenChooser, drafts: list[int], qs: list[np.ndarray], rows: np.ndarray) -> list[int]:
        out: list[int] = []
        if ch.params.greedy:
            for i, d in enumerate(drafts):
                t = ch(rows[i])
                out.append(t)
                if t != d:
                    return out
            out.append(ch(rows[len(drafts)]))
            return out
        for i, d in enumerate(drafts):
            p, q = ch.probs(rows[i]), qs[i]
            if ch.uniform() * q[d] < p[d]:          # accept with probability min(1, p/q)
                out.append(d)
                continue
            residual = np.maximum(p - q, 0.0)
            out.append(ch.draw(residual if residual.sum() > 0 else p))
            return out
        out.append(ch.draw(ch.probs(rows[len(drafts)])))
        return out
