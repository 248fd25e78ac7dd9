"""Bounded load script (not a test): 64 concurrent streaming clients against `flare serve` for 60 s, loopback only.

Starts `flare serve` on 127.0.0.1 (a free port) over moe-lm `tiny` (exported
once into --workdir), runs --clients asyncio clients that each send streaming
completions back to back (mixed lengths, a third of them sharing a prefix,
half greedy, half sampled with a seed) until --seconds have passed, then
sends SIGTERM. Pass: no HTTP error, no in-stream error, no request without
`data: [DONE]`, every streamed token count equal to usage.completion_tokens,
the server exits 0 and its ledger's live bytes after shutdown equal those at
start. Reports requests, tokens/s, time to first token (p50/p95) and the
server's /metrics prefix-cache and step counts at the end.

    OPENBLAS_NUM_THREADS=1 python bench/serve_load.py [--clients 64] [--seconds 60] [-- extra flare serve options]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

SHARED = "System: you are a terse assistant; answer in one short line. User: "


async def client(n: int, url: str, until: float, stats: dict) -> None:
    import httpx

    i = 0
    async with httpx.AsyncClient(timeout=300) as c:
        while time.monotonic() < until:
            i += 1
            prompt = (SHARED if (n + i) % 3 == 0 else "") + f"client {n} request {i} " + "x" * ((n * 7 + i) % 40)
            body = {"prompt": prompt, "max_tokens": 4 + (n + i) % 24, "stream": True, "stop": None,
                    "temperature": 0 if (n + i) % 2 else 0.8, "seed": n * 1000 + i}
            t0 = time.perf_counter()
            first, tokens, done, usage = None, 0, False, None
            try:
                async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        stats["errors"].append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            stats["errors"].append(f"in-stream: {ev['error']}")
                            break
                        k = len(ev["choices"][0]["token_ids"])
                        if k and first is None:
                            first = time.perf_counter() - t0
                        tokens += k
                        usage = ev.get("usage") or usage
            except Exception as exc:  # noqa: BLE001 - every failure is counted, none stops the run
                stats["errors"].append(f"{type(exc).__name__}: {exc}")
                continue
            if not done or usage is None or usage["completion_tokens"] != tokens:
                stats["errors"].append(f"incomplete stream (done={done}, tokens={tokens}, usage={usage})")
                continue
            stats["requests"] += 1
            stats["tokens"] += tokens
            stats["ttft"].append(first)


async def drive(url: str, clients: int, seconds: float) -> dict:
    stats: dict = {"requests": 0, "tokens": 0, "errors": [], "ttft": []}
    until = time.monotonic() + seconds
    t0 = time.perf_counter()
    await asyncio.gather(*(client(n, url, until, stats) for n in range(clients)))
    stats["seconds"] = time.perf_counter() - t0
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--workdir", default="/tmp/flare-bench-serve")
    ap.add_argument("--json", default=None)
    ap.add_argument("serve_options", nargs="*", help="extra `flare serve` options (after --)")
    args = ap.parse_args()
    import httpx
    import numpy as np

    from flare.plugins.export import export_core
    from flare.plugins.serve.process import ServerProcess, ledger_after_stop

    core = Path(args.workdir) / "tiny-ctx512-self-draft.core"
    if not core.exists():
        export_core("moe-lm", core, options={"size": "tiny", "max_ctx": 512}, progress=False)
    server = ServerProcess(core, "--host", "127.0.0.1", "--max-queue", str(4 * args.clients), *args.serve_options)
    try:
        stats = asyncio.run(drive(server.url, args.clients, args.seconds))
        metrics = httpx.get(f"{server.url}/metrics").text
    finally:
        err = server.stop()
    ledger = ledger_after_stop(err)
    ttft = np.array(stats["ttft"], dtype=float)
    pick = {k: float(m.group(1)) for k in ("flare_prefix_cache_reused_tokens", "flare_prefix_cache_evictions",
                                             "flare_requests_total{outcome=\"cancelled\"}")
            if (m := re.search(rf"^{re.escape(k)} ([0-9.e+-]+)$", metrics, re.M))}
    out = {"clients": args.clients, "seconds": stats["seconds"], "requests": stats["requests"],
           "tokens": stats["tokens"], "tokens_per_s": stats["tokens"] / stats["seconds"],
           "ttft_ms": {"p50": float(np.percentile(ttft, 50) * 1000) if ttft.size else None,
                       "p95": float(np.percentile(ttft, 95) * 1000) if ttft.size else None},
           "errors": len(stats["errors"]), "first_errors": stats["errors"][:5], "server_exit": server.proc.returncode,
           "ledger_live_after_stop_vs_start": ledger, "metrics": pick, "serve_options": args.serve_options,
           "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    ok = not stats["errors"] and server.proc.returncode == 0 and ledger is not None and ledger[0] == ledger[1]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
