"""The OpenAI-compatible HTTP API (Starlette): /v1/completions, /v1/models, /health, /metrics.

Handlers never run the model: they validate a request, hand a `Job` to the
step loop's thread and await its events through an asyncio queue (the loop
thread posts with `call_soon_threadsafe`), so the event loop never blocks on
a step. A client that goes away cancels its job (streaming: Starlette stops
the body generator; plain: a task waits for `http.disconnect`). Bad fields get
400 with an OpenAI-style error naming the field, a full queue 429, a loop
that failed or is shutting down 503; nothing a client sends can stop the loop.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from flare.core.errors import FlareError

from .loop import Job, QueueFull, ServeLoop
from flare.plugins.export.serving.sampling import SamplingParams

BOS = 256   # token-lm/1: a text prompt is <bos> then its UTF-8 bytes (as `flare run --prompt`)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": None}}, status_code=self.status)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise BadRequest(f"'{name}' must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}", name)
    return float(v)


def parse_completion(body: Any, *, model: str, serving: Any) -> dict[str, Any]:
    """Check a /v1/completions body against the served core; the fields a Job needs."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", None)
    if body.get("model") not in (None, model):
        raise BadRequest(f"model {body.get('model')!r} is not served here; this server serves {model!r}", "model")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                     # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        ids = (BOS, *prompt.encode("utf-8"))
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = tuple(prompt)
        bad = [t for t in ids if not 0 <= t < serving.vocab]
        if bad:
            raise BadRequest(f"token ids {bad[:4]} are outside the vocabulary 0..{serving.vocab - 1}", "prompt")
    else:
        raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids (one prompt per "
                         "request)", "prompt")
    mt = body.get("max_tokens", 16)
    if mt is None:
        mt = 16
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise BadRequest(f"'max_tokens' must be a positive integer, got {mt!r}", "max_tokens")
    if len(ids) + mt - 1 > serving.max_ctx:
        raise BadRequest(f"a prompt of {len(ids)} tokens plus max_tokens {mt} exceeds the context of "
                         f"{serving.max_ctx} tokens", "max_tokens")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise BadRequest(f"'seed' must be a non-negative integer, got {seed!r}", "seed")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) for s in stops) or len(stops) > 4:
        raise BadRequest("'stop' must be a string or a list of at most 4 strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise BadRequest("only n=1 is supported", "n")
    for name in ("echo", "logprobs", "best_of", "suffix"):
        if body.get(name) not in (None, False, 1 if name == "best_of" else None):
            raise BadRequest(f"'{name}' is not supported", name)
    return {"prompt": ids, "max_tokens": mt, "params": SamplingParams(temperature, top_p, seed), "stops": stops,
            "stream": stream}


class Api:
    """Routes over one step loop. `status()` feeds /metrics' live gauges and /health."""

    def __init__(self, loop: ServeLoop, *, model: str, created: int | None = None,
                 on_shutdown: Callable[[], None] | None = None):
        self.loop = loop
        self.model = model
        self.created = created or int(time.time())
        self.on_shutdown = on_shutdown

    # -------------------------------------------------------------- routes
    async def health(self, request: Request) -> Response:
        if not self.loop.alive:
            return JSONResponse({"status": "stopped", "error": str(self.loop.error or "")}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model",
                                                          "created": self.created, "owned_by": "flare"}]})

    async def metrics(self, request: Request) -> Response:
        return Response(self.loop.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        try:
            try:
                body = json.loads(await request.body())
            except ValueError as exc:
                raise BadRequest(f"the body is not JSON: {exc}", None) from None
            fields = parse_completion(body, model=self.model, serving=self.loop.serving)
        except BadRequest as exc:
            self.loop.metrics.rejected.labels("400").inc()
            return exc.response()
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        aloop = asyncio.get_running_loop()

        def sink(ev: dict[str, Any]) -> None:
            try:
                aloop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:        # the event loop is gone (shutdown): nobody is listening
                pass

        rid = f"cmpl-{uuid.uuid4().hex}"
        job = Job(rid, fields["prompt"], fields["max_tokens"], fields["params"], fields["stops"], sink)
        try:
            self.loop.submit(job)
        except QueueFull as exc:
            self.loop.metrics.rejected.labels("429").inc()
            return BadRequest(str(exc), None, 429, "rate_limit_error").response()
        except FlareError as exc:
            self.loop.metrics.rejected.labels("503").inc()
            return BadRequest(str(exc), None, 503, "server_error").response()
        self.loop.metrics.prompt_tokens.inc(len(job.prompt))
        if fields["stream"]:
            return StreamingResponse(self._stream(job, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._whole(request, job, events)

    # ------------------------------------------------------------- helpers
    def _usage(self, job: Job) -> dict[str, Any]:
        return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.tokens),
                "total_tokens": len(job.prompt) + len(job.tokens),
                "prompt_tokens_details": {"cached_tokens": job.cached_tokens}}

    def _body(self, job: Job, text: str, token_ids: list[int], finish: str | None, usage: bool) -> dict[str, Any]:
        out = {"id": job.id, "object": "text_completion", "created": int(time.time()), "model": self.model,
               "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                            "token_ids": token_ids}]}
        if usage:
            out["usage"] = self._usage(job)
        return out

    async def _whole(self, request: Request, job: Job, events: asyncio.Queue) -> Response:
        async def collect() -> tuple[str, dict[str, Any]]:
            text = []
            while True:
                ev = await events.get()
                if "token" in ev:
                    text.append(ev["text"])
                else:
                    return "".join(text), ev

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(gone())
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if work not in done:                     # the client went away: stop generating for it
            work.cancel()
            self.loop.cancel(job)
            return Response(status_code=499)
        text, end = work.result()
        if "error" in end:
            return BadRequest(f"generation failed: {end['error']}", None, 500, "server_error").response()
        if end["done"] == "cancelled":
            return BadRequest("the server shut down before the request finished", None, 503,
                              "server_error").response()
        return JSONResponse(self._body(job, text, list(job.tokens), end["done"], usage=True))

    async def _stream(self, job: Job, events: asyncio.Queue) -> AsyncIterator[str]:
        finished = False
        try:
            while True:
                ev = await events.get()
                if "token" in ev:
                    yield f"data: {json.dumps(self._body(job, ev['text'], [ev['token']], None, usage=False))}\n\n"
                    continue
                finished = True
                if "error" in ev or ev.get("done") == "cancelled":
                    msg = ev.get("error") or "the server shut down before the request finished"
                    yield f"data: {json.dumps({'error': {'message': msg, 'type': 'server_error'}})}\n\n"
                else:
                    yield f"data: {json.dumps(self._body(job, '', [], ev['done'], usage=True))}\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:
            if not finished:                      # the client went away mid-stream
                self.loop.cancel(job)

    def app(self) -> Starlette:
        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            yield
            if self.on_shutdown is not None:     # uvicorn is shutting down (SIGTERM/SIGINT)
                await asyncio.get_running_loop().run_in_executor(None, self.on_shutdown)

        return Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], lifespan=lifespan)
