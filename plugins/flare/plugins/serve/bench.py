"""`flare bench` workload `serve-http`: concurrent HTTP clients against a real `flare serve` process.

A configuration is a server (core: moe-lm or SmolLM2, mixed prefill, prefix
cache, speculative K, draft) and what clients ask (`api` completions or chat,
`prompts`: a burst, a prompt whose answer repeats it, prompts with nothing to
copy, or prompts sharing no prefix); the server is started once per run
(outside the timings) on a free loopback port and stopped with SIGTERM at the
end. One benchmark request is a whole burst: `clients` concurrent greedy
requests (streaming or not); its time is the burst's wall time, its speed
generated tokens per second, and each burst also reports the clients' mean
time to first token, their decode speed (tokens after the first over the time
after it), the server process's CPU seconds (Linux /proc, in 10 ms ticks: steadier
than wall time on a shared machine) and its step loop thread's CPU milliseconds
(the server's /metrics, ns resolution: the work of serving itself), the prompt tokens served from the prefix cache and the
speculative acceptance (accepted / proposed draft tokens, from /metrics). The
output compared is every generated token id: greedy answers must be identical
across mixed prefill, prefix cache and speculative decoding on or off.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from flare.plugins.bench.config import BenchConfig
from flare.plugins.bench.errors import BenchConfigError
from flare.plugins.bench.workload import Metric, Option, Request, Timed, Workload

SHARED = "You are a helpful assistant serving many users over HTTP. Answer: "
PARAGRAPH = ("The lighthouse stood on a rock at the end of the harbour wall. Every evening the keeper climbed its "
             "ninety steps, wound the clockwork that turned the lens, and lit the lamp before the fishing boats came "
             "home. In winter the waves broke over the wall and the spray froze on the windows, but the light never "
             "failed, and the sailors said that they could see it from twenty miles out at sea.")
REPEAT = "Repeat the following paragraph exactly: " + PARAGRAPH
NO_COPY = ["Write a short poem about autumn leaves.", "Give three tips for learning to cook.",
           "Why do cats purr?", "Describe a busy market in the morning."]
PROMPT_SETS = ("burst", "repeat", "no-copy", "unique")

Item = tuple[str, int, "str | None"]        # (prompt or user message, max_tokens, system message)


def burst(clients: int, new_tokens: int) -> list[Item]:
    """One burst: different lengths, every third sharing a 66-byte prefix."""
    return [((SHARED if i % 3 == 0 else "") + f"request {i}: " + "abcdefgh" * (i % 5), new_tokens, None)
            for i in range(clients)]


def prompt_set(kind: str, clients: int, new_tokens: int, index: int) -> list[Item]:
    """The prompts of benchmark request `index`: `burst`; `repeat` (an answer that copies its prompt: prompt
    lookup's best case); `no-copy` (questions whose answers copy nothing: its cost); `unique` (each prompt
    and system message new, so the prefix cache never hits: its cost at a 0% hit rate)."""
    if kind == "repeat":
        return [(REPEAT, new_tokens, None)] * clients
    if kind == "no-copy":
        return [(NO_COPY[i % len(NO_COPY)], new_tokens, None) for i in range(clients)]
    if kind == "unique":    # the runner puts its call count first: a new prefix at every call
        return [(f"Question {index}.{i}: " + NO_COPY[i % len(NO_COPY)], new_tokens,
                 f"Session {index}.{i}. You are a helpful assistant.") for i in range(clients)]
    return burst(clients, new_tokens)


def default_core(size: str, model: str = "moe-lm") -> Path:
    """moe-lm SIZE with its self-draft, or SmolLM2 (default export options: 512-token context, 2 sequences,
    its self-draft), exported once into the cache (the adapter comes from its plugin)."""
    from flare.plugins.export import cached_core

    if model == "smollm2":
        return cached_core("smollm2", "smollm2.core")
    return cached_core("moe-lm", f"moe-lm-{size}-draft.core", {"size": size})


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (Linux /proc; None elsewhere): the server's own
    work per burst, which other processes' load on a shared machine changes far less than wall time."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _metric(text: str, name: str) -> float:
    import re

    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


class HttpRunner:
    def __init__(self, config: BenchConfig):
        from .process import ServerProcess

        o = config.options
        path = Path(o["core"]) if o["core"] else default_core(o["size"], o["model"])
        argv = ["--host", "127.0.0.1", "--max-queue", str(4 * o["clients"]), "--backends", config.backends[0],
                "--mixed-prefill" if o["mixed_prefill"] else "--no-mixed-prefill",
                "--prefix-cache" if o["prefix_cache"] else "--no-prefix-cache"]
        argv += ["--speculative", str(o["speculative"]), "--draft", o["draft"]] if o["speculative"] \
            else ["--no-speculative"]
        self.server = ServerProcess(path, *argv)
        self.stream = o["stream"]
        self.chat = o["api"] == "chat"
        self.unique = o["prompts"] == "unique"
        self.calls = 0      # `unique`: each call's system messages name it, so warm-up and repeats never hit
        self.description = (f"flare serve {path.name} ({' '.join(argv[4:])}), {o['clients']} concurrent "
                            f"{'streaming ' if self.stream else ''}clients")

    def run(self, request: Request) -> Timed:
        import httpx

        from .process import complete

        def one(item: Item) -> Any:
            prompt, n, system = item
            with httpx.Client(timeout=600) as c:
                return complete(c, self.server.url, prompt, n, stream=self.stream, chat=self.chat, system=system,
                                temperature=0)

        payload = list(request.payload)
        if self.unique:    # the same sequence of calls in every run of every configuration: comparable outputs
            payload = [(p, n, f"Call {self.calls}. {system}") for p, n, system in payload]
        self.calls += 1
        before = httpx.get(f"{self.server.url}/metrics").text
        cpu0 = process_cpu_seconds(self.server.proc.pid)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(payload)) as pool:
            answers = list(pool.map(one, payload))
        seconds = time.perf_counter() - t0
        cpu1 = process_cpu_seconds(self.server.proc.pid)
        after = httpx.get(f"{self.server.url}/metrics").text
        ids = [t for a in answers for t in a.token_ids]
        proposed, accepted = (_metric(after, k) - _metric(before, k) for k in
                              ("flare_speculative_proposed_tokens", "flare_speculative_accepted_tokens"))
        # decode speed: tokens after each client's first over the time after it (prefill and the first
        # token left out: what speculative decoding speeds up; a burst's wall time counts both)
        after_first = [(len(a.token_ids) - 1, a.seconds - a.ttft_s) for a in answers if len(a.token_ids) > 1]
        extras = {"time to first token, mean (ms)": 1000.0 * float(np.mean([a.ttft_s for a in answers])),
                  "decode tokens/s per client (after its first token)": (sum(n for n, _ in after_first)
                                                              / max(1e-9, sum(t for _, t in after_first))
                                                              if after_first else 0.0),
                  "prompt tokens from the prefix cache": float(sum(a.usage["prompt_tokens_details"]["cached_tokens"]
                                                                   for a in answers)),
                  "draft tokens proposed": proposed,
                  "acceptance (accepted / proposed)": accepted / proposed if proposed else 0.0}
        if cpu0 is not None and cpu1 is not None:
            extras["server CPU seconds per burst"] = cpu1 - cpu0
        if "flare_step_loop_cpu_seconds " in before and "flare_step_loop_cpu_seconds " in after:
            extras["step-loop CPU ms per burst"] = 1000.0 * (_metric(after, "flare_step_loop_cpu_seconds")
                                                            - _metric(before, "flare_step_loop_cpu_seconds"))
        return Timed(np.asarray(ids, np.float32), seconds, extras)

    def memory_plan(self) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        from .process import ledger_after_stop

        err = self.server.stop()
        after = ledger_after_stop(err)
        if self.server.proc.returncode != 0 or after is None or after[0] != after[1]:
            raise BenchConfigError(f"flare serve did not stop cleanly (exit {self.server.proc.returncode}): "
                                   f"{err[-500:]}", key="core")


class ServeHttpWorkload(Workload):
    model = "serve-http"
    metric = Metric("tokens/s", "tokens", per_work=False)
    tolerance = 0.0
    default_requests = 3
    entries_separable = False
    options = {
        "model": Option(str, "moe-lm", "model of the default core: moe-lm (SIZE) or smollm2",
                        choices=("moe-lm", "smollm2"), shapes_requests=True),
        "size": Option(str, "tiny", "moe-lm size of the default core (tiny, mid, small)",
                       choices=("tiny", "mid", "small"), shapes_requests=True),
        "core": Option(str, "", "path of an exported core (default: MODEL's with its self-draft, exported "
                       "once into the cache)", shapes_requests=True),
        "api": Option(str, "completions", "what clients ask: completions (text prompts) or chat (messages, the "
                      "model's chat template)", choices=("completions", "chat"), shapes_requests=True),
        "prompts": Option(str, "burst", "burst (mixed lengths, a third sharing a prefix), repeat (answers copy "
                          "the prompt), no-copy, unique (no prefix shared: a 0% cache hit rate)",
                          choices=PROMPT_SETS, shapes_requests=True),
        "mixed_prefill": Option(bool, True, "serve with the core's mixed programs"),
        "prefix_cache": Option(bool, True, "reuse KV blocks of prompts already seen"),
        "speculative": Option(int, 0, "speculative decoding with K proposals (0: off)", minimum=0),
        "draft": Option(str, "ngram", "who proposes: ngram (prompt lookup) or self (the core's draft programs)",
                        choices=("ngram", "self")),
        "stream": Option(bool, True, "clients stream (server-sent events)"),
        "clients": Option(int, 16, "concurrent clients in one burst", minimum=1, shapes_requests=True),
        "new_tokens": Option(int, 16, "tokens generated per client", minimum=1, shapes_requests=True),
    }

    def validate(self, config: BenchConfig) -> None:
        if config.peer != "flare":
            raise BenchConfigError("only Flare serves cores", path=config.path, key="peer")
        if len(config.backends) != 1:
            raise BenchConfigError("a served core runs on one backend", path=config.path, key="backends")

    def requests(self, config: BenchConfig, count: int) -> list[Request]:
        o = config.options
        return [Request(i, tuple(prompt_set(o["prompts"], o["clients"], o["new_tokens"], i)),
                        float(o["clients"] * o["new_tokens"]), f"{o['clients']} concurrent clients, {o['prompts']}")
                for i in range(count)]

    def open_flare(self, config: BenchConfig) -> HttpRunner:
        return HttpRunner(config)
