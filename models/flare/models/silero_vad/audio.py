"""Reading audio for speech models: any file libsndfile reads in, mono float32 at the model's rate out.

Why libraries: decoding is `soundfile` (libsndfile: WAV in every PCM/float/
extensible/A-law/mu-law/ADPCM flavour, FLAC, OGG/Vorbis, Opus, AIFF, ...) and
resampling is `soxr` (libsoxr, high quality); both are well kept and fuzzed far
harder than a hand-written RIFF parser or polyphase filter could be.

What this module adds is the boundary: every failure is an `AudioError` (an
`InputError`) naming the file and the reason, and nothing a header claims can
make us allocate or work without bound —
- the header's channels and sample rate must lie within `MAX_CHANNELS` and
  [`MIN_RATE`, `MAX_RATE`] (a 0-bit, 1 Hz or 4 GHz header is refused before
  any sample is read);
- samples are read in blocks of `BLOCK_FRAMES`, mixed down and resampled as
  they come (soxr's stream API), so memory is the output plus one block, never
  the header's claim; a file longer than `max_seconds` is refused while reading;
- a data chunk that claims more than the file holds is read up to the end of
  the file (libsndfile's behaviour): frames are bounded by the file, not the
  header;
- NaN or infinite float samples are refused.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flare.core.errors import InputError

__all__ = ["AudioError", "WavData", "read_wav", "load_audio", "to_mono", "resample", "MODEL_RATE",
           "MAX_CHANNELS", "MIN_RATE", "MAX_RATE", "MAX_SECONDS"]

MODEL_RATE = 16000
MAX_CHANNELS = 64            # more is not a microphone recording
MIN_RATE, MAX_RATE = 1000, 768_000  # Hz: telephone-grade below, studio masters above
MAX_SECONDS = 4 * 3600.0     # default bound on a file's duration (16 kHz mono output: 0.9 GB)
BLOCK_FRAMES = 1 << 16


class AudioError(InputError):
    """An audio file cannot be read: names the file and the reason."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


@dataclass(frozen=True)
class WavData:
    """Decoded samples [frames, channels] float32 (in [-1, 1] for integer formats), at `sample_rate`."""

    samples: np.ndarray
    sample_rate: int

    @property
    def channels(self) -> int:
        return int(self.samples.shape[1])

    @property
    def duration(self) -> float:
        return self.samples.shape[0] / self.sample_rate


def _soundfile():
    try:
        import soundfile
    except (ImportError, OSError) as exc:  # OSError: the wheel's libsndfile failed to load
        raise InputError(f"reading audio needs soundfile (pip install 'flare-runtime[models]'): {exc}") from None
    return soundfile


def _unreadable(path: Path, exc: OSError) -> AudioError:
    """The AudioError for a file the OS would not give us, saying why."""
    if isinstance(exc, FileNotFoundError):
        return AudioError(path, "no such file")
    if isinstance(exc, IsADirectoryError):
        return AudioError(path, "is a directory, not an audio file")
    return AudioError(path, f"cannot be read ({exc.strerror or exc})")


def _open(path: Path):
    """Open with libsndfile after checking it is a regular file (a FIFO would block, /dev/zero never end)."""
    sf = _soundfile()
    try:
        st = path.stat()
    except OSError as exc:
        raise _unreadable(path, exc) from None
    import stat

    if stat.S_ISDIR(st.st_mode):
        raise AudioError(path, "is a directory, not an audio file")
    if not stat.S_ISREG(st.st_mode):
        raise AudioError(path, "is not a regular file (a device, FIFO or socket)")
    if st.st_size == 0:
        raise AudioError(path, "file is empty")
    try:
        f = sf.SoundFile(str(path))
    except sf.LibsndfileError as exc:
        raise AudioError(path, f"not an audio file libsndfile can read ({_clean(exc, path)})") from None
    except (RuntimeError, TypeError, ValueError, OSError) as exc:
        raise AudioError(path, f"not an audio file libsndfile can read ({type(exc).__name__}: {exc})") from None
    try:
        _check_header(path, f.channels, f.samplerate)
    except BaseException:
        f.close()
        raise
    return f


