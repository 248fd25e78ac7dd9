"""`flare serve NAME.core`: load a core exactly as `flare run` does, then serve it over HTTP.

    flare serve moe.core [--host 127.0.0.1] [--port 8000] [--mixed-prefill | --no-mixed-prefill]
                         [--prefix-cache | --no-prefix-cache] [--speculative K | --no-speculative]
                         [--ranks N] [--max-queue N] [--backends B]

Loading is `load_core(path, LoadOptions(...))`, the very call `flare run`
makes: the same validation, selection (and refusals: `--mixed-prefill` or
`--speculative K` on a core that cannot honour them) and pruning. Under
`--ranks N` the command re-runs under mpirun; rank 0 parses the command
line, broadcasts the options, every rank loads and the ranks agree on the
selection digest; rank 0 serves HTTP and runs the step loop, the others
replay its steps. On SIGTERM or Ctrl-C uvicorn stops accepting, lets open
requests finish (up to --graceful-seconds), then the step loop cancels what
is left, every prefix-cache block and the runtime are released, and the
ledger's live bytes are printed (`flare serve: stopped; ledger live bytes N
(at start M)`), which the load script checks.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from flare.core.errors import FlareError, InputError
from flare.core.options import add_backends_option


HELP = "serve an exported core over an OpenAI-compatible HTTP API"
DESCRIPTION = ("Serve an exported core over an OpenAI-compatible HTTP API (/v1/completions, /v1/models, /health, "
               "/metrics) with continuous batching, a prefix cache and speculative decoding.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("core", metavar="NAME.core|MODEL|FILE.gguf",
                   help="exported core directory (flare export MODEL -o NAME.core), an exportable model's name "
                        "(e.g. smollm2) or a .gguf file (exported once into the cache on first use)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port; the line printed says which)")
    mixed = p.add_mutually_exclusive_group()
    mixed.add_argument("--mixed-prefill", dest="mixed_prefill", action="store_true", default=None,
                       help="use mixed programs; an error if the core has none that can run here")
    mixed.add_argument("--no-mixed-prefill", dest="mixed_prefill", action="store_false",
                       help="exclude mixed programs (separate prefill and decode steps)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--prefix-cache", dest="prefix_cache", action="store_true", default=True,
                       help="reuse KV blocks of prompts already seen (default)")
    cache.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", help="prefill every prompt whole")
    p.add_argument("--prefix-cache-mib", type=float, default=64.0, help="byte budget of the prefix cache (MiB)")
    p.add_argument("--prefix-block", type=int, default=16, help="tokens per prefix-cache block")
    spec = p.add_mutually_exclusive_group()
    spec.add_argument("--speculative", dest="speculative", type=int, default=None, metavar="K",
                      help="speculative decoding with the core's draft programs, K proposals per round; an error "
                           "if the core has none")
    spec.add_argument("--no-speculative", dest="speculative", action="store_const", const=0,
                      help="plain decoding even if the core's default is speculative")
    p.add_argument("--draft", choices=("ngram", "self"), default="ngram",
                   help="who proposes under --speculative: ngram (prompt lookup: tokens that followed the same "
                        "n-gram earlier in the prompt or answer; default) or self (the core's draft programs)")
    p.add_argument("--draft-min", type=int, default=0, metavar="N",
                   help="prompt lookup: propose at least N tokens whenever the n-gram matches, whatever the measured "
                        "step costs say (default 0: the draft length follows the costs, and may be none)")
    add_backends_option(p, dest="backend", default=None, help="backend to run on (default: the core's first)")
    p.add_argument("--ranks", type=int, default=None, help="run on N MPI ranks (spawns mpirun; experts are split)")
    p.add_argument("--max-queue", type=int, default=256, help="most requests waiting for a slot; more get 429")
    p.add_argument("--graceful-seconds", type=float, default=5.0,
                   help="on SIGTERM, how long open requests may take to finish before they are cancelled")
    p.add_argument("--max-body-kib", type=int, default=4096, help="largest request body accepted (larger: 413)")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's headers, and its body (then: closed / 408)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flare serve", description=DESCRIPTION)
    add_arguments(p)
    return p


def load_options(args: argparse.Namespace) -> Any:
    from flare.plugins.export.selection import LoadOptions

    spec = None if args.speculative is None else args.speculative > 0
    return LoadOptions(args.mixed_prefill, args.backend, speculative=spec)


def run(args: argparse.Namespace) -> int:
    """The command: one process, or spawn mpirun for --ranks N > 1."""
    from flare.plugins.export.ranks import under_mpirun

    if under_mpirun():
        return _main_rank(args)
    _check(args)
    args.core = str(resolve_core(args.core))
    if args.ranks is not None and args.ranks > 1:
        return _spawn(args.ranks, ["serve", *_argv(args)])
    from flare.plugins.export.loader import load_core

    _say(f"loading {args.core} (validate, select, prune)")
    core = load_core(args.core, load_options(args))
    return serve(core, args, comm=None)


def resolve_core(arg: str) -> Path:
    """A core directory as given, or the core of an exportable model named `arg`, exported once into
    the cache (`serve/cores/MODEL.core`, default export options) and reused after."""
    path = Path(arg)
    if path.is_dir():
        return path
    from flare.core.cache import cache_dir
    from flare.core.plugin_manager import get_plugin_manager
    from flare.plugins.export.adapters import AdapterSpec
    from flare.plugins.export.exporter import export_core

    adapters = get_plugin_manager().collect("flare_export_adapters", AdapterSpec)
    model, options, name = arg, None, arg
    if arg.endswith(".gguf") and "gguf" in adapters:
        model, options, name = "gguf", {"path": str(path.resolve())}, _file_core_name(path)
    elif arg not in adapters:
        raise InputError(f"{arg!r}: not a core directory, a .gguf file, nor an exportable model (exportable: "
                         f"{', '.join(sorted(adapters)) or 'none'})")
    core = cache_dir("serve", "cores") / f"{name}.core"
    if not core.is_dir():
        from flare.plugins.export.files import CoreExistsError

        _say(f"exporting {arg} once into {core} (first use; later starts reuse it)")
        try:
            export_core(model, core, options=options, progress=False)   # written aside and renamed: never half a core
        except CoreExistsError:
            pass                                     # another server exported it meanwhile
    return core


def _file_core_name(path: Path) -> str:
    """The cached core's name of a model file: its stem and a digest of its absolute path, size and
    modification time, so an edited or replaced file is exported again (InputError if it is missing)."""
    import hashlib

    try:
        st = path.stat()
    except OSError as exc:
        raise InputError(f"{path}: cannot read the model file: {exc.strerror or exc}") from None
    key = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return f"{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def _say(what: str) -> None:
    """Progress on stderr: what is being loaded, and when the server is ready."""
    print(f"flare serve: {what}", file=sys.stderr, flush=True)


def _check(args: argparse.Namespace) -> None:
    """Option values argparse's types cannot judge: a one-line InputError (exit 2) naming the option."""
    import math

    if args.speculative is not None and args.speculative < 0:
        raise InputError(f"--speculative K needs K >= 1, got {args.speculative}")
    if args.max_queue < 1:
        raise InputError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.prefix_block < 1 or not (math.isfinite(args.prefix_cache_mib) and args.prefix_cache_mib >= 0):
        raise InputError("--prefix-block must be >= 1 and --prefix-cache-mib a number >= 0")
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port {args.port}: must be 0..65535")
    if args.ranks is not None and not 1 <= args.ranks <= 1024:
        raise InputError(f"--ranks {args.ranks}: must be between 1 and 1024")
    if args.max_body_kib < 1:
        raise InputError(f"--max-body-kib {args.max_body_kib}: must be >= 1")
    if not (math.isfinite(args.read_timeout) and args.read_timeout > 0):
        raise InputError(f"--read-timeout {args.read_timeout}: must be a number > 0")
    if not (math.isfinite(args.graceful_seconds) and args.graceful_seconds >= 0):
        raise InputError(f"--graceful-seconds {args.graceful_seconds}: must be a number >= 0")
    if args.backend is not None and ("," in args.backend or not args.backend.strip()):
        raise InputError(f"--backends {args.backend!r}: expected one backend name (e.g. cpu)")


