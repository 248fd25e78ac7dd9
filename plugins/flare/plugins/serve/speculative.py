"""Speculative decoding: a drafter proposes up to K tokens, the full model checks them in one step.

Drafters (`--draft`):
- `ngram` (prompt lookup, as llama.cpp's lookup decoding and vLLM's n-gram
  speculator): no second model. The last n tokens of the sequence (n from
  `NGRAM_MAX` down to `NGRAM_MIN`) are looked up in the prompt and the text so
  far; the tokens that followed their latest earlier occurrence are the
  proposals. A sequence with no match proposes nothing; a round where no
  sequence proposes anything is a plain `decode` step (nothing is verified in vain).
- `self`: the core's `draft` programs (the exporter writes them: the model's
  first layers and its head, sharing the model's KV state by name), K batched
  draft steps, one token per sequence each.

Verification is the same for both: steps of the core's `verify` programs (the
full model, logits of every token) holding each sequence's last token and its
proposals (`1 + k` tokens per sequence, as many sequences per step as a
verify program holds). The verify step rewrites every layer's KV rows of the
checked positions, and rows past the accepted tokens are never admitted by a
mask before being written again.

Acceptance, greedy and sampled alike: the full model's token at each position
is chosen exactly as plain decoding would choose it (`TokenChooser` at that
output index: the argmax, or an inverse-CDF draw from the request's uniform
for that index); proposals are accepted while they equal it, and the model's
own token at the first mismatch (or after the last proposal) is added. So the
output is token for token plain decoding's, greedy or seeded, whatever the
drafter proposed; sampled self-drafts draw with the same uniform (a coupled
draft), so a draft close to the model is accepted often.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from flare.plugins.export.serving.batch import Chunk
from flare.plugins.export.serving.sampling import TokenChooser

from .engine import StepEngine

DRAFTERS = ("ngram", "self")
NGRAM_MAX, NGRAM_MIN = 3, 1
BACKOFF_MAX = 16   # most rounds a sequence whose proposals keep missing goes without proposing


class Speculating(Protocol):
    """What a round needs of a sequence (the loop's `_Seq`)."""

    slot: int
    tokens: list[int]
    chooser: TokenChooser
    draft_wait: int              # prompt lookup's back-off (ngram): rounds left without proposals
    draft_backoff: int           # the wait after the next round whose proposals all miss

    @property
    def prompt(self) -> Sequence[int]: ...
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
    plain_steps: int = 0       # rounds where nothing was proposed: a plain decode step instead

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


def ngram_proposals(context: Sequence[int], k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the context's last n tokens
    (the longest n in [n_min, n_max] that occurs); [] when none occurs."""
    if k <= 0 or len(context) < n_min + 1:
        return []
    arr = np.asarray(context, np.int64)
    for n in range(min(n_max, len(arr) - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)   # every earlier n-gram start
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start: start + k].tolist()
    return []


class Speculator:
    def __init__(self, engine: StepEngine, k: int, draft: str = "ngram"):
        if k < 1:
            raise ValueError("speculative K must be >= 1")
        if draft not in DRAFTERS:
            raise ValueError(f"draft must be one of {DRAFTERS}, got {draft!r}")
        self.engine = engine
        self.k = k
        self.draft = draft
        self.stats = SpecStats()
        self.max_ctx = engine.serving.max_ctx

    def _k(self, s: Speculating) -> int:
        """Proposals for `s`: at most K, never past its token budget or the context."""
        return max(0, min(self.k, s.budget - 1, self.max_ctx - 1 - s.position))

    def round(self, seqs: Sequence[Speculating]) -> dict[int, list[int]]:
        """New tokens of each sequence (by index in `seqs`): its accepted proposals and one more."""
        ks = [self._k(s) for s in seqs]
        drafts = self._propose_self(seqs, ks) if self.draft == "self" else self._propose_ngram(seqs, ks)
        out: dict[int, list[int]] = {}
        if not any(drafts):                 # nothing to check: one plain decode step
            rows = self._batched("decode", [Chunk(s.slot, s.position, (s.tokens[-1],)) for s in seqs],
                                 [1] * len(seqs))
            self.stats.plain_steps += 1
            for j, s in enumerate(seqs):
                out[j] = [s.chooser(rows[j], len(s.tokens))]
            self.stats.rounds += 1
            return out
        drafts = self._fit_bucket(drafts)
        chunks = [Chunk(s.slot, s.position, (s.tokens[-1], *drafts[j])) for j, s in enumerate(seqs)]
        rows = self._batched("verify", chunks, [1 + len(d) for d in drafts])
        at = 0
        for j, s in enumerate(seqs):
            n = 1 + len(drafts[j])
            out[j] = self.accept(s.chooser, len(s.tokens), drafts[j], rows[at: at + n])
            at += n
            if self.draft == "ngram" and drafts[j]:
                self._back_off(s, hit=len(out[j]) > 1)
            self.stats.proposed += len(drafts[j])
            self.stats.accepted += len(out[j]) - 1
        self.stats.rounds += 1
        return out

    def _fit_bucket(self, drafts: list[list[int]]) -> list[list[int]]:
        """Drafts trimmed (last proposals of the longest first) so that one verify step is exactly a
        bucket's size: a padded row costs as much as a real one (on the CPU a step's cost grows with its
        rows), and a proposal near the end of a draft is the least likely to be accepted. Unchanged when
        the step is already a bucket's size, spans several steps, or no smaller bucket holds it."""
        n = len(drafts)
        total = n + sum(map(len, drafts))
        sizes = [b.tokens for b in self.engine.buckets.get("verify", []) if b.batch >= n]
        if not sizes or total > max(sizes) or total in sizes:
            return drafts
        target = max((t for t in sizes if n <= t < total), default=None)
        if target is None:
            return drafts
        out = [list(d) for d in drafts]
        while total > target:
            longest = max(range(n), key=lambda j: len(out[j]))
            out[longest].pop()
            total -= 1
        return out

    def _propose_ngram(self, seqs: Sequence[Speculating], ks: list[int]) -> list[list[int]]:
        """Prompt lookup for each sequence not backing off (see `_back_off`)."""
        drafts: list[list[int]] = []
        for s, k in zip(seqs, ks):
            if s.draft_wait > 0:
                s.draft_wait -= 1
                drafts.append([])
            else:
                drafts.append(ngram_proposals([*s.prompt, *s.tokens], k))
        return drafts

    @staticmethod
    def _back_off(s: Speculating, hit: bool) -> None:
        """After a round with proposals: a hit resets the back-off; a miss (not even the first proposal
        accepted) stops proposing for 1, 2, 4 ... up to BACKOFF_MAX rounds, so text with nothing to copy
        pays a verify step only every so often instead of every round."""
        if hit:
            s.draft_wait = s.draft_backoff = 0
        else:
            s.draft_backoff = min(BACKOFF_MAX, max(1, 2 * s.draft_backoff))
            s.draft_wait = s.draft_backoff

    def _propose_self(self, seqs: Sequence[Speculating], ks: list[int]) -> list[list[int]]:
        """K batched steps of the draft programs; each proposal chosen as the model would choose it."""
        drafts: list[list[int]] = [[] for _ in seqs]
        for i in range(max(ks, default=0)):
            active = [j for j, k in enumerate(ks) if k > i]
            chunks = [Chunk(seqs[j].slot, seqs[j].position + i, (drafts[j][-1] if i else seqs[j].tokens[-1],))
                      for j in active]
            logits = self._batched("draft", chunks, [1] * len(chunks))
            self.stats.draft_steps += 1
            for j, row in zip(active, logits):
                drafts[j].append(seqs[j].chooser(row, len(seqs[j].tokens) + i))
        return drafts

    def _batched(self, kind: str, chunks: list[Chunk], sizes: list[int]) -> np.ndarray:
        """Run `chunks` in as few steps of `kind` as its programs allow; logits of every token, in order."""
        t_max, b_max = self.engine.limit(kind)
        parts: list[np.ndarray] = []
        group: list[Chunk] = []
        tokens = 0
        for c, n in zip(chunks, sizes):
            if group and (tokens + n > t_max or len(group) == b_max):
                parts.append(self._run(kind, group))
                group, tokens = [], 0
            group.append(c)
            tokens += n
        if group:
            parts.append(self._run(kind, group))
        return np.concatenate(parts)

    def _run(self, kind: str, group: list[Chunk]) -> np.ndarray:
        if kind == "verify":
            self.stats.verify_steps += 1
        return self.engine.run(kind, group)[0]

    @staticmethod
    def accept(ch: TokenChooser, index: int, drafts: Sequence[int], rows: np.ndarray) -> list[int]:
        """The tokens plain decoding would give from output index `index`, as far as `drafts` agree
        with them, plus the first that does not (or the one after the last proposal)."""
        out: list[int] = []
        for i, d in enumerate(drafts):
            t = ch(rows[i], index + i)
            out.append(t)
            if t != d:
                return out
        out.append(ch(rows[len(drafts)], index + len(drafts)))
        return out

    def status(self) -> dict[str, Any]:
        s = self.stats
        return {"k": self.k, "draft": self.draft, "rounds": s.rounds, "proposed": s.proposed,
                "accepted": s.accepted, "acceptance": s.acceptance, "draft_steps": s.draft_steps,
                "verify_steps": s.verify_steps, "plain_steps": s.plain_steps}
