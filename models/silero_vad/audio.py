"""Reading audio for speech models: WAV in, mono float32 at the model's rate out.

Why our own RIFF reader: the stdlib `wave` module reads integer PCM only, and
speech tools write 32-bit float WAVs as often as 16-bit ones. One small chunk
parser handles PCM (8/16/24/32-bit), IEEE float (32/64-bit) and
WAVE_FORMAT_EXTENSIBLE, with no dependency. `soundfile`, when installed, is
used only for files that are not RIFF/WAVE (FLAC, OGG, ...).

Why our own resampler: a polyphase windowed-sinc filter (Kaiser window, the
same design as `scipy.signal.resample_poly`) in NumPy, so Flare need not
depend on SciPy. It is exact for rational rate ratios, which all real rates are.

Every failure is an `AudioError` (an `InputError`) that names the file and says why.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flare.errors import InputError

__all__ = ["AudioError", "WavData", "read_wav", "load_audio", "to_mono", "resample", "MODEL_RATE"]

MODEL_RATE = 16000

_PCM = 0x0001
_FLOAT = 0x0003
_EXTENSIBLE = 0xFFFE
# The first two bytes of an EXTENSIBLE SubFormat GUID carry the format tag; the
# other 14 are this fixed suffix (KSDATAFORMAT_SUBTYPE_*).
_GUID_SUFFIX = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"


class AudioError(InputError):
    """An audio file cannot be read: names the file and the reason."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


@dataclass(frozen=True)
class WavData:
    """Decoded samples [frames, channels] in [-1, 1] float32, at `sample_rate`."""

    samples: np.ndarray
    sample_rate: int

    @property
    def channels(self) -> int:
        return int(self.samples.shape[1])

    @property
    def duration(self) -> float:
        return self.samples.shape[0] / self.sample_rate


def _chunks(path: Path, blob: bytes):
    """Yield (chunk id, payload offset, declared size) of a RIFF/WAVE file."""
    if len(blob) < 12:
        raise AudioError(path, f"file is {len(blob)} bytes, too short for a WAV header")
    riff, _, wave = struct.unpack("<4sI4s", blob[:12])
    if riff == b"RF64":
        raise AudioError(path, "RF64 (WAV over 4 GiB) is not supported")
    if riff != b"RIFF" or wave != b"WAVE":
        raise AudioError(path, f"not a RIFF/WAVE file (starts with {blob[:4]!r}, form {blob[8:12]!r})")
    pos = 12
    while pos + 8 <= len(blob):
        cid, size = struct.unpack("<4sI", blob[pos:pos + 8])
        yield cid, pos + 8, size
        pos += 8 + size + (size & 1)  # chunks are word aligned


def _parse_fmt(path: Path, fmt: bytes) -> tuple[int, int, int, int, int]:
    """-> (format tag, channels, rate, block align, bits per sample)."""
    if len(fmt) < 16:
        raise AudioError(path, f"fmt chunk is {len(fmt)} bytes, expected at least 16")
    tag, channels, rate, _, block_align, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == _EXTENSIBLE:
        if len(fmt) < 40:
            raise AudioError(path, "WAVE_FORMAT_EXTENSIBLE fmt chunk is shorter than 40 bytes")
        guid = fmt[24:40]
        if guid[2:] != _GUID_SUFFIX:
            raise AudioError(path, f"unsupported extensible sub-format {guid.hex()}")
        tag = struct.unpack("<H", guid[:2])[0]
        valid_bits = struct.unpack("<H", fmt[18:20])[0]
        if valid_bits and valid_bits != bits and tag == _FLOAT:
            raise AudioError(path, f"float samples with {valid_bits} valid bits of {bits} are not supported")
    if channels == 0:
        raise AudioError(path, "fmt chunk declares 0 channels")
    if rate == 0:
        raise AudioError(path, "fmt chunk declares a sample rate of 0 Hz")
    return tag, channels, rate, block_align, bits


