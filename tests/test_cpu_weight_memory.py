"""CPU host memory the way llama.cpp keeps it: read-only weights used where they lie, and
state buffers zeroed by giving their pages back.

A read-only weight (a view of a memory-mapped file, as GGUF weights are) is adopted by the CPU
device (Device.adopt): its buffer is the array's memory, no copy, so a model's weights are
resident once, as the file's pages, and only as they are read. A writable weight is still
copied (the caller may change its array afterwards). State buffers (a KV cache) are zeroed with
madvise(MADV_DONTNEED) (cpu/zeroing.py): the pages are dropped, not written, so a long cache
costs memory only for the positions used. These are resource assertions (bytes), not timings.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from flare.backends.cpu.zeroing import MIN_BYTES, zero_fill
from flare.core.ledger import LEDGER
from flare.core.session import Session

LINUX = os.path.exists("/proc/self/status")


def _rss_anon() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _graph(w: np.ndarray):
    def full(b, shapes):
        x = b.input("x", shapes["x"])
        b.output("y", b.add(x, b.weight("w", w)))
    return full


@pytest.mark.parametrize("writeable", [False, True])
def test_read_only_weights_are_used_in_place_and_writable_ones_copied(writeable):
    w = np.arange(4096, dtype=np.float32).reshape(64, 64)
    w.flags.writeable = writeable
    x = np.ones((64, 64), np.float32)
    before = LEDGER.snapshot()
    with Session(["cpu"]) as sess:
        pg = sess.prepare({"full": _graph(w)}, {"full": {"x": x.shape}}, name="adopt")
        np.testing.assert_array_equal(pg.execute("full", x=x)["y"], x + w)
        (buf,) = pg.persistent.weights.values()
        assert np.shares_memory(buf.handle, w) != writeable
        assert LEDGER.live_bytes("cpu:0") >= w.nbytes   # adopted bytes are in the ledger too
        pg.release()
        assert buf.released and buf.handle is None
    assert LEDGER.snapshot().live == before.live, "ledger not back to empty"


def test_zero_fill_gives_pages_back_and_keeps_the_edges():
    raw = np.empty(16 << 20, np.uint8)
    raw[:] = 7
    view = raw[3: 3 + (12 << 20) + 5].view(np.uint8)   # ragged at both ends
    before = _rss_anon() if LINUX else 0
    zero_fill(view)
    assert not view.any()
    assert raw[2] == 7 and raw[3 + (12 << 20) + 5] == 7, "zeroed outside the range"
    if LINUX:
        assert before - _rss_anon() >= 8 << 20, "the zeroed pages stayed resident"
    view[:] = 1                                          # the pages come back, writable, as zeros were
    assert view.all()


def test_zero_fill_of_small_and_strided_views_writes_zeros():
    a = np.full((64, 64), 3.0, np.float32)
    zero_fill(a[:, ::2])
    assert not a[:, ::2].any() and (a[:, 1::2] == 3.0).all()
    small = np.full(MIN_BYTES // 4 - 1, 5.0, np.float32)
    zero_fill(small)
    assert not small.any()
