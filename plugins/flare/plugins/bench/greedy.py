"""The request every language-model workload times: a prompt prefilled, then greedy decoding.

A model here is anything with `prefill(seq, ids) -> logits` and
`decode(seqs, tokens, positions) -> logits per seq` (moe-lm, GGUF models). The
request's two phases are timed inside it and reported as extras beside the
request's tokens/s (which counts both): goals that speak of decode time (tokens
per second of generation, as llama-bench's `tg` reports it apart from `pp`) read
`decode ms/token`, not a rate diluted by the prompt's prefill.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np


def phase_times(t0: float, t1: float, t2: float, new_tokens: int) -> dict[str, float]:
    """Extras of one request from its clock readings: `prefill ms` (start to the first token's
    logits, t0..t1) and `decode ms/token` (each later token, t1..t2)."""
    out = {"prefill ms": (t1 - t0) * 1e3}
    if new_tokens > 1:
        out["decode ms/token"] = (t2 - t1) * 1e3 / (new_tokens - 1)
    return out


def greedy_request(model: Any, prompt: Sequence[int], new_tokens: int) -> tuple[np.ndarray, dict[str, float]]:
    """Prefill `prompt` as sequence 0 and decode greedily: the logits of every chosen token
    [new_tokens, vocab] (what configurations are compared on) and the phases' times."""
    prompt = list(prompt)
    t0 = time.perf_counter()
    logits = model.prefill(0, prompt)
    t1 = time.perf_counter()
    steps = [logits]
    for j in range(new_tokens - 1):
        logits = model.decode([0], [int(np.argmax(logits))], [len(prompt) + j])[0]
        steps.append(logits)
    return np.stack(steps), phase_times(t0, t1, time.perf_counter(), new_tokens)
