"""Fuzzing the input boundaries with hypothesis (bounded examples, small inputs).

- WAV headers and bodies: `load_audio` returns samples or raises AudioError —
  nothing else — with memory bounded by the file, not the header;
- request files (arbitrary bytes): `read_requests` returns requests or raises
  RequestError;
- every op parameter and tensor field of an exported core's graphs (checksums
  re-written so the loader's deeper checks are reached): loading and serving a
  request raise only typed errors (a CoreFormatError at load for what the op
  registry's parameter schema refuses), and the core's files never change.

Hangs are caught by hypothesis' deadline (generous: a guard, not a speed test).
`tests/test_export_invalid.py` fuzzes manifest and catalog fields.
"""
from __future__ import annotations

import io
import json
import math
import shutil
import struct
import tracemalloc
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flare.core.errors import FlareError
from flare.models.silero_vad.audio import AudioError, load_audio
from flare.plugins.export import export_core
from flare.plugins.export.files import sha256_file, tree_digest
from flare.plugins.export.serving.requests import RequestError, read_requests
from flare.plugins.export.testing import ToyLM

GUARD = timedelta(seconds=30)  # a hang guard, not a timing assertion
FAST = settings(max_examples=60, deadline=GUARD, suppress_health_check=[HealthCheck.function_scoped_fixture])
MEMORY_BOUND = 64 << 20


def _riff(tag: int, channels: int, rate: int, byte_rate: int, align: int, bits: int, data: bytes,
          data_size: int, extra_fmt: bytes) -> bytes:
    fmt = struct.pack("<HHIIHH", tag, channels, rate, byte_rate, align, bits) + extra_fmt
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", data_size) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
wav_headers = st.builds(
    _riff,
    tag=st.sampled_from([0, 1, 2, 3, 6, 7, 0x11, 0x55, 0xFFFE]) | u16,
    channels=st.sampled_from([0, 1, 2, 8, 65, 0xFFFF]) | u16,
    rate=st.sampled_from([0, 1, 8000, 16000, 44100, 768_000, 768_001, 0xFFFFFFFF]) | u32,
    byte_rate=u32, align=u16,
    bits=st.sampled_from([0, 1, 8, 12, 16, 24, 32, 64, 0xFFFF]) | u16,
    data=st.binary(max_size=4096),
    data_size=st.sampled_from([0, 1, 4096, 0xFFFFFFFF]) | u32,
    extra_fmt=st.sampled_from([b"", b"\x00\x00", struct.pack("<HHI", 22, 16, 0) + b"\x01\x00" + bytes(14)]) | st.binary(max_size=40),
)


@FAST
@given(blob=wav_headers | st.binary(max_size=512))
def test_fuzz_wav_headers_and_bodies(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "fuzz.wav"
    path.write_bytes(blob)
    tracemalloc.start()
    try:
        out = load_audio(path)
    except AudioError as exc:
        assert str(path) in str(exc)
        out = None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < MEMORY_BOUND, f"{peak} bytes traced for a {len(blob)}-byte file"
    if out is not None:
        assert out.dtype == np.float32 and out.ndim == 1 and np.isfinite(out).all()
        assert out.size <= 16000 * (len(blob) + 1)   # at most one output sample per input byte at 1 kHz


@FAST
@given(lines=st.lists(st.binary(max_size=200) | st.sampled_from([
    b'{"prompt": "hi"}', b'{"prompt_ids": [256, 1]}', b'{"prompt": "\\udc80"}', b'{"prompt_ids": [-1]}',
    b'{"max_new_tokens": 1e400, "prompt": "x"}', b'{"arrival": NaN, "prompt": "x"}', b'[]', b'\xff\xfe']),
    max_size=8))
def test_fuzz_request_files(lines: list[bytes]) -> None:
    try:
        reqs = read_requests(io.BytesIO(b"\n".join(lines)))
    except RequestError as exc:
        assert str(exc)
        return
    for r in reqs:
        assert r.prompt and all(0 <= t <= 256 for t in r.prompt) and r.max_new_tokens >= 1
        assert math.isfinite(r.arrival)


# -- core graphs ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def toy_core(tmp_path_factory) -> Path:
    return export_core(ToyLM(), tmp_path_factory.mktemp("toy") / "toy.core", progress=False)


def _rehash(core: Path) -> None:
    m = json.loads((core / "manifest.json").read_text())
    for rel, e in m["files"].items():
        e["sha256"], e["bytes"] = sha256_file(core / rel), (core / rel).stat().st_size
    (core / "manifest.json").write_text(json.dumps(m))


HOSTILE = st.sampled_from([float("nan"), float("inf"), -1.0, 0.0, 1e300, -1, 0, 2**63, True, None, "x", "",
                           [1, 2], [], {}, {"a": 1}, [[0, 1]], [-1]]) | st.integers(-10, 10) | st.floats()


@settings(max_examples=80, deadline=GUARD, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pick=st.integers(0, 10_000), field=st.sampled_from(["param", "shape", "dtype", "srcs", "name"]),
       value=HOSTILE)
def test_fuzz_core_graph_fields_and_op_params(toy_core: Path, tmp_path: Path, pick: int, field: str, value) -> None:
    """Set one field or op parameter of every program graph to a hostile value, re-hash, then load
    and serve a request: only FlareErrors, and the core's files are left as they were."""
    from flare.plugins.export.serve import main

    core = tmp_path / f"c{pick}-{field}.core"
    if core.exists():
        shutil.rmtree(core)
    shutil.copytree(toy_core, core)
    for g in sorted((core / "programs").glob("*.json")):
        data = json.loads(g.read_text())
        tensors = data["tensors"]
        t = tensors[pick % len(tensors)]
        if field == "param":
            ops = [x for x in tensors if x.get("params")]
            t = ops[pick % len(ops)]
            key = sorted(t["params"])[pick % len(t["params"])]
            t["params"][key] = value
        elif field in t:
            t[field] = value
        g.write_text(json.dumps(data))
    _rehash(core)
    before = tree_digest(core)
    out = io.StringIO()
    try:
        main(str(core), ["--prompt", "Hi", "--max-new-tokens", "2", "--json"], stdout=out)
    except FlareError as exc:
        assert str(exc)
    assert tree_digest(core) == before
    shutil.rmtree(core)
