"""SileroVad: the model prepared on a Flare session, in streaming or offline mode.

One `PreparedGraph` holds the two entry points of `graph.ENTRIES`; they share
weights, the LSTM state and the workspace. Each file starts from reset state,
so a request never sees the previous one.

Offline (the fast path for whole files): consecutive windows go through the
`offline` entry in pieces whose sizes are powers of two (at most `max_batch`),
so a handful of plans serve every file length and a short file after a long one
reuses the long one's memory; the LSTM state carries from piece to piece, and
zero windows pad only the last piece, after every real step. Streaming: one
`stream` execute per 512-sample chunk, with the 64-sample context and h/c kept
in state tensors.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from flare.core.errors import InputError

if TYPE_CHECKING:
    from flare.core.graph import Tensor
    from flare.core.session import Session
    from flare.core.workspace import GraphWorkspace

from .numpy_reference import CHUNK, WINDOW, windows
from .segments import Segment, VadParams, segments

Progress = Callable[[int, int], None]  # (chunks done, chunks total)

MIN_BATCH = 32
MODES = ("offline", "streaming")
ENTRY_OF_MODE = {"offline": "offline", "streaming": "stream"}  # graph.ENTRIES


def _bucket(n: int, max_batch: int) -> int:
    """Smallest power of two >= n (at least MIN_BATCH, at most max_batch)."""
    size = MIN_BATCH
    while size < n and size < max_batch:
        size *= 2
    return min(size, max_batch)


def _pieces(n: int, max_batch: int) -> list[int]:
    """Power-of-two batch sizes covering n <= max_batch windows with little padding.

    Rounding 563 windows up to 1024 wasted 45% of the frontend's work; the largest
    power of two below n plus the rest rounded up (563 -> 512 + 64) wastes 13 rows,
    and every size stays one of a few cached plans."""
    size = _bucket(n, max_batch)
    if size == n or size // 2 < MIN_BATCH:
        return [size]
    head = size // 2
    return [head, _bucket(n - head, max_batch)]


class SileroVad:
    """Silero VAD on a session. Use as a context manager or call `release()`."""

    def __init__(self, session: "Session", *, workspace: "GraphWorkspace | None" = None,
                 placement: "Callable[[Tensor, list[str]], str | None] | None" = None,
                 weights: Mapping[str, np.ndarray] | None = None, max_batch: int = 2048,
                 modes: Sequence[str] = MODES):
        """`modes`: the modes ("offline", "streaming") whose entry points are planned and
        compiled now; the other is prepared at its first use, with the same results. On a cold
        Vulkan start each entry's new pipelines are compiled at prepare, so `flare run` in one
        mode passes only that mode and compiles (and primes, in one batch) only what it runs."""
        if max_batch < MIN_BATCH:
            raise ValueError(f"max_batch must be >= {MIN_BATCH}")
        unknown = sorted(set(modes) - set(MODES))
        if unknown:
            raise ValueError(f"modes must be among {MODES}, not {unknown}")
        self.max_batch = int(max_batch)
        self.session = session
        # the runtime reads the registered ModelSpec (graph, placement, first shapes) to prepare it
        p = session.model_preparation("silero-vad", {"weights": weights}, placement=placement)
        now = {ENTRY_OF_MODE[m] for m in modes}
        self._later = {e: s for e, s in p.shapes.items() if e not in now}  # prepared at first use
        self.pg = session.prepare(p.entries, {e: s for e, s in p.shapes.items() if e in now}, workspace=workspace,
                                  placement=p.placement, name=p.name, callbacks=p.callbacks)

    def _ensure(self, entry: str) -> None:
        """Prepare `entry` at its first use when the constructor's `modes` left it out."""
        shapes = self._later.pop(entry, None)
        if shapes is not None:
            self.pg.prepare(entry, shapes)

    # -- lifecycle ----------------------------------------------------------------
    def reset(self) -> None:
        """Forget the previous audio (LSTM state and context); memory is kept."""
        self.pg.reset()

    def release(self) -> None:
        self.pg.release()

    def __enter__(self) -> "SileroVad":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # -- streaming -----------------------------------------------------------------
    def stream_chunk(self, chunk: np.ndarray) -> float:
        """Speech probability of the next 512 samples of the current stream."""
        chunk = np.asarray(chunk, dtype=np.float32).reshape(1, -1)
        if chunk.shape[1] != CHUNK:
            raise InputError(f"silero-vad streams {CHUNK}-sample chunks at 16 kHz, got {chunk.shape[1]} samples")
        self._ensure("stream")
        return float(self.pg.execute("stream", chunk=chunk)["prob"][0, 0])

    def probs_streaming(self, audio: np.ndarray, progress: Progress | None = None) -> np.ndarray:
        """Per-chunk probabilities of a whole file, fed chunk by chunk (last chunk zero padded)."""
        audio = _mono16k(audio)
        n = max(1, -(-audio.size // CHUNK))
        padded = np.zeros(n * CHUNK, np.float32)
        padded[:audio.size] = audio
        self._ensure("stream")
        self.reset()
        out = np.empty(n, np.float32)
        for i in range(n):
            out[i] = self.stream_chunk(padded[i * CHUNK:(i + 1) * CHUNK])
            if progress is not None and (i % 64 == 63 or i == n - 1):
                progress(i + 1, n)
        return out

    # -- offline -------------------------------------------------------------------
    def probs_offline(self, audio: np.ndarray, progress: Progress | None = None) -> np.ndarray:
        """Per-chunk probabilities of a whole file: batched frontend, the recurrence in one node."""
        win = windows(_mono16k(audio))
        n = len(win)
        self._ensure("offline")
        self.reset()
        probs = np.empty(n, np.float32)
        lo = 0
        while lo < n:
            for size in _pieces(min(self.max_batch, n - lo), self.max_batch):
                part = win[lo:lo + size]
                batch = part if len(part) == size else np.concatenate(
                    [part, np.zeros((size - len(part), WINDOW), np.float32)])  # only the file's last piece
                probs[lo:lo + len(part)] = self.pg.execute("offline", windows=batch)["probs"][:len(part), 0]
                lo += len(part)
                if progress is not None:
                    progress(lo, n)
        return probs

    # -- segments ------------------------------------------------------------------
    def speech_probs(self, audio: np.ndarray, mode: str = "offline", progress: Progress | None = None) -> np.ndarray:
        if mode == "offline":
            return self.probs_offline(audio, progress)
        if mode == "streaming":
            return self.probs_streaming(audio, progress)
        raise ValueError(f"mode must be 'offline' or 'streaming', not {mode!r}")

    def detect(self, audio: np.ndarray, mode: str = "offline", params: VadParams = VadParams(),
               progress: Progress | None = None) -> list[Segment]:
        """Speech segments of 16 kHz mono audio (silero's get_speech_timestamps rules)."""
        audio = _mono16k(audio)
        return segments(self.speech_probs(audio, mode, progress), audio.size, params)


def _mono16k(audio: np.ndarray) -> np.ndarray:
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 1:
        raise InputError(f"silero-vad takes mono 16 kHz audio as a 1-D array, got shape {audio.shape}")
    return audio


def split_placement(tensor: "Tensor", devices: list[str]) -> str | None:
    """Frontend (STFT + encoder + input projection) on the first device, the
    recurrence and head on the last: the placement test's split, and a sensible
    one when the first device is an accelerator (batched convs) and the last the
    CPU (a 128-wide recurrence is launch-bound)."""
    if len(devices) < 2:
        return None
    if tensor.name.startswith("frontend/"):
        return devices[0]
    # State writes (`state/...`) are left to the scheduler: they must run where the state lives.
    return devices[-1] if tensor.name.startswith(("lstm/", "head/")) else None
