"""Speculative decoding: a drafter proposes up to K tokens, the full model checks them in one step.

Drafters (`--draft`):
- `ngram` (prompt lookup, as llama.cpp's lookup decoding and vLLM's n-gram
  speculator): no second model. The last n tokens of the sequence (n from
  `NGRAM_MAX` down to `NGRAM_MIN`) are looked up in the prompt and the text so
  far; the tokens that followed their latest earlier occurrence are the
  proposals. When only a single token matches but the tokens before the last
  one match a longer span, the model inserted that last token into text it is
  copying (a comma, a word): the span's continuation is proposed (`resync`).
  A sequence with no match proposes nothing; a round where no
  sequence proposes anything is a plain `decode` step (nothing is verified in vain).
  The draft length is chosen per sequence and round for the most tokens per
  second (`DraftLength`: its acceptance rate so far against the measured cost
  of verify steps of each size; `--draft-min N` puts a floor under it, as
  llama.cpp's option of that name does, for a device or a test where step
  times are too noisy to go by), and a sequence whose proposals all miss backs
  off.
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

import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from flare.plugins.export.serving.batch import Chunk
from flare.plugins.export.serving.sampling import TokenChooser

from .engine import StepEngine

DRAFTERS = ("ngram", "self")
NGRAM_MAX, NGRAM_MIN = 3, 1
RESYNC_MIN = 2     # a match of the tokens before an inserted one counts from this length (one is chance)
BACKOFF_MAX = 16   # most rounds a sequence whose proposals keep missing goes without proposing
START_DRAFT = 3    # prompt lookup's draft length (1 + 3 tokens: a verify bucket) until step costs are known
DECAY = 0.8        # weight of a sequence's earlier rounds in its acceptance estimate (DraftLength)
PRIOR_ACCEPTED = 3.0   # with one rejection: an acceptance rate of 0.75 before a sequence's first round


class Speculating(Protocol):
    """What a round needs of a sequence (the loop's `_Seq`)."""

    slot: int
    tokens: list[int]
    chooser: TokenChooser
    draft_wait: int              # prompt lookup's back-off (ngram): rounds left without proposals
    draft_backoff: int           # the wait after the next round whose proposals all miss
    draft_accepted: float        # prompt lookup: decayed count of accepted proposals (DraftLength)
    draft_rejected: float        # ... and of rounds that ended in a rejected proposal

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


def _continuation(arr: np.ndarray, end: int, n_max: int, n_min: int) -> int | None:
    """Where the text after the latest earlier occurrence of arr[end-n:end] starts (the longest n in
    [n_min, n_max] that occurs before `end`), or None."""
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[: end - 1], n)   # every earlier n-gram start
        hits = np.flatnonzero((windows == arr[end - n: end]).all(axis=1))
        if hits.size:
            return int(hits[-1]) + n
    return None


