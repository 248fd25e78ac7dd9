"""What a serving run reports: per request and in total.

Time to first token counts from a request's arrival (queueing included);
tokens/s is generated tokens over the whole run; launches are program
executions a request took part in (a mixed step counts once for each
sequence it served, as does any batched step).
"""
from __future__ import annotations

import resource
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestStats:
    id: str
    prompt_tokens: int
    arrival: float
    admitted: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    launches: int = 0
    steps: dict[str, int] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(stats: list[RequestStats], makespan: float, steps: dict[str, int], rejected: dict[str, str],
              logits_sha256: str) -> dict[str, Any]:
    """The run's report (JSON-able)."""
    ttft = [s.ttft for s in stats if s.ttft is not None]
    generated = sum(len(s.tokens) for s in stats)
    launches = [s.launches for s in stats]
    return {
        "requests": len(stats), "rejected": rejected,
        "completed": sum(1 for s in stats if s.finished is not None),
        "generated_tokens": generated, "seconds": makespan,
        "tokens_per_s": generated / makespan if makespan > 0 else None,
        "ttft_s": {"mean": float(np.mean(ttft)) if ttft else None, "p50": _pct(ttft, 50), "p95": _pct(ttft, 95),
                   "max": max(ttft) if ttft else None},
        "steps": steps, "launches": sum(steps.values()),
        "launches_per_request": {"mean": float(np.mean(launches)) if launches else None,
                                 "max": max(launches) if launches else None},
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "logits_sha256": logits_sha256,
        "per_request": [{"id": s.id, "prompt_tokens": s.prompt_tokens, "arrival": s.arrival, "ttft_s": s.ttft,
                         "finished_s": s.finished, "launches": s.launches, "steps": s.steps, "tokens": s.tokens}
                        for s in stats],
    }
