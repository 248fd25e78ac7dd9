"""Files of a core directory: checksums, paths that stay inside, safetensors headers, atomic writes.

Why a module of its own: everything the loader trusts about bytes on disk
goes through here, so the rules (no path escapes the core directory, every
file is checksummed, headers are parsed as JSON and bounds-checked, nothing
is ever unpickled) live in one place. Writers build a core in a temporary
sibling directory and rename it into place, so a failure never leaves a
half-written core behind.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import struct
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

from flare.core.errors import CoreFormatError, FlareError

CHUNK = 1 << 20


class CoreExistsError(FlareError, FileExistsError):
    """The export target exists and replacing it was not asked for."""

    exit_code = 2  # bad usage (flare.core.errors.USAGE)


MAX_HEADER = 100 << 20  # a safetensors header larger than this is not a header
ST_DTYPES = {"F32": "f32", "F16": "f16", "I32": "i32", "I64": "i64"}
# safetensors has no block-quantized dtypes: such a weight is stored as U8 [..., blocks * block bytes]
# and this `__metadata__` entry (JSON {tensor: Flare block dtype}) says what its bytes are
BLOCK_DTYPES_KEY = "flare_block_dtypes"


def block_dtypes_metadata(dtypes: dict[str, str]) -> dict[str, str]:
    """The safetensors `__metadata__` that marks these U8 tensors as Flare block dtypes."""
    return {BLOCK_DTYPES_KEY: json.dumps(dict(sorted(dtypes.items())))}


def _block_dtypes(meta: Any, field: str) -> dict[str, str]:
    from flare.core.dtypes import QUANT_TYPES

    if meta is None or BLOCK_DTYPES_KEY not in (meta if isinstance(meta, dict) else {}):
        return {}
    f = f"{field}[__metadata__][{BLOCK_DTYPES_KEY!r}]"
    try:
        blocks = json.loads(meta[BLOCK_DTYPES_KEY])
    except (TypeError, ValueError, RecursionError) as exc:
        raise CoreFormatError(f"not JSON: {exc}", f) from None
    if not isinstance(blocks, dict) or not all(isinstance(v, str) and v in QUANT_TYPES for v in blocks.values()):
        raise CoreFormatError(f"must map tensor names to block dtypes ({', '.join(QUANT_TYPES)})", f)
    return blocks


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in chunks (weights can be large)."""
    h = hashlib.sha256()
    with open_regular(Path(path), str(path)) as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def inside(root: Path, rel: Any, field: str) -> Path:
    """`root / rel` after checking `rel` is a relative POSIX path that stays inside `root`
    (no absolute paths, no `..`, no symlink leading out). Raises CoreFormatError naming `field`."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        raise CoreFormatError(f"must be a relative path string, got {rel!r}", field)
    pure = PurePosixPath(rel)
    if pure.is_absolute() or any(part in ("..", "") for part in pure.parts) or rel != str(pure):
        raise CoreFormatError(f"path {rel!r} must be relative, normalised and stay inside the core directory", field)
    path = root / pure
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise CoreFormatError(f"path {rel!r} leads outside the core directory (symlink?)", field)
    return path


def open_regular(path: Path, field: str):
    """Open `path` for reading only if it is a regular file (checked on the open descriptor, so a
    symlink to /dev/zero or a FIFO swapped in is refused, and opening a FIFO never blocks)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CoreFormatError(f"file {path.name!r} is missing", field) from None
    except OSError as exc:
        raise CoreFormatError(f"cannot open {path.name!r}: {exc.strerror or exc}", field) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CoreFormatError(f"{path.name!r} is not a regular file (a device, FIFO, socket or directory)", field)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_json(path: Path, field: str, limit: int = 64 << 20) -> Any:
    """Parse a JSON file (regular files only, at most `limit` bytes read); any failure is a
    CoreFormatError naming `field`."""
    try:
        with open_regular(path, field) as fh:
            data = fh.read(limit + 1)
        if len(data) > limit:
            raise CoreFormatError(f"{path.name} is more than the {limit}-byte limit", field)
        return json.loads(data.decode("utf-8"))
    except CoreFormatError:
        raise
    except FileNotFoundError:
        raise CoreFormatError(f"file {path.name!r} is missing", field) from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CoreFormatError(f"cannot read {path.name!r} as JSON: {type(exc).__name__}: {exc}", field) from None


