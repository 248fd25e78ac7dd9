"""Requests for the serving scheduler, one JSON object per line (a file or standard input).

    {"id": "r1", "prompt": "Hello", "max_new_tokens": 16, "arrival": 0.0}
    {"id": "r2", "prompt_ids": [256, 72, 105], "max_new_tokens": 8, "arrival": 0.05}

`prompt` is text (byte tokens after <bos>, as moe-lm encodes it) and
`prompt_ids` explicit token ids; `arrival` is seconds after the start of the
run (default 0); `id` defaults to the line number. A malformed line is a
`RequestError` naming the line and field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, TextIO

from flare.errors import FlareError

BOS = 256  # token-lm/1 byte vocabulary: 0..255 bytes, then <bos>


class RequestError(FlareError):
    """A request line is malformed or does not fit the core's serving range."""

    exit_code = 2  # bad input (flare.errors.USAGE)


@dataclass(frozen=True)
class Request:
    id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "prompt_ids": list(self.prompt), "max_new_tokens": self.max_new_tokens,
                "arrival": self.arrival}


def parse_request(obj: Any, where: str, default_id: str, default_new: int = 16) -> Request:
    if not isinstance(obj, dict):
        raise RequestError(f"{where}: must be a JSON object")
    rid = obj.get("id", default_id)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise RequestError(f"{where}.id: must be a string")
    if "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError(f"{where}.prompt_ids: must be a non-empty list of token ids")
        prompt = tuple(ids)
    elif isinstance(obj.get("prompt"), str) and obj["prompt"]:
        prompt = (BOS, *obj["prompt"].encode("utf-8"))
    else:
        raise RequestError(f"{where}: needs a non-empty 'prompt' (text) or 'prompt_ids'")
    new = obj.get("max_new_tokens", default_new)
    if not isinstance(new, int) or isinstance(new, bool) or new < 1:
        raise RequestError(f"{where}.max_new_tokens: must be a positive integer")
    arrival = obj.get("arrival", 0.0)
    if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or not 0 <= arrival < 1e6:
        raise RequestError(f"{where}.arrival: must be seconds >= 0")
    return Request(str(rid), prompt, new, float(arrival))


def read_requests(stream: TextIO | Iterable[str], default_new: int = 16) -> list[Request]:
    """Parse JSONL; blank lines and lines starting with # are skipped. Ids must be unique."""
    out: list[Request] = []
    for n, line in enumerate(stream, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise RequestError(f"line {n}: not JSON ({exc})") from None
        out.append(parse_request(obj, f"line {n}", str(len(out)), default_new))
    ids = [r.id for r in out]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise RequestError(f"request ids used twice: {dup}")
    return out
