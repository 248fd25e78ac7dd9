"""How a served core turns text into token ids and back, and chat messages into a prompt.

A core runs without its model plugin, but text and chat need the model's own
tokenizer and chat template. A model plugin supplies them through its export
adapter's spec (`AdapterSpec.tokenizer(core_dir, manifest)`, looked up by the
manifest's adapter name, see `tokenizer_for`); a model without one is served
with `ByteTokenizer` (the `token-lm/1` byte vocabulary) and no chat template.

`Tokenizer` is the small protocol a server needs; a GGUF-backed model
implements it with the `tokenizers` library and its GGUF chat template through
`render_chat` (jinja2's sandbox, as Hugging Face renders chat templates).
"""
from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

BYTE_BOS, BYTE_EOS = 256, 257      # token-lm/1: ids 0..255 are bytes, then <bos>, <eos>


class Decoder(Protocol):
    """Incremental ids -> text: never half a character; `flush` gives what is held at the end."""

    def push(self, token: int) -> str: ...
    def flush(self) -> str: ...


@runtime_checkable
class Tokenizer(Protocol):
    """What `flare serve` asks of a model's tokenizer."""

    end_of_turn: frozenset[int]          # ids that end an assistant's turn (generation stops there)

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids (with the model's <bos> if it uses one)."""

    def decoder(self) -> Decoder:
        """A fresh incremental decoder for one request's output."""

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int] | None:
        """The ids of `messages` rendered by the model's chat template, ready for the assistant's
        turn; None when the model has no chat template."""


def render_chat(template: str, messages: Sequence[Mapping[str, str]], **context: Any) -> str:
    """A Hugging Face style chat template rendered in jinja2's immutable sandbox (templates come with
    model files: they must not reach Python objects), `add_generation_prompt=True`."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=list(messages), add_generation_prompt=True, **context)


class _ByteDecoder:
    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        return self._dec.decode(bytes([token])) if 0 <= token < 256 else ""

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class ByteTokenizer:
    """`token-lm/1`: a prompt is <bos> then its UTF-8 bytes (as `flare run --prompt`); output ids
    below 256 are bytes, specials have no text. `chat_template` (jinja2) is optional."""

    def __init__(self, chat_template: str | None = None, bos: int = BYTE_BOS, eos: int = BYTE_EOS):
        self.chat_template = chat_template
        self.bos = bos
        self.end_of_turn = frozenset({eos})

    def encode(self, text: str) -> list[int]:
        return [self.bos, *text.encode("utf-8")]     # UnicodeEncodeError for a lone surrogate

    def decoder(self) -> Decoder:
        return _ByteDecoder()

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int] | None:
        if self.chat_template is None:
            return None
        return self.encode(render_chat(self.chat_template, messages))


def tokenizer_for(core_dir: str | Path, manifest: Any) -> Tokenizer:
    """The tokenizer the model plugin named by the manifest's adapter supplies; `ByteTokenizer`
    without a chat template when the plugin is not installed or supplies none."""
    from flare.core.plugin_manager import get_plugin_manager

    from flare.plugins.export.adapters import AdapterSpec

    try:
        specs = get_plugin_manager().collect("flare_export_adapters", AdapterSpec)
    except Exception:        # noqa: BLE001 - no export hooks registered: serve bytes
        specs = {}
    spec = specs.get(manifest.adapter)
    make = getattr(spec, "tokenizer", None)
    tok = make(Path(core_dir), manifest) if make is not None else None
    return tok if tok is not None else ByteTokenizer()
