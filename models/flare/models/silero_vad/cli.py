"""`flare run silero-vad [FILE.wav] [--backends ...] [--json] [--mode offline|streaming]`.

Prints the speech segments of a file as a table (or JSON). With no FILE it
runs on the speech sample shipped with the plugin. Long files get a progress
bar on stderr (only when stderr is a terminal, so JSON output stays clean).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from flare.core.options import add_backends_option

SAMPLE = Path(__file__).resolve().parent / "data" / "speech_sample.wav"
PROGRESS_AFTER_S = 60.0  # show a progress bar for audio longer than this


def parser() -> argparse.ArgumentParser:
    from flare.core.cli import add_threads_argument

    p = argparse.ArgumentParser(prog="flare run silero-vad",
                                description="Voice activity detection with Silero VAD (16 kHz).")
    p.add_argument("file", nargs="?", type=Path, default=None,
                   help="WAV file (any rate, mono or stereo; resampled to 16 kHz). Default: the shipped sample.")
    add_backends_option(p, dest="backend")
    p.add_argument("--mode", choices=("offline", "streaming"), default="offline",
                   help="offline: whole file, batched frontend (fast). streaming: 512-sample chunks as a live stream would.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--threshold", type=float, default=0.5, help="speech probability threshold (default 0.5)")
    p.add_argument("--min-speech-ms", type=int, default=250, help="drop segments shorter than this (default 250)")
    p.add_argument("--min-silence-ms", type=int, default=100, help="silence that ends a segment (default 100)")
    p.add_argument("--speech-pad-ms", type=int, default=30, help="padding added to each segment (default 30)")
    add_threads_argument(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry of `flare run silero-vad`; returns the process exit code."""
    from rich.console import Console

    try:
        args = parser().parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # --help or a usage error: argparse has printed why
        return int(exc.code or 0)
    out, err = Console(), Console(stderr=True)

    from flare.models.silero_vad.audio import load_audio
    from flare.core.cli import device_config, report_error
    from flare.core.errors import FlareError
    from flare.core.session import Session, device_list

    from .runner import SileroVad
    from .segments import VadParams

    path = args.file or SAMPLE
    try:
        devices = device_list(args.backend, "--backends")
        params = VadParams(threshold=args.threshold, min_speech_duration_ms=args.min_speech_ms,
                           min_silence_duration_ms=args.min_silence_ms, speech_pad_ms=args.speech_pad_ms)
        audio = load_audio(path)
        seconds = audio.size / 16000
        with Session(devices, config=device_config(args.threads)) as session, SileroVad(session, modes=(args.mode,)) as vad:
            start = time.perf_counter()
            if seconds > PROGRESS_AFTER_S and err.is_terminal:
                segs = _with_progress(vad, audio, args.mode, params, err)
            else:
                segs = vad.detect(audio, args.mode, params)
            elapsed = time.perf_counter() - start
    except FlareError as exc:
        return report_error(exc)

    if args.json:
        print(json.dumps({"model": "silero-vad", "file": str(path), "duration": round(seconds, 3),
                          "sample_rate": 16000, "mode": args.mode, "backend": devices,
                          "elapsed_s": round(elapsed, 4), "segments": [s.to_dict() for s in segs]}, indent=2))
        return 0
    _print_table(out, path, seconds, segs, args.mode, devices, elapsed)
    return 0


def _with_progress(vad, audio, mode, params, console):
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from .segments import segments

    with Progress(TextColumn("[bold]silero-vad[/bold] {task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} chunks"), TimeRemainingColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(mode, total=max(1, -(-audio.size // 512)))
        probs = vad.speech_probs(audio, mode, progress=lambda done, total: bar.update(task, completed=done))
    return segments(probs, audio.size, params)


def _print_table(console, path, seconds, segs, mode, devices, elapsed) -> None:
    from rich.table import Table

    table = Table(title=f"Speech in {path.name}", title_justify="left")
    for col in ("#", "start (s)", "end (s)", "duration (s)", "probability"):
        table.add_column(col, justify="right")
    for i, s in enumerate(segs, 1):
        table.add_row(str(i), f"{s.start:.3f}", f"{s.end:.3f}", f"{s.end - s.start:.3f}", f"{s.probability:.3f}")
    console.print(table)
    speech = sum(s.end - s.start for s in segs)
    rtf = elapsed / seconds if seconds else 0.0
    console.print(f"{len(segs)} segment(s), {speech:.2f} s of speech in {seconds:.2f} s of audio; "
                  f"{mode} on {','.join(devices)} in {elapsed * 1000:.0f} ms ({rtf:.4f} x real time)",
                  highlight=False)


if __name__ == "__main__":
    sys.exit(main())
