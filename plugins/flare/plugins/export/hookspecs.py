"""Hooks `flare export` adds (through `flare_addhooks`): how a model becomes exportable."""
from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("flare")


@hookspec
def flare_export_adapters() -> list:
    """Return `flare.plugins.export.adapters.AdapterSpec`s, one per exportable model.

    The adapter says what the exporter needs beyond the `ModelSpec`: the model's
    configuration, serving range, programs per shape bucket and how to write its
    weights. Keep the hook cheap; the factory may import the model.
    """
