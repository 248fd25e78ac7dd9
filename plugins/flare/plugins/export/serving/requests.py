"""Requests for the serving scheduler, one JSON object per line (a file or standard input).

    {"id": "r1", "prompt": "Hello", "max_new_tokens": 16, "arrival": 0.0}
    {"id": "r2", "prompt_ids": [256, 72, 105], "max_new_tokens": 8, "arrival": 0.05}

`prompt` is text, encoded by the core's tokenizer (`encode`: for a core of a
GGUF model the file's own BPE, as `flare serve NAME.core` encodes a completion
prompt; by default <bos> then its UTF-8 bytes, as moe-lm encodes it) and
`prompt_ids` explicit token ids (below `id_limit`: the vocabulary); `arrival` is seconds after the start of the
run (default 0); `id` defaults to the line number. A malformed line is a
`RequestError` naming the line and field; so is a line that is not UTF-8 (no
replacement: a prompt's bytes are its tokens, so guessing would change them)
and a file larger than `MAX_REQUEST_BYTES`.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterable, TextIO

from flare.core.errors import FlareError

BOS = 256  # token-lm/1 byte vocabulary: 0..255 bytes, then <bos>
MAX_REQUEST_BYTES = 64 << 20  # a requests file larger than this is refused before parsing
MAX_PROMPT_IDS = 1 << 20

Encode = Callable[[str], "list[int] | tuple[int, ...]"]


def byte_prompt(text: str) -> tuple[int, ...]:
    """token-lm/1 bytes: <bos> then the text's UTF-8 bytes (UnicodeEncodeError for a lone surrogate)."""
    return (BOS, *text.encode("utf-8"))


class RequestError(FlareError):
    """A request line is malformed or does not fit the core's serving range."""

    exit_code = 2  # bad input (flare.core.errors.USAGE)


@dataclass(frozen=True)
class Request:
    id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "prompt_ids": list(self.prompt), "max_new_tokens": self.max_new_tokens,
                "arrival": self.arrival}


def prompt_ids_problem(ids: Iterable[int], serving: Any, bos: int = BOS) -> str | None:
    """Why prompt `ids` are not allowed on a core (None: they are). The rule of `flare run` and
    `flare serve` alike: ids inside the vocabulary, and no special token but <bos> (a prompt holding
    <eos>, <pad> or a forbidden id would be read as something no text encodes)."""
    specials = (set(serving.never) | {serving.pad, serving.eos}) - {bos}
    bad = [t for t in ids if not 0 <= t < serving.vocab or t in specials]
    if bad:
        return (f"token ids {bad[:4]} are outside the vocabulary 0..{serving.vocab - 1} or special "
                f"(a prompt may hold <bos> {bos} but no other special id: {sorted(specials)[:8]})")
    return None


def load_json_line(text: str | bytes, where: str, max_depth: int = 64) -> Any:
    """One JSON value, nested at most `max_depth` deep (RequestError otherwise, never RecursionError)."""
    depth = json_depth(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    if depth > max_depth:
        raise RequestError(f"{where}: JSON nested {depth} deep; at most {max_depth} allowed")
    try:
        return json.loads(text)
    except RecursionError:
        raise RequestError(f"{where}: JSON nested too deep") from None
    except ValueError as exc:
        raise RequestError(f"{where}: not JSON ({exc})") from None


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)


def json_depth(data: bytes) -> int:
    """The nesting depth of JSON text (strings skipped), in linear time and without recursion; for
    text that is not JSON a number the parser will refuse anyway."""
    import numpy as np

    a = np.frombuffer(_STRING.sub(b"", data), np.uint8)
    if not a.size:
        return 0
    step = np.isin(a, (0x5B, 0x7B)).astype(np.int32) - np.isin(a, (0x5D, 0x7D)).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


def parse_request(obj: Any, where: str, default_id: str, default_new: int = 16, *, encode: Encode = byte_prompt,
                  id_limit: int = BOS + 1) -> Request:
    """One request object; `encode` turns a text prompt into ids, `prompt_ids` must lie in [0, id_limit)."""
    if not isinstance(obj, dict):
        raise RequestError(f"{where}: must be a JSON object")
    rid = obj.get("id", default_id)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise RequestError(f"{where}.id: must be a string")
    if "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if (not isinstance(ids, list) or not ids or len(ids) > MAX_PROMPT_IDS
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < id_limit for t in ids)):
            raise RequestError(f"{where}.prompt_ids: must be a non-empty list of at most {MAX_PROMPT_IDS} "
                               f"token ids in 0..{id_limit - 1}")
        prompt = tuple(ids)
    elif isinstance(obj.get("prompt"), str) and obj["prompt"]:
        try:
            prompt = tuple(encode(obj["prompt"]))
        except UnicodeEncodeError as exc:  # a lone surrogate from a JSON "\udc80" escape
            raise RequestError(f"{where}.prompt: not valid Unicode ({exc.reason} at character {exc.start})") from None
    else:
        raise RequestError(f"{where}: needs a non-empty 'prompt' (text) or 'prompt_ids'")
    if not prompt:
        raise RequestError(f"{where}.prompt: the tokenizer gives no tokens for it")
    new = obj.get("max_new_tokens", default_new)
    if not isinstance(new, int) or isinstance(new, bool) or new < 1:
        raise RequestError(f"{where}.max_new_tokens: must be a positive integer")
    arrival = obj.get("arrival", 0.0)
    if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or not 0 <= arrival < 1e6:
        raise RequestError(f"{where}.arrival: must be seconds >= 0")
    return Request(str(rid), prompt, new, float(arrival))


def read_request_bytes(stream: BinaryIO, what: str, limit: int = MAX_REQUEST_BYTES) -> list[str]:
    """Read at most `limit` bytes and decode each line as strict UTF-8 (RequestError naming the line)."""
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise RequestError(f"{what}: larger than {limit} bytes; refused")
    lines = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise RequestError(f"{what}: line {n}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                               f"{exc.start + 1})") from None
    return lines


def read_requests(stream: TextIO | BinaryIO | Iterable[str], default_new: int = 16, what: str = "requests", *,
                  encode: Encode = byte_prompt, id_limit: int = BOS + 1) -> list[Request]:
    """Parse JSONL; blank lines and lines starting with # are skipped. Ids must be unique. `encode` and
    `id_limit`: as `parse_request`.

    A binary stream is read through `read_request_bytes` (size bound, strict UTF-8)."""
    out: list[Request] = []
    if hasattr(stream, "read"):
        buffer = getattr(stream, "buffer", None)
        raw = stream.read(0)
        if isinstance(raw, bytes):
            stream = read_request_bytes(stream, what)
        elif buffer is not None:
            stream = read_request_bytes(buffer, what)
    for n, line in enumerate(stream, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        obj = load_json_line(line, f"{what}: line {n}")
        out.append(parse_request(obj, f"{what}: line {n}", str(len(out)), default_new, encode=encode,
                                 id_limit=id_limit))
    dup = sorted(i for i, c in Counter(r.id for r in out).items() if c > 1)   # linear, not ids.count()
    if dup:
        raise RequestError(f"{what}: request ids used twice: {dup}")
    return out
