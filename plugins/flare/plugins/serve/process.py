"""`flare serve` as a child process, and a small streaming client: for tests, benchmarks and `flare bench`.

`ServerProcess(core, *options)` starts `flare serve core --port 0 ...` with the
current interpreter, waits for the line that says where it listens, and
`stop()` sends SIGTERM and returns what it printed, from which
`ledger_after_stop` reads the ledger's live bytes at start and after release.
`complete()` sends one completion (streaming or not) and measures the time to
first token on the client side.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

MAIN = "import sys; from flare.core.cli import main; sys.exit(main(sys.argv[1:]))"
READY = re.compile(r"on (http://[^ ]+:\d+)/v1 ")
STOPPED = re.compile(r"ledger live bytes (\d+) \(at start (\d+)\)")


class ServerProcess:
    def __init__(self, core: str | os.PathLike, *options: str, timeout: float = 120,
                 env: dict[str, str] | None = None):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1"),
               "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **(env or {})}
        argv = [sys.executable, "-c", MAIN, "serve", str(core), *options]
        if "--port" not in options:
            argv += ["--port", "0"]
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline() if self.proc.stderr else ""
            if not line:
                break
            self.lines.append(line)
            m = READY.search(line)
            if m:
                self.url = m.group(1)
                return
        self.proc.kill()
        self.proc.wait()
        raise RuntimeError(f"flare serve did not start: {''.join(self.lines)}")

    def stop(self, timeout: float = 60) -> str:
        """SIGTERM (a graceful shutdown), wait, return everything it wrote to stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return "".join(self.lines) + (err or "")

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def ledger_after_stop(stderr: str) -> tuple[int, int] | None:
    """(live bytes after shutdown, live bytes at start) from a stopped server's stderr."""
    m = STOPPED.search(stderr)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass
class Answer:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: dict[str, Any]
    ttft_s: float
    seconds: float


def complete(client: Any, url: str, prompt: str | Sequence[int], max_tokens: int, *, stream: bool = True,
             chat: bool = False, system: str | None = None, **fields: Any) -> Answer:
    """One /v1/completions request with an `httpx.Client` (`chat`: /v1/chat/completions of the user message
    `prompt` after an optional `system` message); raises on any HTTP or in-stream error."""
    if chat:
        route = "chat/completions"
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        body = {"messages": messages, "max_tokens": max_tokens, "stream": stream, **fields}
    else:
        route = "completions"
        body = {"prompt": prompt if isinstance(prompt, str) else list(prompt), "max_tokens": max_tokens,
                "stream": stream, **fields}
    t0 = time.perf_counter()
    if not stream:
        r = client.post(f"{url}/v1/{route}", json=body)
        r.raise_for_status()
        t = time.perf_counter() - t0
        data = r.json()
        ch = data["choices"][0]
        return Answer(ch["token_ids"], ch["message"]["content"] if chat else ch["text"], ch["finish_reason"],
                      data["usage"], t, t)
    ids: list[int] = []
    text: list[str] = []
    first = None
    finish, usage = None, {}
    with client.stream("POST", f"{url}/v1/{route}", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"in-stream error: {ev['error']}")
            ch = ev["choices"][0]
            if ch["token_ids"] and first is None:
                first = time.perf_counter() - t0
            ids += ch["token_ids"]
            text.append(ch["delta"].get("content") or "" if chat else ch["text"])
            finish = ch["finish_reason"] or finish
            usage = ev.get("usage") or usage
    return Answer(ids, "".join(text), finish, usage, first if first is not None else float("nan"),
                  time.perf_counter() - t0)
