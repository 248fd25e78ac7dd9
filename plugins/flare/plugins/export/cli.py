"""Command line: `flare export MODEL -o NAME.core` and `flare run NAME.core` (registered by `plugin.py`).

    flare export moe-lm -o moe.core [--size tiny] [--tuning quick|audit] [--backends cpu] [--force]
    flare run moe.core [--mixed-prefill | --no-mixed-prefill] [--requests FILE|-] [--prompt TEXT]
                       [--max-new-tokens N] [--backends cpu] [--ranks N] [--check] [--json]

`--ranks N` re-runs the command under `mpirun -n N`; under mpirun rank 0
parses the command line and broadcasts it (see flare.plugins.export.ranks and
flare.plugins.export.serve).
"""
from __future__ import annotations

import argparse
from typing import Sequence



HELP = "build, plan, tune and write a model as a core directory (NAME.core)"
DESCRIPTION = ("Capture a model's prefill/decode/mixed programs per shape bucket, tune kernel "
               "variants, and write manifest, catalog, graphs and safetensors weights atomically.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model name (see `flare models`; exportable: moe-lm, smollm2, gguf)")
    p.add_argument("-o", "--output", required=True, metavar="NAME.core", help="core directory to write")
    p.add_argument("--tuning", choices=["quick", "audit"], default="quick",
                   help="quick: a few timings of each kernel variant; audit: every shape, more repeats")
    p.add_argument("--size", default=None, help="model size (moe-lm: tiny, mid, small)")
    p.add_argument("--seed", type=int, default=None, help="weights seed")
    p.add_argument("--prefill-chunk", type=int, default=None, help="most prompt tokens per prefill step")
    p.add_argument("--max-ctx", type=int, default=None, help="most tokens of one sequence (prompt + generated)")
    p.add_argument("--backends", default="cpu", help="backends to plan and tune for, comma separated (cpu always)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="another export option of the model's adapter (VALUE read as JSON if it parses), "
                        "e.g. flare export gguf --option path=model.gguf")
    mixed = p.add_mutually_exclusive_group()
    mixed.add_argument("--no-mixed", dest="mixed", action="store_false", default=None,
                       help="do not export mixed (prefill + decode) programs")
    mixed.add_argument("--mixed-default", choices=["on", "off"], default=None,
                       help="whether `flare run` uses mixed programs when neither --mixed-prefill nor "
                            "--no-mixed-prefill is given (default: on when exported)")
    p.add_argument("--draft-layers", type=int, default=None, metavar="N",
                   help="speculative decoding: layers of the self-draft (default: the model's, moe-lm half of its "
                        "layers; 0: no draft programs; all layers: the model drafting for itself)")
    p.add_argument("--max-draft", type=int, default=4, metavar="K",
                   help="most proposals per sequence a verify program checks (flare serve --speculative K <= this)")
    p.add_argument("--force", action="store_true", help="replace an existing core directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def cmd_export(args: argparse.Namespace) -> int:
    from rich.console import Console

    from flare.core.session import device_list

    from .exporter import export_core

    named = (("size", args.size), ("seed", args.seed), ("prefill_chunk", args.prefill_chunk), ("max_ctx", args.max_ctx))
    from flare.core.cli import _model_options

    options = {**_model_options(args.option), **{k: v for k, v in named if v is not None}}
    default = None if args.mixed_default is None else args.mixed_default == "on"
    path = export_core(args.model, args.output, tuning=args.tuning, options=options,
                       backends=device_list(args.backends, "--backends"), mixed=args.mixed,
                       mixed_default=default, force=args.force, progress=not args.quiet,
                       draft_layers=args.draft_layers, max_draft=args.max_draft)
    Console(stderr=True).print(f"wrote {path}", soft_wrap=True, highlight=False)
    return 0


def run_core(path: str, argv: Sequence[str]) -> int:
    """`flare run NAME.core ARGS` (claimed through `flare_run_target`)."""
    from .serve import main

    return main(path, list(argv))

