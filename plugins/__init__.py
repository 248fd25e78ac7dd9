"""Flare's plugin layer (pluggy): hook specs, the frozen specs plugins return, the manager."""
from .specs import BackendSpec, ModelSpec
from .manager import PluginManager, get_plugin_manager, hookimpl

__all__ = ["BackendSpec", "ModelSpec", "PluginManager", "get_plugin_manager", "hookimpl"]
