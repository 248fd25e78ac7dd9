"""`flare run minilm-l6 "sentence" ... [--backends ...] [--json]`.

Embeds the sentences (default: the sentence-transformers quickstart three),
prints a summary of each embedding and the cosine similarity matrix.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from flare.core.options import add_backends_option

QUICKSTART = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]


def parser() -> argparse.ArgumentParser:
    from flare.core.cli import add_threads_argument

    p = argparse.ArgumentParser(prog="flare run minilm-l6",
                                description="Sentence embeddings with all-MiniLM-L6-v2 (384-d, unit norm).")
    p.add_argument("sentences", nargs="*", help="sentences to embed (default: three example sentences)")
    add_backends_option(p, dest="backend")
    p.add_argument("--json", action="store_true", help="print JSON (embeddings and similarity) instead of tables")
    add_threads_argument(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry of `flare run minilm-l6`; returns the process exit code."""
    from rich.console import Console

    try:
        args = parser().parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:
        return int(exc.code or 0)
    out = Console()

    from flare.core.cli import device_config, report_error
    from flare.core.errors import FlareError
    from flare.core.session import Session, device_list

    from .runner import MiniLM
    from .tokenize import encode

    sentences = args.sentences or QUICKSTART
    try:
        devices = device_list(args.backend, "--backends")
        with Session(devices, config=device_config(args.threads)) as session, MiniLM(session) as model:
            start = time.perf_counter()
            emb = model.embed(sentences)
            elapsed = time.perf_counter() - start
    except FlareError as exc:
        return report_error(exc)
    sim = emb @ emb.T
    tokens = [len(t) for t in encode(sentences)]

    if args.json:
        print(json.dumps({"model": "minilm-l6", "backend": devices, "dim": int(emb.shape[1]),
                          "elapsed_s": round(elapsed, 4), "sentences": sentences, "tokens": tokens,
                          "embeddings": [[round(float(v), 7) for v in row] for row in emb],
                          "similarity": [[round(float(v), 6) for v in row] for row in sim]}, indent=2))
        return 0

    from rich.table import Table

    t = Table(title=f"{len(sentences)} embedding(s), {emb.shape[1]} dims, unit L2 norm", title_justify="left")
    for col, just in (("#", "right"), ("sentence", "left"), ("tokens", "right"), ("norm", "right"),
                      ("first values", "left")):
        t.add_column(col, justify=just)
    for i, (s, n, e) in enumerate(zip(sentences, tokens, emb), 1):
        t.add_row(str(i), s, str(n), f"{float((e.astype('float64') ** 2).sum() ** 0.5):.4f}",
                  " ".join(f"{v:+.4f}" for v in e[:4]) + " ...")
    out.print(t)
    m = Table(title="Cosine similarity", title_justify="left")
    m.add_column("")
    for i in range(len(sentences)):
        m.add_column(str(i + 1), justify="right")
    for i, row in enumerate(sim, 1):
        m.add_row(str(i), *(f"{v:.4f}" for v in row))
    out.print(m)
    out.print(f"embedded on {','.join(devices)} in {elapsed * 1000:.0f} ms", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
