"""Zeroing large CPU buffers by giving their pages back instead of writing them.

Why: a state buffer such as a language model's KV cache is zeroed when it is placed, and
writing zeros touches every page of it: SmolLM2's 513-position f32 cache (24 MB) became
resident at load although a short chat uses a few positions of it, and Flare's peak RSS was
~1.3x llama.cpp's (whose cache pages are touched only as they are used). For private
anonymous memory, which every CpuDevice buffer is (`np.empty`), `madvise(MADV_DONTNEED)`
is an exact way to zero: the kernel drops the pages, and the next access maps a fresh zero
page. Only whole pages inside the range are given back; the ragged edges are written.
Where madvise is unavailable (not Linux) or refuses, the range is written as before.
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np

MADV_DONTNEED = 4        # Linux
MIN_BYTES = 16 * 4096     # smaller ranges: writing zeros costs about what the system call does
PAGE = mmap.PAGESIZE

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def zero_fill(view: np.ndarray) -> None:
    """Set every element of `view` (a view into private anonymous memory) to zero."""
    if _madvise is None or view.nbytes < MIN_BYTES or not view.flags.c_contiguous:
        view.fill(0)
        return
    raw = view.reshape(-1).view(np.uint8)
    start = raw.ctypes.data
    first = (start + PAGE - 1) // PAGE * PAGE            # first whole page inside the range
    last = (start + raw.nbytes) // PAGE * PAGE           # end of the last whole page inside it
    if last <= first or _madvise(first, last - first, MADV_DONTNEED) != 0:
        view.fill(0)
        return
    raw[: first - start] = 0
    raw[last - start:] = 0
