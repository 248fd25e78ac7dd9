#!/usr/bin/env python3
"""Hostile inputs against every `flare` boundary: one row per case with its exit code and message.

    python scripts/hostile_inputs.py [--flare PATH/TO/flare] [--core NAME.core] [--markdown OUT.md]

Each case runs the real command line in a subprocess (its own environment, standard
input and a time limit) on files made in a temporary directory: malformed WAV headers,
special files, non-UTF-8 text and request files, nonsense options and environment
variables, and exported cores whose files or graphs were altered (with checksums
re-written, so the loader's deeper checks are reached). A tiny moe-lm core is
exported once for the core cases unless --core names one (it is copied, never changed).

It passes (exit 0) when no case prints a traceback, every case exits with the code
the convention gives it (2 bad usage or input, 1 a failure of the run, 0 ok) and
every case ends within its time limit; the table is printed either way.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

TIMEOUT_S = 120


@dataclass
class Case:
    kind: str                     # the hostile input class
    args: list                    # argv after `flare` (str or bytes)
    expect: int                   # the exit code the convention gives it
    env: dict = field(default_factory=dict)
    stdin: bytes = b""


@dataclass
class Outcome:
    case: Case
    rc: int
    message: str
    traceback: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.rc == self.case.expect and not self.traceback


def fmt_chunk(tag: int, channels: int, rate: int, bits: int) -> bytes:
    align = channels * bits // 8
    return struct.pack("<HHIIHH", tag, channels, rate, (rate * align) & 0xFFFFFFFF, align & 0xFFFF, bits)


def riff(fmt: bytes, data: bytes, data_size: int | None = None) -> bytes:
    size = len(data) if data_size is None else data_size
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", size) + data
    return b"RIFF" + struct.pack("<I", len(body) & 0xFFFFFFFF) + body


def wav_cases(d: Path) -> list[Case]:
    files = {
        "WAV bits_per_sample=0": riff(fmt_chunk(1, 1, 16000, 0), b"\0" * 1000),
        "WAV sample rate 1 Hz, 64 KB of data": riff(fmt_chunk(1, 1, 1, 16), b"\0" * 65536),
        "WAV sample rate 4 GHz": riff(fmt_chunk(1, 1, 4_000_000_000, 16), b"\0" * 1000),
        "WAV 0 channels": riff(fmt_chunk(1, 0, 16000, 16), b"\0" * 100),
        "WAV 100 channels": riff(fmt_chunk(1, 100, 16000, 16), b"\0" * 2000),
        "WAV data chunk claims 4 GiB, file holds 10 bytes": riff(fmt_chunk(1, 1, 16000, 16), b"\0" * 10, 0xFFFFFFF0),
        "WAV 16 bytes of data in a 16 kHz header (control)": riff(fmt_chunk(1, 1, 16000, 16), b"\0" * 16),
        "WAV float samples NaN": riff(fmt_chunk(3, 1, 16000, 32), struct.pack("<f", float("nan")) * 512),
        "WAV header only (no data chunk)": b"RIFF" + struct.pack("<I", 4) + b"WAVE",
        "text file named .wav": b"this is not audio\n",
        "empty file": b"",
    }
    # read up to the end of the file, as libsndfile does: frames are bounded by the file, not the header
    readable = {"WAV data chunk claims 4 GiB, file holds 10 bytes", "WAV 16 bytes of data in a 16 kHz header (control)"}
    cases = []
    for i, (kind, blob) in enumerate(files.items()):
        p = d / f"case{i}.wav"
        p.write_bytes(blob)
        cases.append(Case(kind, ["run", "silero-vad", str(p)], 0 if kind in readable else 2))
    fifo = d / "fifo.wav"
    os.mkfifo(fifo)
    zero = d / "zero.wav"
    zero.symlink_to("/dev/zero")
    cases += [Case("WAV path is a FIFO (reading would block)", ["run", "silero-vad", str(fifo)], 2),
              Case("WAV path is a symlink to /dev/zero", ["run", "silero-vad", str(zero)], 2),
              Case("WAV path does not exist", ["run", "silero-vad", str(d / "missing.wav")], 2)]
    return cases


def option_cases() -> list[Case]:
    return [
        Case("--threshold nan", ["run", "silero-vad", "--threshold", "nan"], 2),
        Case("--threshold 7", ["run", "silero-vad", "--threshold", "7"], 2),
        Case("--speech-pad-ms -100000", ["run", "silero-vad", "--speech-pad-ms", "-100000"], 2),
        Case("--min-speech-ms not a number", ["run", "silero-vad", "--min-speech-ms", "lots"], 2),
        Case("--backends ','", ["run", "silero-vad", "--backends", ","], 2),
        Case("--backends unknown name", ["run", "minilm-l6", "--backends", "vulkn"], 2),
        Case("--backends 'cpu,,cpu' (describe)", ["describe", "silero-vad", "--backends", "cpu,,cpu"], 2),
        Case("unknown model name", ["run", "no-such-model"], 2),
        Case("unknown subcommand", ["frobnicate"], 2),
        Case("bench with one config", ["bench", "a.toml"], 2),
        Case("bench --blocks 0", ["bench", "a.toml", "b.toml", "--blocks", "0"], 2),
        Case("moe-lm --max-new-tokens -1", ["run", "moe-lm", "--prompt", "Hi", "--max-new-tokens", "-1"], 2),
        Case("moe-lm --temperature nan", ["run", "moe-lm", "--prompt", "Hi", "--temperature", "nan"], 2),
        Case("moe-lm --top-p 7", ["run", "moe-lm", "--prompt", "Hi", "--top-p", "7"], 2),
        Case("moe-lm --seed -1", ["run", "moe-lm", "--prompt", "Hi", "--seed", "-1"], 2),
        Case("export --seed -5", ["export", "moe-lm", "-o", "never.core", "--seed", "-5"], 2),
        Case("export --prefill-chunk 3", ["export", "moe-lm", "-o", "never.core", "--prefill-chunk", "3"], 2),
        Case("moe-lm --expert-cache-mb nan", ["run", "moe-lm", "--prompt", "Hi", "--experts", "offload",
                                              "--expert-cache-mb", "nan"], 2),
    ]


def text_cases() -> list[Case]:
    return [
        Case("minilm text not UTF-8 (argv bytes)", ["run", "minilm-l6", b"caf\xe9 au lait", "fine"], 2),
        Case("minilm text with a lone surrogate escape", ["run", "minilm-l6", b"\xed\xb2\x80"], 2),
    ]


def gguf_cases(d: Path) -> list[Case]:
    """GGUF files written with gguf.GGUFWriter (flare.models.gguf.testing), then broken."""
    from flare.models.gguf.testing import TinySpec, tensor_offset_field, write_tiny

    good = write_tiny(d / "good.gguf")
    raw = good.read_bytes()
    (d / "truncated.gguf").write_bytes(raw[: len(raw) // 2])
    (d / "magic.gguf").write_bytes(b"GGML" + raw[4:])
    write_tiny(d / "arch.gguf", TinySpec(arch="mamba"))
    write_tiny(d / "q5.gguf", types={"blk.1.attn_v.weight": "q5_0"})
    write_tiny(d / "shape.gguf", shapes={"blk.0.attn_k.weight": (64, 64)})
    patched = bytearray(raw)
    at = tensor_offset_field(good, "blk.1.ffn_up.weight")
    patched[at: at + 8] = (1 << 40).to_bytes(8, "little")
    (d / "offset.gguf").write_bytes(bytes(patched))
    run = ["--prompt", "hi", "--max-new-tokens", "1"]
    return [Case(f"gguf {what}", ["run", str(d / name), *run], 2) for what, name in (
        ("truncated", "truncated.gguf"), ("wrong magic", "magic.gguf"), ("unknown architecture", "arch.gguf"),
        ("unsupported quantization type", "q5.gguf"), ("tensor shape disagrees with the metadata", "shape.gguf"),
        ("tensor offset past the end", "offset.gguf"), ("missing file", "none.gguf"))]


def env_cases() -> list[Case]:
    return [
        Case("FLARE_CPU_MEMORY_LIMIT=lots", ["run", "silero-vad"], 2, env={"FLARE_CPU_MEMORY_LIMIT": "lots"}),
        Case("FLARE_CPU_MEMORY_LIMIT=0", ["run", "silero-vad"], 2, env={"FLARE_CPU_MEMORY_LIMIT": "0"}),
        Case("FLARE_CPU_MEMORY_LIMIT=1KiB (a real out-of-memory)", ["run", "silero-vad"], 1,
             env={"FLARE_CPU_MEMORY_LIMIT": "1KiB"}),
        Case("FLARE_VULKAN_FORCE_STAGING=maybe", ["run", "silero-vad", "--backends", "vulkan"], 2,
             env={"FLARE_VULKAN_FORCE_STAGING": "maybe"}),
        Case("FLARE_VULKAN_DEVICE=nonsense", ["run", "silero-vad", "--backends", "vulkan"], 2,
             env={"FLARE_VULKAN_DEVICE": "nonsense"}),
    ]


# -- cores ------------------------------------------------------------------------------
def rechecksum(core: Path) -> None:
    """Re-write manifest sizes and sha256 so the loader's checks past the checksums are reached."""
    m = json.loads((core / "manifest.json").read_text())
    for rel in m["files"]:
        data = (core / rel).read_bytes()
        m["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (core / "manifest.json").write_text(json.dumps(m, indent=1))


def alter_graphs(core: Path, fn: Callable[[dict], None]) -> None:
    for g in sorted((core / "programs").glob("*.json")):
        data = json.loads(g.read_text())
        fn(data)
        g.write_text(json.dumps(data))   # json writes NaN as the literal NaN, as a hostile file would
    rechecksum(core)


def set_param(op: str, key: str, value) -> Callable[[dict], None]:
    def fn(data: dict) -> None:
        for t in data["tensors"]:
            if t.get("op") == op:
                t.setdefault("params", {})[key] = value
    return fn


def set_input_shape(value) -> Callable[[dict], None]:
    def fn(data: dict) -> None:
        for t in data["tensors"]:
            if t.get("role") == "input":
                t["shape"] = value
                return
    return fn


def core_cases(d: Path, core: Path) -> list[Case]:
    def variant(name: str, change: Callable[[Path], None]) -> str:
        dst = d / f"{name}.core"
        shutil.copytree(core, dst)
        change(dst)
        return str(dst)

    def replace_with(rel: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
        def change(c: Path) -> None:
            (c / rel).unlink()
            make(c / rel)
        return change

    def sparse(size: int) -> Callable[[Path], None]:
        def make(p: Path) -> None:
            with open(p, "wb") as f:
                f.truncate(size)
        return make

    def header_claims_huge(c: Path) -> None:
        w = c / "weights.safetensors"
        data = bytearray(w.read_bytes())
        data[:8] = struct.pack("<Q", 1 << 62)
        w.write_bytes(bytes(data))
        rechecksum(c)

    def corrupt_byte(c: Path) -> None:
        g = sorted((c / "programs").glob("*.json"))[0]
        data = bytearray(g.read_bytes())
        data[len(data) // 2] ^= 0x01
        g.write_bytes(bytes(data))

    def flip(rel: str, text: bytes) -> Callable[[Path], None]:
        def change(c: Path) -> None:
            (c / rel).write_bytes(text)
        return change

    def graph_variant(name: str, fn: Callable[[dict], None]) -> str:
        return variant(name, lambda c: alter_graphs(c, fn))

    run = lambda path, *more: ["run", path, "--check", *more]  # noqa: E731
    serve = lambda path: ["run", path, "--prompt", "Hi", "--max-new-tokens", "2"]  # noqa: E731
    cases = [
        Case("core: manifest.json is a symlink to /dev/zero",
             run(variant("zero", replace_with("manifest.json", lambda p: p.symlink_to("/dev/zero")))), 2),
        Case("core: manifest.json is a FIFO", run(variant("fifo", replace_with("manifest.json", os.mkfifo))), 2),
        Case("core: manifest.json is 1 GiB (sparse)", run(variant("huge", replace_with("manifest.json", sparse(1 << 30)))), 2),
        Case("core: manifest.json is not UTF-8", run(variant("latin", flip("manifest.json", b'{"format": "\xff"}'))), 2),
        Case("core: catalog.json listed but a directory",
             run(variant("dir", replace_with("catalog.json", lambda p: p.mkdir()))), 2),
        Case("core: a graph file modified (checksum)", run(variant("flip", corrupt_byte)), 2),
        Case("core: safetensors header claims 2^62 bytes", run(variant("st", header_claims_huge)), 2),
        Case("core: op parameter eps = NaN", serve(graph_variant("nan", set_param("rms_norm", "eps", float("nan")))), 2),
        Case("core: op parameter eps = \"small\"", serve(graph_variant("str", set_param("rms_norm", "eps", "small"))), 2),
        Case("core: op parameter scale = [1.5] (a list)", serve(graph_variant("scale", set_param("softmax", "scale", [1.5]))), 2),
        Case("core: input shape (4.5,)", serve(graph_variant("shape", set_input_shape([4.5]))), 2),
        Case("core: directory does not exist", run(str(d / "missing.core")), 2),
        Case("core: --ranks 0", ["run", str(core), "--ranks", "0"], 2),
        Case("core: --backends ','", ["run", str(core), "--backends", ",", "--check"], 2),
        Case("serve: --port 99999", ["serve", str(core), "--port", "99999"], 2),
        Case("serve: --prefix-cache-mib nan", ["serve", str(core), "--prefix-cache-mib", "nan"], 2),
        Case("serve: --ranks 0", ["serve", str(core), "--ranks", "0"], 2),
        Case("serve: --graceful-seconds nan", ["serve", str(core), "--graceful-seconds", "nan"], 2),
        Case("serve: --max-body-kib 0", ["serve", str(core), "--max-body-kib", "0"], 2),
        Case("serve: --read-timeout 0", ["serve", str(core), "--read-timeout", "0"], 2),
        Case("serve: neither a core nor a model", ["serve", "no-such-model"], 2),
        Case("core: --max-new-tokens 0", ["run", str(core), "--prompt", "Hi", "--max-new-tokens", "0"], 2),
        Case("core: empty standard input", ["run", str(core)], 2, stdin=b""),
        Case("core: requests not UTF-8", ["run", str(core)], 2, stdin=b'{"prompt": "Hi"}\n{"prompt": "caf\xe9"}\n'),
        Case("core: requests not JSON", ["run", str(core)], 2, stdin=b"{prompt: Hi}\n"),
        Case("core: a request line nested 100000 deep", ["run", str(core)], 2, stdin=b"[" * 100000 + b"]" * 100000),
        Case("core: request prompt is a lone surrogate", ["run", str(core)], 2, stdin=b'{"prompt": "\\udc80"}\n'),
        Case("core: request prompt_ids out of vocabulary", ["run", str(core)], 2, stdin=b'{"prompt_ids": [999999]}\n'),
        Case("core: every request rejected (too long)", ["run", str(core)], 2,
             stdin=b'{"prompt": "Hi", "max_new_tokens": 100000}\n{"prompt_ids": [256, 1], "max_new_tokens": 99999}\n'),
        Case("core: requests file is /dev/zero", ["run", str(core), "--requests", "/dev/zero"], 2),
        Case("core: a good request (control)", ["run", str(core)], 0, stdin=b'{"prompt": "Hi", "max_new_tokens": 2}\n'),
    ]
    return cases


def run_case(flare: str, case: Case, cwd: Path) -> Outcome:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env.update(case.env)
    argv = [os.fsencode(flare)] + [a if isinstance(a, bytes) else os.fsencode(a) for a in case.args]
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, input=case.stdin, capture_output=True, env=env, cwd=cwd, timeout=TIMEOUT_S)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = -9, exc.stdout or b"", (exc.stderr or b"") + f"TIMEOUT after {TIMEOUT_S} s".encode()
    seconds = time.perf_counter() - start
    text = err.decode("utf-8", "replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln or "TIMEOUT" in ln]
    message = (errors[-1] if errors else (lines[-1] if lines else "(no output)")).strip()
    traceback = "Traceback (most recent call last)" in text + out.decode("utf-8", "replace")
    return Outcome(case, rc, message, traceback, seconds)


def export_core(flare: str, d: Path) -> Path:
    core = d / "tiny.core"
    proc = subprocess.run([flare, "export", "moe-lm", "-o", str(core), "--quiet"], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"could not export a core for the core cases: {proc.stderr.strip()}")
    return core


def table(outcomes: list[Outcome]) -> str:
    rows = ["| # | hostile input | command | exit (expected) | message | traceback |",
            "|---|---|---|---|---|---|"]
    for i, o in enumerate(outcomes, 1):
        cmd = " ".join(a.decode("utf-8", "backslashreplace") if isinstance(a, bytes) else a for a in o.case.args[:2])
        msg = o.message.replace("|", "\\|")
        if len(msg) > 160:
            msg = msg[:157] + "..."
        mark = "" if o.ok else " **FAIL**"
        rows.append(f"| {i} | {o.case.kind} | `flare {cmd}` | {o.rc} ({o.case.expect}){mark} | {msg} | "
                    f"{'YES' if o.traceback else 'no'} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flare", default=shutil.which("flare") or "flare", help="the flare executable to test")
    ap.add_argument("--core", default=None, help="an exported moe-lm core to copy (default: export a tiny one)")
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    ap.add_argument("-k", default=None, help="only cases whose description contains this text")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="flare-hostile-") as tmp:
        d = Path(tmp)
        (d / "a.toml").write_text('model = "silero-vad"\n')
        (d / "b.toml").write_text('model = "silero-vad"\n')
        core = Path(args.core) if args.core else export_core(args.flare, d)
        cases = wav_cases(d) + option_cases() + text_cases() + gguf_cases(d) + env_cases() + core_cases(d, core)
        if args.k:
            cases = [c for c in cases if args.k in c.kind]
        outcomes = []
        for c in cases:
            o = run_case(args.flare, c, d)
            outcomes.append(o)
            print(f"{'ok  ' if o.ok else 'FAIL'} {o.rc:>3} ({c.expect}) {o.seconds:5.1f}s  {c.kind}: {o.message[:100]}",
                  file=sys.stderr, flush=True)
    text = table(outcomes)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    bad = [o for o in outcomes if not o.ok]
    print(f"\n{len(outcomes) - len(bad)}/{len(outcomes)} cases as the convention says; "
          f"{sum(o.traceback for o in outcomes)} traceback(s); slowest {max(o.seconds for o in outcomes):.1f} s",
          file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
