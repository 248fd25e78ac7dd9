"""Benchmark configurations: one TOML file names one way of serving a model.

```toml
name = "flare-cpu"            # optional; default: the file's stem
model = "silero-vad"          # a workload kind (silero-vad, minilm-l6, moe-lm)
backends = ["cpu"]            # devices in priority order, e.g. ["vulkan", "cpu"]
peer = "flare"                # flare | onnxruntime | numpy | torch (what the model offers)
threads = 2                   # optional: CPU threads of the runner (flare: the CPU device's `threads`;
                              # onnxruntime: intra-op threads; torch: torch.set_num_threads); default: its own
prepared = true               # false: build, prepare and release the graph for every request
workspace_sharing = true      # false: each entry point gets its own workspace (memory: sum, not max)

[options]                     # the model's own keys (see `flare bench --list-options`)
mode = "offline"
```

Every mistake is a `BenchConfigError` naming the file and the key; unknown keys
are errors (with a "did you mean"), never silently ignored, because a typo in
a benchmark configuration silently benchmarks the default.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .errors import BenchConfigError
from .workload import Option, Workload, get_workload

TOP_KEYS = ("name", "description", "model", "backends", "peer", "threads", "prepared", "workspace_sharing",
            "options")


@dataclass(frozen=True)
class BenchConfig:
    """A validated configuration; `options` has every model option (defaults filled in,
    paths resolved against the file's folder)."""

    name: str
    model: str
    backends: tuple[str, ...] = ("cpu",)
    peer: str = "flare"
    prepared: bool = True
    workspace_sharing: bool = True
    options: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""
    path: Path | None = None
    threads: int | None = None   # CPU threads of the runner; None: the runner's default

    def cpu_config(self) -> dict[str, dict[str, Any]]:
        """Session config for the flare peer: the CPU device's `threads` when set."""
        return {"cpu": {"threads": self.threads}} if self.threads is not None else {}

    def option(self, key: str) -> Any:
        return self.options[key]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path) if self.path else None, "model": self.model,
                "backends": list(self.backends), "peer": self.peer, "prepared": self.prepared,
                "workspace_sharing": self.workspace_sharing, "description": self.description,
                "threads": self.threads,
                "options": {k: list(v) if isinstance(v, tuple) else v for k, v in self.options.items()}}


def _toml():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError as exc:
            raise BenchConfigError("reading TOML on Python 3.10 needs the 'tomli' package (pip install tomli)") from exc
    return tomllib


def load_config(path: str | Path, *, known_backends: Iterable[str] | None = None) -> BenchConfig:
    """Read and validate one configuration file."""
    path = Path(path)
    if not path.is_file():
        raise BenchConfigError("no such configuration file" if not path.exists() else "not a file", path=path)
    tomllib = _toml()
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise BenchConfigError(f"not valid TOML: {exc}", path=path) from exc
    except OSError as exc:
        raise BenchConfigError(f"cannot read: {exc.strerror or exc}", path=path) from exc
    return parse_config(data, path=path, known_backends=known_backends)


def parse_config(data: Mapping[str, Any], *, path: Path | None = None, name: str | None = None,
                 known_backends: Iterable[str] | None = None) -> BenchConfig:
    """Validate a configuration given as a mapping (the parsed TOML)."""
    _reject_unknown(data, TOP_KEYS, path, prefix="")
    if "model" not in data:
        raise BenchConfigError("missing; say which model to run (e.g. model = \"silero-vad\")", path=path, key="model")
    model = _typed(data, "model", str, path)
    workload = get_workload(model, path=path)
    cfg_name = _typed(data, "name", str, path) if "name" in data else (name or (path.stem if path else model))
    peer = _typed(data, "peer", str, path) if "peer" in data else "flare"
    reason = workload.peer_unavailable(peer)
    if reason:
        raise BenchConfigError(reason, path=path, key="peer")
    backends = _backends(data, path, peer, known_backends)
    prepared = _typed(data, "prepared", bool, path) if "prepared" in data else True
    sharing = _typed(data, "workspace_sharing", bool, path) if "workspace_sharing" in data else True
    if peer != "flare" and (not prepared or not sharing):
        key = "prepared" if not prepared else "workspace_sharing"
        raise BenchConfigError(f"applies to the flare peer only (this configuration's peer is {peer!r})",
                               path=path, key=key)
    if not sharing and not workload.entries_separable:
        raise BenchConfigError(f"{model}'s entry points share state, so they cannot get separate workspaces",
                               path=path, key="workspace_sharing")
    raw_options = data.get("options", {})
    if not isinstance(raw_options, Mapping):
        raise BenchConfigError(f"must be a table ([options]), got {_tname(raw_options)}", path=path, key="options")
    threads = _threads(data, path)
    if threads is not None:
        peer_def = workload.peer(peer)
        if not (workload.threads_supported if peer == "flare" else bool(peer_def and peer_def.takes_threads)):
            raise BenchConfigError(f"the {peer!r} runner of {model} does not take a thread count; leave threads out",
                                   path=path, key="threads")
    if threads is not None and "threads" in workload.options:
        # the model's own `threads` option (its peers' thread count) follows the top-level key
        if "threads" in raw_options and raw_options["threads"] != threads:
            raise BenchConfigError(f"says {raw_options['threads']!r} but the top-level threads says {threads}; "
                                   "keep one", path=path, key="options.threads")
        raw_options = {**raw_options, "threads": threads}
    options = _options(workload, raw_options, path)
    config = BenchConfig(name=cfg_name, model=model, backends=backends, peer=peer, prepared=prepared,
                         workspace_sharing=sharing, options=options,
                         description=_typed(data, "description", str, path) if "description" in data else "",
                         path=path, threads=threads)
    workload.validate(config)
    return config


