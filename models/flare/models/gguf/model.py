"""GgufLM: a GGUF decoder prepared on a Session — steps for schedulers, generate for users.

`GgufLM.load(target, ...)` opens the file (named model or path), reads the
config, and prepares one PreparedGraph through the registered `gguf`
ModelSpec (so `flare run`, `flare describe` and `flare bench` prepare the
same thing), with `prefill`/`decode` entries sharing weights, KV state and,
for MoE files in `offload` mode, the expert caches. Steps use the
`token-lm/1` batch layout (`flare.plugins.export.serving.batch`) with the mask
cut to the step's KV window (`kv_window`: attention over the rows in use, a
plan per (tokens, window) bucket), and tokens
are chosen by the token-LM sampler an exported core is served with, so this
loop and a served core choose tokens the same way.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from flare.core.errors import ModelError
from flare.core.expert_staging import release_staged
from flare.core.ledger import LEDGER
from flare.core.ops.quant import as_float
from flare.core.session import Session
from flare.core.specs import STAGE_EXPERTS

from .config import LMConfig
from .graph import ENTRIES, MODES, OFFLOAD, GraphSpec
from .weights import GGUFModel

if TYPE_CHECKING:
    from flare.plugins.export.schema import Serving

TokenCallback = Callable[[int], None]
MIB = 1 << 20
PLANS_PER_ENTRY = 32     # (tokens, KV window) buckets: pow2 chunks x pow2 windows stay well under this


@dataclass(frozen=True)
class Sampling:
    """greedy=True takes the argmax (first index on ties); else temperature / top-k / top-p with `seed`."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0


def chooser(sampling: Sampling | None):
    """The token-LM sampler (flare.plugins.export.serving.sampling) for these settings."""
    from flare.plugins.export.serving.sampling import SamplingParams, TokenChooser

    s = sampling or Sampling()
    greedy = s.greedy or s.temperature <= 0
    params = SamplingParams(temperature=0.0 if greedy else s.temperature,
                            top_p=s.top_p if s.top_p is not None else 1.0, seed=s.seed, top_k=s.top_k)
    return TokenChooser(params, ())


def serving_contract(cfg: LMConfig) -> "Serving":
    """The model's sizes as the `token-lm/1` serving contract."""
    from flare.plugins.export.schema import Serving

    return Serving("token-lm/1", cfg.max_seqs, cfg.max_ctx, cfg.prefill_chunk, cfg.vocab, cfg.pad, cfg.eos, ())


