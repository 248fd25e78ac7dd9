"""`flare run moe-lm --prompt TEXT ...`: generate and stream bytes to stdout.

Bytes are decoded incrementally as UTF-8 (a multi-byte character is printed
when complete; invalid bytes become U+FFFD), so the stream never waits for
the whole answer. Statistics go to stderr with --stats.
"""
from __future__ import annotations

import argparse
import codecs
import json
import sys
from typing import Sequence, TextIO

from flare.core.cli import add_threads_argument, device_config, report_error
from flare.core.errors import FlareError, InputError
from flare.core.options import add_backends_option

from .config import EOS, N_BYTES, SIZES, encode
from .placement import parse_layer_map
from .sampling import Sampling


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flare run moe-lm",
        description="Generate text with the synthetic MoE decoder. Its weights are seeded random numbers, "
                    "so the text is noise: the model exists to exercise placement, expert staging, mixed "
                    "prefill and ranks, and its outputs are compared between modes, not read.")
    p.add_argument("--prompt", required=True, help="prompt text (byte-level tokens)")
    p.add_argument("--size", choices=list(SIZES), default="tiny")
    p.add_argument("--experts", choices=["resident", "offload"], default="resident",
                   help="resident: experts are device weights; offload: a bounded device cache filled per step")
    p.add_argument("--expert-cache-mb", type=float, default=None, help="offload: expert cache MiB over all layers")
    p.add_argument("--expert-source", choices=["mmap", "host"], default="mmap",
                   help="offload: copy experts from the memory-mapped file or from host memory")
    p.add_argument("--prefetch", type=int, default=0, metavar="N",
                   help="offload: copy N guessed experts per token of the next layer on a background thread (CPU caches)")
    add_backends_option(p, dest="backend", help="device(s), comma separated, first preferred (e.g. vulkan or "
                                                "vulkan,cpu); cpu is appended")
    p.add_argument("--expert-device", action="append", default=[], metavar="LAYERS=DEVICE",
                   help="put these layers' experts on DEVICE, e.g. 0-1=cpu (repeatable); a bare DEVICE means all layers")
    p.add_argument("--layer-device", action="append", default=[], metavar="LAYERS=DEVICE",
                   help="put these layers (attention, router and, unless overridden, experts) on DEVICE")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of the synthetic weights")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (default: sampling with --seed)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--prefill-chunk", type=int, default=None, help="most tokens per prefill step (power of two)")
    p.add_argument("--stats", action="store_true", help="print staging and memory statistics to stderr")
    add_threads_argument(p)
    return p


def _check(args: argparse.Namespace) -> None:
    """Option values argparse's types cannot judge: InputError naming the option."""
    from flare.plugins.export.serving.generate import check_generation_args

    check_generation_args(args)
    if not 0 <= args.weights_seed < 2**63:
        raise InputError(f"--weights-seed {args.weights_seed!r}: must be an integer in 0..2^63-1")

def _devices(backend: str) -> list[str]:
    from flare.core.session import device_list

    names = device_list(backend, "--backends")
    if not any(n.split(":")[0] == "cpu" for n in names):
        names.append("cpu")  # host fallback for ops a GPU backend lacks
    return names


def run(argv: Sequence[str], stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Entry point of `flare run moe-lm`; returns the exit status."""
    from flare.core.session import Session

    from .model import MoeLM  # late: keeps `flare models` light

    out = stdout or sys.stdout
    err = stderr or sys.stderr
    args = parser().parse_args(list(argv))
    try:
        _check(args)
    except InputError as exc:
        return report_error(exc, err)
    try:
        expert_all = [e for e in args.expert_device if "=" not in e]
        expert_layers = parse_layer_map([e for e in args.expert_device if "=" in e])
        layer_devices = parse_layer_map(args.layer_device)
    except ValueError as exc:
        return report_error(InputError(str(exc)), err)
    sampling = Sampling(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def emit(tok: int) -> None:
        if tok < N_BYTES:
            text = decoder.decode(bytes([tok]))
            if text:
                out.write(text)
                out.flush()

    try:
        with Session(_devices(args.backend), config=device_config(args.threads)) as session, \
                MoeLM.load(args.size, experts=args.experts, cache_mb=args.expert_cache_mb, session=session,
                        seed=args.weights_seed, prefill_chunk=args.prefill_chunk, expert_source=args.expert_source,
                        expert_device=expert_all[-1] if expert_all else None, layer_devices=layer_devices,
                        expert_layer_devices=expert_layers, prefetch=args.prefetch) as model:
            tokens, _ = model.generate(encode(args.prompt), args.max_new_tokens, sampling, on_token=emit)
            out.write(decoder.decode(b"", final=True) + "\n")
            out.flush()
            if args.stats:
                st = model.stats()
                st["generated"] = len(tokens)
                st["stopped_at_eos"] = bool(tokens and tokens[-1] == EOS)
                print(json.dumps(st, indent=2), file=err)
    except FlareError as exc:
        return report_error(exc, err)
    return 0


def main() -> None:  # python -m flare.models.moe_lm.cli
    raise SystemExit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
