"""Tokenizer and chat template from a GGUF file's metadata, with well-kept libraries.

The BPE is Hugging Face `tokenizers`' (vocabulary `tokenizer.ggml.tokens`,
merges `tokenizer.ggml.merges`), behind the byte-level pre-tokenizer llama.cpp
picks for `tokenizer.ggml.pre`: `gpt2` is GPT-2's regex, `smollm` first splits
every digit on its own (llama.cpp's `\\p{N}` pass, Hugging Face's
`Digits(individual_digits=True)`). Tokens of type CONTROL/USER_DEFINED
(`tokenizer.ggml.token_type` 3 and 4: `<|im_start|>` ...) are matched whole in
the text, as llama.cpp does when it parses specials. No BPE is written here.

The chat template is the file's own Jinja (`tokenizer.chat_template`),
rendered in jinja2's sandbox the way `transformers`' `apply_chat_template`
does (`trim_blocks`, `lstrip_blocks`, `raise_exception`, `bos_token`,
`eos_token`, `add_generation_prompt`).
"""
from __future__ import annotations

from typing import Sequence

from .reader import GGUFError, GGUFFile

CONTROL, USER_DEFINED = 3, 4
PRE_TOKENIZERS = ("gpt2", "smollm", "llama-bpe", "default")


class GGUFTokenizer:
    """encode/decode text and render the chat template. Thread-safe for encode/decode
    (a `tokenizers.Tokenizer` may be shared); the template environment is read-only."""

    def __init__(self, f: GGUFFile):
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        kind = f.metadata("tokenizer.ggml.model")
        if kind != "gpt2":
            raise GGUFError(f"{f.path}: tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, "
                            f"a byte-level BPE)")
        pre = f.metadata("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise GGUFError(f"{f.path}: tokenizer.ggml.pre {pre!r} is not supported (supported: "
                            f"{', '.join(PRE_TOKENIZERS)})")
        tokens = f.metadata("tokenizer.ggml.tokens")
        merges = f.metadata("tokenizer.ggml.merges", [])
        types = f.metadata("tokenizer.ggml.token_type", [1] * len(tokens))
        if len(types) != len(tokens):
            raise GGUFError(f"{f.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = []
        for j, m in enumerate(merges):
            a, sep, b = m.partition(" ")
            if not sep:
                raise GGUFError(f"{f.path}: tokenizer.ggml.merges[{j}] {m!r} is not two tokens")
            pairs.append((a, b))
        try:
            tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, ignore_merges=False))
        except Exception as exc:  # tokenizers raises a bare Exception for a merge outside the vocabulary
            raise GGUFError(f"{f.path}: tokenizer.ggml.merges: {exc}") from None
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "llama-bpe":   # Llama 3's regex: digits in groups of up to three
            split = pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated")
            tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                          use_regex=False)])
        elif pre == "smollm":
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        specials = [t for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        self._tok = tok
        self.vocab_size = len(tokens)
        self.tokens = tokens
        self.special_ids = frozenset(vocab[t] for t in specials)
        self.bos = int(f.metadata("tokenizer.ggml.bos_token_id", 1))
        self.eos = int(f.metadata("tokenizer.ggml.eos_token_id", 2))
        self.add_bos = bool(f.metadata("tokenizer.ggml.add_bos_token", False))
        self.chat_template: str | None = f.metadata("tokenizer.chat_template", None)
        self._template = None

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text` (specials in the text are matched whole); BOS first when the file
        asks for it (`tokenizer.ggml.add_bos_token`) or `add_bos` says so."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos if add_bos is None else add_bos:
            ids = [self.bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def render_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages` ([{"role", "content"}]); GGUFError when the
        file has no template."""
        if self.chat_template is None:
            raise GGUFError("the GGUF file has no tokenizer.chat_template; use --no-chat")
        if self._template is None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise GGUFError(f"tokenizer.chat_template: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            try:
                self._template = env.from_string(self.chat_template)
            except TemplateError as exc:
                raise GGUFError(f"tokenizer.chat_template does not compile: {exc}") from None
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.tokens[self.bos], eos_token=self.tokens[self.eos])
        except TemplateError as exc:
            raise GGUFError(f"tokenizer.chat_template failed: {exc}") from None

    def chat_ids(self, prompt: str, system: str | None = None) -> list[int]:
        """Tokens of a one-turn chat: the template with the generation prompt, specials parsed."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.encode(self.render_chat(messages), add_bos=False)


# llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3 expression
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte -> the byte
    (the table `tokenizers`' ByteLevel decoder uses; written out because it exposes no lookup)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class _BytesDecoder:
    """Incremental ids -> text for one answer: each token's bytes through one UTF-8 decoder, so a
    character split over tokens comes out whole; special tokens have no text (as `decode`)."""

    def __init__(self, pieces: Sequence[bytes]):
        import codecs

        self._pieces = pieces
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        return self._dec.decode(self._pieces[token]) if 0 <= token < len(self._pieces) else ""

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class ServingTokenizer:
    """A GGUF file's tokenizer in the shape `flare serve` asks for
    (`flare.plugins.export.serving.tokenizer.Tokenizer`): completion prompts encoded as `flare run
    --no-chat` does, chat prompts as `flare run` does (`chat_ids`: the file's template, specials parsed),
    and the answer decoded token by token. Immutable after construction: shared by every request
    thread."""

    END_OF_TURN_NAMES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

    def __init__(self, tok: GGUFTokenizer, eot: int | None = None):
        self._tok = tok
        self.bos = tok.bos
        self.eos = tok.eos
        self.vocab_size = tok.vocab_size
        self.chat_template = tok.chat_template
        index = {t: i for i, t in enumerate(tok.tokens) if i in tok.special_ids}
        ends = {tok.eos, *(index[n] for n in self.END_OF_TURN_NAMES if n in index)}
        if eot is not None:
            ends.add(int(eot))
        self.end_of_turn = frozenset(ends)
        table = _byte_decoder()
        self._pieces = tuple(b"" if i in tok.special_ids else bytes(table.get(c, 0x3F) for c in t)
                             for i, t in enumerate(tok.tokens))

    def encode(self, text: str) -> list[int]:
        text.encode("utf-8")                 # UnicodeEncodeError for a lone surrogate, as the byte tokenizer
        return self._tok.encode(text)

    def decoder(self) -> _BytesDecoder:
        return _BytesDecoder(self._pieces)

    def chat_prompt(self, messages: Sequence[dict]) -> list[int] | None:
        if self.chat_template is None:
            return None
        from jinja2.exceptions import TemplateError

        try:
            text = self._tok.render_chat(messages)
        except GGUFError as exc:             # the template's raise_exception or a failed render
            raise TemplateError(str(exc)) from None
        return self._tok.encode(text, add_bos=False)
