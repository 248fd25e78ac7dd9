"""Reading a GGUF file: metadata and tensors, memory-mapped, checked before use.

The parsing is llama.cpp's own (`gguf.GGUFReader`): the file is memory-mapped
and every tensor is a NumPy view into the mapping, so nothing is copied until
a device uploads it. On top of the reader this module adds what a runtime
needs before it trusts a file from a user:

- the magic is checked on the first four bytes, before the reader runs;
- every tensor's type, size and offset are checked against the file's length
  *before* the reader makes a view of it (a subclass hook on the reader's own
  tensor pass), so a tensor past the end is reported by name and no byte
  beyond the file is ever touched;
- whatever else the reader trips over (a truncated header, a bad string
  length) becomes one `GGUFError` naming the file.

Tensors come back as Flare weights: a quantized GGUF tensor of ggml dims
[K, N] (ne[0] is the row length) is a Flare [N, K / block] block tensor of
the dtype `flare.core.dtypes.quant_type_of_ggml` names; F32/F16 stay what
they are. Any other type is refused with the tensor and type named.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from flare.core.dtypes import QUANT_TYPES, quant_type_of_ggml
from flare.core.errors import ModelError

MAGIC = b"GGUF"


class GGUFError(ModelError):
    """A GGUF file is unreadable, truncated, or holds something Flare cannot run. Names the
    file and the key or tensor (exit code 2: the file is the user's input)."""


def _reader_class():
    """`gguf.GGUFReader` with a bounds check on every tensor before the reader maps it."""
    import gguf

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:  # noqa: D401 - reader hook
            size = int(self.data.shape[0])
            for field in fields:
                _len, name_data, _n_dims, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    ggml_type = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise GGUFError(f"tensor {name}: unknown ggml type {int(raw_dtype[0])}") from None
                block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
                n_elems = int(np.prod(dims.astype(np.int64))) if len(dims) else 1
                if any(int(d) < 0 for d in dims) or n_elems % block:
                    raise GGUFError(f"tensor {name}: dims {list(map(int, dims))} are not whole "
                                    f"{ggml_type.name} blocks of {block}")
                begin = int(start_offs) + int(offset[0])
                end = begin + n_elems // block * type_size
                if end > size:
                    raise GGUFError(f"tensor {name}: bytes {begin}..{end} lie past the end of the file "
                                    f"({size} bytes)")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


class GGUFFile:
    """An open GGUF file: `metadata(key)`, `tensor(name)` (Flare weights, views into the
    mapping), `tensor_info(name)`. Close with `close()` (views taken before stay valid
    only while someone holds them; the mapping is released when the last view goes).
    Read-only and safe to share between threads once open."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                head = f.read(4)
        except IsADirectoryError:
            raise GGUFError(f"{self.path}: is a directory, not a GGUF file") from None
        except OSError as exc:
            raise GGUFError(f"{self.path}: cannot open: {exc.strerror or exc}") from None
        if head != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {head!r}, expected {MAGIC!r})")
        try:
            self._reader = _reader_class()(self.path, "r")
        except GGUFError as exc:
            raise GGUFError(f"{self.path}: {exc}") from None
        except (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError, OverflowError, MemoryError) as exc:
            raise GGUFError(f"{self.path}: truncated or malformed GGUF ({type(exc).__name__}: {exc})") from None
        self._tensors = {t.name: t for t in self._reader.tensors}

    # -- metadata ---------------------------------------------------------------------
    def keys(self) -> list[str]:
        return [k for k in self._reader.fields if not k.startswith("GGUF.")]

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def metadata(self, key: str, default: Any = ...) -> Any:
        """The value of `key` (a number, string, bool or list); GGUFError naming the key when
        it is absent and no default is given."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is ...:
                raise GGUFError(f"{self.path}: metadata key {key} is missing")
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise GGUFError(f"{self.path}: metadata key {key} is unreadable ({exc})") from None

    def length(self, key: str) -> int:
        """Items of an array key, without decoding them (a vocabulary of 49k strings)."""
        field = self._reader.fields.get(key)
        if field is None:
            raise GGUFError(f"{self.path}: metadata key {key} is missing")
        return len(field.data)

    # -- tensors ----------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def tensor_info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(Flare shape, Flare dtype) of a tensor, without touching its bytes."""
        t = self._get(name)
        dims = [int(d) for d in t.shape]          # ggml order: ne[0] first
        try:
            dtype = flare_dtype(t.tensor_type, name)
        except GGUFError as exc:
            raise GGUFError(f"{self.path}: {exc}") from None
        shape = tuple(reversed(dims))
        if dtype in QUANT_TYPES:
            shape = (*shape[:-1], shape[-1] // QUANT_TYPES[dtype].block_size)
        return shape, dtype

    def tensor(self, name: str) -> np.ndarray:
        """A tensor as a Flare weight: a view into the mapping (no copy), of the Flare shape."""
        t = self._get(name)
        shape, dtype = self.tensor_info(name)
        if dtype in QUANT_TYPES:
            return t.data.view(QUANT_TYPES[dtype].numpy).reshape(shape)
        return t.data.reshape(shape)

    def expect(self, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...] | None = None) -> tuple[int, ...]:
        """Check a tensor's Flare shape (and dtype) against what the metadata implies."""
        got, dtype = self.tensor_info(name)
        if got != tuple(shape):
            raise GGUFError(f"{self.path}: tensor {name} has shape {list(got)} (Flare order, blocks last), "
                            f"the metadata implies {list(shape)}")
        if dtypes is not None and dtype not in dtypes:
            raise GGUFError(f"{self.path}: tensor {name} is {dtype}; expected one of {', '.join(dtypes)}")
        return got

    def _get(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: tensor {name} is missing") from None

    def drop_pages(self) -> None:
        """Tell the kernel the mapped pages are not needed now (MADV_DONTNEED): once weights
        are on a device, the file's pages need not stay in this process's resident set. The
        mapping stays valid; a later read (expert staging) faults pages in again from the file."""
        import mmap

        raw = getattr(self._reader.data, "_mmap", None) if self._reader is not None else None
        if raw is not None and hasattr(raw, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            raw.madvise(mmap.MADV_DONTNEED)

    @property
    def file_bytes(self) -> int:
        return int(self._reader.data.shape[0])

    def close(self) -> None:
        """Drop this object's references to the mapping (views handed out keep it alive)."""
        self._tensors = {}
        self._reader = None  # type: ignore[assignment]


def flare_dtype(ggml_type: Any, tensor: str) -> str:
    """The Flare dtype of a ggml type: f32/f16 or a block type; GGUFError naming the tensor otherwise."""
    import gguf

    t = gguf.GGMLQuantizationType(int(ggml_type))
    if t == gguf.GGMLQuantizationType.F32:
        return "f32"
    if t == gguf.GGMLQuantizationType.F16:
        return "f16"
    q = quant_type_of_ggml(int(t))
    if q is None:
        supported = ", ".join(["F32", "F16", *(n.upper() for n in QUANT_TYPES)])
        raise GGUFError(f"tensor {tensor}: type {t.name} is not supported (supported: {supported})")
    return q.name
