"""Deterministic synthetic weights, written as safetensors and read back memory-mapped.

Why memory-mapped: in `offload` mode the expert tensors never become device
weights; the staging callback copies the few experts a step selects straight
from the file mapping (the OS page cache is the host tier). Why our own header
reader: it lets us check every tensor's dtype, shape and byte range against
the file size before anything runs, so a truncated or mismatched file is a
`ModelError` naming the tensor instead of a crash mid-generation.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np

from flare.core.cache import cache_dir
from flare.core.errors import ModelError

from .config import MoeConfig

FORMAT_VERSION = "1"
META_KEY = "flare.moe_lm.config"
EXPERT_PARTS = ("gate", "up", "down")


def tensor_shapes(cfg: MoeConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model, name -> shape (the file's contract)."""
    d, q, f, e = cfg.d_model, cfg.qkv_dim, cfg.d_ff, cfg.n_experts
    shapes: dict[str, tuple[int, ...]] = {"tok_emb": (cfg.vocab, d)}
    for i in range(cfg.n_layers):
        shapes.update({
            f"L{i}.attn_norm": (d,), f"L{i}.wq": (q, d), f"L{i}.wk": (q, d), f"L{i}.wv": (q, d), f"L{i}.wo": (d, q),
            f"L{i}.ffn_norm": (d,), f"L{i}.router": (e, d), f"L{i}.router_bias": (e,),
            f"L{i}.experts.gate": (e, f, d), f"L{i}.experts.up": (e, f, d), f"L{i}.experts.down": (e, d, f),
        })
    shapes.update({"out_norm": (d,), "lm_head": (cfg.vocab, d)})
    return shapes


def expert_name(layer: int, part: str) -> str:
    return f"L{layer}.experts.{part}"


def is_expert(name: str) -> bool:
    return ".experts." in name


def _rng(seed: int, name: str) -> np.random.Generator:
    # per-tensor streams: adding a tensor never changes the others
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def generate(cfg: MoeConfig, seed: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) for every tensor, deterministic in (cfg, seed)."""
    for name, shape in tensor_shapes(cfg).items():
        rng = _rng(seed, name)
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("norm"):
            arr = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        elif leaf == "router_bias":
            # Zipf-like popularity, shuffled per layer: trained routers are unbalanced too
            rank = rng.permutation(shape[0]).astype(np.float32)
            arr = (-cfg.router_skew * np.log1p(rank)).astype(np.float32)
        elif name == "tok_emb":
            arr = rng.standard_normal(shape, dtype=np.float32)
        else:
            fan_in = shape[-1]
            arr = rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / np.sqrt(fan_in))
        yield name, np.ascontiguousarray(arr, np.float32)


def write(cfg: MoeConfig, path: str | os.PathLike, seed: int = 0) -> Path:
    """Write the weights of (cfg, seed) to `path` atomically (tmp file + rename)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tensors = dict(generate(cfg, seed))
    save_file(tensors, str(tmp), metadata={META_KEY: cfg.to_json(), "seed": str(seed), "format": FORMAT_VERSION})
    os.replace(tmp, path)
    return path


def default_path(cfg: MoeConfig, seed: int = 0, folder: str | os.PathLike | None = None) -> Path:
    base = Path(folder) if folder is not None else cache_dir("moe_lm")
    return base / f"moe-lm-{cfg.name}-seed{seed}-v{FORMAT_VERSION}-{zlib.crc32(cfg.to_json().encode()):08x}.safetensors"


def ensure(cfg: MoeConfig, seed: int = 0, folder: str | os.PathLike | None = None) -> Path:
    """The weights file of (cfg, seed), generated on first use into the cache dir."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ModelError(f"moe-lm: weights seed {seed!r} must be an integer in 0..2^63-1")
    path = default_path(cfg, seed, folder)
    if not path.exists():
        write(cfg, path, seed)
    return path


class WeightFile:
    """A validated, memory-mapped safetensors file of one model.

    `tensor(name)` is a read-only view into the mapping (no copy); `load(name)`
    is a private in-memory copy.
    """

    def __init__(self, path: str | os.PathLike, cfg: MoeConfig):
        self.path = Path(path)
        self.cfg = cfg
        if not self.path.is_file():
            raise ModelError(f"moe-lm: weights file {str(self.path)!r} does not exist")
        size = self.path.stat().st_size
        header, data_start = _read_header(self.path, size)
        meta = header.pop("__metadata__", {}) or {}
        if META_KEY in meta:
            found = MoeConfig.from_json(meta[META_KEY])
            if found != cfg:
                raise ModelError(f"moe-lm: {self.path} holds model {found.name!r} with a different config than {cfg.name!r}")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        self._views: dict[str, np.ndarray] = {}
        for name, shape in tensor_shapes(cfg).items():
            info = header.get(name)
            if info is None:
                raise ModelError(f"moe-lm: tensor {name!r} is missing from {self.path}")
            if info.get("dtype") != "F32":
                raise ModelError(f"moe-lm: tensor {name!r} in {self.path} has dtype {info.get('dtype')}, expected F32")
            if tuple(info.get("shape", ())) != shape:
                raise ModelError(f"moe-lm: tensor {name!r} in {self.path} has shape {tuple(info.get('shape', ()))}, expected {shape}")
            begin, end = (int(v) for v in info["data_offsets"])
            nbytes = int(np.prod(shape)) * 4
            if end - begin != nbytes:
                raise ModelError(f"moe-lm: tensor {name!r} in {self.path} spans {end - begin} bytes, expected {nbytes}")
            if data_start + end > size:
                raise ModelError(f"moe-lm: tensor {name!r} ends at byte {data_start + end} but {self.path} has only "
                                 f"{size} bytes (truncated file?)")
            start = data_start + begin
            self._views[name] = self._map[start: start + nbytes].view(np.float32).reshape(shape)

    def tensor(self, name: str) -> np.ndarray:
        """Read-only memory-mapped view of a tensor."""
        try:
            return self._views[name]
        except KeyError:
            raise ModelError(f"moe-lm: no tensor {name!r} in {self.path}") from None

    def load(self, name: str) -> np.ndarray:
        return np.array(self.tensor(name))

    def names(self) -> list[str]:
        return list(self._views)

    def as_dict(self) -> dict[str, np.ndarray]:
        return dict(self._views)

    def close(self) -> None:
        self._views.clear()
        mm = getattr(self._map, "_mmap", None)
        self._map = np.zeros(0, np.uint8)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a caller still holds a view; the mapping goes with it
                pass


def _read_header(path: Path, size: int) -> tuple[dict, int]:
    if size < 8:
        raise ModelError(f"moe-lm: weights file {path} is {size} bytes, too short for a safetensors header (truncated?)")
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if 8 + n > size:
            raise ModelError(f"moe-lm: weights file {path} header claims {n} bytes, file has {size} (truncated?)")
        try:
            header = json.loads(fh.read(n))
        except ValueError as exc:
            raise ModelError(f"moe-lm: weights file {path} has an unreadable header: {exc}") from None
    if not isinstance(header, dict):
        raise ModelError(f"moe-lm: weights file {path} header is not a JSON object")
    return header, 8 + n


def host_copy(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """In-memory copies (the `host` expert source: no file access while running)."""
    return {k: np.array(v) for k, v in tensors.items()}
