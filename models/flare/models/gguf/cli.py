"""`flare run smollm2 --prompt TEXT` / `flare run PATH.gguf --prompt TEXT`: chat or complete.

An instruct model (one whose file has a chat template) gets the prompt as a
one-turn chat by default (`--no-chat` feeds the raw text). The answer streams
to stdout as tokens are chosen: the text decoded so far is printed up to the
last complete character, so a multi-byte character is never split.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence, TextIO

from flare.core.cli import report_error
from flare.core.errors import FlareError, InputError


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Generate text with a GGUF language model.")
    p.add_argument("--prompt", required=True, help="the user's message (or raw text with --no-chat)")
    p.add_argument("--system", default=None, help="a system message for the chat template")
    p.add_argument("--no-chat", action="store_true", help="complete the raw prompt instead of a chat turn")
    p.add_argument("--backends", "--backend", dest="backends", default="cpu",
                   help="devices in priority order, e.g. cpu or vulkan,cpu (cpu is appended as the fallback)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-ctx", type=int, default=None, help="KV-cache positions (default: min(1024, the file's))")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="most tokens per prefill step (power of two; default 64, or 4 with --experts offload, "
                        "where a step's tokens bound how many experts must fit in the cache at once)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (default: sampling with --seed)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", choices=["resident", "offload"], default="resident",
                   help="MoE files: experts on the device, or a bounded cache filled from the mapped file")
    p.add_argument("--expert-cache-mb", type=float, default=None, help="offload: expert cache MiB over all layers")
    p.add_argument("--prefetch", type=int, default=0, metavar="N",
                   help="offload on CPU: copy each token's N likeliest next-layer experts while a layer computes")
    p.add_argument("--stats", action="store_true", help="print step and memory statistics to stderr")
    return p


def _check(args: argparse.Namespace) -> None:
    """The shared generation options (InputError naming the option), then the default prefill step."""
    from flare.plugins.export.serving.generate import check_generation_args

    check_generation_args(args)
    if args.prefill_chunk is None:
        args.prefill_chunk = 4 if args.experts == "offload" else 64

def devices(text: str) -> list[str]:
    from flare.core.session import device_list

    names = device_list(text, "--backends")
    if not any(n.split(":")[0] == "cpu" for n in names):
        names.append("cpu")   # the host fallback for ops a GPU backend lacks
    return names


def run(argv: Sequence[str], target: str | None = None, stdout: TextIO | None = None,
        stderr: TextIO | None = None) -> int:
    """`flare run smollm2|PATH.gguf ...`; returns the exit status."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    argv = list(argv)
    if target is None:                   # `flare run gguf PATH.gguf --prompt ...`
        if not argv or argv[0].startswith("-"):
            return report_error(InputError("flare run gguf: give the .gguf file first, e.g. "
                                           "flare run gguf model.gguf --prompt Hi (or flare run model.gguf ...)"), err)
        target, argv = argv[0], argv[1:]
    args = parser(f"flare run {target}").parse_args(argv)
    try:
        _check(args)
        from .model import GgufLM, Sampling

        sampling = Sampling(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed)
        with GgufLM.load(target, devices=devices(args.backends), max_ctx=args.max_ctx,
                         prefill_chunk=args.prefill_chunk, experts=args.experts,
                         cache_mb=args.expert_cache_mb, prefetch=args.prefetch) as lm:
            tok = lm.model.tokenizer()
            chat = tok.chat_template is not None and not args.no_chat
            ids = tok.chat_ids(args.prompt, args.system) if chat else tok.encode(args.prompt)
            generated: list[int] = []
            shown = 0

            def emit(t: int) -> None:
                nonlocal shown
                generated.append(t)
                text = tok.decode(generated)
                if text.endswith("\ufffd"):
                    return                   # an incomplete character: wait for its next byte
                out.write(text[shown:])
                out.flush()
                shown = len(text)

            tokens, _ = lm.generate(ids, args.max_new_tokens, sampling, on_token=emit)
            out.write(tok.decode(generated)[shown:] + "\n")
            out.flush()
            if args.stats:
                st = lm.stats()
                st.update(prompt_tokens=len(ids), generated=len(tokens),
                          stopped_at_eos=bool(tokens and tokens[-1] == lm.cfg.eos))
                print(json.dumps(st, indent=2), file=err)
    except FlareError as exc:
        return report_error(exc, err)
    return 0