def _decode(path: Path, data: bytes, tag: int, channels: int, bits: int) -> np.ndarray:
    """Raw sample bytes -> float32 [frames, channels] in [-1, 1]."""
    width = bits // 8
    if bits % 8:
        raise AudioError(path, f"{bits}-bit samples are not byte aligned; unsupported")
    frame = width * channels
    usable = len(data) - len(data) % frame
    raw = data[:usable]
    if tag == _PCM:
        if bits == 8:  # 8-bit WAV is unsigned
            x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
        elif bits == 16:
            x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
        elif bits == 24:
            b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
            v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
            v = np.where(v & 0x800000, v - (1 << 24), v)
            x = v.astype(np.float32) / float(1 << 23)
        elif bits == 32:
            x = (np.frombuffer(raw, "<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
        else:
            raise AudioError(path, f"{bits}-bit integer PCM is not supported (8, 16, 24, 32 are)")
    elif tag == _FLOAT:
        if bits == 32:
            x = np.frombuffer(raw, "<f4").astype(np.float32)
        elif bits == 64:
            x = np.frombuffer(raw, "<f8").astype(np.float32)
        else:
            raise AudioError(path, f"{bits}-bit float samples are not supported (32, 64 are)")
        if not np.all(np.isfinite(x)):
            raise AudioError(path, "float samples contain NaN or infinity")
    else:
        names = {0x0002: "MS ADPCM", 0x0006: "A-law", 0x0007: "mu-law", 0x0011: "IMA ADPCM", 0x0055: "MP3"}
        what = names.get(tag, f"format tag 0x{tag:04x}")
        raise AudioError(path, f"{what} WAV is not supported (integer PCM and IEEE float are)")
    return x.reshape(-1, channels)


def _unreadable(path: Path, exc: OSError) -> "AudioError":
    """The AudioError for a file the OS would not give us, saying why."""
    if isinstance(exc, FileNotFoundError):
        return AudioError(path, "no such file")
    if isinstance(exc, IsADirectoryError):
        return AudioError(path, "is a directory, not an audio file")
    return AudioError(path, f"cannot be read ({exc.strerror or exc})")


def read_wav(path: str | os.PathLike) -> WavData:
    """Decode a WAV file as it is: all channels, its own rate."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise _unreadable(path, exc) from None
    fmt = None
    data_span = None
    for cid, start, size in _chunks(path, blob):
        if cid == b"fmt ":
            fmt = _parse_fmt(path, blob[start:start + size])
        elif cid == b"data":
            available = len(blob) - start
            if size in (0, 0xFFFFFFFF) and available > 0:  # streamed writer that never patched the size
                size = available
            if size > available:
                raise AudioError(path, f"truncated: data chunk declares {size} bytes, file holds {available}")
            data_span = (start, size)
            break
    if fmt is None:
        raise AudioError(path, "no fmt chunk and no data chunk" if data_span is None else "no fmt chunk before the data")
    if data_span is None:
        raise AudioError(path, "no data chunk")
    tag, channels, rate, _, bits = fmt
    start, size = data_span
    samples = _decode(path, blob[start:start + size], tag, channels, bits)
    return WavData(np.ascontiguousarray(samples), int(rate))


def _read_other(path: Path) -> WavData:
    """Non-WAV containers through soundfile, when it is installed."""
    try:
        import soundfile
    except ImportError:
        raise AudioError(path, "not a RIFF/WAVE file, and soundfile is not installed to read other formats") from None
    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises its own error types
        raise AudioError(path, f"not a RIFF/WAVE file, nor another format soundfile reads ({exc})") from None
    return WavData(np.ascontiguousarray(data), int(rate))


def to_mono(samples: np.ndarray) -> np.ndarray:
    """[frames, channels] -> [frames] by averaging channels (what silero's reader does)."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 1:
        return samples
    if samples.shape[1] == 1:
        return np.ascontiguousarray(samples[:, 0])
    return samples.mean(axis=1, dtype=np.float64).astype(np.float32)


def _lowpass(up: int, down: int) -> np.ndarray:
    """Kaiser-windowed sinc for the upsampled rate; same design as resample_poly's
    default (half length 10 * max(up, down), beta 5.0), DC gain `up`."""
    max_rate = max(up, down)
    half = 10 * max_rate
    n = np.arange(-half, half + 1, dtype=np.float64)
    cutoff = 1.0 / max_rate  # fraction of the upsampled Nyquist
    h = cutoff * np.sinc(cutoff * n) * np.kaiser(2 * half + 1, 5.0)
    h *= up / h.sum()
    return h


def resample(x: np.ndarray, src_rate: int, dst_rate: int, block: int = 1 << 15) -> np.ndarray:
    """Polyphase windowed-sinc resampling of a 1-D signal from src_rate to dst_rate.

    Output sample n sits at input time n * src/dst; the length is
    ceil(len(x) * dst / src). Outputs are computed in blocks so memory stays
    bounded for long files.
    """
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if src_rate <= 0 or dst_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {src_rate} -> {dst_rate}")
    g = math.gcd(int(src_rate), int(dst_rate))
    up, down = int(dst_rate) // g, int(src_rate) // g
    if up == down or x.size == 0:
        return x.copy() if up == down else np.zeros(0, np.float32)
    h = _lowpass(up, down)
    taps = len(h)
    delay = (taps - 1) // 2
    n_out = -(-x.size * up // down)
    # Pad h to a multiple of `up` so every phase has the same number of taps.
    per_phase = -(-taps // up)
    h_pad = np.zeros(per_phase * up, np.float64)
    h_pad[:taps] = h
    phases = h_pad.reshape(per_phase, up).T  # phases[p, i] = h[p + i*up]
    # y[n] = sum_i phases[p, i] * x[k - i] with j = n*down + delay, p = j % up, k = j // up.
    # Since gcd(up, down) == 1, the outputs sharing phase p are n0, n0+up, n0+2up, ...
    # and their k advance by `down`: one strided window view and one mat-vec per phase.
    xp = np.concatenate([np.zeros(per_phase - 1), x.astype(np.float64), np.zeros(per_phase + delay // up + 1)])
    windows = np.lib.stride_tricks.sliding_window_view(xp, per_phase)  # windows[k] = x[k-per_phase+1 .. k]
    out = np.empty(n_out, np.float32)
    for n0 in range(min(up, n_out)):
        j0 = n0 * down + delay
        p, k0 = j0 % up, j0 // up
        count = len(range(n0, n_out, up))
        rows = windows[k0:k0 + count * down:down]
        taps_p = phases[p][::-1]
        dst = out[n0::up]
        for lo in range(0, count, block):  # bounded memory for long files
            dst[lo:lo + block] = rows[lo:lo + block] @ taps_p
    return out


def load_audio(path: str | os.PathLike, sample_rate: int = MODEL_RATE) -> np.ndarray:
    """Read an audio file as mono float32 at `sample_rate` (WAV natively, others via soundfile)."""
    path = Path(path)
    head = b""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise _unreadable(path, exc) from None
    wav = read_wav(path) if head in (b"RIFF", b"RF64") or len(head) < 4 else _read_other(path)
    mono = to_mono(wav.samples)
    if wav.sample_rate != sample_rate:
        mono = resample(mono, wav.sample_rate, sample_rate)
    return mono
