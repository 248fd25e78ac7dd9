"""Token ids to text with stop strings (the model's incremental decoder; token-lm/1 bytes by default).

Streaming must not send half a UTF-8 character nor the start of a stop string
that later completes, so `TextStream` decodes incrementally and holds back the
last `max(len(stop)) - 1` characters until they can no longer begin a stop.
"""
from __future__ import annotations

from typing import Sequence

from flare.plugins.export.serving.tokenizer import ByteTokenizer, Decoder

N_BYTES = 256


def detokenize(ids: Sequence[int]) -> str:
    return bytes(t for t in ids if 0 <= t < N_BYTES).decode("utf-8", "replace")


class TextStream:
    """Feed generated ids one at a time; get text safe to send, and whether a stop string appeared."""

    def __init__(self, stops: Sequence[str] = (), decoder: Decoder | None = None):
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._dec = decoder if decoder is not None else ByteTokenizer().decoder()
        self.text = ""        # all decoded text (up to the stop, once stopped)
        self.sent = 0         # characters of `text` handed out
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.text += self._dec.push(token)
        for s in self.stops:
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
                return self.flush()
        safe = max(self.sent, len(self.text) - self._hold)
        out, self.sent = self.text[self.sent: safe], safe
        return out

    def flush(self) -> str:
        """Everything not sent yet (at the end of a request)."""
        if not self.stopped:
            self.text += self._dec.flush()
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