def build(core: Any, args: argparse.Namespace, comm: Any = None, rank: int = 0, size: int = 1) -> Any:
    """The runtime, the step engine and (rank 0) the loop and API of a loaded core."""
    from flare.plugins.export.expert_parallel import Partition
    from flare.plugins.export.runtime import CoreRuntime

    from .server import Server

    from .requests_api import Limits

    if rank == 0:
        _say(f"preparing {len(core.selection.programs)} programs on {core.selection.backend} "
             f"(arenas, weights, captures)")
    runtime = CoreRuntime(core, partition=Partition(rank, size), comm=comm)
    try:
        return Server(runtime, comm=comm, name=Path(args.core).name, prefix_cache=args.prefix_cache,
                      prefix_cache_bytes=int(args.prefix_cache_mib * 2**20), prefix_block=args.prefix_block,
                      speculative=args.speculative or 0, draft=args.draft, draft_min=args.draft_min, max_queue=args.max_queue,
                      limits=Limits(args.max_body_kib << 10, body_seconds=args.read_timeout))
    except BaseException:
        runtime.release()
        raise


def serve(core: Any, args: argparse.Namespace, comm: Any) -> int:
    import uvicorn

    from flare.core.ledger import LEDGER

    start_bytes = LEDGER.live_bytes()
    server = build(core, args, comm, 0, 1 if comm is None else comm.Get_size())
    sock = None
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((args.host, args.port))
            sock.listen(2048)  # before saying where: a client may connect at once (uvicorn accepts later)
        except OSError as exc:
            raise FlareError(f"--host/--port: cannot listen on {args.host}:{args.port}: {exc}") from None
        host, port = sock.getsockname()[:2]
        server.loop.start()
        from .http import GracefulServer, timed_h11

        # uvicorn's own deadline comes after ours: by then the drained requests have had their answers
        config = uvicorn.Config(server.api.app(), log_level=args.log_level, lifespan="on",
                                http=timed_h11(args.read_timeout),
                                timeout_graceful_shutdown=args.graceful_seconds + 5.0)
        import threading

        drain = threading.Timer(args.graceful_seconds, server.loop.drain)
        drain.daemon = True
        userver = GracefulServer(config, on_exit=drain.start)
        # Until uvicorn installs its own handlers, a SIGTERM/SIGINT (a client may send one as soon as the
        # ready line appears) asks the server to stop before it serves; uvicorn re-raises the signal that
        # stopped it once it has shut down, and with these handlers in place that re-raise lands here
        # instead of killing the process before the release below.
        old = {sig: signal.signal(sig, lambda signum, _f: userver.handle_exit(signum, None))
               for sig in (signal.SIGTERM, signal.SIGINT)}
        print(f"flare serve: {server.api.model} on http://{host}:{port}/v1 ({server.describe()}); ready, "
              f"chat page at http://{host}:{port}/", file=sys.stderr, flush=True)
        if comm is not None:     # under mpirun the spawning process forwards SIGTERM/SIGINT as SIGUSR1
            old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda _s, _f: userver.handle_exit(signal.SIGTERM, None))
        try:
            userver.run(sockets=[sock])
        finally:
            drain.cancel()
            for sig, handler in old.items():
                signal.signal(sig, handler)
    finally:
        server.close()
        if sock is not None:
            sock.close()
    print(f"flare serve: stopped; ledger live bytes {LEDGER.live_bytes()} (at start {start_bytes})",
          file=sys.stderr, flush=True)
    if server.loop.error is not None:
        raise FlareError(f"the step loop failed: {type(server.loop.error).__name__}: {server.loop.error}")
    return 0


