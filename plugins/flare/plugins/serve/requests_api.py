"""Reading and checking an HTTP request body: bounded, strict, and every refusal names its field.

`read_json` reads at most `Limits.max_body_bytes` (413 beyond, from the
Content-Length header when it says so, else while reading), gives up on a body
that has not arrived within `Limits.body_seconds` (408), and refuses JSON
nested deeper than `Limits.max_json_depth` before parsing it (400: Python's
parser would recurse). `parse_completion` and `parse_chat` check each field
strictly (a bool is not a number, 1.0 is not the integer 1, a dict is not a
list of stop strings, text must be encodable: no lone surrogates) and return
what a `Job` needs.
"""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse

from flare.plugins.export.serving.requests import json_depth, prompt_ids_problem
from flare.plugins.export.serving.sampling import SamplingParams

ROLES = ("system", "developer", "user", "assistant")
MAX_STOPS = 4


class BadRequest(Exception):
    """A request refused with an OpenAI-shaped error body."""

    def __init__(self, message: str, param: str | None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": None}}, status_code=self.status)


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 4 << 20
    max_json_depth: int = 32
    body_seconds: float = 30.0


async def read_json(request: Request, limits: Limits) -> Any:
    """The body as JSON, within the limits (BadRequest 400/408/413). ClientDisconnect propagates."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limits.max_body_bytes:
        raise BadRequest(f"the body is {int(declared)} bytes; at most {limits.max_body_bytes} are accepted", None,
                         413)
    parts: list[bytes] = []
    size = 0
    chunks = request.stream().__aiter__()
    deadline = asyncio.get_running_loop().time() + limits.body_seconds
    while True:
        left = deadline - asyncio.get_running_loop().time()
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), max(left, 0.001))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise BadRequest(f"the body did not arrive within {limits.body_seconds:g} s", None, 408) from None
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise BadRequest(f"the body is larger than {limits.max_body_bytes} bytes", None, 413)
        parts.append(chunk)
    data = b"".join(parts)
    depth = json_depth(data)
    if depth > limits.max_json_depth:
        raise BadRequest(f"the body's JSON is nested {depth} deep; at most {limits.max_json_depth} allowed", None)
    try:
        return json.loads(data)
    except RecursionError:
        raise BadRequest("the body's JSON is nested too deep", None) from None
    except ValueError as exc:     # includes UnicodeDecodeError
        raise BadRequest(f"the body is not JSON: {exc}", None) from None


# ------------------------------------------------------------------ fields
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and \
        (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        raise BadRequest(f"'{name}' must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}", name)
    return float(v)


def _text(v: str, name: str) -> str:
    """`v` if it is encodable text (JSON may carry a lone surrogate such as "\\ud800")."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"'{name}' is not valid Unicode ({exc.reason} at character {exc.start})", name) from None
    return v


def _stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) for s in stops):
        raise BadRequest(f"'stop' must be a string or a list of at most {MAX_STOPS} strings, got "
                         f"{type(stop).__name__}", "stop")
    return tuple(_text(s, "stop") for s in stops if s)


def _unsupported(body: Mapping[str, Any], allowed: Mapping[str, tuple]) -> None:
    """Fields Flare does not implement: only their neutral values are accepted (compared by type too:
    `logprobs: 0` or `n: true` are not `None` / `1`)."""
    for name, neutral in allowed.items():
        v = body.get(name)
        if v is None:
            continue
        if not any(type(v) is type(x) and v == x for x in neutral):
            raise BadRequest(f"'{name}' = {v!r} is not supported (accepted: "
                             f"{', '.join(json.dumps(x) for x in neutral) or 'absent'})", name)


COMMON_UNSUPPORTED: dict[str, tuple] = {
    "n": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},),
}


def _common(body: Any, *, model: str, serving: Any, ids: Sequence[int], default_max: int,
            max_names: tuple[str, ...]) -> dict[str, Any]:
    mt = default_max
    for name in max_names:
        v = body.get(name)
        if v is None:
            continue
        if not _is_int(v) or v < 1:
            raise BadRequest(f"'{name}' must be a positive integer, got {v!r}", name)
        mt = v
    if len(ids) + mt - 1 > serving.max_ctx:
        raise BadRequest(f"a prompt of {len(ids)} tokens plus max_tokens {mt} exceeds the context of "
                         f"{serving.max_ctx} tokens", max_names[-1])
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise BadRequest(f"'seed' must be an integer in [0, 2**63), got {seed!r}", "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}
                             or not isinstance(opts.get("include_usage", True), bool)):
        raise BadRequest("'stream_options' may only hold 'include_usage' (a boolean)", "stream_options")
    return {"prompt": tuple(ids), "max_tokens": mt, "params": SamplingParams(temperature, top_p, seed),
            "stops": _stops(body), "stream": stream}


def _check_model(body: Mapping[str, Any], model: str) -> None:
    if body.get("model") not in (None, model):
        raise BadRequest(f"model {body.get('model')!r} is not served here; this server serves {model!r}", "model")


def parse_completion(body: Any, *, model: str, serving: Any, tokenizer: Any) -> dict[str, Any]:
    """Check a /v1/completions body against the served core; the fields a Job needs."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", None)
    _check_model(body, model)
    _unsupported(body, {**COMMON_UNSUPPORTED, "echo": (False,), "logprobs": (), "best_of": (1,), "suffix": ()})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                     # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        try:
            ids = tuple(tokenizer.encode(prompt))
        except UnicodeEncodeError as exc:
            raise BadRequest(f"'prompt' is not valid Unicode ({exc.reason} at character {exc.start})",
                             "prompt") from None
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = tuple(prompt)
        why = prompt_ids_problem(ids, serving, getattr(tokenizer, "bos", 256))
        if why:
            raise BadRequest(why, "prompt")
    else:
        raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids (one prompt per "
                         "request)", "prompt")
    out = _common(body, model=model, serving=serving, ids=ids, default_max=16, max_names=("max_tokens",))
    out["end_ids"] = frozenset()
    return out


def _content(v: Any, where: str) -> str:
    if isinstance(v, str):
        return _text(v, where)
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in v):
        return _text("".join(p["text"] for p in v), where)
    raise BadRequest(f"'{where}' must be a string or a list of text parts", where)


def parse_chat(body: Any, *, model: str, serving: Any, tokenizer: Any) -> dict[str, Any]:
    """Check a /v1/chat/completions body; the prompt is the model's chat template over `messages`."""
    from jinja2.exceptions import TemplateError

    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", None)
    _check_model(body, model)
    _unsupported(body, {**COMMON_UNSUPPORTED, "logprobs": (False,), "top_logprobs": (), "tools": (),
                        "functions": (), "tool_choice": ("none",)})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
    messages = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"'{where}' must be an object with 'role' one of {', '.join(ROLES)}", where)
        messages.append({"role": m["role"], "content": _content(m.get("content"), f"{where}.content")})
    try:
        ids = tokenizer.chat_prompt(messages)
    except TemplateError as exc:
        raise BadRequest(f"the model's chat template refused the messages: {exc}", "messages") from None
    if ids is None:
        raise BadRequest(f"{model} has no chat template; use /v1/completions", "messages")
    left = serving.max_ctx - len(ids) + 1
    if left < 1:
        raise BadRequest(f"the rendered conversation is {len(ids)} tokens; the context holds {serving.max_ctx}",
                         "messages")
    out = _common(body, model=model, serving=serving, ids=ids, default_max=left,
                  max_names=("max_tokens", "max_completion_tokens"))
    out["end_ids"] = frozenset(tokenizer.end_of_turn)
    return out
