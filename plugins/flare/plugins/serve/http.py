"""uvicorn, hardened: a deadline for request headers, and a grace period that ends in answers.

- `timed_h11(seconds)`: uvicorn's h11 protocol with a header deadline. A
  connection must deliver a complete request head within `seconds` of opening
  (or of its previous response); one that stalls mid-headers, or opens and says
  nothing, is closed. (A stalled body is the app's to time out: `read_json`, 408.)
- `GracefulServer`: on SIGTERM/SIGINT uvicorn stops accepting and waits for
  open requests; `on_exit` is called at once, and the caller (`cli.serve`) arms
  a timer that drains the step loop when `--graceful-seconds` run out, so the
  requests still running get a 503 in JSON, or an error event and `[DONE]` on
  a stream, before uvicorn's own (later) deadline would cancel their tasks.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


def timed_h11(seconds: float) -> type[H11Protocol]:
    class TimedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(seconds, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():   # no complete head yet
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

    return TimedH11Protocol


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit
        self._told = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if not self._told:
            self._told = True
            self._on_exit()
