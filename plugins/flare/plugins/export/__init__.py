"""Exported cores: `flare export MODEL -o NAME.core` writes one, `flare run NAME.core` loads it.

A core is a directory (manifest, catalog of captured programs, weights in
safetensors, one serialized graph per program). `export_core` writes it
atomically; `load_core` validates it field by field, applies load options
(mixed prefill on/off) and prunes what the selection does not use;
`CoreRuntime` prepares the selected programs on devices.
"""
from .exporter import cached_core, export_core
from .loader import LoadedCore, load_core, read_manifest
from .selection import LoadOptions, Selection, SelectionError

__all__ = ["LoadOptions", "LoadedCore", "Selection", "SelectionError", "cached_core", "export_core", "load_core", "read_manifest"]
