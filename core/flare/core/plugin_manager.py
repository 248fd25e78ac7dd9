"""Loading plugins: entry points, and objects registered by hand.

Entry point groups name modules that implement the hooks in `flare.core.hookspecs`:
`flare.backends` (device plugins, the built-in CPU backend included),
`flare.models` (model plugins) and `flare.plugins` (application plugins:
bench, export and serving). A plugin that fails to import or whose
registration hook raises is recorded in `broken` and skipped; two plugins
registering the same backend, model or command name is a `PluginError` (it
would be ambiguous which one runs), and so is a hookimpl that no loaded
plugin declares (a misspelled `flare_model` must not register silently).
`FLARE_DISABLE_PLUGIN_AUTOLOAD=1` loads only the plugins of Flare's own
distribution.
"""
from __future__ import annotations

import difflib
import os
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Sequence

import pluggy

from . import hookspecs
from .errors import ModelError, PluginError, UnknownModelError
from .specs import BackendSpec, CommandSpec, ModelSpec

hookimpl = pluggy.HookimplMarker("flare")
ENTRY_POINT_GROUPS = ("flare.backends", "flare.models", "flare.plugins")
OWN_DISTRIBUTION = "flare-runtime"


@dataclass(frozen=True)
class BrokenPlugin:
    name: str
    error: str


class PluginManager:
    """Flare's pluggy manager plus the collected, de-duplicated specs."""

    def __init__(self, autoload: bool | None = None, groups: Sequence[str] = ENTRY_POINT_GROUPS):
        """`autoload`: also load other distributions' plugins (default: unless
        FLARE_DISABLE_PLUGIN_AUTOLOAD is set). `groups`: the entry point groups to load
        (tests pass `("flare.backends",)` for a manager with devices and nothing else)."""
        self.pm = pluggy.PluginManager("flare")
        self.pm.add_hookspecs(hookspecs)
        self.broken: list[BrokenPlugin] = []
        self._backends: dict[str, BackendSpec] | None = None
        self._models: dict[str, ModelSpec] | None = None
        self._commands: dict[str, CommandSpec] | None = None
        if autoload is None:
            autoload = not os.environ.get("FLARE_DISABLE_PLUGIN_AUTOLOAD")
        self._load_entry_points(groups, own_only=not autoload)
        self.pm.hook.flare_addhooks.call_historic(kwargs={"pluginmanager": self.pm})
        self.check_pending()

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def register(self, plugin: Any, name: str | None = None) -> None:
        """Register a plugin object (module or class instance) by hand; checked like entry points."""
        self.pm.register(plugin, name=name)
        self._backends = self._models = self._commands = None
        try:
            self.check_pending()
        except PluginError:
            self.pm.unregister(plugin)
            raise

    def check_pending(self) -> None:
        """Every hookimpl must match a declared hook: raise PluginError naming plugin and hook."""
        declared = [n for n in dir(self.pm.hook) if n.startswith("flare_")]
        for name in declared:
            caller = getattr(self.pm.hook, name)
            if caller.spec is not None:
                continue
            for impl in caller.get_hookimpls():
                if impl.optionalhook:
                    continue
                near = difflib.get_close_matches(name, [n for n in declared if getattr(self.pm.hook, n).spec], 1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise PluginError(f"plugin {impl.plugin_name!r} implements unknown hook {name!r}{hint}")

    def _load_entry_points(self, groups: Sequence[str], own_only: bool) -> None:
        for group in groups:
            for ep in entry_points(group=group):
                dist = getattr(ep, "dist", None)
                if own_only and (dist is None or dist.name != OWN_DISTRIBUTION):
                    continue
                if self.pm.has_plugin(ep.value) or self.pm.get_plugin(ep.value) is not None:
                    continue
                try:
                    plugin = ep.load()
                    self.pm.register(plugin, name=ep.value)
                except Exception as exc:  # a broken plugin must not break Flare
                    self.broken.append(BrokenPlugin(f"{group}:{ep.name}", f"{type(exc).__name__}: {exc}"))

    def collect(self, hook_name: str, kind: type) -> dict[str, Any]:
        """Call a registration hook and gather its specs by `.name`: a spec of the wrong
        type or a hook that raises marks the plugin broken; a duplicate name is a PluginError.
        Application plugins use it for the registration hooks they declare."""
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
            found = self.collect("flare_backends", BackendSpec)
            self._backends = dict(sorted(found.items(), key=lambda kv: -kv[1].priority))
        return self._backends

    def models(self) -> dict[str, ModelSpec]:
        if self._models is None:
            self._models = self.collect("flare_models", ModelSpec)
        return self._models

    def model(self, name: str) -> ModelSpec:
        """The registered model `name`; ModelError naming the registered ones otherwise."""
        models = self.models()
        if name not in models:
            raise UnknownModelError(f"unknown model {name!r}; registered: {', '.join(sorted(models)) or 'none'} "
                             "(see `flare models`)")
        return models[name]

    def commands(self) -> dict[str, CommandSpec]:
        """`flare` subcommands added by plugins, by name."""
        if self._commands is None:
            self._commands = self.collect("flare_cli_commands", CommandSpec)
        return self._commands


_MANAGER: PluginManager | None = None
_MANAGER_LOCK = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide manager (created on first use; safe to call from several threads)."""
    global _MANAGER
    with _MANAGER_LOCK:
        if _MANAGER is None:
            _MANAGER = PluginManager()
        return _MANAGER
