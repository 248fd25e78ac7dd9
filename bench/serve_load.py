"""Bounded load script (not a test): 64 concurrent streaming clients against `flare serve` for 60 s, loopback only.

Starts `flare serve` on 127.0.0.1 (a free port) over moe-lm `tiny` (exported
once into --workdir), runs --clients asyncio clients that each send streaming
completions back to back (mixed lengths, a third of them sharing a prefix,
half greedy, half sampled with a seed) until --seconds have passed, then
sends SIGTERM. `--chat`: the clients speak /v1/chat/completions instead (a shared
system message, the model's chat template). After the load, up to --replay of the
answers are asked again one at a time and must be token for token the same (greedy
and seeded alike: a request's tokens depend on nothing but itself). Pass: no HTTP error, no in-stream error, no request without
`data: [DONE]`, every streamed token count equal to usage.completion_tokens,
the server exits 0 and its ledger's live bytes after shutdown equal those at
start. Reports requests, tokens/s, time to first token (p50/p95) and the
server's /metrics prefix-cache and step counts at the end.

    OPENBLAS_NUM_THREADS=1 python bench/serve_load.py [--clients 64] [--seconds 60] [--chat] [--replay 64]
                                                      [--model smollm2 [--max-seqs 2]] [-- extra flare serve options]
    OPENBLAS_NUM_THREADS=1 python bench/serve_load.py --model smollm2 --chat --clients 32 --seconds 60  # the issue's figure
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


def request_body(n: int, i: int, chat: bool) -> tuple[str, dict]:
    """Client n's i-th request: (route, body)."""
    text = f"client {n} request {i} " + "x" * ((n * 7 + i) % 40)
    common = {"max_tokens": 4 + (n + i) % 24, "stream": True, "stop": None,
              "temperature": 0 if (n + i) % 2 else 0.8, "seed": n * 1000 + i}
    if chat:
        return "chat/completions", {"messages": [{"role": "system", "content": SHARED}, {"role": "user", "content": text}],
                                    **common}
    return "completions", {"prompt": (SHARED if (n + i) % 3 == 0 else "") + text, **common}


async def client(n: int, url: str, until: float, stats: dict, chat: bool = False) -> None:
    import httpx

    i = 0
    async with httpx.AsyncClient(timeout=300) as c:
        while time.monotonic() < until:
            i += 1
            route, body = request_body(n, i, chat)
            t0 = time.perf_counter()
            ids: list[int] = []
            first, tokens, done, usage = None, 0, False, None
            try:
                async with c.stream("POST", f"{url}/v1/{route}", json=body) as r:
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
                        ids += ev["choices"][0]["token_ids"]
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
            stats["answers"].append((route, body, ids))


def replay(url: str, answers: list, limit: int) -> dict:
    """Ask `limit` of the answered requests again, one at a time: the same tokens?"""
    import httpx

    same, differ = 0, []
    with httpx.Client(timeout=300) as c:
        for route, body, ids in answers[:: max(1, len(answers) // max(1, limit))][:limit]:
            data = c.post(f"{url}/v1/{route}", json={**body, "stream": False}).json()
            again = data["choices"][0]["token_ids"]
            if again == ids:
                same += 1
            else:
                differ.append({"body": body, "under_load": ids, "alone": again})
    return {"identical": same, "asked": same + len(differ), "first_differences": differ[:3]}


async def drive(url: str, clients: int, seconds: float, chat: bool = False) -> dict:
    stats: dict = {"requests": 0, "tokens": 0, "errors": [], "ttft": [], "answers": []}
    until = time.monotonic() + seconds
    t0 = time.perf_counter()
    await asyncio.gather(*(client(n, url, until, stats, chat) for n in range(clients)))
    stats["seconds"] = time.perf_counter() - t0
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--workdir", default="/tmp/flare-bench-serve")
    ap.add_argument("--json", default=None)
    ap.add_argument("--chat", action="store_true", help="clients use /v1/chat/completions")
    ap.add_argument("--replay", type=int, default=64, help="answers asked again alone and compared (0: none)")
    ap.add_argument("--model", choices=("moe-lm", "smollm2"), default="moe-lm",
                    help="smollm2: SmolLM2 exported once (512-token context, --max-seqs sequences); use with --chat")
    ap.add_argument("--max-seqs", type=int, default=2, help="smollm2: sequences the exported core runs at once")
    ap.add_argument("--activations", choices=("integer", "float"), default=None,
                    help="smollm2: FLARE_CPU_QUANT_ACTIVATIONS of the server (default: the CPU's default, "
                         "integer; answers under load equal their sequential runs either way, since the CPU "
                         "backend is batch-invariant; float is the dequantized-weights reference, ~6x slower "
                         "at decode)")
    ap.add_argument("serve_options", nargs="*", help="extra `flare serve` options (after --)")
    args = ap.parse_args()
    import httpx
    import numpy as np

    from flare.plugins.export import export_core
    from flare.plugins.serve.process import ServerProcess, ledger_after_stop

    if args.model == "smollm2":
        core = Path(args.workdir) / f"smollm2-ctx512-seqs{args.max_seqs}.core"
        if not core.exists():
            export_core("smollm2", core, options={"max_ctx": 512, "max_seqs": args.max_seqs}, progress=False)
    else:
        core = Path(args.workdir) / "tiny-ctx512-self-draft.core"
        if not core.exists():
            export_core("moe-lm", core, options={"size": "tiny", "max_ctx": 512}, progress=False)
    env = None
    if args.model == "smollm2" and args.activations:
        env = {"FLARE_CPU_QUANT_ACTIVATIONS": args.activations}
    server = ServerProcess(core, "--host", "127.0.0.1", "--max-queue", str(4 * args.clients), *args.serve_options,
                           env=env)
    try:
        stats = asyncio.run(drive(server.url, args.clients, args.seconds, args.chat))
        metrics = httpx.get(f"{server.url}/metrics").text
        sequential = replay(server.url, stats["answers"], args.replay) if args.replay else None
    finally:
        err = server.stop()
    ledger = ledger_after_stop(err)
    ttft = np.array(stats["ttft"], dtype=float)
    pick = {k: float(m.group(1)) for k in ("flare_prefix_cache_reused_tokens", "flare_prefix_cache_evictions",
                                             "flare_requests_total{outcome=\"cancelled\"}")
            if (m := re.search(rf"^{re.escape(k)} ([0-9.e+-]+)$", metrics, re.M))}
    out = {"model": args.model, "activations": args.activations, "clients": args.clients, "chat": args.chat, "identical_to_sequential": sequential,
           "seconds": stats["seconds"], "requests": stats["requests"],
           "tokens": stats["tokens"], "tokens_per_s": stats["tokens"] / stats["seconds"],
           "ttft_ms": {"p50": float(np.percentile(ttft, 50) * 1000) if ttft.size else None,
                       "p95": float(np.percentile(ttft, 95) * 1000) if ttft.size else None},
           "errors": len(stats["errors"]), "first_errors": stats["errors"][:5], "server_exit": server.proc.returncode,
           "ledger_live_after_stop_vs_start": ledger, "metrics": pick, "serve_options": args.serve_options,
           "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    ok = not stats["errors"] and server.proc.returncode == 0 and ledger is not None and ledger[0] == ledger[1] \
        and (sequential is None or sequential["identical"] == sequential["asked"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
