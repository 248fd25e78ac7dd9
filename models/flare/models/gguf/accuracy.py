"""`python -m flare.models.gguf.accuracy [TARGET] [--tokens 256] [--backends cpu]`: teacher-forced
accuracy of a GGUF model in Flare against the NumPy reference on the same weights.

The text is fixed English (bench.TEXT, repeated as needed), tokenized by the file's tokenizer;
Flare prefills it in chunks with every token's logits kept, the reference runs the same tokens
in float64 on weights dequantized by gguf.quants. Prints one JSON line: mean KL(reference ||
Flare) in nats, top-1 agreement, tokens, seconds. The issue's bounds: KL <= 0.01, top-1 >= 99%.
A measurement script, not a test (256 tokens of SmolLM2 take minutes on the NumPy path).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from flare.core.cli import report_error
from flare.core.errors import FlareError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flare.models.gguf.accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("target", nargs="?", default="smollm2")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--backends", default="cpu")
    p.add_argument("--prefill-chunk", type=int, default=64)
    args = p.parse_args(argv)
    from . import numpy_reference as ref
    from .bench import TEXT
    from .cli import devices
    from .model import GgufLM

    try:
        with GgufLM.load(args.target, devices=devices(args.backends), max_ctx=max(args.tokens, 2),
                         prefill_chunk=args.prefill_chunk) as lm:
            ids = lm.model.tokenizer().encode(" ".join([TEXT] * (args.tokens // 64 + 1)))[: args.tokens]
            t0 = time.perf_counter()
            got = lm.prefill(0, ids, all_logits=True)
            flare_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            want = ref.forward(lm.cfg, lm.model.tensor, ids)
            ref_s = time.perf_counter() - t0
        kl, top1 = ref.kl_top1(want, got)
    except FlareError as exc:
        return report_error(exc)
    print(json.dumps({"target": args.target, "backends": args.backends, "tokens": len(ids), "mean_kl_nats": kl,
                      "top1_agreement": top1, "flare_s": round(flare_s, 2), "reference_s": round(ref_s, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
