"""`flare run NAME.core`: load a core (one process or MPI ranks) and serve requests with it.

One process: parse options, load (validate, select, prune), prepare, serve.
Under mpirun: rank 0 parses the command line and broadcasts the options and
the requests; every rank loads and selects on its own and the ranks agree on
the selection digest (or all stop with the same error); experts are
partitioned across ranks; rank 0 schedules and the others replay its steps.

Text in and out (`CoreText`) is the core's model's own tokenizer, the one
`flare serve NAME.core` uses: for a core of a GGUF model (`flare export smollm2
-o s.core`) the file's BPE, read from the file the manifest names; for
`token-lm/1` byte models <bos> and the UTF-8 bytes. A text prompt is encoded
as a completion prompt (no chat template, as `/v1/completions` and `flare run
FILE.gguf --no-chat`), and each request's output is decoded to text in the
report.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence, TextIO

from flare.core.errors import FlareError, InputError
from flare.core.options import add_backends_option

from .expert_parallel import Partition
from .loader import LoadedCore, load_core
from .ranks import agree, allgather_json, bcast_json, spawn, under_mpirun, world
from .selection import LoadOptions


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flare run NAME.core",
                                description="Load an exported core and serve requests with continuous batching.")
    mixed = p.add_mutually_exclusive_group()
    mixed.add_argument("--mixed-prefill", dest="mixed_prefill", action="store_true", default=None,
                       help="use mixed programs (a prefill chunk and decode tokens in one step); an error if the "
                            "core has none that can run here")
    mixed.add_argument("--no-mixed-prefill", dest="mixed_prefill", action="store_false",
                       help="exclude mixed programs (separate prefill and decode steps)")
    add_backends_option(p, dest="backend", default=None, help="backend to run on (default: the core's first)")
    p.add_argument("--requests", default=None, metavar="FILE",
                   help="JSONL requests ('-' = standard input; default: stdin unless --prompt is given)")
    p.add_argument("--prompt", default=None, help="serve one request with this text")
    p.add_argument("--max-new-tokens", type=int, default=16, help="default for requests that do not say")
    p.add_argument("--ranks", type=int, default=None, help="run on N MPI ranks (spawns mpirun; experts are split)")
    p.add_argument("--check", action="store_true", help="validate and select only; print what was selected")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


class CoreText:
    """Text in and out of a core's requests with its model's tokenizer (`tokenizer_for`: a GGUF model's
    from the file the manifest names), loaded on first use: a run of explicit ids needs no file, and
    its report then has text only where the tokenizer can be loaded."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._tok: Any = None

    def tokenizer(self) -> Any:
        if self._tok is None:
            from .loader import read_manifest
            from .serving.tokenizer import tokenizer_for

            self._tok = tokenizer_for(self.path, read_manifest(self.path))
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer().encode(text))

    @property
    def vocab(self) -> int:
        from .loader import read_manifest

        return read_manifest(self.path).serving.vocab

    @property
    def bos(self) -> int | None:
        """The tokenizer's <bos> (None when it cannot be loaded)."""
        try:
            return getattr(self.tokenizer(), "bos", None)
        except FlareError:
            return None

    def decode(self, ids: Sequence[int]) -> str | None:
        """The text of generated ids (None when the tokenizer cannot be loaded: the ids still stand)."""
        try:
            dec = self.tokenizer().decoder()
        except FlareError:
            return None
        return "".join(dec.push(int(t)) for t in ids) + dec.flush()


