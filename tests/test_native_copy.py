"""flare.core.native_copy: C copies on the calling thread and on a native copy thread.

The copies are checked byte for byte; the thread's life is checked through the process's own
thread list (/proc/self/task), so a thread left behind by close(), a finalizer or a failure
shows as a leak."""
from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

from flare.core import native_copy
from flare.core.native_copy import Copier, CopierError

pytestmark = pytest.mark.skipif(not native_copy.available(), reason=f"native copies: {native_copy.reason()}")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _pair(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8), np.zeros(n, np.uint8)


def _segments(dst: np.ndarray, src: np.ndarray, sizes: list[int]) -> list[tuple[int, int, int]]:
    out, at = [], 0
    for n in sizes:
        out.append((dst.ctypes.data + at, src.ctypes.data + at, n))
        at += n
    return out


def test_copy_here_copies_every_segment_exactly():
    src, dst = _pair(1 << 20)
    sizes = [1, 7, 4096, 100_003, 0, 393_216, 3]
    c = Copier()
    try:
        c.copy_here(_segments(dst, src, sizes))
        n = sum(sizes)
        assert np.array_equal(dst[:n], src[:n]) and not dst[n:].any()
        c.copy_here([])                                 # nothing to do
    finally:
        c.close()


def test_background_copies_finish_in_order_and_take_back_drops_only_unstarted_ones():
    src, dst = _pair(64 * 262_144, seed=1)
    c = Copier()
    try:
        segs = _segments(dst, src, [262_144] * 64)
        ticket = c.submit(segs)
        assert ticket == 64
        started = c.take_back()                         # whatever the thread had not begun is dropped
        c.wait(started)
        assert 0 <= started <= 64 and c.done() == started
        for i in range(64):                             # jobs below the ticket copied whole, the rest untouched
            part = dst[i * 262_144:(i + 1) * 262_144]
            if i < started:
                assert np.array_equal(part, src[i * 262_144:(i + 1) * 262_144]), i
            else:
                assert not part.any(), i
        t = c.submit(segs[started:])                    # the ring takes new jobs after a take-back
        c.wait(t)
        assert np.array_equal(dst, src)
    finally:
        c.close()


def test_a_spinning_copy_thread_copies_the_same_and_stops_on_close():
    before = _threads()
    src, dst = _pair(16 * 65_536, seed=5)
    c = Copier(spin_us=2000)                            # idle spin between jobs instead of sleeping
    for k in range(16):                                 # jobs arriving while it spins
        c.wait(c.submit(_segments(dst[k * 65_536:], src[k * 65_536:], [65_536])))
    assert np.array_equal(dst, src)
    c.close()                                           # stops a spinning thread too
    assert _threads() == before


def test_a_full_ring_queues_nothing():
    src, dst = _pair(4096, seed=2)
    c = Copier(capacity=4)
    try:
        assert c.submit(_segments(dst, src, [512] * 5)) == -1
        assert c.done() == 0 and not dst.any()
        c.wait(c.submit(_segments(dst, src, [1024] * 4)))
        assert np.array_equal(dst, src)
    finally:
        c.close()


def test_close_joins_the_thread_and_refuses_further_use():
    before = _threads()
    src, dst = _pair(8 << 20, seed=3)
    for _ in range(20):                                 # many copiers, each closed with copies queued
        c = Copier()
        c.submit(_segments(dst, src, [1 << 20] * 8))
        c.close()
        c.close()                                       # idempotent
        assert c.closed
    assert _threads() == before
    with pytest.raises(CopierError, match="closed"):
        c.submit([(dst.ctypes.data, src.ctypes.data, 1)])
    with pytest.raises(CopierError, match="closed"):
        c.copy_here([(dst.ctypes.data, src.ctypes.data, 1)])


def test_a_copier_dropped_without_close_stops_its_thread():
    before = _threads()
    src, dst = _pair(1 << 20, seed=4)
    c = Copier()
    c.wait(c.submit(_segments(dst, src, [1 << 20])))
    assert _threads() == before + 1
    del c
    gc.collect()
    assert _threads() == before


def test_flare_native_copy_0_turns_it_off():
    code = "from flare.core import native_copy as n; print(n.available(), n.reason())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FLARE_NATIVE_COPY": "0"},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "False off (FLARE_NATIVE_COPY=0)"