def safetensors_header(path: Path, field: str) -> dict[str, dict[str, Any]]:
    """name -> {dtype (flare name), shape, offset (absolute), nbytes} of a safetensors file, bounds-checked
    against the file size. Parses the JSON header only; no tensor data is read."""
    try:
        with open_regular(path, field) as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) < 8:
                raise CoreFormatError(f"{size} bytes is too short for a safetensors header", field)
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CoreFormatError(f"header claims {n} bytes, file has {size}", field)
            header = json.loads(fh.read(n).decode("utf-8"))
    except CoreFormatError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CoreFormatError(f"unreadable safetensors header: {type(exc).__name__}: {exc}", field) from None
    if not isinstance(header, dict):
        raise CoreFormatError("safetensors header is not a JSON object", field)
    data_size = size - 8 - n
    blocks = _block_dtypes(header.get("__metadata__"), field)
    missing = sorted(set(blocks) - set(header))
    if missing:
        raise CoreFormatError(f"lists block dtypes of tensors the file lacks: {missing[:3]}",
                              f"{field}[__metadata__]")
    out: dict[str, dict[str, Any]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        f = f"{field}[{name!r}]"
        if not isinstance(info, dict):
            raise CoreFormatError("must be an object", f)
        dtype = ST_DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
        if name in blocks:
            if info.get("dtype") != "U8":
                raise CoreFormatError(f"is {blocks[name]} by __metadata__ but stored as {info.get('dtype')!r}, not U8", f)
            dtype = blocks[name]
        shape = info.get("shape")
        offsets = info.get("data_offsets")
        if dtype is None:
            raise CoreFormatError(f"dtype {info.get('dtype')!r} is not one of {sorted(ST_DTYPES)}", f)
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise CoreFormatError("shape must be a list of non-negative integers", f)
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise CoreFormatError("data_offsets must be two integers", f)
        begin, end = offsets
        itemsize = {"f32": 4, "f16": 2, "i32": 4, "i64": 8}.get(dtype, 1)   # a block dtype: U8 bytes
        if name in blocks:
            from flare.core.dtypes import itemsize as block_bytes

            if not shape or shape[-1] % block_bytes(dtype):
                raise CoreFormatError(f"U8 shape {shape} is not whole {dtype} blocks of {block_bytes(dtype)} bytes", f)
        count = 1
        for d in shape:
            count *= d
        if not 0 <= begin <= end <= data_size or end - begin != count * itemsize:
            raise CoreFormatError(f"data_offsets {offsets} do not hold {shape} {dtype} inside {data_size} data bytes", f)
        if name in blocks:   # the Flare shape counts blocks
            from flare.core.dtypes import itemsize as block_bytes

            shape = [*shape[:-1], shape[-1] // block_bytes(dtype)]
        out[name] = {"dtype": dtype, "shape": tuple(shape), "offset": 8 + n + begin, "nbytes": end - begin}
    return out


def tree_digest(root: str | os.PathLike) -> str:
    """One sha256 over every file's relative path, mode and bytes (tests: 'nothing changed')."""
    h = hashlib.sha256()
    root = Path(root)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            st = p.lstat()
            h.update(f"{p.relative_to(root)}\0{st.st_mode}\0{st.st_size}\0".encode())
            if p.is_file() and not p.is_symlink():
                h.update(sha256_file(p).encode())
    return h.hexdigest()


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success rename it to `target`.

    On any exception the temporary directory is removed and `target` is left as it was.
    With `overwrite`, an existing target is moved aside first and removed only after the
    new one is in place, so at every moment `target` is either the old or the new core.
    """
    target = Path(target)
    parent = target.parent if str(target.parent) else Path(".")
    if target.exists() and not overwrite:
        raise CoreExistsError(f"{target} exists (use --force to replace it)")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    try:
        yield tmp
        _publishable(tmp)
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=parent))
            os.rename(target, old / "core")
        try:
            os.rename(tmp, target)
        except BaseException:
            if old is not None:
                os.rename(old / "core", target)  # put the previous core back
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _publishable(root: Path) -> None:
    """mkdtemp makes a private (0700) directory and some writers private files: give the core
    the permissions an ordinary directory and files would have under the user's umask."""
    mask = _umask()
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~mask)


def write_json(path: Path, data: Any) -> None:
    """Canonical JSON (sorted keys) so equal content gives equal checksums."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True, allow_nan=False)
        fh.write("\n")
