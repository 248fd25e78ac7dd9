"""flare.models.silero_vad.audio: WAV decoding (PCM, float, extensible), downmix, resampling, typed errors."""
from __future__ import annotations

import math
import struct
import wave
from pathlib import Path

import numpy as np
import pytest

from flare.models.silero_vad.audio import AudioError, load_audio, read_wav, resample, to_mono
from flare.core.errors import InputError


def riff(fmt: bytes, data: bytes, *, data_size: int | None = None, extra: bytes = b"") -> bytes:
    """A RIFF/WAVE file from raw chunk payloads (lets tests write what `wave` cannot)."""
    size = len(data) if data_size is None else data_size
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + extra
    body += b"data" + struct.pack("<I", size) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def fmt_chunk(tag: int, channels: int, rate: int, bits: int) -> bytes:
    align = channels * bits // 8
    return struct.pack("<HHIIHH", tag, channels, rate, rate * align, align, bits)


def extensible_fmt(sub_tag: int, channels: int, rate: int, bits: int) -> bytes:
    guid = struct.pack("<H", sub_tag) + b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    return fmt_chunk(0xFFFE, channels, rate, bits) + struct.pack("<HHI", 22, bits, 0) + guid


def tone(rate: int, seconds: float, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def write_pcm16(path: Path, samples: np.ndarray, rate: int) -> None:
    samples = samples.reshape(len(samples), -1)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(samples.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.round(samples * 32767).astype("<i2").tobytes())


def test_pcm16_mono_roundtrip(tmp_path):
    x = tone(16000, 0.25)
    write_pcm16(tmp_path / "a.wav", x, 16000)
    wav = read_wav(tmp_path / "a.wav")
    assert wav.sample_rate == 16000 and wav.channels == 1
    np.testing.assert_allclose(wav.samples[:, 0], x, atol=1 / 32768 + 1e-6)
    np.testing.assert_allclose(load_audio(tmp_path / "a.wav"), x, atol=1 / 32768 + 1e-6)


def test_stereo_is_downmixed_by_mean(tmp_path):
    left, right = tone(16000, 0.1, 300), tone(16000, 0.1, 700, amp=0.25)
    write_pcm16(tmp_path / "s.wav", np.stack([left, right], 1), 16000)
    assert read_wav(tmp_path / "s.wav").channels == 2
    np.testing.assert_allclose(load_audio(tmp_path / "s.wav"), (left + right) / 2, atol=2e-4)


@pytest.mark.parametrize("extensible", [False, True])
def test_float32_wav(tmp_path, extensible):
    x = tone(16000, 0.1) * 1.5  # floats may exceed 1: kept as is
    fmt = extensible_fmt(3, 1, 16000, 32) if extensible else fmt_chunk(3, 1, 16000, 32)
    (tmp_path / "f.wav").write_bytes(riff(fmt, x.astype("<f4").tobytes()))
    np.testing.assert_array_equal(load_audio(tmp_path / "f.wav"), x)


def test_pcm24_and_pcm8_and_float64(tmp_path):
    x = tone(16000, 0.05)
    v = np.round(x * (2 ** 23 - 1)).astype(np.int32)
    b24 = np.stack([v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF], 1).astype(np.uint8).tobytes()
    (tmp_path / "24.wav").write_bytes(riff(fmt_chunk(1, 1, 16000, 24), b24))
    np.testing.assert_allclose(load_audio(tmp_path / "24.wav"), x, atol=1e-6)
    odd = x[:799]
    u8 = np.round(odd * 127 + 128).astype(np.uint8).tobytes()
    (tmp_path / "8.wav").write_bytes(riff(fmt_chunk(1, 1, 16000, 8), u8 + b"\x00", data_size=len(u8)))  # + pad byte
    np.testing.assert_allclose(load_audio(tmp_path / "8.wav"), odd, atol=1 / 127)
    (tmp_path / "64.wav").write_bytes(riff(fmt_chunk(3, 1, 16000, 64), x.astype("<f8").tobytes()))
    np.testing.assert_array_equal(load_audio(tmp_path / "64.wav"), x)


def test_unknown_chunks_are_skipped(tmp_path):
    x = tone(16000, 0.05)
    extra = b"LIST" + struct.pack("<I", 5) + b"abcde" + b"\x00"  # odd-sized chunk + pad byte
    (tmp_path / "l.wav").write_bytes(riff(fmt_chunk(3, 1, 16000, 32), x.tobytes(), extra=extra))
    np.testing.assert_array_equal(load_audio(tmp_path / "l.wav"), x)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resampled_to_16k_keeps_a_tone(tmp_path, rate):
    x = tone(rate, 1.0, freq=1000.0)
    write_pcm16(tmp_path / "r.wav", x, rate)
    y = load_audio(tmp_path / "r.wav")
    assert len(y) == math.ceil(len(x) * 16000 / rate)
    expected = tone(16000, 1.0, freq=1000.0)[: len(y)]
    middle = slice(800, len(y) - 800)  # away from the filter's edge transients
    np.testing.assert_allclose(y[middle], expected[middle], atol=2e-3)


def test_resample_keeps_length_and_level():
    x = tone(44100, 0.5, freq=440.0)
    y = resample(x, 44100, 16000)
    assert abs(len(y) - len(x) * 16000 / 44100) <= 1
    rms = np.sqrt(np.mean(y[800:-800] ** 2))
    assert rms == pytest.approx(0.5 / math.sqrt(2), rel=1e-3)


def test_resample_removes_content_above_the_new_nyquist():
    x = tone(48000, 1.0, freq=12000.0)  # above 8 kHz: must not alias into the 16 kHz output
    y = resample(x, 48000, 16000)
    assert np.sqrt(np.mean(y[1000:-1000] ** 2)) < 1e-3


def test_to_mono_shapes():
    assert to_mono(np.ones(5, np.float32)).shape == (5,)
    assert to_mono(np.ones((5, 1), np.float32)).shape == (5,)
    np.testing.assert_array_equal(to_mono(np.array([[1.0, 0.0], [0.5, 0.5]], np.float32)), [0.5, 0.5])


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", "file is empty"),
        (b"hello, this is not audio at all", "Format not recognised"),
        (riff(fmt_chunk(1, 0, 16000, 16), b"\x00" * 10), "Channel count is zero"),
        (riff(fmt_chunk(1, 1, 16000, 0), b"\x00" * 100), "unimplemented format"),     # bits_per_sample = 0
        (riff(fmt_chunk(1, 1, 1, 16), b"\x00" * 65536), "sample rate of 1 Hz"),         # would run for hours
        (riff(struct.pack("<HHIIHH", 1, 1, 4_000_000_000, 0, 2, 16), b"\x00" * 64), "readable"),  # 4 GHz
        (riff(fmt_chunk(1, 100, 16000, 16), b"\x00" * 200), "100 channels"),
        (b"RIFF" + struct.pack("<I", 4) + b"WAVE", "No 'data' chunk"),
        (riff(fmt_chunk(3, 1, 16000, 32), np.array([np.nan], "<f4").tobytes()), "NaN"),
    ],
)
def test_unreadable_files_raise_typed_errors_naming_file_and_reason(tmp_path, content, reason):
    path = tmp_path / "bad.wav"
    path.write_bytes(content)
    with pytest.raises(AudioError) as info:
        load_audio(path)
    assert isinstance(info.value, InputError)
    assert str(path) in str(info.value) and reason in str(info.value), str(info.value)
    assert str(info.value).count(str(path)) == 1