def slots_for_budget(cfg: LMConfig, infos: Any, cache_mb: float | None, max_step: int) -> int:
    """Expert slots per layer a budget of `cache_mb` MiB (all layers) buys (default: a quarter of
    the experts, at least one step's worth); ModelError when it cannot hold one step's experts."""
    from flare.core.dtypes import itemsize

    from .graph import EXPERT_PARTS, expert_tensor

    per_expert = sum(int(np.prod(infos[expert_tensor(0, p)].shape[1:])) * itemsize(infos[expert_tensor(0, p)].dtype)
                     for p in EXPERT_PARTS)
    need = cfg.slots_needed(max_step)
    if cache_mb is None:
        return min(max(cfg.n_experts // 4, need), cfg.n_experts)
    slots = min(int(cache_mb * MIB) // (cfg.n_layers * per_expert), cfg.n_experts)
    if slots < need:
        raise ModelError(f"{cfg.name}: an expert cache of {cache_mb:g} MiB holds {slots} expert(s) per layer "
                         f"({cfg.n_layers} layers x {per_expert} B); a step of {max_step} token(s) with top_k "
                         f"{cfg.top_k} may need {need} (at least {need * cfg.n_layers * per_expert / MIB:.2f} MiB)")
    return slots


class GgufLM:
    """A prepared GGUF decoder. Obtain with `GgufLM.load`; call `release()` when done.
    Not for concurrent use by several threads (steps share the KV cache); the graph's own
    lock keeps concurrent calls sequential but their sequences must not collide."""

    def __init__(self, model: GGUFModel, session: Session, *, experts: str, slots: int, owns_session: bool,
                 prefetch: int = 0):
        self.model = model
        self.cfg = model.cfg
        self.session = session
        self.experts = experts
        self.slots = slots
        self._owns_session = owns_session
        self.steps = 0
        self.tokens_in = 0
        self.seconds = 0.0
        self.spec = GraphSpec(model.cfg, model.infos(), model.tensor, experts, slots)
        options = {"graph_spec": self.spec, "model": model, "prefetch": prefetch}
        self.graph = session.prepare_model("gguf", options)
        self.graph.max_plans = max(self.graph.max_plans, PLANS_PER_ENTRY)
        self.stager = self.graph.callbacks.get(STAGE_EXPERTS)
        self._prepared = set(self.graph.entries) & {"prefill", "decode"}
        # The weights are on the devices now: their copies of the file's pages may go. A CPU
        # device copies nothing (Device.adopt: it computes on the mapped file, as llama.cpp
        # does), so with only CPU devices the pages are its weights and stay.
        if any(d.backend != "cpu" for d in session.devices):
            model.file.drop_pages()
        self.released = False

    @classmethod
    def load(cls, target: str | os.PathLike = "smollm2", *, devices: Sequence[str] | None = None,
             session: Session | None = None, max_seqs: int = 1, max_ctx: int | None = None, prefill_chunk: int = 64,
             experts: str = "resident", cache_mb: float | None = None, prefetch: int = 0) -> "GgufLM":
        """Open `target` (a named model such as smollm2, or a .gguf path) and prepare it.
        experts (MoE files): "resident", or "offload" to a bounded cache of `cache_mb` MiB filled
        from the memory-mapped file per step; `prefetch` n > 0 also copies each token's n likeliest
        experts of the next layer on a background thread while a layer computes (CPU devices only:
        the background writes go straight to host memory)."""
        if experts not in MODES:
            raise ModelError(f"experts must be one of {', '.join(MODES)}, not {experts!r}")
        model = GGUFModel.open(target, max_seqs=max_seqs, max_ctx=max_ctx, prefill_chunk=prefill_chunk)
        if experts == OFFLOAD and not model.cfg.is_moe:
            raise ModelError(f"{target}: experts=offload needs a mixture-of-experts file; this one has none")
        slots = 0
        if experts == OFFLOAD:
            slots = slots_for_budget(model.cfg, model.infos(), cache_mb,
                                     max(model.cfg.prefill_chunk, model.cfg.max_seqs))
        owns = session is None
        sess = session or Session(list(devices or ["cpu"]))
        if prefetch and (experts != OFFLOAD or any(d.backend != "cpu" for d in sess.devices)):
            if owns:
                sess.close()
            raise ModelError("expert prefetch needs experts=offload on CPU devices only (a background copy into "
                             "another device's cache would race its queue)")
        try:
            return cls(model, sess, experts=experts, slots=slots, owns_session=owns, prefetch=prefetch)
        except BaseException:
            if owns:
                sess.close()
            raise

    # -------------------------------------------------------------------- steps
    def step(self, chunks: Sequence[Any], *, entry: str | None = None) -> np.ndarray:
        """Run one batch of `Chunk`s (seq, start, tokens); logits [len(chunks), vocab] of each
        chunk's last token."""
        from flare.plugins.export.serving.batch import kv_window, token_lm_inputs

        self._check_alive()
        if entry is None:
            if all(len(c.tokens) == 1 for c in chunks):
                entry = "decode"
            else:
                entry = "prefill" if len(chunks) == 1 else "mixed"
        if entry not in ENTRIES:
            raise ModelError(f"unknown entry {entry!r}; entries are {', '.join(ENTRIES)}")
        for c in chunks:
            bad = [t for t in c.tokens if not 0 <= t < self.cfg.vocab]
            if bad:
                raise ModelError(f"token ids {bad[:4]} outside the vocabulary 0..{self.cfg.vocab - 1}")
        n = sum(len(c.tokens) for c in chunks)
        if self.experts == OFFLOAD and self.cfg.slots_needed(n) > self.slots:
            raise ModelError(f"a step of {n} tokens may need {self.cfg.slots_needed(n)} experts per layer; the "
                             f"expert cache has {self.slots} slot(s) per layer")
        serving = serving_contract(self.cfg)
        inputs = token_lm_inputs(serving, list(chunks), tokens=n, batch=None if entry == "decode" else len(chunks),
                                 window=kv_window(serving, chunks))
        if entry not in self._prepared:
            self.graph.prepare(entry, {k: v.shape for k, v in inputs.items()})
            self._prepared.add(entry)
        t0 = time.perf_counter()
        with self.graph.hold():                # no other thread's step between the prefetch and its step
            if self.stager is not None and self.stager.prefetch:
                ids = np.fromiter((t for c in chunks for t in c.tokens), np.int64)
                embd = self.model.tensor("token_embd.weight")
                # layer 0 guesses from the tokens' embeddings, dequantized on the helper thread
                self.stager.prefetch_layer(0, lambda: as_float(np.asarray(embd[ids])), self.graph)
            out = self.graph.execute(entry, **inputs)["logits"]
        self.seconds += time.perf_counter() - t0
        self.steps += 1
        self.tokens_in += n
        return out

    def prefill(self, seq: int, tokens: Sequence[int], start: int = 0, *, all_logits: bool = False) -> np.ndarray:
        """Feed `tokens` of sequence `seq` from `start` in power-of-two chunks; the last token's
        logits [vocab], or with `all_logits` every token's [n, vocab] (teacher forcing)."""
        from flare.plugins.export.serving.batch import Chunk, pow2_chunks

        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ModelError("prefill needs at least one token")
        rows = []
        at = 0
        for size in pow2_chunks(len(tokens), self.cfg.prefill_chunk):
            part = tokens[at: at + size]
            if all_logits:
                rows.append(self.step([Chunk(seq, start + at, tuple(part))], entry="decode")
                            if size == 1 else self._all_rows(seq, start + at, part))
            else:
                rows.append(self.step([Chunk(seq, start + at, tuple(part))], entry="prefill"))
            at += size
        return np.concatenate(rows) if all_logits else rows[-1][0]

    def _all_rows(self, seq: int, start: int, part: list[int]) -> np.ndarray:
        """Logits of every token of a chunk: the prefill graph with out_rows selecting each row."""
        from flare.plugins.export.serving.batch import Chunk, kv_window, token_lm_inputs

        serving, chunks = serving_contract(self.cfg), [Chunk(seq, start, tuple(part))]
        inputs = token_lm_inputs(serving, chunks, tokens=len(part), batch=1, window=kv_window(serving, chunks))
        inputs["out_rows"] = np.arange(len(part), dtype=np.int32)
        t0 = time.perf_counter()
        out = self.graph.execute("prefill", **inputs)["logits"]
        self.seconds += time.perf_counter() - t0
        self.steps += 1
        self.tokens_in += len(part)
        return out

    def decode(self, seqs: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        from flare.plugins.export.serving.batch import Chunk

        return self.step([Chunk(s, p, (t,)) for s, t, p in zip(seqs, tokens, positions)], entry="decode")

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 32, sampling: Sampling | None = None, *,
                 seq: int = 0, on_token: TokenCallback | None = None,
                 stop_at_eos: bool = True) -> tuple[list[int], list[np.ndarray]]:
        """Prefill the prompt, then decode up to `max_new_tokens` tokens; (tokens, their logits)."""
        from flare.plugins.export.serving.generate import generate

        return generate(self.prefill, self.decode, chooser(sampling), prompt_ids, max_new_tokens, max_ctx=self.cfg.max_ctx,
                        eos=self.cfg.eos, name=self.cfg.name, seq=seq, on_token=on_token, stop_at_eos=stop_at_eos,
                        context_hint="--max-ctx")

    # ------------------------------------------------------------- bookkeeping
    def reset(self) -> None:
        """Zero the KV caches."""
        self._check_alive()
        self.graph.reset()

    def stats(self) -> dict[str, Any]:
        devices = {}
        persistent = self.graph.persistent_bytes() if not self.released else {}
        for name in (d.name for d in self.session.devices):
            devices[name] = {"live_bytes": LEDGER.live_bytes(name), "peak_bytes": LEDGER.peak_bytes(name),
                             "persistent_bytes": persistent.get(name, 0)}
        return {"model": self.cfg.name, "experts": self.experts, "slots_per_layer": self.slots, "steps": self.steps,
                "tokens_in": self.tokens_in, "seconds": self.seconds,
                "staging": self.stager.stats.as_dict() if self.stager is not None else None, "devices": devices}

    def release(self) -> None:
        """Release the prepared graph (and the session if `load` opened it). Idempotent."""
        if self.released:
            return
        self.released = True
        release_staged(self.graph, self.stager, self.session.close if self._owns_session else None)

    def _check_alive(self) -> None:
        if self.released:
            raise ModelError(f"{self.cfg.name}: model was released")

    def __enter__(self) -> "GgufLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
