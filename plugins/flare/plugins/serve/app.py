"""The OpenAI-compatible HTTP API (Starlette): /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics, and the chat page at /.

Handlers never run the model: they read and check a request (`requests_api`),
hand a `Job` to the step loop's thread and await its events through an
asyncio queue (the loop thread posts with `call_soon_threadsafe`), so the
event loop never blocks on a step. A client that goes away cancels its job
(streaming: Starlette stops the body generator; plain: a task waits for
`http.disconnect`). Every refusal is an OpenAI-shaped error counted in
`flare_rejected_requests_total{status}`: 400 naming the field, 408 for a body
that stalls, 413 for one too large, 429 for a full queue, 503 while shutting
down, and 500 (one log line, no traceback) for anything unforeseen; nothing a
client sends can stop the loop.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from html import escape
from importlib import resources
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from flare.core.errors import FlareError

from .loop import Job, QueueFull, ServeLoop
from .requests_api import BadRequest, Limits, parse_chat, parse_completion, read_json

log = logging.getLogger("flare.serve")
SHUTDOWN = "the server shut down before the request finished"


class ClientGone(Exception):
    """The client left while its request was being read."""


class Api:
    """Routes over one step loop. `status()` feeds /metrics' live gauges and /health."""

    def __init__(self, loop: ServeLoop, *, model: str, tokenizer: Any = None, limits: Limits | None = None,
                 created: int | None = None, on_shutdown: Callable[[], None] | None = None):
        from flare.plugins.export.serving.tokenizer import ByteTokenizer

        self.loop = loop
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.limits = limits or Limits()
        self.created = created or int(time.time())
        self.on_shutdown = on_shutdown

    # -------------------------------------------------------------- routes
    async def page(self, request: Request) -> Response:
        html = resources.files("flare.plugins.serve").joinpath("static/chat.html").read_text("utf-8")
        return HTMLResponse(html.replace("{{MODEL}}", escape(self.model)))

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
        return await self._serve(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    # ------------------------------------------------------------- serving
    def _reject(self, exc: BadRequest) -> Response:
        self.loop.metrics.rejected.labels(str(exc.status)).inc()
        return exc.response()

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        try:
            try:
                body = await read_json(request, self.limits)
            except ClientDisconnect:
                raise ClientGone() from None
            parse = parse_chat if chat else parse_completion
            fields = parse(body, model=self.model, serving=self.loop.serving, tokenizer=self.tokenizer)
        except ClientGone:
            return Response(status_code=499)
        except BadRequest as exc:
            return self._reject(exc)
        except Exception as exc:  # noqa: BLE001 - a bug in checking must not become a traceback page
            log.error("flare serve: unexpected %s while reading a request: %s", type(exc).__name__, exc)
            return self._reject(BadRequest(f"internal error reading the request: {type(exc).__name__}", None, 500,
                                           "server_error"))
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        aloop = asyncio.get_running_loop()

        def sink(ev: dict[str, Any]) -> None:
            try:
                aloop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:        # the event loop is gone (shutdown): nobody is listening
                pass

        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        job = Job(rid, fields["prompt"], fields["max_tokens"], fields["params"], fields["stops"], sink,
                  end_ids=fields["end_ids"], decoder=self.tokenizer.decoder())
        try:
            self.loop.submit(job)
        except QueueFull as exc:
            return self._reject(BadRequest(str(exc), None, 429, "rate_limit_error"))
        except FlareError as exc:
            return self._reject(BadRequest(str(exc), None, 503, "server_error"))
        self.loop.metrics.prompt_tokens.inc(len(job.prompt))
        shape = _Chat(self, job) if chat else _Completion(self, job)
        if fields["stream"]:
            return StreamingResponse(self._stream(job, events, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._whole(request, job, events, shape)

    def usage(self, job: Job) -> dict[str, Any]:
        return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.tokens),
                "total_tokens": len(job.prompt) + len(job.tokens),
                "prompt_tokens_details": {"cached_tokens": job.cached_tokens}}

    async def _whole(self, request: Request, job: Job, events: asyncio.Queue, shape: "_Shape") -> Response:
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
        if end["done"] in ("cancelled", "shutdown"):
            return BadRequest(SHUTDOWN, None, 503, "server_error").response()
        return JSONResponse(shape.whole(text, end["done"]))

    async def _stream(self, job: Job, events: asyncio.Queue, shape: "_Shape") -> AsyncIterator[str]:
        finished = False
        try:
            first = shape.first()
            if first is not None:
                yield _sse(first)
            while True:
                ev = await events.get()
                if "token" in ev:
                    yield _sse(shape.delta(ev["text"], ev["token"]))
                    continue
                finished = True
                if "error" in ev or ev.get("done") in ("cancelled", "shutdown"):
                    msg = ev.get("error") or SHUTDOWN
                    yield _sse({"error": {"message": msg, "type": "server_error", "param": None,
                                          "code": 503 if "error" not in ev else 500}})
                else:
                    yield _sse(shape.last(ev["done"]))
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
            Route("/", self.page, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], lifespan=lifespan)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Shape:
    """The JSON of one endpoint's answers (whole, first/delta/last stream events)."""

    def __init__(self, api: Api, job: Job):
        self.api, self.job = api, job

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.job.id, "object": obj, "created": int(time.time()), "model": self.api.model}

    def first(self) -> dict[str, Any] | None:
        return None


class _Completion(_Shape):
    def _body(self, text: str, ids: list[int], finish: str | None, usage: bool) -> dict[str, Any]:
        out = {**self._head("text_completion"),
               "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": ids}]}
        if usage:
            out["usage"] = self.api.usage(self.job)
        return out

    def whole(self, text: str, finish: str) -> dict[str, Any]:
        return self._body(text, list(self.job.tokens), finish, True)

    def delta(self, text: str, token: int) -> dict[str, Any]:
        return self._body(text, [token], None, False)

    def last(self, finish: str) -> dict[str, Any]:
        return self._body("", [], finish, True)


class _Chat(_Shape):
    def whole(self, text: str, finish: str) -> dict[str, Any]:
        return {**self._head("chat.completion"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": finish, "token_ids": list(self.job.tokens)}],
                "usage": self.api.usage(self.job)}

    def _chunk(self, delta: dict[str, Any], ids: list[int], finish: str | None) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                             "token_ids": ids}]}

    def first(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""}, [], None)

    def delta(self, text: str, token: int) -> dict[str, Any]:
        return self._chunk({"content": text}, [token], None)

    def last(self, finish: str) -> dict[str, Any]:
        return {**self._chunk({}, [], finish), "usage": self.api.usage(self.job)}
