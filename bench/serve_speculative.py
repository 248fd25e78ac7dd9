"""Speculative-decoding benchmark (not a test): acceptance rate and tokens/s with and without, via `flare serve`.

Two cores of moe-lm (default `tiny`, 512-token context) are exported once
into --workdir: the self-draft (`--draft-layers` default: the first half of
the layers plus the model's head) and the ideal case (`--draft-layers` = all
layers: the model drafting for itself, whose proposals the verifier always
accepts under greedy decoding — the upper bound of acceptance). For each core,
servers run without speculation and with `--speculative K --draft self`; then
prompt lookup (`--draft ngram`, no second model) on the self-draft core, once on
prompts whose answers can copy from them (`ngram`) and once on the ordinary
prompts (`ngram-nothing-to-copy`: its cost when it finds little). Each serves the
same greedy requests one at a time (speculation pays most at low batch) and
then `--concurrent` at once. Reported: generated tokens/s (client wall time),
acceptance (accepted / proposed draft tokens, read from /metrics) and whether
the token ids equal those of the non-speculative server.

    OPENBLAS_NUM_THREADS=1 python bench/serve_speculative.py [--size tiny] [--k 3] [--new-tokens 64]
                                                          [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

PROMPTS = ["Speculative decoding proposes tokens with a cheap draft", "The quick brown fox",
           "Mixture of experts route tokens", "Once upon a time"]
# prompt lookup has something to copy: the (greedy, random-weight) answer falls into repeats of the prompt
REPEAT = ["Repeat exactly: " + "the cat sat on the mat. " * 8, "Copy: " + "abc abd abe " * 10,
          "Again: " + "0123456789" * 8, "Echo: " + "la la la " * 12]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def measure(core: Path, options: list[str], new_tokens: int, concurrent: int, prompts: list[str] = PROMPTS) -> dict:
    import httpx

    from flare.plugins.serve.process import ServerProcess, complete

    with ServerProcess(core, *options) as s, httpx.Client(timeout=600) as c:
        complete(c, s.url, prompts[0], 4, temperature=0)                      # warm-up
        base = httpx.get(f"{s.url}/metrics").text
        t0 = time.perf_counter()
        single = [complete(c, s.url, p, new_tokens, temperature=0).token_ids for p in prompts]
        t_single = time.perf_counter() - t0
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrent) as pool:
            many = list(pool.map(lambda p: complete(httpx.Client(timeout=600), s.url, p, new_tokens,
                                                    temperature=0).token_ids, prompts[:concurrent]))
        t_many = time.perf_counter() - t0
        after = httpx.get(f"{s.url}/metrics").text
    proposed = _metric(after, "flare_speculative_proposed_tokens") - _metric(base, "flare_speculative_proposed_tokens")
    accepted = _metric(after, "flare_speculative_accepted_tokens") - _metric(base, "flare_speculative_accepted_tokens")
    return {"options": options, "tokens_per_s_single": sum(map(len, single)) / t_single,
            "tokens_per_s_concurrent": sum(map(len, many)) / t_many,
            "acceptance": accepted / proposed if proposed else None, "proposed": proposed, "accepted": accepted,
            "ids": single + many}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--workdir", default="/tmp/flare-bench-serve")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from flare.plugins.export import export_core, load_core

    out: dict = {"size": args.size, "k": args.k, "new_tokens": args.new_tokens}
    layers = None
    for case in ("self-draft", "ideal", "ngram", "ngram-nothing-to-copy"):
        path = Path(args.workdir) / f"{args.size}-ctx512-{'self-draft' if case.startswith('ngram') else case}.core"
        if not path.exists():
            if case == "ideal":
                layers = int(load_core(Path(args.workdir) / f"{args.size}-ctx512-self-draft.core")
                             .manifest.config["n_layers"])
            export_core("moe-lm", path, options={"size": args.size, "max_ctx": 512}, progress=False,
                        draft_layers=layers if case == "ideal" else None)
        prompts = REPEAT if case == "ngram" else PROMPTS
        draft = "ngram" if case.startswith("ngram") else "self"
        plain = measure(path, ["--no-speculative"], args.new_tokens, args.concurrent, prompts)
        spec = measure(path, ["--speculative", str(args.k), "--draft", draft], args.new_tokens, args.concurrent, prompts)
        out[case] = {
            "plain_tokens_per_s": {"single": plain["tokens_per_s_single"], "concurrent": plain["tokens_per_s_concurrent"]},
            "speculative_tokens_per_s": {"single": spec["tokens_per_s_single"],
                                         "concurrent": spec["tokens_per_s_concurrent"]},
            "acceptance": spec["acceptance"], "proposed": spec["proposed"], "accepted": spec["accepted"],
            "greedy_identical": plain["ids"] == spec["ids"],
        }
    out["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if all(out[c]["greedy_identical"] for c in ("self-draft", "ideal", "ngram", "ngram-nothing-to-copy")) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
