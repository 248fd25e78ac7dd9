"""One served core: runtime, step engine, prefix cache, speculator, step loop and API, released in order.

`close()` is the one way down, idempotent: stop the loop (it cancels what is
left, frees the prefix cache's blocks and tells other ranks to stop), then
free any block still held (ranks > 0), then release the runtime (captures,
persistent buffers, workspace). After it the ledger holds nothing of this
server.
"""
from __future__ import annotations

from typing import Any

from flare.core.errors import FlareError

from .app import Api
from .engine import StepEngine
from .loop import ServeLoop
from .metrics import ServeMetrics
from .prefix_cache import PrefixCache
from .speculative import Speculator


class Server:
    def __init__(self, runtime: Any, *, name: str, comm: Any = None, prefix_cache: bool = True,
                 prefix_cache_bytes: int = 64 << 20, prefix_block: int = 16, speculative: int = 0,
                 draft: str = "ngram", draft_min: int = 0, max_queue: int = 256, tokenizer: Any = None,
                 limits: Any = None):
        self.runtime = runtime
        self.engine = StepEngine(runtime, comm)
        self.follower = comm is not None and comm.Get_rank() > 0   # replays rank 0's steps, never decides
        core = runtime.core
        self.speculative = speculative
        if speculative and not (self.engine.has("verify") and (draft == "ngram" or self.engine.has("draft"))):
            raise FlareError("--speculative: the selection holds no draft and verify programs")  # selection refuses first
        if speculative:
            k_max = self.engine.limit("verify")[0] - 1
            if speculative > k_max:
                raise FlareError(f"--speculative {speculative}: the core's verify programs hold at most "
                                 f"{k_max} proposals (1 + K tokens of one sequence)")
        if draft_min and not (speculative and draft == "ngram"):
            raise FlareError("--draft-min: only for prompt lookup (--speculative K --draft ngram)")
        if not 0 <= draft_min <= speculative:
            raise FlareError(f"--draft-min {draft_min}: not within 0..{speculative}, the proposals "
                             "--speculative allows")
        self.metrics = ServeMetrics()
        self.cache = PrefixCache(self.engine, prefix_cache_bytes, prefix_block) if prefix_cache else None
        self.spec = Speculator(self.engine, speculative, draft, draft_min) if speculative else None
        self.loop = ServeLoop(self.engine, mixed=core.mixed, prefix_cache=self.cache, speculator=self.spec,
                              max_queue=max_queue, metrics=self.metrics)
        if tokenizer is None and getattr(core, "path", None) is not None:
            from flare.plugins.export.serving.tokenizer import tokenizer_for

            tokenizer = tokenizer_for(core.path, core.manifest)
        self.tokenizer = tokenizer
        self.api = Api(self.loop, model=name, tokenizer=tokenizer, limits=limits, on_shutdown=self.close)
        self.metrics.watch(self.status)
        self._closed = False

    def describe(self) -> str:
        return (f"mixed prefill {'on' if self.loop.mixed else 'off'}, prefix cache "
                f"{'on' if self.cache else 'off'}, speculative "
                f"{f'K={self.speculative}, {self.spec.draft} draft' if self.spec else 'off'}")

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"memory": {} if self.runtime.released else self.runtime.memory(),
                               "step_loop_cpu_seconds": self.loop.cpu_seconds()}
        if self.cache is not None:
            out["prefix_cache"] = self.cache.stats()
        if self.spec is not None:
            out["speculative"] = self.spec.status()
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if not self.follower:
                self.loop.shutdown()
        finally:
            try:
                self.engine.close()
            finally:
                self.runtime.release()
