"""Ranks on MPI (mpi4py over Open MPI): spawning, JSON messages without pickle, agreement.

mpi4py's lower-case methods pickle; a core must never be unpickled, and
neither is anything here: messages are JSON encoded to bytes and moved with
the buffer-based upper-case calls (`Bcast`, `Allgather`, `Allgatherv`).

`flare run NAME.core --ranks N` re-executes itself under `mpirun -n N`;
under mpirun, rank 0 alone reads the command line and broadcasts the load
options; every rank validates and selects on its own, and `agree` makes all
ranks either continue with the same selection digest or raise the same error.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from flare.core.errors import CoreFormatError, FlareError, InputError

T = TypeVar("T")
MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


class RankError(CoreFormatError):
    """Raised on every rank when one rank failed (or the ranks disagreed): the same text everywhere,
    naming the failing rank, its error and the field."""

    def __init__(self, text: str, field: str | None = None):
        self.field = field
        FlareError.__init__(self, text)


def under_mpirun() -> bool:
    """True when this process was started by mpirun with more than one rank."""
    for var in MPI_SIZE_VARS:
        v = os.environ.get(var)
        if v and v.isdigit() and int(v) > 1:
            return True
    return False


def world() -> Any:
    """MPI.COMM_WORLD (imports mpi4py only when ranks are used)."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise FlareError(f"ranks need mpi4py (pip install 'flare-runtime[mpi]'): {exc}") from None
    return MPI.COMM_WORLD


BUSY_POLLS = 1000      # polls before a waiting rank starts sleeping between them
IDLE_POLL_S = 0.001


def bcast_json(comm: Any, obj: Any = None, root: int = 0) -> Any:
    """Broadcast a JSON-able object from `root` (others pass None and get it back).

    The size goes first by a non-blocking broadcast that the other ranks poll, sleeping a
    millisecond between polls once they have waited a moment: a follower waiting for rank 0's
    next step (an idle server, a tokenizer, a prompt being read) would otherwise spin a core
    inside MPI, as Open MPI's blocking collectives busy-poll."""
    rank = comm.Get_rank()
    if rank == root:
        data = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)
        n = np.array([data.size], np.int64)
    else:
        data, n = None, np.zeros(1, np.int64)
    req = comm.Ibcast(n, root=root)
    if rank == root:
        req.Wait()
    else:
        polls = 0
        while not req.Test():
            polls += 1
            if polls > BUSY_POLLS:
                time.sleep(IDLE_POLL_S)
        data = np.empty(int(n[0]), np.uint8)
    comm.Bcast(data, root=root)
    return json.loads(data.tobytes().decode()) if rank != root else obj


def allgather_json(comm: Any, obj: Any) -> list[Any]:
    """Every rank's JSON-able object, in rank order, on every rank."""
    data = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)
    sizes = np.zeros(comm.Get_size(), np.int64)
    comm.Allgather(np.array([data.size], np.int64), sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    buf = np.empty(int(sizes.sum()), np.uint8)
    comm.Allgatherv(data, [buf, sizes.tolist(), offsets.tolist(), _byte_type()])
    return [json.loads(buf[o: o + s].tobytes().decode()) for o, s in zip(offsets, sizes)]


def _byte_type() -> Any:
    from mpi4py import MPI
    return MPI.BYTE


def agree(comm: Any, work: Callable[[], T], digest: Callable[[T], str],
          describe: Callable[[T], Any] = lambda r: None) -> tuple[T, list[Any]]:
    """Run `work` on every rank; continue only if every rank succeeded with the same digest.

    Returns (this rank's result, every rank's `describe(result)`). Otherwise every rank raises
    the same CoreFormatError: the first failing rank's error, or the digest disagreement.
    """
    result: Any = None
    try:
        result = work()
        mine = {"ok": True, "digest": digest(result), "info": describe(result)}
    except Exception as exc:  # any failure, typed or not: a rank that raised alone would hang the others
        mine = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "field": getattr(exc, "field", None)}
    every = allgather_json(comm, mine)
    failed = [(r, m) for r, m in enumerate(every) if not m["ok"]]
    if failed:
        r, m = failed[0]
        raise RankError(f"rank {r} of {len(every)} stopped: {m['error']}", m.get("field"))
    digests = {m["digest"] for m in every}
    if len(digests) != 1:
        table = ", ".join(f"rank {r}: {m['digest'][:12]}" for r, m in enumerate(every))
        raise RankError(f"selection: ranks disagree on the selection ({table})", "selection")
    return result, [m["info"] for m in every]


def mpirun_command(n: int, argv: Sequence[str]) -> list[str]:
    """`mpirun -n N python -c 'flare.core.cli.main' ARGV` (root- and oversubscription-safe).

    Not `python -m flare.core.cli`: that would run a second copy of the module as __main__,
    whose command tables the extensions (export, bench) do not register into."""
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise FlareError("--ranks needs mpirun on PATH (Debian: apt install openmpi-bin)")
    cmd = [mpirun, "-n", str(int(n)), "--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + [sys.executable, "-c", "import sys; from flare.core.cli import main; sys.exit(main(sys.argv[1:]))", *argv]


def spawn(n: int, argv: Sequence[str]) -> int:
    """Re-run `flare ARGV` on `n` ranks; returns mpirun's exit status."""
    if n < 1:
        raise InputError(f"--ranks must be >= 1, got {n}")
    env = dict(os.environ)
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    return subprocess.call(mpirun_command(n, argv), env=env)
