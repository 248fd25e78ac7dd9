"""Prefix-cache benchmark (not a test): two requests sharing a 200-token prefix, against `flare serve`.

Exports moe-lm `tiny` with a 512-token context (once, into --workdir), starts
`flare serve` with the prefix cache on, sends request 1 (prefix + suffix 1),
then request 2 (prefix + suffix 2), both streaming, and reports for each the
time to first token measured by the client and `usage.prompt_tokens_details.
cached_tokens`. Then the same two requests against a server started with
`--no-prefix-cache`: the token ids must be identical. Repeated --rounds times
(fresh prefixes each round, so round r's first request is cold), medians
reported.

    OPENBLAS_NUM_THREADS=1 python bench/serve_prefix.py [--rounds 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefix-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--workdir", default="/tmp/flare-bench-serve")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import httpx

    from flare.plugins.export import export_core
    from flare.plugins.serve.process import ServerProcess, complete, ledger_after_stop

    core = Path(args.workdir) / "tiny-ctx512.core"
    if not core.exists():
        export_core("moe-lm", core, options={"size": "tiny", "max_ctx": 512}, progress=False)
    # prompt ids: <bos> + (prefix_tokens - 1) bytes shared, then a distinct suffix
    def prompt(r: int, which: int) -> list[int]:
        shared = [256] + [(37 * r + 11 * i) % 256 for i in range(args.prefix_tokens - 1)]
        return shared + [(100 + 7 * which + i) % 256 for i in range(12)]

    rows = []
    with ServerProcess(core, "--prefix-cache") as warm, httpx.Client(timeout=300) as c:
        complete(c, warm.url, [256, 1, 2, 3], 2, temperature=0)          # first-use costs out of the way
        for r in range(args.rounds):
            a = complete(c, warm.url, prompt(r, 1), args.new_tokens, temperature=0)
            b = complete(c, warm.url, prompt(r, 2), args.new_tokens, temperature=0)
            rows.append({"round": r, "ttft_first_ms": 1000 * a.ttft_s, "ttft_second_ms": 1000 * b.ttft_s,
                         "cached_first": a.usage["prompt_tokens_details"]["cached_tokens"],
                         "cached_second": b.usage["prompt_tokens_details"]["cached_tokens"],
                         "ids": [a.token_ids, b.token_ids]})
        err = warm.stop()
    with ServerProcess(core, "--no-prefix-cache") as cold, httpx.Client(timeout=300) as c:
        complete(c, cold.url, [256, 1, 2, 3], 2, temperature=0)
        for row in rows:
            r = row["round"]
            ids = [complete(c, cold.url, prompt(r, w), args.new_tokens, temperature=0).token_ids for w in (1, 2)]
            row["identical_without_cache"] = ids == row.pop("ids")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    summary = {
        "prompt_tokens": len(prompt(0, 1)), "rounds": args.rounds,
        "ttft_first_ms_median": statistics.median(r["ttft_first_ms"] for r in rows),
        "ttft_second_ms_median": statistics.median(r["ttft_second_ms"] for r in rows),
        "cached_second_min": min(r["cached_second"] for r in rows),
        "cached_first_max": max(r["cached_first"] for r in rows),
        "identical_without_cache": all(r["identical_without_cache"] for r in rows),
        "ledger_after_stop": ledger_after_stop(err), "uptime": load, "rounds_detail": rows,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds_detail"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    ok = summary["cached_second_min"] >= 192 and summary["identical_without_cache"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