def test_other_formats_libsndfile_reads(tmp_path):
    x = tone(8000, 0.05)
    mu = np.round(np.sign(x) * np.log1p(255 * np.abs(x)) / np.log1p(255) * 127).astype(np.int8)
    (tmp_path / "mu.wav").write_bytes(riff(fmt_chunk(7, 1, 8000, 8), (~(mu.view(np.uint8))).tobytes()))
    assert load_audio(tmp_path / "mu.wav").shape == (800,)  # mu-law WAV, resampled 8 -> 16 kHz
    import soundfile

    soundfile.write(tmp_path / "t.flac", x, 8000)
    y = load_audio(tmp_path / "t.flac", 8000)
    np.testing.assert_allclose(y, x, atol=1 / 32768 + 1e-6)


def test_truncated_data_is_read_up_to_the_end_of_the_file(tmp_path):
    (tmp_path / "t.wav").write_bytes(riff(fmt_chunk(1, 1, 16000, 16), b"\x00" * 10, data_size=1 << 30))
    assert load_audio(tmp_path / "t.wav").shape == (5,)   # frames bounded by the file, not the header


def test_duration_bound(tmp_path):
    write_pcm16(tmp_path / "long.wav", tone(16000, 2.0), 16000)
    with pytest.raises(AudioError, match="longer than 1 s"):
        load_audio(tmp_path / "long.wav", max_seconds=1.0)


def test_special_files_are_refused_before_reading(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo.wav")       # reading would block forever
    with pytest.raises(AudioError, match="not a regular file"):
        load_audio(tmp_path / "fifo.wav")
    (tmp_path / "zero.wav").symlink_to("/dev/zero")   # reading would never end
    with pytest.raises(AudioError, match="not a regular file"):
        load_audio(tmp_path / "zero.wav")


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(AudioError, match="no such file"):
        load_audio(tmp_path / "missing.wav")
    with pytest.raises(AudioError, match="directory"):
        load_audio(tmp_path)