def check_pair(a: BenchConfig, b: BenchConfig) -> Workload:
    """A and B must run the same model on the same requests; returns the workload kind."""
    if a.model != b.model:
        raise BenchConfigError(f"A runs {a.model!r} but B ({b.path or b.name}) runs {b.model!r}; "
                               "a comparison needs one model", path=a.path, key="model")
    workload = get_workload(a.model)
    for key, opt in workload.options.items():
        if opt.shapes_requests and a.options[key] != b.options[key]:
            raise BenchConfigError(f"decides the requests, so A and B must agree: A has {a.options[key]!r}, "
                                   f"B ({b.path or b.name}) has {b.options[key]!r}", path=a.path, key=f"options.{key}")
    return workload


def check_usable(config: BenchConfig) -> None:
    """Every backend the configuration names can run here (its probe says so); otherwise a
    BenchConfigError naming the file, the key and the probe's reason. Checked before any run,
    so a comparison does not fail half-way."""
    if config.peer != "flare":
        return
    from flare.core.plugin_manager import get_plugin_manager

    specs = get_plugin_manager().backends()
    for dev in config.backends:
        backend = dev.partition(":")[0]
        probe = specs[backend].backend.probe() if backend in specs else None
        if probe is None or not probe.usable:
            reason = probe.reason if probe is not None else "not installed"
            raise BenchConfigError(f"backend {backend!r} cannot run here: {reason}", path=config.path, key="backends")


# -- helpers -------------------------------------------------------------------
def _tname(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)


def _reject_unknown(data: Mapping[str, Any], known: Sequence[str], path: Path | None, prefix: str) -> None:
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise BenchConfigError(f"unknown key{hint}; known keys: {', '.join(known)}", path=path,
                                   key=prefix + key)


def _typed(data: Mapping[str, Any], key: str, kind: type, path: Path | None, prefix: str = "") -> Any:
    value = data[key]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise BenchConfigError(f"must be {_tname(kind())}, got {_tname(value)} {value!r}", path=path,
                               key=prefix + key)
    return value


def _threads(data: Mapping[str, Any], path: Path | None) -> int | None:
    if "threads" not in data:
        return None
    value = _typed(data, "threads", int, path)
    if not 1 <= value <= 4096:
        raise BenchConfigError(f"must be between 1 and 4096, got {value}", path=path, key="threads")
    return value


def _backends(data: Mapping[str, Any], path: Path | None, peer: str,
              known_backends: Iterable[str] | None) -> tuple[str, ...]:
    if "backends" not in data:
        return ("cpu",)
    value = data["backends"]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise BenchConfigError(f"must be a non-empty list of device names like [\"vulkan\", \"cpu\"], got {value!r}",
                               path=path, key="backends")
    if known_backends is None:
        from flare.core.plugin_manager import get_plugin_manager

        known_backends = get_plugin_manager().backends()
    known = sorted(known_backends)
    for dev in value:
        backend, _, index = dev.partition(":")
        if backend not in known or (index and not index.isdigit()):
            raise BenchConfigError(f"unknown backend {dev!r}; installed backends: {', '.join(known) or 'none'} "
                                   "(a device may be named BACKEND:INDEX)", path=path, key="backends")
    if peer != "flare" and [v.partition(":")[0] for v in value] != ["cpu"]:
        raise BenchConfigError(f"the {peer!r} peer runs on the CPU only; leave backends out or say [\"cpu\"]",
                               path=path, key="backends")
    return tuple(value)


def _options(workload: Workload, raw: Mapping[str, Any], path: Path | None) -> dict[str, Any]:
    if workload.free_options:
        for key, value in raw.items():
            if not isinstance(value, (bool, int, float, str, list)):
                raise BenchConfigError(f"must be a number, text, boolean or list (a model option), got "
                                       f"{_tname(value)}", path=path, key=f"options.{key}")
        return dict(raw)
    _reject_unknown(raw, list(workload.options), path, prefix="options.")
    out: dict[str, Any] = {}
    for key, opt in workload.options.items():
        out[key] = _option(key, opt, raw[key], path) if key in raw else opt.default
    return out


def _option(key: str, opt: Option, value: Any, path: Path | None) -> Any:
    full = f"options.{key}"
    if opt.kind == "paths":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
            raise BenchConfigError(f"must be a file name or a list of file names, got {value!r}", path=path, key=full)
        resolved = []
        for item in items:
            if item in opt.keywords:
                resolved.append(item)
                continue
            file = Path(item).expanduser()
            if not file.is_absolute() and path is not None:
                file = path.parent / file
            if not file.is_file():
                raise BenchConfigError(f"file {str(file)!r} does not exist"
                                       + (f" (or use {', '.join(map(repr, opt.keywords))})" if opt.keywords else ""),
                                       path=path, key=full)
            resolved.append(str(file.resolve()))
        return tuple(resolved)
    value = _typed({key: value}, key, opt.kind, path, prefix="options.")
    if opt.choices is not None and value not in opt.choices:
        raise BenchConfigError(f"must be one of {', '.join(map(str, opt.choices))}, got {value!r}", path=path, key=full)
    if opt.minimum is not None and value < opt.minimum:
        raise BenchConfigError(f"must be at least {opt.minimum:g}, got {value!r}", path=path, key=full)
    return value
