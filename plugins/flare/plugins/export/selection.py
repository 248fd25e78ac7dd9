"""Load-time selection: which programs of a catalog this process runs, and what they need.

Options come from the command line (`--mixed-prefill` / `--no-mixed-prefill`,
neither = the export's default) and the backend that will run the programs.
Selection is a pure function of (manifest, catalog, options), so every MPI
rank computes it on its own and the ranks compare digests instead of
trusting each other. What is not selected — programs, and every kernel and
tuning entry only they used — is simply not carried into the loaded core.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from flare.core.errors import CoreFormatError

from .schema import DRAFT, MIXED, SPECULATIVE, VERIFY, Catalog, Manifest


class SelectionError(CoreFormatError):
    """The load options ask for something the core cannot give (names the option)."""


@dataclass(frozen=True)
class LoadOptions:
    """What the user chose at load time. `mixed_prefill=None` keeps the export's default;
    `speculative` True selects the draft and verify programs (None and False leave them out:
    only `flare serve --speculative K` decodes speculatively)."""

    mixed_prefill: bool | None = None
    backend: str | None = None
    speculative: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LoadOptions":
        mixed = data.get("mixed_prefill")
        backend = data.get("backend")
        spec = data.get("speculative")
        if mixed not in (None, True, False) or spec not in (None, True, False) or \
                not (backend is None or isinstance(backend, str)):
            raise CoreFormatError(f"malformed load options {dict(data)!r}", "options")
        return cls(mixed, backend, spec)


@dataclass(frozen=True)
class Selection:
    """The outcome: selected program names, and the kernels/tuning/weights they need (one backend)."""

    backend: str
    mixed: bool
    reason: str                               # why mixed programs are in or out
    programs: tuple[str, ...]
    kernels: tuple[str, ...]
    tuning: tuple[str, ...]
    weights: tuple[str, ...]
    excluded: dict[str, str] = field(default_factory=dict)   # program -> why
    pruned_kernels: dict[str, tuple[str, ...]] = field(default_factory=dict)
    pruned_tuning: tuple[str, ...] = ()
    speculative: bool = False                 # draft and verify programs selected

    def digest(self, manifest: Manifest) -> str:
        """sha256 of what was selected and of the files it comes from: equal digests on two ranks
        mean they run the same programs with the same kernels, tuning and weights."""
        files = {p: e.sha256 for p, e in sorted(manifest.files.items())}
        body = {"backend": self.backend, "mixed": self.mixed, "speculative": self.speculative, "programs": self.programs, "kernels": self.kernels,
                "tuning": self.tuning, "weights": self.weights, "files": files}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _no_mixed_reason(catalog: Catalog, backend: str, max_seqs: int) -> str:
    mixed = [p for p in catalog.programs if p.kind == MIXED]
    if not catalog.mixed_supported:
        return f"the core has no mixed programs: {catalog.mixed_reason or 'the model does not support them'}"
    if not mixed:
        return f"the core has no mixed programs ({catalog.mixed_reason or 'none were exported'})"
    off = [p.name for p in mixed if backend not in p.kernels]
    if off:
        return f"its mixed programs ({', '.join(off)}) were not exported for backend {backend!r}"
    return f"no mixed program fits the serving range (max_seqs {max_seqs})"


def _no_draft_reason(catalog: Catalog, backend: str) -> str:
    spec = catalog.speculative
    if not spec.supported:
        return f"the core has no draft program ({spec.reason or 'none was exported'})"
    for kind in (DRAFT, VERIFY):
        if not any(p.kind == kind and backend in p.kernels for p in catalog.programs):
            return f"its {kind} programs were not exported for backend {backend!r}"
    return "no draft program can run here"


def select(manifest: Manifest, catalog: Catalog, options: LoadOptions) -> Selection:
    """Apply `options` to the catalog. Raises SelectionError for an explicit `--mixed-prefill` that
    no eligible mixed program can honour, or a backend the core was not exported for."""
    backend = options.backend or catalog.backends[0]
    if backend not in catalog.backends:
        raise SelectionError(f"the core was exported for {', '.join(catalog.backends)}, not {backend!r} "
                             "(export again with --backends)", "options.backend")
    max_seqs = manifest.serving.max_seqs
    runnable = [p for p in catalog.programs if backend in p.kernels]
    eligible = [p for p in runnable if p.kind == MIXED and p.bucket.batch <= max_seqs]
    excluded: dict[str, str] = {p.name: f"not exported for {backend}" for p in catalog.programs if p not in runnable}
    if options.mixed_prefill is True and not eligible:
        raise SelectionError(f"--mixed-prefill was asked for, but {_no_mixed_reason(catalog, backend, max_seqs)}",
                             "options.mixed_prefill")
    want = manifest.mixed_prefill_default if options.mixed_prefill is None else options.mixed_prefill
    source = "the export's default" if options.mixed_prefill is None else (
        "--mixed-prefill" if options.mixed_prefill else "--no-mixed-prefill")
    if want and eligible:
        mixed, reason = True, f"mixed programs on ({source})"
    elif want:
        mixed, reason = False, f"mixed programs off: {_no_mixed_reason(catalog, backend, max_seqs)}"
    else:
        mixed, reason = False, f"mixed programs off ({source})"
    speculative = all(any(p.kind == k for p in runnable) for k in (DRAFT, VERIFY))
    if options.speculative is True and not speculative:
        raise SelectionError(f"--speculative was asked for, but {_no_draft_reason(catalog, backend)}",
                             "options.speculative")
    speculative = speculative and options.speculative is True
    selected = []
    for p in runnable:
        if p.kind == MIXED and not mixed:
            excluded[p.name] = "mixed programs disabled" if want is False else "mixed programs unavailable"
        elif p.kind in SPECULATIVE and not speculative:
            excluded[p.name] = "speculative decoding off"
        else:
            selected.append(p)
    kernels = sorted({k for p in selected for k in p.kernels[backend]})
    tuning = sorted({key for p in selected for key in p.tuning if catalog.tuning[key].backend == backend})
    weights = sorted({w for p in selected for w in p.weights})
    pruned_kernels = {b: tuple(sorted(k for k in table if b != backend or k not in kernels))
                      for b, table in catalog.kernels.items()}
    pruned_kernels = {b: ks for b, ks in pruned_kernels.items() if ks}
    pruned_tuning = tuple(sorted(k for k in catalog.tuning if k not in tuning))
    return Selection(backend, mixed, reason, tuple(p.name for p in selected), tuple(kernels), tuple(tuning),
                     tuple(weights), excluded, pruned_kernels, pruned_tuning, speculative)
