"""What the prefix cache costs when it never hits, over HTTP (not a test): two servers at once, the same prompts.

`flare bench serve_smollm2_unique_cache_{off,on}.toml` runs one server per run
in A B B A order, so each configuration meets whatever load the shared machine
had during its own seconds: its pairs ranged 0.64-1.70x on a loaded machine and
0.82-1.00x on a quiet one, far beyond the 2% it is meant to show. Here both
`flare serve smollm2` processes (`--no-prefix-cache`, `--prefix-cache`, the
serve-http workload's other options: mixed prefill, no speculation) run side by
side for the whole measurement, one streaming greedy chat client sends each
unique prompt (`serve.bench.prompt_set("unique")`: a 0% hit rate) to both,
alternating which goes first, and per request takes each server's CPU time by
thread from /proc/PID/task/*/schedstat (ns; the step loop, the C kernels' pool
worker and the event loop apart), its wall time and its time to first token.
It checks that both servers give the same tokens for every prompt and that each
stopped with its ledger back to zero.

    OPENBLAS_NUM_THREADS=1 python bench/serve_cache_cost_http.py [--requests 30] [--json out.json]
    # the noise floor: two servers with the cache off
    python bench/serve_cache_cost_http.py --b-options=--no-prefix-cache
"""
from __future__ import annotations

import argparse
import glob
import os
from typing import Any

from summary_json import emit  # bench/, the script's own folder

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def thread_cpu_ns(pid: int) -> dict[str, int]:
    """CPU ns so far of each live thread of `pid`, by "name:tid" (Linux /proc)."""
    out = {}
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            with open(f"{task}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue                     # a thread that ended between the listing and the read
        out[f"{name}:{task.rsplit('/', 1)[1]}"] = ns
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30, help="prompts, each served by both servers")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--a-options", default="--no-prefix-cache", help="server A's cache options")
    ap.add_argument("--b-options", default="--prefix-cache", help="server B's cache options")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import httpx

    from flare.plugins.serve.bench import default_core, prompt_set
    from flare.plugins.serve.process import ServerProcess, complete, ledger_after_stop

    core = default_core("tiny", "smollm2")
    common = ["--host", "127.0.0.1", "--max-queue", "4", "--backends", "cpu", "--mixed-prefill", "--no-speculative"]
    servers = {"A": ServerProcess(core, *common, *args.a_options.split())}
    try:
        servers["B"] = ServerProcess(core, *common, *args.b_options.split())
    except BaseException:
        servers["A"].stop()
        raise
    rows: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    stderr: dict[str, str] = {}
    try:
        with httpx.Client(timeout=600) as client:
            def serve(key: str, index: int) -> dict[str, Any]:
                (prompt, n, system), = prompt_set("unique", 1, args.new_tokens, index)
                s = servers[key]
                t0 = thread_cpu_ns(s.proc.pid)
                a = complete(client, s.url, prompt, n, stream=True, chat=True, system=f"Call {index}. {system}",
                             temperature=0)
                t1 = thread_cpu_ns(s.proc.pid)
                ms = {k: (t1[k] - t0.get(k, 0)) / 1e6 for k in t1}
                return {"tokens": a.token_ids, "wall_ms": 1000 * a.seconds, "ttft_ms": 1000 * a.ttft_s, "cpu_ms": ms}

            for i in range(-3, 0):                  # first uses of programs and window shapes, untimed
                for key in ("A", "B"):
                    serve(key, i)
            for i in range(args.requests):
                for key in (("A", "B") if i % 2 == 0 else ("B", "A")):
                    rows[key].append(serve(key, i))
    finally:
        for key, s in servers.items():
            stderr[key] = s.stop()

    def total(key: str, f: Any) -> float:
        return sum(f(r) for r in rows[key])

    def by_role(key: str) -> dict[str, float]:
        """Mean ms per request of each thread, named by role: its name and its rank by CPU."""
        names: dict[str, float] = {}
        for r in rows[key]:
            for k, v in r["cpu_ms"].items():
                names[k] = names.get(k, 0.0) + v
        ranked = sorted(names, key=lambda k: -names[k])
        return {f"{k.split(':')[0]} #{i}": names[k] / len(rows[key]) for i, k in enumerate(ranked)
                if names[k] / len(rows[key]) >= 0.5}

    same = all(a["tokens"] == b["tokens"] for a, b in zip(rows["A"], rows["B"]))
    ledgers = {key: ledger_after_stop(err) for key, err in stderr.items()}
    clean = all(v is not None and v[0] == v[1] for v in ledgers.values())
    cpu = {key: total(key, lambda r: sum(r["cpu_ms"].values())) for key in rows}
    summary = {
        "requests": args.requests, "A": args.a_options, "B": args.b_options,
        "server CPU ms per request": {key: cpu[key] / args.requests for key in rows},
        "server CPU B / A": cpu["B"] / cpu["A"],
        "wall B / A": total("B", lambda r: r["wall_ms"]) / total("A", lambda r: r["wall_ms"]),
        "time to first token B / A": total("B", lambda r: r["ttft_ms"]) / total("A", lambda r: r["ttft_ms"]),
        "CPU ms per request by thread": {key: by_role(key) for key in rows},
        "same greedy tokens": same, "ledger live bytes after stop (live, at start)": ledgers,
    }
    emit(summary, rows, args.json)
    return 0 if same and clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
