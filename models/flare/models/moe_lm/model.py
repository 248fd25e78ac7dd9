"""MoeLM: a loaded MoE decoder on a Session — steps for schedulers, generate for users.

`MoeLM.load(...)` is the one place that turns options into a prepared graph:
weights file (generated on demand), expert mode and cache size (a too-small
cache is rejected here, before anything is allocated), placement policy, and
one PreparedGraph with `prefill` and `decode` entries sharing memory, KV state
and the expert caches. `step()` runs any batch of sequence chunks (prefill,
decode or mixed), which is what a continuous-batching scheduler needs;
`generate()` is the single-request loop on top of it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from flare.core.errors import ModelError
from flare.core.expert_staging import release_staged
from flare.core.ledger import LEDGER
from flare.core.session import Session
from flare.core.specs import STAGE_EXPERTS

from . import weights as weights_mod
from flare.plugins.export.serving.batch import pow2_chunks

from .batch import SeqChunk, make_inputs
from .config import EOS, MoeConfig, get_config
from .graph import ENTRIES, MODES, OFFLOAD, GraphSpec
from .placement import Placement, resolve
from .sampling import Sampler, Sampling
from .staging import ExpertCacheError, ExpertStager, slots_for_budget

TokenCallback = Callable[[int], None]


@dataclass
class RunCounters:
    steps: int = 0
    tokens_in: int = 0
    seconds: float = 0.0


class MoeLM:
    """A prepared MoE decoder. Obtain with `MoeLM.load`; call `release()` when done."""

    def __init__(self, cfg: MoeConfig, session: Session, weight_file: weights_mod.WeightFile, *, experts: str,
                 slots: int, prefill_chunk: int, placement: Placement, owns_session: bool,
                 expert_source: str = "mmap", trace: bool = False):
        self.cfg = cfg
        self.session = session
        self.weight_file = weight_file
        self.experts = experts
        self.slots = slots
        self.prefill_chunk = prefill_chunk
        self.placement = placement
        self._owns_session = owns_session
        self.counters = RunCounters()
        self.spec = GraphSpec(cfg, weight_file.as_dict(), experts, slots)
        # the runtime reads the registered ModelSpec: graph, placement and the expert-staging
        # callback (built from these options by ModelSpec.stage_experts)
        options = {"graph_spec": self.spec, "weight_file": weight_file, "prefill_chunk": prefill_chunk,
                   "expert_source": expert_source, "trace": trace}
        self.graph = session.prepare_model("moe-lm", options, placement=placement)
        self.stager: ExpertStager | None = self.graph.callbacks.get(STAGE_EXPERTS)
        self._tok_emb = weight_file.tensor("tok_emb")   # [vocab, D]: layer 0's prefetch guesses from it
        self._prepared_entries = set(self.graph.entries) & {"prefill", "decode"}
        self.released = False

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        size: str | MoeConfig = "tiny",
        *,
        experts: str = "resident",
        cache_mb: float | None = None,
        devices: Sequence[str] | None = None,
        session: Session | None = None,
        seed: int = 0,
        weights_path: str | os.PathLike | None = None,
        weights_dir: str | os.PathLike | None = None,
        prefill_chunk: int | None = None,
        expert_source: str = "mmap",
        main_device: str | None = None,
        expert_device: str | None = None,
        layer_devices: Mapping[int, str] | None = None,
        expert_layer_devices: Mapping[int, str] | None = None,
        trace: bool = False,
        prefetch: int = 0,
    ) -> "MoeLM":
        """Load (generating the weights file on first use) and prepare.

        experts: "resident" (expert weights are device weights) or "offload" (a
        bounded device cache of `cache_mb` MiB over all layers, filled per step
        from `expert_source`: "mmap" = the memory-mapped file, "host" = RAM).
        prefill_chunk: most tokens per step (power of two); with the decode batch
        (max_seqs) it sets how many experts a layer may need at once.
        Raises ExpertCacheError (a ModelError) when the cache cannot hold them.
        prefetch: offload only; guess this many experts per token of the next layer
        and copy them on a background thread (CPU expert caches only; outputs unchanged).
        """
        cfg = get_config(size) if isinstance(size, str) else size
        if experts not in MODES:
            raise ModelError(f"moe-lm: experts must be one of {', '.join(MODES)}, not {experts!r}")
        if expert_source not in ("mmap", "host"):
            raise ModelError(f"moe-lm: expert_source must be 'mmap' or 'host', not {expert_source!r}")
        chunk = int(prefill_chunk or cfg.prefill_chunk)
        if chunk < 1 or chunk & (chunk - 1) or chunk > cfg.max_ctx:
            raise ModelError(f"moe-lm: prefill_chunk {chunk} must be a power of two in 1..{cfg.max_ctx}")
        max_step = max(chunk, cfg.max_seqs)
        slots = slots_for_budget(cfg, cache_mb, max_step) if experts == OFFLOAD else 0
        path = weights_path if weights_path is not None else weights_mod.ensure(cfg, seed, weights_dir)
        wf = weights_mod.WeightFile(path, cfg)
        owns = session is None
        sess = session or Session(list(devices or ["cpu"]))
        try:
            placement = Placement(main_device, expert_device, layers=layer_devices,
                                  expert_layers=expert_layer_devices)
            model = cls(cfg, sess, wf, experts=experts, slots=slots, prefill_chunk=chunk, placement=placement,
                        owns_session=owns, expert_source=expert_source, trace=trace)
            if model.stager is not None and prefetch:
                try:
                    _enable_prefetch(model.stager, cfg, wf, placement, sess, prefetch)
                except BaseException:
                    model.graph.release()
                    raise
            return model
        except BaseException:
            if owns:
                sess.close()
            wf.close()
            raise

    # -------------------------------------------------------------------- steps
    def step(self, chunks: Sequence[SeqChunk], *, pad_to: int | None = None, entry: str | None = None) -> np.ndarray:
        """Run one batch of chunks; logits [len(chunks), vocab] of each chunk's last token.

        The entry is `decode` for unpadded all-single-token batches, `prefill` for one
        chunk, `mixed` for several chunks of which one has several tokens (or `entry`).
        """
        self._check_alive()
        lengths = [len(c.tokens) for c in chunks]      # once: this runs on every decode step
        n = sum(lengths)
        single = max(lengths, default=1) == 1          # all(...) of the chunks: True for none
        if self.experts == OFFLOAD and self.cfg.slots_needed(n) > self.slots:  # padding selects no experts
            raise ExpertCacheError(
                f"moe-lm: a step of {n} token(s) may need {self.cfg.slots_needed(n)} experts per layer; the "
                f"expert cache has {self.slots} slot(s) per layer (prefill_chunk is {self.prefill_chunk})")
        if entry is None:
            if pad_to is None and single:
                entry = "decode"
            else:
                entry = "prefill" if len(chunks) == 1 else "mixed"
        if entry not in ENTRIES:
            raise ModelError(f"moe-lm: unknown entry {entry!r}; entries are {', '.join(ENTRIES)}")
        if entry == "decode" and not single:
            raise ModelError("moe-lm: the decode entry takes one token per sequence")
        inputs = make_inputs(self.cfg, chunks, pad_to=pad_to, out_rows=entry != "decode")
        if entry not in self._prepared_entries:
            self.graph.prepare(entry, {k: v.shape for k, v in inputs.items()})
            self._prepared_entries.add(entry)
        t0 = time.perf_counter()
        with self.graph.hold():                # no other thread's step between the prefetch and its step
            if self.stager is not None and self.stager.prefetch:
                tokens = np.fromiter((t for c in chunks for t in c.tokens), np.int64)
                self.stager.prefetch_layer(0, self._tok_emb[tokens], self.graph)   # layer 0: from embeddings
            out = self.graph.execute(entry, **inputs)["logits"][: len(chunks)]  # decode: padding rows dropped
        self.counters.seconds += time.perf_counter() - t0
        self.counters.steps += 1
        self.counters.tokens_in += n
        return out

    def prefill(self, seq: int, tokens: Sequence[int], start: int = 0) -> np.ndarray:
        """Feed `tokens` of sequence `seq` from position `start` in power-of-two chunks of at
        most `prefill_chunk`; returns the last token's logits [vocab]."""
        tokens = list(tokens)
        if not tokens:
            raise ModelError("moe-lm: prefill needs at least one token")
        logits = None
        at = 0
        for size in pow2_chunks(len(tokens), self.prefill_chunk):
            logits = self.step([SeqChunk(seq, start + at, tokens[at: at + size])])[0]
            at += size
        return logits

    def decode(self, seqs: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """One token per sequence; logits [len(seqs), vocab]."""
        return self.step([SeqChunk(s, p, [t]) for s, t, p in zip(seqs, tokens, positions)])

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 32, sampling: Sampling | None = None, *,
                 seq: int = 0, on_token: TokenCallback | None = None,
                 stop_at_eos: bool = True) -> tuple[list[int], list[np.ndarray]]:
        """Prefill the prompt, then decode up to `max_new_tokens` tokens.

        Returns (generated token ids, logits each was chosen from). `on_token` is
        called with each token as soon as it is chosen (streaming). Earlier
        requests' KV rows need no reset: the mask admits only this request's rows.
        """
        from flare.plugins.export.serving.generate import generate

        return generate(self.prefill, self.decode, Sampler(sampling), prompt_ids, max_new_tokens, max_ctx=self.cfg.max_ctx,
                        eos=EOS, name="moe-lm", seq=seq, on_token=on_token, stop_at_eos=stop_at_eos)

    # ------------------------------------------------------------- bookkeeping
    def reset(self) -> None:
        """Zero the KV caches (expert caches stay: they hold weights, not request state)."""
        self._check_alive()
        self.graph.reset()

    def stats(self) -> dict[str, Any]:
        """Staging counters, step counters, and ledger bytes per device."""
        devices = {}
        persistent = self.graph.persistent_bytes() if not self.released else {}
        for name in (d.name for d in self.session.devices):
            devices[name] = {"live_bytes": LEDGER.live_bytes(name), "peak_bytes": LEDGER.peak_bytes(name),
                             "persistent_bytes": persistent.get(name, 0)}
        return {
            "size": self.cfg.name, "experts": self.experts, "slots_per_layer": self.slots,
            "expert_cache_bytes": self.expert_cache_bytes, "prefill_chunk": self.prefill_chunk,
            "steps": self.counters.steps, "tokens_in": self.counters.tokens_in, "seconds": self.counters.seconds,
            "staging": self.stager.stats.as_dict() if self.stager else None,
            "devices": devices,
        }

    @property
    def expert_cache_bytes(self) -> int:
        return self.cfg.n_layers * self.slots * self.cfg.expert_bytes

    def release(self) -> None:
        """Release the prepared graph (and the session if `load` opened it). Idempotent."""
        if self.released:
            return
        self.released = True
        try:
            release_staged(self.graph, self.stager, self.session.close if self._owns_session else None)
        finally:
            self.spec = self._tok_emb = None  # drop the views into the file mapping before closing it
            self.weight_file.close()

    def _check_alive(self) -> None:
        if self.released:
            raise ModelError("moe-lm: model was released")

    def __enter__(self) -> "MoeLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        return (f"MoeLM({self.cfg.name}, experts={self.experts}, slots={self.slots}, "
                f"devices={[d.name for d in self.session.devices]})")


def _enable_prefetch(stager: ExpertStager, cfg: MoeConfig, wf: weights_mod.WeightFile, placement: Placement,
                     session: Session, prefetch: int) -> None:
    """Prefetch writes caches from a background thread: allowed only where every expert
    cache lives in host memory (CPU devices), where such writes need no queue."""
    names = [d.name for d in session.devices]
    for i in range(cfg.n_layers):
        dev = session.device(resolve(placement.wanted(f"L{i}.experts.gate") or names[0], names))
        if dev.backend != "cpu":
            raise ModelError(f"moe-lm: expert prefetch needs the expert caches on a CPU device; layer {i}'s are on "
                             f"{dev.name} (background writes would race its queue)")
    stager.set_routers({n: wf.tensor(n) for n in wf.names() if ".router" in n or ".ffn_norm" in n}, prefetch)
