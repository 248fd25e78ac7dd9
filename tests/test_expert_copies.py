"""How expert staging copies bytes: block-quantized rows written as bytes (state_rows), on every backend.

Expert caches of a GGUF file hold block-quantized rows (Q4_0 ...), which NumPy sees as a
structured dtype; a CPU device writes them as the byte copy they are. The bytes must be the
same whichever way a backend writes them."""
from __future__ import annotations

import numpy as np
import pytest

from flare.core.dtypes import to_numpy
from flare.core.errors import InputError


def _q4_cache_entry(b, shapes):
    table = b.cache("experts", (4, 2, 3), "q4_0")     # 4 slots of [2, 3] blocks
    x = b.input("x", shapes["x"])
    b.output("out", b.add(x, x))


def _blocks(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(count, 2, 3, to_numpy("q4_0").itemsize), dtype=np.uint8)
    raw[..., 1] &= 0x3B                                  # finite f16 scales (no NaN payloads to compare)
    return raw.view(to_numpy("q4_0")).reshape(count, 2, 3)


def test_quantized_cache_rows_are_written_as_their_bytes(backend):
    sess = backend.fallback_session()
    g = sess.prepare({"main": _q4_cache_entry}, {"main": {"x": (3,)}}, name="q4rows")
    try:
        want = np.zeros((4, 2, 3), to_numpy("q4_0"))
        a, b = _blocks(2, 0), _blocks(4, 1)[::2]          # contiguous rows, then strided rows
        g.write_rows("experts", 1, a)
        want[1:3] = a
        g.write_rows("experts", 3, b[:1])
        want[3:4] = b[:1]
        got = g.state("experts")
        assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()
        with pytest.raises(InputError, match="does not fit"):
            g.write_rows("experts", 3, a)
        assert g.state("experts").view(np.uint8).tobytes() == want.view(np.uint8).tobytes()   # nothing half-written
    finally:
        g.release()
        sess.close()