def _main_rank(args: argparse.Namespace) -> int:
    """Under mpirun: rank 0's options win; all ranks load and agree; rank 0 serves, the others follow."""
    from flare.plugins.export.loader import load_core
    from flare.plugins.export.ranks import agree, bcast_json, world
    from flare.plugins.export.selection import LoadOptions

    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    msg: dict[str, Any] = {}
    if rank == 0:
        try:
            _check(args)
            msg = {"ok": True, "options": load_options(args).to_dict()}
        except FlareError as exc:
            msg = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    msg = bcast_json(comm, msg)
    if not msg["ok"]:
        raise FlareError(f"rank 0 stopped every rank: {msg['error']}")
    options = LoadOptions.from_dict(msg["options"])
    core, _ = agree(comm, lambda: load_core(args.core, options), lambda c: c.digest)
    if rank == 0:
        return serve(core, args, comm)
    for sig in (signal.SIGTERM, signal.SIGUSR1):       # rank 0 decides when to stop, and says so
        signal.signal(sig, signal.SIG_IGN)
    server = build(core, args, comm, rank, size)
    try:
        server.engine.follow()
    finally:
        server.close()
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    """The command line of one rank (everything but --ranks), rebuilt from the parsed options."""
    out = [args.core, "--host", args.host, "--port", str(args.port), "--max-queue", str(args.max_queue),
           "--prefix-cache-mib", str(args.prefix_cache_mib), "--prefix-block", str(args.prefix_block),
           "--graceful-seconds", str(args.graceful_seconds), "--log-level", args.log_level, "--draft", args.draft,
           "--draft-min", str(args.draft_min),
           "--max-body-kib", str(args.max_body_kib), "--read-timeout", str(args.read_timeout),
           "--prefix-cache" if args.prefix_cache else "--no-prefix-cache"]
    if args.mixed_prefill is not None:
        out.append("--mixed-prefill" if args.mixed_prefill else "--no-mixed-prefill")
    if args.speculative is not None:
        out += ["--speculative", str(args.speculative)] if args.speculative else ["--no-speculative"]
    if args.backend:
        out += ["--backends", args.backend]
    return out


def _spawn(n: int, argv: list[str]) -> int:
    """mpirun -n N flare ARGV. SIGTERM/SIGINT reach the ranks as SIGUSR1 (which mpirun forwards; its own
    SIGTERM handling would kill the job): rank 0 shuts down gracefully and stops the others."""
    from flare.plugins.export.ranks import mpirun_command

    env = dict(os.environ)
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    child = subprocess.Popen(mpirun_command(n, argv), env=env)

    def forward(signum: int, _frame: Any) -> None:
        child.send_signal(signal.SIGUSR1)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