def _without_ranks(argv: Sequence[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--ranks":
            skip = True
        elif not a.startswith("--ranks="):
            out.append(a)
    return out


def main(path: str, argv: list[str], stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    if under_mpirun():
        return _main_rank(path, argv, stdin or sys.stdin, stdout or sys.stdout)
    args = _check(parser().parse_args(argv))
    if args.ranks is not None and args.ranks > 1:
        return spawn(args.ranks, ["run", path, *_without_ranks(argv)])
    options = LoadOptions(args.mixed_prefill, args.backend)
    core = load_core(path, options)
    if args.check:
        _print({"load": core.summary(), "ranks": [_rank_info(core, 0)]}, args.json, stdout or sys.stdout)
        return 0
    text = CoreText(path)
    requests = _requests(args, stdin or sys.stdin, text)
    report = _serve(core, requests, Partition(), None, text)
    report["ranks"] = [_rank_info(core, 0)]
    _print(report, args.json, stdout or sys.stdout)
    _all_rejected(report)
    return 0


def _all_rejected(report: dict[str, Any]) -> None:
    """Every request refused is bad input: the report is printed, then exit 2 naming why."""
    from flare.plugins.export.serving.requests import RequestError

    rejected = report.get("rejected") or {}
    if rejected and not report.get("requests") and not report.get("completed"):  # `requests`: those admitted
        first, why = next(iter(rejected.items()))
        raise RequestError(f"all {len(rejected)} request(s) were rejected (first: {first}: {why})")


MAX_RANKS = 1024
MAX_NEW_TOKENS = 1 << 20


def _check(args: argparse.Namespace) -> argparse.Namespace:
    """Option values argparse's types cannot judge (InputError naming the option)."""
    if args.ranks is not None and not 1 <= args.ranks <= MAX_RANKS:
        raise InputError(f"--ranks {args.ranks}: must be between 1 and {MAX_RANKS}")
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise InputError(f"--max-new-tokens {args.max_new_tokens}: must be between 1 and {MAX_NEW_TOKENS}")
    if args.backend is not None and ("," in args.backend or not args.backend.strip()):
        raise InputError(f"--backends {args.backend!r}: expected one backend name (e.g. cpu)")
    return args


def _requests(args: argparse.Namespace, stdin: TextIO, text: CoreText) -> list[dict[str, Any]]:
    """The requests as dicts of prompt ids (text already encoded by the core's tokenizer)."""
    from flare.plugins.export.serving.requests import RequestError, parse_request, read_requests

    how = {"encode": text.encode, "id_limit": text.vocab}
    if args.prompt is not None and args.requests is None:
        return [parse_request({"id": "prompt", "prompt": args.prompt}, "--prompt", "prompt",
                              args.max_new_tokens, **how).to_dict()]
    if args.requests in (None, "-"):
        if args.requests is None and stdin.isatty():
            print("reading requests from standard input, one JSON object per line "
                  '(e.g. {"prompt": "Hello", "max_new_tokens": 8}); end with Ctrl-D', file=sys.stderr)
        what = "standard input"
        reqs = read_requests(stdin, args.max_new_tokens, what, **how)
    else:
        what = args.requests
        try:
            with open(args.requests, "rb") as fh:
                reqs = read_requests(fh, args.max_new_tokens, what, **how)
        except OSError as exc:
            raise InputError(f"--requests: cannot read {args.requests!r}: {exc.strerror or exc}") from None
    if not reqs:
        raise RequestError(f"{what}: no requests (expected one JSON object per line, or --prompt TEXT)")
    return [r.to_dict() for r in reqs]


def _rank_info(core: LoadedCore, rank: int) -> dict[str, Any]:
    return {"rank": rank, "options": core.options.to_dict(), "mixed_prefill": core.mixed, "digest": core.digest,
            "programs": list(core.selection.programs)}


def _serve(core: LoadedCore, requests: list[dict[str, Any]], part: Partition, comm: Any,
           text: CoreText | None = None) -> dict[str, Any]:
    from flare.core.ledger import LEDGER
    from flare.plugins.export.serving.requests import parse_request
    from flare.plugins.serve.engine import StepEngine
    from flare.plugins.serve.offline import Batcher

    from .runtime import CoreRuntime

    vocab = core.manifest.serving.vocab
    reqs = [parse_request(r, f"request {i}", str(i), id_limit=vocab) for i, r in enumerate(requests)]
    LEDGER.reset_peak()
    runtime = CoreRuntime(core, partition=part, comm=comm)
    try:
        engine = StepEngine(runtime, comm)
        if part.rank == 0:
            report = Batcher(engine, bos=text.bos if text is not None else None).run(reqs)
            for r in report.get("per_request", []) if text is not None else []:
                r["text"] = text.decode(r["tokens"])
        else:
            engine.follow()
            report = {}
        report["memory"] = runtime.memory()
        report["launches_by_program"] = dict(runtime.launches)
        report["local_experts"] = runtime.local_experts
    finally:
        runtime.release()
    report["load"] = core.summary()
    return report


def _main_rank(path: str, argv: list[str], stdin: TextIO, stdout: TextIO) -> int:
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    msg: dict[str, Any] = {}
    if rank == 0:                      # only rank 0 reads the command line (and stdin)
        try:
            args = _check(parser().parse_args(argv))
            msg = {"ok": True, "options": LoadOptions(args.mixed_prefill, args.backend).to_dict(),
                   "check": args.check, "json": args.json,
                   "requests": None if args.check else _requests(args, stdin, CoreText(path))}
        except SystemExit as exc:      # --help (0) or a usage error (2), already printed by argparse
            msg = {"ok": False, "exit": exc.code or 0, "error": f"bad command line (exit {exc.code})"}
        except FlareError as exc:
            msg = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    msg = bcast_json(comm, msg)
    if not msg["ok"] and msg.get("exit") == 0:
        return 0
    if not msg["ok"]:
        raise FlareError(f"rank 0 stopped every rank: {msg['error']}")
    options = LoadOptions.from_dict(msg["options"])
    core, infos = agree(comm, lambda: load_core(path, options), lambda c: c.digest, lambda c: _rank_info(c, rank))
    if msg["check"]:
        if rank == 0:
            _print({"load": core.summary(), "ranks": infos}, msg["json"], stdout)
        return 0
    try:
        report = _serve(core, msg["requests"], Partition(rank, size), comm, CoreText(path) if rank == 0 else None)
        every = allgather_json(comm, {"memory": report["memory"], "local_experts": report["local_experts"],
                                      "launches": report["launches_by_program"]})
    except BaseException as exc:       # a rank failing mid-run would leave the others in a collective
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        comm.Abort(2)
        raise
    if rank == 0:
        report["ranks"] = [{**info, **extra} for info, extra in zip(infos, every)]
        _print(report, msg["json"], stdout)
        _all_rejected(report)
    return 0


def _print(report: dict[str, Any], as_json: bool, out: TextIO) -> None:
    if as_json:
        out.write(json.dumps(report, indent=1, sort_keys=True) + "\n")
        out.flush()
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(file=out)
    load = report["load"]
    console.print(f"[bold]{load['core']}[/] ({load['model']}, {load['backend']}): {load['reason']}")
    console.print(f"programs: {', '.join(load['programs'])}")
    if load["excluded"]:
        console.print(f"excluded: {', '.join(f'{k} ({v})' for k, v in load['excluded'].items())}")
    console.print(f"kernels kept: {len(load['kernels'])}, tuning entries kept: {len(load['tuning'])}, pruned: "
                  f"{sum(len(v) for v in load['pruned_kernels'].values())} kernels, {len(load['pruned_tuning'])} tuning")
    console.print(f"ranks: {len(report['ranks'])}, selection digest {load['digest'][:16]}")
    if "per_request" not in report:
        return
    rate = report.get("tokens_per_s")
    table = Table(title=f"{report['completed']}/{report['requests']} requests, {report['generated_tokens']} tokens "
                        f"in {report['seconds'] or 0:.3f} s ({'-' if rate is None else f'{rate:.1f}'} tokens/s)")
    for col in ("request", "prompt", "ttft ms", "launches", "output"):
        table.add_column(col)
    for r in report["per_request"]:
        text = r.get("text")
        if text is None:
            text = bytes(t for t in r["tokens"] if t < 256).decode("utf-8", "replace")
        table.add_row(r["id"], str(r["prompt_tokens"]), f"{1000 * (r['ttft_s'] or 0):.1f}", str(r["launches"]),
                      repr(text)[:40])
    console.print(table)
    mean = (report.get("launches_per_request") or {}).get("mean")
    console.print(f"steps: {report['steps']}; launches per request: "
                  f"{'none completed' if mean is None else f'mean {mean:.1f}'}")
    for dev, m in report["memory"].items():
        console.print(f"memory {dev}: persistent {m['persistent_bytes']} B, workspace {m['workspace_bytes']} B, "
                      f"peak {m['peak_bytes']} B")
    for rid, why in report["rejected"].items():
        console.print(f"[yellow]rejected[/] {rid}: {why}")
