"""llama.cpp as the GGUF models' peer: a `flare bench` runner, its logits, and its tokenizer.

llama.cpp comes from the `llama-cpp-python` source distribution (its vendored llama.cpp),
built once for this CPU by `scripts/install-bench-peers.sh` (too slow for CI). Everything
here imports it lazily, so the plugin loads without it.

- `LLAMACPP` (a `flare bench` peer, `peer = "llama.cpp"`): the same request as Flare's
  `gguf` workload — prefill the prompt in batches of `prefill_chunk`, then greedy decode
  `new_tokens` — returning the logits of every chosen token, so outputs are compared.
- `python -m flare.models.gguf.llamacpp logits [--tokens 256]`: top-1 agreement and KL of
  Flare's teacher-forced logits against llama.cpp's on the same positions.
- `python -m flare.models.gguf.llamacpp tokens`: writes tests/data/smollm2_llamacpp_tokens.json,
  llama.cpp's token ids for a fixed set of texts (the fixture tests/test_gguf_smollm2.py reads).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from flare.plugins.bench.greedy import phase_times
from flare.plugins.bench.peer_runner import PeerRunner
from flare.plugins.bench.workload import Peer

from .weights import resolve

TEXTS = [
    "Hello, world!", "What is the capital of France?", " leading space", "trailing space ",
    "Numbers 1234567890 and 3.14159", "tabs\tand\nnewlines\n\n", "Ünïcödé: naïve café — déjà vu",
    "Привет, мир", "日本語のテキスト", "emoji 🚀🔥👍🏽", "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2  # square", "   multiple   spaces   ", "don't won't can't I'm you're",
]


def _llama(path: Path, threads: int, n_ctx: int, n_batch: int, logits_all: bool = False) -> Any:
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                           n_threads_batch=threads, logits_all=logits_all, verbose=False)


def _last_logits(llm: Any) -> np.ndarray:
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).astype(np.float32)


class LlamaCppRunner(PeerRunner):
    def __init__(self, target: str, threads: int, max_ctx: int, prefill_chunk: int, new_tokens: int):
        import llama_cpp

        self.llm = _llama(resolve(target), threads, max_ctx, prefill_chunk)
        self.new_tokens = int(new_tokens)
        self.description = (f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, built by "
                            f"scripts/install-bench-peers.sh), {threads} thread(s), batch {prefill_chunk}")

    def compute(self, payload: Any) -> tuple[np.ndarray, dict[str, float]]:
        llm = self.llm
        t0 = time.perf_counter()
        llm.reset()
        llm.eval(list(payload))
        steps = [_last_logits(llm)]
        t1 = time.perf_counter()
        for _ in range(self.new_tokens - 1):
            llm.eval([int(np.argmax(steps[-1]))])
            steps.append(_last_logits(llm))
        return np.stack(steps), phase_times(t0, t1, time.perf_counter(), self.new_tokens)

    def close(self) -> None:
        llm = self.__dict__.get("llm")
        if llm is not None:
            llm.close()
        super().close()


def _open(config: Any) -> LlamaCppRunner:
    o = config.options
    threads = config.threads if config.threads is not None else 1
    return LlamaCppRunner(o["target"], threads, o["max_ctx"], o["prefill_chunk"], o["new_tokens"])


LLAMACPP = Peer("llama.cpp", "llama.cpp through llama-cpp-python, built from its sdist for this CPU "
                "(scripts/install-bench-peers.sh)", module="llama_cpp", model="gguf", open=_open,
                takes_threads=True)


def _logits(args: argparse.Namespace) -> int:
    from . import numpy_reference as ref
    from .bench import TEXT
    from .cli import devices
    from .model import GgufLM

    with GgufLM.load(args.target, devices=devices(args.backends), max_ctx=max(args.tokens, 2),
                     prefill_chunk=args.prefill_chunk) as lm:
        ids = lm.model.tokenizer().encode(" ".join([TEXT] * (args.tokens // 64 + 1)))[: args.tokens]
        got = lm.prefill(0, ids, all_logits=True)
    llm = _llama(resolve(args.target), 1, max(args.tokens, 2) + 8, args.prefill_chunk, logits_all=True)
    llm.eval(ids)
    want = np.array(llm.scores[: len(ids)], np.float32)
    llm.close()
    kl, top1 = ref.kl_top1(want, got)
    print(json.dumps({"target": args.target, "backends": args.backends, "tokens": len(ids),
                      "mean_kl_vs_llamacpp_nats": kl, "top1_agreement_vs_llamacpp": top1}))
    return 0


def _tokens(args: argparse.Namespace) -> int:
    llm = _llama(resolve(args.target), 1, 512, 64)
    cases = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=True)} for t in TEXTS]
    llm.close()
    import llama_cpp
    out = {"source": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}: Llama.tokenize(text, add_bos=False, "
                     "special=True: special tokens parsed, as for a rendered chat prompt)", "target": args.target, "texts": cases}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {len(cases)} texts to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flare.models.gguf.llamacpp", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    lg = sub.add_parser("logits", help="Flare's teacher-forced logits against llama.cpp's")
    lg.add_argument("target", nargs="?", default="smollm2")
    lg.add_argument("--tokens", type=int, default=256)
    lg.add_argument("--backends", default="cpu")
    lg.add_argument("--prefill-chunk", type=int, default=64)
    tk = sub.add_parser("tokens", help="llama.cpp's token ids for the fixed texts, as the tests' fixture")
    tk.add_argument("target", nargs="?", default="smollm2")
    tk.add_argument("-o", "--out", default="tests/data/smollm2_llamacpp_tokens.json")
    args = p.parse_args(argv)
    return _logits(args) if args.what == "logits" else _tokens(args)


if __name__ == "__main__":
    sys.exit(main())
