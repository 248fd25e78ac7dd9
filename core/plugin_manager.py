"""Loading plugins: built-ins, entry points, and explicitly registered objects.

Entry point groups `flare.backends` and `flare.models` name modules that
implement the hooks in `hookspecs`. A plugin that fails to import or whose
hook raises is recorded in `broken` and skipped; two plugins registering the
same backend or model name is a `PluginError` (it would be ambiguous which
one runs). `FLARE_DISABLE_PLUGIN_AUTOLOAD=1` loads only the built-ins.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import pluggy

from .errors import PluginError
from . import hookspecs
from .specs import BackendSpec, ModelSpec

hookimpl = pluggy.HookimplMarker("flare")
ENTRY_POINT_GROUPS = ("flare.backends", "flare.models")
BUILTIN_PLUGINS = ("flare.backends.cpu.plugin", "flare.lifecycle_plugin")


@dataclass(frozen=True)
class BrokenPlugin:
    name: str
    error: str


class PluginManager:
    """Flare's pluggy manager plus the collected, de-duplicated specs."""

    def __init__(self, autoload: bool | None = None):
        self.pm = pluggy.PluginManager("flare")
        self.pm.add_hookspecs(hookspecs)
        self.broken: list[BrokenPlugin] = []
        self._backends: dict[str, BackendSpec] | None = None
        self._models: dict[str, ModelSpec] | None = None
        for module in BUILTIN_PLUGINS:
            self.pm.register(importlib.import_module(module), name=module)
        if autoload is None:
            autoload = not os.environ.get("FLARE_DISABLE_PLUGIN_AUTOLOAD")
        if autoload:
            self._load_entry_points()

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def register(self, plugin: Any, name: str | None = None) -> None:
        """Register a plugin object (module or class instance) by hand."""
        self.pm.register(plugin, name=name)
        self._backends = self._models = None

    def _load_entry_points(self) -> None:
        for group in ENTRY_POINT_GROUPS:
            for ep in entry_points(group=group):
                if self.pm.has_plugin(ep.value) or self.pm.get_plugin(ep.name) is not None:
                    continue
                try:
                    plugin = ep.load()
                    self.pm.register(plugin, name=ep.value)
                except Exception as exc:  # a broken plugin must not break Flare
                    self.broken.append(BrokenPlugin(f"{group}:{ep.name}", f"{type(exc).__name__}: {exc}"))

    def _collect(self, hook_name: str, kind: type) -> dict[str, Any]:
        found: dict[str, Any] = {}
        owners: dict[str, str] = {}
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            try:
                specs = impl.function() or []
            except Exception as exc:
                self.broken.append(BrokenPlugin(impl.plugin_name, f"{type(exc).__name__}: {exc}"))
                continue
            for spec in specs:
                if not isinstance(spec, kind):
                    self.broken.append(BrokenPlugin(impl.plugin_name, f"{hook_name} returned {type(spec).__name__}, not {kind.__name__}"))
                    continue
                if spec.name in found:
                    raise PluginError(
                        f"{kind.__name__} name {spec.name!r} registered twice: by {owners[spec.name]} and by {impl.plugin_name}")
                found[spec.name] = spec
                owners[spec.name] = impl.plugin_name
        return found

    def backends(self) -> dict[str, BackendSpec]:
        """Registered backends by name (highest priority first)."""
        if self._backends is None:
            found = self._collect("flare_backends", BackendSpec)
            self._backends = dict(sorted(found.items(), key=lambda kv: -kv[1].priority))
        return self._backends

    def models(self) -> dict[str, ModelSpec]:
        if self._models is None:
            self._models = self._collect("flare_models", ModelSpec)
        return self._models


_MANAGER: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide manager (created on first use)."""
    global _MANAGER
    if _MANAGER is None:
        _MANAGER = PluginManager()
    return _MANAGER