def _clean(exc: Exception, path: Path) -> str:
    """libsndfile's message without the path it repeats (the AudioError names the file)."""
    text = " ".join(str(exc).split()).replace("Error opening ", "")
    text = text.replace(f"{str(path)!r}: ", "").replace(f"'{path}': ", "")
    return text.strip() or type(exc).__name__


def _check_header(path: Path, channels: int, rate: int) -> None:
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioError(path, f"header declares {channels} channels; 1 to {MAX_CHANNELS} are accepted")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise AudioError(path, f"header declares a sample rate of {rate} Hz; {MIN_RATE} to {MAX_RATE} Hz are accepted")


def _blocks(path: Path, f, max_seconds: float):
    """Yield float32 [frames, channels] blocks, refusing non-finite samples and over-long files."""
    limit = int(max_seconds * f.samplerate)
    seen = 0
    sf = _soundfile()
    try:
        while True:
            block = f.read(BLOCK_FRAMES, dtype="float32", always_2d=True)
            if not len(block):
                return
            seen += len(block)
            if seen > limit:
                raise AudioError(path, f"longer than {max_seconds:g} s; refused (max_seconds)")
            if not np.isfinite(block).all():
                raise AudioError(path, "samples contain NaN or infinity")
            yield block
    except sf.LibsndfileError as exc:
        raise AudioError(path, f"cannot be decoded ({_clean(exc, path)})") from None
    except (RuntimeError, ValueError) as exc:
        raise AudioError(path, f"cannot be decoded ({type(exc).__name__}: {exc})") from None


def read_wav(path: str | os.PathLike, *, max_seconds: float = MAX_SECONDS) -> WavData:
    """Decode an audio file as it is: all channels, its own rate (any format libsndfile reads)."""
    path = Path(path)
    with _open(path) as f:
        rate, channels = int(f.samplerate), int(f.channels)
        blocks = list(_blocks(path, f, max_seconds))
    samples = np.concatenate(blocks) if blocks else np.zeros((0, channels), np.float32)
    return WavData(np.ascontiguousarray(samples), rate)


def to_mono(samples: np.ndarray) -> np.ndarray:
    """[frames, channels] -> [frames] by averaging channels (what silero's reader does)."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 1:
        return samples
    if samples.shape[1] == 1:
        return np.ascontiguousarray(samples[:, 0])
    return samples.mean(axis=1, dtype=np.float64).astype(np.float32)


def _soxr():
    try:
        import soxr
    except ImportError as exc:
        raise InputError(f"resampling audio needs soxr (pip install 'flare-runtime[models]'): {exc}") from None
    return soxr


def resample(x: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Resample a 1-D signal from src_rate to dst_rate with libsoxr (high quality, linear phase)."""
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(-1))
    if not (0 < src_rate <= MAX_RATE and 0 < dst_rate <= MAX_RATE):
        raise InputError(f"sample rates must be in 1..{MAX_RATE} Hz, got {src_rate} -> {dst_rate}")
    if src_rate == dst_rate:
        return x.copy()
    return np.asarray(_soxr().resample(x, src_rate, dst_rate, quality="HQ"), dtype=np.float32)


def load_audio(path: str | os.PathLike, sample_rate: int = MODEL_RATE, *,
               max_seconds: float = MAX_SECONDS) -> np.ndarray:
    """Read an audio file as mono float32 at `sample_rate`, block by block (bounded memory)."""
    path = Path(path)
    with _open(path) as f:
        rate = int(f.samplerate)
        if rate == sample_rate:
            parts = [to_mono(b) for b in _blocks(path, f, max_seconds)]
        else:
            stream = _soxr().ResampleStream(rate, sample_rate, 1, dtype="float32", quality="HQ")
            parts = [stream.resample_chunk(to_mono(b)) for b in _blocks(path, f, max_seconds)]
            parts.append(stream.resample_chunk(np.zeros(0, np.float32), last=True))
    return np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)
