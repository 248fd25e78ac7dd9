"""The core format: manifest.json and catalog.json as frozen dataclasses, parsed field by field.

A core directory holds:

    manifest.json        format + version, model name/config, serving range, defaults,
                         and the sha256 and size of every other file
    catalog.json         programs (name, kind, bucket, graph file, kernels per backend,
                         tuning entries, weights), the kernel table, the tuning entries
    weights.safetensors  every weight, by name
    programs/*.json      one serialized graph per program (flare.core.serialize)

Parsing checks types and ranges of every field and raises `CoreFormatError`
naming it (`catalog.programs[2].bucket.tokens`); cross-references between
the two files are checked by `flare.plugins.export.validate`. The `*_to_dict`
functions are the writer's side, so a written core always parses.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from flare.core.errors import CoreFormatError

FORMAT = "flare-core"
FORMAT_VERSION = 1
KINDS = ("prefill", "decode", "mixed", "draft", "verify")
MIXED = "mixed"
DRAFT = "draft"      # speculative decoding: the draft model, one token per sequence, logits of every token
VERIFY = "verify"    # speculative decoding: the full model on 1 + K tokens per sequence, logits of every token
SPECULATIVE = (DRAFT, VERIFY)
EVERY_ROW = ("decode", DRAFT, VERIFY)   # kinds without out_rows: a logit row per token
TUNING_MODES = ("quick", "audit")
CONTRACTS = ("token-lm/1",)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SHA_RE = re.compile(r"^[0-9a-f]{64}$")


# ----------------------------------------------------------------- checked access
def need_obj(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CoreFormatError(f"must be an object, got {type(value).__name__}", field)
    return value


def _get(d: Mapping[str, Any], key: str, field: str) -> Any:
    if key not in d:
        raise CoreFormatError("is missing", f"{field}.{key}")
    return d[key]


def need_str(d: Mapping[str, Any], key: str, field: str, pattern: re.Pattern | None = None,
             choices: tuple[str, ...] | None = None) -> str:
    v = _get(d, key, field)
    f = f"{field}.{key}"
    if not isinstance(v, str) or not v:
        raise CoreFormatError(f"must be a non-empty string, got {v!r}", f)
    if pattern is not None and not pattern.match(v):
        raise CoreFormatError(f"{v!r} does not match {pattern.pattern}", f)
    if choices is not None and v not in choices:
        raise CoreFormatError(f"must be one of {', '.join(choices)}, got {v!r}", f)
    return v


def need_int(d: Mapping[str, Any], key: str, field: str, lo: int | None = None, hi: int | None = None) -> int:
    v = _get(d, key, field)
    f = f"{field}.{key}"
    if not isinstance(v, int) or isinstance(v, bool):
        raise CoreFormatError(f"must be an integer, got {v!r}", f)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise CoreFormatError(f"{v} is outside {lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}", f)
    return v


def need_bool(d: Mapping[str, Any], key: str, field: str) -> bool:
    v = _get(d, key, field)
    if not isinstance(v, bool):
        raise CoreFormatError(f"must be true or false, got {v!r}", f"{field}.{key}")
    return v


def need_list(d: Mapping[str, Any], key: str, field: str) -> list[Any]:
    v = _get(d, key, field)
    if not isinstance(v, list):
        raise CoreFormatError(f"must be a list, got {type(v).__name__}", f"{field}.{key}")
    return v


def need_names(d: Mapping[str, Any], key: str, field: str, pattern: re.Pattern | None = None) -> tuple[str, ...]:
    """A list of unique non-empty strings."""
    items = need_list(d, key, field)
    seen: set[str] = set()
    for i, v in enumerate(items):
        f = f"{field}.{key}[{i}]"
        if not isinstance(v, str) or not v:
            raise CoreFormatError(f"must be a non-empty string, got {v!r}", f)
        if pattern is not None and not pattern.match(v):
            raise CoreFormatError(f"{v!r} does not match {pattern.pattern}", f)
        if v in seen:
            raise CoreFormatError(f"{v!r} is listed twice", f)
        seen.add(v)
    return tuple(items)


# --------------------------------------------------------------------- manifest
@dataclass(frozen=True)
class FileEntry:
    path: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Serving:
    """The range a server may ask of this core (contract `token-lm/1`: moe-lm's batch layout)."""

    contract: str
    max_seqs: int
    max_ctx: int
    max_prefill_tokens: int
    vocab: int
    pad: int
    eos: int
    never: tuple[int, ...] = ()   # tokens a sampler must never produce (<bos>, <pad>, ...)

    @property
    def kv_rows(self) -> int:
        return self.max_seqs * self.max_ctx + 1

    @property
    def scratch_row(self) -> int:
        return self.max_seqs * self.max_ctx


@dataclass(frozen=True)
class Manifest:
    format_version: int
    model: str
    adapter: str
    config: dict[str, Any]
    files: dict[str, FileEntry]
    catalog: str
    weights: str
    mixed_prefill_default: bool
    serving: Serving
    created: dict[str, Any] = field(default_factory=dict)


def parse_serving(value: Any, f: str) -> Serving:
    d = need_obj(value, f)
    contract = need_str(d, "contract", f, choices=CONTRACTS)
    max_seqs = need_int(d, "max_seqs", f, 1, 1 << 16)
    max_ctx = need_int(d, "max_ctx", f, 1, 1 << 24)
    max_prefill = need_int(d, "max_prefill_tokens", f, 1, 1 << 20)
    vocab = need_int(d, "vocab", f, 1, 1 << 24)
    pad = need_int(d, "pad", f, 0, vocab - 1)
    eos = need_int(d, "eos", f, 0, vocab - 1)
    if max_prefill > max_ctx:
        raise CoreFormatError(f"{max_prefill} exceeds max_ctx {max_ctx}", f"{f}.max_prefill_tokens")
    never = d.get("never", [])
    if not isinstance(never, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                              for t in never):
        raise CoreFormatError(f"must be a list of token ids below {vocab}", f"{f}.never")
    return Serving(contract, max_seqs, max_ctx, max_prefill, vocab, pad, eos, tuple(never))


def parse_manifest(data: Any) -> Manifest:
    f = "manifest"
    d = need_obj(data, f)
    fmt = d.get("format")
    if fmt != FORMAT:
        raise CoreFormatError(f"must be {FORMAT!r}, got {fmt!r} (not a Flare core?)", f"{f}.format")
    version = need_int(d, "format_version", f)
    if version != FORMAT_VERSION:
        raise CoreFormatError(f"this Flare reads version {FORMAT_VERSION}, the core is version {version}",
                              f"{f}.format_version")
    model = need_obj(_get(d, "model", f), f"{f}.model")
    name = need_str(model, "name", f"{f}.model")
    adapter = need_str(model, "adapter", f"{f}.model")
    config = need_obj(_get(model, "config", f"{f}.model"), f"{f}.model.config")
    files_raw = need_obj(_get(d, "files", f), f"{f}.files")
    files: dict[str, FileEntry] = {}
    for path, entry in files_raw.items():
        ff = f"{f}.files[{path!r}]"
        e = need_obj(entry, ff)
        sha = need_str(e, "sha256", ff, SHA_RE)
        size = need_int(e, "bytes", ff, 0)
        files[path] = FileEntry(path, sha, size)
    catalog = need_str(d, "catalog", f)
    weights = need_str(d, "weights", f)
    defaults = need_obj(_get(d, "defaults", f), f"{f}.defaults")
    mixed_default = need_bool(defaults, "mixed_prefill", f"{f}.defaults")
    serving = parse_serving(_get(d, "serving", f), f"{f}.serving")
    created = need_obj(d.get("created", {}), f"{f}.created")
    return Manifest(version, name, adapter, config, files, catalog, weights, mixed_default, serving, created)


def manifest_to_dict(m: Manifest) -> dict[str, Any]:
    s = m.serving
    return {
        "format": FORMAT, "format_version": m.format_version,
        "model": {"name": m.model, "adapter": m.adapter, "config": m.config},
        "files": {p: {"sha256": e.sha256, "bytes": e.bytes} for p, e in sorted(m.files.items())},
        "catalog": m.catalog, "weights": m.weights,
        "defaults": {"mixed_prefill": m.mixed_prefill_default},
        "serving": {"contract": s.contract, "max_seqs": s.max_seqs, "max_ctx": s.max_ctx,
                    "max_prefill_tokens": s.max_prefill_tokens, "vocab": s.vocab, "pad": s.pad, "eos": s.eos,
                    "never": list(s.never)},
        "created": m.created,
    }


# ---------------------------------------------------------------------- catalog
@dataclass(frozen=True)
class Bucket:
    """A program's fixed shape: `tokens` rows in the step, `batch` sequences (logit rows)."""

    tokens: int
    batch: int


@dataclass(frozen=True)
class Program:
    name: str
    kind: str
    bucket: Bucket
    graph: str
    kernels: dict[str, tuple[str, ...]]   # backend -> kernel names
    tuning: tuple[str, ...]               # tuning entry keys
    weights: tuple[str, ...]


@dataclass(frozen=True)
class Kernel:
    backend: str
    name: str
    variants: tuple[str, ...]
    default: str


@dataclass(frozen=True)
class TuningEntry:
    """The measured best variant of one kernel for one shape class (step tokens)."""

    key: str
    backend: str
    kernel: str
    tokens: int
    choice: str
    seconds: dict[str, float]   # variant -> best measured seconds (all shapes of the class)
    repeats: int


@dataclass(frozen=True)
class Speculative:
    """Whether the catalog holds draft and verify programs: the draft's layers (of the model's) and the
    most proposals one verify program of one sequence can check."""

    supported: bool
    reason: str
    draft_layers: int = 0
    max_draft: int = 0


@dataclass(frozen=True)
class Catalog:
    format_version: int
    backends: tuple[str, ...]
    programs: tuple[Program, ...]
    kernels: dict[str, dict[str, Kernel]]
    tuning_mode: str
    tuning: dict[str, TuningEntry]
    mixed_supported: bool
    mixed_reason: str
    speculative: "Speculative" = field(default_factory=lambda: Speculative(False, "not exported"))

    def program(self, name: str) -> Program:
        for p in self.programs:
            if p.name == name:
                return p
        raise KeyError(name)


def parse_program(value: Any, f: str) -> Program:
    d = need_obj(value, f)
    name = need_str(d, "name", f, NAME_RE)
    kind = need_str(d, "kind", f, choices=KINDS)
    b = need_obj(_get(d, "bucket", f), f"{f}.bucket")
    bucket = Bucket(need_int(b, "tokens", f"{f}.bucket", 1, 1 << 20), need_int(b, "batch", f"{f}.bucket", 1, 1 << 16))
    if bucket.batch > bucket.tokens:
        raise CoreFormatError(f"batch {bucket.batch} exceeds tokens {bucket.tokens}", f"{f}.bucket")
    if kind == "prefill" and bucket.batch != 1:
        raise CoreFormatError(f"a prefill program serves one sequence, batch is {bucket.batch}", f"{f}.bucket.batch")
    if kind in ("decode", DRAFT) and bucket.batch != bucket.tokens:
        raise CoreFormatError(f"a {kind} program has one token per sequence, tokens {bucket.tokens} != batch "
                              f"{bucket.batch}", f"{f}.bucket")
    if kind == MIXED and (bucket.batch < 2 or bucket.tokens <= bucket.batch):
        raise CoreFormatError("a mixed program holds a prefill chunk and at least one decode token: needs batch >= 2 "
                              f"and tokens > batch, got {bucket}", f"{f}.bucket")
    graph = need_str(d, "graph", f)
    kraw = need_obj(_get(d, "kernels", f), f"{f}.kernels")
    kernels = {backend: need_names(kraw, backend, f"{f}.kernels", NAME_RE) for backend in kraw}
    tuning = need_names(d, "tuning", f)
    weights = need_names(d, "weights", f)
    return Program(name, kind, bucket, graph, kernels, tuning, weights)


def parse_catalog(data: Any) -> Catalog:
    f = "catalog"
    d = need_obj(data, f)
    version = need_int(d, "format_version", f)
    if version != FORMAT_VERSION:
        raise CoreFormatError(f"this Flare reads version {FORMAT_VERSION}, the catalog is version {version}",
                              f"{f}.format_version")
    backends = need_names(d, "backends", f, NAME_RE)
    if not backends:
        raise CoreFormatError("must name at least one backend", f"{f}.backends")
    programs = tuple(parse_program(p, f"{f}.programs[{i}]") for i, p in enumerate(need_list(d, "programs", f)))
    if not programs:
        raise CoreFormatError("must hold at least one program", f"{f}.programs")
    seen: dict[str, int] = {}
    for i, p in enumerate(programs):
        if p.name in seen:
            raise CoreFormatError(f"program name {p.name!r} is used by programs[{seen[p.name]}] too",
                                  f"{f}.programs[{i}].name")
        seen[p.name] = i
    kraw = need_obj(_get(d, "kernels", f), f"{f}.kernels")
    kernels: dict[str, dict[str, Kernel]] = {}
    for backend, table in kraw.items():
        fb = f"{f}.kernels.{backend}"
        kernels[backend] = {}
        for kname, info in need_obj(table, fb).items():
            fk = f"{fb}.{kname}"
            if not NAME_RE.match(kname):
                raise CoreFormatError(f"kernel name {kname!r} does not match {NAME_RE.pattern}", fk)
            k = need_obj(info, fk)
            variants = need_names(k, "variants", fk, NAME_RE)
            if not variants:
                raise CoreFormatError("must list at least one variant", f"{fk}.variants")
            default = need_str(k, "default", fk, choices=variants)
            kernels[backend][kname] = Kernel(backend, kname, variants, default)
    t = need_obj(_get(d, "tuning", f), f"{f}.tuning")
    mode = need_str(t, "mode", f"{f}.tuning", choices=TUNING_MODES)
    tuning: dict[str, TuningEntry] = {}
    for key, entry in need_obj(_get(t, "entries", f"{f}.tuning"), f"{f}.tuning.entries").items():
        fe = f"{f}.tuning.entries[{key!r}]"
        e = need_obj(entry, fe)
        secs_raw = need_obj(_get(e, "seconds", fe), f"{fe}.seconds")
        secs: dict[str, float] = {}
        for variant, s in secs_raw.items():
            if not isinstance(s, (int, float)) or isinstance(s, bool) or not 0 <= s < 1e9:
                raise CoreFormatError(f"must be a non-negative number of seconds, got {s!r}", f"{fe}.seconds.{variant}")
            secs[variant] = float(s)
        tuning[key] = TuningEntry(key, need_str(e, "backend", fe), need_str(e, "kernel", fe),
                                  need_int(e, "tokens", fe, 1), need_str(e, "choice", fe), secs,
                                  need_int(e, "repeats", fe, 1))
    m = need_obj(_get(d, "mixed", f), f"{f}.mixed")
    supported = need_bool(m, "supported", f"{f}.mixed")
    reason = m.get("reason", "")
    if not isinstance(reason, str):
        raise CoreFormatError("must be a string", f"{f}.mixed.reason")
    return Catalog(version, backends, programs, kernels, mode, tuning, supported, reason, _parse_speculative(d, f))


def _parse_speculative(d: dict[str, Any], f: str) -> Speculative:
    """`catalog.speculative` (absent in cores written before speculative decoding: unsupported)."""
    if "speculative" not in d:
        return Speculative(False, "not exported")
    s = need_obj(d["speculative"], f"{f}.speculative")
    supported = need_bool(s, "supported", f"{f}.speculative")
    reason = s.get("reason", "")
    if not isinstance(reason, str):
        raise CoreFormatError("must be a string", f"{f}.speculative.reason")
    if not supported:
        return Speculative(False, reason)
    return Speculative(True, reason, need_int(s, "draft_layers", f"{f}.speculative", 1, 1 << 10),
                       need_int(s, "max_draft", f"{f}.speculative", 1, 64))


def program_to_dict(p: Program) -> dict[str, Any]:
    return {"name": p.name, "kind": p.kind, "bucket": {"tokens": p.bucket.tokens, "batch": p.bucket.batch},
            "graph": p.graph, "kernels": {b: list(k) for b, k in p.kernels.items()}, "tuning": list(p.tuning),
            "weights": list(p.weights)}


def catalog_to_dict(c: Catalog) -> dict[str, Any]:
    return {
        "format_version": c.format_version,
        "backends": list(c.backends),
        "programs": [program_to_dict(p) for p in c.programs],
        "kernels": {b: {k.name: {"variants": list(k.variants), "default": k.default} for k in t.values()}
                    for b, t in c.kernels.items()},
        "tuning": {"mode": c.tuning_mode,
                   "entries": {e.key: {"backend": e.backend, "kernel": e.kernel, "tokens": e.tokens,
                                       "choice": e.choice, "seconds": e.seconds, "repeats": e.repeats}
                               for e in c.tuning.values()}},
        "mixed": {"supported": c.mixed_supported, "reason": c.mixed_reason},
        "speculative": {"supported": c.speculative.supported, "reason": c.speculative.reason,
                        "draft_layers": c.speculative.draft_layers, "max_draft": c.speculative.max_draft},
    }