def ngram_proposals(context: Sequence[int], k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the context's last n tokens
    (the longest n in [n_min, n_max] that occurs); [] when none occurs.

    A match of at least RESYNC_MIN tokens is looked for first, then one of the tokens before the last
    (the model inserted the last token into a span it copies: what followed the span comes next), and
    only then a single token."""
    if k <= 0 or len(context) < n_min + 1:
        return []
    arr = np.asarray(context, np.int64)
    start = None
    if n_max >= RESYNC_MIN:
        start = _continuation(arr, len(arr), n_max, max(n_min, RESYNC_MIN))
        if start is None and len(arr) > RESYNC_MIN + 1:
            start = _continuation(arr, len(arr) - 1, n_max, RESYNC_MIN)     # resync: skip the last token
    if start is None and n_min < RESYNC_MIN:
        start = _continuation(arr, len(arr), min(n_max, RESYNC_MIN - 1), n_min)
    return [] if start is None else arr[start: start + k].tolist()


class DraftLength:
    """Prompt lookup's draft length, chosen each round for the most tokens per second.

    A verify step of 1 + d tokens yields E(d) = 1 + p + ... + p^d tokens when each proposal is accepted
    with probability p (the sequence's own recent rate: decayed counts of accepted proposals and of
    rounds ending in a rejection, `DECAY`, from a prior of 0.75), and costs what the measured step
    times say (`observe`: seconds per step by its token rows, a line fitted through the sizes seen,
    so an unseen bucket is estimated from the others). The length is the rung (the sizes that fill a
    verify bucket for one sequence, up to K) from START_DRAFT up with the highest E(d) / seconds(1 + d),
    or none when a plain decode step (1 / seconds(1)) is expected to be faster; START_DRAFT until two
    step sizes have been timed. (Shorter drafts than START_DRAFT are not tried: a rate estimated from
    a few rounds is too noisy to choose between 1 and 3 proposals.) So where a verify step costs about
    a decode step (a GPU) long drafts win, and where its cost grows with its rows (the CPU's quantized
    products) drafts stay short unless the text is being copied almost token for token."""

    def __init__(self, k: int, verify_tokens: Sequence[int], minimum: int = 0):
        self.rungs = sorted({t - 1 for t in verify_tokens if 1 <= t - 1 <= k} | {k})
        self.start = max((r for r in self.rungs if r <= START_DRAFT), default=self.rungs[0])
        # `--draft-min`: the shortest rung of at least `minimum` proposals, whatever the costs say (0: none)
        self.floor = min((r for r in self.rungs if r >= minimum), default=self.rungs[-1]) if minimum > 0 else 0
        self.seconds: dict[int, float] = {}        # step rows -> seconds (moving average)
        self._seen: dict[int, int] = {}

    def observe(self, rows: int, seconds: float) -> None:
        """A step of `rows` rows took `seconds`. A size's first step is not counted (it may have planned
        a new KV window: many times a step; until a second one runs, the size's cost is estimated from
        the others); later ones move the average, a slow outlier (another process took the core) by at
        most half the average."""
        n = self._seen[rows] = self._seen.get(rows, 0) + 1
        old = self.seconds.get(rows)
        if n == 1:
            return
        if old is None:
            self.seconds[rows] = seconds
        else:
            self.seconds[rows] = old + 0.2 * (min(seconds, 1.5 * old) - old)

    def cost(self, rows: int) -> float | None:
        """Seconds of a step of `rows` token rows: measured, or on the line through the sizes measured."""
        if rows in self.seconds:
            return self.seconds[rows]
        if len(self.seconds) < 2:
            return None
        t = np.fromiter(self.seconds, float)
        c = np.fromiter(self.seconds.values(), float)
        slope = float(((t - t.mean()) * (c - c.mean())).sum() / ((t - t.mean()) ** 2).sum())
        return float(c.mean() + slope * (rows - t.mean()))

    @staticmethod
    def rate(s: Speculating) -> float:
        return (s.draft_accepted + PRIOR_ACCEPTED) / (s.draft_accepted + s.draft_rejected + PRIOR_ACCEPTED + 1)

    def current(self, s: Speculating) -> int:
        """The draft length for `s` this round; 0 when a plain decode step is expected to be faster
        (never below the floor `--draft-min` sets)."""
        return max(self._by_cost(s), self.floor)

    def _by_cost(self, s: Speculating) -> int:
        p = min(self.rate(s), 0.999)
        best, best_speed = self.start, 0.0
        for d in self.rungs[self.rungs.index(self.start):]:    # shorter drafts: too noisy to be worth it
            c = self.cost(1 + d)
            if c is None or c <= 0:
                return self.start
            speed = (1 - p ** (d + 1)) / (1 - p) / c
            if speed > best_speed:
                best, best_speed = d, speed
        plain = self.cost(1)
        return 0 if plain is not None and plain > 0 and best_speed < 1.0 / plain else best

    @staticmethod
    def update(s: Speculating, proposed: int, accepted: int) -> None:
        """After a round: its proposals counted in (none proposed: the counts only fade, so a sequence
        judged not worth drafting for drifts back to the prior and is tried again)."""
        s.draft_accepted = DECAY * s.draft_accepted + accepted
        s.draft_rejected = DECAY * s.draft_rejected + (accepted < proposed)


class Speculator:
    def __init__(self, engine: StepEngine, k: int, draft: str = "ngram", draft_min: int = 0):
        if k < 1:
            raise ValueError("speculative K must be >= 1")
        if not 0 <= draft_min <= k:
            raise ValueError(f"draft_min must be within 0..K ({k}), got {draft_min}")
        if draft not in DRAFTERS:
            raise ValueError(f"draft must be one of {DRAFTERS}, got {draft!r}")
        self.engine = engine
        self.k = k
        self.draft = draft
        self.stats = SpecStats()
        self.max_ctx = engine.serving.max_ctx
        self.lengths = DraftLength(k, [b.tokens for b in engine.buckets.get("verify", [])], draft_min)

    def _k(self, s: Speculating) -> int:
        """Proposals for `s`: at most K (prompt lookup: its current draft length), never past its token
        budget or the context."""
        k = self.lengths.current(s) if self.draft == "ngram" else self.k
        return max(0, min(k, s.budget - 1, self.max_ctx - 1 - s.position))

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
                if self.draft == "ngram":
                    self.lengths.update(s, 0, 0)
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
            if self.draft == "ngram":
                if drafts[j]:
                    self._back_off(s, hit=len(out[j]) > 1)
                self.lengths.update(s, len(drafts[j]), len(out[j]) - 1)
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
        t0 = time.perf_counter()
        logits, bucket = self.engine.run(kind, group)
        if kind != "draft":
            self.lengths.observe(bucket.tokens, time.perf_counter() - t0)
        return logits

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
